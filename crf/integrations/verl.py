"""The composer loss in verl: a registered policy loss ``composer``, found through the
``verl.plugins`` entry point.

verl calls a policy loss as ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)`` on ``(batch, response_len)``
tensors and gives it nothing else of the batch. So the composer's distillation channel rides
in the advantages: :func:`fold_distillation` (the data-preparation step, run on the
``DataProto`` after the advantages are computed and before the actor update) adds
``alpha · (teacher_log_prob - old_log_prob)`` to each response token's advantage, the
on-policy reverse-KL(student || teacher) signal in its sampled-token form; the policy loss
is then verl's own PPO-clip term (``compute_policy_loss_vanilla``) over those advantages, with
the channel's size among the metrics. The teacher's log-probs of the response tokens (the
same policy conditioned on a hint, or any teacher) go in the batch key
:data:`TEACHER_KEY`. Replay (channel 3) needs paired sequences, which a verl micro-batch does
not keep together: it is not offered here.

``pip install crf`` puts this module in the ``verl.plugins`` entry-point group, which
``import verl`` loads in every process (driver and Ray workers), so
``actor_rollout_ref.actor.policy_loss.loss_mode=composer`` works with no import in the
user's code. Importing it without verl installed registers nothing.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TEACHER_KEY", "composer_policy_loss", "fold_distillation", "register"]

#: the batch key the data-preparation step reads: the teacher's log-probs of each response
#: token, shaped like ``old_log_probs``
TEACHER_KEY = "crf_teacher_log_prob"
#: the batch key where it records each token's distillation advantage (for the metrics)
DISTILL_KEY = "crf_distill_advantage"


def fold_distillation(batch: Any, alpha: float) -> Any:
    """Add ``alpha · (teacher - old) · response_mask`` to ``batch.batch["advantages"]`` in
    place (``batch`` is a verl ``DataProto``, or anything with a ``.batch`` mapping of those
    tensors). ValueError, before training, when the teacher's log-probs are missing or shaped
    unlike the advantages."""
    if alpha < 0:
        raise ValueError(f"distillation alpha must be >= 0 (got {alpha})")
    t = batch.batch
    if TEACHER_KEY not in t.keys():
        raise ValueError(
            f"the batch has no {TEACHER_KEY!r}: compute the teacher's log-probs of the response "
            "tokens (shaped like old_log_probs) into it before fold_distillation"
        )
    teacher, old, adv = t[TEACHER_KEY], t["old_log_probs"], t["advantages"]
    if teacher.shape != adv.shape:
        raise ValueError(
            f"{TEACHER_KEY} has shape {tuple(teacher.shape)} but the advantages "
            f"{tuple(adv.shape)}: one log-prob per response token"
        )
    extra = alpha * (teacher - old) * t["response_mask"].to(adv.dtype)
    t["advantages"] = adv + extra
    t[DISTILL_KEY] = extra
    return batch


def composer_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's PPO-clip loss over the (distillation-folded) advantages, plus the policy's
    mean log-ratio to the rollout on the response tokens."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip
    mask = response_mask.to(log_prob.dtype)
    kl = ((old_log_prob - log_prob).detach() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {**metrics, "crf/rollout_kl": kl.item()}


def register() -> bool:
    """Register ``composer`` with verl's policy-loss registry; False where verl is absent."""
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError:
        return False
    register_policy_loss("composer")(composer_policy_loss)
    return True


register()
