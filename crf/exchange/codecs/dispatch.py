"""The wire functions the exchange calls: each takes the wire format's name and hands the
work to its registered codec (:func:`crf.exchange.codecs.registry.get_codec`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crf.exchange.codecs.base import finite
from crf.exchange.codecs.registry import get_codec


def encode(x: torch.Tensor, wire: str, segments: Sequence[int] | None = None) -> torch.Tensor:
    """fp32 1-D -> the tensor stored on the wire (a float tensor, or uint8 bytes for int8:
    ``nblocks`` fp32 scales, then ``n`` int8 codes; blocks as
    :func:`crf.exchange.codecs.int8.int8_blocks` cuts them for ``segments``)."""
    return get_codec(wire).encode(x, segments)


def decode(
    w: torch.Tensor,
    wire: str,
    n: int,
    out: torch.Tensor | None = None,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode` for a shard of ``n`` values (cut into the same
    ``segments``); always returns fp32, written into ``out`` (a contiguous fp32 tensor of
    ``n`` values) when given."""
    codec = get_codec(wire)
    if out is not None and (out.dtype != torch.float32 or out.numel() != n):
        raise ValueError(f"out must be {n} fp32 values, got {out.numel()} {out.dtype}")
    return codec.decode(w, n, out=out, segments=segments)


def decode_add(
    w: torch.Tensor,
    wire: str,
    n: int,
    acc: torch.Tensor,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """``acc += decode(w)`` (chunk by chunk where the codec can, so the decoded shard is
    never materialized; the same bits as adding a full decode: both are element-wise fp32
    adds)."""
    return get_codec(wire).decode_add(w, n, acc, segments)


def all_finite(
    w: torch.Tensor | list[torch.Tensor],
    wire: str,
    n: int,
    segments: Sequence[int] | None = None,
) -> bool:
    """Whether a shard on the wire decodes to finite values only, read without decoding it
    where the codec can: the values themselves for a float wire, the block scales for int8.
    A list is the fp32 slices the exact wire sends as they are."""
    if isinstance(w, list):
        return all(finite(p) for p in w)
    return get_codec(wire).all_finite(w, n, segments)


def wire_nbytes(wire: str, n: int, segments: Sequence[int] | None = None) -> int:
    """Bytes of a shard of ``n`` values on the wire (what :func:`encode` returns)."""
    return get_codec(wire).nbytes(n, segments)


def wire_numel_ok(
    w: torch.Tensor, wire: str, n: int, segments: Sequence[int] | None = None
) -> bool:
    """Whether a downloaded shard has the size a shard of ``n`` values has on this wire."""
    return get_codec(wire).numel_ok(w, n, segments)


def compression(wire: str) -> float:
    """Bytes of fp32 per byte on the wire (int8 pays 4 bytes of scale per block)."""
    return get_codec(wire).compression()


def wire_name(wire_dtype: str, density: float) -> str:
    """The name a run's wire goes by in the store: a sparse codec's carries its density
    (``topk4@0.02``), so replicas that disagree on it are told apart like two wires."""
    return f"{wire_dtype}@{density!r}" if get_codec(wire_dtype).sparse else wire_dtype


def is_sparse(wire: str) -> bool:
    """Whether the wire keeps only some values (error feedback always on)."""
    return get_codec(wire).sparse


def encode_reduced(
    x: torch.Tensor,
    wire: str,
    segments: Sequence[int] | None = None,
    parts: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """A shard's fp32 average -> the tensor its owner publishes (the codec's
    :meth:`~crf.exchange.codecs.base.Codec.encode_reduced`; ``parts``: the wire parts it
    was summed from, in rank order, for a sparse codec)."""
    return get_codec(wire).encode_reduced(x, segments, parts)


def decode_reduced(
    w: torch.Tensor,
    wire: str,
    n: int,
    out: torch.Tensor | None = None,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode_reduced` for a shard of ``n`` values, as :func:`decode`."""
    if out is not None and (out.dtype != torch.float32 or out.numel() != n):
        raise ValueError(f"out must be {n} fp32 values, got {out.numel()} {out.dtype}")
    return get_codec(wire).decode_reduced(w, n, out=out, segments=segments)


def reduced_numel_ok(
    w: torch.Tensor, wire: str, n: int, segments: Sequence[int] | None = None
) -> bool:
    """Whether a downloaded average is well formed for a shard of ``n`` values."""
    return get_codec(wire).reduced_numel_ok(w, n, segments)


def reduced_all_finite(
    w: torch.Tensor, wire: str, n: int, segments: Sequence[int] | None = None
) -> bool:
    """Whether a downloaded average decodes to finite values only."""
    return get_codec(wire).reduced_all_finite(w, n, segments)
