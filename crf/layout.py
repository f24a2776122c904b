"""The run-folder contract: every key, listing, env var name and record that the driver and
the replicas share through the store, in one place.

The store is the only bus between the driver and the replicas (docs/design.md, "The run
folder"), so what each side writes and reads there is an interface. Everything that names a
key, counts rounds, reads a replica's environment or reads a record goes through this module;
nothing else builds a key with an f-string or parses a message to recover one. This module
sits at the bottom layer beside :mod:`crf.spec`: it imports nothing from crf but
:mod:`crf.jsonsafe`, and needs no SDK and no torch.

Layout of one run folder::

    run.json                                  the run spec (written once, create-if-absent)
    backend.json                              the backend and its options (no secrets)
    result.json                               the driver's summary of the newest launch
    launches/<k>.json                         who launched attempt k of the whole run, from where,
                                              and the options a resume changed
    launches/<k>/handles.json                 the replicas' handles (to attach, cancel, resume)
    launches/<k>/workers.json                 the rollout workers' handles
    launches/<k>/attempts/<rank>-<a>.json     what a replica's failed attempt left
    launches/<k>/cancel.json                  crf cancel asked launch k to stop (no restarts)
    launches/<k>/previous/...                 the previous launch's result files, kept at resume
    launches/<k>/superseded/global/<r>/...    global states a resume started past
    replicas/<rank>/state.json                heartbeat
    replicas/<rank>/inner/<r>.pt              inner-optimizer state after exchange round r
    replicas/<rank>/trained.json              the job's metrics once every step was trained
    results/<rank>.json                       a replica's final result
    metrics/<rank>/<r>.json                   per-round metrics
    rounds/<r>/contrib/<rank>.<base>.<facts>  a contribution (manifest + shards, one object)
    rounds/<r>/quorum.json                    who takes part in round r (first writer wins)
    rounds/<r>/reduced/<s>                    the average of shard s over the quorum
    rounds/<r>/partial/<i>/<g>                two levels: group g's sum of slice i
    rounds/<r>/held/<rank>/<s>                a shard kept when its owner left the quorum
    rounds/<r>/failed.json                    round r cannot complete (why)
    global/<r>/part-<s>-of-<n>.safetensors    global weights + outer optimizer after round r,
                                              part s of n (older runs: state.safetensors)
    model/                                    the trained model, Hugging Face format (at the end)
    tensorboard/r<rank>/<file>                a replica's TensorBoard event files (--report-to)
    heal/<rank>.json                          a replica's request for a global state
    faults/<tag>                              a fault-injection spec that has fired (tests)
    code/crf-<sha>.tar.gz                     the crf source cloud containers fetch and run
    code/workdir-<sha>.tar.gz                 the user's --workdir, unpacked for every replica
    code/rewards-<sha>.json                   the reward modules a local launch checked, which
                                              each replica imports (no --workdir)
    logs/replica-<rank>.log                   local backend: a replica's output (crf logs)
    workdir/<rank>/                           local backend: a replica's copy of --workdir
    policy/base/<r>                           rollout workers: the global weights of round r
    policy/<rank>/<step>                      trainer rank's policy after <step> inner steps
                                              (a delta against policy/base/<round>)
    policy/<rank>/acks/<w>.json               the version worker w has loaded (it holds it)
    rollouts/<rank>/<w>-<seq>                 worker w's rollout batch <seq> for trainer rank
    rollouts/<rank>/cursor.json               the step trainer rank's next queued batch serves
    rollouts/<rank>/returned/<w>-<seq>        a batch its trainer could not use in time: the
                                              worker generates its rows again
    workers/<w>/state.json                    rollout worker w's heartbeat
    workers/<w>/result.json                   rollout worker w's final result
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# ---------------------------------------------------------------------------------- env vars
#: the replica contract: all a replica needs in its environment (the rest is in run.json)
ENV_RUN_URI = "CRF_RUN_URI"
ENV_RANK = "CRF_RANK"
ENV_WORLD_SIZE = "CRF_WORLD_SIZE"
ENV_RUN_ID = "CRF_RUN_ID"
#: optional knobs a replica reads
ENV_LOG_LEVEL = "CRF_LOG_LEVEL"
ENV_TORCH_THREADS = "CRF_TORCH_THREADS"
ENV_FAULT = "CRF_FAULT"
#: set by a replica of K > 1 local ranks in its workers' environment (crf/replica/local_ranks.py)
ENV_LOCAL_WORKER = "CRF_LOCAL_WORKER"
#: names of the env vars whose values are secrets (comma-separated), for the log redactor
ENV_SECRET_NAMES = "CRF_SECRET_NAMES"
#: the run-folder key of the packed --workdir a cloud container unpacks and runs in
ENV_WORKDIR_KEY = "CRF_WORKDIR_KEY"
#: the run-folder key of the reward code a local run's driver checked (crf/replica/reward_code.py)
ENV_REWARD_CODE = "CRF_REWARD_CODE"
#: ``trainer`` (the default) or ``rollout``: what a started process is
ENV_ROLE = "CRF_ROLE"
ROLE_TRAINER, ROLE_ROLLOUT = "trainer", "rollout"
#: a rollout worker's index (0..M-1), set with CRF_ROLE=rollout
ENV_WORKER = "CRF_WORKER"
#: benchmarks only (bench/async.py): a rollout worker takes this many times its generation
#: time per batch (it waits the rest), to stand for workers on slower GPUs than the trainers
ENV_ROLLOUT_SLOWDOWN = "CRF_ROLLOUT_SLOWDOWN"


def replica_env(run_uri: str, rank: int, world_size: int, run_id: str) -> dict[str, str]:
    """The replica contract's environment for one replica."""
    return {
        ENV_RUN_URI: run_uri,
        ENV_RANK: str(rank),
        ENV_WORLD_SIZE: str(world_size),
        ENV_RUN_ID: run_id,
    }


