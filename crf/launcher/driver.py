"""The driver: validate, write run.json, launch, watch, gather - in that order.

Everything a user can get wrong is checked in ``prepare`` before a single replica starts
(backend, job and its options, numbers, entrypoint, store, an existing run folder), because a
mistake found after launch costs N processes - or N paid containers - and leaves a half-made
run folder behind. ``run`` then writes ``run.json`` with create-if-absent (two drivers racing
for one run id cannot both win), starts the replicas, shows their heartbeats, and writes the
summary to ``result.json``. The replicas never need the driver: if it dies, they go on, and
the store still gets their results.

While it watches, the driver also restarts replicas that die (``RestartPolicy``): the new
process resumes from the store by itself, so a restart is just "run the same command again".
``prepare_resume`` / ``resume`` continue a run whose driver and replicas all stopped, from its
``run.json`` (never rewritten) and its newest committed ``global/<r>``. Every driver launch of
a run is recorded under ``launches/<k>.json`` (0 = the first launch, then one per resume), with
what each ended replica attempt left behind under ``launches/<k>/`` - so neither a restart nor a
resume overwrites anything without keeping it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import socket
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from crf.executors.base import (
    ExecutorError,
    ReplicaHandle,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
)
from crf.executors.process import is_replica_process
from crf.launcher.errors import LaunchError
from crf.layout import RUN_SPEC
from crf.spec import RunSpec, SpecError, check_run_id, check_seconds, new_run_id, run_options

if TYPE_CHECKING:
    from rich.console import Console

    from crf.store import RunStore

DEFAULT_STORE = "./crf-runs"
#: RunSpec fields the driver fills in itself; every other field is a run option (crf.spec)
_MANAGED = frozenset(f.name for f in dataclasses.fields(RunSpec)) - set(run_options())
LOG_TAIL_LINES = 15
DEFAULT_MAX_RESTARTS = 3
#: exit codes that a restart cannot fix (crf.replica): why, for the summary
NO_RESTART_EXIT_CODES = {
    2: "means its environment is broken",
    3: "means it failed with an error a restart cannot fix",
}
#: a replica on another host whose heartbeat is younger than this may still be running
LIVE_HEARTBEAT_S = 60.0


def make_executor(backend: str, options: Mapping[str, Any] | None = None) -> ServerlessExecutor:
    """The executor for a backend name and its options; LaunchError says what to fix."""
    from crf.executors.registry import make_executor as build

    try:
        return build(backend, options)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None


def display_path(store: RunStore, key: str = "") -> str:
    """A local path for file:// stores (what a user can open), the URI otherwise."""
    if store.scheme == "file":
        return store.path(key)
    return f"{store.uri}/{key}" if key else store.uri


