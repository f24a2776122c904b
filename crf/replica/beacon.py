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

A replica writes a heartbeat when something happens (a step, a phase, a wait in the
exchange), so one long step - a long generation, a held-out evaluation, building a large
model, uploading the trained one - would leave it silent for as long as the step lasts.
:class:`HeartbeatWriter` keeps it alive meanwhile: from a thread of its own it writes the
newest heartbeat again with a fresh ``alive_at`` (never a fresh ``updated_at``, which stays
the time of the news it carries) whenever none was written for ``ALIVE_EVERY_S``. A reader
that asks whether the replica's process still lives (a rollout worker: crf/rollouts/
worker.py; ``crf runs``: crf/launcher/liveness.py) reads ``Heartbeat.seen_at``, the newer of
the two, and so does the exchange for a member of the round before
(crf/exchange/membership.py ``_gone_quiet``); whether a replica that is no member shows life
is its news alone (``updated_at``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: the longest a live replica's heartbeat goes without being written (``alive_at``), give or
#: take half of it
ALIVE_EVERY_S = 10.0
#: how long heartbeats pause after one failed to write
HEARTBEAT_BACKOFF_S = 30.0


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


class HeartbeatWriter:
    """Writes one replica's heartbeats, one at a time whatever thread hands them over, and
    keeps the newest alive while nothing newer comes (module docstring). A failed write is
    logged and pauses heartbeats for ``HEARTBEAT_BACKOFF_S`` (``pace.paused_until``): a
    heartbeat must never kill training, nor slow every step."""

    def __init__(
        self, put: Callable[[dict[str, Any]], None], pace: Any, every_s: float | None = None
    ) -> None:
        every_s = ALIVE_EVERY_S if every_s is None else every_s
        self._put = put
        #: when the next heartbeat is due, and until when they pause after a failed write
        self.pace = pace
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None
        self._written = time.monotonic()
        self._closed = False
        # the thread holds this writer weakly: a writer nobody holds any more (a context a
        # test dropped) stops its thread rather than write into a folder long gone
        ref = weakref.ref(self)
        thread = threading.Thread(target=_keep_alive, args=(ref, every_s), daemon=True,
                                  name="crf-heartbeat-alive")  # fmt: skip
        thread.start()

    def write(self, beat: dict[str, Any]) -> None:
        with self._lock:
            self._last = beat
            self._put_now(beat)

    def refresh(self, every_s: float) -> None:
        """Write the newest heartbeat again, with ``alive_at`` now, if none was written for
        ``every_s`` (and heartbeats are not paused)."""
        with self._lock:
            now = time.time()
            quiet = time.monotonic() - self._written >= every_s
            if self._closed or self._last is None or not quiet or now < self.pace.paused_until:
                return
            self._put_now({**self._last, "alive_at": now})

    def close(self) -> None:
        """No more refreshes (the final heartbeat is written: done or failed)."""
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _put_now(self, beat: dict[str, Any]) -> None:
        self._written = time.monotonic()
        try:
            self._put(beat)
        # whatever the store or its SDK raises (and it must not slow every step either: it
        # pauses after a failure)
        except Exception as e:
            log.warning("heartbeat failed (pausing heartbeats for %.0f s): %s",
                        HEARTBEAT_BACKOFF_S, e)  # fmt: skip
            self.pace.paused_until = time.time() + HEARTBEAT_BACKOFF_S


def _keep_alive(ref: weakref.ref[HeartbeatWriter], every_s: float) -> None:
    """The writer's thread: a look every half period, until it is closed or dropped."""
    while True:
        time.sleep(every_s / 2)
        writer = ref()
        if writer is None or writer.closed:
            return
        writer.refresh(every_s)
        del writer
