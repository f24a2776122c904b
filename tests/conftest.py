"""Shared fixtures: fresh stores on memory:// and file://, and a thread runner for replicas."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from crf.store import RunStore

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> RunStore:
    """An empty run folder, on memory:// and on file://."""
    if request.param == "memory":
        s = RunStore(f"memory://crf-test/{uuid.uuid4().hex}")
        yield s
        s.delete("")
    else:
        yield RunStore(f"file://{tmp_path}/run")


def run_threads(n: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run fn(rank) in n threads; return results (exceptions are returned, not raised)."""
    out: list[Any] = [None] * n

    def _target(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[r] = e

    threads = [threading.Thread(target=_target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "replica thread hung"
    return out
