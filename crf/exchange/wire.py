"""Wire formats for pseudo-gradient shards: what one fp32 shard becomes in the store.

* ``float32`` — exact.
* ``bfloat16`` / ``float16`` — 2 bytes per value (~2x fewer bytes).
* ``int8`` — block-wise absmax quantization: per block of ``INT8_BLOCK`` values one fp32
  scale (absmax / 127) and int8 codes, ~4x fewer bytes (as in prime/INTELLECT-1's int8
  all-reduce). Blocks never span two tensors (:func:`int8_blocks`): each tensor's piece of a
  shard starts a block of its own, so a tensor's precision is relative to its own values.
  Accumulation always happens in fp32 after decoding, in rank order, so the reduction stays
  deterministic: every replica that decodes the same object gets the same bits.

Error feedback (optional, per replica) keeps what quantization dropped and adds it to the next
round's contribution, so the error does not accumulate over rounds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

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

#: a piece of a shard that int8 blocks do not cross: (start, end, index of its first block)
Segment = tuple[int, int, int]


def int8_blocks(n: int, segments: Sequence[int] | None = None) -> tuple[list[Segment], int]:
    """Where the int8 blocks of a shard of ``n`` values lie: one (start, end, first block)
    per segment, and the number of blocks. ``segments`` are the lengths of the tensors'
    pieces the shard holds, in order (None: one piece). Blocks restart at every piece, so a
    block never holds values of two tensors: a small tensor (a bias of magnitude 0.01) next to
    a large one keeps a scale of its own instead of sharing the large values' scale. Every
    replica derives the pieces from the same layout, so every one cuts the same blocks."""
    if segments is None:
        segments = [n]
    out, pos, blocks = [], 0, 0
    for m in segments:
        if m < 0:
            raise ValueError(f"int8 segments must not be negative, got {m}")
        if m:
            out.append((pos, pos + m, blocks))
            pos, blocks = pos + m, blocks + (m + INT8_BLOCK - 1) // INT8_BLOCK
    if pos != n:
        raise ValueError(f"int8 segments cover {pos} values, the shard has {n}")
    return out, blocks


def _encode_into(x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
    """Quantize ``x`` (one piece) into its ``scales`` and ``codes``, blocks from its start."""
    n = x.numel()
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


def encode(x: torch.Tensor, wire: str, segments: Sequence[int] | None = None) -> torch.Tensor:
    """fp32 1-D -> the tensor stored on the wire (a float tensor, or uint8 bytes for int8:
    ``nblocks`` fp32 scales, then ``n`` int8 codes; blocks as :func:`int8_blocks` cuts
    them for ``segments``)."""
    if wire in _FLOATS:
        return x.to(_FLOATS[wire])
    n = x.numel()
    pieces, nblocks = int8_blocks(n, segments)
    out = torch.empty(nblocks * 4 + n, dtype=torch.uint8)
    scales = out[: nblocks * 4].view(torch.float32)
    codes = out[nblocks * 4 :].view(torch.int8)
    for a, b, k in pieces:
        m = (b - a + INT8_BLOCK - 1) // INT8_BLOCK
        _encode_into(x[a:b], scales[k : k + m], codes[a:b])
    return out


def _int8_parts(
    w: torch.Tensor, n: int, segments: Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor, list[Segment]]:
    """(fp32 scales, int8 codes, pieces) of an int8 shard of ``n`` values, checked for size.
    The scales may sit at any byte offset of a downloaded object: they are copied to align
    them."""
    pieces, nblocks = int8_blocks(n, segments)
    if w.dtype != torch.uint8 or w.numel() != nblocks * 4 + n:
        raise ValueError(f"int8 shard has {w.numel()} bytes, expected {nblocks * 4 + n}")
    return w[: nblocks * 4].clone().view(torch.float32), w[nblocks * 4 :].view(torch.int8), pieces


def _chunks(pieces: list[Segment]) -> list[tuple[int, int, int]]:
    """(start, end, first block) of at most INT8_CHUNK values each, covering the pieces."""
    out = []
    for a0, b0, k0 in pieces:
        for a in range(a0, b0, INT8_CHUNK):
            out.append((a, min(a + INT8_CHUNK, b0), k0 + (a - a0) // INT8_BLOCK))
    return out


def _dequantize(
    scales: torch.Tensor, codes: torch.Tensor, a: int, b: int, first: int, dst: torch.Tensor
) -> torch.Tensor:
    """Values [a, b) of an int8 shard into ``dst`` (b - a fp32 values; ``a`` starts block
    ``first``, and [a, b) lies in one piece): codes times their block's scale."""
    dst.copy_(codes[a:b])
    nfull = (b - a) // INT8_BLOCK
    if nfull:
        dst[: nfull * INT8_BLOCK].view(-1, INT8_BLOCK).mul_(scales[first : first + nfull, None])
    if nfull * INT8_BLOCK < b - a:  # the piece's last, partial block
        dst[nfull * INT8_BLOCK :].mul_(scales[first + nfull])
    return dst


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
    if out is not None and (out.dtype != torch.float32 or out.numel() != n):
        raise ValueError(f"out must be {n} fp32 values, got {out.numel()} {out.dtype}")
    if wire in _FLOATS:
        return w.to(torch.float32) if out is None else out.copy_(w)
    scales, codes, pieces = _int8_parts(w, n, segments)
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    for a, b, k in _chunks(pieces):
        _dequantize(scales, codes, a, b, k, out[a:b])
    return out


