"""ComposerReplicationTrainer on a tiny Qwen2: invariants against a stock GRPOTrainer.

Each run trains a few optimizer steps of a 2-layer, hidden-64 model on the string-reversal
task (no downloads). "Bit-identical" means ``torch.equal`` on every parameter.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import crf.composer.trainer as trainer_mod  # noqa: E402
from crf.composer import (  # noqa: E402
    ComposerConfig,
    ComposerReplicationTrainer,
    DiLoCoCallback,
    capture_hidden,
    char_tokenizer,
    save_tiny,
    tiny_qwen2,
)
from crf.composer.task import (  # noqa: E402
    HINT_TEMPLATE,
    make_examples,
    reverse_reward,
    task_alphabet,
)

TOK = char_tokenizer(task_alphabet("abcd"))
ROWS = make_examples(64, 0)
ON = dict(distill_alpha=0.5, replay_beta=0.5)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("composer-trainer"))


def dataset(drop: tuple[str, ...] = (), **replace: Any) -> Dataset:
    rows = [{**r, **replace} for r in ROWS]
    return Dataset.from_list(rows).remove_columns(list(drop))


def config_kwargs(out_dir: str, steps: int, **kw: Any) -> dict[str, Any]:
    base = dict(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        seed=0,
    )
    base.update(kw)
    return base


def train(
    out_dir: str,
    *,
    stock: bool = False,
    data: Dataset | None = None,
    steps: int = 3,
    grpo_beta: float = 0.0,
    callbacks: tuple = (),
    run: bool = True,
    rollout_func: Any = None,
    **kw: Any,
) -> tuple[Any, dict[str, torch.Tensor]]:
    model = tiny_qwen2(TOK, seed=0)
    if grpo_beta > 0:  # TRL reloads the reference from config._name_or_path
        save_tiny(model, TOK, f"{out_dir}/init-{'stock' if stock else 'composer'}")
    if stock:
        args = GRPOConfig(**config_kwargs(out_dir, steps, beta=grpo_beta, **kw))
        cls = GRPOTrainer
    else:
        kw.setdefault("distill_hint_template", HINT_TEMPLATE)
        args = ComposerConfig(**config_kwargs(out_dir, steps, beta=grpo_beta, **kw))
        cls = ComposerReplicationTrainer
    trainer = cls(
        model=model,
        reward_funcs=reverse_reward,
        args=args,
        train_dataset=dataset() if data is None else data,
        processing_class=TOK,
        callbacks=list(callbacks),
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)
    if run:
        trainer.train()
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_STOCK: dict[float, dict[str, torch.Tensor]] = {}


def stock_params(out_dir: str, grpo_beta: float = 0.0) -> dict[str, torch.Tensor]:
    if grpo_beta not in _STOCK:
        _STOCK[grpo_beta] = train(out_dir, stock=True, grpo_beta=grpo_beta)[1]
    return _STOCK[grpo_beta]


def logged(trainer: Any, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


# --------------------------------------------------------------------------- logits
def test_student_logits_reproduce_trl_logprobs(out_dir: str) -> None:
    trainer, _ = train(out_dir, steps=1, temperature=0.7, **ON)
    batch = trainer._buffered_inputs[0]
    hf = trainer._hf_model()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    k = batch["completion_ids"].size(1)
    with torch.no_grad(), capture_hidden(hf.base_model) as store:
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, k)
    assert len(store) == 1  # one forward: the hook rides along TRL's own pass
    logits = trainer._logits_from_hidden(hf, store[0][:, -k - 1 : -1])
    ours = torch.log_softmax(logits / trainer.temperature, -1)
    ours = ours.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    m = batch["completion_mask"].bool()
    torch.testing.assert_close(ours[m], trl_logps[m], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- bit-exactness
@pytest.mark.parametrize("grpo_beta", [0.0, 0.04])
def test_zero_weights_are_bit_identical_to_stock_grpo(out_dir: str, grpo_beta: float) -> None:
    _, params = train(out_dir, grpo_beta=grpo_beta, distill_alpha=0.0, replay_beta=0.0)
    assert same(params, stock_params(out_dir, grpo_beta))


def test_alpha_zero_skips_distill_bit_exactly(out_dir: str) -> None:
    # alpha = 0 with hints present == alpha > 0 on data without hints; both differ from stock
    _, a = train(out_dir, distill_alpha=0.0, replay_beta=0.5)
    _, b = train(out_dir, data=dataset(drop=("hint",)), **ON)
    assert same(a, b)
    assert not same(a, stock_params(out_dir))


def test_beta_zero_skips_replay_bit_exactly(out_dir: str) -> None:
    _, a = train(out_dir, distill_alpha=0.5, replay_beta=0.0)
    _, b = train(out_dir, data=dataset(drop=("trace",)), **ON)
    assert same(a, b)
    assert not same(a, stock_params(out_dir))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(lambda: dataset(drop=("hint", "trace")), id="columns-absent"),
        pytest.param(lambda: dataset(hint=None, trace=""), id="columns-empty"),
    ],
)
def test_batch_without_channel_inputs_is_bit_identical_to_stock(out_dir: str, data) -> None:
    trainer, params = train(out_dir, data=data(), **ON)
    assert same(params, stock_params(out_dir))
    assert not logged(trainer, "distill_loss") and not logged(trainer, "replay_loss")
    assert len(logged(trainer, "grpo_loss")) == 3


def test_trainer_requires_a_composer_config(out_dir: str) -> None:
    with pytest.raises(TypeError, match="ComposerConfig"):
        ComposerReplicationTrainer(
            model=tiny_qwen2(TOK),
            reward_funcs=reverse_reward,
            args=GRPOConfig(**config_kwargs(out_dir, 1)),
            train_dataset=dataset(),
            processing_class=TOK,
        )


# --------------------------------------------------------------------------- TAID
def test_taid_without_schedule_step_raises_at_first_step(out_dir: str) -> None:
    trainer, _ = train(out_dir, run=False, distill_alpha=0.5, distill_wrapper="taid")
    assert trainer.taid_t is None
    with pytest.raises(ValueError, match="TAID needs an interpolation value t"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_taid_manual_t(out_dir: str) -> None:
    trainer, _ = train(out_dir, run=False, distill_alpha=0.5, distill_wrapper="taid")
    trainer.set_taid_t(0.3)
    trainer.train()
    assert logged(trainer, "taid_t") == [0.3, 0.3, 0.3]
    with pytest.raises(ValueError):
        trainer.set_taid_t(2.0)


@pytest.mark.parametrize(
    "wrapper_kw",
    [
        pytest.param(dict(distill_wrapper="taid", taid_schedule="linear"), id="taid-linear"),
        pytest.param(
            dict(distill_wrapper="taid", taid_schedule="adaptive", taid_step_size=0.2),
            id="taid-adaptive",
        ),
        pytest.param(dict(distill_wrapper="entropy_opd", opd_entropy_threshold=0.5), id="eopd"),
        pytest.param(dict(distill_clip=0.01, distill_jsd_beta=0.0), id="fkl-clip"),
    ],
)
def test_distill_wrappers_train(out_dir: str, wrapper_kw: dict) -> None:
    trainer, _ = train(out_dir, steps=4, distill_alpha=0.5, **wrapper_kw)
    losses = logged(trainer, "distill_loss")
    assert len(losses) == 4 and all(math.isfinite(x) and x >= 0 for x in losses)
    if wrapper_kw.get("taid_schedule"):
        ts = logged(trainer, "taid_t")
        assert ts[0] == pytest.approx(0.4) and all(b >= a for a, b in zip(ts, ts[1:], strict=False))
        if wrapper_kw["taid_schedule"] == "linear":
            assert ts == pytest.approx([0.4, 0.55, 0.7, 0.85])
    if "distill_clip" in wrapper_kw:
        assert max(losses) <= 0.01 + 1e-7


# --------------------------------------------------------------------------- replay
def test_dpo_at_initialisation_logs_ln2(out_dir: str) -> None:
    trainer, _ = train(out_dir, steps=1, replay_beta=1.0, replay_loss="dpo")
    (first,) = logged(trainer, "replay_loss")
    assert first == pytest.approx(math.log(2.0), abs=1e-6)


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def tool_rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """A TRL ``rollout_func`` giving tool-calling rollouts: the model writes two tokens, a tool
    answers with two (``env_mask`` 0, which TRL turns into its tool mask), the model writes one
    more and ends. The first token varies with the row, so rewards differ."""
    completions = [_ids("abcd"[i % 4] + "b") + _ids("dc") + _ids("a") for i in range(len(prompts))]
    return {
        "prompt_ids": [_ids(p) for p in prompts],
        "completion_ids": [c + [TOK.eos_token_id] for c in completions],
        "logprobs": None,
        "env_mask": [[1, 1, 0, 0, 1, 1] for _ in prompts],
    }


def test_dpo_with_tool_mask_logs_ln2_at_initialisation(out_dir: str) -> None:
    # Policy and reference must sum a rollout's log-probs over the same tokens (completion x
    # tool mask); the reference used to sum over the tool result too (1.37 logged, not ln 2).
    trainer, _ = train(
        out_dir, steps=1, replay_beta=1.0, replay_loss="dpo", rollout_func=tool_rollout
    )
    batch = trainer._buffered_inputs[0]
    assert "tool_mask" in batch and not batch["tool_mask"].bool().all()
    (first,) = logged(trainer, "replay_loss")
    assert first == pytest.approx(math.log(2.0), abs=1e-6)


def test_simpo_replay_trains(out_dir: str) -> None:
    trainer, params = train(out_dir, replay_beta=1.0, replay_loss="simpo")
    assert len(logged(trainer, "replay_loss")) == 3
    assert not same(params, stock_params(out_dir))


# --------------------------------------------------------------------------- logging
def test_every_channel_is_logged_every_step(out_dir: str) -> None:
    cb = DiLoCoCallback(None)
    trainer, _ = train(out_dir, steps=4, callbacks=(cb,), **ON)
    for key in ("grpo_loss", "distill_loss", "replay_loss", "reward", "loss"):
        assert len(logged(trainer, key)) == 4, key
    assert [h["step"] for h in cb.history] == [1.0, 2.0, 3.0, 4.0]
    assert all(
        {"loss", "reward", "grpo_loss", "distill_loss", "replay_loss"} <= set(h) for h in cb.history
    )
    # TRL's `loss` is the composed total
    h = trainer.state.log_history[0]
    total = h["grpo_loss"] + 0.5 * h["distill_loss"] + 0.5 * h["replay_loss"]
    assert h["loss"] == pytest.approx(total, rel=1e-4, abs=1e-6)


# --------------------------------------------------------------------------- truncation
def truncating_rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Rollouts ending with eos, except for prompts starting with "a" or "b": those stop
    without eos, which TRL calls truncated (and, with mask_truncated_completions, masks)."""
    completions = []
    for i, p in enumerate(prompts):
        ids = _ids("abcd"[i % 4] + "ba"[i % 2])
        completions.append(ids if p[0] in "ab" else ids + [TOK.eos_token_id])
    return {
        "prompt_ids": [_ids(p) for p in prompts],
        "completion_ids": completions,
        "logprobs": None,
    }


