"""Step 1 of a round (docs/design.md, "Exchange"): cut the tensors into shards, encode them
for the wire (error feedback applied, each checked finite) and upload them with a manifest in
front as one contribution object, holding back the shards this replica owns in a full quorum."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from crf.exchange import codecs as wirefmt
from crf.exchange.contribution import (
    Arrival,
    Packing,
    contrib_name,
    encode_manifest,
    facts_digest,
    manifest_size,
    shard_header_size,
)
from crf.exchange.round import (
    AllReduceResult,
    _Contribution,
    _gather_fp32,
    _layout_hash,
    _Segments,
    layout_of,
    shard_bounds,
)
from crf.exchange.transfers import ExchangeState
from crf.faults import maybe_fault, maybe_poison
from crf.layout import contrib_key
from crf.store.codec import encode_tensor_parts


def _poisoned(payload: Any, wire: str, n: int) -> Any:
    """A copy of a shard with its first value NaN (fault injection: ``nan_contribution``);
    for int8 and the top-k wires, its first block's scale."""
    if n == 0:
        return payload
    if isinstance(payload, list):
        out = [p.clone() for p in payload]
        next(p for p in out if p.numel()).view(-1)[0] = float("nan")
        return out
    out = payload.clone()
    if wire == "int8" or wire.startswith("topk"):  # both start with an fp32 scale
        out[:4].view(torch.float32)[0] = float("nan")
    else:
        out[0] = float("nan")
    return out


class Upload(ExchangeState):
    """Step 1: this replica's contribution."""

    def _cut_into_shards(self, r: int, tensors: list[torch.Tensor]) -> _Contribution:
        """Step 1's plan: where the shards of these tensors start and end, and where each
        shard's frame sits in a contribution object of this round."""
        shapes = layout_of(tensors)
        lhash = _layout_hash(shapes)
        views = [t.detach().reshape(-1) for t in tensors]  # a view unless non-contiguous
        # the exact wire reads the tensors themselves: a shard is the list of their slices it
        # covers, checksummed and written without being copied into one vector. A compressed
        # wire encodes shard by shard from those slices too (a shard inside one fp32 tensor
        # is encoded straight from it), so no fp32 copy of the whole vector is kept
        source = _Segments(views)
        exact = self.wire == "float32" and all(v.dtype == torch.float32 for v in views)
        bounds = shard_bounds(source.numel, self.config.num_shards)
        segs = self._shard_segments(lhash, [v.numel() for v in views], bounds)
        packing = Packing(
            bounds,
            self.wire,
            self.world_size,
            manifest_size(
                shapes,
                self.config.run_id,
                self.config.num_shards,
                self.world_size,
                # room for the reduce_group_size fact (one level: the size it always had)
                extra=32 if self._two_level else 0,
            ),
            shard_header_size(self.config.run_id),
            segs,
            hold_back=not self.config.reduce_group_size,
        )
        return _Contribution(r, tensors, source, exact, shapes, lhash, packing)

    def _encode_shards(
        self,
        mine: _Contribution,
        previous: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> list[Future]:
        """Step 1's encoding: each shard's wire payload into ``mine.wire`` (checked finite;
        error feedback applied and its residual kept), and the checksummed parts of those
        that are uploaded, computed in parallel."""
        r, tensors, source, packing = mine.round, mine.tensors, mine.source, mine.packing
        bounds, segs = packing.bounds, packing.segments
        held_back = packing.kept(self.rank)
        encoding = []
        for s, (a, b) in enumerate(bounds):
            if mine.staged is not None:  # this shard's chunks of a device copy
                with self._timed("d2h"):
                    mine.staged.wait_until(b)
            if mine.exact:
                payload: Any = source.pieces(a, b)
                self._check_own_finite(r, s, tensors, source, a, b, payload, None, segs[s])
            else:
                x = _gather_fp32(source.pieces(a, b))
                if previous is not None:  # error feedback: resend what was dropped before
                    if self._decay == 1.0:
                        x = x + previous[a:b]
                    else:  # SparseLoCo: e <- beta * e + delta
                        x = previous[a:b].mul(self._decay).add_(x)
                payload = wirefmt.encode(x, self.wire, segs[s])
                # the fp32 values (int8 would encode a NaN block as finite garbage) and what
                # went on the wire (float16 overflows past 65504)
                self._check_own_finite(r, s, tensors, source, a, b, payload, x, segs[s])
                if residual is not None:
                    residual[a:b] = x - wirefmt.decode(payload, self.wire, b - a, segments=segs[s])
                del x
            if maybe_poison("nan_contribution", self.rank, r, self.store):
                payload = _poisoned(payload, self.wire, b - a)
            mine.wire[s] = payload
            if s not in held_back:  # checksums of the shards are computed in parallel
                encoding.append(
                    self._pool().submit(
                        encode_tensor_parts,
                        payload,
                        self._meta(r, s, mine.lhash, source.numel),
                        header_bytes=packing.header_bytes,
                    )
                )
        return encoding

    def _upload_contribution(
        self,
        res: AllReduceResult,
        mine: _Contribution,
        base_round: int | None,
        fragment: int | None,
    ) -> None:
        """Step 1: publish my contribution: the manifest and every shard but the ones this
        replica owns in a full quorum (those stay in memory: the owner never downloads its
        own part, so a replica uploads ~P, not P + P/N), packed into one object, one PUT."""
        r, total = mine.round, mine.source.numel
        residual = previous = None
        if not mine.exact and self.config.error_feedback:
            residual = torch.zeros(total)
            previous = self._residual.get(fragment)
            if previous is not None and previous.numel() != total:
                previous = None
        self._phase("uploading")
        encoding = self._encode_shards(mine, previous, residual)
        mine.manifest = {
            "rank": self.rank,
            "run_id": self.config.run_id,
            "round": r,
            "layout_hash": mine.lhash,
            "layout": mine.layout,
            "base_round": base_round,
            "numel": total,
            "num_shards": self.config.num_shards,
            "wire_dtype": self.wire,
            "held_back": mine.packing.kept(self.rank),
            "fragment": fragment,
        }
        if self.config.reduce_group_size:  # an optional fact: absent, one level's names
            mine.manifest["reduce_group_size"] = self.config.reduce_group_size
        parts: list[Any] = [encode_manifest(mine.manifest, mine.packing.manifest_bytes)]
        for f in encoding:  # checksums: still encoding
            parts.extend(f.result())
        mine.facts = facts_digest(mine.manifest)
        mine.name = contrib_name(self.rank, base_round, mine.facts)
        maybe_fault("uploading", self.rank, r, self.store)
        self._put(res, contrib_key(r, mine.name), parts)
        del parts

        if residual is not None:
            self._residual[fragment] = residual
        for old in [k for k in self._present if k < r]:
            del self._present[old]
        self._present.setdefault(r, {})[self.rank] = Arrival(
            self.rank, base_round, mine.facts, mine.name
        )
