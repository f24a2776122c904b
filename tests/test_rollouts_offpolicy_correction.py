"""The decoupled-PPO weights of each correction mode, masking, truncation and the refusal rule,
on hand-made log-probs (crf/rollouts/correction.py)."""

from __future__ import annotations

import math

import pytest
import torch

from crf.rollouts.config import CORRECTION_MODES
from crf.rollouts.correction import correct, refusal

# two rollouts, three token slots; the second rollout has two tokens (last slot is padding)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# log(pi_prox / pi_b) per token: ratios 4, 1, 0.25 | 2, 1 (and a padded slot that must not count)
LOG_W = torch.log(torch.tensor([[4.0, 1.0, 0.25], [2.0, 1.0, 123.0]]))
BEHAVIOUR = torch.full((2, 3), -1.0)
PROXIMAL = BEHAVIOUR + LOG_W


def weights(mode: str, **kw) -> torch.Tensor:
    return correct(PROXIMAL, BEHAVIOUR, MASK, mode=mode, **kw).weights


def test_token_truncate_clamps_each_token_ratio() -> None:
    w = weights("token_truncate", clip_min=0.5, clip_max=3.0)
    assert torch.allclose(w, torch.tensor([[3.0, 1.0, 0.5], [2.0, 1.0, 0.0]]))


def test_token_truncate_without_lower_bound_keeps_small_ratios() -> None:
    w = weights("token_truncate", clip_min=None, clip_max=3.0)
    assert torch.allclose(w, torch.tensor([[3.0, 1.0, 0.25], [2.0, 1.0, 0.0]]))


def test_token_mask_zeroes_tokens_outside_the_bounds() -> None:
    c = correct(PROXIMAL, BEHAVIOUR, MASK, mode="token_mask", clip_min=0.5, clip_max=3.0)
    assert torch.allclose(c.weights, torch.tensor([[0.0, 1.0, 0.0], [2.0, 1.0, 0.0]]))
    assert c.stats["masked"] == pytest.approx(2 / 5)
    assert c.stats["clipped"] == pytest.approx(2 / 5)


def test_sequence_modes_use_the_product_of_a_rollouts_ratios() -> None:
    # sequence ratios: 4 * 1 * 0.25 = 1 (kept) and 2 * 1 = 2 (over clip_max 1.5)
    t = weights("sequence_truncate", clip_max=1.5)
    assert torch.allclose(t, torch.tensor([[1.0, 1.0, 1.0], [1.5, 1.5, 0.0]]))
    c = correct(PROXIMAL, BEHAVIOUR, MASK, mode="sequence_mask", clip_max=1.5)
    assert torch.allclose(c.weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert c.stats["masked"] == pytest.approx(2 / 5)


def test_off_weighs_every_token_one_but_still_measures() -> None:
    c = correct(PROXIMAL, BEHAVIOUR, MASK, mode="off")
    assert torch.equal(c.weights, MASK.float())
    assert c.stats["ratio_max"] == pytest.approx(4.0)
    assert c.stats["masked"] == 0.0


def test_stats_cover_loss_tokens_only() -> None:
    s = correct(PROXIMAL, BEHAVIOUR, MASK).stats
    ratios = torch.tensor([4.0, 1.0, 0.25, 2.0, 1.0])
    k3 = (ratios - 1) - torch.log(ratios)
    assert s["ratio_min"] == pytest.approx(0.25)
    assert s["ratio_max"] == pytest.approx(4.0)
    assert s["ratio_mean"] == pytest.approx(float(ratios.mean()))
    assert s["mismatch_kl"] == pytest.approx(float(k3.mean()), rel=1e-6)


def test_identical_policies_give_ratio_one_and_no_mismatch() -> None:
    c = correct(BEHAVIOUR, BEHAVIOUR, MASK, mode="token_mask", clip_min=0.5, clip_max=3.0)
    assert c.stats == {
        "mismatch_kl": 0.0,
        "ratio_min": 1.0,
        "ratio_mean": 1.0,
        "ratio_max": 1.0,
        "masked": 0.0,
        "clipped": 0.0,
    }
    assert torch.equal(c.weights, MASK.float())


def test_nan_behaviour_logprob_counts_as_ratio_one() -> None:
    behaviour = BEHAVIOUR.clone()
    behaviour[0, 0] = math.nan
    c = correct(PROXIMAL, behaviour, MASK, mode="token_truncate")
    assert c.weights[0, 0] == 1.0
    assert math.isfinite(c.stats["mismatch_kl"])


def test_every_mode_is_known_and_others_are_refused() -> None:
    for mode in CORRECTION_MODES:
        correct(PROXIMAL, BEHAVIOUR, MASK, mode=mode)
    with pytest.raises(ValueError, match="unknown correction 'token'"):
        correct(PROXIMAL, BEHAVIOUR, MASK, mode="token")


def test_refusal_names_the_mismatch() -> None:
    assert refusal({"mismatch_kl": 0.1}, 0.5) is None
    reason = refusal({"mismatch_kl": 0.9}, 0.5)
    assert reason is not None and "mismatch KL 0.9 exceeds max_mismatch 0.5" in reason
    assert "not finite" in (refusal({"mismatch_kl": math.inf}, 0.5) or "")


def test_each_rollout_gets_its_sequence_ratio_bounded_as_the_mode_says() -> None:
    prox = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.9], [0.2, 0.4]]))
    beh = torch.log(torch.tensor([[0.5, 0.5], [0.3, 0.3], [0.4, 0.4]]))
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    seq = torch.tensor([1.0, 9.0, 0.5])  # the products of the ratios over loss tokens
    got = correct(prox, beh, mask, mode="token_truncate", clip_max=3.0).sequence
    assert torch.allclose(got, torch.tensor([1.0, 3.0, 0.5]))
    got = correct(prox, beh, mask, mode="sequence_mask", clip_min=0.6, clip_max=3.0).sequence
    assert torch.allclose(got, torch.tensor([1.0, 0.0, 0.0]))
    got = correct(prox, beh, mask, mode="token_truncate", clip_max=None).sequence
    assert torch.allclose(got, seq)
    assert torch.equal(correct(prox, beh, mask, mode="off").sequence, torch.ones(3))
