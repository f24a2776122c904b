"""Bit packing for the sparse wires: small unsigned integers (offsets in a chunk, value codes)
stored ``bits`` bits each, little-endian, with no padding but at the very end."""

from __future__ import annotations

import math

import torch


def _group(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest run of values that fills whole bytes."""
    if not 1 <= bits <= 24:
        raise ValueError(f"packed fields are 1 to 24 bits, got {bits}")
    span = math.lcm(bits, 8)
    return span // bits, span // 8


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits take packed."""
    per, nbytes = _group(bits)
    return (count + per - 1) // per * nbytes


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (integers in [0, 2**bits)) packed into uint8 bytes: a run of values that
    fills whole bytes at a time (12 bits: two values in three bytes), so each step is one
    vectorized pass however many values there are."""
    per, nbytes = _group(bits)
    count = values.numel()
    v = values.reshape(-1).to(torch.int64)
    if count % per:
        v = torch.cat([v, v.new_zeros(per - count % per)])
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (v.view(-1, per) << shifts).sum(dim=1, keepdim=True)
    out = (words >> (torch.arange(nbytes, dtype=torch.int64) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(-1)


def unpack_bits(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` int64 values :func:`pack_bits` packed into ``data``."""
    per, nbytes = _group(bits)
    if data.numel() != packed_nbytes(count, bits):
        raise ValueError(f"{data.numel()} packed bytes cannot hold {count} values of {bits} bits")
    b = data.reshape(-1, nbytes).to(torch.int64)
    words = (b << (torch.arange(nbytes, dtype=torch.int64) * 8)).sum(dim=1, keepdim=True)
    v = (words >> (torch.arange(per, dtype=torch.int64) * bits)) & ((1 << bits) - 1)
    return v.reshape(-1)[:count]