# -------------------------------------------------------------------------------------- keys
RUN_SPEC = "run.json"
BACKEND = "backend.json"
RESULT = "result.json"
LAUNCHES = "launches"
ROUNDS = "rounds"
GLOBAL = "global"
HEAL = "heal"
RESULTS = "results"
METRICS = "metrics"
REPLICAS = "replicas"
FAULTS = "faults"
#: the trained model in Hugging Face format, written at the end of a run (crf export)
MODEL_DIR = "model"
#: the replicas' TensorBoard event files (--report-to tensorboard): tensorboard --logdir it
TENSORBOARD_DIR = "tensorboard"


def heartbeat_key(rank: int) -> str:
    return f"{REPLICAS}/{rank}/state.json"


def inner_dir(rank: int) -> str:
    return f"{REPLICAS}/{rank}/inner"


def inner_key(rank: int, r: int) -> str:
    return f"{inner_dir(rank)}/{r}.pt"


def trained_metrics_key(rank: int) -> str:
    """The job's metrics as a replica had them once every inner step was trained, written
    before ``model/`` and its result: a restart that only finishes the export (it died
    writing the model) reports them rather than none."""
    return f"{REPLICAS}/{rank}/trained.json"


def result_key(rank: int) -> str:
    return f"{RESULTS}/{rank}.json"


def metrics_dir(rank: int) -> str:
    return f"{METRICS}/{rank}"


def metrics_key(rank: int, r: int) -> str:
    return f"{metrics_dir(rank)}/{r}.json"


def launch_key(k: int) -> str:
    return f"{LAUNCHES}/{k}.json"


def handles_key(k: int) -> str:
    return f"{LAUNCHES}/{k}/handles.json"


def worker_handles_key(launch: int) -> str:
    """The rollout workers' handles of driver launch ``launch`` (beside the replicas')."""
    return f"{LAUNCHES}/{launch}/workers.json"


def cancel_key(k: int) -> str:
    """Written by ``crf cancel`` before it signals the replicas: a driver watching launch
    ``k`` reads it when a replica dies, and restarts none (a cancel, not a death)."""
    return f"{LAUNCHES}/{k}/cancel.json"


def attempt_key(k: int, rank: int, attempt: int) -> str:
    return f"{LAUNCHES}/{k}/attempts/{rank}-{attempt}.json"


def previous_key(k: int, key: str) -> str:
    """Where launch k keeps the previous launch's ``key`` (``result.json``, results)."""
    return f"{LAUNCHES}/{k}/previous/{key}"


def superseded_key(k: int, key: str) -> str:
    """Where launch k moves a global state it started past."""
    return f"{LAUNCHES}/{k}/superseded/{key}"


def round_dir(r: int) -> str:
    return f"{ROUNDS}/{r}"


def contrib_dir(r: int) -> str:
    return f"{ROUNDS}/{r}/contrib"


