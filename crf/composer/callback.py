"""``DiLoCoCallback``: joins a Hugging Face / TRL trainer to a crf run.

- ``on_train_begin`` enters ``ctx.diloco(model, inner_optimizer)`` (kept open in an
  ``ExitStack`` until ``on_train_end``): the trainer's own optimizer becomes DiLoCo's inner
  optimizer, and every ``sync_every`` optimizer steps the replicas average pseudo-gradients.
  Across a replica's local ranks (``--procs-per-replica``) every rank's trainer has one: local
  rank 0's context exchanges, the others' (``LocalFollower``) take its weights after each
  outer step. The trainer's arguments then come from ``crf.replica.local_ranks.trainer_args``
  (each rank's share of the batch; DDP without per-forward collectives).
- ``on_step_end`` asks the trainer to log every optimizer step, and ``on_log`` then calls
  ``ctx.log_step(loss=..., reward=..., grpo_loss=..., distill_loss=..., replay_loss=...)``
  exactly once per inner optimizer step (metrics a step did not produce are left out), with
  ``reward_missing/<name>`` per reward: 1.0 when it gave no value in the step (all None/NaN).
- A step that fp16's gradient scaler skips (its gradients overflowed: the trainer does not
  call the optimizer's ``step``, so no step hook runs) still counts as an inner step, as it
  does in the trainer's own ``global_step`` and ``max_steps``: ``on_step_end`` takes an
  empty step of the inner optimizer (every gradient None: no weight or state changes) so
  that its hooks run, DiLoCo's sync included. Otherwise crf's step count would fall behind
  the trainer's, which stops at ``max_steps`` before the run's last sync. (torch's fused
  AdamW, the trainer's default ``optim``, takes the scaler into its own ``step`` and skips
  the update inside it: its hooks run, and nothing is added.)

- ``weights_replaced``: callables run whenever the model's weights changed outside the
  trainer's optimizer: after each sync's outer step (and a heal into a later round), and on
  entering DiLoCo (a restarted replica loads the global state). The composer job registers
  the trainer's ``weights_replaced`` there, so TRL's vLLM copy of the weights is marked stale
  and the next rollout pushes the new global weights first.

- ``rollouts``: with rollout workers, the trainer replica's publisher and rollout source
  (crf/rollouts/replica.py, set by the composer job): the policy is published on entering
  DiLoCo and every ``publish_every`` inner steps, and each round's rollout counts go into its
  record (``RoundMetrics.rollouts``). None without workers: nothing of it runs.

``ctx`` may be ``None`` (standalone/debug runs): the callback then only records the history.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

__all__ = ["DEFAULT_STEP_METRICS", "DiLoCoCallback"]

DEFAULT_STEP_METRICS = ("reward", "grpo_loss", "distill_loss", "replay_loss")

log = logging.getLogger(__name__)


class DiLoCoCallback(TrainerCallback):
    """See module docstring. ``history`` holds one dict per optimizer step."""

    def __init__(
        self,
        ctx: Any | None,
        metrics: tuple[str, ...] = DEFAULT_STEP_METRICS,
        round_eval: Callable[[], dict[str, float | None]] | None = None,
    ) -> None:
        """``round_eval``, if given, is called after the last inner step of each outer round
        (the weights are then the round's global model) and its metrics are logged with that
        step, so each round's record carries them (e.g. held-out exact match)."""
        self.ctx = ctx
        self.metrics = tuple(metrics)
        self.round_eval = round_eval
        self.history: list[dict[str, float]] = []
        self._stack: contextlib.ExitStack | None = None
        self._last_logged_step = -1
        self.weights_replaced: list[Callable[[], None]] = []
        self._ctx_step = 0
        self._inner: Any = None
        #: optimizer steps fp16's gradient scaler skipped (each counted as an inner step)
        self.skipped_steps = 0
        #: crf.rollouts.replica.TrainerRollouts with rollout workers, else None
        self.rollouts: Any = None
        #: a resumed trainer whose data loader drew from the random-number generators after
        #: ``diloco()`` restored them (its data resumes inside an epoch): restore them again
        #: at the first step (``ctx.restore_rng``), where the uninterrupted trainer was
        self.restore_rng_at_step = False

    # ------------------------------------------------------------------ DiLoCo
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._last_logged_step = state.global_step
        if self.ctx is None:
            return
        if model is None or optimizer is None:
            raise RuntimeError(
                "DiLoCoCallback needs the trainer's model and optimizer at on_train_begin "
                f"(got model={type(model).__name__}, optimizer={type(optimizer).__name__})"
            )
        # accelerate wraps the optimizer; DiLoCo hooks the torch optimizer whose step() runs
        inner = getattr(optimizer, "optimizer", optimizer)
        # across local ranks the trainer may hand over its DDP wrapper: DiLoCo (and the
        # weights local rank 0 shares) are the module's own parameters
        model = _unwrapped(model)
        self._inner = inner
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.ctx.diloco(model, inner))
        self._ctx_step = int(getattr(self.ctx, "step", 0) or 0)
        self._replaced()  # a restarted replica holds the global weights now
        if self.rollouts is not None:
            self.rollouts.begin(model, self._ctx_step)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.restore_rng_at_step and self.ctx is not None:
            self.restore_rng_at_step = False
            restore = getattr(self.ctx, "restore_rng", None)  # a local follower has none
            if restore is not None:
                restore()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Leave the DiLoCo context (idempotent); called by on_train_end."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        rollouts, self.rollouts = self.rollouts, None
        if rollouts is not None:
            rollouts.close()

    def _replaced(self) -> None:
        for listener in self.weights_replaced:
            listener()

    # ------------------------------------------------------------------ metrics
    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = True  # one log (hence one ctx.log_step) per optimizer step
        if self.ctx is not None:
            self._count_skipped(kwargs.get("optimizer"), state.global_step)
            step = int(getattr(self.ctx, "step", 0) or 0)
            if _synced(self.ctx, step) or step != self._ctx_step + 1:  # outer step, or a heal
                self._replaced()
            self._ctx_step = step
            if self.rollouts is not None:
                self.rollouts.step_end(_unwrapped(kwargs.get("model")), step)
        if self.ctx is not None and getattr(self.ctx, "step", 0) >= self.ctx.total_steps:
            control.should_training_stop = True  # healed into a later round: nothing left
        return control

    def _count_skipped(self, optimizer: Any, global_step: int) -> None:
        """After a step fp16's gradient scaler skipped (accelerate's ``step_was_skipped``),
        an empty step of the inner optimizer: its gradients are None (the trainer zeroed
        them), so torch's optimizers change nothing, and its step hooks count the step (and
        sync at the round's end) as for a step taken."""
        step = int(getattr(self.ctx, "step", 0) or 0)
        if self._inner is None or step != self._ctx_step:
            return
        if not getattr(optimizer, "step_was_skipped", False):
            return
        self.skipped_steps += 1
        say = log.warning if self.skipped_steps == 1 else log.info
        say(
            "step %d: fp16's gradient scaler skipped the optimizer step (the gradients "
            "overflowed; it lowers its scale and goes on); it counts as an inner step, as in "
            "the trainer's max_steps",
            global_step,
        )
        self._inner.zero_grad(set_to_none=True)
        self._inner.step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs or state.global_step <= self._last_logged_step:
            return
        self._last_logged_step = state.global_step
        record: dict[str, float] = {"step": float(state.global_step), "loss": float(logs["loss"])}
        for key in self.metrics:
            value = logs.get(key)
            if value is not None and math.isfinite(float(value)):
                record[key] = float(value)
        record.update(missing_rewards(logs))
        self.history.append(record)
        if self.ctx is not None:
            extra = {k: v for k, v in record.items() if k not in ("step", "loss")}
            if self.round_eval is not None and _at_round_end(self.ctx):
                # the round's global model (with fragments, not the replica's own weights)
                weights = getattr(self.ctx, "global_weights", contextlib.nullcontext)
                with weights():
                    scores = self.round_eval()
                extra.update({k: v for k, v in scores.items() if v is not None})
            if self.rollouts is not None and _at_round_end(self.ctx):
                self.ctx.log_rollouts(self.rollouts.take_counts())
            self.ctx.log_step(loss=record["loss"], **extra)


