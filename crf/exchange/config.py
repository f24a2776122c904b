"""The exchange's settings, fixed when it is built: an immutable config and the hooks through
which it reports back.

Everything an :class:`~crf.exchange.allreduce.ObjectStoreAllReduce` needs to know is decided
before its first round and never patched afterwards: the manager builds its exchange with its
own hooks (``on_wait`` serves heal requests while a replica waits, ``on_phase`` shows what the
background transfer is doing) rather than setting attributes on one built elsewhere. A run's
values come from its spec (:meth:`ExchangeConfig.from_spec`); tests and benchmarks pass them
as keywords.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crf.exchange.codecs import codec_names

#: the two ways a sparse wire's error feedback and outer step fit together (``sparse_outer``):
#: "sparseloco" (arXiv 2508.15706: the error buffer decays by ``SPARSELOCO_BETA`` and stands
#: in for the outer momentum; the outer step is plain SGD on the average) or "diloco" (the
#: whole residual is kept, beta = 1, and the outer step is DiLoCo's Nesterov SGD)
SPARSE_OUTERS = ("sparseloco", "diloco")
#: the default of ``sparse_outer``: the one constant to change when bench/quality.py's sparse
#: rows say the other form wins (docs/design.md, "Sparse wires")
DEFAULT_SPARSE_OUTER = "sparseloco"
#: SparseLoCo's error-feedback decay (the paper's beta)
SPARSELOCO_BETA = 0.95
#: the default share of values a sparse wire keeps per chunk
DEFAULT_SPARSE_DENSITY = 0.02


def two_level_sparse_error(wire: str) -> str:
    """Why a sparse wire and two levels do not go together, and what to change."""
    return (
        f"--reduce-group-size does not work with the sparse wire {wire}: a group's sum of "
        "top-k parts is dense and would cost more than the sparse wire saves; use "
        "--reduce-group-size 0 or a dense --wire-dtype (float32, bfloat16, float16, int8)"
    )


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ExchangeConfig:
    """How one replica's exchange behaves; the same on every replica of a run except where a
    field says otherwise. ``None`` means "choose from the world size or the store" (see
    :meth:`resolve`)."""

    #: the run these objects belong to (checked on everything read); default: the folder name
    run_id: str | None = None
    #: a round may close at its deadline with at least this many (default: all of them)
    min_replicas: int | None = None
    #: how long a replica waits for the others in one round
    round_timeout_s: float = 300.0
    #: how long past the quorum a replica waits for a shard's owner before reducing it itself
    shard_grace_s: float = 30.0
    #: shards the pseudo-gradient is cut into (default: one per replica; G with two levels)
    num_shards: int | None = None
    #: two-level reduction (docs/performance.md, "Two-level reduction"): the participants
    #: are cut into groups of this many consecutive ranks and the vector into this many
    #: slices; each group sums its slices, one leader per slice adds the groups' sums.
    #: 0: one level (every replica owns a shard of all N contributions)
    reduce_group_size: int = 0
    #: rounds kept in the store; older ones are garbage-collected
    keep_rounds: int = 3
    #: a registered wire codec: float32 | bfloat16 | float16 | int8 (block-wise scales) |
    #: topk2 | topk4 | topk8 (sparse: sparse_density of each chunk, error feedback always on)
    wire_dtype: str = "float32"
    #: with a lossy wire, resend what quantization dropped last time (always on with a
    #: sparse wire)
    error_feedback: bool = False
    #: a sparse wire (topk2/4/8) keeps this share of the values of every chunk
    sparse_density: float = DEFAULT_SPARSE_DENSITY
    #: a sparse wire's error feedback: "sparseloco" decays the residual by SPARSELOCO_BETA
    #: (the outer step then has no momentum), "diloco" keeps all of it
    sparse_outer: str = DEFAULT_SPARSE_OUTER
    #: the longest pause between two looks at the store (default: 0.05 s on a local folder,
    #: 0.5 s on an object store, where every call is billed and rate-limited)
    max_poll_s: float | None = None
    #: transfers in flight at once
    max_transfers: int = 8
    #: delete this replica's contribution once it has every reduced shard (default: on a
    #: local folder, which spares the disk the write-back; elsewhere the GC does it)
    drop_contributions: bool | None = None
    #: a replica late for the quorum, with the participants' base round, takes the published
    #: average (P down) rather than healing from a global state (about 3 P)
    catch_up: bool = True
    #: global/<r> is written every this many rounds (and on demand): with more than one, a
    #: replica cannot rely on global/ to tell it is behind, so it looks at rounds/ too
    checkpoint_every: int = 1
    #: exchange rounds per outer round (Streaming DiLoCo syncs one fragment per exchange
    #: round): ``checkpoint_every`` counts outer rounds, so a checkpoint is taken after the
    #: last fragment's sync
    fragments: int = 1
    #: owners download their shard's parts while the quorum is open (default: on object
    #: stores, where that takes requests off the critical path; a local folder's reads are
    #: cheap and would only compete with the peers' writes)
    fetch_early: bool | None = None
    #: a round waits for the previous round's members and for replicas whose heartbeat shows
    #: them alive, not for one that died (needs heartbeats: ReplicaContext writes them)
    follow_liveness: bool = False

    def __post_init__(self) -> None:
        if self.min_replicas is not None:
            _check_int("min_replicas", self.min_replicas, 1)
        if self.num_shards is not None:
            _check_int("num_shards", self.num_shards, 1)
        _check_int("reduce_group_size", self.reduce_group_size, 0)
        _check_int("keep_rounds", self.keep_rounds, 1)
        _check_int("checkpoint_every", self.checkpoint_every, 1)
        _check_int("fragments", self.fragments, 1)
        _check_int("max_transfers", self.max_transfers, 1)
        if self.wire_dtype not in codec_names():  # looked up now: a codec registered late counts
            raise ValueError(f"wire_dtype must be one of {codec_names()}, got {self.wire_dtype!r}")
        if not (isinstance(self.sparse_density, float | int) and 0 < self.sparse_density <= 1):
            raise ValueError(f"sparse_density must be in (0, 1], got {self.sparse_density!r}")
        if self.sparse_outer not in SPARSE_OUTERS:
            raise ValueError(
                f"sparse_outer must be one of {SPARSE_OUTERS}, got {self.sparse_outer!r}"
            )
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")
        if self.reduce_group_size:
            if self.num_shards is not None and self.num_shards != self.reduce_group_size:
                raise ValueError(
                    f"num_shards ({self.num_shards}) is the group size with reduce_group_size "
                    f"({self.reduce_group_size}): leave num_shards out"
                )
            if self.sparse:
                raise ValueError(two_level_sparse_error(self.wire_dtype))

    @classmethod
    def from_spec(cls, spec: Any, **overrides: Any) -> ExchangeConfig:
        """The exchange settings of a run: the spec's fields of the same name, plus
        ``overrides`` (what the replica decides for itself, e.g. ``follow_liveness``).
        ``spec`` is a :class:`crf.spec.RunSpec`, read by field name only: the spec imports
        this module's defaults, so this module does not import it back."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {n: getattr(spec, n) for n in names if hasattr(spec, n)}
        return cls(**{**values, **overrides})

    @property
    def checkpoint_period(self) -> int:
        """Exchange rounds from one periodic checkpoint to the next."""
        return self.checkpoint_every * self.fragments

    def resolve(self, world_size: int, scheme: str, default_run_id: str) -> ExchangeConfig:
        """This config with every ``None`` chosen for ``world_size`` replicas on a store of
        ``scheme``; raises ValueError where the two do not fit."""
        min_replicas = world_size if self.min_replicas is None else self.min_replicas
        if min_replicas > world_size:
            raise ValueError(f"min_replicas ({min_replicas}) must be <= world_size ({world_size})")
        local = scheme in ("file", "memory")
        return dataclasses.replace(
            self,
            run_id=self.run_id or default_run_id,
            min_replicas=min_replicas,
            num_shards=self.reduce_group_size or self.num_shards or world_size,
            max_poll_s=self.max_poll_s or (0.05 if local else 0.5),
            drop_contributions=(
                scheme == "file" if self.drop_contributions is None else self.drop_contributions
            ),
            fetch_early=not local if self.fetch_early is None else self.fetch_early,
            error_feedback=(self.error_feedback and self.wire_dtype != "float32") or self.sparse,
        )

    @property
    def sparse(self) -> bool:
        """Whether the wire keeps only some values (top-k): error feedback is then on."""
        from crf.exchange.codecs import is_sparse  # imports the codec (torch)

        return is_sparse(self.wire_dtype)

    @property
    def wire(self) -> str:
        """The wire's name in the store: a sparse wire's carries its density
        (``topk4@0.02``, :func:`crf.exchange.codecs.wire_name`)."""
        from crf.exchange.codecs import wire_name

        return wire_name(self.wire_dtype, self.sparse_density)

    @property
    def sparseloco(self) -> bool:
        """Whether this is SparseLoCo: a sparse wire whose decaying error buffer stands in
        for the outer momentum (the outer step is then plain SGD on the average)."""
        return self.sparse and self.sparse_outer == "sparseloco"

    @property
    def error_decay(self) -> float:
        """What last round's residual is multiplied by before it is added to this round's
        pseudo-gradient: SparseLoCo's beta on a sparse wire in that form, else 1."""
        if self.sparseloco:
            return SPARSELOCO_BETA
        return 1.0


@dataclass(frozen=True)
class ExchangeHooks:
    """Callbacks the exchange calls; given when it is built."""

    #: the exchange's phase ("uploading", "quorum", "reducing", "gathering"), as it changes
    on_phase: Callable[[str], None] | None = None
    #: called about once a second while this replica waits for the others to arrive (the
    #: manager serves pending heal requests from it)
    on_wait: Callable[[], None] | None = None