def contrib_key(r: int, name: str) -> str:
    return f"{contrib_dir(r)}/{name}"


def shard_name(r: int, rank: int, s: int) -> str:
    """How records name shard s inside replica rank's contribution object (not a key)."""
    return f"{contrib_dir(r)}/{rank}#{s}"


def held_key(r: int, rank: int, s: int) -> str:
    return f"{ROUNDS}/{r}/held/{rank}/{s}"


def held_dir(r: int, rank: int) -> str:
    return f"{ROUNDS}/{r}/held/{rank}"


def quorum_key(r: int) -> str:
    return f"{ROUNDS}/{r}/quorum.json"


def reduced_dir(r: int) -> str:
    return f"{ROUNDS}/{r}/reduced"


def reduced_key(r: int, s: int) -> str:
    return f"{reduced_dir(r)}/{s}"


def partial_dir(r: int, i: int) -> str:
    """Two-level reduction: every group's sum of slice i (one listing tells its leader which
    are there)."""
    return f"{ROUNDS}/{r}/partial/{i}"


def partial_key(r: int, g: int, i: int) -> str:
    """Two-level reduction: group g's sum (not divided) of slice i, with its count."""
    return f"{partial_dir(r, i)}/{g}"


def failed_key(r: int) -> str:
    return f"{ROUNDS}/{r}/failed.json"


def global_dir(r: int) -> str:
    return f"{GLOBAL}/{r}"


def global_key(r: int) -> str:
    """Round r's global state as one file: what runs before parts wrote (still read)."""
    return f"{GLOBAL}/{r}/state.safetensors"


# ------------------------------------------------- global states written in parts
_GLOBAL_PART = re.compile(r"^part-(\d+)-of-(\d+)\.safetensors$")


def shard_prefix(local_rank: int, local_size: int) -> str:
    """Where local rank ``local_rank`` of ``local_size`` of a ``DiLoCoHook`` replica exchanges
    its shard, inside the run folder (the run folder itself with one rank)."""
    return "" if local_size == 1 else f"shards/{local_rank}-of-{local_size}"


def global_part_key(r: int, s: int, n: int) -> str:
    """Part ``s`` of round r's global state, one of ``n``: written by the round's s-th
    participant, the owner of shard s. The name says how many parts make the state whole."""
    return f"{GLOBAL}/{r}/part-{s}-of-{n}.safetensors"


def global_parts(store: Lister, r: int) -> list[str]:
    """The keys that hold round r's whole global state: its ``n`` parts when every one has
    landed, else ``global_key(r)`` where an older run wrote one file, else []. (A kill or a
    dead writer can leave some parts without the others: such a round is not a state.)"""
    names = store.list(global_dir(r))
    found: dict[int, set[int]] = {}
    for name in names:
        m = _GLOBAL_PART.match(name)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    for n in sorted(found, reverse=True):  # one count per round; the largest if several
        if found[n] == set(range(n)):
            return [global_part_key(r, s, n) for s in range(n)]
    if global_key(r).rsplit("/", 1)[-1] in names:
        return [global_key(r)]
    return []


def global_complete(store: Lister, r: int) -> bool:
    """Whether round r's global state is whole in the store (:func:`global_parts`)."""
    return bool(global_parts(store, r))


def model_key(name: str) -> str:
    """A file of the exported model (``config.json``, ``model.safetensors``, ...)."""
    return f"{MODEL_DIR}/{name}"


def tensorboard_key(rank: int, name: str) -> str:
    """A file of replica ``rank``'s TensorBoard log (``name`` relative to its log dir), one
    TensorBoard run per replica, named like its tracker run (``r<rank>``)."""
    return f"{TENSORBOARD_DIR}/r{rank}/{name}"


def heal_key(rank: int) -> str:
    return f"{HEAL}/{rank}.json"


def code_key(digest: str) -> str:
    """Where a cloud launch puts the crf source its containers fetch (one per content)."""
    return f"code/crf-{digest}.tar.gz"


def workdir_key(digest: str) -> str:
    """Where the driver puts the packed ``--workdir`` (one per content; run.json names it)."""
    return f"code/workdir-{digest}.tar.gz"


def reward_code_key(digest: str) -> str:
    """Where a local driver puts the reward modules it checked (one per content)."""
    return f"code/rewards-{digest}.json"


def fault_key(tag: str) -> str:
    return f"{FAULTS}/{tag}"


