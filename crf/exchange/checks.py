"""The checks of a round's objects (docs/design.md, "Exchange"): a replica's own numbers
before they go up, the participants' settings, where each downloaded part, reduced shard and
decision came from, that averages are finite - and the failed round every replica discards
alike when the one copy everyone needs is bad."""

from __future__ import annotations

import time
from typing import Any

import torch

from crf import jsonsafe, layout
from crf.exchange import codecs as wirefmt
from crf.exchange.contribution import read_manifest
from crf.exchange.round import (
    AllReduceError,
    AllReduceResult,
    LayoutMismatchError,
    NonFiniteError,
    RoundFailed,
    _gather_fp32,
    _Part,
    _Round,
    _Segments,
    describe_nonfinite,
)
from crf.exchange.transfers import ExchangeState
from crf.layout import contrib_key
from crf.store import CorruptObjectError, ObjectNotFound, decode_tensor

#: how a rejection message says why a part was left out for its values
_NONFINITE = "holds NaN/Inf values: never averaged"


def _reason(e: CorruptObjectError, key: str) -> str:
    """Why an object failed its check, without the ``"<key>: "`` its message starts with (a
    rejection carries the key apart)."""
    return str(e).removeprefix(f"{key}: ")


class Checks(ExchangeState):
    """Checks on what a round reads and writes; failed rounds."""

    def _check_own_finite(
        self,
        r: int,
        s: int,
        tensors: list[torch.Tensor],
        source: _Segments,
        a: int,
        b: int,
        payload: Any,
        fp32: torch.Tensor | None,
        segs: list[int],
    ) -> None:
        """Before anything is uploaded: this replica's shard s must be finite, as fp32 and on
        the wire. A non-finite pseudo-gradient means this replica's weights went non-finite
        during its inner steps (or the wire cannot carry its values): it must not be averaged,
        and the replica cannot go on, so it raises :class:`NonFiniteError`."""
        if (fp32 is None or wirefmt.finite(fp32)) and wirefmt.all_finite(
            payload, self.wire, b - a, segs
        ):
            return
        values = fp32 if fp32 is not None else _gather_fp32(source.pieces(a, b))
        if wirefmt.finite(values):
            decoded = wirefmt.decode(payload, self.wire, b - a, segments=segs)
            raise NonFiniteError(
                f"round {r}: this replica's pseudo-gradient overflows the {self.wire} wire "
                f"(shard {s}: {describe_nonfinite(decoded)}); "
                "use a wider wire format (--wire bfloat16 or float32)"
            )
        # the shard's own values say what is wrong; the tensor is named where one is found
        # (on a GPU the copies of later chunks may still be in flight)
        first = next((i for i, t in enumerate(tensors) if not wirefmt.finite(t)), None)
        where = (
            f"tensor {first} of {len(tensors)}: {describe_nonfinite(tensors[first].detach())}"
            if first is not None
            else f"shard {s}: {describe_nonfinite(values)}"
        )
        raise NonFiniteError(
            f"round {r}: this replica's pseudo-gradient holds non-finite values ({where}): its "
            "weights went NaN/Inf during the inner steps; nothing was uploaded"
        )

    def _check_layouts(
        self,
        res: AllReduceResult,
        r: int,
        participants: list[int],
        mine: dict[str, Any],
        my_facts: str,
        decided: dict[str, Any],
    ) -> None:
        """Every participant must send the same tensors, wire and fragment as this replica.
        The decision carries a digest of each participant's facts; only a participant whose
        digest differs has its manifest read, to say how."""
        contributions = decided.get("contributions") or {}
        for p in participants:
            c = contributions.get(str(p)) or {}
            if p == self.rank or c.get("facts") == my_facts:
                continue
            try:
                other = read_manifest(
                    self.store,
                    contrib_key(r, c.get("name", "")),
                    lambda k, a, b: self._get_range(res, k, a, b),
                )
            except (ObjectNotFound, CorruptObjectError) as e:
                raise AllReduceError(
                    f"round {r}: replica {p} sends other tensors or settings than this "
                    f"replica, and its manifest is unreadable ({e})"
                ) from None
            if other.get("run_id") != self.config.run_id:
                raise LayoutMismatchError(
                    f"round {r}: replica {p}'s contribution is from run {other.get('run_id')!r}"
                )
            if other.get("wire_dtype") != mine["wire_dtype"]:
                raise LayoutMismatchError(
                    f"round {r}: replica {p} sends {other.get('wire_dtype')} on the wire, "
                    f"this replica {mine['wire_dtype']}: all replicas must use one wire format"
                )
            if other.get("fragment") != mine.get("fragment"):
                raise LayoutMismatchError(
                    f"round {r}: replica {p} syncs fragment {other.get('fragment')}, this "
                    f"replica fragment {mine.get('fragment')}: all replicas must use the same "
                    "fragments"
                )
            if other.get("layout_hash") != mine["layout_hash"]:
                raise LayoutMismatchError(_describe_mismatch(r, self.rank, mine, p, other))
            theirs, ours = other.get("reduce_group_size") or 0, mine.get("reduce_group_size") or 0
            if theirs != ours:
                raise LayoutMismatchError(
                    f"round {r}: replica {p} runs with --reduce-group-size {theirs}, this "
                    f"replica with {ours}: all replicas must use the same reduce_group_size"
                )
            if other.get("num_shards") != mine["num_shards"]:
                raise LayoutMismatchError(
                    f"round {r}: replica {p} cuts the vector into {other.get('num_shards')} "
                    f"shards, this replica {mine['num_shards']}: all replicas must use the "
                    "same num_shards"
                )

    def _check_part(
        self, job: _Round, p: int, s: int, name: str, t: Any, hdr: dict[str, Any]
    ) -> _Part:
        """Participant p's decoded part of shard s (``name``), if its header says it is this
        run's, round's, rank's and shard's, its size fits and its values are finite (checked
        here, in the transfer threads, in parallel)."""
        expect = {
            "run_id": self.config.run_id,
            "round": job.round,
            "rank": p,
            "shard": s,
            "layout_hash": job.lhash,
            "numel_total": job.total,
            "wire": self.wire,
        }
        bad = {k: hdr.get(k) for k, v in expect.items() if hdr.get(k) != v}
        lo, hi = job.bounds[s]
        segs = self._segments[job.lhash][s]
        if bad or not wirefmt.wire_numel_ok(t, self.wire, hi - lo, segs):
            return _Part(None, layout.Rejection(name, f"header does not match this round ({bad})"))
        if not wirefmt.all_finite(t, self.wire, hi - lo, segs):
            return _Part(None, layout.Rejection(name, _NONFINITE))
        return _Part(t)

    def _unlike(
        self, hdr: dict[str, Any], r: int, s: int, lhash: str, **more: Any
    ) -> dict[str, Any]:
        """The fields of a downloaded tensor object's header that are not those of this
        run's round r, shard (slice) s, layout and wire, nor ``more``: what it holds instead."""
        expect = {
            "run_id": self.config.run_id,
            "round": r,
            "shard": s,
            "layout_hash": lhash,
            "wire": self.wire,
            **more,
        }
        return {k: hdr.get(k) for k, v in expect.items() if hdr.get(k) != v}

    def _decode_reduced(
        self, r: int, s: int, key: str, data: bytes, lhash: str, n: int
    ) -> torch.Tensor:
        """A downloaded reduced shard, checked for where it came from: its header must name
        this run, round r, shard s, this layout and wire, a reducer of this run, and its size
        fit. One copied from an older round of this run or from another run (same layout,
        valid checksum) is as unusable as a corrupt one: never averaged, and the round fails
        for everyone (the key is create-if-absent: no good copy can replace it)."""
        try:
            t, hdr = decode_tensor(data, where=f"{self.store.uri}/{key}", copy=False)
            bad = self._unlike(hdr, r, s, lhash)
            rank = hdr.get("rank")
            if not (isinstance(rank, int) and 0 <= rank < self.world_size):
                bad["rank"] = rank
            if bad:
                raise CorruptObjectError(
                    f"{key}: reduced shard is not this run's round {r} shard {s} ({bad})"
                )
            segs = self._segments[lhash][s]
            if not wirefmt.reduced_numel_ok(t, self.wire, n, segs):
                raise CorruptObjectError(f"{key}: reduced shard has the wrong size")
        except CorruptObjectError as e:
            # the one copy everyone needs is bad: nobody can finish this round consistently
            raise self._fail_round(r, f"bad reduced shard: {e}", key, str(e)) from e
        return t  # decoded once the whole round is here (allreduce, step 4)

    def _check_averages_finite(
        self,
        r: int,
        got: dict[int, torch.Tensor],
        bounds: list[tuple[int, int]],
        segs: list[list[int]],
    ) -> None:
        """Downloaded averages must be finite before they go into the weights: a reducer
        leaves non-finite parts out, so a non-finite reduced shard is a bad object - the
        round fails for everyone, like a corrupt one."""
        for s, w in got.items():
            if not wirefmt.reduced_all_finite(w, self.wire, bounds[s][1] - bounds[s][0], segs[s]):
                key = layout.reduced_key(r, s)
                raise self._fail_round(r, f"bad reduced shard: {key}: {_NONFINITE}", key)

    def round_failed(self, r: int) -> bool:
        """Whether some replica declared round ``r`` failed (it cannot complete)."""
        return self.store.object_exists(layout.failed_key(r))

    def was_committed(self, r: int) -> bool:
        """Whether round ``r`` was decided and not failed, as far as the store says now: the
        others then took its outer step, and a replica that missed it is behind."""
        return self.store.object_exists(layout.quorum_key(r)) and not self.round_failed(r)

    def _fail_round(
        self, r: int, reason: str, key: str | None = None, said: str | None = None
    ) -> RoundFailed:
        """Declare round r failed for everyone (``failed.json``, create-if-absent: the first
        declaration stands) and return the error to raise. ``key``: the bad object (apart
        from the reason, so nobody reads it out of the text); ``said``: the error's message
        after "round r failed: " when it differs from ``reason``."""
        key = key or layout.failed_key(r)
        body = {"round": r, "reason": reason, "key": key, "by": self.rank, "at": time.time()}
        self.store.put_if_absent(layout.failed_key(r), jsonsafe.dumps(body).encode())
        return RoundFailed(f"round {r} failed: {said or reason}", layout.Rejection(key, reason))

    def _raise_if_failed(self, r: int) -> None:
        try:
            body = self.store.get_json(layout.failed_key(r))
        except ObjectNotFound:
            return
        reason = str(body.get("reason"))
        raise RoundFailed(
            f"round {r} failed (declared by replica {body.get('by')}): {reason}",
            layout.Rejection(str(body.get("key") or layout.failed_key(r)), reason),
        )


def _describe_mismatch(r: int, me: int, mine: dict[str, Any], p: int, other: dict[str, Any]) -> str:
    a, b = mine["layout"], other.get("layout", [])
    if len(a) != len(b):
        what = f"{len(a)} tensors here vs {len(b)} on replica {p}"
    else:
        diffs = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        i = diffs[0]
        what = (
            f"tensor {i} is {a[i][1]}{tuple(a[i][0])} here vs {b[i][1]}{tuple(b[i][0])} "
            f"on replica {p}"
        )
    return (
        f"round {r}: replicas {me} and {p} disagree on the tensors to average ({what}); "
        "every replica must build the same model"
    )
