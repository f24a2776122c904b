"""The ServerlessExecutor protocol: how N replicas start, are watched, stopped and collected.

Every backend (local processes, Modal, HF Jobs, SageMaker) starts the same command N times with
the replica contract in the environment and nothing else: ``CRF_RUN_URI``, ``CRF_RANK``,
``CRF_WORLD_SIZE``, ``CRF_RUN_ID``. Everything else a replica needs is in ``run.json`` in the
store, so a backend never has to understand training, and a user's own entrypoint
(``["python", "my_train.py"]``) is started exactly like the built-in ``python -m crf.replica``.

The executor knows the *process* side (exit codes, logs, cancel); the replica's own account of
what it did lives in the store at ``results/<rank>.json``. ``collect`` joins the two, so the
driver gets one row per replica whichever backend ran it.

Restarts: a replica that dies (preempted, OOM-killed, crashed) is started again *for the same
rank* with ``relaunch(handle)``; it resumes from the store by itself (newest ``global/<r>`` plus
its own inner-optimizer state), so a backend only has to run the same command again. A backend
whose platform can restart failed containers itself (a retry strategy, ``retries=``, a job's
backoff limit) sets ``native_restarts``, applies the ``max_restarts`` it is given at launch and
reports how often it did in ``ReplicaStatus.restarts``; the driver then only counts.
"""

from __future__ import annotations

import inspect
import json
import shlex
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from crf import layout

Entrypoint = str | Sequence[str] | None


class ExecutorError(RuntimeError):
    """Replicas cannot be started or controlled; the message says what to change."""


class MissingAccess(ExecutorError):
    """What an account or a setup step provides is missing or refused: credentials (and
    where they would come from), a store the replicas can reach, a role, a client library.

    Apart from other ExecutorErrors (bad input: a misspelt GPU name) because ``--dry-run``
    lists every one of these after the plan and its price, for someone who has no account
    yet, while bad input stops a dry run as it stops a launch.
    """


#: one check before launch: returns nothing useful, raises ExecutorError (MissingAccess for
#: what an account or setup provides)
ReadyCheck = Callable[[], object]


class ReplicaState(StrEnum):
    """Lifecycle of one replica as the backend sees it (not the training phase)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.CANCELLED)


@dataclass(frozen=True)
class ReplicaStatus:
    """What ``status()`` returns: a state, the exit code once known, and a short reason."""

    state: ReplicaState
    exit_code: int | None = None
    message: str = ""
    #: restarts the backend did by itself (backends with ``native_restarts`` only)
    restarts: int = 0

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass
class ReplicaHandle:
    """Enough to find one replica again: which backend, which run, which rank, which job/pid.

    Handles are plain data (``to_dict``) so a driver can save them and a later process can ask
    the same backend about them.
    """

    backend: str
    run_id: str
    rank: int
    backend_id: str  # pid for local processes, job/function-call id for cloud backends
    run_uri: str
    world_size: int
    log_path: str | None = None
    started_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReplicaResult:
    """One replica at the end: the backend's exit status joined with ``results/<rank>.json``."""

    handle: ReplicaHandle
    state: ReplicaState
    exit_code: int | None
    result: dict[str, Any] | None  # the replica's own result; None if it never wrote one
    error: str | None = None
    ended_at: float = field(default_factory=time.time)

    @property
    def rank(self) -> int:
        return self.handle.rank

    @property
    def ok(self) -> bool:
        """Exited cleanly and did not report a failure itself.

        A replica that exits 0 without a result (a user's script that does not use the SDK's
        result writer) still counts as ok: the process is the authority on success.
        """
        if self.state is not ReplicaState.SUCCEEDED:
            return False
        return self.result is None or self.result.get("status", "ok") == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "state": str(self.state),
            "exit_code": self.exit_code,
            "ok": self.ok,
            "error": self.error,
            "result": self.result,
            "handle": self.handle.to_dict(),
        }


def default_entrypoint() -> list[str]:
    """The built-in replica runtime, run by the same interpreter as the driver."""
    return [sys.executable, "-m", "crf.replica"]


