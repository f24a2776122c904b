"""What one exchange round is made of: its result and errors, the plan of its shards, and
the records its steps hand each other (:mod:`crf.exchange.allreduce` runs the steps)."""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from crf import layout
from crf.exchange.contribution import Packing
from crf.exchange.groups import GroupPlan
from crf.exchange.staging import Staged
from crf.store.codec import dtype_name


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
    #: seconds of this round per phase (:data:`crf.exchange.phases.PHASES`), as the round's
    #: own thread spent them; the rest of ``seconds`` is bookkeeping and polls
    phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["rejected"] = [x.to_dict() for x in self.rejected]
        out["phases"] = dict(self.phases)
        return out


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
    #: the tensors' copy to host memory, when they live on a device (None: on the CPU)
    staged: Staged | None = None

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
