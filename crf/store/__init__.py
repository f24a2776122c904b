"""The run store: fsspec URIs -> atomic put, create-if-absent, get, list, wait."""

from crf.store.codec import decode_blob, decode_tensor, encode_blob, encode_tensor
from crf.store.errors import (
    CorruptObjectError,
    ObjectNotFound,
    StoreError,
    StoreNotWritable,
    StoreTimeout,
)
from crf.store.run_store import (
    SUPPORTED_SCHEMES,
    RunStore,
    join_uri,
    normalize_uri,
    split_uri,
    wait_until,
)

__all__ = [
    "SUPPORTED_SCHEMES",
    "CorruptObjectError",
    "ObjectNotFound",
    "RunStore",
    "StoreError",
    "StoreNotWritable",
    "StoreTimeout",
    "decode_blob",
    "decode_tensor",
    "encode_blob",
    "encode_tensor",
    "join_uri",
    "normalize_uri",
    "split_uri",
    "wait_until",
]
