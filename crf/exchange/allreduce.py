"""ObjectStoreAllReduce: average tensors across replicas that meet only through a store.

One round (docs/design.md, "Exchange"):

1. every replica cuts its tensors (read as one vector, not copied into one) into
   ``num_shards`` shards and uploads them, with a manifest (layout, base round, wire) in front,
   as ONE object ``rounds/<r>/contrib/<rank>.<base round>.<facts>``
   (:mod:`crf.exchange.contribution`: each shard at a byte range every replica can compute,
   so a reader fetches just its shard); the shard a replica owns in a full quorum stays home;
2. when all N contributions are listed, the lowest eligible rank (on the newest base round)
   creates ``rounds/<r>/quorum.json`` (create-if-absent: one decision) from the listing
   alone - the names carry what the decision needs - with the participants, their
   contributions and facts digests; anyone decides if it has not appeared after a grace
   period, or once the round deadline passes with at least ``min_replicas`` arrived;
3. shard ``s`` is owned by ``participants[s % len(participants)]``; the owner averages it over
   the quorum in rank order (fp32 accumulation, so every replica that computes a shard gets the
   same bits) and publishes ``rounds/<r>/reduced/<s>``; if the owner does not publish within
   ``shard_grace_s`` any participant computes it — the inputs are all in the store;
4. every participant downloads all reduced shards and copies the average back in place.

With ``reduce_group_size`` G > 0 step 3 has two levels (docs/performance.md, "Two-level
reduction for large N"): the participants form groups of G consecutive ranks and the vector
G slices (the shards, none held back); member i of group g publishes the group's fp32 sum of
slice i (``rounds/<r>/partial/<i>/<g>``), slice i's leader (:mod:`crf.exchange.groups`) adds
the groups' sums in group order into ``rounds/<r>/reduced/<i>``; a missing sum or slice is
computed by any participant after ``shard_grace_s``, as in one level.

Per replica and round this moves about P up and 2·P down (P = payload), whatever N is.
A contribution whose integrity check fails, or that holds a NaN or infinite value, is never
averaged: it is left out of that shard's average, which every replica then copies alike, and
reported. A replica whose own pseudo-gradient is not finite uploads nothing and raises
:class:`NonFiniteError`. A reduced shard that fails its check marks
the round failed for everyone (``rounds/<r>/failed.json``), so all replicas discard it
together.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from crf import jsonsafe, layout
from crf.exchange import codecs as wirefmt
from crf.exchange.config import ExchangeConfig, ExchangeHooks, _check_int
from crf.exchange.contribution import (
    FACTS,
    Arrival,
    Packing,
    contrib_name,
    encode_manifest,
    facts_digest,
    manifest_size,
    parse_contrib_name,
    read_manifest,
    shard_header_size,
)
from crf.exchange.groups import GroupPlan
from crf.exchange.quorum import QuorumDecision, QuorumPort
from crf.exchange.quorum import Stale as _Stale
from crf.faults import maybe_fault, maybe_poison
from crf.layout import contrib_key, held_key, shard_name
from crf.store import (
    CorruptObjectError,
    ObjectNotFound,
    RunStore,
    StoreError,
    decode_tensor,
    wait_until,
)
from crf.store.codec import dtype_name, encode_tensor_parts

log = logging.getLogger(__name__)


#: above this many reduced shards still missing, a poll lists the round's ``reduced/`` once
#: and downloads only what is there, rather than asking for each missing shard (a request
#: per shard per poll: with N = 64 most of a replica's requests were such misses;
#: docs/performance.md, "Scaling to 64 replicas")
_LIST_ABOVE = 4
#: how often a replica waiting for reduced shards asks whether a peer declared the round failed
_FAILED_CHECK_S = 1.0
#: a heartbeat counts as a sign of life for this long, as a share of the round deadline (and
#: at most _ALIVE_MAX_S): a live replica refreshes it every second, while a dead one's is
#: at least a deadline old once the round it missed was decided
_ALIVE_SHARE = 0.6
_ALIVE_MAX_S = 30.0


class AllReduceError(RuntimeError):
    """The round could not complete (quorum not reached, round failed, layout mismatch)."""


class LayoutMismatchError(AllReduceError, ValueError):
    """Replicas passed tensors of different count, shape or dtype."""


class QuorumTimeout(AllReduceError, TimeoutError):
    """Fewer than min_replicas contributions arrived before the round deadline."""


class NonFiniteError(ArithmeticError):
    """This replica's own numbers (its pseudo-gradient, its weights) hold NaN or infinite
    values. Not an :class:`AllReduceError`: the round is not lost for the others, this
    replica is - and so is a restart of it, which would compute the same numbers again from
    the same global state and data (see docs/faults.md)."""


def describe_nonfinite(t: torch.Tensor) -> str:
    """'3 NaN, 1 Inf of 4096 values' (what a NonFiniteError message says about a tensor)."""
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"{nan} NaN, {inf} Inf of {t.numel()} values"


class _AlreadyReduced(Exception):
    """A contribution is gone because its shard's average was published (and the uploader
    then dropped it): the attempt to reduce that shard is moot."""


@dataclass
class _Round:
    """What the reduce step of one round needs to know."""

    round: int
    participants: list[int]
    bounds: list[tuple[int, int]]
    lhash: str
    total: int
    mine: dict[int, torch.Tensor]  # this replica's wire tensors, by shard
    packing: Packing
    #: the participants' contribution objects (names in rounds/<r>/contrib/), by rank
    names: dict[int, str]
    #: contributions fetched while the quorum was being decided, by (rank, shard)
    early: dict[tuple[int, int], Future] = field(default_factory=dict)
    #: the groups and leaders of a two-level round (None: one level)
    plan: GroupPlan | None = None


@dataclass
class _Contribution:
    """This replica's side of one round, as step 1 cuts and uploads it: its tensors (the
    average goes back into them), where their shards lie, and what it published. The steps
    after the quorum read it."""

    round: int
    tensors: list[torch.Tensor]
    source: _Segments  # the tensors read as one vector
    exact: bool  # the float32 wire over fp32 tensors: a shard is the tensors' own slices
    layout: list[list[Any]]  # per tensor [shape, dtype]
    lhash: str
    packing: Packing  # the shards' bounds and pieces, and their frames in a contribution
    #: this replica's wire payload by shard: a wire tensor, or fp32 slices (exact wire)
    wire: dict[int, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    facts: str = ""  # the digest of the manifest's facts, in the object's name
    name: str = ""  # the contribution object's name in rounds/<r>/contrib/

    def job(
        self,
        participants: list[int],
        names: dict[int, str] | None = None,
        early: dict[tuple[int, int], Future] | None = None,
    ) -> _Round:
        """What the reduce step needs, for a quorum of ``participants`` whose contribution
        objects are ``names`` (by rank), with the parts downloaded ``early``."""
        return _Round(
            self.round,
            participants,
            self.packing.bounds,
            self.lhash,
            self.source.numel,
            self.wire,
            self.packing,
            {} if names is None else names,
            {} if early is None else early,
        )


class _Backoff:
    """The pause between two polls of the store: 5 ms, growing 1.6x to ``cap`` while nothing
    arrives, back to 5 ms once something did (the rest of a round usually follows)."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.delay = 0.005

    def after(self, progressed: bool) -> None:
        """Called after a pass: sleep unless it brought something."""
        if progressed:
            self.delay = 0.005
        else:
            time.sleep(self.delay)
            self.delay = min(self.delay * 1.6, self.cap)


