"""A stand-in for PRIME-RL's loss contract, rebuilt from its source.

PRIME-RL is not on the package index and its trainer needs a GPU, so the tests of
crf.integrations.prime_rl call the adapter through this copy of what PRIME-RL's trainer does
around a custom loss (tests/test_integrations_prime_rl_real.py holds it against PRIME-RL's own
modules where a checkout is given: ``make test-prime-rl``). It follows PRIME-RL main at commit
559b44772e471d1538537b8805cc77f3824a5e64 (2026-08-21, tag v0.8.1.dev67, package version 0.8.0;
the newest release tag, v0.8.0, is older):

- :class:`LossInputs` / :class:`LossOutputs`: field for field, in order and with the same
  default, ``src/prime_rl/trainer/rl/loss.py``;
- :func:`route_to_ref_kl`: ``stamp_loss_routing`` of ``src/prime_rl/orchestrator/algo/routing.py``
  for the ``opd``/``opsd`` algorithms (``action_loss_type = "ref_kl"``), the only ones that
  attach reference log-probs: ``rl_weights`` 0.0 on every token, ``ref_kl_weights`` 1.0 on
  the trainable ones;
- :func:`pack`: ``_materialize_bin`` and ``pad_micro_batch`` of ``src/prime_rl/trainer/batch.py``
  for the fields the loss sees (a sample without reference log-probs gets ``0.0`` on every
  token once one sample of the micro-batch has them; a sample without an ``rl_weights`` stream
  gets ``STREAM_FILL["rl_weights"]`` = 1.0 once one has it, and ``ref_kl_weights`` 0.0;
  padding tokens get loss_mask False, 0.0 everywhere else, and join the last sample);
- :func:`rl_scale` and :func:`compute_rl_loss`: the rl component of ``compute_loss`` (loss.py)
  and the global token count ``train.py`` passes it as ``rl_scale``: per sample,
  ``LossInputs(loss_weights=None)`` on the full loss mask when there is no weight stream, else
  ``loss_mask & (rl_w != 0)`` with the stream, skipped when that is empty; the sum divided
  by ``rl_scale``.

The trainer's tensors are float32 (``torch.tensor(..., dtype=torch.float)`` in
``src/prime_rl/trainer/rl/data.py``), the loss mask bool; the trainer's log-probs are the
split of one packed ``(1, seq)`` tensor (``out["logprobs"].squeeze().split(sequence_lengths)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


@dataclasses.dataclass
class LossInputs:
    """Inputs for computing loss on a single sample (PRIME-RL's, field for field)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = dataclasses.field(default=None)


@dataclasses.dataclass
class LossOutputs:
    loss: Tensor
    metrics: dict[str, Tensor]


@dataclasses.dataclass
class Sample:
    """One trainable sample as the orchestrator ships it (the per-token lists of a
    ``TrainingSample``/``MicroBatch`` the loss reads)."""

    loss_mask: list[bool]
    inference_logprobs: list[float]
    advantages: list[float]
    ref_logprobs: list[float] | None = None
    rl_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


@dataclasses.dataclass
class MicroBatch:
    loss_mask: list[bool]
    inference_logprobs: list[float]
    advantages: list[float]
    ref_logprobs: list[float] | None
    rl_weights: list[float] | None
    ref_kl_weights: list[float] | None
    sequence_lengths: list[int]


def route_to_ref_kl(sample: Sample) -> Sample:
    """``stamp_loss_routing(sample, "ref_kl")``: an opd/opsd sample's trainable tokens go to
    PRIME-RL's ref_kl loss and none to the rl loss."""
    n = len(sample.loss_mask)
    sample.rl_weights = [0.0] * n
    sample.ref_kl_weights = [1.0 if m else 0.0 for m in sample.loss_mask]
    return sample


def pack(samples: Sequence[Sample], pad_to_multiple_of: int = 1) -> MicroBatch:
    """``_materialize_bin`` then ``pad_micro_batch``, for the fields above."""
    has_ref = any(s.ref_logprobs is not None for s in samples)
    has_rl = any(s.rl_weights is not None for s in samples)
    has_ref_kl = any(s.ref_kl_weights is not None for s in samples)
    mb = MicroBatch(
        [], [], [], [] if has_ref else None, [] if has_rl else None, [] if has_ref_kl else None, []
    )
    for s in samples:
        n = len(s.loss_mask)
        mb.loss_mask.extend(s.loss_mask)
        mb.inference_logprobs.extend(s.inference_logprobs)
        mb.advantages.extend(s.advantages)
        if mb.ref_logprobs is not None:
            mb.ref_logprobs.extend(s.ref_logprobs if s.ref_logprobs is not None else [0.0] * n)
        if mb.rl_weights is not None:
            mb.rl_weights.extend(s.rl_weights if s.rl_weights is not None else [1.0] * n)
        if mb.ref_kl_weights is not None:
            fill = [0.0] * n
            mb.ref_kl_weights.extend(s.ref_kl_weights if s.ref_kl_weights is not None else fill)
        mb.sequence_lengths.append(n)
    total = len(mb.loss_mask)
    pad = (pad_to_multiple_of - total % pad_to_multiple_of) % pad_to_multiple_of
    if pad_to_multiple_of > 1 and pad > 0:
        mb.advantages.extend([0.0] * pad)
        mb.loss_mask.extend([False] * pad)
        mb.sequence_lengths[-1] += pad
        mb.inference_logprobs.extend([0.0] * pad)
        if mb.ref_logprobs is not None:
            mb.ref_logprobs.extend([0.0] * pad)
        if mb.rl_weights is not None:
            mb.rl_weights.extend([0.0] * pad)
        if mb.ref_kl_weights is not None:
            mb.ref_kl_weights.extend([0.0] * pad)
    return mb


def _tensor(values: list[float] | None) -> Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float).unsqueeze(0)


