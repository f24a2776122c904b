"""Typed results of the SDK: what ``Run.wait()``, ``Run.status()``, ``crf.runs()`` and
``crf.dry_run()`` return.

Each is a dataclass over the JSON the CLI prints and the run folder holds (``result.json``,
``crf status --json``, ``crf runs --json``), so a script reads attributes with types instead
of dictionary keys, and ``to_dict()`` gives back exactly the JSON it came from: keys this
version does not declare are kept in ``extra`` (a newer driver's result still round-trips).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["DryRun", "ReplicaProgress", "ReplicaSummary", "RunInfo", "RunResult", "RunStatus"]


@dataclass
class _Typed:
    """from_dict / to_dict over declared fields, the other keys kept in ``extra``."""

    #: fields holding nested records: name -> (class, is a list)
    _NESTED: ClassVar[dict[str, tuple[type, bool]]] = {}
    extra: dict[str, Any] = field(default_factory=dict, repr=False, kw_only=True)
    #: declared fields the source did not have: to_dict leaves them out again
    absent: frozenset[str] = field(
        default_factory=frozenset, repr=False, compare=False, kw_only=True
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "absent"}
        known: dict[str, Any] = {}
        for key in names & set(data):
            value = data[key]
            nested = cls._NESTED.get(key)
            if nested and value is not None:
                kind, many = nested
                value = [kind.from_dict(v) for v in value] if many else kind.from_dict(value)
            known[key] = value
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, extra=extra, absent=frozenset(names - set(data)))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "absent"):
                continue
            value = getattr(self, f.name)
            if f.name in self.absent and value == _default(f):
                continue
            if isinstance(value, list):
                value = [v.to_dict() if isinstance(v, _Typed) else v for v in value]
            elif isinstance(value, _Typed):
                value = value.to_dict()
            out[f.name] = value
        return {**out, **self.extra}


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


@dataclass
class ReplicaSummary(_Typed):
    """One replica's row of ``result.json``."""

    rank: int
    ok: bool = False
    #: how its backend saw it end: succeeded, failed or cancelled
    state: str | None = None
    #: what the replica itself reported (ok, failed; None: it wrote no result)
    reported_status: str | None = None
    exit_code: int | None = None
    error: str | None = None
    rounds_committed: int | None = None
    final_loss: float | None = None
    weights_sha256: str | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    sync_s: float | None = None
    #: the background exchanges' own time (sync_s well below it: the exchange was hidden)
    transfer_s: float | None = None
    compute_s: float | None = None
    restarts: int = 0
    job_metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str | None:
        """The replica's own word (``reported_status``): ok or failed, None without one."""
        return self.reported_status


@dataclass
class RunResult(_Typed):
    """A finished run: ``result.json``, written by the driver (or a gather) at the end."""

    _NESTED: ClassVar[dict[str, tuple[type, bool]]] = {"replicas": (ReplicaSummary, True)}

    run_id: str
    status: str
    error: str | None = None
    backend: str | None = None
    job: str | None = None
    world_size: int | None = None
    rounds: int | None = None
    weights_identical: bool | None = None
    weights_sha256: str | None = None
    final_loss: float | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    wall_s: float | None = None
    restarts: int = 0
    learning: dict[str, Any] = field(default_factory=dict)
    #: held-out evaluation per round, combined over the replicas (None: no held-out data)
    held_out: dict[str, Any] | None = None
    figure: str | None = None
    result_path: str | None = None
    replicas: list[ReplicaSummary] = field(default_factory=list)
    #: what the checks before launch warned of, one line each (a folder's files the
    #: replicas' reader skips, a split checked on its first rows only): the lines a launch
    #: prints before its replicas start, kept for a caller that did not watch them; and, in
    #: a summary written over a damaged ``result.json``, the line that said so
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class RunInfo(_Typed):
    """One run of a store, as ``crf runs`` lists it."""

    run_id: str
    backend: str | None = None
    job: str | None = None
    replicas: int | None = None
    rounds: int | None = None
    created_at: float | None = None
    #: ok, failed, cancelled, starting (its replicas have not beaten yet), running, stopped,
    #: unknown (cloud replicas that have not beaten long after their launch, its driver
    #: gone: ``Run.status()`` asks the backend), or damaged: its run.json cannot be read
    status: str | None = None
    #: why a damaged run's run.json cannot be read (the file and the field); None otherwise
    error: str | None = None
    #: why an unknown run's status is unknown; None otherwise
    note: str | None = None


@dataclass
class ReplicaProgress(_Typed):
    """One replica now, as its backend and its heartbeat see it (``crf status``)."""

    rank: int
    state: str | None = None
    exit_code: int | None = None
    restarts: int = 0
    phase: str | None = None
    round: int | None = None
    step: int | None = None
    loss: float | None = None
    reward: float | None = None
    heartbeat_age_s: float | None = None


@dataclass
class RunStatus(_Typed):
    """A run now (``crf status --json``): its replicas, and its result once written."""

    _NESTED: ClassVar[dict[str, tuple[type, bool]]] = {
        "replicas": (ReplicaProgress, True),
        "result": (RunResult, False),
    }

    run_id: str
    status: str
    backend: str | None = None
    job: str | None = None
    launch: int = 0
    rounds: int | None = None
    replicas: list[ReplicaProgress] = field(default_factory=list)
    result: RunResult | None = None

    @property
    def running(self) -> bool:
        """Whether the run has not ended: its replicas run, or are still starting (a loop
        that waits for the end must not stop before the first heartbeat)."""
        return self.status in ("starting", "running")


@dataclass
class DryRun(_Typed):
    """A checked launch that was not started (``crf.dry_run()``, ``crf launch --dry-run``):
    what would start where, on what hardware, at what price, and what is still missing.
    Nothing was launched or written."""

    run_id: str
    backend: str
    replicas: int
    #: every run option by RunSpec field name, as run.json would hold it
    options: dict[str, Any] = field(default_factory=dict)
    where: str | None = None
    image: str | None = None
    hardware: str | None = None
    region: str | None = None
    command: list[str] = field(default_factory=list)
    store: str | None = None
    #: the backend's own limit on a replica's time, in seconds (None: none)
    timeout_s: float | None = None
    #: list price per replica and for all of them (0.0 on this machine; None: not published)
    hourly_usd: float | None = None
    total_hourly_usd: float | None = None
    #: names of every secret the replicas get (never a value)
    secrets: list[str] = field(default_factory=list)
    #: the job's effective settings (defaults included) and the TRL fields not at TRL's
    #: default (composer); empty for a custom entrypoint
    job_settings: dict[str, Any] = field(default_factory=dict)
    trl_settings: dict[str, Any] = field(default_factory=dict)
    #: what the backend says about the plan, one line each
    notes: list[str] = field(default_factory=list)
    #: what may not be what you meant (GPUs left idle, completions shorter than the answers)
    warnings: list[str] = field(default_factory=list)
    #: what an account or a setup step must provide before the run can launch
    missing: list[str] = field(default_factory=list)
    #: the rollout workers' role (``rollout_workers``): how many, where, on what hardware,
    #: at what price and worst case (the replicas' fields above); None without workers
    workers: dict[str, Any] | None = None

    @property
    def ready(self) -> bool:
        """Whether nothing is missing: the same launch would start."""
        return not self.missing
