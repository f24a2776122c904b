"""The exact form of a sparse wire's average: what a shard's owner publishes after summing
the participants' top-k parts in fp32 (:meth:`crf.exchange.codecs.topk.TopKCodec.encode_reduced`).

The sum of N sparse parts is sparse too (at most N times the density), so it goes on the wire
as it is, never quantized again: every replica downloads the same object and applies the same
bits, and nothing is lost in the average. Of three forms the smallest is published:

* dense: the ``n`` fp32 values (``4 n`` bytes);
* positions: the nonzero values' positions (int32, ascending) and their fp32 values
  (``8 k`` bytes for ``k`` nonzeros);
* bitmap: one bit per value saying whether it is nonzero, then the nonzero fp32 values
  (``n / 8 + 4 k`` bytes: smaller than positions from ``k > n / 32``).

On the wire, as uint8 bytes: an int32 header ``[form, k]``, then the form's body. A sparse
codec may add a form of its own (top-k: ``PARTS``, the summed parts as they came). A value that
sums to zero (positive or negative) is left out and decodes as +0.0.
"""

from __future__ import annotations

import numpy as np
import torch

from crf.exchange.codecs.base import finite

DENSE, POSITIONS, BITMAP = 0, 1, 2
#: a fourth form, the codec's own: the parts the average was summed from
#: (:meth:`crf.exchange.codecs.topk.TopKCodec.encode_reduced`)
PARTS = 3
HEADER = 8


def form_sizes(n: int, k: int) -> dict[int, int]:
    """Bytes of each form (header included) for ``k`` nonzeros among ``n`` values."""
    return {
        DENSE: HEADER + 4 * n,
        POSITIONS: HEADER + 8 * k,
        BITMAP: HEADER + (n + 7) // 8 + 4 * k,
    }


def encode_exact(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` in its smallest exact form (ties: the earlier form in DENSE, POSITIONS,
    BITMAP)."""
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    mask = x != 0  # NaN is kept (and caught by the finiteness check)
    k = int(mask.sum())
    sizes = form_sizes(n, k)
    form = min(sizes, key=lambda f: (sizes[f], f))
    header = torch.tensor([form, k], dtype=torch.int32).view(torch.uint8)
    if form == DENSE:
        return torch.cat([header, x.contiguous().view(torch.uint8)])
    values = x[mask].contiguous().view(torch.uint8)
    if form == POSITIONS:
        pos = torch.nonzero(mask).reshape(-1).to(torch.int32).view(torch.uint8)
        return torch.cat([header, pos, values])
    bitmap = torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    return torch.cat([header, bitmap, values])


def header(w: torch.Tensor) -> tuple[int, int]:
    """(form, count) of an average on the wire."""
    form, k = w[:HEADER].clone().view(torch.int32).tolist()
    return form, k


def _fp32(w: torch.Tensor) -> torch.Tensor:
    """Bytes at any offset of a downloaded object as fp32 (copied to align them)."""
    return w.clone().view(torch.float32)


def _mask(w: torch.Tensor, n: int) -> torch.Tensor:
    bits = np.unpackbits(w[HEADER : HEADER + (n + 7) // 8].numpy(), bitorder="little")
    return torch.from_numpy(bits[:n].astype(bool))


def _positions(w: torch.Tensor, k: int) -> torch.Tensor:
    return w[HEADER : HEADER + 4 * k].clone().view(torch.int32).to(torch.int64)


def exact_ok(w: torch.Tensor, n: int) -> bool:
    """Whether a downloaded object is a well-formed exact shard of ``n`` values: its size
    fits its header, its positions are ascending and inside the shard, its bitmap counts
    its values."""
    if w.dtype != torch.uint8 or w.dim() != 1 or w.numel() < HEADER:
        return False
    form, k = header(w)
    if form not in (DENSE, POSITIONS, BITMAP) or not 0 <= k <= n:
        return False
    if w.numel() != form_sizes(n, k)[form]:
        return False
    if form == POSITIONS and k:
        pos = _positions(w, k)
        return bool(pos[0] >= 0) and bool(pos[-1] < n) and bool((pos[1:] > pos[:-1]).all())
    if form == BITMAP:
        return int(_mask(w, n).sum()) == k
    return True


def _values(w: torch.Tensor, n: int) -> torch.Tensor:
    form, k = header(w)
    start = form_sizes(n, k)[form] - 4 * (n if form == DENSE else k)
    return _fp32(w[start:])


def exact_finite(w: torch.Tensor, n: int) -> bool:
    """Whether the shard's values are all finite (its zeros are)."""
    return finite(_values(w, n))


def decode_exact(w: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` fp32 values of an exact shard, written into ``out`` when given."""
    form, k = header(w)
    values = _values(w, n)
    if form == DENSE:
        return values if out is None else out.copy_(values)
    out = torch.zeros(n, dtype=torch.float32) if out is None else out.zero_()
    if form == POSITIONS:
        return out.index_put_((_positions(w, k),), values)
    out[_mask(w, n)] = values
    return out
