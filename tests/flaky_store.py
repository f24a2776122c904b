"""Store fault injection for tests: a RunStore whose requests fail or stall on demand.

Object stores fail in ordinary ways - a GET that times out, a PUT answered 503, a response
that takes seconds - and crf promises that one such request never kills a replica (the store
retries with backoff) while a store that stays down ends the replica with a clear error after
a bounded time. This module makes those failures happen on purpose:

* ``install(store, plan)`` wraps one :class:`~crf.store.RunStore` in place: its fsspec
  filesystem (GET, LIST, EXISTS, DELETE) and its atomic writer (PUT), so every request the
  store makes passes through :class:`FaultPlan`;
* ``install_from_env()`` does that for every RunStore a replica process creates, from the
  JSON in ``CRF_TEST_FLAKY`` (see :func:`plan_from_env`) - ``tests/replica_shim.py`` calls
  it before running the real replica.

Injected errors are ``ConnectionError``s (``OSError`` subclasses, as a network filesystem
raises), and each message starts with ``[flaky_store]`` so a test can tell them apart.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from crf.store import RunStore

ENV = "CRF_TEST_FLAKY"
TAG = "[flaky_store]"


@dataclass
class FaultPlan:
    """Which requests fail or stall. Requests are counted per plan, from 1.

    ``fail_first``: op -> the first k requests of that op fail (op: get, put, list, exists,
    delete). ``fail_every``: every n-th request fails (once: its retry is the next request).
    ``slow_every`` / ``slow_s``: every n-th request first sleeps ``slow_s``. ``down_from_key``:
    once a request touches a key containing this text, every request from then on fails - a
    store that went away for good.
    """

    fail_first: dict[str, int] = field(default_factory=dict)
    fail_every: int = 0
    slow_every: int = 0
    slow_s: float = 0.0
    down_from_key: str | None = None
    calls: int = 0
    per_op: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    slowed: int = 0
    down_since: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def before(self, op: str, key: str) -> None:
        """Called before every request: may sleep, may raise."""
        with self._lock:
            self.calls += 1
            n = self.calls
            self.per_op[op] = self.per_op.get(op, 0) + 1
            k = self.per_op[op]
            if (
                self.down_from_key is not None
                and self.down_since is None
                and self.down_from_key in key
            ):
                self.down_since = time.time()
                print(f"{TAG} store unreachable from now on (t={self.down_since:.3f})", flush=True)
            down = self.down_since is not None
            fail = down or k <= self.fail_first.get(op, 0)
            fail = fail or (self.fail_every > 0 and n % self.fail_every == 0)
            slow = self.slow_every > 0 and n % self.slow_every == 0
            self.failures += fail
            self.slowed += slow
        if slow:
            time.sleep(self.slow_s)
        if down:
            raise ConnectionRefusedError(f"{TAG} store unreachable: {op.upper()} {key}")
        if fail:
            raise ConnectionResetError(f"{TAG} injected transient failure: {op.upper()} {key}")

    def report(self) -> str:
        return f"{TAG} {self.calls} requests, {self.failures} failed, {self.slowed} slowed" + (
            f", down since t={self.down_since:.3f}" if self.down_since else ""
        )


class FlakyFS:
    """An fsspec filesystem proxy that asks a FaultPlan before each request."""

    _OPS = {"cat_file": "get", "ls": "list", "exists": "exists", "rm": "delete"}

    def __init__(self, fs: Any, plan: FaultPlan, root: str) -> None:
        self._fs = fs
        self._plan = plan
        self._root = root.rstrip("/")

    def _key(self, path: Any) -> str:
        return str(path).removeprefix(self._root).lstrip("/")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        op = self._OPS.get(name) or ("put" if name == "pipe_file" else None)
        if op is None:
            return attr

        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            self._plan.before(op, self._key(path))
            return attr(path, *args, **kwargs)

        return call


def install(store: RunStore, plan: FaultPlan) -> RunStore:
    """Make every request of ``store`` go through ``plan`` (in place; returns the store)."""
    store.fs = FlakyFS(store.fs, plan, store.root)
    if store.scheme != "memory":  # memory:// writes through fs.pipe_file, already wrapped
        put = store._put

        def flaky_put(path: str, data: bytes, *, exclusive: bool, **kw: Any) -> bool:
            plan.before("put", path.removeprefix(store.root).lstrip("/"))
            return put(path, data, exclusive=exclusive, **kw)

        store._put = flaky_put  # type: ignore[method-assign]
    return store


def plan_from_env(rank: int, environ: dict[str, str] | None = None) -> FaultPlan | None:
    """The plan for ``rank`` from ``CRF_TEST_FLAKY``: a JSON object mapping a rank (as a
    string) or ``"*"`` to FaultPlan fields, e.g. ``{"*": {"fail_every": 9}, "1":
    {"down_from_key": "rounds/2/contrib"}}`` (a rank's own entry wins over ``"*"``)."""
    text = (os.environ if environ is None else environ).get(ENV)
    if not text:
        return None
    spec = json.loads(text)
    fields = spec.get(str(rank), spec.get("*"))
    return FaultPlan(**fields) if fields is not None else None


def install_from_env() -> FaultPlan | None:
    """In a replica process: wrap every RunStore it creates with this rank's plan, and print
    what was injected when the process exits (the test reads it from the replica's log)."""
    rank = int(os.environ.get("CRF_RANK", "-1"))
    plan = plan_from_env(rank)
    if plan is None:
        return None
    original = RunStore.__init__

    def __init__(self: RunStore, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        install(self, plan)

    RunStore.__init__ = __init__  # type: ignore[method-assign]
    atexit.register(lambda: print(f"{plan.report()}; exit at t={time.time():.3f}", flush=True))
    print(f"{TAG} rank {rank}: {plan}", file=sys.stderr, flush=True)
    return plan
