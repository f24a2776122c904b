"""The run store: fsspec URIs -> atomic put, create-if-absent, get, list, wait.

The tensor codec is imported on first use (module ``__getattr__``): it needs torch, and the
read-only commands (``crf runs``, ``crf status``, ``crf logs``) reach the store without it.
"""

from __future__ import annotations

import importlib as _importlib
from typing import Any as _Any

from crf.store.errors import (
    CorruptObjectError,
    ObjectNotFound,
    StoreError,
    StoreNotWritable,
    StoreTimeout,
    StoreURIError,
)
from crf.store.run_store import (
    RunStore,
    check_uri,
    join_uri,
    normalize_uri,
    register_scheme,
    split_uri,
    supported_schemes,
    wait_until,
)

__all__ = [
    "CorruptObjectError",
    "ObjectNotFound",
    "RunStore",
    "StoreError",
    "StoreNotWritable",
    "StoreTimeout",
    "StoreURIError",
    "check_uri",
    "decode_blob",
    "decode_tensor",
    "encode_blob",
    "encode_tensor",
    "join_uri",
    "normalize_uri",
    "register_scheme",
    "split_uri",
    "supported_schemes",
    "wait_until",
]

_CODEC = ("decode_blob", "decode_tensor", "encode_blob", "encode_tensor")


def __getattr__(name: str) -> _Any:
    if name in _CODEC:
        return getattr(_importlib.import_module("crf.store.codec"), name)
    raise AttributeError(f"module 'crf.store' has no attribute {name!r}")
