"""The ``composer`` replica job and the bring-your-own-model example.

A ``FakeContext`` with ReplicaContext's surface stands in for the runtime (its ``diloco()``
only records what it was given and yields); two tests also run the real ``ReplicaContext``
with one replica over a ``file://`` store, so DiLoCo's hooks fire for real.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from crf.replica.jobs import get_job, job_config

ROOT = Path(__file__).resolve().parents[1]


class FakeContext:
    """ReplicaContext's surface; ``diloco()`` yields without syncing."""

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        sync_every: int = 10,
        rounds: int = 6,
        job_config: dict | None = None,
    ) -> None:
        self.spec = SimpleNamespace(
            sync_every=sync_every,
            rounds=rounds,
            total_steps=sync_every * rounds,
            seed=seed,
            job_config=job_config or {},
        )
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.data_seed = seed * 1_000_003 + rank + 1
        self.total_steps = sync_every * rounds
        self.step = 0
        self.logged: list[dict[str, Any]] = []
        self.diloco_calls: list[tuple[Any, Any]] = []
        self.inside = False
        self.exits = 0
        self.finished: dict | None = None

    @contextlib.contextmanager
    def diloco(self, model: Any, inner_optimizer: Any):
        self.diloco_calls.append((model, inner_optimizer))
        self.inside = True
        try:
            yield None
        finally:
            self.inside = False
            self.exits += 1

    def log_step(self, loss: float | None = None, **metrics: float) -> None:
        assert self.inside, "log_step outside ctx.diloco()"
        self.step += 1
        self.logged.append({"loss": loss, **metrics})

    def finish(self, metrics: dict) -> None:
        self.finished = metrics


# --------------------------------------------------------------------------- config
def test_job_is_registered_and_config_coerces_cli_strings() -> None:
    job = get_job("composer")
    assert hasattr(job, "Config") and hasattr(job, "run")
    cfg = job_config("composer", {"distill_alpha": "0.2", "replay_loss": "dpo", "taid_t": "-1"})
    assert cfg.distill_alpha == 0.2 and cfg.replay_loss == "dpo"
    job_config("composer", {})  # defaults validate


