"""The trainer's side of rollouts in: where each generation batch comes from.

The composer trainer asks its :class:`RolloutSource` at every generation for a batch of
``rows`` rollouts; :class:`StoreRolloutSource` answers from the trainer's queue in the store
(crf/rollouts/batches.py): the oldest batch at most ``max_staleness`` inner steps behind the
trainer, waiting up to ``wait_s`` for one while a worker of this trainer is alive. When none
comes, it answers None and the trainer generates the batch itself: workers speed a run up,
the run never depends on them. A batch whose policy digest is not what the trainer published
for its version is refused (the worker generated with other weights), as is one the trainer's
correction refuses (mismatch KL above the bound); both are counted, and the trainer then
generates locally.

It also keeps the round's counts, which the replica writes into ``RoundMetrics.rollouts``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from crf import layout
from crf.rollouts.batches import RolloutBatch, RolloutQueue
from crf.rollouts.config import RolloutConfig, in_bound
from crf.rollouts.polling import Poll
from crf.store import ObjectNotFound, RunStore

log = logging.getLogger(__name__)

#: a worker whose heartbeat is older than this is not waited for (it died or was preempted)
WORKER_SILENT_S = 30.0
#: while waiting for a batch: the longest pause between two looks at the queue, and how
#: often the workers' heartbeats are read
MAX_POLL_S = 0.5
ALIVE_EVERY_S = 1.0


class RolloutSource(Protocol):
    """What the composer trainer asks for its generation batches."""

    def take(self, step: int, rows: int) -> tuple[RolloutBatch, list[dict]] | None:
        """A batch for the generation at the trainer's global inner step ``step`` holding
        ``rows`` rollouts, and its dataset rows (one dict per rollout); None: generate
        locally."""
        ...

    def used(self, batch: RolloutBatch, stats: dict[str, float]) -> None:
        """The trainer trained on ``batch``; ``stats``: its correction's statistics."""
        ...

    def refused(self, batch: RolloutBatch, reason: str) -> None: ...

    def local(self, rows: int) -> None:
        """The trainer generated ``rows`` rollouts itself."""
        ...

    def expected_digest(self, version: int) -> str | None:
        """The digest of the weights the trainer published as ``version``."""
        ...


@dataclass
class RolloutCounts:
    """One round's rollouts by source, for ``RoundMetrics.rollouts``."""

    workers: int = 0
    local: int = 0
    refused: int = 0
    returned: int = 0
    staleness: list[int] = field(default_factory=list)
    per_worker: dict[int, int] = field(default_factory=dict)
    #: per worker, each used batch's correction statistics
    stats: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    #: seconds the trainer spent looking for (and waiting for) its workers' batches
    wait_s: float = 0.0

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "workers": self.workers,
            "local": self.local,
            "refused": self.refused,
            "returned": self.returned,
            "staleness_mean": (
                sum(self.staleness) / len(self.staleness) if self.staleness else None
            ),
            "staleness_max": max(self.staleness) if self.staleness else None,
            "wait_s": round(self.wait_s, 3),
        }
        for w in sorted(self.per_worker):
            out[f"w{w}"] = self.per_worker[w]
        correction = {f"w{w}": _summarize(s) for w, s in sorted(self.stats.items()) if s}
        if correction:
            out["correction"] = correction
        return out


def _summarize(stats: list[dict[str, float]]) -> dict[str, float]:
    """Per statistic: the min of minima, the max of maxima, the mean of the rest."""
    out: dict[str, float] = {}
    for name in {k for s in stats for k in s}:
        values = [float(s[name]) for s in stats if name in s]
        if name.endswith("_min") or name == "min":
            out[name] = min(values)
        elif name.endswith("_max") or name == "max":
            out[name] = max(values)
        else:
            out[name] = sum(values) / len(values)
    return out