# ------------------------------------------------------------------ rollout workers' keys
POLICY = "policy"
ROLLOUTS = "rollouts"
WORKERS = "workers"


def policy_base_key(r: int) -> str:
    """The global weights rollout workers add a trainer's delta to in round r (first writer
    wins: every trainer's copy is the same)."""
    return f"{POLICY}/base/{r}"


def policy_dir(rank: int) -> str:
    return f"{POLICY}/{rank}"


def policy_key(rank: int, step: int) -> str:
    """Trainer rank's policy after ``step`` inner steps in all (crf.rollouts.Version)."""
    return f"{policy_dir(rank)}/{step}"


def policy_ack_key(rank: int, worker: int) -> str:
    return f"{policy_dir(rank)}/acks/{worker}.json"


def rollout_dir(rank: int) -> str:
    return f"{ROLLOUTS}/{rank}"


def rollout_key(rank: int, worker: int, seq: int) -> str:
    return f"{rollout_dir(rank)}/{worker}-{seq}"


def rollout_cursor_key(rank: int) -> str:
    """The step the next queued batch of trainer rank will serve (written before the trainer
    takes a batch): its workers count their next batch's staleness from it."""
    return f"{rollout_dir(rank)}/cursor.json"


def returned_key(rank: int, worker: int, seq: int) -> str:
    return f"{rollout_dir(rank)}/returned/{worker}-{seq}"


def worker_state_key(worker: int) -> str:
    return f"{WORKERS}/{worker}/state.json"


def worker_result_key(worker: int) -> str:
    return f"{WORKERS}/{worker}/result.json"


# ---------------------------------------------------------------------------------- listings
class Lister(Protocol):
    """What listings need of a store (RunStore has it)."""

    def list(self, prefix: str = "") -> list[str]: ...

    def exists(self, key: str) -> bool: ...


def numbered(names: Iterable[str], suffix: str = "") -> list[int]:
    """The numbers among ``names`` (``"3"``, or ``"3.json"`` with ``suffix=".json"``), sorted
    ascending; other names (temp files, strays) are ignored."""
    out = []
    for name in names:
        stem = name[: -len(suffix)] if suffix and name.endswith(suffix) else name
        if (not suffix or name.endswith(suffix)) and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def round_numbers(store: Lister) -> list[int]:
    """Exchange rounds with a folder under ``rounds/``, ascending."""
    return numbered(store.list(ROUNDS))


def global_rounds(store: Lister, *, complete: bool = False) -> list[int]:
    """Rounds with a global state folder, ascending. ``complete=True`` keeps only those whose
    state is whole (:func:`global_complete`, one listing per round): a kill mid-write can
    leave the folder with only a writer's temp file, or some parts without the others."""
    rounds = numbered(store.list(GLOBAL))
    if complete:
        rounds = [r for r in rounds if global_complete(store, r)]
    return rounds


def inner_rounds(store: Lister, rank: int) -> list[int]:
    """Exchange rounds for which replica ``rank`` saved its inner state, ascending."""
    return numbered(store.list(inner_dir(rank)), ".pt")


def metrics_rounds(store: Lister, rank: int) -> list[int]:
    return numbered(store.list(metrics_dir(rank)), ".json")


def launch_numbers(store: Lister) -> list[int]:
    """Launches of the whole run (0 the first, one more per resume), ascending."""
    return numbered(store.list(LAUNCHES), ".json")


def heal_requests(store: Lister) -> list[int]:
    """Ranks with a heal request, ascending."""
    return numbered(store.list(HEAL), ".json")


# ----------------------------------------------------------------------------------- records
def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


