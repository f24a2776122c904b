"""The composer loss as a PRIME-RL custom loss (``[trainer.loss] type = "custom"``).

PRIME-RL calls the loss once per sample, as ``fn(inputs, **kwargs) -> LossOutputs(loss,
metrics)``, where ``inputs`` carries 1-D per-token tensors of that sample:
``trainer_logprobs`` (with gradient), ``inference_logprobs`` (the rollout engine's),
``reference_logprobs`` (or None), ``advantages``, ``loss_mask`` and ``loss_weights``. This
module reads them by attribute name only, so it needs no PRIME-RL import to be tested.

What :func:`composer_loss` computes, per token t of the sample:

- the GRPO term ``-r_t · A_t`` with the importance ratio ``r_t = exp(trainer - inference)``,
  on the tokens of ``loss_mask`` whose ratio lies in ``[ratio_low, ratio_high]`` (DPPO-style:
  a token outside the band is masked out, not clipped);
- channel 2, where the sample carries the teacher's log-probs of its tokens
  (``reference_logprobs``, or the attribute named by ``teacher_attr``): the on-policy reverse
  KL(student || teacher) in its sampled-token form, ``d_t = trainer_t - teacher_t`` as the
  value and ``d_t · ∇ trainer_t`` as the gradient (the score-function gradient of the reverse
  KL), weighted by ``distill_alpha``. The full-vocabulary forms of docs/composer.md (GKD's
  JSD for beta in (0, 1), TAID, the entropy gate of entropy-aware OPD) need both models'
  logits over the vocabulary, which the per-sample contract does not carry;
- channel 3 (replay) needs a chosen and a rejected sequence in one call; the contract hands
  the loss one sample, so ``replay_beta`` > 0 is refused (:func:`check_kwargs`).

Each token's terms are weighted by ``loss_weights`` and summed: PRIME-RL puts its
normalization (per token, per sequence) in those weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LossOutputs", "check_config", "check_kwargs", "composer_loss"]

#: the keyword arguments ``[trainer.loss.kwargs]`` may set, with their defaults
DEFAULTS: dict[str, Any] = {
    "ratio_low": 0.125,
    "ratio_high": 8.0,
    "distill_alpha": 0.0,
    "teacher_attr": "reference_logprobs",
    "replay_beta": 0.0,
}


@dataclasses.dataclass
class _LossOutputs:
    """What the loss returns where PRIME-RL is not installed: its ``LossOutputs`` fields."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _outputs_class() -> Any:
    try:
        from prime_rl.trainer.rl.loss import LossOutputs as theirs  # type: ignore[import-not-found]
    except ImportError:
        return _LossOutputs
    return theirs


LossOutputs = _outputs_class()


def check_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The loss's options with defaults filled in; ValueError (one line, what to fix) for an
    unknown name, a bad band, a negative weight, or replay, which the contract cannot feed."""
    unknown = sorted(set(kwargs) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"crf composer loss: unknown option(s) {', '.join(unknown)} in [trainer.loss.kwargs]"
            f"; it takes {', '.join(DEFAULTS)}"
        )
    kw = {**DEFAULTS, **kwargs}
    low, high = float(kw["ratio_low"]), float(kw["ratio_high"])
    if not 0.0 <= low < 1.0 < high:
        raise ValueError(
            f"crf composer loss: need 0 <= ratio_low < 1 < ratio_high (got {low}, {high})"
        )
    if float(kw["distill_alpha"]) < 0:
        raise ValueError(
            f"crf composer loss: distill_alpha must be >= 0 (got {kw['distill_alpha']})"
        )
    if float(kw["replay_beta"]) != 0:
        raise ValueError(
            "crf composer loss: replay (channel 3) needs chosen/rejected pairs in one call, but "
            "PRIME-RL's loss sees one sample at a time: set replay_beta = 0"
        )
    return kw


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check a PRIME-RL config's ``[trainer.loss]`` table (``config`` is the whole parsed
    TOML, or its ``trainer`` table) before a run starts: it must name this loss and its
    kwargs must pass :func:`check_kwargs`. Returns the kwargs with defaults."""
    trainer = config.get("trainer", config)
    loss = trainer.get("loss", {})
    path = f"{__name__}.composer_loss"
    if loss.get("type") != "custom" or loss.get("import_path") != path:
        raise ValueError(f'[trainer.loss] must say type = "custom" and import_path = "{path}"')
    return check_kwargs(loss.get("kwargs", {}))


def composer_loss(inputs: Any, **kwargs: Any) -> Any:
    """One sample's loss (see the module docstring) and its metrics."""
    kw = check_kwargs(kwargs)
    trainer = inputs.trainer_logprobs
    mask = inputs.loss_mask.to(torch.bool)
    weights = inputs.loss_weights.to(trainer.dtype)
    log_ratio = trainer - inputs.inference_logprobs.to(trainer.dtype)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        in_band = (ratio >= kw["ratio_low"]) & (ratio <= kw["ratio_high"])
    keep = (mask & in_band).to(trainer.dtype)
    grpo = (-(ratio * inputs.advantages.to(trainer.dtype)) * keep * weights).sum()
    loss = grpo
    n_mask = mask.sum().clamp(min=1)
    metrics = {
        "grpo_loss": grpo.detach(),
        "masked_out_of_band": ((mask & ~in_band).sum() / n_mask).detach().to(torch.float32),
    }
    teacher = getattr(inputs, kw["teacher_attr"], None)
    if float(kw["distill_alpha"]) > 0 and teacher is not None:
        diff = (trainer - teacher.to(trainer.dtype)).detach()
        # value d_t, gradient d_t * grad(trainer_t)
        per_token = diff + (trainer - trainer.detach()) * diff
        w = mask.to(trainer.dtype) * weights
        distill = (per_token * w).sum()
        loss = loss + float(kw["distill_alpha"]) * distill
        metrics["distill_loss"] = distill.detach()
    return LossOutputs(loss=loss, metrics=metrics)
