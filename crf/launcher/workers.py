"""The launcher's side of rollout workers: their hardware, their start, their supervision.

A run with ``--rollout-workers M`` has two roles (docs/rollout-workers.md): N trainer
replicas and M rollout workers. Workers run on the same backend, with the same image, code,
``--workdir``, ``--pip`` and secrets as the replicas, on hardware of their own: every backend
option may be given again for the workers as ``rollout_<option>`` (``rollout_gpu``,
``rollout_flavor``, ``rollout_instance_type``, or ``rollout_hardware`` for whichever the
backend names its hardware; ``--rollout-hardware`` on the command line), and the workers'
executor is the backend's executor built with those options over the replicas' ones.

A worker never decides a run: the trainers generate locally when no worker batch comes in
time, so a worker that dies is started again while the restart policy allows (like a
replica) and otherwise left dead; the run's status is its trainers'. Once every trainer has
ended, the workers still running are cancelled.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crf import layout
from crf.executors.base import (
    ExecutorError,
    ReplicaHandle,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
)
from crf.launcher.errors import LaunchError

if TYPE_CHECKING:
    from rich.console import Console

    from crf.executors.base import BackendPlan
    from crf.spec import RunSpec
    from crf.store import RunStore

#: a worker's exit code when its environment breaks the contract (``python -m crf.replica``
#: says so with 2): starting it again cannot help
CONTRACT_EXIT = 2
#: a worker's exit code when it failed with an error a restart would raise again (its own
#: input: a model folder, a dataset it cannot read; crf.rollouts.worker), as a replica's
UNRECOVERABLE_EXIT = 3
#: why a worker that was running reads as cancelled: its trainers were done, or the run
#: itself was cancelled (crf cancel, Ctrl-C)
TRAINERS_ENDED = "cancelled: its trainers had ended"
RUN_CANCELLED = "cancelled with the run"
#: a backend option given for the workers only: ``rollout_<option>``
PREFIX = "rollout_"
#: the workers' hardware under the generic names (as --hardware, --gpu, --flavor, ...)
HARDWARE_KEYS = tuple(
    f"{PREFIX}{k}" for k in ("hardware", "gpu", "flavor", "instance_type")
)  # fmt: skip


def rollout_key(backend_cls: type[ServerlessExecutor], key: str) -> str | None:
    """``rollout_<option>`` as the backend's own option for the workers (``rollout_gpu``
    on Modal for ``rollout_hardware``), or None where ``key`` is no rollout option."""
    key = key.replace("-", "_")
    if not key.startswith(PREFIX):
        return None
    if key in HARDWARE_KEYS:
        hardware = getattr(backend_cls, "hardware_option", None)
        return f"{PREFIX}{hardware}" if hardware else key
    return key


def split_options(
    backend: str, options: Mapping[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The backend options as (the replicas', the workers' overrides): ``rollout_<option>``
    keys go to the workers (without the prefix); LaunchError for one the backend lacks."""
    from crf.executors.registry import executor_class, option_names

    trainer: dict[str, Any] = {}
    rollout: dict[str, Any] = {}
    for key, value in (options or {}).items():
        name = str(key).replace("-", "_")
        if not name.startswith(PREFIX):
            trainer[key] = value
            continue
        try:
            cls = executor_class(backend)
        except ExecutorError as e:
            raise LaunchError(str(e)) from None
        own = (rollout_key(cls, name) or name).removeprefix(PREFIX)
        known = option_names(cls)
        if own not in known:
            flag = "--rollout-hardware" if name in HARDWARE_KEYS else name
            raise LaunchError(
                f"the {backend} backend has no {flag} option for rollout workers (its "
                f"options, each also as rollout_<option>: {', '.join(known) or 'none'})"
            )
        rollout[own] = value
    return trainer, rollout


@dataclass
class WorkerPlan:
    """How a run's rollout workers start: how many, for how many trainers, and the
    executor built for their hardware (the replicas' own where nothing differs)."""

    workers: int
    trainers: int
    executor: ServerlessExecutor
    #: the backend options given for the workers only (rollout_<option>, unprefixed)
    overrides: dict[str, Any] = field(default_factory=dict)
    #: the workers' command; None: the replicas' (``python -m crf.replica``, which runs the
    #: worker loop under ``CRF_ROLE=rollout``)
    command: list[str] | None = None

    def describe(self, command: Sequence[str] | None, run_uri: str) -> BackendPlan:
        return self.executor.describe(self.workers, command, run_uri)


