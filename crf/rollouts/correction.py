"""Decoupled PPO for rollouts a worker generated with an older policy.

A worker's rollout was sampled by the behaviour policy pi_b (the version it held); the
trainer updates pi_theta. Decoupled PPO (AReaL's objective) separates the two roles the old
policy plays in PPO:

- the **proximal** policy pi_prox, the trainer's current weights at the moment it takes the
  batch, anchors the clip: TRL's ``old_per_token_logps`` are set to its log-probs, so the
  trust region is taken around a policy the trainer actually has (not one that never existed
  on this trainer);
- the **behaviour** policy is corrected by importance weighting: the advantage of each token
  is multiplied by w = pi_prox / pi_b, truncated or masked as TRL's
  ``vllm_importance_sampling_mode`` names the modes (:data:`CORRECTION_MODES`).

The composer's distillation and replay channels average over the policy's own rollouts as
well; they weigh each rollout by its sequence ratio pi_prox(y)/pi_b(y), bounded as the mode
says (``Correction.sequence``; crf/composer/trainer.py ``_rollout_mean``).

TRL's clipped losses are linear in the advantage: for w >= 0,
``-min(r·A·w, clip(r)·A·w) = w · -min(r·A, clip(r)·A)``, so per-token advantages (B, T) = A·w
(which TRL's ``_compute_loss`` accepts) apply exactly the weighted objective. VESPO weighs
sequences by a function of the advantage's sign and the ratio, where that identity fails: it
is refused with workers.

The same numbers tell whether the worker served the weights it names. At staleness 0 on exact
weights, w is 1 up to float noise (the worker computes pi_b with the trainer's own code,
crf/rollouts/generate.py). A few steps of policy lag give a small mismatch; another policy
altogether (say the initial weights against a trained trainer) gives a large one. The
mismatch is the mean per-token k3 estimate of KL(pi_b || pi_prox) over the loss tokens,
``(w - 1) - log w`` with tokens sampled from pi_b: unbiased, always >= 0, and robust to the
long tails a plain ``-log w`` mean suffers on few tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from crf.rollouts.config import CORRECTION_MODES

__all__ = ["Correction", "correct", "refusal"]


@dataclass
class Correction:
    """Per-token weights (B, T) to multiply the advantages by, and the batch's statistics:
    ``mismatch_kl`` (mean k3 over loss tokens), ``ratio_min``/``ratio_mean``/``ratio_max``
    (of the raw token ratio pi_prox/pi_b over loss tokens, before truncation or masking),
    ``masked`` (share of loss tokens the correction zeroes) and ``clipped`` (share of loss
    tokens whose ratio, or whose sequence's ratio under ``sequence_*``, lies outside
    [clip_min, clip_max]: truncated or masked)."""

    weights: torch.Tensor
    stats: dict[str, float]
    #: per rollout (B,): the weight of a loss taken over whole rollouts (the composer's
    #: replay pairs): the sequence ratio pi_prox(y)/pi_b(y), truncated or masked as ``mode``
    #: says (all 1 with the correction off)
    sequence: torch.Tensor | None = None


def correct(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Correction:
    """The importance weights pi_prox/pi_b of one batch, per ``mode`` (TRL's semantics):

    - ``token_truncate``: each token's ratio clamped to [clip_min, clip_max];
    - ``token_mask``: tokens whose ratio is outside [clip_min, clip_max] weigh 0, others their
      ratio;
    - ``sequence_truncate``/``sequence_mask``: the same on the sequence ratio (the product of
      its tokens' ratios), given to every token of the sequence;
    - ``off``: every weight 1 (the rollouts are trained on as if on-policy).

    ``proximal``/``behaviour`` are (B, T) log-probs, ``mask`` the (B, T) loss mask. A NaN
    behaviour log-prob gives its token ratio 1, as TRL does for tokens vLLM cannot score."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown correction {mode!r}: use one of {', '.join(CORRECTION_MODES)}")
    m = mask.to(proximal.dtype)
    diff = torch.nan_to_num((proximal.float() - behaviour.float()) * m, nan=0.0)
    lo = -math.inf if clip_min is None else float(clip_min)
    hi = math.inf if clip_max is None else float(clip_max)
    stats = _stats(diff, m.bool())

    def bounded(ratio: torch.Tensor) -> torch.Tensor:
        """``ratio`` truncated to, or zeroed outside, [clip_min, clip_max] as ``mode`` says."""
        if mode.endswith("truncate"):
            if clip_min is None and clip_max is None:
                return ratio
            return torch.clamp(ratio, min=clip_min, max=clip_max)
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)

    if mode == "off":
        weights = torch.ones_like(diff)
        outside = torch.zeros_like(diff, dtype=torch.bool)
        sequence = torch.ones(diff.size(0), dtype=diff.dtype, device=diff.device)
    else:
        seq_ratio = torch.exp(diff.sum(-1))
        ratio = seq_ratio.unsqueeze(-1) if mode.startswith("sequence") else torch.exp(diff)
        outside = ((ratio < lo) | (ratio > hi)).expand_as(diff)
        weights = bounded(ratio).expand_as(diff).contiguous()
        sequence = bounded(seq_ratio)
    loss_tokens = m.bool()
    n = max(int(loss_tokens.sum()), 1)
    stats["masked"] = float(((weights == 0) & loss_tokens).sum()) / n
    stats["clipped"] = float((outside & loss_tokens).sum()) / n
    return Correction(weights=weights * m, stats=stats, sequence=sequence)