#: the round record's metric of a reward that gave no value: ``reward_missing/<name>``, the
#: share of the round's logged steps in which it gave None or NaN for every completion
MISSING = "reward_missing/"


def missing_rewards(logs: dict[str, Any]) -> dict[str, float]:
    """For each reward TRL logged (``rewards/<name>/mean``, a mean over the completions it
    scored): 1.0 when it gave no value in the step (None or NaN for every completion: TRL's
    "not applicable", left out of the reward trained on), else 0.0."""
    out = {}
    for key, value in logs.items():
        if key.startswith("rewards/") and key.endswith("/mean"):
            name = key.removeprefix("rewards/").removesuffix("/mean")
            given = isinstance(value, int | float) and math.isfinite(float(value))
            out[MISSING + name] = 0.0 if given else 1.0
    return out


def _unwrapped(model: Any) -> Any:
    """``model`` without DistributedDataParallel's wrapper (the same parameters)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _synced(ctx: Any, step: int) -> bool:
    """Inner step ``step`` ended with a sync (one fragment's, with Streaming DiLoCo): its
    outer step changed the weights."""
    spec = getattr(ctx, "spec", None)
    period = int(getattr(spec, "sync_period", 0) or getattr(spec, "sync_every", 0) or 0)
    return period > 0 and step > 0 and step % period == 0


def _at_round_end(ctx: Any) -> bool:
    """The inner step just taken closed an outer round (its sync is in the weights)."""
    every = int(getattr(getattr(ctx, "spec", None), "sync_every", 0) or 0)
    step = int(getattr(ctx, "step", 0) or 0)
    return every > 0 and step > 0 and step % every == 0
