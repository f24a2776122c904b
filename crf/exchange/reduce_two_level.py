"""Step 3 of a round with two levels (docs/performance.md, "Two-level reduction for large
N"): group sums of each slice (``partial/<i>/<g>``), then each slice's leader adds the groups'
sums in group order into ``reduced/<i>``; a missing sum or slice is computed by any participant
after ``shard_grace_s``. The parts are read and added as in one level
(:mod:`crf.exchange.reduce`)."""

from __future__ import annotations

import logging
import time

import torch

from crf import layout
from crf.exchange import codecs as wirefmt
from crf.exchange.checks import _NONFINITE
from crf.exchange.groups import GroupPlan
from crf.exchange.round import (
    AllReduceResult,
    RoundFailed,
    _AlreadyReduced,
    _Backoff,
    _Round,
    _size_hint,
    _Sum,
    describe_nonfinite,
)
from crf.exchange.transfers import ExchangeState
from crf.store import CorruptObjectError, decode_tensor
from crf.store.codec import encode_tensor_parts

log = logging.getLogger(__name__)


class TwoLevelReduce(ExchangeState):
    """Step 3, two levels: group sums, then slice averages."""

    def _reduce_two_levels(
        self, res: AllReduceResult, job: _Round, plan: GroupPlan
    ) -> dict[int, torch.Tensor]:
        """Step 3 with two levels: sum the slices this replica owns over its group and
        publish each as ``partial/<i>/<g>``; then, for each slice it leads, add the groups'
        sums in group order and publish their average as ``reduced/<i>`` (the one-level
        format, so the gather, catch-up and checks are the same). Returns the reduced wire
        tensors it published, by slice."""
        self._phase("reducing")
        g = plan.group_of(self.rank)
        own: dict[tuple[int, int], _Sum] = {}
        for i in range(plan.size):
            if plan.partial_owner(g, i) == self.rank:
                total = self._reduce_partial(res, job, plan, g, i, first=True)
                if total is not None:
                    own[(g, i)] = total
        reduced_here: dict[int, torch.Tensor] = {}
        for i in range(plan.size):
            if plan.leader(i) == self.rank:
                w = self._reduce_slice(res, job, plan, i, own=own, first=True)
                if w is not None:
                    reduced_here[i] = w
        return reduced_here

    def _reduce_partial(
        self,
        res: AllReduceResult,
        job: _Round,
        plan: GroupPlan,
        g: int,
        i: int,
        *,
        first: bool = False,
    ) -> _Sum | None:
        """Group g's sum of slice i: its members' parts in rank order, fp32, not divided,
        published create-if-absent as ``partial/<i>/<g>`` with the ranks it holds (a part
        missing, corrupt or not finite is left out and reported, as in one level). The
        published sum is the one every leader adds, so when another replica published it
        first, that one is returned. None when the slice's average is out already (its
        inputs may be gone). ``first``: the owner's own attempt (kept buffer, no lookup)."""
        r = job.round
        key = layout.partial_key(r, g, i)
        if not first:
            there = self._published_partial(res, job, plan, g, i)
            if there is not None:
                return there
        members = plan.groups[g]
        fetches = {
            p: self._pool().submit(self._fetch_contrib, res, job, p, i, 0.0)
            for p in members
            if p != self.rank
        }
        acc: torch.Tensor | None = None
        used: list[int] = []
        for p in members:  # fixed rank order
            try:
                w = self._usable_part(res, job, i, p, fetches)
            except _AlreadyReduced:
                for f in fetches.values():
                    f.cancel()
                return None
            if w is not None:
                acc = self._add_part(job, i, acc, w, buffer="partial" if first else None)
                used.append(p)
        if acc is None:  # nothing usable in this group: an empty sum, which adds nothing
            a, b = job.bounds[i]
            acc = torch.zeros(b - a, dtype=torch.float32)
        if not wirefmt.finite(acc):  # finite parts whose sum overflowed fp32
            why = f"the sum of slice {i} over group {g} overflowed float32"
            raise self._fail_round(r, f"{why} ({describe_nonfinite(acc)})")
        meta = self._meta(r, i, job.lhash, job.total) | {"group": g, "participants": used}
        if self._put(res, key, encode_tensor_parts(acc, meta), exclusive=True):
            return _Sum(acc, used)
        return self._published_partial(res, job, plan, g, i)

    def _published_partial(
        self, res: AllReduceResult, job: _Round, plan: GroupPlan, g: int, i: int
    ) -> _Sum | None:
        """Group g's sum of slice i if it is published (one lookup), else None."""
        return self._wait_partials(res, job, plan, i, [g], 0.0)[g]

    def _wait_partials(
        self,
        res: AllReduceResult,
        job: _Round,
        plan: GroupPlan,
        i: int,
        groups: list[int],
        wait_s: float,
    ) -> dict[int, _Sum | None]:
        """The published sums of slice i of ``groups``, asked for (in parallel) until all
        are there or ``wait_s`` has passed; None for those still missing. With many
        missing, one listing of ``partial/<i>/`` per pass says which to download
        (:meth:`_fetch_there`), as the gather does for reduced shards."""
        r = job.round
        found: dict[int, _Sum | None] = dict.fromkeys(groups)
        missing = list(groups)
        deadline = time.monotonic() + wait_s
        backoff = _Backoff(self.config.max_poll_s)
        hint = _size_hint(job.bounds[i])
        while missing:
            keys = {g: (layout.partial_key(r, g, i), hint) for g in missing}
            with self._timed("download"):
                arrived = self._fetch_there(res, layout.partial_dir(r, i), keys)
            for g, data in arrived.items():
                found[g] = self._decode_partial(job, plan, g, i, keys[g][0], data)
                missing.remove(g)
            if not missing or time.monotonic() >= deadline:
                break
            with self._timed("wait"):
                backoff.after(bool(arrived))
        return found

    def _decode_partial(
        self, job: _Round, plan: GroupPlan, g: int, i: int, key: str, data: bytes
    ) -> _Sum:
        """A downloaded group sum, checked like a reduced shard: this run's, round's,
        group's and slice's, the right size, finite, over members of the group. A bad one
        fails the round for everyone (its key is create-if-absent: nothing can replace it)."""
        r = job.round
        try:
            t, hdr = decode_tensor(data, where=f"{self.store.uri}/{key}", copy=False)
            bad = self._unlike(hdr, r, i, job.lhash, group=g, numel_total=job.total)
            used = hdr.get("participants")
            if not (isinstance(used, list) and used == sorted(set(used))) or not set(used) <= set(
                plan.groups[g]
            ):
                bad["participants"] = used
            if bad:
                raise CorruptObjectError(
                    f"{key}: not this run's sum of round {r} group {g} slice {i} ({bad})"
                )
            a, b = job.bounds[i]
            if t.dtype != torch.float32 or t.numel() != b - a:
                raise CorruptObjectError(f"{key}: group sum has the wrong size or dtype")
            if not wirefmt.finite(t):
                raise CorruptObjectError(f"{key}: {_NONFINITE}")
        except CorruptObjectError as e:
            raise self._fail_round(r, f"bad group sum: {e}", key, str(e)) from e
        return _Sum(t, list(used))

    def _reduce_slice(
        self,
        res: AllReduceResult,
        job: _Round,
        plan: GroupPlan,
        i: int,
        *,
        own: dict[tuple[int, int], _Sum] | None = None,
        first: bool = False,
    ) -> torch.Tensor | None:
        """Slice i's average: the groups' sums in group order (fp32), divided by the number
        of parts they hold, published create-if-absent as ``reduced/<i>``. The leader
        (``first``) waits up to ``shard_grace_s`` for each sum; one still missing then (its
        owner is late or dead) it computes from the contributions, as a fallback (after the
        gather's grace period) does for every missing one. ``own``: sums this replica
        published. Returns the wire tensor if this call published it."""
        r = job.round
        if not first and self.store.object_exists(layout.reduced_key(r, i)):
            return None
        own = own or {}
        wait_s = self.config.shard_grace_s if first else 0.0
        # the wait ends before a missing sum is computed: its downloads then find the
        # transfer threads free
        groups = range(len(plan.groups))
        mine = {g: own[(g, i)] for g in groups if (g, i) in own}
        rest = [g for g in groups if g not in mine]
        waited = self._wait_partials(res, job, plan, i, rest, wait_s)
        found = {g: mine[g] if g in mine else waited[g] for g in groups}  # group order
        if None in found.values() and self.store.object_exists(layout.reduced_key(r, i)):
            return None  # published meanwhile by a fallback
        sums: list[_Sum] = []
        for g, total in found.items():  # fixed group order
            if total is None:
                log.warning("round %d: group %d's sum of slice %d is late; computing it", r, g, i)
                total = self._reduce_partial(res, job, plan, g, i)
                if total is None:  # the average is out: its inputs may be gone
                    return None
            sums.append(total)
        acc: torch.Tensor | None = None
        used: list[int] = []
        for total in sums:
            if not total.used:
                continue
            if acc is None:
                a, b = job.bounds[i]
                acc = self._buffer(f"acc{i}", b - a) if first else torch.empty(b - a)
                acc.copy_(total.values)
            else:
                acc.add_(total.values)
            used.extend(total.used)
        if acc is None:
            why = f"no usable contribution for shard {i}"
            raise RoundFailed(f"round {r}: {why}", layout.Rejection(layout.failed_key(r), why))
        return self._publish_reduced(res, job, i, acc, used, [])
