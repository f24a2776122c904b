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

The round works in host memory: tensors on a device are copied into host buffers kept for
their layout (pinned on CUDA), in chunks that step 1 encodes as they arrive, and the average
is copied back once (:mod:`crf.exchange.staging`); tensors on the CPU are used in place.

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

The code follows the round: step 1 is :mod:`crf.exchange.upload`, step 2
:mod:`crf.exchange.membership` (the decision's rules: :mod:`crf.exchange.quorum`), step 3
:mod:`crf.exchange.reduce` (two levels: :mod:`crf.exchange.reduce_two_level`), step 4 and
catch-up :mod:`crf.exchange.gather`; the checks of every object a round reads, and failed
rounds, are :mod:`crf.exchange.checks`, dropping a round's objects :mod:`crf.exchange.garbage`.
What a round is made of (results, errors, the shard plan) is :mod:`crf.exchange.round`, the
store requests and their byte counts :mod:`crf.exchange.transfers`. This module combines the
steps into :class:`ObjectStoreAllReduce` and runs them in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from crf.exchange import codecs as wirefmt
from crf.exchange.checks import Checks
from crf.exchange.config import ExchangeConfig, ExchangeHooks, _check_int
from crf.exchange.contribution import Arrival
from crf.exchange.garbage import GarbageCollection
from crf.exchange.gather import Gather
from crf.exchange.groups import GroupPlan
from crf.exchange.membership import _ALIVE_MAX_S, _ALIVE_SHARE, Membership
from crf.exchange.phases import PhaseClock
from crf.exchange.reduce import OneLevelReduce
from crf.exchange.reduce_two_level import TwoLevelReduce
from crf.exchange.round import (
    AllReduceError,
    AllReduceResult,
    LayoutMismatchError,
    NonFiniteError,
    QuorumTimeout,
    RoundFailed,
    _Early,
    describe_nonfinite,
    layout_of,
    shard_bounds,
    tensors_layout_hash,
)
from crf.exchange.staging import HostStaging, Staged
from crf.exchange.transfers import Transfers
from crf.exchange.upload import Upload
from crf.faults import maybe_fault
from crf.store import RunStore

__all__ = [
    "AllReduceError",
    "AllReduceResult",
    "LayoutMismatchError",
    "NonFiniteError",
    "ObjectStoreAllReduce",
    "QuorumTimeout",
    "RoundFailed",
    "describe_nonfinite",
    "layout_of",
    "shard_bounds",
    "tensors_layout_hash",
]


class ObjectStoreAllReduce(
    Upload, Membership, OneLevelReduce, TwoLevelReduce, Gather, Checks, GarbageCollection, Transfers
):
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
        #: rounds whose members were read from the store, not seen by this process
        self._members_read: set[int] = set()
        #: when this exchange started (a member last heard from before it, known only from
        #: the store, may be starting too: Membership._gone_quiet)
        self.started_at = time.time()
        self._count_lock = threading.Lock()
        self.history: list[AllReduceResult] = []
        #: per layout hash, the lengths of the tensors' pieces in each shard (int8 blocks
        #: restart at each: :func:`crf.exchange.codecs.int8.int8_blocks`)
        self._segments: dict[str, list[list[int]]] = {}
        self._staging = HostStaging()
        self._clock: PhaseClock | None = None

    def reserve(self, tensors: list[torch.Tensor]) -> int:
        """Allocate the host buffers a round of tensors like these (the same shapes, dtypes
        and devices) copies through, before the first round; returns the bytes allocated
        (none for CPU tensors: a round uses them in place)."""
        return self._staging.reserve(tensors) if self.world_size > 1 else 0

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
            self._clock = PhaseClock(res.phases)
            staged: Staged | None = None
            try:
                with self._timed("d2h"):
                    staged = self._staging.stage(tensors)
                self._run_round(res, staged, base_round, fragment)
                if res.in_quorum or res.caught_up:
                    with self._timed("h2d"):
                        staged.copy_back()
            finally:
                if staged is not None:
                    staged.finish()  # the next round reuses the buffers
                self._clock.close()
                self._clock = None
        res.seconds = time.monotonic() - t0
        self.history.append(res)
        return res

    def _run_round(
        self,
        res: AllReduceResult,
        staged: Staged,
        base_round: int | None,
        fragment: int | None,
    ) -> None:
        """The four steps of round ``res.round`` (the module docstring), recorded in ``res``,
        on the tensors' host copy (``staged.host``: the tensors themselves on the CPU)."""
        r, tensors = res.round, staged.host
        with self._timed("encode"):
            mine = self._cut_into_shards(r, tensors)
            mine.staged = staged if staged.on_device else None
            self._upload_contribution(res, mine, base_round, fragment)
        with self._timed("wait"):
            decided, early = self._join_quorum(
                res, mine.job(list(range(self.world_size))), mine.manifest
            )
        if self.rank not in res.participants:
            res.in_quorum = False
            if res.participants and self.config.catch_up:
                with self._timed("download"):
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
        self._publish_held_back(res, job)  # an upload (timed there)
        maybe_fault("after_quorum", self.rank, r, self.store)
        if self.config.reduce_group_size:
            job.plan = GroupPlan(tuple(res.participants), self.config.reduce_group_size, r)
        with self._timed("decode"):  # adding parts up; their downloads are timed there
            if job.plan is not None and job.plan.two_levels:
                reduced_here = self._reduce_two_levels(res, job, job.plan)
            else:  # one level, or two levels whose participants fit one group (G >= N)
                reduced_here = self._reduce_my_shards(res, job)
        maybe_fault("after_reduce", self.rank, r, self.store)
        with self._timed("download"):
            got = self._gather(res, job, reduced_here)
        with self._timed("decode"):
            self._finish_round(mine, got, reduced_here)

    def close(self) -> None:
        """Stop the transfer threads (a later round starts them again)."""
        for executor in (self._executor, self._control_executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._executor = self._control_executor = None
