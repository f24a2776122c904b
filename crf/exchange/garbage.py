"""Garbage collection of a round's objects: a replica drops its own contribution once the
round's averages are out, and old round folders go after ``keep_rounds``."""

from __future__ import annotations

import logging

from crf import layout
from crf.exchange.transfers import ExchangeState
from crf.layout import contrib_key
from crf.store import StoreError

log = logging.getLogger(__name__)


class GarbageCollection(ExchangeState):
    """What a round leaves in the store, removed."""

    def _drop_contributions(self, r: int, name: str) -> None:
        """Delete this replica's contribution to round r (and any shard it published after a
        degraded quorum). Every reduced shard exists by now, so no reducer needs them: an
        owner's late first attempt finds them gone and defers to the published average
        (:class:`_AlreadyReduced`), and the quorum is decided, so nobody reads the
        manifest."""
        for key in (contrib_key(r, name), layout.held_dir(r, self.rank)):
            try:
                self.store.delete(key)
            except (StoreError, OSError) as e:  # only disk space is at stake; the GC retries
                log.debug("round %d: could not drop %s: %s", r, key, e)

    def collect_garbage(self, current_round: int) -> list[int]:
        """Delete rounds older than ``keep_rounds`` before ``current_round``; returns them."""
        removed = []
        for k in layout.round_numbers(self.store):
            if k <= current_round - self.config.keep_rounds:
                self.store.delete(layout.round_dir(k))
                removed.append(k)
        return sorted(removed)
