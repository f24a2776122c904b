"""Step 3 of a round with one level (docs/design.md, "Exchange"): each shard's owner
averages it over the participants in rank order (fp32) and publishes it create-if-absent; a
part missing, corrupt or not finite is left out and reported. The same code is the fallback
that any participant runs for a shard whose owner is late or dead."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from crf import layout
from crf.exchange import codecs as wirefmt
from crf.exchange.checks import _NONFINITE, _reason
from crf.exchange.round import (
    AllReduceResult,
    RoundFailed,
    _AlreadyReduced,
    _Part,
    _Round,
    _size_hint,
    describe_nonfinite,
)
from crf.exchange.transfers import ExchangeState
from crf.faults import maybe_fault
from crf.layout import contrib_key, held_key, shard_name
from crf.store import CorruptObjectError, ObjectNotFound, decode_tensor, wait_until
from crf.store.codec import encode_tensor_parts

log = logging.getLogger(__name__)


class OneLevelReduce(ExchangeState):
    """Step 3, one level: reduce-scatter through the store."""

    def _publish_held_back(self, res: AllReduceResult, job: _Round) -> None:
        """After the quorum: a degraded quorum moves ownership, so the shards this replica
        held back (it owns them in a full quorum) go up for the participant that owns them
        now, each as its own object in ``held/``."""
        r, participants = job.round, job.participants
        for s in job.packing.kept(self.rank):
            if participants[s % len(participants)] != self.rank:
                meta = self._meta(r, s, job.lhash, job.total)
                self._put(res, held_key(r, self.rank, s), encode_tensor_parts(job.mine[s], meta))

    def _reduce_my_shards(self, res: AllReduceResult, job: _Round) -> dict[int, torch.Tensor]:
        """Step 3, reduce-scatter: average and publish the shards this replica owns; returns
        the wire tensors it published, by shard (orphans wait for the gather's grace period)."""
        self._phase("reducing")
        reduced_here: dict[int, torch.Tensor] = {}
        for s in range(self.config.num_shards):
            if job.participants[s % len(job.participants)] == self.rank:
                w = self._reduce_shard(res, job, s, first=True)
                if w is not None:
                    reduced_here[s] = w
        return reduced_here

    def _reduce_shard(
        self, res: AllReduceResult, job: _Round, s: int, *, first: bool = False
    ) -> torch.Tensor | None:
        """Average shard s over the participants whose contribution is present and intact,
        in rank order with fp32 accumulation, and publish it (create-if-absent). The
        published object is the one truth every replica downloads, so a contribution left out
        (missing after the grace period, or failing its integrity check) changes that shard's
        average for everyone alike and never forks the weights. Returns the wire tensor if
        this call published it. ``first``: the owner's own first attempt (nobody else computes
        a shard before its grace period, so it skips asking whether it exists)."""
        if not first and self.store.object_exists(layout.reduced_key(job.round, s)):
            return None
        fetches = self._fetch_parts(res, job, s)
        acc: torch.Tensor | None = None
        used, parts = [], []
        for p in job.participants:  # fixed rank order
            try:
                w = self._usable_part(res, job, s, p, fetches)
            except _AlreadyReduced:
                return None
            if w is not None:
                acc = self._add_part(job, s, acc, w)
                used.append(p)
                if self._sparse:  # small: a sparse average may go as its parts
                    parts.append(w)
        if acc is None:
            why = f"no usable contribution for shard {s}"
            raise RoundFailed(
                f"round {job.round}: {why}", layout.Rejection(layout.failed_key(job.round), why)
            )
        return self._publish_reduced(res, job, s, acc, used, parts)

    def _fetch_parts(self, res: AllReduceResult, job: _Round, s: int) -> dict[int, Future]:
        """Start downloading the others' parts of shard s (those fetched early are taken as
        they are), by rank: they download in parallel and add up in rank order. A part that
        never left its replica (its shard's owner in a full quorum, still the owner) has
        none."""
        owner = job.participants[s % len(job.participants)]
        fetches: dict[int, Future] = {}
        for p in job.participants:
            home = job.packing.keeps(p, s)  # p keeps shard s at home in a full quorum
            if p == self.rank or (home and owner == p):
                continue
            fetches[p] = job.early.pop((p, s), None) or self._pool().submit(
                self._fetch_contrib,
                res,
                job,
                p,
                s,
                self.config.shard_grace_s if home else 0.0,  # uploaded late?
            )
        return fetches

    def _fetch_contrib(
        self,
        res: AllReduceResult,
        job: _Round,
        p: int,
        s: int,
        wait_s: float,
    ) -> _Part:
        """Participant p's wire tensor for shard s, or why it cannot be averaged. A shard p
        keeps is read from ``held/`` (p published it for a degraded quorum, perhaps late:
        ``wait_s``); any other from its range of p's contribution object."""
        r = job.round
        held = s in job.packing.kept(p)
        key = held_key(r, p, s) if held else contrib_key(r, job.names[p])
        name = key if held else shard_name(r, p, s)  # what a rejection names
        if wait_s > 0 and held:
            rkey = layout.reduced_key(r, s)  # once published, the part is not needed
            wait_until(
                lambda: self.store.object_exists(key) or self.store.object_exists(rkey),
                wait_s,
                poll_s=0.005,
                max_poll_s=self.config.max_poll_s,
            )
        try:
            if held:
                data = self._get(res, key, _size_hint(job.bounds[s]))
            else:
                a, b = job.packing.ranges(p)[s]
                data = self._get_range(res, key, a, b)
            t, hdr = decode_tensor(data, where=name, copy=False)
        except ObjectNotFound:
            if self.store.object_exists(layout.reduced_key(r, s)):
                # dropped by its uploader after the round completed: this shard's average
                # is published already, and this attempt would lose the race anyway
                raise _AlreadyReduced(s) from None
            return _Part(None, layout.Rejection(name, "missing", left_out=True))
        except CorruptObjectError as e:
            return _Part(None, layout.Rejection(name, _reason(e, name)))
        return self._check_part(job, p, s, name, t, hdr)

    def _usable_part(
        self, res: AllReduceResult, job: _Round, s: int, p: int, fetches: dict[int, Future]
    ) -> Any | None:
        """Participant p's wire part of shard s if it can be averaged; else None, and why in
        ``res.rejected``. Raises :class:`_AlreadyReduced` if the shard's average is out."""
        r = job.round
        if p == self.rank:
            a, b = job.bounds[s]
            w: Any = job.mine[s]
            # e.g. poisoned after its check
            if wirefmt.all_finite(w, self.wire, b - a, self._segments[job.lhash][s]):
                return w
            log.warning("round %d: left out of shard %d: its own part is not finite", r, s)
            res.rejected.append(layout.Rejection(shard_name(r, p, s), _NONFINITE))
            return None
        if p not in fetches:
            # p's own shard never leaves p: p is dead or late (we are the fallback)
            res.rejected.append(
                layout.Rejection(shard_name(r, p, s), f"owner {p} did not reduce it", left_out=True)
            )
            return None
        with self._timed("download"):
            part = fetches[p].result()
        if part.problem is not None:
            log.warning("round %d: left out of shard %d: %s", r, s, part.problem)
            res.rejected.append(part.problem)
        return part.tensor

    def _add_part(
        self, job: _Round, s: int, acc: torch.Tensor | None, w: Any, buffer: str | None = "acc"
    ) -> torch.Tensor:
        """``acc`` plus one participant's wire part of shard s, in fp32; the first part
        is copied (decoded) into a kept buffer per shard, as this round may own several
        (``buffer``: its name before the shard's number; None: a new tensor, for a
        fallback's one-off sums)."""
        a, b = job.bounds[s]
        segs = self._segments[job.lhash][s]  # int8 blocks restart at every tensor
        first_part = acc is None
        if acc is None:
            acc = (
                self._buffer(f"{buffer}{s}", b - a)
                if buffer is not None
                else torch.empty(b - a, dtype=torch.float32)
            )
        if isinstance(w, list):  # the exact wire's fp32 slices
            pos = 0
            for piece in w:
                dst = acc[pos : pos + piece.numel()]
                dst.copy_(piece) if first_part else dst.add_(piece)
                pos += piece.numel()
        elif first_part:  # compressed: decoded straight into the accumulator
            wirefmt.decode(w, self.wire, b - a, out=acc, segments=segs)
        else:
            wirefmt.decode_add(w, self.wire, b - a, acc, segments=segs)
        return acc

    def _publish_reduced(
        self,
        res: AllReduceResult,
        job: _Round,
        s: int,
        acc: torch.Tensor,
        used: list[int],
        parts: list[Any],
    ) -> torch.Tensor | None:
        """Divide shard s's sum of ``used`` parts into their average and publish it
        (create-if-absent; a sparse wire may publish the ``parts`` themselves when smaller);
        the wire tensor if this call published it. A sum that overflowed
        fails the round for everyone."""
        r = job.round
        acc.div_(len(used))
        if not wirefmt.finite(acc):  # finite parts whose sum overflowed fp32
            why = f"the sum of shard {s} overflowed float32 ({describe_nonfinite(acc)})"
            raise self._fail_round(r, why)
        maybe_fault("owning_shard", self.rank, r, self.store)
        meta = self._meta(r, s, job.lhash, job.total) | {"participants": used}
        # the codec's form of an average: a sparse wire's is exact, not top-k again
        with self._timed("encode"):
            wire = wirefmt.encode_reduced(acc, self.wire, self._segments[job.lhash][s], parts)
            data = encode_tensor_parts(wire, meta)  # its checksum
        key = layout.reduced_key(r, s)
        if self._put(res, key, data, exclusive=True):
            res.shards_computed.append(s)
            return wire
        return None
