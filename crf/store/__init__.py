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
    RunStore,
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
