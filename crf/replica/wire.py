"""Wire formats for pseudo-gradient shards: what one fp32 shard becomes in the store.

* ``float32`` — exact.
* ``bfloat16`` / ``float16`` — 2 bytes per value (~2x fewer bytes).
* ``int8`` — block-wise absmax quantization: per block of ``INT8_BLOCK`` values one fp32
  scale (absmax / 127) and int8 codes, ~4x fewer bytes (as in prime/INTELLECT-1's int8
  all-reduce). Accumulation always happens in fp32 after decoding, in rank order, so the
  reduction stays deterministic: every replica that decodes the same object gets the same bits.

Error feedback (optional, per replica) keeps what quantization dropped and adds it to the next
round's contribution, so the error does not accumulate over rounds.
"""

from __future__ import annotations

import math

import torch

WIRE_FORMATS = ("float32", "bfloat16", "float16", "int8")
INT8_BLOCK = 256
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_wire(name: str) -> str:
    if name not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {WIRE_FORMATS}, got {name!r}")
    return name


#: int8 encodes and decodes this many values at a time (a multiple of INT8_BLOCK): the
#: temporaries (abs, quotient, codes) stay a few MB whatever the shard size, and the passes
#: over a chunk run in cache
INT8_CHUNK = INT8_BLOCK * 4096


def encode(x: torch.Tensor, wire: str) -> torch.Tensor:
    """fp32 1-D -> the tensor stored on the wire (a float tensor, or uint8 bytes for int8:
    ``nblocks`` fp32 scales, then ``n`` int8 codes)."""
    if wire in _FLOATS:
        return x.to(_FLOATS[wire])
    n = x.numel()
    nblocks = (n + INT8_BLOCK - 1) // INT8_BLOCK
    out = torch.empty(nblocks * 4 + n, dtype=torch.uint8)
    scales = out[: nblocks * 4].view(torch.float32)
    codes = out[nblocks * 4 :].view(torch.int8)
    for a in range(0, n, INT8_CHUNK):
        b = min(a + INT8_CHUNK, n)
        chunk = x[a:b]
        if (b - a) % INT8_BLOCK:  # the last, partial block: pad it with zeros
            padded = torch.zeros((b - a + INT8_BLOCK - 1) // INT8_BLOCK * INT8_BLOCK)
            padded[: b - a] = chunk
            chunk = padded
        blocks = chunk.view(-1, INT8_BLOCK)
        # absmax as max(max, -min): exactly the same values, and two reductions are ~10x
        # faster than materializing abs() on this CPU build
        s = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).div_(127.0)
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = blocks / s[:, None]
        codes[a:b] = q.round_().clamp_(-127, 127).view(-1)[: b - a].to(torch.int8)
        scales[a // INT8_BLOCK : a // INT8_BLOCK + s.numel()] = s
    return out


def _int8_parts(w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scales, int8 codes) of an int8 shard of ``n`` values, checked for size. The
    scales may sit at any byte offset of a downloaded object: they are copied to align them."""
    nblocks = (n + INT8_BLOCK - 1) // INT8_BLOCK
    if w.dtype != torch.uint8 or w.numel() != nblocks * 4 + n:
        raise ValueError(f"int8 shard has {w.numel()} bytes, expected {nblocks * 4 + n}")
    return w[: nblocks * 4].clone().view(torch.float32), w[nblocks * 4 :].view(torch.int8)


def _dequantize(
    scales: torch.Tensor, codes: torch.Tensor, a: int, b: int, dst: torch.Tensor
) -> torch.Tensor:
    """Values [a, b) of an int8 shard into ``dst`` (b - a fp32 values; ``a`` on a block
    boundary): codes times their block's scale."""
    dst.copy_(codes[a:b])
    full = (b - a) // INT8_BLOCK * INT8_BLOCK
    if full:
        first = a // INT8_BLOCK
        dst[:full].view(-1, INT8_BLOCK).mul_(scales[first : first + full // INT8_BLOCK, None])
    if full < b - a:  # the last, partial block
        dst[full:].mul_(scales[-1])
    return dst


def decode(w: torch.Tensor, wire: str, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`encode` for a shard of ``n`` values; always returns fp32, written
    into ``out`` (a contiguous fp32 tensor of ``n`` values) when given."""
    if out is not None and (out.dtype != torch.float32 or out.numel() != n):
        raise ValueError(f"out must be {n} fp32 values, got {out.numel()} {out.dtype}")
    if wire in _FLOATS:
        return w.to(torch.float32) if out is None else out.copy_(w)
    scales, codes = _int8_parts(w, n)
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    for a in range(0, n, INT8_CHUNK):
        b = min(a + INT8_CHUNK, n)
        _dequantize(scales, codes, a, b, out[a:b])
    return out


def decode_add(w: torch.Tensor, wire: str, n: int, acc: torch.Tensor) -> torch.Tensor:
    """``acc += decode(w)`` chunk by chunk, so the decoded shard is never materialized (the
    same bits as adding a full decode: both are element-wise fp32 adds)."""
    if wire in _FLOATS:
        return acc.add_(w)
    scales, codes = _int8_parts(w, n)
    tmp = torch.empty(min(n, INT8_CHUNK), dtype=torch.float32)
    for a in range(0, n, INT8_CHUNK):
        b = min(a + INT8_CHUNK, n)
        acc[a:b].add_(_dequantize(scales, codes, a, b, tmp[: b - a]))
    return acc


def finite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN and no infinity, in one vectorized pass: the min
    and the max are finite exactly then (both propagate NaN). ``torch.isfinite(t).all()``
    says the same but materializes a bool tensor: measured ~30x slower on a CPU (16M fp32
    values: 18 ms against 600 ms)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def all_finite(w: torch.Tensor | list[torch.Tensor], wire: str, n: int) -> bool:
    """Whether a shard on the wire decodes to finite values only, read without decoding it:
    the values themselves for a float wire (fp32 slices included), the block scales for
    int8 (a code is a small integer, so its value is finite exactly when its scale is; a
    NaN or infinite input makes its block's absmax, hence its scale, non-finite)."""
    if isinstance(w, list):
        return all(finite(p) for p in w)
    if wire in _FLOATS:
        return finite(w)
    scales, _ = _int8_parts(w, n)
    return finite(scales)


def wire_nbytes(wire: str, n: int) -> int:
    """Bytes of a shard of ``n`` values on the wire (what :func:`encode` returns)."""
    if wire in _FLOATS:
        return n * torch.empty(0, dtype=_FLOATS[wire]).element_size()
    return (n + INT8_BLOCK - 1) // INT8_BLOCK * 4 + n


def wire_numel_ok(w: torch.Tensor, wire: str, n: int) -> bool:
    if wire in _FLOATS:
        return w.numel() == n
    return w.numel() == (n + INT8_BLOCK - 1) // INT8_BLOCK * 4 + n


def compression(wire: str) -> float:
    """Bytes of fp32 per byte on the wire (int8 pays 4 bytes of scale per block)."""
    if wire in _FLOATS:
        return 4.0 / torch.empty(0, dtype=_FLOATS[wire]).element_size()
    return 4.0 * INT8_BLOCK / (INT8_BLOCK + 4)
