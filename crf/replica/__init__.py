"""What runs inside a replica: the env contract, jobs, the object-store all-reduce, the
DiLoCo manager and the heartbeat/metrics/result writer. Imported lazily (torch-heavy)."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ReplicaContext": "crf.replica.context",
    "ObjectStoreAllReduce": "crf.replica.allreduce",
    "ObjectStoreManager": "crf.replica.manager",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'crf.replica' has no attribute {name!r}")
