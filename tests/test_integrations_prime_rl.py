"""crf.integrations.prime_rl against PRIME-RL's per-sample loss contract.

PRIME-RL is not on the package index and needs a GPU, so these tests stand in for it with
tests/prime_rl_upstream.py: its ``LossInputs``, the packing that fills it and the rl part of
``compute_loss``, rebuilt from PRIME-RL main at commit 559b4477 (2026-08-21, tag v0.8.1.dev67,
package version 0.8.0). tests/test_integrations_prime_rl_real.py runs the adapter through
PRIME-RL's own code where a checkout of that commit is given (``make test-prime-rl``)."""

from __future__ import annotations

import math

import pytest
import torch

from crf.integrations.prime_rl import check_config, check_kwargs, composer_loss
from tests.prime_rl_upstream import (
    LossInputs,
    Sample,
    compute_rl_loss,
    pack,
    rl_scale,
    route_to_ref_kl,
)


def _inputs(t: int = 6, *, ref: bool = True, seed: int = 0) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    inference = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    trainer = inference + 0.1 * torch.randn(t, generator=g, dtype=torch.float64)
    return LossInputs(
        trainer_logprobs=trainer.requires_grad_(),
        inference_logprobs=inference,
        ref_logprobs=inference - 0.3 if ref else None,
        advantages=torch.full((t,), 0.5, dtype=torch.float64),
        loss_mask=torch.tensor([True] * (t - 1) + [False]),
        loss_weights=torch.full((t,), 1.0 / (t - 1), dtype=torch.float64),
    )


def test_grpo_term_matches_a_hand_reference() -> None:
    x = _inputs(ref=False)
    out = composer_loss(x)
    assert out.loss.shape == () and set(out.metrics) == {"grpo_loss", "masked_out_of_band"}
    out.loss.backward()
    ratio = [
        math.exp(a - b)
        for a, b in zip(x.trainer_logprobs.tolist(), x.inference_logprobs.tolist(), strict=True)
    ]
    w = 1.0 / 5
    expect = sum(-r * 0.5 * w for r in ratio[:5])
    assert out.loss.item() == pytest.approx(expect, rel=1e-12)
    # d/dlogp of -r*A*w is -r*A*w; the masked last token gets no gradient
    grad = x.trainer_logprobs.grad.tolist()
    assert grad[:5] == pytest.approx([-r * 0.5 * w for r in ratio[:5]], rel=1e-12)
    assert grad[5] == 0.0


def test_out_of_band_tokens_are_masked_and_the_edges_kept() -> None:
    x = _inputs(4, ref=False)
    with torch.no_grad():
        x.inference_logprobs.copy_(torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64))
        # ratios: exactly the low edge, inside, far above, exactly the high edge
        x.trainer_logprobs.copy_(x.inference_logprobs + torch.log(torch.tensor(
            [0.5, 1.0, 100.0, 2.0], dtype=torch.float64)))  # fmt: skip
    x.loss_mask = torch.ones(4, dtype=torch.bool)
    x.loss_weights = torch.ones(4, dtype=torch.float64)
    low, high = torch.exp(x.trainer_logprobs - x.inference_logprobs)[[0, 3]].tolist()
    out = composer_loss(x, ratio_low=low, ratio_high=high)  # the edges as the loss sees them
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0) * 0.5, rel=1e-12)
    assert out.metrics["masked_out_of_band"].item() == pytest.approx(0.25)
    assert x.trainer_logprobs.grad[2].item() == 0.0 and x.trainer_logprobs.grad[3].item() != 0


def test_an_all_masked_sample_gives_zero_and_no_nan() -> None:
    x = _inputs(ref=True)
    x.loss_mask = torch.zeros_like(x.loss_mask)
    out = composer_loss(x, distill_alpha=1.0)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.all(x.trainer_logprobs.grad == 0)
    assert out.metrics["masked_out_of_band"].item() == 0.0


def test_distillation_channel_matches_a_hand_reference() -> None:
    x = _inputs(ref=True)
    base = composer_loss(_inputs(ref=True), distill_alpha=0.0)
    out = composer_loss(x, distill_alpha=0.3)
    w = 1.0 / 5
    diffs = [
        a - b for a, b in zip(x.trainer_logprobs.tolist(), x.ref_logprobs.tolist(), strict=True)
    ]
    distill = sum(d * w for d in diffs[:5])
    assert out.metrics["distill_loss"].item() == pytest.approx(distill, rel=1e-12)
    assert out.loss.item() == pytest.approx(base.loss.item() + 0.3 * distill, rel=1e-12)
    out.loss.backward()
    grpo_only = _inputs(ref=True)
    composer_loss(grpo_only).loss.backward()
    extra = (x.trainer_logprobs.grad - grpo_only.trainer_logprobs.grad).tolist()
    assert extra[:5] == pytest.approx([0.3 * d * w for d in diffs[:5]], rel=1e-9)
    assert extra[5] == 0.0


