"""A trainer replica's side of the rollout workers, joined to its composer trainer.

:func:`attach` (called by the composer job when the run has rollout workers) gives the
trainer a :class:`~crf.rollouts.source.StoreRolloutSource` (its generation batches come from
its workers when they are in time) and the DiLoCo callback a :class:`TrainerRollouts`, which
the callback drives at the trainer's own moments:

- ``begin`` (DiLoCo entered: the weights are the global ones) and every round start after
  it: the round's base weights go to the store (``policy/base/<r>``), then version ``step``;
- ``step_end``: every ``publish_every`` inner steps, version ``step`` (a delta on the rollout
  wire), deleting what no worker can still use; nothing after the last step, which no
  generation follows;
- ``take_counts``: the round's rollouts by source, for ``RoundMetrics.rollouts``;
- ``close``: the trainer's versions and its workers' acknowledgements go, and, once it has
  trained every step, the rollout batches queued for it (what its workers wrote ahead).

Publishing happens on the training thread, between two steps: a worker at staleness 0 must
find version ``s`` before the trainer's generation at step ``s``.
"""

from __future__ import annotations

import logging
from typing import Any

from crf.rollouts.config import RolloutConfig
from crf.rollouts.policy import PolicyPublisher
from crf.rollouts.source import StoreRolloutSource

log = logging.getLogger(__name__)


class TrainerRollouts:
    """The publisher and the source of one trainer replica (module docstring)."""

    def __init__(self, ctx: Any, rows: list[dict[str, Any]], cfg: RolloutConfig) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.sync_every = max(1, int(ctx.spec.sync_every))
        self.publisher = PolicyPublisher(
            ctx.store, ctx.rank, cfg, run_id=ctx.spec.run_id, sync_every=self.sync_every
        )
        # TRL's own step restarts at 0 when a replica resumes; versions count the run's
        self.source = StoreRolloutSource(
            ctx.store, ctx.rank, ctx.world_size, cfg, rows, digests=self.publisher,
            step_of=lambda: int(ctx.step),
        )  # fmt: skip
        self._round: int | None = None

    def begin(self, model: Any, step: int) -> None:
        """Training starts (or resumes) at ``step`` on the global weights."""
        self.publisher.drop_after(step)
        self._publish(model, step, force=True)

    def step_end(self, model: Any, step: int) -> None:
        self._publish(model, step, force=False)

    def _publish(self, model: Any, step: int, *, force: bool) -> None:
        total = getattr(self.ctx, "total_steps", None)
        if total is not None and step >= int(total):
            return  # trained every step: no generation left for a version (or a base) to serve
        r = step // self.sync_every
        if self._round != r and (force or step % self.sync_every == 0):
            self.publisher.start_round(r, model)
            self._round = r
        # after an outer step too: the rollouts of earlier versions are out of bounds now
        synced = self.cfg.sync_period > 0 and step % self.cfg.sync_period == 0
        if force or synced or step % max(1, self.cfg.publish_every) == 0:
            self.publisher.publish(step, model)

    def take_counts(self) -> dict[str, Any]:
        return self.source.take_counts()

    def close(self) -> None:
        try:
            self.publisher.close()
        except Exception as e:  # noqa: BLE001 - cleanup must not fail a finished run
            log.warning("could not delete the published policy versions: %s", e)
        total = getattr(self.ctx, "total_steps", None)
        if total is None or int(self.ctx.step) < int(total):
            return  # stopped short: a restart's workers still regenerate the returned rows
        try:  # trained every step: what its workers wrote ahead, no attempt of it takes
            self.source.queue.clear()
        except Exception as e:  # noqa: BLE001 - cleanup must not fail a finished run
            log.warning("could not delete the rollout batches left in the queue: %s", e)


def attach(ctx: Any, trainer: Any, callback: Any, rows: list[dict[str, Any]]) -> TrainerRollouts:
    """Give ``trainer`` its workers' batches and ``callback`` the publishing (module
    docstring); ``rows``: the replica's shard as ``build()`` made it (the batches' row ids
    index it)."""
    cfg = RolloutConfig.from_spec(ctx.spec)
    hooks = TrainerRollouts(ctx, rows, cfg)
    trainer.use_rollout_source(hooks.source, cfg)
    callback.rollouts = hooks
    return hooks
