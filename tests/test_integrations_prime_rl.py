"""crf.integrations.prime_rl against PRIME-RL's per-sample loss contract.

PRIME-RL is not on PyPI and needs a GPU, so ``LossInputs`` here is a stand-in built from its
contract: one sample's 1-D per-token tensors ``trainer_logprobs`` (with gradient),
``inference_logprobs``, ``reference_logprobs`` (may be None), ``advantages``, ``loss_mask``
and ``loss_weights``; the loss returns ``LossOutputs(loss, metrics)``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from crf.integrations.prime_rl import check_config, check_kwargs, composer_loss


@dataclasses.dataclass
class LossInputs:
    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    reference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor


def _inputs(t: int = 6, *, ref: bool = True, seed: int = 0) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    inference = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    trainer = inference + 0.1 * torch.randn(t, generator=g, dtype=torch.float64)
    return LossInputs(
        trainer_logprobs=trainer.requires_grad_(),
        inference_logprobs=inference,
        reference_logprobs=inference - 0.3 if ref else None,
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
        a - b
        for a, b in zip(x.trainer_logprobs.tolist(), x.reference_logprobs.tolist(), strict=True)
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
    assert "distill_loss" not in out.metrics


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


def test_check_config_reads_the_loss_table() -> None:
    table = {"trainer": {"loss": {"type": "custom",
             "import_path": "crf.integrations.prime_rl.composer_loss",
             "kwargs": {"distill_alpha": 0.1}}}}  # fmt: skip
    assert check_config(table)["distill_alpha"] == 0.1
    with pytest.raises(ValueError, match='type = "custom"'):
        check_config({"trainer": {"loss": {"type": "default"}}})