@dataclass
class _Sum:
    """A group's sum of one slice (two levels): fp32 values, not divided, and the ranks
    whose parts it holds."""

    values: torch.Tensor
    used: list[int]


@dataclass
class _Part:
    """A participant's wire tensor for one shard, or why it cannot be averaged (reported
    when the reduce step uses it: an early download that ends up unused reports nothing)."""

    tensor: torch.Tensor | None
    problem: layout.Rejection | None = None


@dataclass
class _Early:
    """A round's reduce step started during its quorum wait (see ``_fetch_early``)."""

    job: _Round
    manifest: dict[str, Any]
    res: AllReduceResult
    fetches: dict[tuple[int, int], Future] = field(default_factory=dict)


class _Segments:
    """1-D tensors read as one concatenated vector, without concatenating them."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.starts = []
        pos = 0
        for p in parts:
            self.starts.append(pos)
            pos += p.numel()
        self.numel = pos

    def pieces(self, a: int, b: int) -> list[torch.Tensor]:
        """Views of the parts that cover [a, b), in order."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while a < b and i < len(self.parts):
            start, part = self.starts[i], self.parts[i]
            lo, hi = a - start, min(b, start + part.numel()) - start
            if hi > lo:
                out.append(part[lo:hi])
                a = start + hi
            i += 1
        return out


