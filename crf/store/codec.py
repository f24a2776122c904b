"""Self-checking binary format for tensor objects in the store.

Every tensor object carries its own header (JSON: dtype, shape, run, round, rank, shard, ...)
and a SHA-256 of header+payload, so a truncated, bit-flipped or foreign object is detected by
the reader and never averaged (DESIGN.md, "Rules every writer keeps").

Layout: MAGIC(8) | header_len u32 | payload_len u64 | sha256(32) | header json | payload
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings
from typing import Any

import torch

from crf.store.errors import CorruptObjectError

MAGIC = b"CRFTNSR1"
_FIXED = struct.Struct("<8sIQ32s")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def raw_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (for hashing and writing)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(raw_view(t))


def encode_tensor(tensor: torch.Tensor, meta: dict[str, Any] | None = None) -> bytes:
    """Serialize one tensor with its metadata and an integrity hash."""
    header = dict(meta or {})
    header["dtype"] = dtype_name(tensor.dtype)
    header["shape"] = list(tensor.shape)
    hbytes = json.dumps(header, sort_keys=True).encode()
    payload = raw_view(tensor)
    h = hashlib.sha256(hbytes)
    h.update(payload)
    fixed = _FIXED.pack(MAGIC, len(hbytes), payload.nbytes, h.digest())
    return b"".join((fixed, hbytes, payload))  # the only copy of the payload


def decode_tensor(
    data: bytes, *, where: str = "object", copy: bool = True
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Parse and verify an object written by encode_tensor; raise CorruptObjectError if bad.

    With ``copy=False`` the tensor shares memory with the immutable ``data`` (one copy less on
    the exchange's hot path): the caller must only read it.
    """
    if len(data) < _FIXED.size:
        raise CorruptObjectError(
            f"{where}: truncated ({len(data)} bytes, header needs {_FIXED.size})"
        )
    magic, hlen, plen, digest = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise CorruptObjectError(f"{where}: not a crf tensor object (bad magic {magic!r})")
    expected = _FIXED.size + hlen + plen
    if len(data) != expected:
        raise CorruptObjectError(
            f"{where}: truncated or padded ({len(data)} bytes, header says {expected})"
        )
    body = memoryview(data)[_FIXED.size :]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptObjectError(f"{where}: checksum mismatch (object is corrupted)")
    try:
        header = json.loads(bytes(body[:hlen]))
        dtype = dtype_from_name(header["dtype"])
        shape = [int(s) for s in header["shape"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptObjectError(f"{where}: unreadable header ({e})") from None
    payload = bytearray(body[hlen:]) if copy else body[hlen:]
    if plen == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():  # read-only buffer when copy=False: documented above
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
    if t.numel() * t.element_size() != plen:
        raise CorruptObjectError(f"{where}: payload size does not match shape {shape}")
    return t, header


BLOB_MAGIC = b"CRFBLOB1"


def encode_blob(payload: bytes, meta: dict[str, Any] | None = None) -> bytes:
    """Wrap opaque bytes (e.g. a torch.save'd checkpoint) with a header and a SHA-256."""
    hbytes = json.dumps(dict(meta or {}), sort_keys=True).encode()
    digest = hashlib.sha256(hbytes + payload).digest()
    return _FIXED.pack(BLOB_MAGIC, len(hbytes), len(payload), digest) + hbytes + payload


def decode_blob(data: bytes, *, where: str = "object") -> tuple[bytes, dict[str, Any]]:
    """Verify and unwrap an encode_blob object; CorruptObjectError if anything is off."""
    if len(data) < _FIXED.size:
        raise CorruptObjectError(f"{where}: truncated ({len(data)} bytes)")
    magic, hlen, plen, digest = _FIXED.unpack_from(data)
    if magic != BLOB_MAGIC:
        raise CorruptObjectError(f"{where}: not a crf blob (bad magic {magic!r})")
    if len(data) != _FIXED.size + hlen + plen:
        raise CorruptObjectError(f"{where}: truncated or padded")
    body = memoryview(data)[_FIXED.size :]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptObjectError(f"{where}: checksum mismatch (object is corrupted)")
    return bytes(body[hlen:]), json.loads(bytes(body[:hlen]))