def test_a_sample_without_teacher_logprobs_skips_the_channel() -> None:
    out = composer_loss(_inputs(ref=False), distill_alpha=0.5)
    assert out.metrics["distill_samples"].item() == 0.0
    assert out.loss.item() == composer_loss(_inputs(ref=False)).loss.item()


def test_none_weights_mean_one_on_every_token() -> None:
    """Plain GRPO: PRIME-RL sends no weight stream, so ``loss_weights`` is None."""
    x, ones = _inputs(seed=3), _inputs(seed=3)
    x.loss_weights = None
    ones.loss_weights = torch.ones_like(ones.advantages)
    a, b = composer_loss(x, distill_alpha=0.2), composer_loss(ones, distill_alpha=0.2)
    assert a.loss.item() == b.loss.item() and a.metrics["distill_samples"].item() == 1.0


def test_the_pack_fill_is_no_teacher_but_one_certain_token_is() -> None:
    x = _inputs(seed=1)
    x.ref_logprobs = torch.zeros_like(x.inference_logprobs)  # the fill of a sample with none
    assert composer_loss(x, distill_alpha=0.5).metrics["distill_samples"].item() == 0.0
    x.ref_logprobs = x.inference_logprobs - 0.3
    x.ref_logprobs[0] = 0.0  # a token the teacher is certain of, in a taught sample
    assert composer_loss(x, distill_alpha=0.5).metrics["distill_samples"].item() == 1.0


def test_a_teacher_attr_that_is_no_field_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="teacher_attr = 'reference_logprobs' is no field") as e:
        composer_loss(_inputs(), distill_alpha=0.1, teacher_attr="reference_logprobs")
    assert "\n" not in str(e.value) and "ref_logprobs" in str(e.value)


def _sample(n: int, seed: int, *, prompt: int = 2, ref: bool, weights: float | None = None):
    g = torch.Generator().manual_seed(seed)
    inference = (-torch.rand(n, generator=g) * 3).tolist()
    return Sample(
        loss_mask=[False] * prompt + [True] * (n - prompt),
        inference_logprobs=inference,
        advantages=[0.7 - 0.4 * seed] * n,
        ref_logprobs=[v - 0.25 for v in inference] if ref else None,
        rl_weights=None if weights is None else [weights] * n,
    )


def _reference(samples, trainer, alpha: float, scale: int) -> float:
    """The loss by hand, in float64, from the samples' own lists (padding excluded)."""
    total, at = 0.0, 0
    for s in samples:
        w = s.rl_weights or [1.0] * len(s.loss_mask)
        for k, m in enumerate(s.loss_mask):
            if m and w[k] != 0:
                t = trainer[at + k]
                total += -math.exp(t - s.inference_logprobs[k]) * s.advantages[k] * w[k]
                if s.ref_logprobs is not None:
                    total += alpha * (t - s.ref_logprobs[k]) * w[k]
        at += len(s.loss_mask)
    return total / scale


def test_the_exact_upstream_shapes_with_none_weights() -> None:
    """Three samples packed and padded as PRIME-RL does (the middle one without reference
    log-probs, so 0.0-filled), float32, no weight stream (``loss_weights`` None), the trainer's
    log-probs the split of one packed tensor; the default teacher is ``ref_logprobs``."""
    samples = [_sample(7, 0, ref=True), _sample(5, 1, ref=False), _sample(6, 2, ref=True)]
    mb = pack(samples, pad_to_multiple_of=8)
    assert mb.sequence_lengths == [7, 5, 12] and len(mb.ref_logprobs) == 24
    inference = torch.tensor(mb.inference_logprobs)
    trainer = inference + 0.05 * torch.randn(24, generator=torch.Generator().manual_seed(9))
    trainer = trainer.unsqueeze(0).requires_grad_()
    scale = rl_scale([mb])
    loss, metrics, called = compute_rl_loss(
        trainer, mb, lambda x: composer_loss(x, distill_alpha=0.2), scale
    )
    assert [c.loss_weights for c in called] == [None, None, None]
    assert all(c.trainer_logprobs.dtype == torch.float32 and c.loss_mask.dtype == torch.bool
               for c in called)  # fmt: skip
    assert [v.item() for v in metrics["distill_samples"]] == [1.0, 0.0, 1.0]
    assert scale == 5 + 3 + 4
    expect = _reference(samples, trainer[0].tolist(), 0.2, scale)
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    loss.backward()
    grad = trainer.grad[0]
    assert torch.all(grad[18:] == 0)  # padding, which joined the last sample
    assert torch.all(grad[[0, 1, 7, 8, 12, 13]] == 0)  # prompts
    # the middle sample got the GRPO gradient only: -r*A/scale per token
    r = torch.exp(trainer[0, 9:12] - inference[9:12]).detach()
    assert grad[9:12].tolist() == pytest.approx((-r * samples[1].advantages[0] / scale).tolist(),
                                                rel=1e-5)  # fmt: skip