class Record:
    """A JSON object in the run folder, as a dataclass: ``to_dict`` for writers, ``from_dict``
    for readers (unknown keys are ignored, so an older reader reads a newer writer's record;
    missing keys take their defaults)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Any:
        return cls(**_known(cls, data or {}))


#: the legacy "key: reason" reasons for a part that was absent rather than bad
_LEGACY_LEFT_OUT = re.compile(r": (missing|owner \d+ did not reduce it)$")


@dataclass
class Rejection(Record):
    """An object a replica did not use: ``key`` names it (a store key, or a shard inside a
    contribution), ``reason`` says why. ``left_out`` marks a part that was absent (its
    replica died or was late) rather than one that was there but bad."""

    key: str
    reason: str
    left_out: bool = False

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"

    @classmethod
    def from_dict(cls, data: Rejection | Mapping[str, Any] | str | None) -> Rejection:
        if isinstance(data, Rejection):  # already one (a list may mix records and strings)
            return data
        if isinstance(data, str):  # a record written before rejections had a structure
            key, _, reason = data.partition(": ")
            return cls(key=key, reason=reason, left_out=_LEGACY_LEFT_OUT.search(data) is not None)
        return cls(**_known(cls, data or {}))


def rejected_keys(rejections: Iterable[Rejection]) -> list[str]:
    """The distinct keys of bad (not merely absent) objects, sorted by round then name: one
    bad object can be reported by several replicas, and counting keys counts objects."""
    keys = {x.key for x in rejections if not x.left_out}

    def order(key: str) -> tuple[int, str]:
        digits = next((p for p in key.replace("#", "/").split("/") if p.isdigit()), None)
        return (int(digits) if digits is not None else -1, key)

    return sorted(keys, key=order)


@dataclass
class Heartbeat(Record):
    """``replicas/<rank>/state.json``: what a replica is doing now (rewritten every few
    seconds while it lives: ``updated_at`` when it has news, ``alive_at`` while a long step
    has none; crf/replica/beacon.py)."""

    rank: int = 0
    phase: str = "starting"
    step: int = 0
    round: int = 0  # outer round
    exchange_round: int = 0  # one per fragment sync
    transfer: str | None = None
    loss: float | None = None
    updated_at: float = 0.0
    pid: int | None = None
    pid_started_at: float | None = None
    host: str | None = None
    rounds_committed: int = 0
    # the last outer round this replica closed (None before its first): its mean loss and
    # mean step metrics (the job's reward...) and its sync time, so a live table shows the
    # same "loss" (the last round's mean) as the summary; absent from older heartbeats
    last_round: int | None = None
    round_loss: float | None = None
    round_metrics: dict[str, float] = field(default_factory=dict)
    round_sync_s: float | None = None
    round_rejected: int = 0  # bad objects that round refused (not parts merely left out)
    # the inner step that round closed at (``step`` has moved on by the time it is read);
    # absent from older heartbeats
    round_step: int | None = None
    # when its process last said it lives, news or not (absent from older heartbeats)
    alive_at: float | None = None

    @property
    def seen_at(self) -> float:
        """When the replica's process was last known to live: the newer of ``updated_at``
        and ``alive_at`` (0.0 when neither says)."""
        times = [t for t in (self.updated_at, self.alive_at) if isinstance(t, int | float)]
        return float(max(times, default=0.0))


@dataclass
class RoundMetrics(Record):
    """``metrics/<rank>/<r>.json``: one replica's numbers for one exchange round."""

    round: int
    rank: int
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    compute_s: float = 0.0  # the replica's compute time so far (since its process started)
    step: int = 0
    updated_at: float = 0.0
    committed: bool = False
    participants: list[int] = field(default_factory=list)
    exchange_round: int | None = None
    sync_s: float = 0.0
    transfer_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    error: str | None = None
    rejected: list[Rejection] = field(default_factory=list)
    healed_from: int | None = None
    #: the exchange's seconds per phase of this round (crf.exchange.phases.PHASES: d2h,
    #: encode, upload, wait, download, decode, h2d), summed over its syncs, ``snapshot``:
    #: the checkpoint copies that blocked training since the previous record, and ``outer``:
    #: DiLoCo's own work at the syncs (pseudo-gradients, restoring the global weights, the
    #: outer step, its global copy); {} in records written before the exchange timed its
    #: phases
    phases_s: dict[str, float] = field(default_factory=dict)
    #: with rollout workers: the rollouts this round trained on by source (``workers``,
    #: ``local``), ``refused`` batches, ``staleness_mean`` / ``staleness_max`` (inner steps)
    #: and, per worker ``w<k>``, its rollouts; {} without workers
    rollouts: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the exchange's other facts

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RoundMetrics:
        data = dict(data or {})
        known = _known(cls, data)
        known["rejected"] = [Rejection.from_dict(x) for x in data.get("rejected") or ()]
        known.setdefault("extra", {})
        known["extra"].update({k: v for k, v in data.items() if k not in known})
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        extra = out.pop("extra")
        return {**extra, **out}