def _stats(diff: torch.Tensor, loss_tokens: torch.Tensor) -> dict[str, float]:
    log_w = diff[loss_tokens]
    if log_w.numel() == 0:
        return {"mismatch_kl": 0.0, "ratio_min": 1.0, "ratio_mean": 1.0, "ratio_max": 1.0}
    w = torch.exp(log_w)
    k3 = (w - 1) - log_w
    return {
        "mismatch_kl": float(k3.mean()),
        "ratio_min": float(w.min()),
        "ratio_mean": float(w.mean()),
        "ratio_max": float(w.max()),
    }


def refusal(stats: dict[str, float], max_mismatch: float) -> str | None:
    """Why a batch with these statistics must not be trained on, or None.

    A mismatch above ``max_mismatch`` (or a non-finite one) says the worker sampled from
    weights other than the version it names: a stale or failed weight load, another run's
    policy, a corrupted delta. Training on such a batch would push the policy toward whatever
    the worker held, so the trainer refuses it and generates the batch itself.

    The default bound (``RolloutConfig.max_mismatch`` = 0.5) was calibrated on the embedded
    task's tiny Qwen2 at the toy's settings (learning rate 5e-3, 8 prompts x 4 generations,
    5 completion tokens, distillation and replay on): one batch generated by the weights
    after step s, scored by the weights after step s + d, over 30 steps and 3 batches each.
    Within the bounds workers run at (d = 1 or 2) the mismatch was 0.03 to 0.10, and 0.22 at
    most (d = 2 in the first steps, where the policy moves fastest); d = 4 stayed under 0.2.
    The initial weights against the weights after 20 to 29 steps gave 0.98 to 1.18. 0.5 sits
    more than twice above the first and twice below the second. Two different random
    initialisations of the tiny model are only 0.02 apart (both near uniform), and the
    initial weights against step 10 give 0.45: the mismatch cannot tell such policies apart,
    which is why the trainer also checks the policy digest a batch names."""
    kl = stats.get("mismatch_kl", 0.0)
    if not math.isfinite(kl):
        return f"mismatch KL is {kl}: the behaviour log-probs are not finite"
    if kl > max_mismatch:
        return (
            f"mismatch KL {kl:.4g} exceeds max_mismatch {max_mismatch:g}: the worker "
            "sampled from other weights than the version it names"
        )
    return None