def test_a_weight_stream_weights_and_masks_tokens() -> None:
    """One sample sends rl weights 0.5, the other none (filled with 1.0); padding gets 0.0
    and leaves the mask."""
    samples = [_sample(6, 0, ref=True, weights=0.5), _sample(5, 1, ref=True)]
    mb = pack(samples, pad_to_multiple_of=4)
    assert mb.rl_weights == [0.5] * 6 + [1.0] * 5 + [0.0]
    trainer = torch.tensor(mb.inference_logprobs).unsqueeze(0).requires_grad_()
    scale = rl_scale([mb])
    loss, _, called = compute_rl_loss(
        trainer, mb, lambda x: composer_loss(x, distill_alpha=0.3), scale
    )
    assert called[1].loss_mask.tolist() == [False, False, True, True, True, False]
    samples[1].rl_weights = [1.0] * 5
    assert loss.item() == pytest.approx(_reference(samples, trainer[0].tolist(), 0.3, scale),
                                        rel=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replay_beta": 0.1}, "replay .* needs chosen/rejected pairs .* set replay_beta = 0"),
        ({"ratio_low": 1.5}, "need 0 <= ratio_low < 1 < ratio_high"),
        ({"distill_alpha": -1}, "distill_alpha must be >= 0"),
        ({"alpha": 1}, "unknown option\\(s\\) alpha"),
    ],
)
def test_bad_kwargs_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        check_kwargs(kwargs)
    assert "\n" not in str(err.value)


def test_an_opd_sample_never_reaches_the_rl_loss() -> None:
    """PRIME-RL's opd/opsd samples, the only ones with reference log-probs, are routed to its
    ref_kl loss (rl weights 0.0): the rl loss runs on the GRPO sample packed beside them only,
    whose reference is the pack's 0.0 fill, so distillation adds nothing."""
    grpo, opd = _sample(6, 0, ref=False), route_to_ref_kl(_sample(5, 1, ref=True))
    mb = pack([grpo, opd], pad_to_multiple_of=4)
    assert mb.rl_weights == [1.0] * 6 + [0.0] * 6 and mb.ref_logprobs[:6] == [0.0] * 6
    assert mb.ref_kl_weights == [0.0] * 6 + [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    trainer = torch.tensor(mb.inference_logprobs).unsqueeze(0) + 0.1
    scale = rl_scale([mb])
    assert scale == 4
    with_alpha, metrics, called = compute_rl_loss(
        trainer, mb, lambda x: composer_loss(x, distill_alpha=0.5), scale
    )
    without, _, _ = compute_rl_loss(trainer, mb, composer_loss, scale)
    assert len(called) == 1 and called[0].loss_mask.sum().item() == 4
    assert [v.item() for v in metrics["distill_samples"]] == [0.0]
    assert with_alpha.item() == without.item()


def _rl_config(alpha: float, **orchestrator: dict) -> dict:
    return {
        "orchestrator": orchestrator,
        "trainer": {"loss": {"type": "custom",
                    "import_path": "crf.integrations.prime_rl.composer_loss",
                    "kwargs": {"distill_alpha": alpha}}},
    }  # fmt: skip


def test_check_config_reads_the_loss_table() -> None:
    assert check_config(_rl_config(0.0))["ratio_high"] == 8.0
    trainer_only = _rl_config(0.1)["trainer"]  # a trainer config does not name the algorithm
    assert check_config(trainer_only)["distill_alpha"] == 0.1
    custom = _rl_config(0.1, algo={"type": "my_distilled_grpo"})  # registered in code
    assert check_config(custom)["distill_alpha"] == 0.1
    with pytest.raises(ValueError, match='type = "custom"'):
        check_config({"trainer": {"loss": {"type": "default"}}})


@pytest.mark.parametrize(
    ("orchestrator", "named"),
    [
        ({}, "grpo"),
        ({"algo": {"type": "opd", "teacher": {"name": "t", "base_url": "http://h/v1"}}}, "opd"),
        ({"train": {"source": [{"name": "a"}, {"name": "b", "algo": {"type": "opd"}}]}},
         "grpo, opd"),
    ],
)  # fmt: skip
def test_distillation_with_prime_rl_algorithms_is_refused_in_one_line(
    orchestrator: dict, named: str
) -> None:
    with pytest.raises(ValueError, match=f"algorithm\\(s\\) {named}: only opd and opsd") as e:
        check_config(_rl_config(0.1, **orchestrator))
    assert "\n" not in str(e.value) and "set distill_alpha = 0" in str(e.value)