def rl_scale(micro_batches: Sequence[MicroBatch]) -> int:
    """The rl component's global token count (train.py), at least 1."""
    total = 0
    for mb in micro_batches:
        mask = torch.tensor(mb.loss_mask)
        w = _tensor(mb.rl_weights)
        total += int((mask & (w[0] != 0)).sum()) if w is not None else int(mask.sum())
    return max(total, 1)


def compute_rl_loss(
    trainer_logprobs: Tensor,
    mb: MicroBatch,
    rl_loss_fn: Callable[[LossInputs], Any],
    scale: int,
) -> tuple[Tensor, dict[str, list[Tensor]], list[LossInputs]]:
    """The rl component of ``compute_loss`` on one packed micro-batch: ``trainer_logprobs``
    is the model's ``(1, seq)`` output. Returns the scaled loss, each metric's per-sample
    values, and the ``LossInputs`` the loss was called with."""
    lengths = mb.sequence_lengths
    inference = _tensor(mb.inference_logprobs).squeeze().split(lengths)
    advantages = _tensor(mb.advantages).squeeze().split(lengths)
    mask = torch.tensor(mb.loss_mask, dtype=torch.bool).unsqueeze(0).squeeze().split(lengths)
    ref = _tensor(mb.ref_logprobs)
    refs = ref.squeeze().split(lengths) if ref is not None else [None] * len(lengths)
    rl_w = _tensor(mb.rl_weights)
    weights = rl_w.squeeze().split(lengths) if rl_w is not None else [None] * len(lengths)
    trainer = trainer_logprobs.squeeze().split(lengths)
    loss = trainer[0].sum() * 0.0
    metrics: dict[str, list[Tensor]] = {}
    called: list[LossInputs] = []
    for t, i, r, a, m, w in zip(trainer, inference, refs, advantages, mask, weights, strict=True):
        if w is None:
            inputs = LossInputs(t, i, r, a, m, None)
        else:
            rl_mask = m & (w != 0)
            if not bool(rl_mask.any()):
                continue
            inputs = LossInputs(t, i, r, a, rl_mask, w)
        out = rl_loss_fn(inputs)
        called.append(inputs)
        loss = loss + out.loss
        for k, v in out.metrics.items():
            metrics.setdefault(k, []).append(v)
    return loss / scale, metrics, called
