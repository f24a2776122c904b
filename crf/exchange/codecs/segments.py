"""Which tensors' pieces each shard holds: what a codec that works in blocks (int8) cuts its
blocks along, so no block mixes two tensors. Pure arithmetic on the layout, no torch."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def shard_segments(sizes: Sequence[int], bounds: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Per shard [a, b) of the concatenated tensors (of ``sizes`` values each), the lengths
    of the tensors' pieces it holds, in order: what
    :func:`crf.exchange.codecs.int8.int8_blocks` cuts blocks along. A tensor split across
    shards gives a piece to each."""
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
