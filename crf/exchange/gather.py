"""Step 4 of a round (docs/design.md, "Exchange"): download every reduced shard (computing
those whose owner is late or dead after ``shard_grace_s``), verify them all, then write the
average into the tensors. A replica left out of the quorum with the participants' base takes
the same average (catch-up)."""

from __future__ import annotations

import logging
import time

import torch

from crf import layout
from crf.exchange import codecs as wirefmt
from crf.exchange.round import (
    AllReduceError,
    AllReduceResult,
    _Backoff,
    _Contribution,
    _Round,
    _Segments,
    _size_hint,
)
from crf.exchange.transfers import ExchangeState
from crf.store import CorruptObjectError, StoreError

log = logging.getLogger(__name__)


#: how often a replica waiting for reduced shards asks whether a peer declared the round failed
_FAILED_CHECK_S = 1.0


class Gather(ExchangeState):
    """Step 4: all-gather, and catch-up for a replica that was late."""

    def _gather(
        self, res: AllReduceResult, job: _Round, reduced_here: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Step 4, all-gather: every reduced shard of round ``job.round``, by shard (computing
        those whose owner is late or dead), verified but not yet written anywhere."""
        r, bounds, lhash = job.round, job.bounds, job.lhash
        self._phase("gathering")
        pending = []
        # the averages stay where they are (this replica's reduced buffers, the downloaded
        # objects) until every shard is here and verified; then one copy into the tensors
        got: dict[int, torch.Tensor] = {}
        for s in range(len(bounds)):
            if s in reduced_here:  # published by this replica: no need to download it
                got[s] = reduced_here[s]
            else:
                pending.append(s)
        grace_deadline = time.monotonic() + self.config.shard_grace_s
        backoff = _Backoff(self.config.max_poll_s)
        # a peer may declare the round failed while we wait: asked once a second, not on
        # every poll (a round's shards usually arrive within a poll or two)
        next_failed_check = time.monotonic() + _FAILED_CHECK_S
        while pending:
            if time.monotonic() >= next_failed_check:
                self._raise_if_failed(r)
                next_failed_check = time.monotonic() + _FAILED_CHECK_S
            progressed = self._fetch_reduced(res, r, bounds, lhash, pending, got)
            if not pending:
                break
            if time.monotonic() >= grace_deadline:  # reductions, timed as in step 3
                # owners are late or dead: compute their shards ourselves
                for s in list(pending):
                    log.warning("round %d: shard %d owner is late; computing it", r, s)
                    with self._timed("decode"):
                        if job.plan is not None and job.plan.two_levels:
                            self._reduce_slice(res, job, job.plan, s)
                        else:
                            self._reduce_shard(res, job, s)
                grace_deadline = time.monotonic() + self.config.shard_grace_s
            else:
                with self._timed("wait"):  # for a peer to publish
                    backoff.after(progressed)
        return got

    def _fetch_reduced(
        self,
        res: AllReduceResult,
        r: int,
        bounds: list[tuple[int, int]],
        lhash: str,
        pending: list[int],
        got: dict[int, torch.Tensor],
    ) -> bool:
        """One pass over round r's pending reduced shards (:meth:`_fetch_there`): each one
        there is verified into ``got`` and leaves ``pending``. True if any arrived."""
        keys = {s: (layout.reduced_key(r, s), _size_hint(bounds[s])) for s in pending}
        arrived = self._fetch_there(res, layout.reduced_dir(r), keys)
        for s, data in arrived.items():
            a, b = bounds[s]
            with self._timed("decode"):  # its checks (the checksum)
                got[s] = self._decode_reduced(r, s, keys[s][0], data, lhash, b - a)
            pending.remove(s)
        return bool(arrived)

    def _finish_round(
        self,
        mine: _Contribution,
        got: dict[int, torch.Tensor],
        reduced_here: dict[int, torch.Tensor],
    ) -> None:
        """After step 4: every shard is here and verified: write the average into the
        tensors, each in its own dtype, and let this replica's contribution go."""
        r, bounds = mine.round, mine.packing.bounds
        self._check_averages_finite(
            r,
            {s: w for s, w in got.items() if s not in reduced_here},
            bounds,
            mine.packing.segments,
        )
        self._write_average(got, bounds, mine.tensors, mine.exact)
        if self.config.drop_contributions:  # in the background: nobody waits for it
            self._pool().submit(self._drop_contributions, r, mine.name)

    def _write_average(
        self,
        got: dict[int, torch.Tensor],
        bounds: list[tuple[int, int]],
        tensors: list[torch.Tensor],
        exact: bool,
    ) -> None:
        """Every shard is here and verified: write the average into the tensors."""
        # a codec decodes on the CPU: straight into the tensors when they are there
        if not exact and all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            self._decode_in_place(got, bounds, tensors)
        else:
            self._copy_in_place(got, bounds, tensors)

    def _decode_in_place(
        self,
        got: dict[int, torch.Tensor],
        bounds: list[tuple[int, int]],
        tensors: list[torch.Tensor],
    ) -> None:
        """Decode each compressed shard straight into the contiguous tensors: a shard that is
        one fp32 slice is written in place, so no fp32 copy of the whole average is made."""
        dest = _Segments([t.view(-1) for t in tensors])
        segs = wirefmt.shard_segments([t.numel() for t in tensors], bounds)
        for s, (a, b) in enumerate(bounds):
            targets = dest.pieces(a, b)
            if len(targets) == 1 and targets[0].dtype == torch.float32:
                wirefmt.decode_reduced(got[s], self.wire, b - a, out=targets[0], segments=segs[s])
                continue
            values, pos = wirefmt.decode_reduced(got[s], self.wire, b - a, segments=segs[s]), 0
            for piece in targets:
                piece.copy_(values[pos : pos + piece.numel()])
                pos += piece.numel()

    def _copy_in_place(
        self,
        got: dict[int, torch.Tensor],
        bounds: list[tuple[int, int]],
        tensors: list[torch.Tensor],
    ) -> None:
        """Copy the averaged shards into the tensors, non-contiguous ones included: the exact
        wire's fp32 objects as they are, a compressed wire's decoded to fp32 first."""
        segs = wirefmt.shard_segments([t.numel() for t in tensors], bounds)
        averaged = _Segments(
            [
                wirefmt.decode_reduced(got[s], self.wire, b - a, segments=segs[s])
                for s, (a, b) in enumerate(bounds)
            ]
        )
        offset = 0
        for t in tensors:
            n = t.numel()
            pieces = averaged.pieces(offset, offset + n)
            if t.is_contiguous():
                dst, pos = t.view(-1), 0
                for piece in pieces:
                    dst[pos : pos + piece.numel()].copy_(piece)
                    pos += piece.numel()
            else:
                t.copy_((pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(t.shape))
            offset += n

    def _catch_up(
        self,
        res: AllReduceResult,
        r: int,
        bounds: list[tuple[int, int]],
        lhash: str,
        tensors: list[torch.Tensor],
        exact: bool,
    ) -> bool:
        """Left out of round r's quorum but not stale (same base as the participants): wait
        for the round's reduced shards and put the average in the tensors. The caller's
        outer step then produces exactly the participants' weights and momentum, so the
        replica rejoins without a global checkpoint. False if the round fails or its
        average does not appear in time (the caller heals from global/ then), and if the
        others already decided a later round: this replica would be late for that one too,
        so it jumps to the newest global state instead of catching up round by round."""
        if self._later_decided_round(r) is not None:
            return False
        self._phase("catching up")
        got: dict[int, torch.Tensor] = {}
        pending = list(range(len(bounds)))
        deadline = time.monotonic() + self.config.round_timeout_s + 2 * self.config.shard_grace_s
        backoff = _Backoff(self.config.max_poll_s)
        try:
            while pending:
                self._raise_if_failed(r)
                progressed = self._fetch_reduced(res, r, bounds, lhash, pending, got)
                if not pending:
                    break
                if time.monotonic() >= deadline:
                    log.warning("round %d: its average did not appear; healing instead", r)
                    return False
                backoff.after(progressed)
            self._check_averages_finite(r, got, bounds, self._segments[lhash])
        except (AllReduceError, StoreError, CorruptObjectError) as e:
            log.warning("round %d: cannot take its average (%s); healing instead", r, e)
            return False
        self._write_average(got, bounds, tensors, exact)
        log.info("round %d: late for the quorum; took the published average", r)
        return True
