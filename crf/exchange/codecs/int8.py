"""The ``int8`` codec: block-wise absmax quantization, ~4x fewer bytes than fp32.

Per block of ``INT8_BLOCK`` values one fp32 scale (absmax / 127) and int8 codes (as in
prime/INTELLECT-1's int8 all-reduce). Blocks never span two tensors (:func:`int8_blocks`):
each tensor's piece of a shard starts a block of its own, so a tensor's precision is relative
to its own values. On the wire: ``nblocks`` fp32 scales, then ``n`` int8 codes, as uint8
bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crf.exchange.codecs.base import FP32_BYTES, Codec, finite

INT8_BLOCK = 256

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


def _parts(
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


class Int8Codec(Codec):
    """Block-wise absmax int8; decodes chunk by chunk, so a shard's fp32 copy is never
    materialized when adding it, and the temporaries stay a few MB."""

    name = "int8"

    def encode(self, x: torch.Tensor, segments: Sequence[int] | None = None) -> torch.Tensor:
        n = x.numel()
        pieces, nblocks = int8_blocks(n, segments)
        out = torch.empty(nblocks * 4 + n, dtype=torch.uint8)
        scales = out[: nblocks * 4].view(torch.float32)
        codes = out[nblocks * 4 :].view(torch.int8)
        for a, b, k in pieces:
            m = (b - a + INT8_BLOCK - 1) // INT8_BLOCK
            _encode_into(x[a:b], scales[k : k + m], codes[a:b])
        return out

    def decode(
        self,
        w: torch.Tensor,
        n: int,
        out: torch.Tensor | None = None,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        scales, codes, pieces = _parts(w, n, segments)
        out = torch.empty(n, dtype=torch.float32) if out is None else out
        for a, b, k in _chunks(pieces):
            _dequantize(scales, codes, a, b, k, out[a:b])
        return out

    def decode_add(
        self,
        w: torch.Tensor,
        n: int,
        acc: torch.Tensor,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        scales, codes, pieces = _parts(w, n, segments)
        tmp = torch.empty(min(n, INT8_CHUNK), dtype=torch.float32)
        for a, b, k in _chunks(pieces):
            acc[a:b].add_(_dequantize(scales, codes, a, b, k, tmp[: b - a]))
        return acc

    def nbytes(self, n: int, segments: Sequence[int] | None = None) -> int:
        return int8_blocks(n, segments)[1] * 4 + n

    def numel_ok(self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None) -> bool:
        return w.numel() == self.nbytes(n, segments)

    def all_finite(self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None) -> bool:
        # a code is a small integer, so its value is finite exactly when its block's scale
        # is; a NaN or infinite input makes its block's absmax, hence its scale, non-finite
        scales, _, _ = _parts(w, n, segments)
        return finite(scales)

    def compression(self) -> float:
        return FP32_BYTES * INT8_BLOCK / (INT8_BLOCK + 4)  # 4 bytes of scale per block


INT8 = Int8Codec()