@dataclass
class RestartPolicy:
    """How often the driver starts a failed replica again.

    ``max_restarts`` per replica (rank) and ``max_run_restarts`` for the whole run (None: no
    cap beyond N x max_restarts). A restarted replica resumes from the newest global state and
    its own saved inner-optimizer state, so a restart costs only that replica's work since the
    last committed round. A replica that exits 2 (its environment breaks the contract) or was
    cancelled is never restarted: running it again cannot help.
    """

    max_restarts: int = DEFAULT_MAX_RESTARTS
    max_run_restarts: int | None = None

    def validate(self) -> RestartPolicy:
        for name in ("max_restarts", "max_run_restarts"):
            value = getattr(self, name)
            if value is None and name == "max_run_restarts":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                flag = "--" + name.replace("_", "-")
                raise LaunchError(f"{flag} must be an integer >= 0 (got {value!r})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ResumeInfo:
    """What ``prepare_resume`` found: which launch this is and where the run stands."""

    launch: int  # this driver launch's number (0 was the first launch)
    #: the global round the replicas continue from (None: nothing committed yet): the newest
    #: one every replica's inner state was saved for, else the newest (see resume_point)
    from_round: int | None
    previous_status: str | None  # status in the previous result.json, if any
    #: newer global rounds set aside (under launches/<k>/superseded/) because a replica's
    #: inner state of that round never landed; the resumed replicas compute them again
    superseded: list[int] = field(default_factory=list)
    #: replicas that resume with a fresh inner optimizer (no saved state of from_round)
    fresh_inner: list[int] = field(default_factory=list)


@dataclass
class Plan:
    """A validated run, ready to start: nothing has been written or launched yet."""

    spec: RunSpec
    store: RunStore
    executor: ServerlessExecutor
    command: list[str] | None  # None: the backend's default, python -m crf.replica
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    resume: ResumeInfo | None = None  # set when continuing an existing run


def _validate_job(job: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check the job exists and its options are valid; return the options as typed values."""
    from crf.replica.jobs import job_config

    try:
        cfg = job_config(job, dict(options or {}))
    except ImportError as e:
        raise LaunchError(f"job {job!r} cannot be loaded ({e}); is crf fully installed?") from None
    except (TypeError, ValueError) as e:
        raise LaunchError(str(e)) from None
    # Keep only what the user set (coerced to the option's type): the replica applies the
    # job's defaults itself, and run.json stays readable.
    return {k: getattr(cfg, k, v) for k, v in (options or {}).items()}


def _check_replica_limit(executor: ServerlessExecutor, replicas: int) -> None:
    """LaunchError if the backend cannot run that many replicas (see replica_limit)."""
    limit_of = getattr(executor, "replica_limit", None)
    found = limit_of() if callable(limit_of) else None
    if found is not None and replicas > found[0]:
        limit, why = found
        name = getattr(executor, "name", "this")
        raise LaunchError(
            f"--replicas {replicas} is more than the {name} backend can run: at most {limit} "
            f"({why}); lower --replicas or use a cloud backend"
        )


def launch_options(options: Mapping[str, Any] | RunSpec | None) -> dict[str, Any]:
    """The run options of a launch as a dict by RunSpec field name: a mapping's (LaunchError
    for a name that is no run option), or a RunSpec's own (its run_uri is not one: the store
    decides where a run lives)."""
    if isinstance(options, RunSpec):
        return {name: getattr(options, name) for name in run_options()}
    values = dict(options or {})
    unknown = sorted(set(values) - set(run_options()))
    if unknown:
        raise LaunchError(f"unknown launch option(s): {', '.join(unknown)}")
    return values


def prepare(
    options: Mapping[str, Any] | RunSpec | None = None,
    *,
    store: str | None = None,
    executor: ServerlessExecutor | None = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    dry_run: bool = False,
) -> Plan:
    """Validate every input; LaunchError says what to fix. Writes nothing but a probe (and
    not even that with ``dry_run``).

    ``options``: the run options (RunSpec fields declared with ``option``: job, replicas,
    sync_every, rounds, job_config, entrypoint, ...); one left out takes its RunSpec default,
    ``run_id`` a new one. ``executor`` replaces the one ``backend`` and ``backend_options``
    name.
    """
    from crf.store import join_uri, normalize_uri

    values = launch_options(options)
    policy = (restart or RestartPolicy()).validate()
    job_options, entrypoint = values.pop("job_config", None), values.pop("entrypoint", None)
    run_id = values.pop("run_id", None)
    run_id = run_id if run_id is not None else new_run_id()
    if executor is None:
        executor = make_executor(values.get("backend", RunSpec.backend), backend_options)
    values["backend"] = getattr(executor, "name", values.get("backend", RunSpec.backend))
    try:
        run_uri = join_uri(normalize_uri(store or DEFAULT_STORE), run_id)
    except (TypeError, ValueError, OSError) as e:  # not a string; no working directory
        raise LaunchError(f"--store {store!r} is not a usable URI or path: {e}") from None
    try:
        spec = RunSpec(run_id=run_id, run_uri=run_uri, **values)
        if _is_count(spec.replicas):  # the machine's limit says more than N's range
            _check_replica_limit(executor, spec.replicas)
        spec.validate()
    except SpecError as e:
        raise LaunchError(str(e)) from None
    except TypeError as e:  # e.g. outer_lr="fast" from Python: comparisons fail
        raise LaunchError(f"a run option has the wrong type: {e}") from None
    try:
        executor.check_ready(run_uri)  # credentials, hardware names, store reachable from it
    except ExecutorError as e:
        raise LaunchError(str(e)) from None
    spec.job_config = _validate_job(spec.job, job_options)
    command = _command(entrypoint)
    spec.entrypoint = command
    try:
        executor.check_command(command)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None
    # The store last: the writability probe is the only check with a side effect.
    run_store = _run_folder(run_uri, run_id, dry_run)
    return Plan(spec, run_store, executor, command, restart=policy)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _command(entrypoint: str | Sequence[str] | None) -> list[str] | None:
    """The replica command of ``--entrypoint`` (a shell-quoted string or a list)."""
    if entrypoint is None:
        return None
    try:
        return shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    except ValueError as e:
        raise LaunchError(f"--entrypoint {entrypoint!r} cannot be parsed: {e}") from None


def _run_folder(run_uri: str, run_id: str, dry_run: bool) -> RunStore:
    """The new run's folder, checked: it holds no run, and (unless ``dry_run``, which writes
    nothing) it is writable and empty."""
    from crf.store import RunStore, StoreError

    try:
        probe = RunStore(run_uri, retries=0)
        if probe.exists(RUN_SPEC):
            raise LaunchError(
                f"run folder {display_path(probe)} already holds a run (run.json exists); "
                f"choose another --run-id, or continue it with --resume {run_id}"
            )
        if dry_run:
            return probe
        probe.check_writable()
        leftovers = [n for n in probe.list() if not n.startswith(".crf-probe-")]
        if leftovers:
            raise LaunchError(
                f"run folder {display_path(probe)} is not empty ({', '.join(leftovers[:5])}); "
                "choose another --run-id or another --store"
            )
        return RunStore(run_uri)
    except LaunchError:
        raise
    except StoreError as e:
        raise LaunchError(f"{e} (check --store)") from None
    except Exception as e:  # noqa: BLE001 - any other client error: one line, not a traceback
        raise LaunchError(
            f"cannot use store {run_uri}: {type(e).__name__}: {e} (check --store)"
        ) from None


# ---------------------------------------------------------------------- resume
def _live_replicas(
    store: RunStore, replicas: int, run_id: str, now: float | None = None
) -> list[str]:
    """Replicas of a run that may still be running, each as a short description.

    Two sets of replicas for one rank would both publish contributions under that rank, so a
    resume must not start while the old ones live. On this host the heartbeat's pid says it
    for sure (while held by the replica: same start time, run id and rank - pids get reused);
    for another host a recent heartbeat is all we have.
    """
    now = time.time() if now is None else now
    host = socket.gethostname()
    live = []
    for rank in range(replicas):
        hb = _read_heartbeat(store, rank)
        if not hb or hb.get("phase") in ("done", "failed"):
            continue
        pid, updated = hb.get("pid"), hb.get("updated_at")
        age = now - updated if isinstance(updated, int | float) else None
        if hb.get("host") == host and isinstance(pid, int):
            started = hb.get("pid_started_at")
            started = started if isinstance(started, str | int | float) else None
            if is_replica_process(pid, run_id=run_id, rank=rank, started_at=started):
                live.append(f"replica {rank} (pid {pid} on this host)")
        elif age is not None and age < LIVE_HEARTBEAT_S:
            live.append(f"replica {rank} (on {hb.get('host')}, heartbeat {age:.0f}s ago)")
    return live


def _launch_numbers(store: RunStore) -> list[int]:
    return sorted(
        int(n.removesuffix(".json"))
        for n in store.list("launches")
        if n.removesuffix(".json").isdigit()
    )


def prepare_resume(
    run_id: str,
    *,
    store: str | None = None,
    backend: str | None = None,
    executor: ServerlessExecutor | None = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    max_run_restarts: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
) -> Plan:
    """Validate that run ``run_id`` in ``store`` can be continued; LaunchError otherwise.

    The run keeps everything in its ``run.json`` (job, N, H, rounds, deadlines...), which is
    read and never rewritten. Refused: a run folder without ``run.json``, a run that already
    finished ok, a run whose replicas may still be running, and another backend than the one
    the run was launched on.
    """
    from crf.store import RunStore, StoreError, join_uri, normalize_uri

    policy = RestartPolicy(max_restarts, max_run_restarts).validate()
    try:
        check_run_id(run_id, "--resume run id")  # one folder in --store, never a path out
    except SpecError as e:
        raise LaunchError(str(e)) from None
    try:
        run_uri = join_uri(normalize_uri(store or DEFAULT_STORE), run_id)
        run_store = RunStore(run_uri, retries=0)
        where = display_path(run_store)
        if not run_store.exists("run.json"):
            raise LaunchError(
                f"nothing to resume at {where}: it holds no run.json (check --store and the run id)"
            )
        spec = read_run_spec(run_store)
        previous = None
        if run_store.exists("result.json"):
            try:
                previous = run_store.get_json("result.json").get("status")
            except (ValueError, AttributeError):
                previous = None
        live = _live_replicas(run_store, spec.replicas, spec.run_id)
        launches = _launch_numbers(run_store)
        # a global round exists once its state landed: a kill during its write can leave
        # the folder (with the writer's temp file) and nothing else
        rounds = [
            int(n)
            for n in run_store.list("global")
            if n.isdigit() and run_store.exists(f"global/{n}/state.pt")
        ]
        inner = {
            k: {
                int(n.removesuffix(".pt"))
                for n in run_store.list(f"replicas/{k}/inner")
                if n.removesuffix(".pt").isdigit()
            }
            for k in range(spec.replicas)
        }
    except LaunchError:
        raise
    except StoreError as e:
        raise LaunchError(f"{e} (check --store)") from None
    except Exception as e:  # noqa: BLE001 - any other client error: one line, not a traceback
        raise LaunchError(
            f"cannot use store {run_uri}: {type(e).__name__}: {e} (check --store)"
        ) from None
    if previous == "ok":
        raise LaunchError(
            f"run {run_id} already finished (result.json says ok); there is nothing to resume"
        )
    if live:
        raise LaunchError(
            f"run {run_id} still has running replicas: {', '.join(live)}; stop them (or let "
            "them finish) before resuming, or two replicas would share one rank"
        )
    if backend is not None and backend != spec.backend:
        raise LaunchError(
            f"run {run_id} was launched on backend {spec.backend!r}; resume it there "
            f"(got --backend {backend})"
        )
    if executor is None:
        options = {**saved_backend_options(run_store), **(backend_options or {})}
        executor = make_executor(spec.backend, options)
    _check_replica_limit(executor, spec.replicas)
    try:
        executor.check_ready(run_uri)
        executor.check_command(spec.entrypoint)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None
    _validate_job(spec.job, spec.job_config)
    # replicas find the run where it is now, even if the folder was moved since launch
    spec.run_uri = run_store.uri
    start, superseded, fresh = resume_point(spec, rounds, inner)
    info = ResumeInfo(
        launch=(max(launches) + 1) if launches else 1,
        from_round=start,
        previous_status=previous,
        superseded=superseded,
        fresh_inner=fresh,
    )
    return Plan(spec, RunStore(run_uri), executor, spec.entrypoint, policy, info)


def resume_point(
    spec: RunSpec, rounds: list[int], inner: Mapping[int, set[int]]
) -> tuple[int | None, list[int], list[int]]:
    """Where a resume starts: (global round, newer global rounds to set aside, replicas
    without a saved inner state of that round). ``inner``: rank -> rounds it saved.

    A checkpoint is the global state of round r plus every replica's own inner-optimizer
    state of r, written by each replica in the background after the round committed. A run
    killed at any moment can hold ``global/<r>`` while a replica's ``inner/<r>`` never landed;
    resuming there would restart that replica's inner optimizer and the run would no longer
    be the run nobody killed. So the resume starts from the newest global round whose inner
    states all exist, and the newer ones (recomputed, bit for bit, by the resumed replicas)
    are set aside. If no kept round is complete (a replica was gone for a while, or the job
    has no inner optimizer), it starts from the newest and those replicas start afresh.
    """
    if not rounds:
        return None, [], []

    def missing(r: int) -> list[int]:
        return [k for k in range(spec.replicas) if r not in inner.get(k, set())]

    complete = [r for r in rounds if spec.saves_inner_state(r) and not missing(r)]
    start = max(complete) if complete else max(rounds)
    fresh = missing(start) if spec.saves_inner_state(start) else []
    return start, sorted(r for r in rounds if r > start), fresh


def read_run_spec(store: RunStore) -> RunSpec:
    """The run's ``run.json`` as a valid RunSpec. A damaged one (not UTF-8, not JSON, not an
    object, a field of the wrong type or out of range) is a LaunchError that names the file
    and what is wrong with it, for ``--resume``, ``crf status``, ``crf logs`` and
    ``crf cancel`` alike."""
    where = display_path(store, "run.json")
    raw = store.get("run.json")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise LaunchError(
            f"{where} is damaged: not UTF-8 text (bad byte at offset {e.start}); restore it "
            "from a copy, or remove the run folder"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LaunchError(
            f"{where} is damaged: not valid JSON ({e.msg} at line {e.lineno}, column "
            f"{e.colno}); restore it from a copy, or remove the run folder"
        ) from None
    if not isinstance(data, dict):
        raise LaunchError(
            f"{where} is damaged: it holds a JSON {type(data).__name__}, not the run's "
            "options (an object); restore it from a copy, or remove the run folder"
        )
    try:
        return RunSpec.from_dict(data).validate()
    except (SpecError, TypeError) as e:  # TypeError: a missing field, or one of a wrong type
        raise LaunchError(f"{where} is damaged: {e}") from None


def saved_backend_options(store: RunStore) -> dict[str, Any]:
    """The executor options a run was launched with (``backend.json``; empty if absent)."""
    try:
        data = store.get_json("backend.json")
    except Exception:
        return {}
    options = data.get("options") if isinstance(data, dict) else None
    return {k: v for k, v in (options or {}).items() if v is not None}


def _read_heartbeat(store: RunStore, rank: int) -> dict[str, Any] | None:
    try:
        data = store.get_json(f"replicas/{rank}/state.json")
    except Exception:  # not written yet, or the store hiccupped: keep the last one we had
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def _newline_after(console: Console, enabled: bool) -> Iterator[None]:
    """Off a terminal, Live prints its last frame without a final newline; add it."""
    try:
        yield
    finally:
        if enabled and not console.is_terminal:
            console.line()


class Supervisor:
    """Keeps a run's replicas going: relaunches failed ones within the restart policy and
    records every attempt that ended, so the summary can say what happened.

    ``handles`` always holds the current attempt of each rank (rank order). Before a rank is
    relaunched, what its failed attempt left (``results/<rank>.json``, its last heartbeat, its
    exit status) is moved to ``launches/<k>/attempts/<rank>-<attempt>.json``: the new process
    must not be judged by its predecessor's result, and the record must not be lost either.
    """

    def __init__(
        self,
        plan: Plan,
        handles: Sequence[ReplicaHandle],
        *,
        launch_no: int,
        console: Console | None = None,
    ) -> None:
        self.plan = plan
        self.handles = list(handles)
        self.launch_no = launch_no
        self.console = console
        self.restarts = {h.rank: 0 for h in handles}
        self.attempts: dict[int, list[dict[str, Any]]] = {h.rank: [] for h in handles}
        self.not_restarted: dict[int, str] = {}
        self.stopped = False  # set once the driver cancels the run: no more restarts

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def _why_not(self, rank: int, status: ReplicaStatus) -> str | None:
        policy = self.plan.restart
        if self.stopped:
            return "the run is being stopped"
        if status.exit_code in NO_RESTART_EXIT_CODES:
            return f"exit code {status.exit_code} {NO_RESTART_EXIT_CODES[status.exit_code]}"
        if self._reported_unrestartable(rank):
            return "it reported an error a restart cannot fix"
        if self.restarts[rank] >= policy.max_restarts:
            return f"it already restarted {self.restarts[rank]} time(s) (--max-restarts)"
        if policy.max_run_restarts is not None and self.total_restarts >= policy.max_run_restarts:
            return f"the run already restarted {self.total_restarts} time(s) (--max-run-restarts)"
        return None

    def _reported_unrestartable(self, rank: int) -> bool:
        """The failed attempt's result says a restart would hit the same error (a user's own
        entrypoint exits 1 for any error; ``crf.replica`` also exits 3)."""
        try:
            result = self.plan.store.get_json(f"results/{rank}.json")
        except Exception:  # no result (it died) or unreadable: the exit code decides
            return False
        return isinstance(result, dict) and result.get("restartable") is False

    def check(self, index: int, heartbeat: dict[str, Any] | None) -> ReplicaStatus:
        """The status of the replica at ``index``, relaunching it first if it failed and may
        restart (the returned status is then the new attempt's)."""
        executor = self.plan.executor
        handle = self.handles[index]
        status = executor.status(handle)
        if executor.native_restarts:  # the platform restarts it; we only count
            self.restarts[handle.rank] = max(self.restarts[handle.rank], status.restarts)
            return status
        if status.state is not ReplicaState.FAILED or handle.rank in self.not_restarted:
            return status
        reason = self._why_not(handle.rank, status)
        if reason is not None:
            self.not_restarted[handle.rank] = reason
            self._say(
                f"[red]replica {handle.rank} {escape(_what(status))}; not restarting it: "
                f"{escape(reason)}[/]"
            )
            return status
        if heartbeat and (heartbeat.get("updated_at") or 0) < handle.started_at - 1:
            heartbeat = None  # written by an earlier attempt: says nothing about this one
        self._record(handle, status, heartbeat)
        try:
            new = executor.relaunch(handle)
        except ExecutorError as e:
            self.not_restarted[handle.rank] = f"relaunch failed: {e}"
            self._say(f"[red]replica {handle.rank}: could not restart it: {escape(str(e))}[/]")
            return status
        self.restarts[handle.rank] += 1
        self.handles[index] = new
        save_handles(self.plan.store, self.launch_no, self.handles)
        where = f" in round {heartbeat.get('round')}" if heartbeat else ""
        self._say(
            f"[yellow]replica {handle.rank} {escape(_what(status))}{where}: restarted it "
            f"({self.restarts[handle.rank]}/{self.plan.restart.max_restarts}); it resumes "
            "from the newest global state[/]"
        )
        return executor.status(new)

    def _record(
        self, handle: ReplicaHandle, status: ReplicaStatus, heartbeat: dict[str, Any] | None
    ) -> None:
        store = self.plan.store
        attempt = int(handle.extra.get("attempt", 0))
        record: dict[str, Any] = {
            "rank": handle.rank,
            "launch": self.launch_no,
            "attempt": attempt,
            "backend_id": handle.backend_id,
            "state": str(status.state),
            "exit_code": status.exit_code,
            "message": status.message,
            "started_at": handle.started_at,
            "ended_at": time.time(),
            "phase": (heartbeat or {}).get("phase"),
            "round": (heartbeat or {}).get("round"),
            "step": (heartbeat or {}).get("step"),
            "result": None,
        }
        try:
            key = f"results/{handle.rank}.json"
            if store.exists(key):
                record["result"] = store.get_json(key)
            store.put_json(
                f"launches/{self.launch_no}/attempts/{handle.rank}-{attempt}.json", record
            )
            if record["result"] is not None:
                store.delete(key)
        except Exception as e:  # bookkeeping must never stop a restart
            record["record_error"] = f"{type(e).__name__}: {e}"
        slim = {k: v for k, v in record.items() if k != "result"}
        if isinstance(record["result"], dict):  # it failed cleanly and said why
            slim["error"] = record["result"].get("error")
            slim["rejected"] = record["result"].get("rejected") or []
        self.attempts[handle.rank].append(slim)

    def _say(self, message: str) -> None:
        """Tell the user at once (above the live table): a restart is news, not a summary."""
        if self.console is not None:
            self.console.print(message, highlight=False)


def save_handles(store: RunStore, launch_no: int, handles: Sequence[ReplicaHandle]) -> None:
    """Keep the current handles in the store (plain data, no secrets) so ``crf status``,
    ``crf logs`` and ``crf cancel`` can reattach from any process."""
    with contextlib.suppress(Exception):  # bookkeeping must never stop a run
        store.put_json(
            f"launches/{launch_no}/handles.json", {"handles": [h.to_dict() for h in handles]}
        )


def _what(status: ReplicaStatus) -> str:
    """'was killed by SIGKILL' / 'exited with code 1' for a failed replica."""
    if status.message.startswith("killed"):
        return f"was {status.message}"
    return status.message or f"failed (exit code {status.exit_code})"


def _watch(
    sup: Supervisor,
    *,
    console: Console,
    progress: bool,
    timeout_s: float | None,
    poll_s: float,
    started: float,
) -> bool:
    """Poll process status and heartbeats until every replica ended (relaunching failed ones
    through ``sup``); True if the run timed out and was cancelled."""
    from rich.live import Live

    from crf.launcher.progress import ReplicaView, render_progress

    plan = sup.plan
    spec, store, executor = plan.spec, plan.store, plan.executor
    beats: dict[int, dict[str, Any] | None] = {h.rank: None for h in sup.handles}

    def refresh() -> tuple[bool, Any]:
        views = []
        for i, h in enumerate(sup.handles):
            beats[h.rank] = _read_heartbeat(store, h.rank) or beats[h.rank]
            st = sup.check(i, beats[h.rank])
            views.append(ReplicaView(h.rank, st, beats[h.rank], sup.restarts[h.rank]))
        table = render_progress(
            views,
            run_id=spec.run_id,
            rounds=spec.rounds,
            sync_every=spec.sync_every,
            elapsed_s=time.time() - started,
        )
        return all(v.status.terminal for v in views), table

    live = Live(console=console, refresh_per_second=4, transient=False) if progress else None
    with _newline_after(console, live is not None), live or contextlib.nullcontext():
        while True:
            done, table = refresh()
            if live is not None:
                live.update(table, refresh=True)
            if done:
                return False
            if timeout_s is not None and time.time() - started > timeout_s:
                sup.stopped = True
                executor.cancel_all(sup.handles)
                if live is not None:
                    live.update(refresh()[1], refresh=True)
                return True
            time.sleep(poll_s)


def _log_tail(executor: ServerlessExecutor, handle: ReplicaHandle) -> list[str]:
    try:
        return list(deque(executor.logs(handle), maxlen=LOG_TAIL_LINES))
    except Exception:  # logs are a courtesy; never let them hide the real result
        return []


def backend_config(plan: Plan) -> dict[str, Any]:
    """The executor's non-secret options, for rebuilding it in another process."""
    try:
        return dict(plan.executor.config())
    except Exception:
        return {}


def _start_launch(plan: Plan, started: float) -> int:
    """Claim this driver launch in the store; return its number.

    A first launch creates ``run.json`` (create-if-absent: two drivers racing for one run id
    cannot both win). A resume leaves ``run.json`` alone, claims ``launches/<k>.json`` with
    create-if-absent (two drivers resuming at once cannot both win either), and keeps the
    previous ``result.json`` and ``results/<rank>.json`` under ``launches/<k>/previous/``
    before its replicas write new ones.
    """
    from crf.store import ObjectNotFound

    spec, store = plan.spec, plan.store
    record = {
        "launch": 0,
        "started_at": started,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "backend": spec.backend,
        "restart_policy": plan.restart.to_dict(),
        "resumed_from_round": None,
    }
    if plan.resume is None:
        if not store.put_if_absent("run.json", spec.to_json().encode()):
            raise LaunchError(
                f"run folder {display_path(store)} already holds a run (run.json exists); "
                f"choose another --run-id, or continue it with --resume {spec.run_id}"
            )
        store.put_json_if_absent("launches/0.json", record)
        store.put_json("backend.json", {"backend": spec.backend, "options": backend_config(plan)})
        return 0
    k = plan.resume.launch
    record.update(launch=k, resumed_from_round=plan.resume.from_round)
    if plan.resume.superseded:
        record["superseded_globals"] = plan.resume.superseded
    if not store.put_json_if_absent(f"launches/{k}.json", record):
        raise LaunchError(
            f"another driver is resuming run {spec.run_id} right now (launches/{k}.json "
            "exists); let it run, or wait for it to stop"
        )
    keep = [("result.json", f"launches/{k}/previous/result.json")]
    keep += [
        (f"results/{r}.json", f"launches/{k}/previous/results/{r}.json")
        for r in range(spec.replicas)
    ]
    for src, dst in keep:
        with contextlib.suppress(Exception):  # missing is normal; nothing here may block
            data = store.get(src)
            store.put(dst, data)
            if src != "result.json":
                store.delete(src)
    # no replica of the run is alive (checked before): exchange rounds after the newest
    # global state belong to the stopped launch, and the replicas will run them again from
    # that state; so would heal requests. Left in place, a resumed round could read its old
    # quorum and averages (with checkpoint_every > 1 there are up to that many such rounds).
    top = plan.resume.from_round
    for g in plan.resume.superseded:  # kept, not lost: the replicas write global/<g> again
        src, dst = f"global/{g}/state.pt", f"launches/{k}/superseded/global/{g}/state.pt"
        with contextlib.suppress(ObjectNotFound):
            store.put(dst, store.get(src))
            store.delete(f"global/{g}")
    with contextlib.suppress(Exception):
        for name in store.list("rounds"):
            if name.isdigit() and (top is None or int(name) > top):
                store.delete(f"rounds/{name}")
        store.delete("heal")
    return k


def run(
    plan: Plan,
    *,
    env: Mapping[str, str] | None = None,
    progress: bool = True,
    report: bool = True,
    console: Console | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    plot: bool = True,
    detach: bool = False,
) -> dict[str, Any]:
    """Write run.json (or claim a resume), start the replicas, watch them (restarting failed
    ones), write result.json; return the summary.

    With ``detach`` it returns right after the launch, with ``status == "detached"``: the
    replicas go on by themselves, and ``crf status RUN`` gathers the summary once they end
    (restarts are then only those the platform does itself).
    """
    from rich.console import Console

    from crf.launcher.summary import build_summary

    if timeout_s is not None:
        try:
            check_seconds("--timeout", timeout_s)
        except SpecError as e:
            raise LaunchError(str(e)) from None
    console = console or Console()
    spec, store, executor = plan.spec, plan.store, plan.executor
    started = time.time()
    from crf.store import StoreError

    try:
        launch_no = _start_launch(plan, started)
    except (OSError, StoreError) as e:  # after the store's own retries
        raise LaunchError(f"cannot write to the run folder {display_path(store)}: {e}") from None
    if report:
        console.print(
            f"[bold]crf[/] run [bold]{spec.run_id}[/]: {spec.replicas} replica(s) of job "
            f"{spec.job!r} on {spec.backend}, {spec.rounds} round(s) x {spec.sync_every} steps"
        )
        if plan.resume is not None:
            r = plan.resume.from_round
            where = f"round {r + 1} (global/{r})" if r is not None else "the start"
            console.print(f"resuming (launch {launch_no}): replicas continue from {where}")
            if plan.resume.superseded:
                names = ", ".join(f"global/{g}" for g in plan.resume.superseded)
                console.print(
                    f"set aside {names} (a replica's inner state of it never landed; kept "
                    f"under launches/{launch_no}/superseded/): its rounds are computed again"
                )
            if plan.resume.fresh_inner:
                ranks = ", ".join(str(k) for k in plan.resume.fresh_inner)
                console.print(
                    f"[yellow]replica(s) {ranks} have no saved inner-optimizer state of "
                    f"global/{r}: they start it afresh (the run will not be bit-identical)[/]"
                )
        console.print(f"run folder: {display_path(store)}", soft_wrap=True, highlight=False)
    extra = {"launch": launch_no, "restart_policy": plan.restart.to_dict()}
    if plan.resume is not None:
        extra["resumed_from_round"] = plan.resume.from_round
    try:
        handles = executor.launch_replicas(
            spec.replicas,
            plan.command,
            (),
            env,
            run_uri=spec.run_uri,
            run_id=spec.run_id,
            max_restarts=plan.restart.max_restarts,
        )
    except ExecutorError as e:
        failed = build_summary(spec=spec, results=[], started_at=started, error=str(e), **extra)
        store.put_json("result.json", failed)
        raise LaunchError(f"could not start the replicas: {e}") from None

    save_handles(store, launch_no, handles)
    if detach:
        if report:
            base = spec.run_uri.rstrip("/").rsplit("/", 1)[0]
            where = f" --store {base}"
            console.print(
                f"detached: {spec.replicas} replica(s) started. Follow with "
                f"[bold]crf status {spec.run_id}{where}[/] or "
                f"[bold]crf logs {spec.run_id}{where} --follow[/]; "
                f"stop with [bold]crf cancel {spec.run_id}{where}[/]",
                highlight=False,
                soft_wrap=True,
            )
        return {
            "status": "detached",
            "run_id": spec.run_id,
            "run_uri": spec.run_uri,
            "launch": launch_no,
            "handles": [h.to_dict() for h in handles],
        }
    sup = Supervisor(plan, handles, launch_no=launch_no, console=console if report else None)
    error: str | None = None
    cancelled = False
    try:
        timed_out = _watch(
            sup,
            console=console,
            progress=progress,
            timeout_s=timeout_s,
            poll_s=poll_s,
            started=started,
        )
        if timed_out:
            error = f"the run did not finish within {timeout_s}s; its replicas were cancelled"
    except KeyboardInterrupt:
        cancelled = True
        sup.stopped = True
        console.print("[yellow]interrupted: cancelling the replicas...[/]")
        executor.cancel_all(sup.handles)

    return finish_run(
        plan.spec,
        store,
        executor,
        sup.handles,
        launch_no=launch_no,
        started=started,
        cancelled=cancelled,
        error=error,
        attempts=sup.attempts,
        restarts=sup.restarts,
        not_restarted=sup.not_restarted,
        extra=extra,
        report=report,
        console=console,
        plot=plot,
    )


def _one_line(e: BaseException) -> str:
    """A store error as one line: StoreErrors already say what to fix; others get their type."""
    from crf.store import StoreError

    text = str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def finish_run(
    spec: RunSpec,
    store: RunStore,
    executor: ServerlessExecutor,
    handles: Sequence[ReplicaHandle],
    *,
    launch_no: int,
    started: float,
    cancelled: bool = False,
    error: str | None = None,
    attempts: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    restarts: Mapping[int, int] | None = None,
    not_restarted: Mapping[int, str] | None = None,
    extra: Mapping[str, Any] | None = None,
    report: bool = True,
    console: Console | None = None,
    plot: bool = True,
) -> dict[str, Any]:
    """Gather ended replicas into the summary: ``result.json``, the loss plot, the launch
    record, and the rendered table. Used by the watching driver and by ``crf status`` for a
    detached run whose replicas have all ended."""
    from rich.console import Console

    from crf.launcher.summary import build_summary, plot_losses, read_metrics, render_summary

    console = console or Console()
    extra = dict(extra or {})
    results = executor.collect(handles, timeout=60)
    tails = {
        r.rank: _log_tail(executor, r.handle)
        for r in results
        if not r.ok and r.state is not ReplicaState.CANCELLED
    }
    try:
        metrics = read_metrics(store, spec.replicas)
    except Exception:  # a summary without per-round detail beats no summary
        metrics = {}
    summary = build_summary(
        spec=spec,
        results=results,
        started_at=started,
        cancelled=cancelled,
        error=error,
        log_tails=tails,
        attempts=attempts,
        restarts=restarts,
        not_restarted=not_restarted,
        metrics=metrics,
        **extra,
    )
    plot_path = None
    if plot:
        try:
            png = plot_losses(metrics, title=f"crf run {spec.run_id}")
        except Exception as e:  # a plot must never turn a good run into a crash
            png = None
            console.print(f"[yellow]could not draw the loss plot: {type(e).__name__}: {e}[/]")
        if png is not None:
            try:
                store.put("loss.png", png)
                plot_path = display_path(store, "loss.png")
            except Exception as e:  # the store went away (bucket deleted...): said below
                console.print(f"[yellow]could not save the loss plot: {_one_line(e)}[/]")
    summary["loss_plot"] = plot_path
    summary["result_path"] = display_path(store, "result.json")
    try:
        store.put_json("result.json", summary)
    except Exception as e:  # noqa: BLE001 - the summary is still shown; the cause in one line
        # A store that disappeared mid-run (bucket deleted, credentials revoked) fails the
        # replicas too; the user gets the summary and one line saying why it was not saved.
        summary["result_path"] = None
        why = f"result.json could not be written to {display_path(store)}: {_one_line(e)}"
        summary["error"] = f"{summary['error']}; {why}" if summary.get("error") else why
    with contextlib.suppress(Exception):  # the launch record is history, not the result
        record = store.get_json(f"launches/{launch_no}.json")
        record.update(
            ended_at=summary["ended_at"],
            status=summary["status"],
            restarts=summary["restarts"],
            error=summary["error"],
        )
        store.put_json(f"launches/{launch_no}.json", record)
    if report:
        render_summary(summary, console, result_path=summary["result_path"], plot_path=plot_path)
    return summary


def launch(
    options: Mapping[str, Any] | RunSpec | None = None,
    *,
    store: str | None = None,
    executor: ServerlessExecutor | None = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    **watch: Any,
) -> dict[str, Any]:
    """Run N replicas to the end and return the summary that was written to result.json.

    ``options`` are the run options, by RunSpec field name (``{"job": "lm", "replicas": 4,
    "sync_every": 20, "job_config": {...}}``; see :func:`prepare`), or a RunSpec. ``watch``
    goes to :func:`run`: ``env`` adds variables to every replica (credentials go there,
    never in ``entrypoint``), ``progress``, ``report``, ``plot``, ``timeout_s``, ``poll_s``,
    ``console``, ``detach``. A replica that fails is started again as ``restart`` allows
    (default: RestartPolicy()). Raises LaunchError for bad input, before launching; a run
    that starts and fails returns a summary with ``status == "failed"``.
    """
    _no_run_options_in(watch)
    plan = prepare(
        options, store=store, executor=executor, backend_options=backend_options, restart=restart
    )
    return run(plan, **watch)


def _no_run_options_in(watch: Mapping[str, Any]) -> None:
    """LaunchError for a run option passed as a keyword (``launch(replicas=4)``): it belongs
    in the options mapping."""
    misplaced = sorted(set(watch) & set(run_options()))
    if misplaced:
        example = ", ".join(f"{name!r}: ..." for name in misplaced)
        raise LaunchError(
            f"run options go in the first argument, launch({{{example}}}), not as keywords "
            f"({', '.join(misplaced)})"
        )


def resume(
    run_id: str,
    *,
    store: str | None = None,
    backend: str | None = None,
    executor: ServerlessExecutor | None = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    **watch: Any,
) -> dict[str, Any]:
    """Continue run ``run_id`` whose driver and replicas stopped: start all N replicas again;
    each resumes from the newest committed ``global/<r>`` with its own inner-optimizer state
    and data position, so no committed round is lost and none is trained twice. (If a
    replica's inner state of that round never landed, the newest round saved whole is used
    instead and the newer global states are set aside: see :func:`resume_point`.) ``watch``
    goes to :func:`run`, as for :func:`launch`. Returns the summary written to result.json
    (``launch`` says which driver launch this was)."""
    policy = restart or RestartPolicy()
    plan = prepare_resume(
        run_id,
        store=store,
        backend=backend,
        executor=executor,
        max_restarts=policy.max_restarts,
        max_run_restarts=policy.max_run_restarts,
        backend_options=backend_options,
    )
    return run(plan, **watch)
