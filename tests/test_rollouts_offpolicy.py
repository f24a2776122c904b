"""The composer trainer on rollout workers' batches: staleness 0 is on-policy, the correction
is applied, wrong batches are refused, and the channels and LoRA keep working.

Tiny Qwen2 on the string-reversal task, one or two optimizer steps each (CPU)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from crf.rollouts.config import RolloutConfig  # noqa: E402
from tests.rollout_helpers import (  # noqa: E402
    ROWS,
    Grads,
    MemorySource,
    Snapshots,
    logged,
    make_trainer,
    repeated,
    replaying,
    worker_batch,
)

PROMPTS = ROWS[10:14]  # the worker's prompts: not the rows the trainer's sampler draws first


def train_on(trainer, source: MemorySource, config: RolloutConfig | None = None) -> Grads:
    grads = Grads()
    trainer.add_callback(grads)
    trainer.use_rollout_source(source, config)
    trainer.train()
    return grads


@pytest.fixture(scope="module")
def stale0() -> dict[str, Any]:
    """A worker on the trainer's exact (initial) weights, consumed with the correction on
    (decoupled PPO) and off (as if generated on-policy), one step each, raw gradients."""
    rows = repeated(PROMPTS)
    batch = worker_batch(make_trainer(), rows)
    out: dict[str, Any] = {"batch": batch}
    for mode in ("token_truncate", "off"):
        trainer = make_trainer(max_grad_norm=0.0)
        source = MemorySource([(batch, rows)])
        grads = train_on(trainer, source, RolloutConfig(workers=1, correction=mode))
        out[mode] = (trainer, source, grads.grads)
    # TRL's own path, no intake: a rollout_func hands TRL the same completions as its own
    reference = make_trainer(
        max_grad_norm=0.0, rows=list(PROMPTS), rollout_func=replaying(batch, rows)
    )
    grads = Grads()
    reference.add_callback(grads)
    reference.train()
    out["trl"] = (reference, None, grads.grads)
    return out


def test_staleness_zero_gives_ratio_one(stale0: dict[str, Any]) -> None:
    trainer, source, _ = stale0["token_truncate"]
    assert source.refusals == [] and source.local_rows == []
    (stats,) = source.used_stats
    assert abs(stats["ratio_min"] - 1) <= 1e-6 and abs(stats["ratio_max"] - 1) <= 1e-6
    assert stats["mismatch_kl"] <= 1e-6
    assert stats["masked"] == 0.0
    # the per-worker statistics reach the trainer's logs
    for key in ("mismatch_kl", "ratio_min", "ratio_mean", "ratio_max", "masked"):
        assert logged(trainer, f"rollouts/w0/{key}"), key
    assert logged(trainer, "rollouts/worker_share") == [1.0]


def test_staleness_zero_gradients_equal_on_policy(stale0: dict[str, Any]) -> None:
    _, _, corrected = stale0["token_truncate"]
    _, _, on_policy = stale0["off"]
    assert corrected.keys() == on_policy.keys()
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in on_policy.values()))
    assert norm > 1e-3  # the step has a real gradient to compare
    worst = max(float((corrected[k] - on_policy[k]).abs().max()) for k in on_policy)
    assert worst <= 1e-6, worst
    # and "off" is TRL's on-policy path, fed the same completions through its rollout_func
    _, _, trl = stale0["trl"]
    worst = max(float((trl[k] - on_policy[k]).abs().max()) for k in on_policy)
    assert worst <= 1e-6, worst


def test_worker_rows_are_the_ones_scored(stale0: dict[str, Any]) -> None:
    """Rewards come from the rows the worker completed, not the sampler's rows."""
    trainer, _, _ = stale0["off"]
    prompts = trainer._logs["prompt"]
    assert list(prompts) == [r["prompt"] for r in repeated(PROMPTS)]


def test_no_batch_in_time_generates_locally() -> None:
    trainer = make_trainer()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    source = MemorySource([])
    train_on(trainer, source)
    assert source.taken == [(0, 16)] and source.local_rows == [16]
    assert source.used_stats == [] and source.refusals == []
    assert logged(trainer, "rollouts/worker_share") == [0.0]
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_channels_train_on_worker_rollouts() -> None:
    """Distillation (hints) and replay (traces) read the worker's rows and are non-empty."""
    rows = repeated(PROMPTS)
    batch = worker_batch(make_trainer(), rows)
    trainer = make_trainer(distill_alpha=0.5, replay_beta=0.5)
    source = MemorySource([(batch, rows)])
    train_on(trainer, source)
    assert len(source.used_stats) == 1
    assert logged(trainer, "distill_loss") and logged(trainer, "replay_loss")


@pytest.fixture(scope="module")
def trained() -> list[dict[str, torch.Tensor]]:
    """The tiny model's weights after each of 12 local steps."""
    trainer = make_trainer(steps=12)
    snaps = Snapshots()
    trainer.add_callback(snaps)
    trainer.train()
    return snaps.weights


