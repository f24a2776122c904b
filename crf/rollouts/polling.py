"""How often trainers and workers look at the store while they wait for each other.

A worker pacing to its trainer waits about one trainer step; a trainer at staleness 0 waits
about one worker batch. A fixed backoff (0.05 s growing to a second) suits a GPU's
multi-second steps and not short ones, where the last sleep overshoots the event it waits
for by up to a whole step. :class:`Poll` backs off the same way, but caps each pause at a
quarter of the longer of the interval it has seen between the events it waits for and the
time it has waited so far. A wait then overshoots its event by about a quarter at most,
costs a few store requests per event, and a long wait (a dead worker) backs off to ``cap``.
"""

from __future__ import annotations

import time

#: the shortest pause between two looks (a local folder answers in well under this)
MIN_POLL_S = 0.01
#: how much of the observed interval, or of the wait so far, one pause may take
SHARE = 0.25


class Poll:
    """Backoff between looks at the store (module docstring)."""

    def __init__(self, first: float = 0.05, cap: float = 1.0) -> None:
        self.first = max(MIN_POLL_S, first)
        self.cap = max(self.first, cap)
        #: the mean interval between events (an exponential average), None until two seen
        self.interval: float | None = None
        self._last_event: float | None = None
        self.start()

    def start(self, now: float | None = None) -> None:
        """A new wait begins: look again soon."""
        self._since = time.monotonic() if now is None else now
        self.delay = self.first

    def limit(self, now: float | None = None) -> float:
        """The longest pause now."""
        now = time.monotonic() if now is None else now
        scale = max(self.interval or 0.0, now - self._since)
        return min(self.cap, max(MIN_POLL_S, SHARE * scale))

    def pause(self, now: float | None = None) -> float:
        """The pause before the next look (and backs off for the one after it)."""
        limit = self.limit(now)
        delay = min(self.delay, limit)
        self.delay = min(self.cap, delay * 1.5)
        return delay

    def sleep(self, at_most: float | None = None) -> None:
        delay = self.pause()
        time.sleep(delay if at_most is None else max(0.0, min(delay, at_most)))

    def event(self, count: int = 1, now: float | None = None) -> None:
        """``count`` of the awaited events happened (e.g. the trainer advanced that many
        steps): learn their interval, and start a new wait."""
        now = time.monotonic() if now is None else now
        if count <= 0:
            return
        if self._last_event is not None:
            gap = (now - self._last_event) / count
            self.interval = gap if self.interval is None else 0.7 * self.interval + 0.3 * gap
        self._last_event = now
        self.start(now)