@dataclass
class WorkerState(Record):
    """``workers/<w>/state.json``: what rollout worker w is doing (rewritten while it lives)
    and, in ``workers/<w>/result.json``, how it ended."""

    worker: int = 0
    serves: int = 0  # the trainer replica it generates for
    # starting (building its model), loading (a policy version), generating, pacing, done,
    # failed
    phase: str = "starting"
    version: int | None = None  # the policy version (inner step) it holds
    rollouts: int = 0  # rollouts (completions) written
    batches: int = 0
    returned: int = 0  # batches its trainer returned (too stale) that it generated again
    staleness_mean: float | None = None  # at the time each batch was written
    generate_s: float = 0.0  # seconds spent generating the batches written
    updated_at: float = 0.0
    pid: int | None = None
    host: str | None = None
    status: str | None = None  # in result.json: ok, stopped (by itself), failed, cancelled
    error: str | None = None
    #: why a ``stopped`` worker ended by itself (its trainer gone, the run ended)
    reason: str | None = None


@dataclass
class PolicyAck(Record):
    """``policy/<rank>/acks/<w>.json``: the policy version worker w has loaded and holds."""

    worker: int
    step: int
    digest: str = ""
    loaded_at: float = 0.0


@dataclass
class ResultRecord(Record):
    """``results/<rank>.json``: a replica's final result (``ok`` or ``failed``)."""

    rank: int
    status: str
    error: str | None = None
    rounds_committed: int = 0
    rounds_missed: list[int] = field(default_factory=list)
    fragments: int = 1
    fragment_sync_delay: int = 0
    syncs_committed: int = 0
    syncs_missed: list[int] = field(default_factory=list)
    syncs_caught_up: list[int] = field(default_factory=list)
    final_loss: float | None = None
    weights_sha256: str | None = None
    #: the dtype ``--model``'s checkpoint is stored in (its config.json's), when this replica
    #: saves a model: model/ holds the fp32 master weights, which ``crf export`` then says
    model_dtype: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    ckpt_bytes_up: int = 0
    ckpt_bytes_down: int = 0
    bytes_per_round: int = 0
    wire: str = "float32"
    compression: float = 1.0
    sync_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    ckpt_s: float = 0.0
    steps: int = 0
    wall_s: float = 0.0
    rejected: list[Rejection] = field(default_factory=list)
    resumed_from: int | None = None
    job_metrics: dict[str, Any] = field(default_factory=dict)
    traceback: str | None = None
    restartable: bool = True
    #: where a failed replica was: ``setup`` (building data, model, trainer), ``training``...
    failed_in: str | None = None
    #: the error says the machine or the network failed (a restart may well succeed)
    transient: bool = False
    #: the error is one every replica meets at whatever round (a reward function's own): the
    #: driver ends the run on it (crf.replica.failures.stops_run)
    stops_run: bool = False
    #: what the replica ran with: torch / torchft / trl / transformers versions (crf.versions)
    versions: dict[str, str | None] = field(default_factory=dict)
    #: torch.cuda.is_available() in the replica (None: torch could not be imported)
    cuda_available: bool | None = None
    #: the processes that trained this replica (--procs-per-replica; older results: 1)
    local_ranks: int = 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ResultRecord:
        data = dict(data or {})
        known = _known(cls, data)
        known["rejected"] = [Rejection.from_dict(x) for x in data.get("rejected") or ()]
        return cls(**known)


@dataclass
class LaunchRecord(Record):
    """``launches/<k>.json``: one launch of the whole run (0 the first, one per resume)."""

    launch: int
    started_at: float
    host: str
    pid: int
    backend: str
    restart_policy: dict[str, Any] = field(default_factory=dict)
    resumed_from_round: int | None = None
    superseded_globals: list[int] = field(default_factory=list)
    #: the options this launch changed from run.json's (a resume's ``--reward-timeout``:
    #: crf.spec.AT_RESUME), by field name; they hold for the launches after it too
    changed: dict[str, Any] = field(default_factory=dict)
    ended_at: float | None = None
    status: str | None = None
    restarts: int = 0
    error: str | None = None

    def opening(self) -> dict[str, Any]:
        """The record as its launch writes it when it starts: without the fields written when
        it ends (so a record that has them says its driver saw the end), and without
        ``superseded_globals`` or ``changed`` unless a resume set rounds aside or changed an
        option."""
        data = self.to_dict()
        for name in ("ended_at", "status", "restarts", "error"):
            data.pop(name)
        if not self.superseded_globals:
            data.pop("superseded_globals")
        if not self.changed:
            data.pop("changed")
        return data


#: the run's figure (crf/launcher/figure.py), beside result.json
FIGURE = "figure.png"