@pytest.fixture(scope="module")
def plain():
    """A trainer on the initial weights, for checks that only run its intake."""
    return make_trainer()


@pytest.fixture(scope="module")
def latest(trained: list[dict[str, torch.Tensor]]):
    """A trainer on the weights after the last of the 12 steps."""
    trainer = make_trainer()
    trainer.model.load_state_dict(trained[-1])
    return trainer


def generated_by(plain, weights: dict[str, torch.Tensor], rows: list[dict]):
    """A worker batch sampled by ``weights`` (``plain``'s own weights are put back)."""
    initial = {k: v.clone() for k, v in plain.model.state_dict().items()}
    plain.model.load_state_dict(weights)
    try:
        return worker_batch(plain, rows)
    finally:
        plain.model.load_state_dict(initial)


def take(trainer, batch, rows, config: RolloutConfig | None = None, **digests: str):
    """Run the trainer's intake on one generation batch; the source records the outcome."""
    source = MemorySource([(batch, rows)], {int(k[1:]): v for k, v in digests.items()})
    trainer.use_rollout_source(source, config)
    taken = trainer._intake.take(rows)
    return taken, source


def test_batch_from_other_weights_is_refused(plain, latest) -> None:
    """The initial policy's rollouts, offered to a trained trainer as its current version:
    the mismatch says the worker served other weights."""
    rows = repeated(PROMPTS)
    batch = worker_batch(plain, rows)  # initial weights
    taken, source = take(latest, batch, rows, RolloutConfig(workers=1))
    assert taken is None and source.local_rows == [16]
    (reason,) = source.refusals
    assert "exceeds max_mismatch" in reason


def test_batch_within_the_bound_is_taken(plain, latest, trained) -> None:
    """One step stale (the default bound): taken and corrected, its ratios off 1."""
    rows = repeated(PROMPTS)
    batch = generated_by(plain, trained[-2], rows)
    taken, source = take(latest, batch, rows, RolloutConfig(workers=1))
    assert source.refusals == [] and taken is not None
    stats = taken.correction.stats
    assert 0 < stats["mismatch_kl"] <= RolloutConfig().max_mismatch
    assert stats["ratio_min"] < 1 < stats["ratio_max"]


def test_other_policy_digest_is_refused(plain) -> None:
    rows = repeated(PROMPTS)
    trainer = plain
    batch = worker_batch(trainer, rows, policy_digest="not-published")
    taken, source = take(trainer, batch, rows, v0="published")
    assert taken is None and "policy digest" in source.refusals[0]
    batch.policy_digest = "published"
    taken, source = take(trainer, batch, rows, v0="published")
    assert taken is not None and source.refusals == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda b: setattr(b, "sampling", {**b.sampling, "temperature": 0.7}), "sampling"),
        (lambda b: setattr(b, "tokenizer_digest", "x"), "tokenizer"),
        (lambda b: b.prompt_ids.__setitem__(0, [5, 5]), "prompts do not tokenize"),
        (lambda b: b.logprobs.__setitem__(0, b.logprobs[0][:-1]), "log-probs"),
    ],
)
def test_inconsistent_batch_is_refused(plain, change, reason: str) -> None:
    rows = repeated(PROMPTS)
    trainer = plain
    batch = worker_batch(trainer, rows)
    change(batch)
    taken, source = take(trainer, batch, rows)
    assert taken is None and reason in source.refusals[0]


def test_vespo_is_refused_with_workers() -> None:
    trainer = make_trainer(loss_type="vespo")
    with pytest.raises(ValueError, match="loss_type 'vespo' cannot take the off-policy"):
        trainer.use_rollout_source(MemorySource([]))
    trainer.use_rollout_source(MemorySource([]), RolloutConfig(correction="off"))


def test_masking_mode_zeroes_advantages_outside_the_bounds(plain, latest, trained) -> None:
    """token_mask on a stale batch: the advantages TRL gets are per token, zero exactly where
    the ratio left [clip_min, clip_max], and the clip is anchored at the proximal log-probs."""
    rows = repeated(PROMPTS)
    batch = generated_by(plain, trained[-3], rows)
    trainer = latest
    taken, _ = take(trainer, batch, rows, RolloutConfig(workers=1, correction="off"))
    mask = taken.tensors["mask"].bool()
    behaviour = torch.zeros_like(taken.proximal)
    for i, lp in enumerate(batch.logprobs):
        behaviour[i, : len(lp)] = torch.tensor(lp)
    ratio = torch.exp(taken.proximal - behaviour)
    clip_max = float(ratio[mask].median())  # about half the tokens fall outside
    config = RolloutConfig(workers=1, correction="token_mask", clip_max=clip_max)
    taken, source = take(trainer, batch, rows, config)
    assert taken is not None and source.refusals == []
    weights = taken.correction.weights
    outside = mask & (ratio > clip_max)
    assert outside.any() and (mask & ~outside).any()
    assert torch.all(weights[outside] == 0) and torch.all(weights[mask & ~outside] > 0)
    assert taken.correction.stats["masked"] == pytest.approx(
        float(outside.sum()) / float(mask.sum())
    )
    output = {
        key: taken.tensors[key] for key in ("prompt_ids", "completion_ids", "completion_mask")
    }
    output["advantages"] = torch.arange(1.0, 17.0)
    trainer._intake.apply(taken, output)
    assert torch.equal(output["advantages"], torch.arange(1.0, 17.0)[:, None] * weights)
    assert torch.equal(output["old_per_token_logps"], taken.proximal)