def build_command(entrypoint: Entrypoint, entrypoint_args: Sequence[str] = ()) -> list[str]:
    """Normalise an entrypoint (None, a shell-like string, or an argv list) to an argv list."""
    if entrypoint is None:
        cmd = default_entrypoint()
    elif isinstance(entrypoint, str):
        cmd = shlex.split(entrypoint)
    else:
        cmd = [str(part) for part in entrypoint]
    if not cmd or not cmd[0]:
        raise ExecutorError(
            "the entrypoint is empty: give a command such as 'python my_train.py' "
            "(or leave it out to run the built-in replica, python -m crf.replica)"
        )
    return cmd + [str(a) for a in entrypoint_args]


def replica_env(
    run_uri: str,
    run_id: str,
    rank: int,
    world_size: int,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables one replica gets: the caller's extras, then the replica contract
    (``crf.layout.replica_env``), which wins over an extra of the same name."""
    out = {str(k): str(v) for k, v in (env or {}).items()}
    out.update(layout.replica_env(run_uri, rank, world_size, run_id))
    return out


@dataclass(frozen=True)
class Workers:
    """The processes a launch starts are rollout workers, not trainer replicas: worker w
    gets the replica contract of the trainer it serves (``CRF_RANK`` w % trainers,
    ``CRF_WORLD_SIZE`` the trainers) plus ``CRF_ROLE=rollout`` and ``CRF_WORKER=w``, so
    ``python -m crf.replica`` runs the worker loop for that trainer. Given to
    ``launch_replicas(..., workers=Workers(n))``: the "ranks" it starts are then worker
    indices (0..M-1), their logs, job names and labels named ``worker-<w>`` / ``w<w>``."""

    trainers: int

    def env(self, worker: int) -> dict[str, str]:
        return {
            layout.ENV_RANK: str(worker % max(1, self.trainers)),
            layout.ENV_WORLD_SIZE: str(self.trainers),
            layout.ENV_ROLE: layout.ROLE_ROLLOUT,
            layout.ENV_WORKER: str(worker),
        }

    @staticmethod
    def unit(worker: int) -> str:
        """How job names and log files tell worker w from replica w."""
        return f"w{worker}"


def role_of(handle: ReplicaHandle) -> str:
    """``trainer`` or ``rollout``: what a handle's process is (older handles: trainer)."""
    return str(handle.extra.get("role") or layout.ROLE_TRAINER)


def unit_name(rank: int, workers: Workers | None) -> str:
    """A replica's rank, or ``w<k>`` for rollout worker k (job names, labels, messages)."""
    return str(rank) if workers is None else Workers.unit(rank)


def resolve_procs_per_replica(
    requested: int | None,
    executor: ServerlessExecutor,
    entrypoint: Sequence[str] | None,
    job: str,
) -> int:
    """``--procs-per-replica``: as given, else the GPUs of each replica's hardware (1 on
    CPU). Local ranks are started by the built-in replica (``python -m crf.replica``) for a
    job that trains data-parallel (``LOCAL_RANKS = True``, as ``lm`` and ``composer``): an own
    ``--entrypoint`` or another job gets 1 by default, and ExecutorError when it asks for
    more."""
    from crf.replica.jobs import get_job
    from crf.replica.local_ranks import supports_local_ranks

    if entrypoint is not None:
        why = "your own --entrypoint can start torchrun itself"
    elif not supports_local_ranks(get_job(job)):
        why = f"job {job!r} trains on one process per replica (lm and composer train data-parallel)"
    else:
        why = ""
    if why and requested is not None and requested > 1:
        raise ExecutorError(
            f"--procs-per-replica {requested} starts the built-in replica's job on that many "
            f"local ranks, but {why}: leave --procs-per-replica out"
        )
    if why:
        return 1
    return requested if requested is not None else max(1, executor.gpus_per_replica())


def run_id_from_uri(run_uri: str) -> str:
    """The run id is the last part of the run URI (the replica contract, crf.spec)."""
    return run_uri.rstrip("/").rsplit("/", 1)[-1]


def check_launch_args(n_replicas: int, run_uri: str, *, in_process: bool) -> None:
    """Checks every backend makes before starting anything."""
    if not isinstance(n_replicas, int) or isinstance(n_replicas, bool) or n_replicas < 1:
        raise ExecutorError(f"n_replicas must be an integer >= 1 (got {n_replicas!r})")
    if not run_uri:
        raise ExecutorError("run_uri is required: the store folder the replicas meet in")
    if not in_process and run_uri.startswith("memory://"):
        raise ExecutorError(
            f"the run store {run_uri!r} is memory://, which exists only inside one process; "
            "replicas started as separate processes or containers cannot see it. "
            "Use a file:// URI or a plain folder path (or an object store) instead; "
            "memory:// is only for in-process tests that run replicas as threads."
        )


@dataclass
class LaunchArgs:
    """How a run's replicas were started, kept in memory so one rank can be started again.

    Never serialized: ``env`` may hold credentials.
    """

    n_replicas: int
    entrypoint: Entrypoint
    entrypoint_args: tuple[str, ...]
    env: dict[str, str]
    run_uri: str
    run_id: str
    plain_env: dict[str, str] = field(default_factory=dict)
    #: set when the launch started rollout workers (kept apart from the trainers' record)
    workers: Workers | None = None

    @classmethod
    def of(cls, n_replicas: int, entrypoint: Entrypoint, entrypoint_args: Sequence[str],
           env: Mapping[str, str] | None, run_uri: str, run_id: str,
           plain_env: Mapping[str, str] | None = None,
           workers: Workers | None = None) -> LaunchArgs:  # fmt: skip
        """The record of a ``launch_replicas`` call, its arguments copied as plain strings."""
        return cls(
            n_replicas=n_replicas,
            entrypoint=entrypoint,
            entrypoint_args=tuple(str(a) for a in entrypoint_args),
            env={str(k): str(v) for k, v in (env or {}).items()},
            run_uri=run_uri,
            run_id=run_id,
            plain_env={str(k): str(v) for k, v in (plain_env or {}).items()},
            workers=workers,
        )

    @property
    def role(self) -> str:
        return layout.ROLE_TRAINER if self.workers is None else layout.ROLE_ROLLOUT


def prepare_launch(n_replicas: int, run_uri: str, run_id: str | None,
                   ranks: Sequence[int] | None) -> tuple[str, str, list[int]]:  # fmt: skip
    """What every process/container backend does first in ``launch_replicas``: check the
    arguments, normalise the run URI; return (run URI, run id, ranks to start)."""
    check_launch_args(n_replicas, run_uri, in_process=False)
    to_start = check_ranks(ranks, n_replicas)
    from crf.store import normalize_uri  # lazy: keeps `import crf.executors` light

    run_uri = normalize_uri(run_uri)
    return run_uri, run_id or run_id_from_uri(run_uri), to_start


def check_ranks(ranks: Sequence[int] | None, n_replicas: int) -> list[int]:
    """The ranks to start (all of them by default); ExecutorError for out-of-range ones."""
    if ranks is None:
        return list(range(n_replicas))
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n_replicas:
            raise ExecutorError(f"rank {r!r} is not in [0, {n_replicas})")
        if r not in out:
            out.append(r)
    return out


@dataclass
class BackendPlan:
    """What ``crf launch --dry-run`` prints: what would start where, on what, at what price.

    ``hourly_usd`` is per replica, from the backend's published list price for the chosen
    hardware (None where the backend publishes none, or for the local backend: free);
    ``price_basis`` says which price it is where that is not obvious (a spot run priced at
    the on-demand rate because no spot price is published). ``resources`` is each replica's
    CPU and memory, as the platform reserves them.
    """

    backend: str
    replicas: int
    where: str  # e.g. "Modal sandboxes in app crf", "this machine"
    image: str
    hardware: str
    command: list[str]
    store: str
    region: str | None = None
    timeout_s: float | None = None
    hourly_usd: float | None = None
    secrets: list[str] = field(default_factory=list)  # names only, never values
    notes: list[str] = field(default_factory=list)
    resources: str = "-"  # CPU and memory per replica, e.g. "4 CPU cores, 16 GiB"
    price_basis: str = ""  # e.g. "on-demand price; managed spot bills less"

    @property
    def total_hourly_usd(self) -> float | None:
        return None if self.hourly_usd is None else self.hourly_usd * self.replicas

    @property
    def worst_case_usd(self) -> float | None:
        """What the run costs if every replica runs until the platform's timeout stops it
        (None where the price or the timeout is unknown)."""
        total = self.total_hourly_usd
        if total is None or self.timeout_s is None:
            return None
        return total * self.timeout_s / 3600

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["total_hourly_usd"] = self.total_hourly_usd
        out["worst_case_usd"] = self.worst_case_usd
        return out


class ServerlessExecutor(ABC):
    """Starts N replicas of one command and reports on them.

    Subclasses implement ``launch_replicas``, ``status``, ``logs`` and ``cancel``; ``wait``,
    ``cancel_all``, ``collect`` and ``relaunch`` are shared so every backend gathers results
    and restarts replicas the same way.
    """

    #: backend name, recorded in handles and in run.json
    name: ClassVar[str] = "base"
    #: True for executors whose replicas share the driver's process (threads): only they may
    #: use a memory:// store.
    in_process: ClassVar[bool] = False
    #: True when the platform restarts a failed replica by itself (see the module docstring);
    #: the driver then passes ``max_restarts`` to ``launch_replicas`` instead of relaunching.
    native_restarts: ClassVar[bool] = False
    #: True when the replicas' environment installs a run's ``--pip`` packages (the cloud
    #: bootstrap); otherwise the driver checks they are installed where it runs
    installs_packages: ClassVar[bool] = False

    @abstractmethod
    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: Entrypoint = None,
        entrypoint_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        run_uri: str,
        run_id: str | None = None,
        ranks: Sequence[int] | None = None,
        max_restarts: int = 0,
        plain_env: Mapping[str, str] | None = None,
    ) -> list[ReplicaHandle]:
        """Start ranks 0..n_replicas-1 (or only ``ranks``, e.g. to restart one) of a run of
        ``n_replicas``; return one handle per started rank, in rank order.

        ``env`` is secret (credentials, ``--secret``): it goes through the platform's secret
        mechanism and its names into ``CRF_SECRET_NAMES``. ``plain_env`` (``--env``) is plain
        configuration, set as ordinary environment that a describe call may show.

        Implementations call ``remember_launch`` so ``relaunch`` can start a rank again.
        ``max_restarts`` is for backends with ``native_restarts``; others ignore it (the
        driver relaunches instead).
        """

    @abstractmethod
    def status(self, handle: ReplicaHandle) -> ReplicaStatus:
        """Current state of one replica; never blocks for long."""

    @abstractmethod
    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        """Lines the replica printed (no trailing newline); with follow, until it ends."""

    @abstractmethod
    def cancel(self, handle: ReplicaHandle) -> None:
        """Stop one replica (and everything it started); a finished replica is left alone."""

    # ------------------------------------------------------------------ planning, reattach
    def ready_checks(self, run_uri: str) -> list[ReadyCheck]:
        """Everything that can be checked before launching (credentials, hardware names,
        whether replicas on this backend can reach ``run_uri``), as independent checks in
        the order a launch runs them. The default (local processes): only the run URI."""
        return [lambda: self.check_run_uri(run_uri)]

    def check_ready(self, run_uri: str) -> None:
        """Run the ready checks; the first failure is an ExecutorError that says what to fix
        (a launch stops there, before anything starts)."""
        for check in self.ready_checks(run_uri):
            check()

    def missing(self, run_uri: str) -> list[str]:
        """Every MissingAccess the ready checks raise, one line each, so ``--dry-run`` can
        list all that is missing at once; bad input (any other ExecutorError) still raises."""
        found: list[str] = []
        for check in self.ready_checks(run_uri):
            try:
                check()
            except MissingAccess as e:
                found.append(str(e))
        return found

    def replica_limit(self) -> tuple[int, str] | None:
        """The most replicas this backend can run at once, and why (None: no limit known
        here; the platform's own quotas answer at launch). Checked before launching."""
        return None

    def describe(self, n_replicas: int, command: Sequence[str] | None, run_uri: str) -> BackendPlan:
        """The plan ``--dry-run`` prints; launches nothing, writes nothing."""
        cmd = build_command(command)
        return BackendPlan(self.name, n_replicas, "this machine", "-", "-", cmd, run_uri)

    def config(self) -> dict[str, Any]:
        """Constructor options (never secrets) that rebuild an equivalent executor in another
        process, so ``crf status/logs/cancel`` can reattach to a run (kept in the store)."""
        return {}

    def find_replicas(self, run_id: str, run_uri: str, world_size: int) -> list[ReplicaHandle]:
        """Find a run's replicas through the backend's own tags/labels (for runs whose
        handles were never saved, e.g. the driver died right after launching). Backends
        without tags raise ExecutorError."""
        raise ExecutorError(f"the {self.name} backend cannot look up replicas by run id")

    # ------------------------------------------------------------------ restarts
    def remember_launch(self, record: LaunchArgs) -> None:
        """Keep how a run was started (in memory only) for ``relaunch``: one record per
        run and role (its trainers, its rollout workers)."""
        if not hasattr(self, "_launch_records"):
            self._launch_records: dict[tuple[str, str], LaunchArgs] = {}
        self._launch_records[(record.run_id, record.role)] = record

    def starts_workers(self) -> bool:
        """Whether this backend can start rollout workers: its ``launch_replicas`` takes
        ``workers=`` (every built-in one does)."""
        return "workers" in inspect.signature(self.launch_replicas).parameters

    def launch_workers(
        self,
        n_workers: int,
        trainers: int,
        entrypoint: Entrypoint = None,
        env: Mapping[str, str] | None = None,
        *,
        run_uri: str,
        run_id: str | None = None,
        workers: Sequence[int] | None = None,
        plain_env: Mapping[str, str] | None = None,
    ) -> list[ReplicaHandle]:
        """Start rollout workers 0..n_workers-1 (or only ``workers``) of a run of
        ``trainers`` replicas, on this executor's hardware, with the same code, image and
        secrets handling as its replicas; one handle per worker (``extra["role"]`` is
        ``rollout``, ``rank`` the worker's index). Backends whose ``launch_replicas`` takes
        ``workers=`` (every built-in one) need nothing more."""
        if not self.starts_workers():
            raise ExecutorError(f"the {self.name} backend cannot start rollout workers")
        handles = self.launch_replicas(
            n_workers,
            entrypoint,
            (),
            env,
            run_uri=run_uri,
            run_id=run_id,
            ranks=workers,
            plain_env=plain_env,
            workers=Workers(trainers),  # type: ignore[call-arg]
        )
        for h in handles:
            h.extra["role"] = layout.ROLE_ROLLOUT
        return handles

    def relaunch(self, handle: ReplicaHandle) -> ReplicaHandle:
        """Start ``handle``'s rank again with the command and environment it was first started
        with; return the new handle (``extra["attempt"]`` counts up from 0).

        The new process finds its own place in the run from the store (it resumes from the
        newest global state), so nothing about the old process is carried over. Only runs this
        executor instance launched can be relaunched: the environment, which may hold
        credentials, is never written anywhere it could be read back from.
        """
        role = role_of(handle)
        record = getattr(self, "_launch_records", {}).get((handle.run_id, role))
        if record is None:
            what = "replica" if role == layout.ROLE_TRAINER else "rollout worker"
            raise ExecutorError(
                f"cannot relaunch {what} {handle.rank} of run {handle.run_id}: it was not "
                "launched by this executor (resume the run instead: crf launch --resume)"
            )
        if record.workers is not None:
            (new,) = self.launch_workers(
                record.n_replicas,
                record.workers.trainers,
                record.entrypoint,
                record.env,
                run_uri=record.run_uri,
                run_id=record.run_id,
                workers=[handle.rank],
                plain_env=record.plain_env,
            )
        else:
            (new,) = self.launch_replicas(
                record.n_replicas,
                record.entrypoint,
                record.entrypoint_args,
                record.env,
                run_uri=record.run_uri,
                run_id=record.run_id,
                ranks=[handle.rank],
                plain_env=record.plain_env,
            )
        new.extra["attempt"] = int(handle.extra.get("attempt", 0)) + 1
        return new

    # ------------------------------------------------------------------ shared helpers
    def check_run_uri(self, run_uri: str) -> None:
        """Refuse a store this backend's replicas cannot reach (memory:// for processes)."""
        check_launch_args(1, run_uri, in_process=self.in_process)

    def gpus_per_replica(self) -> int:
        """The GPUs each replica's hardware has (0: CPU only, or hardware crf cannot count):
        the default of ``--procs-per-replica``."""
        return 0

    def gpu_bf16(self) -> bool | None:
        """Whether each replica's GPU computes in bfloat16 itself (Ampere or later; older
        GPUs emulate it, slower than fp32): ``--precision``'s choices there. None where the
        backend does not say, or without a GPU."""
        return None

    def check_command(
        self, entrypoint: Entrypoint, entrypoint_args: Sequence[str] = ()
    ) -> list[str]:
        """The argv replicas will run; backends that can, check the program exists."""
        return build_command(entrypoint, entrypoint_args)

    def cancel_all(self, handles: Sequence[ReplicaHandle]) -> None:
        """Cancel every replica that is still running. Backends may do it in parallel."""
        for h in handles:
            if not self.status(h).terminal:
                self.cancel(h)

    def wait(
        self,
        handles: Sequence[ReplicaHandle],
        timeout: float | None = None,
        *,
        poll_s: float = 0.2,
    ) -> bool:
        """Block until every replica has ended; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if all(self.status(h).terminal for h in handles):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def read_result(self, handle: ReplicaHandle) -> tuple[dict[str, Any] | None, str | None]:
        """``results/<rank>.json`` (a rollout worker's ``workers/<w>/result.json``) from the
        store: (result, problem reading it)."""
        from crf.store import ObjectNotFound, RunStore  # lazy: the store pulls in fsspec

        if role_of(handle) == layout.ROLE_ROLLOUT:
            key = layout.worker_result_key(handle.rank)
        else:
            key = layout.result_key(handle.rank)
        try:
            data = RunStore(handle.run_uri).get_json(key)
        except ObjectNotFound:
            return None, None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, f"{key} is not valid JSON ({e})"
        except Exception as e:  # noqa: BLE001 - any store client's error: report it, keep the exit codes
            return None, f"could not read {key}: {type(e).__name__}: {e}"
        if not isinstance(data, dict):
            return None, f"{key} is not a JSON object"
        return data, None

    def collect(
        self,
        handles: Sequence[ReplicaHandle],
        timeout: float | None = None,
        *,
        cancel_on_timeout: bool = True,
        poll_s: float = 0.2,
    ) -> list[ReplicaResult]:
        """Wait for every replica, then join exit codes with the results in the store.

        If ``timeout`` passes first, the replicas still running are cancelled and reported as
        such (``cancel_on_timeout``), or ``TimeoutError`` is raised and nothing is stopped.
        """
        finished = self.wait(handles, timeout, poll_s=poll_s)
        timed_out: set[int] = set()
        if not finished:
            late = [h for h in handles if not self.status(h).terminal]
            if not cancel_on_timeout:
                ranks = ", ".join(str(h.rank) for h in late)
                raise TimeoutError(f"replica(s) {ranks} still running after {timeout}s")
            timed_out = {h.rank for h in late}
            self.cancel_all(late)
        results = []
        for h in handles:
            st = self.status(h)
            data, problem = self.read_result(h)
            error = problem
            if h.rank in timed_out:
                error = f"did not finish within {timeout}s and was cancelled"
            elif data is not None and data.get("status") == "failed":
                error = str(data.get("error") or "replica reported failure")
            elif st.state is ReplicaState.FAILED:
                error = st.message or f"exited with code {st.exit_code}"
            elif st.state is ReplicaState.CANCELLED:
                error = st.message or "cancelled"
            results.append(ReplicaResult(h, st.state, st.exit_code, data, error))
        return results