def test_fully_masked_rollouts_take_no_part_in_distill_or_replay(out_dir: str) -> None:
    # A truncated rollout masked whole must count exactly as a row without hint and trace (it
    # used to be a distill row of value 0 and a replay pair with rejected log-prob 0).
    rows = make_examples(64, 0, min_len=3, max_len=3)  # equal lengths: equal padding below
    kept = [{**r, "hint": None, "trace": ""} if r["prompt"][0] in "ab" else r for r in rows]
    common = dict(
        steps=2,
        rollout_func=truncating_rollout,
        mask_truncated_completions=True,
        replay_loss="simpo",
        **ON,
    )
    masked, p_masked = train(out_dir, data=Dataset.from_list(rows), **common)
    absent, p_absent = train(out_dir, data=Dataset.from_list(kept), **common)
    clipped = logged(masked, "completions/clipped_ratio")
    assert any(0 < c < 1 for c in clipped), clipped  # a step with rows masked whole and not
    for key in ("distill_loss", "replay_loss"):
        assert logged(absent, key), key
        assert logged(masked, key) == pytest.approx(logged(absent, key), rel=1e-6, abs=1e-7), key
    assert same(p_masked, p_absent)


# --------------------------------------------------------------------------- loss scale
class ComposeRecorder:
    """Wraps the trainer module's compose_loss and records every call (with the optimizer
    step it belongs to once ``trainer`` is set)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[dict[str, Any]] = []
        self.trainer: Any = None

    def __call__(self, grpo, **kw):
        out = self.fn(grpo, **kw)
        step = None if self.trainer is None else self.trainer.state.global_step
        self.calls.append(
            dict(grpo=grpo.detach(), total=out.total.detach(), out=out, step=step, **kw)
        )
        return out


@pytest.fixture()
def recorder(monkeypatch: pytest.MonkeyPatch) -> ComposeRecorder:
    rec = ComposeRecorder(trainer_mod.compose_loss)
    monkeypatch.setattr(trainer_mod, "compose_loss", rec)
    return rec


def _check_scales(calls: list[dict[str, Any]], accum: int) -> None:
    assert len(calls) % accum == 0
    for w in range(0, len(calls), accum):
        window = calls[w : w + accum]
        for ch in ("distill", "replay"):
            scales = [float(c[f"{ch}_scale"]) for c in window if c[ch] is not None]
            if scales:  # the channel's micro-batch scales add up to 1, like TRL's 1/GA
                assert sum(scales) == pytest.approx(1.0)
        for c in window:
            want = c["grpo"].double()
            if c["distill"] is not None:
                want = want + c["alpha"] * c["distill"].double() * float(c["distill_scale"])
            if c["replay"] is not None:
                want = want + c["beta"] * c["replay"].double() * float(c["replay_scale"])
            assert c["total"].dtype == torch.float32
            assert c["total"].double().item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
            assert c["out"].grpo_loss == pytest.approx(c["grpo"].item() * accum, rel=1e-6)


def test_gradient_accumulation_keeps_trl_loss_scale(out_dir: str, recorder) -> None:
    common = dict(steps=1, optim="sgd", max_grad_norm=0.0, **ON)
    init = {k: v.clone() for k, v in tiny_qwen2(TOK, seed=0).state_dict().items()}
    t1, full = train(
        out_dir, gradient_accumulation_steps=1, per_device_train_batch_size=8, **common
    )
    _check_scales(recorder.calls, 1)
    recorder.calls.clear()
    t2, accum = train(
        out_dir, gradient_accumulation_steps=2, per_device_train_batch_size=4, **common
    )
    _check_scales(recorder.calls, 2)
    assert len(recorder.calls) == 2
    num = sum(((full[k] - accum[k]).double() ** 2).sum() for k in init) ** 0.5
    den = sum(((full[k] - init[k]).double() ** 2).sum() for k in init) ** 0.5
    assert den > 0 and num / den < 1e-5  # same update, whether accumulated or not
    for key in ("loss", "grpo_loss", "distill_loss", "replay_loss"):
        assert logged(t1, key)[0] == pytest.approx(logged(t2, key)[0], rel=1e-5, abs=1e-7), key


def one_right_rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """The first row of each generation batch is the right answer but stops without eos:
    reward 1 (so ``replay_reward_threshold=1.0`` leaves it out of replay) and truncated (so
    ``mask_truncated_completions`` masks it whole and it leaves distillation too). The other
    rows are wrong. 7 channel rows cannot split evenly over two micro-batches of 4."""
    completions = [
        _ids(p[:-1][::-1]) if i % 8 == 0 else _ids("abcd"[i % 4] + "=") + [TOK.eos_token_id]
        for i, p in enumerate(prompts)
    ]
    return {
        "prompt_ids": [_ids(p) for p in prompts],
        "completion_ids": completions,
        "logprobs": None,
    }


def test_accumulated_step_logs_and_feeds_taid_the_row_weighted_mean(out_dir: str, recorder) -> None:
    # The micro-batches of every step hold 3 and 4 channel rows; the step's value is the mean
    # over its 7 rows (as the loss weighs them), not the mean of the two micro-batch means.
    trainer, _ = train(
        out_dir,
        run=False,
        steps=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        rollout_func=one_right_rollout,
        mask_truncated_completions=True,
        replay_reward_threshold=1.0,
        replay_loss="simpo",
        distill_wrapper="taid",
        taid_schedule="adaptive",
        **ON,
    )
    fed: list[float] = []
    schedule_step = trainer._taid_schedule.step

    def spy(loss: float, *args: Any) -> float:
        fed.append(loss)
        return schedule_step(loss, *args)

    trainer._taid_schedule.step = spy
    recorder.trainer = trainer
    trainer.train()
    for ch in ("replay", "distill"):
        want = []
        for step in range(3):
            parts = [
                (float(c[ch]), float(c[f"{ch}_scale"]))
                for c in recorder.calls
                if c["step"] == step and c[ch] is not None
            ]  # scale = rows here / rows in the step
            assert len(parts) == 2 and parts[0][1] != parts[1][1], (ch, parts)  # 3 and 4 rows
            want.append(sum(v * s for v, s in parts) / sum(s for _, s in parts))
        assert logged(trainer, f"{ch}_loss") == pytest.approx(want, rel=1e-6, abs=1e-7), ch
    assert fed == pytest.approx(logged(trainer, "distill_loss"), rel=1e-6, abs=1e-7)
    for h in trainer.state.log_history[:3]:  # the total is what the channels' values make
        total = h["grpo_loss"] + 0.5 * h["distill_loss"] + 0.5 * h["replay_loss"]
        assert h["loss"] == pytest.approx(total, rel=1e-4, abs=1e-6)


def test_mixed_precision_keeps_trl_loss_scale(out_dir: str, recorder) -> None:
    t32, _ = train(
        out_dir, steps=1, gradient_accumulation_steps=2, per_device_train_batch_size=4, **ON
    )
    recorder.calls.clear()
    t16, _ = train(
        out_dir,
        steps=1,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        bf16=True,
        **ON,
    )
    assert t16.accelerator.mixed_precision == "bf16"
    _check_scales(recorder.calls, 2)
    for key in ("loss", "grpo_loss", "distill_loss", "replay_loss"):
        a, b = logged(t32, key)[0], logged(t16, key)[0]
        assert b == pytest.approx(a, rel=5e-2, abs=5e-3), key


# --------------------------------------------------------------------------- standalone
def test_trainer_alone_without_diloco(out_dir: str) -> None:
    cb = DiLoCoCallback(None)  # no ctx: no DiLoCo, just per-step history
    init = {k: v.clone() for k, v in tiny_qwen2(TOK, seed=0).state_dict().items()}
    trainer, params = train(out_dir, steps=5, callbacks=(cb,), replay_loss="dpo", **ON)
    assert trainer.state.global_step == 5 and len(cb.history) == 5
    assert not same(params, init)
    assert all(math.isfinite(h["loss"]) for h in cb.history)