class StoreRolloutSource:
    """:class:`RolloutSource` on the run's store, for trainer replica ``rank``."""

    def __init__(
        self,
        store: RunStore,
        rank: int,
        world_size: int,
        cfg: RolloutConfig,
        rows: list[dict[str, Any]],
        *,
        digests: Any = None,
        step_of: Callable[[], int] | None = None,
        poll_s: float = 0.05,
    ) -> None:
        """``rows``: the trainer's shard as ``build()`` makes it (a batch's row ids index it);
        ``digests``: what answers ``expected_digest`` (the trainer's PolicyPublisher); ``step_of``:
        the replica's global inner step, used in place of the step ``take`` is given (a resumed
        trainer's TRL counts from 0)."""
        self.store = store
        self.rank = rank
        self.cfg = cfg
        self.rows = list(rows)
        self.workers = cfg.workers_of(rank, world_size)
        self.queue = RolloutQueue(store, rank)
        self.digests = digests
        self.poll_s = poll_s
        self.step_of = step_of
        self.counts = RolloutCounts()
        self.total = RolloutCounts()
        #: the step the batch in use was taken at (its staleness is counted from there)
        self._taken_at: dict[str, int] = {}
        #: the cursor last written (crf/rollouts/batches.py ``set_cursor``)
        self._cursor: int | None = None
        #: how long taking a batch has typically waited (paces the looks while waiting)
        self._wait_s: float | None = None

    # ------------------------------------------------------------------ the protocol
    def take(self, step: int, rows: int) -> tuple[RolloutBatch, list[dict]] | None:
        if self.step_of is not None:
            step = self.step_of()
        # the workers pace to the cursor: the first queued batch serves ``step``
        self._set_cursor(step)
        claimed = lambda: self._set_cursor(step + 1)  # noqa: E731 - before it leaves the queue
        started = time.monotonic()
        deadline = started + max(0.0, self.cfg.wait_s)
        poll = Poll(first=self.poll_s, cap=MAX_POLL_S)
        poll.interval = self._wait_s  # pause at most a quarter of a typical wait
        alive_checked, alive = 0.0, True
        hopeless = not self._may_come(step)
        while True:
            batch, returned, bad = self.queue.oldest_within(
                step, self.cfg.max_staleness, rows, on_claim=claimed,
                sync_period=self.cfg.sync_period,
            )  # fmt: skip
            for b in returned:
                self.counts.returned += 1
                self.total.returned += 1
                log.info("step %d: worker %d's batch %d (version %d) came too late: returned",
                         step, b.worker, b.seq, b.version)  # fmt: skip
            for (w, seq), reason in bad:
                self._count_refused()
                log.warning("step %d: worker %d's batch %d refused: %s", step, w, seq, reason)
            if batch is not None:
                why = self._unusable(batch)
                if why is None:
                    self._taken_at = {batch.key: step}
                    waited = self._waited(started)
                    self._wait_s = waited if self._wait_s is None else (
                        0.7 * self._wait_s + 0.3 * waited)  # fmt: skip
                    return batch, [dict(self.rows[i]) for i in batch.row_ids]
                self.refused(batch, why)
                if self._unpublished(batch):  # its rows are still owed: made again
                    self.queue.return_rows(batch)
                    log.info("worker %d's batch %d: its rows go back to it", batch.worker,
                             batch.seq)  # fmt: skip
                self._set_cursor(step)  # still looking for step's batch
                continue
            now = time.monotonic()
            if now - alive_checked >= ALIVE_EVERY_S:  # a few requests a second, not more
                alive, alive_checked = self._worker_alive(), now
            if now >= deadline or not alive or hopeless:
                self._set_cursor(step + 1)  # the trainer generates step's batch itself
                self._waited(started)
                return None
            poll.sleep(at_most=deadline - now)

    def used(self, batch: RolloutBatch, stats: dict[str, float]) -> None:
        for c in (self.counts, self.total):
            c.workers += len(batch)
            c.per_worker[batch.worker] = c.per_worker.get(batch.worker, 0) + len(batch)
            c.staleness.append(max(0, self._taken_at.get(batch.key, batch.version) - batch.version))
            c.stats.setdefault(batch.worker, []).append(dict(stats))

    def refused(self, batch: RolloutBatch, reason: str) -> None:
        self._count_refused()
        log.warning("worker %d's batch %d (version %d) refused: %s",
                    batch.worker, batch.seq, batch.version, reason)  # fmt: skip

    def local(self, rows: int) -> None:
        self.counts.local += rows
        self.total.local += rows

    def expected_digest(self, version: int) -> str | None:
        if self.digests is None:
            return None
        return self.digests.expected_digest(version)

    # ------------------------------------------------------------------ the replica's
    def take_counts(self) -> dict[str, Any]:
        """The counts since the last call (one round's), as ``RoundMetrics.rollouts``."""
        counts, self.counts = self.counts, RolloutCounts()
        return counts.record()

    # ------------------------------------------------------------------ internals
    def _set_cursor(self, step: int) -> None:
        """Tell the workers which step the first queued batch serves (one small write, only
        when it changes: about one per step)."""
        if self._cursor != step:
            self.queue.set_cursor(step)
            self._cursor = step

    def _may_come(self, step: int) -> bool:
        """Whether a batch for ``step`` may still come: this trainer published a version
        within the bound of it (with ``--publish-every`` beyond ``--max-staleness`` + 1 some
        steps have none, and waiting ``--rollout-wait`` for them would be in vain). Without
        the publisher's digests (tests), always."""
        if self.digests is None:
            return True
        low = max(0, step - self.cfg.max_staleness)
        return any(
            self.expected_digest(v) is not None
            for v in range(low, step + 1)
            if in_bound(v, step, self.cfg.max_staleness, self.cfg.sync_period)
        )

    def _waited(self, started: float) -> float:
        """Count the seconds since ``started`` as time spent on the workers' batches."""
        waited = time.monotonic() - started
        self.counts.wait_s += waited
        self.total.wait_s += waited
        return waited

    def _count_refused(self) -> None:
        self.counts.refused += 1
        self.total.refused += 1

    def _unusable(self, batch: RolloutBatch) -> str | None:
        """Why ``batch`` cannot be this trainer's (None: it may be): rows it does not have, or
        a version this trainer attempt never published (an earlier attempt's, or deleted).
        Whether its contents are what the trainer would have sampled (tokenizer, sampling,
        the published digest, the prompts' tokens, the mismatch) is the intake's to judge
        (crf/rollouts/intake.py), in one place."""
        if any(not 0 <= i < len(self.rows) for i in batch.row_ids):
            return f"row ids outside the trainer's {len(self.rows)} rows"
        if self._unpublished(batch):
            return (
                f"version {batch.version} was not published by this trainer (an earlier "
                "attempt's, or deleted)"
            )
        return None

    def _unpublished(self, batch: RolloutBatch) -> bool:
        """Whether ``batch`` was made from a version this trainer attempt never published
        (an earlier attempt's, or deleted). Its rows are fine, and its worker makes them
        again from a version this attempt publishes (given back, not lost for the pass);
        a batch refused for what it holds would be made the same way again, so it is not."""
        return self.digests is not None and self.expected_digest(batch.version) is None

    def _worker_alive(self) -> bool:
        """Whether one of this trainer's workers is running (worth waiting for). A worker
        still ``starting`` (building its model: minutes for a large one) is waited for only
        until this trainer has trained on a worker's batch: at first, waiting for the first
        batch is the point; after that a starting worker is a restarted one (or one slower
        to start than its peers), and each step would wait ``--rollout-wait`` for it in vain
        before generating its batch itself anyway."""
        now = time.time()
        for w in self.workers:
            try:
                state = layout.WorkerState.from_dict(
                    self.store.get_json(layout.worker_state_key(w))
                )
            except (ObjectNotFound, ValueError, TypeError):
                continue
            if state.phase in ("done", "failed"):
                continue
            if state.phase == "starting" and self.total.workers:
                continue
            if now - state.updated_at <= WORKER_SILENT_S:
                return True
        return False
