"""The sparse wires ``topk2``, ``topk4`` and ``topk8``: per chunk, the largest values only, at
2, 4 or 8 bits, with their positions packed at 12 bits (SparseLoCo, arXiv 2508.15706).

A shard is cut into chunks of ``TOPK_CHUNK`` values that restart at every tensor's piece
(``segments``, as int8's blocks do). Each chunk of ``m`` values keeps its
``k = ceil(density * m)`` values of largest magnitude (ties to the lower position: a stable
sort, so every machine keeps the same ones), each as a sign bit and ``bits - 1`` bits of
magnitude on a uniform grid from the chunk's smallest kept magnitude ``lo`` to its largest:
top-k values sit far from zero, so a grid over ``[lo, hi]`` spends no level on zero (at 2
bits a value is ``±lo`` or ``±hi``). On the wire, as uint8 bytes: every chunk's ``lo`` (fp32),
every chunk's grid step (fp32), then the kept values' offsets in their chunk (12 bits each,
chunk by chunk, ascending) and their codes (``bits`` each), both bit-packed. ``k`` depends
only on the chunk's length, so the size is fixed by the shard's size, its segments and the
density: the contribution packing reserves it, like any codec's.

The density is part of the wire's identity: the exchange names the wire ``topk4@0.02``
(:func:`crf.exchange.codecs.dispatch.wire_name`), so replicas that disagree on it are refused
by the quorum's facts like replicas on two wires, and :meth:`TopKCodec.variant` gives the
codec for that name.

The *average* of sparse parts is not re-sparsified: an owner sums the decoded parts in fp32
and publishes the exact result (:meth:`TopKCodec.encode_reduced`) in the smallest of four
forms: dense fp32, the nonzero positions with their fp32 values, a bitmap with them
(:mod:`crf.exchange.codecs.sparse`), or the parts themselves, which every replica sums the
way the owner did.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from crf.exchange.codecs import sparse
from crf.exchange.codecs.base import FP32_BYTES, Codec, finite
from crf.exchange.codecs.bits import pack_bits, packed_nbytes, unpack_bits

#: values per chunk: offsets in a chunk fit ``INDEX_BITS`` bits
TOPK_CHUNK = 4096
INDEX_BITS = 12
#: the density a codec looked up by its bare name keeps (a run's ``sparse_density`` names
#: its own variant, ``topk4@0.05``)
DEFAULT_DENSITY = 0.02
#: chunks whose top-k are sorted at once (bounds the temporaries to a few MB)
_BATCH = 256


@dataclass(frozen=True)
class _Plan:
    """Where the chunks of a shard lie and how many values each keeps (a pure function of
    the shard's size, its segments and the density; cached)."""

    starts: torch.Tensor  # int64, first value of each chunk
    lens: torch.Tensor  # int64, values in each chunk
    ks: torch.Tensor  # int64, values kept in each chunk
    kept: int  # values kept in the shard

    @property
    def chunks(self) -> int:
        return self.starts.numel()


def _chunk_bounds(n: int, segments: Sequence[int] | None) -> list[tuple[int, int]]:
    """(start, length) of every chunk: chunks restart at every segment."""
    if segments is None:
        segments = [n]
    out, pos = [], 0
    for m in segments:
        if m < 0:
            raise ValueError(f"topk segments must not be negative, got {m}")
        out.extend((pos + a, min(TOPK_CHUNK, m - a)) for a in range(0, m, TOPK_CHUNK))
        pos += m
    if pos != n:
        raise ValueError(f"topk segments cover {pos} values, the shard has {n}")
    return out


def kept_per_chunk(m: int, density: float) -> int:
    """Values a chunk of ``m`` values keeps: ``ceil(density * m)``, at least one (a float64
    product, the same on every machine)."""
    return min(m, max(1, math.ceil(density * m))) if m else 0


@functools.lru_cache(maxsize=256)  # a few numbers per 4096 values: shards x fragments fit
def _plan(n: int, segments: tuple[int, ...] | None, density: float) -> _Plan:
    bounds = _chunk_bounds(n, segments)
    starts = torch.tensor([a for a, _ in bounds], dtype=torch.int64)
    lens = torch.tensor([m for _, m in bounds], dtype=torch.int64)
    ks = torch.tensor([kept_per_chunk(m, density) for _, m in bounds], dtype=torch.int64)
    return _Plan(starts, lens, ks, int(ks.sum()))


class TopKCodec(Codec):
    """Per-chunk top-k at ``bits`` bits a value (sign + magnitude on the chunk's grid)."""

    sparse = True

    def __init__(self, bits: int, density: float = DEFAULT_DENSITY) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"topk codes are 2, 4 or 8 bits, got {bits}")
        if not 0 < density <= 1:
            raise ValueError(f"topk density must be in (0, 1], got {density}")
        self.name = f"topk{bits}"
        self.bits = bits
        self.density = density
        self.levels = 1 << (bits - 1)  # magnitudes on the grid; the top bit is the sign

    def variant(self, param: str) -> TopKCodec:
        try:
            density = float(param)
        except ValueError:
            raise ValueError(f"{self.name}@{param}: the density must be a number") from None
        return TopKCodec(self.bits, density)

    def _plan(self, n: int, segments: Sequence[int] | None) -> _Plan:
        return _plan(n, None if segments is None else tuple(segments), self.density)

    # ------------------------------------------------------------------ size
    def nbytes(self, n: int, segments: Sequence[int] | None = None) -> int:
        plan = self._plan(n, segments)
        return (
            2 * FP32_BYTES * plan.chunks
            + packed_nbytes(plan.kept, INDEX_BITS)
            + packed_nbytes(plan.kept, self.bits)
        )

    def numel_ok(self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None) -> bool:
        return w.dtype == torch.uint8 and w.numel() == self.nbytes(n, segments)

    # ------------------------------------------------------------------ encode
    def _select(
        self, x: torch.Tensor, plan: _Plan, c0: int, c1: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunks [c0, c1), one row each: the kept values' offsets (ascending; a row's
        columns past its ``k`` are padding), their values, and which columns are kept.

        A chunk keeps every value above its k-th largest magnitude and, of those equal to
        it, the first ones: the k-th largest is the same on every machine whatever order
        ``topk`` breaks ties in, so the choice is too."""
        starts, lens, ks = plan.starts[c0:c1], plan.lens[c0:c1], plan.ks[c0:c1]
        rows = c1 - c0
        a0 = int(starts[0])
        if int(starts[-1]) - a0 == (rows - 1) * TOPK_CHUNK and bool((lens == TOPK_CHUNK).all()):
            # whole chunks side by side (the usual case): a view, no gather, no padding
            mag = x[a0 : a0 + rows * TOPK_CHUNK].view(rows, TOPK_CHUNK).abs()
            mag.nan_to_num_(nan=math.inf)
        else:
            cols = torch.arange(TOPK_CHUNK)
            valid = cols[None, :] < lens[:, None]
            mag = x[torch.where(valid, starts[:, None] + cols[None, :], 0)].abs_()
            # NaN is kept as the largest (its chunk's scale goes NaN and the shard is
            # refused); padding is never kept
            mag = torch.where(valid, mag.nan_to_num_(nan=math.inf), -1.0)
        kmax = int(ks.max())
        kth = torch.topk(mag, kmax, dim=1).values.gather(1, (ks - 1)[:, None])
        above = mag > kth
        ties = mag == kth
        room = ks[:, None] - above.sum(dim=1, keepdim=True)
        if bool((ties.sum(dim=1, keepdim=True) <= room).all()):  # the usual case: no excess
            chosen = above | ties
        else:
            chosen = above | (ties & (ties.cumsum(dim=1) <= room))
        r, c = chosen.nonzero(as_tuple=True)  # row by row, ascending offsets
        first = torch.cumsum(ks, 0) - ks
        j = torch.arange(r.numel()) - first[r]
        keep = torch.arange(kmax)[None, :] < ks[:, None]
        offsets = torch.full((rows, kmax), TOPK_CHUNK, dtype=torch.int64)
        offsets[r, j] = c
        values = x[starts[:, None] + torch.where(keep, offsets, 0)]
        return offsets, values, keep

    def _quantize(self, v: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of kept values -> (each row's lo, each row's grid step, the codes). amax and
        amin propagate NaN, so a chunk holding one gets a NaN scale (:meth:`all_finite`)."""
        a = v.abs()
        hi = torch.where(keep, a, -math.inf).amax(dim=1)
        lo = torch.where(keep, a, math.inf).amin(dim=1)
        step = (hi - lo) / (self.levels - 1)
        q = (a - lo[:, None]) / torch.where(step > 0, step, 1.0)[:, None]
        q = torch.nan_to_num(q.round_(), nan=0.0).clamp_(0, self.levels - 1).to(torch.int64)
        return lo, step, q + self.levels * (v < 0)

    def encode(self, x: torch.Tensor, segments: Sequence[int] | None = None) -> torch.Tensor:
        n = x.numel()
        plan = self._plan(n, segments)
        x = x.detach().reshape(-1).to(torch.float32)
        lo = torch.empty(plan.chunks, dtype=torch.float32)
        step = torch.empty(plan.chunks, dtype=torch.float32)
        offsets, codes = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, dtype=torch.int64)]
        for c0 in range(0, plan.chunks, _BATCH):
            c1 = min(c0 + _BATCH, plan.chunks)
            off, v, keep = self._select(x, plan, c0, c1)
            lo[c0:c1], step[c0:c1], q = self._quantize(v, keep)
            offsets.append(off[keep])
            codes.append(q[keep])
        head = torch.cat([lo, step]).view(torch.uint8)
        return torch.cat(
            [
                head,
                pack_bits(torch.cat(offsets), INDEX_BITS),
                pack_bits(torch.cat(codes), self.bits),
            ]
        )

    # ------------------------------------------------------------------ decode
    def _entries(
        self, w: torch.Tensor, n: int, segments: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the shard, fp32 values) of a shard's kept values."""
        plan = self._plan(n, segments)
        if not self.numel_ok(w, n, segments):
            raise ValueError(
                f"{self.name} shard has {w.numel()} bytes, expected {self.nbytes(n, segments)}"
            )
        c = plan.chunks
        head = w[: 8 * c].clone().view(torch.float32)  # may sit at any offset: copy to align
        lo, step = head[:c], head[c:]
        i0 = 8 * c
        i1 = i0 + packed_nbytes(plan.kept, INDEX_BITS)
        offsets = unpack_bits(w[i0:i1], plan.kept, INDEX_BITS)
        codes = unpack_bits(w[i1:], plan.kept, self.bits)
        chunk = torch.repeat_interleave(torch.arange(c), plan.ks)  # per kept value its chunk
        if plan.kept and bool((offsets >= plan.lens[chunk]).any()):
            raise ValueError(f"{self.name} shard has a position outside its chunk")
        mag = (codes & (self.levels - 1)).to(torch.float32).mul_(step[chunk]).add_(lo[chunk])
        values = torch.where(codes >= self.levels, -mag, mag)
        return plan.starts[chunk] + offsets, values

    def decode(
        self,
        w: torch.Tensor,
        n: int,
        out: torch.Tensor | None = None,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        pos, values = self._entries(w, n, segments)
        out = torch.zeros(n, dtype=torch.float32) if out is None else out.zero_()
        return out.index_put_((pos,), values)

    def decode_add(
        self,
        w: torch.Tensor,
        n: int,
        acc: torch.Tensor,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        # positions are distinct: each value is one fp32 add, the bits of adding a full decode
        pos, values = self._entries(w, n, segments)
        return acc.index_put_((pos,), acc[pos].add_(values))

    def all_finite(self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None) -> bool:
        # a value is lo + code * step: finite exactly when its chunk's lo and step are (a
        # NaN or infinite input makes its chunk's magnitudes, hence lo or step, non-finite)
        c = self._plan(n, segments).chunks
        return finite(w[: 8 * c].clone().view(torch.float32))

    # ------------------------------------------------------------------ the average
    def encode_reduced(
        self,
        x: torch.Tensor,
        segments: Sequence[int] | None = None,
        parts: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The average exact: its smallest exact form (:mod:`crf.exchange.codecs.sparse`),
        or the ``parts`` it was summed from as they came (``PARTS``), when that is smaller:
        N top-k parts are about N x density x (12 + bits) bits a value, the exact sum's
        nonzeros 32 bits each plus their positions. Decoding the parts repeats the owner's
        sum (decode the first, add the others in rank order in fp32, divide), element-wise
        IEEE arithmetic: every replica gets the owner's bits."""
        exact = sparse.encode_exact(x)
        if parts:
            size = sparse.HEADER + len(parts) * self.nbytes(x.numel(), segments)
            if size < exact.numel():
                head = torch.tensor([sparse.PARTS, len(parts)], dtype=torch.int32)
                return torch.cat([head.view(torch.uint8), *(p.reshape(-1) for p in parts)])
        return exact

    def _parts(self, w: torch.Tensor, n: int, segments: Sequence[int] | None) -> list[torch.Tensor]:
        """The wire parts of a ``PARTS`` average."""
        _, count = sparse.header(w)
        m = self.nbytes(n, segments)
        return [w[sparse.HEADER + i * m : sparse.HEADER + (i + 1) * m] for i in range(count)]

    def decode_reduced(
        self,
        w: torch.Tensor,
        n: int,
        out: torch.Tensor | None = None,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if sparse.header(w)[0] != sparse.PARTS:
            return sparse.decode_exact(w, n, out)
        parts = self._parts(w, n, segments)
        out = self.decode(parts[0], n, out=out, segments=segments)
        for part in parts[1:]:  # the owner's order and arithmetic (ObjectStoreAllReduce)
            self.decode_add(part, n, out, segments)
        return out.div_(len(parts))

    def reduced_numel_ok(
        self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None
    ) -> bool:
        if w.dtype != torch.uint8 or w.numel() < sparse.HEADER:
            return False
        form, count = sparse.header(w)
        if form == sparse.PARTS:
            return count >= 1 and w.numel() == sparse.HEADER + count * self.nbytes(n, segments)
        return sparse.exact_ok(w, n)

    def reduced_all_finite(
        self, w: torch.Tensor, n: int, segments: Sequence[int] | None = None
    ) -> bool:
        if sparse.header(w)[0] == sparse.PARTS:  # the sum of finite parts may overflow
            return finite(self.decode_reduced(w, n, segments=segments))
        return sparse.exact_finite(w, n)


TOPK2 = TopKCodec(2)
TOPK4 = TopKCodec(4)
TOPK8 = TopKCodec(8)
