"""A slow store on purpose: per-request latency and a bandwidth limit in front of a RunStore.

Benchmarks (``bench/overlap.py``) use it to make a local folder behave like a remote object
store, where a request costs a round trip and bytes move at a link's speed::

    store = throttle(RunStore("file:///tmp/run"), latency_s=0.02, mb_per_s=100)

Each request first waits ``latency_s`` (concurrent requests wait concurrently, as on a
network). Then its bytes take ``size / bandwidth``; uploads and downloads each have one link per
process (full duplex), so concurrent transfers in one direction share it - one replica's NIC.
The waits are sleeps: they release the GIL and cost no CPU, so other threads (training) run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from crf.store.run_store import RunStore


class Throttle:
    """Latency per request and a per-direction bandwidth shared by all threads."""

    def __init__(self, latency_s: float = 0.0, mb_per_s: float | None = None) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        if mb_per_s is not None and mb_per_s <= 0:
            raise ValueError(f"mb_per_s must be > 0, got {mb_per_s}")
        self.latency_s = latency_s
        self.bytes_per_s = mb_per_s * 2**20 if mb_per_s else None
        self._links = {"up": threading.Lock(), "down": threading.Lock()}
        self._free_at = {"up": 0.0, "down": 0.0}
        self.requests = 0
        self.bytes = {"up": 0, "down": 0}

    def wait(self, direction: str, nbytes: int) -> None:
        """Block like a request that moves ``nbytes`` up or down."""
        self.requests += 1
        self.bytes[direction] += nbytes
        if self.latency_s:
            time.sleep(self.latency_s)
        if not self.bytes_per_s or not nbytes:
            return
        with self._links[direction]:  # book the link: transfers queue behind each other
            start = max(time.monotonic(), self._free_at[direction])
            done = start + nbytes / self.bytes_per_s
            self._free_at[direction] = done
        time.sleep(max(0.0, done - time.monotonic()))


class _ThrottledFS:
    """An fsspec filesystem proxy: reads and listings wait on the throttle."""

    def __init__(self, fs: Any, throttle: Throttle) -> None:
        self._fs = fs
        self._throttle = throttle

    def cat_file(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        data = self._fs.cat_file(path, *args, **kwargs)
        self._throttle.wait("down", len(data))
        return data

    def ls(self, *args: Any, **kwargs: Any) -> Any:
        self._throttle.wait("down", 0)
        return self._fs.ls(*args, **kwargs)

    def exists(self, *args: Any, **kwargs: Any) -> Any:
        self._throttle.wait("down", 0)
        return self._fs.exists(*args, **kwargs)

    def rm(self, *args: Any, **kwargs: Any) -> Any:
        self._throttle.wait("up", 0)
        return self._fs.rm(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def throttle(store: RunStore, latency_s: float = 0.0, mb_per_s: float | None = None) -> RunStore:
    """Make every request of ``store`` slow (in place; returns the store). ``store.throttle``
    is the :class:`Throttle`, with request and byte counts."""
    t = Throttle(latency_s, mb_per_s)
    store.fs = _ThrottledFS(store.fs, t)
    put = store._put

    def slow_put(path: str, data: Any, *, exclusive: bool, **kw: Any) -> bool:
        t.wait("up", _nbytes(data))
        return put(path, data, exclusive=exclusive, **kw)

    store._put = slow_put  # type: ignore[method-assign]
    store.throttle = t  # type: ignore[attr-defined]
    return store


def _nbytes(data: Any) -> int:
    if isinstance(data, list | tuple):
        return sum(memoryview(d).nbytes for d in data)
    return memoryview(data).nbytes