def test_lora_policy_trains_on_worker_rollouts() -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(peft_config=config)
    rows = repeated(PROMPTS)
    batch = worker_batch(trainer, rows)  # the worker holds the trainer's exact adapter
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    source = MemorySource([(batch, rows)])
    train_on(trainer, source)
    (stats,) = source.used_stats
    assert abs(stats["ratio_min"] - 1) <= 1e-6 and abs(stats["ratio_max"] - 1) <= 1e-6
    after = dict(trainer.model.named_parameters())
    changed = {k for k in before if not torch.equal(before[k], after[k].detach())}
    assert changed and all("lora_" in k for k in changed)


@pytest.mark.parametrize(
    ("settings", "mode"),
    [
        ({"loss_type": "cispo"}, "sequence_mask"),
        ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, "sequence_truncate"),
        (
            {
                "per_device_train_batch_size": 8,
                "gradient_accumulation_steps": 2,
                "num_iterations": 2,
            },
            "token_truncate",
        ),
    ],
)
def test_other_losses_and_schedules_train_on_worker_rollouts(
    stale0: dict[str, Any], settings: dict[str, Any], mode: str
) -> None:
    """Per-token advantages suit TRL's other clipped losses, sequence-level ratios, and a
    generation split over micro-batches and reused for several iterations."""
    rows = repeated(PROMPTS)
    trainer = make_trainer(steps=2 if "num_iterations" in settings else 1, **settings)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    source = MemorySource([(stale0["batch"], rows)])
    train_on(trainer, source, RolloutConfig(workers=1, correction=mode))
    (stats,) = source.used_stats
    assert abs(stats["ratio_max"] - 1) <= 1e-6 and source.local_rows == []
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_stale_batch_carries_its_rollouts_sequence_ratios(plain, latest, trained) -> None:
    """Replay and distillation average over the policy's own rollouts: on a stale batch each
    rollout weighs pi_prox(y)/pi_b(y), the product of its tokens' ratios (truncated at
    clip_max), which GRPO's per-token weights alone would not give them."""
    rows = repeated(PROMPTS)
    batch = generated_by(plain, trained[-3], rows)  # two steps stale
    taken, _ = take(latest, batch, rows, RolloutConfig(workers=1))
    assert taken is not None
    c = taken.correction
    mask = taken.tensors["mask"].bool()
    diff = (taken.proximal - pad_behaviour(batch, taken.proximal)) * mask
    expected = torch.exp(diff.sum(-1)).clamp(max=3.0)
    assert torch.allclose(c.sequence, expected)
    assert float(c.sequence.min()) < 1 < float(c.sequence.max())


def pad_behaviour(batch, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, lp in enumerate(batch.logprobs):
        out[i, : len(lp)] = torch.tensor(lp)
    return out


def test_channel_means_weigh_each_rollout() -> None:
    from crf.composer.trainer import _rollout_mean

    per_row, idx = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 3])
    assert float(_rollout_mean(per_row, {}, idx)) == 2.0  # no worker batch: a plain mean
    weights = torch.tensor([3.0, 9.0, 1.0, 0.0])  # per rollout of the generation batch
    got = _rollout_mean(per_row, {"rollout_sequence_weights": weights}, idx)
    assert float(got) == pytest.approx((3 * 1 + 1 * 2 + 0 * 3) / 4)
    masked = {"rollout_sequence_weights": torch.zeros(4)}
    assert float(_rollout_mean(per_row, masked, idx)) == 0.0  # every rollout masked


def test_staleness_zero_channels_equal_on_policy() -> None:
    """With distillation and replay on, a worker on the trainer's exact weights gives the
    same gradients with the correction as without it (every weight 1 up to float noise)."""
    rows = repeated(PROMPTS)
    batch = worker_batch(make_trainer(), rows)
    grads = {}
    for mode in ("token_truncate", "off"):
        trainer = make_trainer(max_grad_norm=0.0, distill_alpha=0.5, replay_beta=0.5)
        got = train_on(trainer, MemorySource([(batch, rows)]),
                       RolloutConfig(workers=1, correction=mode))  # fmt: skip
        assert logged(trainer, "replay_loss") and logged(trainer, "distill_loss")
        grads[mode] = got.grads
    worst = max(float((grads["token_truncate"][k] - grads["off"][k]).abs().max())
                for k in grads["off"])  # fmt: skip
    assert worst <= 1e-6, worst
