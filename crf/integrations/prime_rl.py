"""The composer loss as a PRIME-RL custom loss (``[trainer.loss] type = "custom"``).

The contract, as PRIME-RL's ``src/prime_rl/trainer/rl/loss.py`` defines it (main at commit
559b4477, 2026-08-21, tag v0.8.1.dev67, package version 0.8.0; the newest release tag is
v0.8.0): ``compute_loss`` splits each packed micro-batch into its
samples and calls the loss once per sample, as ``fn(inputs, **kwargs) -> LossOutputs(loss,
metrics)``. ``inputs`` is a ``LossInputs`` of 1-D per-token float32 tensors of that sample:
``trainer_logprobs`` (with gradient), ``inference_logprobs`` (the rollout engine's),
``ref_logprobs`` (the reference or teacher model's, or None), ``advantages``, ``loss_mask``
(bool) and ``loss_weights`` (the rl weight stream, or None, which means 1.0 on every token).
This module reads them by attribute name only, so it needs no PRIME-RL import to be tested.

What :func:`composer_loss` computes, per token t of the sample:

- the GRPO term ``-r_t · A_t`` with the importance ratio ``r_t = exp(trainer - inference)``,
  on the tokens of ``loss_mask`` whose ratio lies in ``[ratio_low, ratio_high]`` (DPPO-style:
  a token outside the band is masked out, not clipped);
- channel 2, where the sample carries the teacher's log-probs of its tokens (``ref_logprobs``,
  or the attribute named by ``teacher_attr``): the on-policy reverse KL(student || teacher) in
  its sampled-token form, ``d_t = trainer_t - teacher_t`` as the value and
  ``d_t · ∇ trainer_t`` as the gradient (the score-function gradient of the reverse KL),
  weighted by ``distill_alpha``. The full-vocabulary forms of docs/composer.md (GKD's JSD for
  beta in (0, 1), TAID, the entropy gate of entropy-aware OPD) need both models' logits over
  the vocabulary, which the per-sample contract does not carry;
- channel 3 (replay) needs a chosen and a rejected sequence in one call; the contract hands
  the loss one sample, so ``replay_beta`` > 0 is refused (:func:`check_kwargs`).

Which samples reach the loss with a teacher. Only PRIME-RL's ``opd`` and ``opsd`` algorithms
attach reference log-probs, and both route their tokens to PRIME-RL's own ``ref_kl`` loss:
the orchestrator stamps such a sample ``rl_weights`` 0.0 on every token
(``stamp_loss_routing`` in ``src/prime_rl/orchestrator/algo/routing.py``), and
``compute_loss`` skips the rl loss for a sample with no rl token. So with PRIME-RL's own
algorithms this loss never sees a real teacher, and ``distill_alpha`` > 0 is refused
(:func:`check_config`); the channel serves an algorithm registered in code that trains rl
tokens and attaches reference log-probs. PRIME-RL packs several samples into one micro-batch and, as
soon as one of them carries reference log-probs, fills the others' with ``0.0`` on every
token (``_materialize_bin`` in ``src/prime_rl/trainer/batch.py``); padding tokens get ``0.0``
too (``pad_micro_batch``), behind a false ``loss_mask``. So a sample's teacher counts as
absent when the attribute is None or when it is exactly ``0.0`` on every token of the
sample's ``loss_mask``: a real teacher gives every sampled token a probability of exactly 1
on no real sample, while the fill always does. Such a sample gets the GRPO term only, and
``distill_samples`` (1 or 0 per sample) counts the ones that were taught. A single token
whose reference is exactly ``0.0`` in a sample that has a teacher stays a teacher's token.

Normalization. Each token's terms are multiplied by ``loss_weights`` (when given) and summed
over the sample, as PRIME-RL's own default loss does; the loss does not divide. PRIME-RL
divides outside the custom loss: ``compute_loss`` divides the summed rl losses by
``rl_scale``, the global count of rl tokens (``loss_mask & (rl_weights != 0)``, or
``loss_mask`` when there is no weight stream) over every micro-batch and data rank of the
step. ``loss_weights`` is a per-token weight, 1.0 unless the sample's producer sent others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BUILTIN_ALGORITHMS", "LossOutputs", "check_config", "check_kwargs", "composer_loss"]

#: the keyword arguments ``[trainer.loss.kwargs]`` may set, with their defaults
DEFAULTS: dict[str, Any] = {
    "ratio_low": 0.125,
    "ratio_high": 8.0,
    "distill_alpha": 0.0,
    "teacher_attr": "ref_logprobs",
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


#: PRIME-RL's algorithms (``AlgoConfig`` in its ``prime_rl.configs.algorithm``). None of them
#: hands the rl loss reference log-probs: ``opd`` and ``opsd`` attach them but route their
#: tokens to PRIME-RL's own ``ref_kl`` loss (module docstring).
BUILTIN_ALGORITHMS = frozenset(
    {"grpo", "max_rl", "rae", "hierarchical_grpo", "echo", "opd", "opsd", "sft"}
)


def _algorithms(config: Mapping[str, Any]) -> set[str] | None:
    """The algorithm types a whole ``rl`` config trains with (each ``[[orchestrator.train.
    source]]``'s ``algo``, else ``[orchestrator.algo]``, whose default is ``grpo``); None
    for a trainer table alone, which does not say."""
    if "trainer" not in config:
        return None
    orchestrator = config.get("orchestrator", {})
    default = orchestrator.get("algo", {}).get("type", "grpo")
    sources = orchestrator.get("train", {}).get("source", [])
    return {(s.get("algo") or {}).get("type", default) for s in sources} or {default}


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check a PRIME-RL config's ``[trainer.loss]`` table (``config`` is the whole parsed
    TOML, or its ``trainer`` table) before a run starts: it must name this loss and its
    kwargs must pass :func:`check_kwargs`; in a whole config, ``distill_alpha`` > 0 needs an
    algorithm that is not one of PRIME-RL's own, which never feed it (``BUILTIN_ALGORITHMS``).
    Returns the kwargs with defaults."""
    trainer = config.get("trainer", config)
    loss = trainer.get("loss", {})
    path = f"{__name__}.composer_loss"
    if loss.get("type") != "custom" or loss.get("import_path") != path:
        raise ValueError(f'[trainer.loss] must say type = "custom" and import_path = "{path}"')
    kw = check_kwargs(loss.get("kwargs", {}))
    algorithms = _algorithms(config)
    if float(kw["distill_alpha"]) > 0 and algorithms and algorithms <= BUILTIN_ALGORITHMS:
        raise ValueError(
            f"crf composer loss: distill_alpha > 0 does nothing with PRIME-RL's algorithm(s) "
            f"{', '.join(sorted(algorithms))}: only opd and opsd send reference log-probs, and "
            "their tokens train PRIME-RL's ref_kl loss, not this one; set distill_alpha = 0 "
            '(for distillation, use type = "opd" in [orchestrator.algo])'
        )
    return kw


def _teacher(inputs: Any, attr: str, mask: torch.Tensor) -> torch.Tensor | None:
    """The sample's teacher log-probs, None where it has none: the attribute is None, or
    it is PRIME-RL's pack fill (exactly 0.0 on every token of ``mask``; module docstring)."""
    if not hasattr(inputs, attr):
        fields = ", ".join(vars(inputs))
        raise ValueError(
            f"crf composer loss: teacher_attr = {attr!r} is no field of PRIME-RL's LossInputs "
            f"({fields}); its teacher log-probs are ref_logprobs"
        )
    teacher = getattr(inputs, attr)
    if teacher is None:
        return None
    with torch.no_grad():
        if not bool((teacher[mask] != 0).any()):
            return None
    return teacher


def composer_loss(inputs: Any, **kwargs: Any) -> Any:
    """One sample's loss (see the module docstring) and its metrics."""
    kw = check_kwargs(kwargs)
    trainer = inputs.trainer_logprobs
    dtype = trainer.dtype
    mask = inputs.loss_mask.to(torch.bool)
    weights = getattr(inputs, "loss_weights", None)
    weights = None if weights is None else weights.to(dtype)  # None: 1.0 on every token
    log_ratio = trainer - inputs.inference_logprobs.to(dtype)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        in_band = (ratio >= kw["ratio_low"]) & (ratio <= kw["ratio_high"])
    keep = (mask & in_band).to(dtype)
    per_token = -(ratio * inputs.advantages.to(dtype)) * keep
    if weights is not None:
        per_token = per_token * weights
    grpo = per_token.sum()
    loss = grpo
    n_mask = mask.sum().clamp(min=1)
    metrics = {
        "grpo_loss": grpo.detach(),
        "masked_out_of_band": ((mask & ~in_band).sum() / n_mask).detach().to(torch.float32),
    }
    alpha = float(kw["distill_alpha"])
    if alpha > 0:
        teacher = _teacher(inputs, kw["teacher_attr"], mask)
        distill = trainer.new_zeros(())
        if teacher is not None:
            diff = (trainer - teacher.to(dtype)).detach()
            # value d_t, gradient d_t * grad(trainer_t)
            per_token = (diff + (trainer - trainer.detach()) * diff) * mask.to(dtype)
            if weights is not None:
                per_token = per_token * weights
            distill = per_token.sum()
            loss = loss + alpha * distill
        metrics["distill_loss"] = distill.detach()
        taught = float(teacher is not None)
        metrics["distill_samples"] = torch.tensor(taught, device=trainer.device)
    return LossOutputs(loss=loss, metrics=metrics)
