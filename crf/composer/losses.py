"""The composer's extra loss channels, as plain tensor functions (no trainer state).

Channel 2 (distillation, on the policy's own rollouts; the teacher is the same policy
conditioned on a hint, under ``stopgrad``):

- ``generalized_jsd`` — the generalized Jensen-Shannon divergence of GKD (arXiv 2306.13649),
  token by token, exactly as ``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`` computes
  it: ``beta == 0`` is forward KL(teacher || student), ``beta == 1`` is reverse
  KL(student || teacher), otherwise ``beta·KL(T || M) + (1-beta)·KL(S || M)`` with the mixture
  ``M = beta·T + (1-beta)·S``; logits are divided by ``temperature`` first.
- ``taid_interpolate`` — TAID (arXiv 2501.16937): the target becomes
  ``softmax((1-t)·stopgrad(z_student) + t·z_teacher)``; ``TAIDSchedule`` is the paper's
  adaptive schedule for ``t`` (or a linear one).
- ``entropy_opd`` — entropy-aware on-policy distillation (arXiv 2603.07079): reverse
  KL(student || teacher) on every token plus forward KL(teacher || student) on the tokens where
  the teacher's entropy is at least a threshold.
- ``distill_per_token`` puts these together with the optional per-token clip.

Channel 3 (replay: a correct teacher trace is "chosen", the policy's own rollout "rejected"):

- ``dpo_loss`` — DPO (arXiv 2305.18290) against a frozen reference.
- ``simpo_loss`` — SimPO (arXiv 2405.14734), reference-free, length-normalised, as in
  ``trl.experimental.cpo`` with ``loss_type="simpo"`` (no label smoothing).

``compose_loss`` adds the channels to TRL's GRPO term. A channel whose weight is 0 or whose
inputs are ``None`` is skipped — never multiplied by zero — so the result is then bit-for-bit
the GRPO loss object itself.

See docs/composer.md for why these exact forms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from crf.composer.names import DISTILL_WRAPPERS, TAID_SCHEDULES

__all__ = [
    "ComposedLoss",
    "TAIDSchedule",
    "compose_loss",
    "distill_per_token",
    "dpo_loss",
    "entropy_opd",
    "generalized_jsd",
    "masked_row_mean",
    "sequence_logps",
    "simpo_loss",
    "taid_interpolate",
    "teacher_entropy",
]


# --------------------------------------------------------------------------- distillation
def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token generalized JSD of GKD, shape ``logits.shape[:-1]`` (sum over the vocabulary).

    Same arithmetic as TRL's ``GKDTrainer.generalized_jsd_loss`` before its reduction.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd beta must be in [0, 1] (got {beta})")
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-b), teacher_log_probs + torch.log(b)]),
            dim=0,
        )
        kl_teacher = F.kl_div(
            mixture_log_probs, teacher_log_probs, reduction="none", log_target=True
        )
        kl_student = F.kl_div(
            mixture_log_probs, student_log_probs, reduction="none", log_target=True
        )
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd.sum(-1)


def taid_interpolate(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, t: float | None
) -> torch.Tensor:
    """TAID's intermediate target logits ``(1-t)·stopgrad(z_s) + t·z_t``.

    Interpolating logits or log-probabilities gives the same softmax (they differ by a
    per-token constant). At ``t = 1`` the result equals ``teacher_logits`` exactly; at
    ``t = 0`` it is the detached student and carries nothing from the teacher.
    """
    if t is None:
        raise ValueError(
            "TAID needs an interpolation value t but none was given: set "
            "ComposerConfig.taid_t (constant), ComposerConfig.taid_schedule ('linear' or "
            "'adaptive'), or call trainer.set_taid_t(t) before the first training step"
        )
    t = float(t)
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"TAID t must be in [0, 1] (got {t})")
    return (1.0 - t) * student_logits.detach() + t * teacher_logits


def teacher_entropy(teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token entropy (nats) of ``softmax(teacher_logits / temperature)``."""
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def entropy_opd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    entropy_threshold: float = 1.0,
    forward_weight: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Entropy-aware OPD, per token:
    ``KL(S || T) + forward_weight · 1[H(T) >= entropy_threshold] · KL(T || S)``.

    Exactly zero where the student equals the teacher.
    """
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    reverse = F.kl_div(t, s, reduction="none", log_target=True).sum(-1)  # KL(S || T)
    forward = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)  # KL(T || S)
    with torch.no_grad():
        high = -(t.exp() * t).sum(-1) >= entropy_threshold
    return reverse + forward_weight * high.to(forward.dtype) * forward


def _soft_clip(per_token: torch.Tensor, clip: float) -> torch.Tensor:
    """Value ``min(x, clip)``; above the clip the gradient is scaled by ``clip / x`` (not
    zeroed), so an outlier token still pulls in the right direction with bounded weight."""
    scale = (clip / per_token.detach().clamp(min=torch.finfo(per_token.dtype).tiny)).clamp(max=1.0)
    return per_token * scale


def distill_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    jsd_beta: float = 0.5,
    temperature: float = 1.0,
    clip: float | None = None,
    wrapper: str = "none",
    taid_t: float | None = None,
    opd_entropy_threshold: float = 1.0,
    opd_forward_weight: float = 1.0,
) -> torch.Tensor:
    """Channel 2's per-token loss (``logits.shape[:-1]``); ``teacher_logits`` is treated as
    constant (pass it detached / computed under ``no_grad``)."""
    teacher_logits = teacher_logits.detach()
    if wrapper == "none":
        per_token = generalized_jsd(student_logits, teacher_logits, jsd_beta, temperature)
    elif wrapper == "taid":
        target = taid_interpolate(student_logits, teacher_logits, taid_t)
        per_token = generalized_jsd(student_logits, target, jsd_beta, temperature)
    elif wrapper == "entropy_opd":
        per_token = entropy_opd(
            student_logits, teacher_logits, opd_entropy_threshold, opd_forward_weight, temperature
        )
    else:
        raise ValueError(f"unknown distill wrapper {wrapper!r}; choose one of {DISTILL_WRAPPERS}")
    if clip is not None:
        per_token = _soft_clip(per_token, clip)
    return per_token


def masked_row_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's valid tokens, shape ``(B,)`` (0 for a row without tokens)."""
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@dataclass
class TAIDSchedule:
    """The interpolation value ``t`` of TAID over training.

    ``linear``: ``t = t_start + (t_end - t_start) · step / total_steps``.
    ``adaptive`` (the paper's Algorithm 1): with the relative change of the TAID loss
    ``δ = (J_prev - J) / J_prev``, momentum ``m ← momentum·m + (1 - momentum)·δ`` and
    ``t ← min(t_end, max(linear(step), t + step_size·sigmoid(m)·(1 - t)))``; the first update
    only records ``J``.
    """

    mode: str = "adaptive"
    t_start: float = 0.4
    t_end: float = 1.0
    momentum: float = 0.99
    step_size: float = 5e-4
    t: float = field(init=False)
    _prev_loss: float | None = field(default=None, init=False, repr=False)
    _m: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in TAID_SCHEDULES:
            raise ValueError(f"unknown TAID schedule {self.mode!r}; choose one of {TAID_SCHEDULES}")
        if not 0.0 <= self.t_start <= self.t_end <= 1.0:
            raise ValueError(
                f"TAID needs 0 <= t_start <= t_end <= 1 (got t_start={self.t_start}, "
                f"t_end={self.t_end})"
            )
        self.t = self.t_start

    def step(self, loss: float, step: int, total_steps: int) -> float:
        """Advance after optimizer step ``step`` (1-based) of ``total_steps``; returns new t."""
        progress = min(1.0, step / max(1, total_steps))
        linear = self.t_start + (self.t_end - self.t_start) * progress
        if self.mode == "linear":
            self.t = linear
            return self.t
        if self._prev_loss is None or not math.isfinite(self._prev_loss):
            self._prev_loss = float(loss)
            return self.t
        delta = (self._prev_loss - loss) / (self._prev_loss + 1e-15)
        self._m = self.momentum * self._m + (1 - self.momentum) * delta
        dt = self.step_size * (1.0 / (1.0 + math.exp(-self._m))) * (1.0 - self.t)
        self.t = min(self.t_end, max(linear, self.t + dt))
        self._prev_loss = float(loss)
        return self.t


