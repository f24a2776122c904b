"""Wire codecs: what one fp32 pseudo-gradient shard becomes in the store, by name.

Built in: ``float32`` (exact), ``bfloat16`` and ``float16`` (2 bytes per value,
:mod:`crf.exchange.codecs.floats`), ``int8`` (block-wise absmax scales, ~4x fewer bytes,
:mod:`crf.exchange.codecs.int8`), and the sparse ``topk2``/``topk4``/``topk8`` (per chunk the
largest values at 2, 4 or 8 bits; at 2% density 43-60x fewer bytes up than fp32,
:mod:`crf.exchange.codecs.topk`; their average is published exact,
:mod:`crf.exchange.codecs.sparse`). Each is a :class:`~crf.exchange.codecs.base.Codec`
(encode, decode, decode-and-add, size); a new one is a module with its class plus its
registration (:mod:`crf.exchange.codecs.registry`; docs/extending.md, "Add a wire codec").

This package imports without torch: the registry (:func:`register_codec`,
:func:`get_codec`, :func:`codec_names`) holds the built-in codecs by module path, and
``crf.spec`` lists their names to validate a run before anything heavy is loaded. Names are
looked up when a run or an exchange is validated, so a codec registered at runtime is
accepted like a built-in one. The functions the exchange calls with a wire's name
(:func:`encode`, :func:`decode`, :func:`decode_add`, :func:`all_finite`, :func:`wire_nbytes`,
:func:`wire_numel_ok`, :func:`compression`, :func:`finite`; :mod:`crf.exchange.codecs.dispatch`)
and the int8 constants are imported from their torch-using modules on first access.

Accumulation always happens in fp32 after decoding, in rank order, so the reduction stays
deterministic: every replica that decodes the same object gets the same bits. Error feedback
(optional, per replica) keeps what a lossy codec dropped and adds it to the next round's
contribution, so the error does not accumulate over rounds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from crf.exchange.codecs.registry import codec_names, get_codec, register_codec, unregister_codec
from crf.exchange.codecs.segments import shard_segments

if TYPE_CHECKING:
    from crf.exchange.codecs.base import Codec, finite
    from crf.exchange.codecs.dispatch import (
        all_finite,
        compression,
        decode,
        decode_add,
        decode_reduced,
        encode,
        encode_reduced,
        is_sparse,
        reduced_all_finite,
        reduced_numel_ok,
        wire_name,
        wire_nbytes,
        wire_numel_ok,
    )
    from crf.exchange.codecs.int8 import INT8_BLOCK, INT8_CHUNK, int8_blocks

#: names imported from the torch-using modules on first access (PEP 562), then kept here
_LAZY = {
    "Codec": "crf.exchange.codecs.base",
    "finite": "crf.exchange.codecs.base",
    **{
        name: "crf.exchange.codecs.dispatch"
        for name in (
            "all_finite",
            "compression",
            "decode",
            "decode_add",
            "encode",
            "encode_reduced",
            "decode_reduced",
            "reduced_numel_ok",
            "reduced_all_finite",
            "is_sparse",
            "wire_name",
            "wire_nbytes",
            "wire_numel_ok",
        )
    },
    "INT8_BLOCK": "crf.exchange.codecs.int8",
    "INT8_CHUNK": "crf.exchange.codecs.int8",
    "int8_blocks": "crf.exchange.codecs.int8",
}

__all__ = [
    "Codec",
    "INT8_BLOCK",
    "INT8_CHUNK",
    "all_finite",
    "codec_names",
    "compression",
    "decode",
    "decode_add",
    "decode_reduced",
    "encode",
    "encode_reduced",
    "finite",
    "get_codec",
    "int8_blocks",
    "is_sparse",
    "reduced_all_finite",
    "reduced_numel_ok",
    "register_codec",
    "shard_segments",
    "unregister_codec",
    "wire_name",
    "wire_nbytes",
    "wire_numel_ok",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'crf.exchange.codecs' has no attribute {name!r}")
