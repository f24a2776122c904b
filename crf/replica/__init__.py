"""What runs inside a replica: the env contract, the jobs (built-in, or any job module by its
path: :mod:`crf.replica.jobs`), and the heartbeat/metrics/result writer
(:mod:`crf.replica.context`, its per-round bookkeeping in :mod:`crf.replica.rounds`). The
exchange it drives lives in :mod:`crf.exchange`, the composer trainer in :mod:`crf.composer`.
Imported lazily (torch-heavy)."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ReplicaContext": "crf.replica.context",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'crf.replica' has no attribute {name!r}")