def _gather_fp32(pieces: list[torch.Tensor]) -> torch.Tensor:
    """One fp32 vector of ``pieces`` in host memory, where the codecs and the error-feedback
    residual work: the piece itself when it is a single fp32 slice on the CPU."""
    if len(pieces) == 1:
        return pieces[0].float().cpu()  # no copy for fp32 on the CPU
    if not pieces:
        return torch.zeros(0)
    return torch.cat([p.float() for p in pieces]).cpu()


#: how a rejection message says why a part was left out for its values
_NONFINITE = "holds NaN/Inf values: never averaged"


def _reason(e: CorruptObjectError, key: str) -> str:
    """Why an object failed its check, without the ``"<key>: "`` its message starts with (a
    rejection carries the key apart)."""
    return str(e).removeprefix(f"{key}: ")


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


class RoundFailed(AllReduceError):
    """A participant declared this round failed (e.g. a corrupt reduced shard): nobody can
    finish it consistently. ``rejection`` names the bad object (``failed.json`` when the
    failure is about no one object), as every replica reports it."""

    def __init__(self, message: str, rejection: layout.Rejection) -> None:
        super().__init__(message)
        self.rejection = rejection


@dataclass
class AllReduceResult:
    """What happened in one round, for metrics and the manager's should_commit()."""

    round: int
    participants: list[int]
    in_quorum: bool
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    shards_computed: list[int] = field(default_factory=list)
    #: parts left out or refused; the metrics write ``str(x)`` ("key: reason") for each
    rejected: list[layout.Rejection] = field(default_factory=list)
    #: set when this replica's weights are based on an older global round than the others':
    #: the newest base among the arrivals, which this replica must heal to
    stale_behind: int | None = None
    #: left out of the quorum (late) but with the participants' base: this replica took the
    #: round's published average instead of its own pseudo-gradient, so its outer step gives
    #: the same weights as everyone's without loading a global checkpoint
    caught_up: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["rejected"] = [x.to_dict() for x in self.rejected]
        return out


def layout_of(tensors: Sequence[torch.Tensor]) -> list[list[Any]]:
    """Per-tensor [shape, dtype]: replicas must agree on it exactly."""
    return [[list(t.shape), dtype_name(t.dtype)] for t in tensors]


def _layout_hash(layout: list[list[Any]]) -> str:
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def tensors_layout_hash(tensors: Sequence[torch.Tensor]) -> str:
    """The digest of the tensors' shapes and dtypes that an exchange checks (the model's,
    for the checkpoints that carry it)."""
    return _layout_hash(layout_of(tensors))


def _size_hint(bounds: tuple[int, int]) -> int:
    """An upper bound of a shard object's size (fp32 values + header): lets an S3 store
    read it with one GET (:meth:`RunStore.get`)."""
    a, b = bounds
    return (b - a) * 4 + (64 << 10)