def decode_add(
    w: torch.Tensor,
    wire: str,
    n: int,
    acc: torch.Tensor,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """``acc += decode(w)`` chunk by chunk, so the decoded shard is never materialized (the
    same bits as adding a full decode: both are element-wise fp32 adds)."""
    if wire in _FLOATS:
        return acc.add_(w)
    scales, codes, pieces = _int8_parts(w, n, segments)
    tmp = torch.empty(min(n, INT8_CHUNK), dtype=torch.float32)
    for a, b, k in _chunks(pieces):
        acc[a:b].add_(_dequantize(scales, codes, a, b, k, tmp[: b - a]))
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


def all_finite(
    w: torch.Tensor | list[torch.Tensor],
    wire: str,
    n: int,
    segments: Sequence[int] | None = None,
) -> bool:
    """Whether a shard on the wire decodes to finite values only, read without decoding it:
    the values themselves for a float wire (fp32 slices included), the block scales for
    int8 (a code is a small integer, so its value is finite exactly when its scale is; a
    NaN or infinite input makes its block's absmax, hence its scale, non-finite)."""
    if isinstance(w, list):
        return all(finite(p) for p in w)
    if wire in _FLOATS:
        return finite(w)
    scales, _, _ = _int8_parts(w, n, segments)
    return finite(scales)


def wire_nbytes(wire: str, n: int, segments: Sequence[int] | None = None) -> int:
    """Bytes of a shard of ``n`` values on the wire (what :func:`encode` returns)."""
    if wire in _FLOATS:
        return n * torch.empty(0, dtype=_FLOATS[wire]).element_size()
    return int8_blocks(n, segments)[1] * 4 + n


def wire_numel_ok(
    w: torch.Tensor, wire: str, n: int, segments: Sequence[int] | None = None
) -> bool:
    if wire in _FLOATS:
        return w.numel() == n
    return w.numel() == wire_nbytes(wire, n, segments)


def shard_segments(sizes: Sequence[int], bounds: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Per shard [a, b) of the concatenated tensors (of ``sizes`` values each), the lengths
    of the tensors' pieces it holds, in order: what :func:`int8_blocks` cuts blocks along.
    A tensor split across shards gives a piece to each."""
    starts, pos = [], 0
    for m in sizes:
        starts.append(pos)
        pos += m
    out = []
    for a, b in bounds:
        segs = []
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(sizes) and starts[i] < b:
            lo, hi = max(a, starts[i]), min(b, starts[i] + sizes[i])
            if hi > lo:
                segs.append(hi - lo)
            i += 1
        out.append(segs)
    return out


def compression(wire: str) -> float:
    """Bytes of fp32 per byte on the wire (int8 pays 4 bytes of scale per block)."""
    if wire in _FLOATS:
        return 4.0 / torch.empty(0, dtype=_FLOATS[wire]).element_size()
    return 4.0 * INT8_BLOCK / (INT8_BLOCK + 4)
