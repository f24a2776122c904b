"""Where a round's time goes, phase by phase, as its own thread lived it.

A round's steps overlap (downloads run on transfer threads while the round's thread adds
parts up), so per-thread sums would count the same second twice. The clock times only the
round's own thread: each second of its wall time goes to the innermost phase it is in (a
nested phase pauses the one around it), and what no phase covers is the rest of the round's
``seconds``. The result's ``phases`` and a replica's round record (``phases_s``) carry the
totals; the record adds ``snapshot``, the training thread's checkpoint copies since the last
record (``crf/exchange/checkpoints.py``), and ``outer``, DiLoCo's own work at the sync
(``crf/replica/context.py``); ``bench/gpu.py`` reads them for its breakdown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: the phases, in a round's order: device-to-host copies, encoding and checksums, uploads,
#: waiting for peers (the quorum, a shard not published yet), downloads, decoding and adding
#: parts up (and writing the average), host-to-device copies
PHASES = ("d2h", "encode", "upload", "wait", "download", "decode", "h2d")


class PhaseClock:
    """Seconds per phase of one round, timed on the thread that created the clock."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self._thread = threading.get_ident()
        self._stack: list[list] = []  # [phase, since]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside the block as ``name`` (only on the clock's own thread)."""
        if threading.get_ident() != self._thread:
            yield
            return
        now = time.monotonic()
        if self._stack:
            self._charge(self._stack[-1], now)
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.monotonic()
            self._charge(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1] = now

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` measured elsewhere as ``name``."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def close(self) -> None:
        """The round is over: its totals, to 0.1 ms."""
        for k, v in self.totals.items():
            self.totals[k] = round(v, 4)

    def _charge(self, entry: list, now: float) -> None:
        self.add(entry[0], now - entry[1])
        entry[1] = now
