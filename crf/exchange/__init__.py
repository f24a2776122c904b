"""The exchange: how replicas average pseudo-gradients through an object store.

Usable on its own (bench/ and SDK users do): the all-reduce over a run folder
(:mod:`crf.exchange.allreduce`, which runs a round's steps in order:
:mod:`~crf.exchange.upload`, :mod:`~crf.exchange.membership`, :mod:`~crf.exchange.reduce`
or :mod:`~crf.exchange.reduce_two_level`, :mod:`~crf.exchange.gather`, with
:mod:`~crf.exchange.checks` and :mod:`~crf.exchange.garbage`), one replica's contribution
and its wire encodings (:mod:`crf.exchange.contribution`, :mod:`crf.exchange.codecs`), and
the torchft-facing manager that DiLoCo drives (:mod:`crf.exchange.manager`). Imported
lazily (torch-heavy).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ObjectStoreAllReduce": "crf.exchange.allreduce",
    "ObjectStoreManager": "crf.exchange.manager",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'crf.exchange' has no attribute {name!r}")
