"""Heartbeats written off the training thread.

A heartbeat is a small ``put`` to the store, about once a second and at every phase change.
On a remote store each one costs a round trip (tens of ms), and it shares the replica's
uplink with the exchange and the checkpoint uploads: written by the training thread, it
stalled training for as long as the link was busy (``bench/overlap.py`` measured 25 such
puts costing 2-3 s of a 9.6 s run, more than the whole exchange Streaming DiLoCo hides;
docs/performance.md). :class:`HeartbeatSender` writes them from its own thread instead.

Only the newest heartbeat matters (each one replaces the last in the store), so the sender
holds one slot: a heartbeat handed over while an older one waits replaces it, and memory and
store traffic stay bounded however slow the store is. A failed write never reaches training:
the ``write`` callback deals with it (the replica logs it and pauses its heartbeats).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class HeartbeatSender:
    """One thread writing the newest heartbeat handed to :meth:`send` (latest wins)."""

    def __init__(self, write: Callable[[dict[str, Any]], None]) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="crf-heartbeat", daemon=True)
        self._thread.start()

    def send(self, beat: dict[str, Any]) -> None:
        """Queue ``beat``, replacing one not written yet; returns at once."""
        with self._cond:
            self._pending = beat
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                beat, self._pending = self._pending, None
                self._busy = True
            try:
                self._write(beat)
            # whatever the store raises, the next heartbeat is still written
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the newest heartbeat is written; False if ``timeout_s`` ran out."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._pending is None and not self._busy, timeout=timeout_s
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the thread (a store that hangs is not waited for
        past ``timeout_s`` in all: the thread is a daemon, and the next heartbeat is written
        by the caller)."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