def check_rollout_options(spec: RunSpec) -> None:
    """LaunchError for rollout-worker settings that would do nothing, checked at launch (a
    stored run.json is not judged by it): a worker option changed from its default without
    ``--rollout-workers`` (the run would start no worker and ignore it), or fewer workers
    than replicas (a replica without a worker generates its own rollouts, and every round
    waits for that slowest trainer, so the workers would buy no time)."""
    from crf.spec import ROLLOUT, run_options

    if not spec.rollout_workers:
        given = [
            f"{opt.flag} {getattr(spec, name)}"
            for name, opt in run_options().items()
            if opt.group == ROLLOUT
            and name != "rollout_workers"
            and getattr(spec, name) != opt.default
        ]
        if given:
            raise LaunchError(
                f"{', '.join(map(str, given))} configure{'s' if len(given) == 1 else ''} "
                "rollout workers: add --rollout-workers M, or leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        return
    if spec.rollout_workers < spec.replicas:
        idle = spec.replicas - spec.rollout_workers
        raise LaunchError(
            f"--rollout-workers {spec.rollout_workers} leaves {idle} of the {spec.replicas} "
            "replicas without a worker (worker w serves replica w % N), and every round waits "
            f"for those: use at least {spec.replicas} workers (a multiple of --replicas splits "
            "them evenly), or drop --rollout-workers"
        )


def check_worker_hardware(spec: RunSpec, overrides: Mapping[str, Any]) -> None:
    """LaunchError for the workers' own backend options (``rollout_<option>``, unprefixed in
    ``overrides``) given without ``--rollout-workers``: the run would start no worker."""
    if overrides and not spec.rollout_workers:
        names = ", ".join(f"{PREFIX}{k}" for k in overrides)
        raise LaunchError(
            f"{names} (--rollout-hardware and the other rollout_<option> backend options) "
            "configure rollout workers: add --rollout-workers M, or leave them out"
        )


def plan_workers(
    spec: RunSpec,
    executor: ServerlessExecutor,
    backend_options: Mapping[str, Any] | None,
    overrides: Mapping[str, Any],
) -> WorkerPlan | None:
    """The workers of a checked spec (None without ``--rollout-workers``); LaunchError for
    worker hardware given without workers, or a worker option the backend refuses."""
    from crf.executors.registry import make_executor

    if not spec.rollout_workers:
        check_worker_hardware(spec, overrides)
        return None
    if not executor.starts_workers():
        raise LaunchError(
            f"--rollout-workers {spec.rollout_workers}: the {executor.name} backend cannot "
            "start rollout workers (its launch_replicas takes no workers=): drop "
            "--rollout-workers, or use a built-in backend"
        )
    if spec.procs_per_replica not in (None, 1):
        raise LaunchError(
            f"--rollout-workers {spec.rollout_workers} needs --procs-per-replica 1 (each "
            f"replica's hardware has {spec.procs_per_replica} GPUs, which would start that "
            "many trainer processes): pass --procs-per-replica 1"
        )
    check_machine_limit(spec, executor)
    worker_executor = executor
    if overrides:
        try:
            worker_executor = make_executor(spec.backend, {**(backend_options or {}), **overrides})
        except ExecutorError as e:
            raise LaunchError(f"rollout workers: {e}") from None
    return WorkerPlan(spec.rollout_workers, spec.replicas, worker_executor, dict(overrides))


def idle_worker_gpus(plan: WorkerPlan | None) -> list[str]:
    """The plan's warning when each worker's hardware has more than one GPU: a worker
    generates in one process on one GPU, so the others are paid for and sit idle."""
    gpus = plan.executor.gpus_per_replica() if plan is not None else 0
    if gpus <= 1:
        return []
    return [
        f"each rollout worker has {gpus} GPUs but generates on one, {gpus - 1} idle: choose "
        "worker hardware with one GPU (--rollout-hardware)"
    ]


def check_machine_limit(spec: RunSpec, executor: ServerlessExecutor) -> None:
    """LaunchError when the replicas and workers together are more processes than the
    backend can run at once (the local backend: this machine's memory, where each worker
    holds the model as a replica does); a cloud backend's quotas answer at launch."""
    limit_of = getattr(executor, "replica_limit", None)
    found = limit_of() if callable(limit_of) else None
    total = spec.replicas + spec.rollout_workers
    if found is None or total <= found[0]:
        return
    limit, why = found
    raise LaunchError(
        f"--replicas {spec.replicas} and --rollout-workers {spec.rollout_workers} are {total} "
        f"processes, more than the {executor.name} backend can run: at most {limit} ({why}, "
        "and a worker holds the model as a replica does); lower them or use a cloud backend"
    )


def saved_rollout_options(run_uri: str) -> dict[str, Any]:
    """The workers' own backend options a run was launched with (``backend.json``)."""
    from crf.store import RunStore

    try:
        data = RunStore(run_uri).get_json(layout.BACKEND)
    except Exception:  # noqa: BLE001 - absent (no workers, an older run) or damaged: none
        return {}
    found = data.get("rollout_options") if isinstance(data, dict) else None
    return dict(found) if isinstance(found, dict) else {}


def start_workers(
    plan: WorkerPlan,
    spec: RunSpec,
    command: Sequence[str] | None,
    env: Mapping[str, str],
) -> list[ReplicaHandle]:
    """Start the M workers (after the replicas); ExecutorError says why they could not."""
    command = plan.command or command
    return plan.executor.launch_workers(
        plan.workers,
        plan.trainers,
        list(command) if command else None,
        env,
        run_uri=spec.run_uri,
        run_id=spec.run_id,
        plain_env=spec.env,
    )


def save_worker_handles(store: RunStore, launch_no: int, handles: Sequence[ReplicaHandle]) -> None:
    """Keep the workers' current handles in the store, as the replicas' (no secrets)."""
    with contextlib.suppress(Exception):  # bookkeeping must never stop a run
        data = {"handles": [h.to_dict() for h in handles]}
        store.put_json(layout.worker_handles_key(launch_no), data)


def read_worker_state(
    store: RunStore, worker: int, *, final: bool = False
) -> layout.WorkerState | None:
    """Worker ``worker``'s heartbeat (or, ``final``, its result), or None if there is none."""
    key = layout.worker_result_key(worker) if final else layout.worker_state_key(worker)
    try:
        data = store.get_json(key)
    except Exception:  # noqa: BLE001 - absent, torn or any client error: a worker is optional
        return None
    return layout.WorkerState.from_dict(data) if isinstance(data, dict) else None


def worker_states(store: RunStore, workers: int) -> dict[int, layout.WorkerState]:
    """Each worker's newest record: its result where it wrote one, else its heartbeat."""
    out = {}
    for w in range(workers):
        state = read_worker_state(store, w, final=True) or read_worker_state(store, w)
        if state is not None:
            out[w] = state
    return out


class WorkerPool:
    """The run's rollout workers while its trainers train: restarts a dead one within the
    restart policy (``--max-restarts`` per worker), never fails the run, and cancels them
    all once the trainers are done."""

    def __init__(
        self,
        plan: WorkerPlan,
        handles: Sequence[ReplicaHandle],
        *,
        store: RunStore,
        launch_no: int,
        max_restarts: int,
        console: Console | None = None,
    ) -> None:
        self.plan = plan
        self.handles = list(handles)
        self.store = store
        self.launch_no = launch_no
        self.max_restarts = max_restarts
        self.console = console
        self.restarts = {h.rank: 0 for h in handles}
        self.not_restarted: dict[int, str] = {}
        self.stopped = False
        #: ``crf cancel`` asked this launch to stop (``launches/<k>/cancel.json``), or the
        #: driver was interrupted: the workers end with the run, not by a death
        self.cancelled = False
        #: the workers whose process ran at the latest poll before a cancel
        self.alive: set[int] = {h.rank for h in handles}

    @property
    def executor(self) -> ServerlessExecutor:
        return self.plan.executor

    def poll(self) -> list[ReplicaStatus]:
        """Each worker's status, relaunching a failed one first while the policy allows."""
        out = []
        for i, handle in enumerate(self.handles):
            try:
                status = self.executor.status(handle)
            except Exception as e:  # noqa: BLE001 - a worker's status never stops the run
                out.append(ReplicaStatus(ReplicaState.PENDING, None, f"status unknown: {e}"))
                continue
            if status.state is ReplicaState.FAILED and not self.stopped:
                status = self._restart(i, handle, status)
            out.append(status)
        if not self.cancelled:  # else the workers the cancel found running stay alive
            ended = {h.rank for h, st in zip(self.handles, out, strict=True) if st.state.terminal}
            self.alive = {h.rank for h in self.handles} - ended
        return out

    def _restart(self, index: int, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaStatus:
        w = handle.rank
        if w in self.not_restarted:
            return status
        if self._cancel_requested():  # crf cancel stopped it, elsewhere: not a death
            self.cancelled = self.stopped = True
            return status
        why = self._no_restart(w, status)
        if why is not None:
            self.not_restarted[w] = why
            self._say(
                f"rollout worker {w} {status.message or 'failed'}; not restarting it "
                f"({why}): its trainer generates for itself"
            )
            self._mark_failed(w, status)
            return status
        said = self._error_of(w, handle)  # its next attempt's result will replace it
        try:
            new = self.executor.relaunch(handle)
        except ExecutorError as e:
            self.not_restarted[w] = f"relaunch failed: {e}"
            self._say(f"rollout worker {w}: could not restart it: {e}")
            self._mark_failed(w, status)
            return status
        new.extra["role"] = layout.ROLE_ROLLOUT
        self._mark(w, "starting")  # its trainer, past its first batches, stops waiting at once
        self.restarts[w] += 1
        self.handles[index] = new
        save_worker_handles(self.store, self.launch_no, self.handles)
        self._say(
            f"rollout worker {w} {status.message or 'failed'}{said}: restarted it "
            f"({self.restarts[w]}/{self.max_restarts})"
        )
        return self.executor.status(new)

    def _error_of(self, w: int, handle: ReplicaHandle) -> str:
        """`` (the error)`` worker w's ended attempt recorded in its result, or ``""`` (a
        death records none; an earlier attempt's result says nothing of this one)."""
        record = read_worker_state(self.store, w, final=True)
        if record is None or not record.error or record.updated_at < handle.started_at - 1:
            return ""
        return f" ({record.error.strip().splitlines()[0]})"

    def _no_restart(self, w: int, status: ReplicaStatus) -> str | None:
        """Why worker w, which failed, is not started again (None: it is): an exit that says
        a restart would fail the same way (with the error it recorded), or the policy."""
        if status.exit_code == CONTRACT_EXIT:
            return f"exit code {CONTRACT_EXIT}: its environment breaks the worker contract"
        if status.exit_code == UNRECOVERABLE_EXIT:
            record = read_worker_state(self.store, w, final=True)
            error = record.error if record is not None and record.error else "see its log"
            return f"a restart would fail the same way: {error}"
        if self.restarts[w] >= self.max_restarts:
            return (
                f"--max-restarts {self.max_restarts}: it already restarted "
                f"{self.restarts[w]} time(s)"
            )
        return None

    def _cancel_requested(self) -> bool:
        """Whether ``crf cancel`` (from any process) asked this launch to stop: it stops the
        workers too, and to this executor a worker it stopped looks like a dead one."""
        try:
            return self.store.exists(layout.cancel_key(self.launch_no))
        except Exception:  # noqa: BLE001 - unreadable: judge the worker as a death
            return False

    def _mark_failed(self, w: int, status: ReplicaStatus) -> None:
        """Say in worker w's heartbeat that it is gone for good (phase ``failed``, its
        counts kept): its trainer then stops waiting for its batches at once, instead of
        waiting ``--rollout-wait`` per step until the heartbeat has been silent for 30 s."""
        self._mark(w, "failed", f"{status.message or 'failed'}; not restarted")

    def _mark(self, w: int, phase: str, error: str | None = None) -> None:
        """Worker w's heartbeat says ``phase`` now (its counts kept): ``failed`` for one not
        restarted, ``starting`` for one restarted (crf.rollouts.source: a trainer past its
        first batches does not wait for a worker still building its model)."""
        state = read_worker_state(self.store, w) or layout.WorkerState(
            worker=w, serves=w % max(1, self.plan.trainers)
        )
        state.phase, state.error = phase, error
        state.updated_at = time.time()
        with contextlib.suppress(Exception):  # bookkeeping must never stop a run
            self.store.put_json(layout.worker_state_key(w), state.to_dict())

    def stop(self, *, cancelled: bool = False) -> None:
        """The trainers are done (or, ``cancelled``, the run was): cancel the workers still
        running."""
        self.stopped = True
        self.cancelled = self.cancelled or cancelled
        with contextlib.suppress(Exception):  # best effort: they stop with their timeout too
            self.executor.cancel_all(self.handles)
        drop_untaken(self.store, self.plan.trainers)

    def live_rows(self, statuses: Sequence[ReplicaStatus]) -> list[dict[str, Any]]:
        """One row per worker for the live table, from the statuses :meth:`poll` just gave
        (no second status call) and each worker's heartbeat."""
        from crf.launcher.rollout_view import worker_row

        return [
            worker_row(
                h.rank,
                str(st.state),
                read_worker_state(self.store, h.rank),
                self.restarts.get(h.rank, 0),
                st.message,
            )  # fmt: skip
            for h, st in zip(self.handles, statuses, strict=False)
        ]

    def collect(self) -> list[dict[str, Any]]:
        """One row per worker for the summary: its process's end and its own account; in a
        cancelled run, the workers that ran until the cancel read as cancelled with it."""
        rows = worker_rows(self.executor, self.handles, self.store, self.restarts)
        return as_cancelled(rows, self.alive, RUN_CANCELLED) if self.cancelled else rows

    def _say(self, message: str) -> None:
        """A yellow line, verbatim: an error's text is no markup (``[/INST]`` would be)."""
        if self.console is not None:
            self.console.print(message, style="yellow", markup=False, highlight=False)


def worker_rows(
    executor: ServerlessExecutor,
    handles: Sequence[ReplicaHandle],
    store: RunStore,
    restarts: Mapping[int, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per worker (crf.launcher.rollout_view.worker_row): its process's state as
    the backend sees it, joined with its own record (its result, else its heartbeat)."""
    from crf.launcher.rollout_view import worker_row

    rows = []
    for handle in handles:
        try:
            status = executor.status(handle)
        except Exception as e:  # noqa: BLE001 - a row that says so beats no summary
            status = ReplicaStatus(ReplicaState.FAILED, None, f"status unknown: {e}")
        record = read_worker_state(store, handle.rank, final=True)
        record = record or read_worker_state(store, handle.rank)
        restarted = (restarts or {}).get(handle.rank, int(handle.extra.get("attempt", 0)))
        rows.append(worker_row(handle.rank, str(status.state), record, restarted, status.message))
    return rows


def drop_untaken(store: RunStore, trainers: int) -> None:
    """The workers are stopped: the batches no finished trainer took go, and once all
    ``trainers`` finished ok the round bases of their policy (only store space is at stake,
    so a store error is let be)."""
    from crf.rollouts.batches import drop_finished_queues
    from crf.rollouts.policy import drop_finished_bases

    with contextlib.suppress(Exception):
        drop_finished_queues(store)
    with contextlib.suppress(Exception):
        drop_finished_bases(store, trainers)


def running_workers(executor: ServerlessExecutor, handles: Sequence[ReplicaHandle]) -> set[int]:
    """The workers whose process still runs (pending or running), before a cancel."""
    out = set()
    for handle in handles:
        try:
            if not executor.status(handle).state.terminal:
                out.add(handle.rank)
        except Exception:  # noqa: BLE001 - unknown: not known to be running
            continue
    return out


def as_cancelled(
    rows: list[dict[str, Any]], running: set[int], why: str = TRAINERS_ENDED
) -> list[dict[str, Any]]:
    """``rows`` with each worker that was still running when it was cancelled shown
    ``cancelled`` (``why`` its message), unless it ended by itself first: from another
    process than the one that started it, the backend sees only that it ended without an ok
    result (``failed``)."""
    for row in rows:
        if row["worker"] in running and row["state"] != "succeeded":
            row["state"], row["message"] = "cancelled", why
    return rows


def read_worker_handles(store: RunStore, launch_no: int) -> list[ReplicaHandle]:
    """The workers' saved handles of a launch (none: a run without workers, or damaged)."""
    try:
        saved = store.get_json(layout.worker_handles_key(launch_no))
        handles = [ReplicaHandle(**h) for h in saved.get("handles", [])]
    except Exception:  # noqa: BLE001 - none or damaged: the workers are optional
        return []
    for h in handles:
        h.extra["role"] = layout.ROLE_ROLLOUT
    return sorted(handles, key=lambda h: h.rank)