@pytest.mark.parametrize(
    "values, match",
    [
        ({"replay_loss": "ipo"}, "replay_loss 'ipo' is unknown"),
        ({"distill_wrapper": "kd"}, "distill_wrapper 'kd' is unknown"),
        ({"distill_wrapper": "taid"}, "needs exactly one of taid_t"),
        ({"taid_schedule": "linear"}, "only valid with distill_wrapper=taid"),
        ({"hidden_size": 30}, "divisible by num_heads"),
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"distill_alpha": -1.0}, "distill_alpha must be >= 0"),
        ({"letters": "a=b"}, "must not contain"),
        ({"min_len": 4, "max_len": 2}, "min_len <= max_len"),
        ({"no_such_option": 1}, "has no option"),
    ],
)
def test_job_config_rejects_bad_values(values: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        job_config("composer", values)


def test_job_config_is_light() -> None:
    """The driver validates job configs without importing torch/trl."""
    code = (
        "import sys; from crf.replica.jobs import job_config; "
        "job_config('composer', {'distill_alpha': '0.3'}); "
        "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- replicas
def test_replicas_build_identical_weights_and_disjoint_shards() -> None:
    import torch

    from crf.composer.task import make_examples
    from crf.replica.jobs.composer import Config, build

    cfg = Config(num_examples=200)
    setups = [build(FakeContext(rank=r, world_size=4, seed=3), cfg) for r in range(4)]
    ref = setups[0].model.state_dict()
    for s in setups[1:]:
        sd = s.model.state_dict()
        assert all(torch.equal(ref[k], sd[k]) for k in ref)
    pool = make_examples(200, 3)
    got = sorted(json.dumps(e, sort_keys=True) for s in setups for e in s.shard)
    assert got == sorted(json.dumps(e, sort_keys=True) for e in pool)  # a partition of the pool
    assert [len(s.shard) for s in setups] == [50, 50, 50, 50]
    assert setups[0].shard != pool[0::4]  # ordered by the rank's data_seed
    other_seed = build(FakeContext(seed=4), cfg).model.state_dict()
    assert not all(torch.equal(ref[k], other_seed[k]) for k in ref)


@pytest.mark.slow
def test_composer_job_learns_with_fake_context() -> None:
    from crf.replica.jobs.composer import Config, run

    ctx = FakeContext(sync_every=10, rounds=6, seed=0)
    metrics = run(ctx, Config())
    # DiLoCo got the trainer's model and its torch optimizer, once, and was left at the end
    import torch

    ((model, opt),) = ctx.diloco_calls
    assert isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch")
    assert isinstance(model, torch.nn.Module) and ctx.exits == 1
    # exactly one log_step per optimizer step, with every channel's loss
    assert len(ctx.logged) == ctx.total_steps == metrics["steps"] == 60
    assert all({"loss", "reward", "grpo_loss"} <= set(s) for s in ctx.logged)
    assert sum("distill_loss" in s for s in ctx.logged) >= 55
    assert sum("replay_loss" in s for s in ctx.logged) >= 55
    rounds = metrics["rounds"]
    assert len(rounds) == 6 and all(math.isfinite(r["loss"]) for r in rounds)
    # learning: the last round's mean reward is clearly above the first's
    first, last = metrics["reward_first_round"], metrics["reward_last_round"]
    print(
        f"composer job reward: first round {first:.3f}, last round {last:.3f}; "
        f"exact match {metrics['exact_match_before']:.2f} -> {metrics['exact_match_after']:.2f}"
    )
    assert last > first + 0.15
    assert metrics["exact_match_after"] > metrics["exact_match_before"]


def test_composer_job_variant_taid_dpo_grpo_kl() -> None:
    from crf.replica.jobs.composer import run

    cfg = job_config(
        "composer",
        {
            "distill_wrapper": "taid",
            "taid_schedule": "adaptive",
            "replay_loss": "dpo",
            "grpo_beta": 0.04,
            "num_examples": 64,
        },
    )
    ctx = FakeContext(sync_every=2, rounds=2)
    metrics = run(ctx, cfg)
    assert metrics["steps"] == 4 and len(metrics["rounds"]) == 2 and len(ctx.logged) == 4
    assert all(math.isfinite(s["loss"]) for s in ctx.logged)


# --------------------------------------------------------------------------- real context
def _real_context(
    tmp_path: Path, entrypoint: list[str] | None = None, job: str = "composer", rounds: int = 2
):
    from crf.replica.context import ReplicaContext
    from crf.spec import RunSpec
    from crf.store import RunStore

    uri = f"file://{tmp_path}/run"
    spec = RunSpec(
        run_id="composer-test",
        run_uri=uri,
        job=job,
        entrypoint=entrypoint,
        replicas=1,
        sync_every=2,
        rounds=rounds,
        round_timeout_s=30.0,
        eval_examples=8,
    ).validate()
    store = RunStore(uri)
    if not store.exists("run.json"):  # a restart reads the run's own
        store.put("run.json", spec.to_json().encode())
    env = {"CRF_RUN_URI": uri, "CRF_RANK": "0", "CRF_WORLD_SIZE": "1", "CRF_RUN_ID": spec.run_id}
    return ReplicaContext, store, env


def test_composer_job_under_real_replica_context(tmp_path: Path) -> None:
    from crf.replica.jobs.composer import Config, run

    ReplicaContext, store, env = _real_context(tmp_path)
    with ReplicaContext.from_env(env) as ctx:
        metrics = run(ctx, Config(num_examples=64))
        ctx.finish(metrics)
    result = store.get_json("results/0.json")
    assert result["status"] == "ok" and result["steps"] == 4
    assert result["rounds_committed"] == 2 and result["weights_sha256"]
    assert result["job_metrics"]["steps"] == 4
    round0 = store.get_json("metrics/0/0.json")["metrics"]
    assert {"reward", "grpo_loss", "distill_loss"} <= set(round0)


# --------------------------------------------------------------------------- the example
def _load_example():
    path = ROOT / "examples" / "composer_custom.py"
    spec = importlib.util.spec_from_file_location("composer_custom_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def tiny_model_dir(tmp_path: Path) -> str:
    from crf.composer import char_tokenizer, save_tiny, tiny_qwen2

    example = _load_example()
    tok = char_tokenizer(example.example_alphabet())
    rows = example.build_dataset(32, seed=0)
    text = "".join(r["prompt"] + r["hint"] + r["trace"] for r in rows) + example.HINT_TEMPLATE
    assert set(text.replace("{hint}", "").replace("{prompt}", "")) <= set(tok.get_vocab())
    return save_tiny(tiny_qwen2(tok, seed=0), tok, tmp_path / "tiny-model")


def test_example_runs_standalone(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CRF_RUN_URI", raising=False)
    example = _load_example()
    metrics = example.main(
        [
            "--model",
            tiny_model_dir,
            "--max-steps",
            "3",
            "--examples",
            "64",
            "--output-dir",
            str(tmp_path / "out"),
            "--replay-loss",
            "dpo",
        ]
    )
    assert metrics["steps"] == 3 and math.isfinite(metrics["final_loss"])
    assert metrics["reward_first_quarter"] is not None


def test_example_runs_as_replica_entrypoint(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, store, env = _real_context(
        tmp_path, entrypoint=["python", "examples/composer_custom.py"], job="lm"
    )
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    example = _load_example()
    metrics = example.main(
        ["--model", tiny_model_dir, "--examples", "64", "--output-dir", str(tmp_path / "out")]
    )
    assert metrics["steps"] == 4  # ctx.total_steps = sync_every * rounds
    result = store.get_json("results/0.json")
    assert result["status"] == "ok" and result["rounds_committed"] == 2
    assert result["job_metrics"]["steps"] == 4


def test_the_embedded_model_reads_a_datasets_characters_the_same_on_every_replica(
    tmp_path: Path,
) -> None:
    """Without --model the embedded model is sized to the user's rows: every character of
    them (digits and spaces here, none of the embedded task's alphabet) is a token of its
    own, not the unknown token, on every replica alike, whatever rows its shard holds; and
    its positions hold the longest prompt and its completions."""
    import torch

    from crf.composer.tiny import UNK
    from crf.replica.jobs.composer import Config, build, completion_tokens

    data = tmp_path / "sums.jsonl"
    rows = [{"prompt": f"{i} + {i} = " + "pad " * (i % 7), "answer": 2 * i} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    setups = []
    for rank in range(2):
        ctx = FakeContext(rank=rank, world_size=2, seed=3)
        vars(ctx.spec).update(dataset=str(data), dataset_config=None, dataset_split="train",
                              columns={}, reward=["math_answer"], eval_dataset=None,
                              eval_split=None)  # fmt: skip
        setups.append(build(ctx, Config()))
    ref = setups[0].model.state_dict()
    assert all(torch.equal(ref[k], setups[1].model.state_dict()[k]) for k in ref)
    tokenizer = setups[0].tokenizer
    unk = tokenizer.convert_tokens_to_ids(UNK)
    for row in rows:
        text = row["prompt"] + str(row["answer"])
        ids = tokenizer(text)["input_ids"]
        assert unk not in ids and len(ids) == len(text), row
    longest = max(len(r["prompt"]) for r in rows)
    positions = setups[0].model.config.max_position_embeddings
    assert positions >= longest + completion_tokens(Config(), ctx.spec)


def test_the_default_reward_reads_a_number_answer_as_it_prints() -> None:
    """A --dataset without --reward is scored by the embedded task's reward, which compares
    characters: a JSON or CSV answer that is a number (24) is the text "24" there, as the
    other built-in rewards read it, not a TypeError in the first training step."""
    from crf.composer.task import reverse_reward

    assert reverse_reward(["24", "2", "42"], answer=[24, 24, 24]) == [1.0, 0.25, 0.0]
    assert reverse_reward(["x"], answer=[""]) == [0.0]  # an empty answer scores, not raises


def test_conversations_without_a_chat_template_fail_at_setup(tmp_path: Path) -> None:
    """Conversational prompts (a URL dataset: the launcher reads its first rows only) with a
    tokenizer without a chat template: a DataError while the replica builds (a setup error,
    never restarted), not TRL's ValueError at the first training step (restarted)."""
    from crf.replica.data import DataError
    from crf.replica.jobs.composer import Config, build

    data = tmp_path / "d.jsonl"
    rows = [{"prompt": [{"role": "user", "content": w}], "answer": w[::-1]} for w in ("ab", "cd")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = FakeContext()
    vars(ctx.spec).update(dataset=f"file://{data}", dataset_config=None, dataset_split="train",
                          columns={}, reward=[], eval_dataset=None, eval_split=None)  # fmt: skip
    with pytest.raises(DataError, match="the prompts hold conversations .* the composer job's "
                       "embedded model has no chat template"):  # fmt: skip
        build(ctx, Config())


class _Killed(Exception):
    """Stands in for the SIGKILL of a fault point (``CRF_FAULT``) in-process."""


@pytest.mark.parametrize(
    ("num_examples", "killed_at"),
    [(24, 3), (16, 3)],
    ids=["resumes-mid-epoch", "resumes-at-an-epoch-start"],
)
def test_a_restarted_composer_replica_ends_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_examples: int, killed_at: int
) -> None:
    """A composer replica dies in round 1 (after inner step 3) and starts again: it resumes
    from global/0 at step 2 and ends with the weights of the run nobody stopped. GRPO samples
    its completions from the random-number generators, which the restarted trainer seeds
    afresh: the inner state saves them and the restart restores them; and the prompts go on
    in the uninterrupted trainer's shuffled order (24 rows: 3 steps an epoch, the resume
    lands inside one; 16 rows: 2 steps, at an epoch's start)."""
    from crf.replica import context
    from crf.replica.jobs.composer import Config, run

    def train(where: Path) -> dict[str, Any]:
        ReplicaContext, store, env = _real_context(where, rounds=3)
        with contextlib.suppress(_Killed), ReplicaContext.from_env(env) as ctx:
            ctx.finish(run(ctx, Config(num_examples=num_examples)))
        return store.get_json("results/0.json")

    reference = train(tmp_path / "ref")
    real_fault = context.maybe_fault

    def fault(point: str, rank: int, round: Any, store: Any, step: Any = None, **kw: Any) -> None:
        if point == "inner_step" and step == killed_at:
            raise _Killed
        real_fault(point, rank, round, store, step=step, **kw)

    monkeypatch.setattr(context, "maybe_fault", fault)
    assert train(tmp_path / "victim")["status"] == "failed"
    monkeypatch.setattr(context, "maybe_fault", real_fault)
    result = train(tmp_path / "victim")
    assert result["status"] == "ok" and result["resumed_from"] == 0
    assert result["weights_sha256"] == reference["weights_sha256"]