def shard_bounds(total: int, num_shards: int) -> list[tuple[int, int]]:
    """Split [0, total) into num_shards contiguous near-equal ranges (first ones larger)."""
    base, extra = divmod(total, num_shards)
    bounds, start = [], 0
    for s in range(num_shards):
        size = base + (1 if s < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


class ObjectStoreAllReduce:
    """Average lists of tensors in place across ``world_size`` replicas through a run store.

    ``store`` is a :class:`~crf.store.RunStore` or a URI of the run folder. Rounds are numbered
    by the caller (``round=``) or count up from 0. ``world_size == 1`` never touches the store.
    A replica that arrives after its round's quorum closed, with the same ``base_round`` as
    the participants, gets the round's average anyway (``catch_up``, on by default; the result
    says ``caught_up``) while the others have not moved on to a later round.
    """

    def __init__(
        self,
        store: RunStore | str,
        world_size: int,
        rank: int,
        config: ExchangeConfig | None = None,
        hooks: ExchangeHooks | None = None,
        **options: Any,
    ) -> None:
        """``config`` (or, for tests and benchmarks, its fields as keywords in ``options``)
        fixes how this exchange behaves; ``hooks`` are how it reports back. Neither changes
        after construction."""
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size ({world_size}), got rank={rank}")
        if config is not None and options:
            raise TypeError("pass either config= or its fields as keywords, not both")
        self.store = RunStore(store) if isinstance(store, str) else store
        self.world_size = world_size
        self.rank = rank
        default_id = self.store.uri.rstrip("/").rsplit("/", 1)[-1]
        self.config = (config or ExchangeConfig(**options)).resolve(
            world_size, self.store.scheme, default_id
        )
        self.hooks = hooks or ExchangeHooks()
        self._wire = self.config.wire
        wirefmt.get_codec(self._wire)  # a bad variant (topk4@x) fails here, not mid-round
        self._decay = self.config.error_decay
        self._sparse = self.config.sparse
        self._two_level = self.config.reduce_group_size > 0
        # what quantization dropped last time, per fragment (Streaming DiLoCo syncs fragments
        # of different - or, for identical blocks, equal - sizes in turn)
        self._residual: dict[int | None, torch.Tensor] = {}
        self.next_round = 0
        #: contributions listed in a round (complete: each is one atomic PUT), by rank
        self._present: dict[int, dict[int, Arrival]] = {}
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._control_executor: ThreadPoolExecutor | None = None
        self._early: _Early | None = None
        self.alive_window_s = min(_ALIVE_MAX_S, _ALIVE_SHARE * self.config.round_timeout_s)
        #: who arrived for a decided round (participants and stale), by round: the members
        #: the next round waits for (None: the decision is not in the store)
        self._members: dict[int, frozenset[int] | None] = {}
        self._count_lock = threading.Lock()
        self.history: list[AllReduceResult] = []
        #: per layout hash, the lengths of the tensors' pieces in each shard (int8 blocks
        #: restart at each: :func:`crf.exchange.codecs.int8.int8_blocks`)
        self._segments: dict[str, list[list[int]]] = {}

    @property
    def wire(self) -> str:
        """The wire format of this exchange's payloads, by its name in the store (a sparse
        wire's carries its density: ``topk4@0.02``)."""
        return self._wire

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """What the wire dropped and is still to be resent, per fragment (key: the fragment,
        ``"-"`` without fragments): saved with the replica's inner state, so a restart or a
        resumed run goes on resending it (:meth:`load_error_feedback_state`)."""
        return {"-" if f is None else str(f): t for f, t in self._residual.items()}

    def load_error_feedback_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`error_feedback_state` returned (replacing this exchange's)."""
        self._residual = {
            None if k == "-" else int(k): t.detach().to(torch.float32).reshape(-1).clone()
            for k, t in state.items()
        }

    # ------------------------------------------------------------------ helpers
    def _phase(self, phase: str) -> None:
        if self.hooks.on_phase is not None:
            self.hooks.on_phase(phase)

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """An fp32 work buffer of ``numel`` values, kept for the next round of that size."""
        buf = self._buffers.get((name, numel))
        if buf is None:
            buf = self._buffers[(name, numel)] = torch.empty(numel, dtype=torch.float32)
        return buf

    def _put(self, res: AllReduceResult, key: str, data: Any, *, exclusive: bool = False) -> bool:
        """Publish bytes or a list of buffers (``encode_tensor_parts``), counting them."""
        n = sum(memoryview(d).nbytes for d in data) if isinstance(data, list) else len(data)
        with self._count_lock:
            res.bytes_up += n
        # a round's objects are transient and checksummed end to end: no fsync (file://).
        # A crash loses the round anyway; resumption reads global/ and inner/, kept durable.
        if exclusive:
            return self.store.put_if_absent(key, data, durable=False)
        self.store.put(key, data, durable=False)
        return True

    def _shard_segments(
        self, lhash: str, sizes: list[int], bounds: list[tuple[int, int]]
    ) -> list[list[int]]:
        """The tensors' pieces in each shard (kept by layout hash: the reduce and gather
        steps of a round, which know only the hash, cut int8 blocks along them too)."""
        segs = self._segments.get(lhash)
        if segs is None:
            if len(self._segments) >= 16:  # fragments of one model: a handful of layouts
                self._segments.clear()
            segs = self._segments[lhash] = wirefmt.shard_segments(sizes, bounds)
        return segs

    def _get(self, res: AllReduceResult, key: str, size_hint: int | None = None) -> bytes:
        data = self.store.get(key, size_hint=size_hint)
        with self._count_lock:
            res.bytes_down += len(data)
        return data

    def _get_range(self, res: AllReduceResult, key: str, start: int, end: int) -> bytes:
        data = self.store.get_range(key, start, end)
        with self._count_lock:
            res.bytes_down += len(data)
        return data

    def _get_if_there(
        self, res: AllReduceResult, key: str, size_hint: int | None = None
    ) -> bytes | None:
        try:
            return self._get(res, key, size_hint)
        except ObjectNotFound:
            return None

    def _control(self) -> ThreadPoolExecutor:
        """Threads for small control requests (the quorum, manifests, listings) that run
        next to each other: kept apart from the transfer threads so that a poll never
        queues behind a download."""
        if self._control_executor is None:
            self._control_executor = ThreadPoolExecutor(4, thread_name_prefix="crf-control")
        return self._control_executor

    def _pool(self) -> ThreadPoolExecutor:
        """Threads for a round's independent transfers (shard parts, reduced shards)."""
        if self._executor is None:
            # two levels: a member reads G - 1 parts, a leader M partials, whatever G is
            shards = self.world_size if self.config.reduce_group_size else self.config.num_shards
            workers = max(1, min(self.config.max_transfers, shards))
            self._executor = ThreadPoolExecutor(workers, thread_name_prefix="crf-transfer")
        return self._executor

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        round: int | None = None,
        base_round: int | None = None,
        fragment: int | None = None,
    ) -> AllReduceResult:
        """Average ``tensors`` across the quorum of this round, in place.

        Returns the round's result; if this replica is not in the quorum the tensors are left
        untouched and ``result.in_quorum`` is False. ``base_round`` (DiLoCo: the global round
        these weights start from) keeps a replica that missed a commit out of the quorum.
        ``fragment`` (Streaming DiLoCo: which part of the model this round carries) is
        recorded in the manifest, checked against the others', and keys error feedback.
        Raises :class:`AllReduceError` subclasses when the round cannot complete.
        """
        r = self.next_round if round is None else _check_int("round", round, 0)
        self.next_round = r + 1
        t0 = time.monotonic()
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            if not t.is_floating_point():
                raise TypeError(f"tensor {i} has dtype {t.dtype}: only floating tensors average")
        res = AllReduceResult(round=r, participants=[self.rank], in_quorum=True)
        if self.world_size > 1:
            self._run_round(res, tensors, base_round, fragment)
        res.seconds = time.monotonic() - t0
        self.history.append(res)
        return res

    def _run_round(
        self,
        res: AllReduceResult,
        tensors: list[torch.Tensor],
        base_round: int | None,
        fragment: int | None,
    ) -> None:
        """The four steps of round ``res.round`` (the module docstring), recorded in ``res``."""
        r = res.round
        mine = self._cut_into_shards(r, tensors)
        self._upload_contribution(res, mine, base_round, fragment)
        decided, early = self._join_quorum(
            res, mine.job(list(range(self.world_size))), mine.manifest
        )
        if self.rank not in res.participants:
            res.in_quorum = False
            if res.participants and self.config.catch_up:
                res.caught_up = self._catch_up(
                    res, r, mine.packing.bounds, mine.lhash, tensors, mine.exact
                )
            return
        job = mine.job(
            res.participants,
            {int(p): c["name"] for p, c in decided["contributions"].items()},
            early,
        )
        self._check_layouts(res, r, res.participants, mine.manifest, mine.facts, decided)
        self._publish_held_back(res, job)
        maybe_fault("after_quorum", self.rank, r, self.store)
        if self.config.reduce_group_size:
            job.plan = GroupPlan(tuple(res.participants), self.config.reduce_group_size, r)
        if job.plan is not None and job.plan.two_levels:
            reduced_here = self._reduce_two_levels(res, job, job.plan)
        else:  # one level, or two levels whose participants fit one group (G >= N)
            reduced_here = self._reduce_my_shards(res, job)
        maybe_fault("after_reduce", self.rank, r, self.store)
        got = self._gather(res, job, reduced_here)
        self._finish_round(mine, got, reduced_here)

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
        for f in encoding:
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

    # ------------------------------------------------------------------ two levels
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
            arrived = self._fetch_there(res, layout.partial_dir(r, i), keys)
            for g, data in arrived.items():
                found[g] = self._decode_partial(job, plan, g, i, keys[g][0], data)
                missing.remove(g)
            if not missing or time.monotonic() >= deadline:
                break
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

    # ------------------------------------------------------------------ result
    def _join_quorum(
        self, res: AllReduceResult, job: _Round, manifest: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[tuple[int, int], Future]]:
        """Step 2, the quorum: the round's decision (``res.participants`` set from it; empty
        when this replica is stale) and the early downloads still of use. While it is being
        decided, the contributions to the shards this replica owns in a full quorum are
        already downloaded, as each peer's object appears: the reduce step then starts with
        them at hand."""
        r = job.round
        self._phase("quorum")
        self._early = _Early(job, manifest, res)  # names: the listing's, as it grows
        decided: dict[str, Any] = {}
        try:
            decided = self._decide_quorum(res, r)
            participants = sorted(int(p) for p in decided["participants"])
            self._remember_members(r, decided)
        except _Stale as e:
            participants, res.stale_behind = [], e.top
        finally:
            early, self._early = self._early.fetches, None
        res.participants = participants
        if participants != list(range(self.world_size)) or self.rank not in participants:
            # another quorum moves ownership (or this replica reduces nothing): drop them
            for f in early.values():
                f.cancel()
            early = {}
        return decided, early

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
            if time.monotonic() >= grace_deadline:
                # owners are late or dead: compute their shards ourselves
                for s in list(pending):
                    log.warning("round %d: shard %d owner is late; computing it", r, s)
                    if job.plan is not None and job.plan.two_levels:
                        self._reduce_slice(res, job, job.plan, s)
                    else:
                        self._reduce_shard(res, job, s)
                grace_deadline = time.monotonic() + self.config.shard_grace_s
            else:
                backoff.after(progressed)
        return got

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
            got[s] = self._decode_reduced(r, s, keys[s][0], data, lhash, b - a)
            pending.remove(s)
        return bool(arrived)

    def _fetch_there(
        self, res: AllReduceResult, folder: str, keys: dict[int, tuple[str, int]]
    ) -> dict[int, bytes]:
        """One pass over numbered objects not seen yet (``keys``: number -> key and size
        hint, all in ``folder``): those that are there, downloaded in parallel, in the
        order of ``keys``. With many missing, one listing of ``folder`` says which are there
        (:data:`_LIST_ABOVE`) instead of a GET each."""
        wanted = list(keys)
        if len(wanted) > _LIST_ABOVE:
            there = set(self.store.list(folder))
            wanted = [k for k in wanted if str(k) in there]
        fetches = [(k, self._pool().submit(self._get_if_there, res, *keys[k])) for k in wanted]
        return {k: data for k, f in fetches if (data := f.result()) is not None}

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

    # ------------------------------------------------------------------ steps
    def _drop_contributions(self, r: int, name: str) -> None:
        """Delete this replica's contribution to round r (and any shard it published after a
        degraded quorum). Every reduced shard exists by now, so no reducer needs them: an
        owner's late first attempt finds them gone and defers to the published average
        (:class:`_AlreadyReduced`), and the quorum is decided, so nobody reads the
        manifest."""
        for key in (contrib_key(r, name), layout.held_dir(r, self.rank)):
            try:
                self.store.delete(key)
            except (StoreError, OSError) as e:  # only disk space is at stake; the GC retries
                log.debug("round %d: could not drop %s: %s", r, key, e)

    def _meta(self, r: int, s: int, lhash: str, total: int) -> dict[str, Any]:
        return {
            "run_id": self.config.run_id,
            "round": r,
            "rank": self.rank,
            "shard": s,
            "layout_hash": lhash,
            "numel_total": total,
            "wire": self.wire,
        }

    def _list_present(self, r: int) -> dict[int, Arrival]:
        """Contributions to round r in the store (complete: each is one atomic PUT), by rank,
        with what their names tell (base round, facts digest). Once all are there the folder
        is not listed again."""
        present = self._present.setdefault(r, {})
        if len(present) < self.world_size:
            for name in self.store.list(layout.contrib_dir(r)):
                arrival = parse_contrib_name(name)
                if arrival is not None and arrival.rank < self.world_size:
                    present.setdefault(arrival.rank, arrival)
        return dict(sorted(present.items()))

    def _remember_members(self, r: int, decided: dict[str, Any]) -> None:
        """Keep who arrived for decided round r (participants and stale ones): the members
        round r + 1 waits for without asking for heartbeats."""
        try:
            members = frozenset(int(p) for p in decided.get("participants", [])) | frozenset(
                int(p) for p in decided.get("stale", [])
            )
        except (TypeError, ValueError):
            members = None
        self._members = {k: v for k, v in self._members.items() if k >= r - 1}
        self._members[r] = members

    def _members_before(self, res: AllReduceResult, r: int) -> frozenset[int] | None:
        """Who arrived for round r - 1 (its decision: this replica's memory, else one read);
        None when unknown (round 0, or a decision garbage-collected or never made): then
        round r waits for everyone, as it would without ``follow_liveness``."""
        if r == 0:
            return None
        if r - 1 not in self._members:
            data = self._get_if_there(res, layout.quorum_key(r - 1), 0)
            decided: Any = None
            if data is not None:
                try:
                    decided = json.loads(data)
                except ValueError:
                    decided = None
            if isinstance(decided, dict) and decided.get("run_id") in (None, self.config.run_id):
                self._remember_members(r - 1, decided)
            else:
                self._members[r - 1] = None
        return self._members.get(r - 1)

    def _shows_life(self, k: int, r: int) -> bool:
        """Whether replica k, which was no member of round r - 1, is to be waited for in
        round r: its heartbeat is younger than ``alive_window_s`` and says it is at round
        r - 1 or later (a restart that resumed, a straggler one round behind that will catch
        up, a replica that healed). A dead replica's heartbeat stops; one far behind says an
        older round; one that ended says so in its phase. An unreadable store answers yes:
        waiting is what a round did before liveness was followed."""
        try:
            beat = json.loads(self.store.get(layout.heartbeat_key(k)))
        except ObjectNotFound:
            return False
        except (ValueError, CorruptObjectError):
            return False
        except (StoreError, OSError) as e:
            log.debug("round %d: cannot read replica %d's heartbeat (%s): waiting for it", r, k, e)
            return True
        if not isinstance(beat, dict) or "exchange_round" not in beat:
            return False
        record = layout.Heartbeat.from_dict(beat)
        if record.phase in ("done", "failed"):
            return False
        at, updated = record.exchange_round, record.updated_at
        if isinstance(at, bool) or not isinstance(at, int):
            return False
        if isinstance(updated, bool) or not isinstance(updated, int | float):
            return False
        return at >= r - 1 and time.time() - updated <= self.alive_window_s

    @staticmethod
    def _eligible(arrived: dict[int, Arrival]) -> tuple[list[int], list[int]]:
        """Split arrivals into (eligible, stale): a replica whose weights are based on an
        older global round than the others missed a commit and must heal, not contribute."""
        bases = {k: a.base_round for k, a in arrived.items()}
        known = [b for b in bases.values() if b is not None]
        if not known:
            return sorted(arrived), []
        top = max(known)
        eligible = sorted(k for k, b in bases.items() if b is None or b == top)
        return eligible, sorted(set(arrived) - set(eligible))

    def _decide_quorum(self, res: AllReduceResult, r: int) -> dict[str, Any]:
        """Read or create rounds/<r>/quorum.json; exactly one decision per round, returned
        (the rules are :mod:`crf.exchange.quorum`'s). Raises _Stale as soon as this replica
        sees it is behind the others (it must heal)."""
        key = layout.quorum_key(r)

        def write(body: dict[str, Any]) -> dict[str, Any]:
            if self._put(res, key, jsonsafe.dumps(body).encode(), exclusive=True):
                return body
            # someone else decided first: theirs is the decision
            return self._read_decision(r, key, self._get(res, key, 0))

        def fetch_early(peers: dict[int, Arrival]) -> None:
            # two levels: a member's parts depend on the groups, known once decided
            if self._early is not None and self.config.fetch_early and not self._two_level:
                self._fetch_early(peers)

        port = QuorumPort(
            rank=self.rank,
            world_size=self.world_size,
            min_replicas=self.config.min_replicas,
            follow_liveness=self.config.follow_liveness,
            control=self._control,
            list_arrivals=lambda: self._list_present(r),
            eligible=self._eligible,
            read_if_there=lambda: self._get_if_there(res, key, 0),
            read_decision=lambda data: self._read_decision(r, key, data),
            write_decision=write,
            members_before=lambda: self._members_before(res, r),
            shows_life=lambda k: self._shows_life(k, r),
            lag_behind=lambda: self._lag_behind(r),
            fetch_early=fetch_early,
            facts=lambda: {k: self._early.manifest.get(k) for k in FACTS} if self._early else None,
            on_wait=self.hooks.on_wait,
            run_id=self.config.run_id,
        )
        deadline = time.monotonic() + self.config.round_timeout_s
        decision = QuorumDecision(port, r, self._present[r][self.rank], deadline)
        # keep polling a little past the deadline so a decision by a peer is seen
        if not wait_until(
            decision.poll,
            self.config.round_timeout_s + 1.0,
            poll_s=0.005,
            max_poll_s=self.config.max_poll_s,
        ):
            raise QuorumTimeout(
                f"round {r}: only {len(self._list_present(r))} of {self.world_size} replicas "
                f"arrived within {self.config.round_timeout_s:.0f}s (need "
                f"min_replicas={self.config.min_replicas})"
            )
        decided = decision.decided
        assert decided is not None
        if self.rank in decided.get("stale", []) and decided.get("base_round") is not None:
            raise _Stale(int(decided["base_round"]))
        return decided

    def _read_decision(self, r: int, key: str, data: bytes) -> dict[str, Any]:
        """Round r's quorum.json, checked for where it came from: this run, round r, and
        participants that are ranks of this run, each with its own contribution (whose name
        carries the rank, and the digest of run, layout, wire and shards that
        ``_check_layouts`` compares). A decision copied from another run or round, or
        unreadable, is never followed: it holds the round's one create-if-absent key, so no
        good decision can replace it, and the round fails for everyone alike
        (``failed.json``, as for a bad reduced shard), reported as rejected."""
        problems = []
        try:
            decided = json.loads(data)
        except ValueError as e:
            decided, problems = {}, [f"unreadable ({e})"]
        if not isinstance(decided, dict):
            decided, problems = {}, ["not a json object"]
        if not problems:
            if decided.get("run_id") != self.config.run_id:
                problems.append(f"run {decided.get('run_id')!r}, not {self.config.run_id!r}")
            if decided.get("round") != r:
                problems.append(f"round {decided.get('round')!r}, not {r}")
            parts = decided.get("participants")
            contributions = decided.get("contributions")
            if not isinstance(parts, list) or not isinstance(contributions, dict):
                problems.append("no participants or contributions")
            else:
                for p in parts:
                    c = contributions.get(str(p))
                    name = c.get("name") if isinstance(c, dict) else None
                    arrival = parse_contrib_name(name) if isinstance(name, str) else None
                    if not (isinstance(p, int) and 0 <= p < self.world_size) or (
                        arrival is None or arrival.rank != p
                    ):
                        problems.append(f"participant {p!r} is not a rank with a contribution")
                        break
        if problems:
            msg = f"{key}: not this run's decision of round {r} ({'; '.join(problems)})"
            log.warning("rejected %s", msg)
            raise self._fail_round(r, f"bad quorum: {msg}", key, msg)
        return decided

    def _lag_behind(self, r: int) -> int | None:
        """The global round this replica must heal to if the others are past round r."""
        newest = self._newest_global()
        if newest is not None and newest >= r:
            # round r was committed already and its folder garbage-collected: this replica
            # lags the others by more than keep_rounds (a straggler). A quorum decided now
            # would fork the weights; catch up instead.
            return newest
        if self.config.checkpoint_every > 1:
            # global/ is written only every few rounds: a later decided round shows just as
            # well that this replica lags the others
            return self._later_decided_round(r)
        return None

    def _fetch_early(self, peers: dict[int, Arrival]) -> None:
        """Start downloading the parts of the shards this replica owns in a full quorum from
        every peer whose contribution is here and matches this replica's (same base round
        and facts digest): with everyone in the quorum they are exactly what the reduce step
        reads, and until then they only cost their download."""
        early = self._early
        assert early is not None
        job = early.job
        for p, arrival in peers.items():
            if p == self.rank:
                continue
            job.names[p] = arrival.name
            for s in range(self.rank, self.config.num_shards, self.world_size):
                if (p, s) not in early.fetches:
                    early.fetches[(p, s)] = self._pool().submit(
                        self._fetch_contrib,
                        early.res,
                        job,
                        p,
                        s,
                        0.0,
                    )

    def _later_decided_round(self, r: int) -> int | None:
        """If a round after r has a quorum (the others moved past r), the round before it:
        the global round this replica must at least heal to. None otherwise."""
        later = sorted(layout.round_numbers(self.store), reverse=True)
        for k in later:
            if k <= r:
                break
            if self.store.object_exists(layout.quorum_key(k)):
                return k - 1
        return None

    def _newest_global(self) -> int | None:
        rounds = layout.global_rounds(self.store)
        return rounds[-1] if rounds else None

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
        wire = wirefmt.encode_reduced(acc, self.wire, self._segments[job.lhash][s], parts)
        key = layout.reduced_key(r, s)
        if self._put(res, key, encode_tensor_parts(wire, meta), exclusive=True):
            res.shards_computed.append(s)
            return wire
        return None

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
        first = next(i for i, t in enumerate(tensors) if not wirefmt.finite(t))
        raise NonFiniteError(
            f"round {r}: this replica's pseudo-gradient holds non-finite values (tensor {first} "
            f"of {len(tensors)}: {describe_nonfinite(tensors[first].detach())}): its weights "
            "went NaN/Inf during the inner steps; nothing was uploaded"
        )

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

    def close(self) -> None:
        """Stop the transfer threads (a later round starts them again)."""
        for executor in (self._executor, self._control_executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._executor = self._control_executor = None

    # ------------------------------------------------------------------ gc
    def collect_garbage(self, current_round: int) -> list[int]:
        """Delete rounds older than ``keep_rounds`` before ``current_round``; returns them."""
        removed = []
        for k in layout.round_numbers(self.store):
            if k <= current_round - self.config.keep_rounds:
                self.store.delete(layout.round_dir(k))
                removed.append(k)
        return sorted(removed)


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
