"""The composer loss in verl: a registered policy loss ``composer``, found through the
``verl.plugins`` entry point, and the trainer step that folds the distillation channel in.

Checked against verl 0.9.1 (the wheel's sources). verl calls a policy loss as
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights) -> (loss, metrics)`` on ``(batch, response_len)`` tensors, with ``config``
the actor's config (``ActorConfig``/``FSDPActorConfig``, ``verl/workers/config/actor.py``),
and gives it nothing else of the batch (``verl/trainer/ppo/core_algos.py``). So the
composer's distillation channel rides in the advantages: :func:`fold_distillation` adds
``alpha · (teacher_log_prob - old_log_prob)`` to each response token's advantage of a
``DataProto``, the on-policy reverse-KL(student || teacher) signal in its sampled-token form;
the policy loss is then verl's own PPO-clip term (``compute_policy_loss_vanilla``, which
reads ``clip_ratio``, ``clip_ratio_low``/``clip_ratio_high``, ``clip_ratio_c`` and
``global_batch_info`` from that config) over those advantages, with the channel's size among
the metrics. Replay (channel 3) needs paired sequences, which a verl micro-batch does not
keep together: it is not offered here.

Where the fold runs: verl's ``RayPPOTrainer.fit`` (``verl/trainer/ppo/ray_trainer.py``, the
trainer of ``trainer.use_v1=false``) calls ``compute_advantage`` and then
``self._update_actor(batch)``, with only the critic's update (which reads the batch) between
them. :func:`composer_trainer_class` returns a subclass whose ``_update_actor`` folds the
channel into the batch first. The teacher's log-probs are read from ``teacher_key``:
``ref_log_prob`` (what verl's reference policy writes when it is on) by default, or any key
the user's data step fills.

Installing crf (``pip install 'composer-replication @ git+...'``) puts this module in the
``verl.plugins`` entry-point group, which ``import verl`` loads in every process (driver and
Ray workers) unless ``VERL_USE_EXTERNAL_PLUGINS`` says otherwise (``verl/__init__.py``:
``auto``, the default, loads every plugin; ``none`` loads none; ``a,b`` only those named, so
``crf`` must be among them). Importing it without verl installed registers nothing.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "TEACHER_KEY",
    "composer_policy_loss",
    "composer_trainer_class",
    "fold_distillation",
    "register",
]

#: where :func:`fold_distillation` reads the teacher's log-probs of each response token
#: (shaped like ``old_log_probs``) unless told otherwise: what verl's reference policy writes
TEACHER_KEY = "ref_log_prob"
#: the batch key where it records each token's distillation advantage (for the metrics)
DISTILL_KEY = "crf_distill_advantage"


def fold_distillation(batch: Any, alpha: float, teacher_key: str = TEACHER_KEY) -> Any:
    """Add ``alpha · (teacher - old) · response_mask`` to ``batch.batch["advantages"]`` in
    place (``batch`` is a verl ``DataProto``, or anything with a ``.batch`` mapping of those
    tensors), the teacher read from ``teacher_key``. ValueError, before training, when the
    teacher's log-probs are missing or shaped unlike the advantages."""
    if alpha < 0:
        raise ValueError(f"distillation alpha must be >= 0 (got {alpha})")
    t = batch.batch
    if teacher_key not in t.keys():
        raise ValueError(
            f"the batch has no {teacher_key!r}: turn on verl's reference policy (it writes "
            "ref_log_prob) or compute the teacher's log-probs of the response tokens (shaped "
            "like old_log_probs) into that key before fold_distillation"
        )
    teacher, old, adv = t[teacher_key], t["old_log_probs"], t["advantages"]
    if teacher.shape != adv.shape:
        raise ValueError(
            f"{teacher_key} has shape {tuple(teacher.shape)} but the advantages "
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


def composer_trainer_class(base: type | None = None) -> type:
    """A subclass of verl's ``RayPPOTrainer`` (or of ``base``) whose ``_update_actor`` first
    folds the distillation channel into the batch (:func:`fold_distillation`), after verl
    computed the advantages. Its ``distill_alpha`` and ``teacher_key`` come from the Hydra
    config's ``crf`` table when there is one (``+crf.distill_alpha=0.1``), else from the class
    attributes; with ``distill_alpha`` 0 it is verl's trainer unchanged. Construct it
    wherever verl's entry point constructs ``RayPPOTrainer`` (``verl/trainer/main_ppo_v0.py``,
    ``TaskRunner.run``)."""
    if base is None:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        base = RayPPOTrainer

    class ComposerPPOTrainer(base):  # type: ignore[misc, valid-type]
        """verl's PPO trainer with the composer's distillation channel in the advantages."""

        distill_alpha: float = 0.0
        teacher_key: str = TEACHER_KEY

        def _crf_option(self, name: str) -> Any:
            table = self.config.get("crf") if hasattr(self.config, "get") else None
            value = table.get(name) if table is not None else None
            return getattr(self, name) if value is None else value

        def _update_actor(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
            alpha = float(self._crf_option("distill_alpha"))
            if alpha > 0:
                fold_distillation(batch, alpha, str(self._crf_option("teacher_key")))
            return super()._update_actor(batch, *args, **kwargs)

    return ComposerPPOTrainer


def register() -> bool:
    """Register ``composer`` with verl's policy-loss registry; False where verl is absent."""
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError:
        return False
    register_policy_loss("composer")(composer_policy_loss)
    return True


register()