# --------------------------------------------------------------------------- replay
def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Sum (or mean, ``average=True``) of ``log softmax(logits)[label]`` over ``mask``: ``(B,)``.

    ``logits[:, i]`` must be the prediction for ``labels[:, i]`` (already shifted).
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logps = torch.gather(F.log_softmax(logits, dim=-1), -1, labels.unsqueeze(-1))
    logps = logps.squeeze(-1) * mask.to(logps.dtype)
    total = logps.sum(-1)
    if average:
        return total / mask.to(logps.dtype).sum(-1).clamp(min=1.0)
    return total


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """Per-pair sigmoid DPO loss ``-log σ(β·[(π_c - ref_c) - (π_r - ref_r)])`` (sequence
    log-probabilities, summed over tokens). Equals ln 2 when the policy is the reference."""
    logits = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * logits)


def simpo_loss(
    policy_chosen_avg_logps: torch.Tensor,
    policy_rejected_avg_logps: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> torch.Tensor:
    """Per-pair SimPO loss ``-log σ(β·(avg_c - avg_r) - γ)`` on length-normalised
    log-probabilities; no reference model. (TRL's CPO writes it as
    ``-logsigmoid(β·((avg_c - avg_r) - γ/β))``.)"""
    logits = (policy_chosen_avg_logps - policy_rejected_avg_logps) - gamma / beta
    return -F.logsigmoid(beta * logits)


# --------------------------------------------------------------------------- composition
@dataclass
class ComposedLoss:
    """``total`` is what to backpropagate; the others are detached floats for logging
    (``None`` for a skipped channel)."""

    total: torch.Tensor
    grpo_loss: float
    distill_loss: float | None = None
    replay_loss: float | None = None

    def metrics(self) -> dict[str, float]:
        out = {"grpo_loss": self.grpo_loss}
        if self.distill_loss is not None:
            out["distill_loss"] = self.distill_loss
        if self.replay_loss is not None:
            out["replay_loss"] = self.replay_loss
        return out


def compose_loss(
    grpo_loss: torch.Tensor,
    *,
    distill: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
    alpha: float = 0.0,
    beta: float = 0.0,
    distill_scale: float | torch.Tensor = 1.0,
    replay_scale: float | torch.Tensor = 1.0,
    grpo_scale: float = 1.0,
) -> ComposedLoss:
    """``total = grpo_loss + alpha·distill·distill_scale + beta·replay·replay_scale``.

    ``distill`` / ``replay`` are the channels' mean losses over the rows of this micro-batch
    that carry the channel's inputs; the ``*_scale`` factors put them on the same footing as
    TRL's GRPO term under gradient accumulation (the trainer passes
    ``rows_here / rows_in_accumulation_window``, i.e. ``1 / gradient_accumulation_steps``
    when every micro-batch has the same number of rows). ``grpo_scale`` only undoes TRL's
    accumulation scaling for the logged ``grpo_loss``.

    A channel with weight 0 or without inputs is skipped (not multiplied by zero): with both
    skipped, ``total`` is ``grpo_loss`` itself.
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"channel weights must be >= 0 (got alpha={alpha}, beta={beta})")
    total = grpo_loss
    out = ComposedLoss(total=total, grpo_loss=float(grpo_loss.detach()) * grpo_scale)
    if alpha != 0 and distill is not None:
        total = total + alpha * (distill * distill_scale)
        out.distill_loss = float(distill.detach())
    if beta != 0 and replay is not None:
        total = total + beta * (replay * replay_scale)
        out.replay_loss = float(replay.detach())
    out.total = total
    return out
