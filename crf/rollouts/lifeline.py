"""When a rollout worker ends by itself although its trainer has no result.

A worker ends when its trainer has a result (crf/rollouts/worker.py). A trainer that never
writes one - killed, and restarted by nobody (a detached run: no driver watches it, and the
backend restarts nothing) - would leave its workers generating, on GPUs that serve no one,
until someone runs ``crf status`` or ``crf cancel`` or the backend's timeout stops them.
:class:`Lifeline` is what the worker asks instead, every ``CHECK_EVERY_S`` seconds of its
loop; it says to stop, in one line the worker logs and records, when:

- the run has ended: its launch's summary (``result.json``) is written, or ``crf cancel``
  asked for its launch to stop (``launches/<k>/cancel.json``), or a newer launch (``crf
  launch --resume``) has started workers of its own, one of which has its index;
- its trainer has shown no sign of life for ``grace_s`` (``--rollout-grace``): its
  heartbeat's ``seen_at`` (``updated_at`` or ``alive_at``) is that old, counted from the
  worker's own start at the earliest (a trainer restarted by a resume, or still starting,
  has the time of the grace to beat). A trainer writes its heartbeat again at least every
  ``ALIVE_EVERY_S`` (about 10 s) while its process lives, whatever it does - a long step, a
  held-out evaluation, a checkpoint, building its model, uploading the trained one
  (crf/replica/beacon.py) - so a slow trainer is never taken for a dead one; the grace
  covers the time a dead one takes to be restarted (by the driver, or by the backend).

A look that cannot read the store says nothing: a store outage is not a dead trainer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from crf import layout
from crf.store import ObjectNotFound

log = logging.getLogger(__name__)

#: how often the worker looks (a few small reads each time)
CHECK_EVERY_S = 5.0


@dataclass
class Lifeline:
    """Whether rollout worker's trainer ``rank`` (of launch ``launch``) may still use it."""

    store: Any
    rank: int
    grace_s: float
    #: the launch the worker belongs to (None: the run folder has no launch record)
    launch: int | None = None
    check_every_s: float = CHECK_EVERY_S
    #: the newest sign of life of the trainer, on the wall clock (from the worker's start)
    seen: float = field(default_factory=time.time)
    _looked: float | None = None

    @classmethod
    def of(cls, store: Any, rank: int, grace_s: float) -> Lifeline:
        """The lifeline of a worker starting now: its launch is the run's newest (the driver
        claims it before it starts the workers)."""
        try:
            launches = layout.launch_numbers(store)
        except Exception:  # noqa: BLE001 - unreadable now: the run-ended looks are skipped
            launches = []
        return cls(store, rank, grace_s, max(launches) if launches else None)

    def why_stop(self) -> str | None:
        """None while the worker should go on; else why it should end (one line). Reads
        the store at most every ``check_every_s``."""
        now = time.monotonic()
        if self._looked is not None and now - self._looked < self.check_every_s:
            return None
        self._looked = now
        try:
            return self._run_ended() or self._trainer_gone()
        except Exception as e:  # noqa: BLE001 - the store cannot say now: no news
            log.debug("could not look at the trainer's liveness: %s", e)
            return None

    def _run_ended(self) -> str | None:
        if self.launch is None:
            return None
        newer = [k for k in layout.launch_numbers(self.store) if k > self.launch]
        if newer:
            return f"the run was resumed (launch {max(newer)}), with workers of its own"
        if self.store.object_exists(layout.cancel_key(self.launch)):
            return f"the run was cancelled (launch {self.launch})"
        try:
            summary = self.store.get_json(layout.RESULT)
        except ObjectNotFound:
            return None
        if isinstance(summary, dict) and summary.get("launch", 0) == self.launch:
            return f"the run has ended ({summary.get('status')}): its summary is written"
        return None

    def _trainer_gone(self) -> str | None:
        try:
            beat = layout.Heartbeat.from_dict(self.store.get_json(layout.heartbeat_key(self.rank)))
            self.seen = max(self.seen, beat.seen_at)
        except ObjectNotFound:
            pass  # none yet: silent since the worker started
        silent = time.time() - self.seen
        if silent <= self.grace_s:
            return None
        return (
            f"its trainer (replica {self.rank}) has shown no sign of life for {silent:.0f} s "
            f"(--rollout-grace {self.grace_s:g} s) and has no result: it is gone, and nobody "
            "restarted it"
        )
