"""Reattach to a run from any process: ``crf runs``, ``crf status``, ``crf logs``, ``crf cancel``.

Everything needed to find a run's replicas again is in its run folder, never in the driver's
memory: ``run.json`` (what was launched), ``backend.json`` (the executor's non-secret
options), ``launches/<k>.json`` (each driver launch) and ``launches/<k>/handles.json`` (the
current handle of each rank). When the handles are missing - the driver died between the
launch and writing them - the backend's own labels/tags find the replicas
(``find_replicas``). Credentials come from the environment of the process that reattaches,
as they did for the launch.

A detached run has no driver watching it, so ``crf status`` is also where it gets its
summary: once every replica has ended and the latest launch has no result yet, ``status``
gathers the results into ``result.json`` exactly as a watching driver would have.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from crf import layout
from crf.executors.base import (
    ExecutorError,
    MissingAccess,
    ReplicaHandle,
    ReplicaStatus,
    ServerlessExecutor,
)
from crf.launcher.errors import LaunchError
from crf.spec import RunSpec
from crf.store.errors import StoreError


@dataclass
class AttachedRun:
    """A run found in a store, with an executor able to ask its backend about it."""

    spec: RunSpec
    store: Any  # RunStore
    executor: ServerlessExecutor
    launch_no: int
    launch_record: dict[str, Any]
    handles: list[ReplicaHandle]
    #: the rollout workers' handles and the executor that started them (none without)
    workers: list[ReplicaHandle] = field(default_factory=list)
    worker_executor: ServerlessExecutor | None = None

    def worker_rows(self) -> list[dict[str, Any]]:
        """One row per rollout worker: its state as the backend sees it, and its record."""
        from crf.launcher.workers import worker_rows

        if not self.workers or self.worker_executor is None:
            return []
        return worker_rows(self.worker_executor, self.workers, self.store)

    def trainer_rollouts(self) -> dict[str, dict[str, Any]]:
        """Each replica's rollouts so far by source (its round metrics; rollout_view)."""
        from crf.launcher.figure import read_metrics
        from crf.launcher.rollout_view import trainer_rollouts

        metrics = read_metrics(self.store, self.spec.replicas)
        return {str(rank): trainer_rollouts(rounds) for rank, rounds in sorted(metrics.items())}

    def logs_of(self, role: str) -> tuple[ServerlessExecutor, list[ReplicaHandle]]:
        """The executor and handles of one role: ``trainer`` (the replicas) or ``rollout``."""
        if role == layout.ROLE_ROLLOUT:
            if not self.workers or self.worker_executor is None:
                raise LaunchError(f"run {self.spec.run_id} has no rollout workers")
            return self.worker_executor, self.workers
        return self.executor, self.handles

    def statuses(self) -> list[tuple[ReplicaHandle, ReplicaStatus, layout.Heartbeat | None]]:
        from crf.launcher.liveness import read_heartbeat

        out = []
        for h in self.handles:
            try:
                st = self.executor.status(h)
            except MissingAccess as e:
                st = self._recorded_status(h, e)
            except ExecutorError as e:
                from crf.executors.base import ReplicaState

                st = ReplicaStatus(ReplicaState.FAILED, None, f"status unavailable: {e}")
            out.append((h, st, read_heartbeat(self.store, h.rank)))
        return self._as_recorded(out)

    def _as_recorded(
        self, rows: list[tuple[ReplicaHandle, ReplicaStatus, layout.Heartbeat | None]]
    ) -> list[tuple[ReplicaHandle, ReplicaStatus, layout.Heartbeat | None]]:
        """Once every replica has ended and this launch's summary is written, each one's
        exit code and restarts as the summary records them (a backend asked from another
        process knows no exit code of a process it did not start, nor the driver's
        restarts), and ``cancelled`` where the summary says so (a replica stopped by a
        cancel is, to its backend, a process killed by a signal): the table would otherwise
        contradict the summary printed under it."""
        from crf.executors.base import ReplicaState

        result = self.result() if all(st.terminal for _, st, _ in rows) else None
        if result is None:
            return rows
        recorded = {r.get("rank"): r for r in result.get("replicas") or ()}
        out = []
        for h, st, beat in rows:
            row = recorded.get(h.rank) or {}
            code = row.get("exit_code")
            restarts = row.get("restarts")
            st = dataclasses.replace(
                st,
                exit_code=st.exit_code if code is None else code,
                restarts=max(st.restarts, restarts if isinstance(restarts, int) else 0),
            )
            if st.state is ReplicaState.FAILED and row.get("state") == "cancelled":
                st = dataclasses.replace(st, state=ReplicaState.CANCELLED)
            out.append((h, st, beat))
        return out

    def _recorded_status(self, handle: ReplicaHandle, refused: MissingAccess) -> ReplicaStatus:
        """A replica's state when the backend refuses this process (no, wrong or expired
        credentials; out of reach): as ``result.json`` records it once the run has ended;
        before, ``refused`` itself. A refusal is no replica's state: read as a failed replica,
        ``crf cancel`` would stop nothing and ``crf rm`` delete a run whose replicas still
        run, on a token that has merely expired."""
        from crf.executors.base import ReplicaState

        result = self.result()
        if result is None:
            raise refused
        row = next((r for r in result.get("replicas") or () if r.get("rank") == handle.rank), {})
        try:
            state = ReplicaState(row.get("state"))
        except ValueError:
            state = ReplicaState.SUCCEEDED if row.get("ok") else ReplicaState.FAILED
        return ReplicaStatus(state, row.get("exit_code"), "as result.json records it")

    def result(self) -> dict[str, Any] | None:
        """This launch's ``result.json``, if it was written (by its driver or a gather)."""
        try:
            data = self.store.get_json(layout.RESULT)
        except (StoreError, OSError, ValueError):  # absent, unreadable or not JSON
            return None
        if result_damage(data) is not None or int(data.get("launch", 0) or 0) != self.launch_no:
            return None
        return data

    def result_damage(self) -> str | None:
        """Why ``result.json`` cannot be read as a summary, when the file is there (None:
        absent, unreadable now, or a summary, of any launch). A gather writes a new one over
        it, and the user must hear that the old one was damaged rather than see it replaced
        without a word."""
        try:
            raw = self.store.get(layout.RESULT)
        except (StoreError, OSError):  # absent (no summary yet), or cannot be read now
            return None
        try:
            data = json.loads(bytes(raw).decode("utf-8"))
        except UnicodeDecodeError as e:
            return f"not UTF-8 text (bad byte at offset {e.start})"
        except json.JSONDecodeError as e:
            return f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        return result_damage(data)

    def handle(self, rank: int) -> ReplicaHandle:
        for h in self.handles:
            if h.rank == rank:
                return h
        ranks = ", ".join(str(h.rank) for h in self.handles)
        raise LaunchError(f"run {self.spec.run_id} has no replica {rank} (ranks: {ranks})")


def result_damage(data: Any) -> str | None:
    """What keeps a parsed ``result.json`` from being a run's summary (None: it is one): it
    must be an object with a status."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not a summary (an object)"
    if not isinstance(data.get("status"), str):
        return "it has no status"
    try:
        int(data.get("launch", 0) or 0)
    except (TypeError, ValueError):
        return f"its launch is {data.get('launch')!r}, not a number"
    return None


def run_store(run_id: str, store: str | None) -> Any:
    from crf.launcher.plan import DEFAULT_STORE, store_base
    from crf.spec import SpecError, check_run_id
    from crf.store import RunStore, join_uri

    try:
        check_run_id(run_id)  # one folder in --store, never a path out of it
    except SpecError as e:
        raise LaunchError(str(e)) from None
    base = store_base(store)  # LaunchError: blank, a typo, credentials
    try:
        st = RunStore(join_uri(base, run_id), retries=1)
        if not st.exists(layout.RUN_SPEC):
            raise LaunchError(
                st.missing_bucket()
                or f"no run {run_id!r} in {store or DEFAULT_STORE} (no run.json there); "
                "list runs with `crf runs --store ...`"
            )
    except LaunchError:
        raise
    except Exception as e:  # noqa: BLE001 - any client error: one line that names the store
        raise LaunchError(f"cannot open run {run_id!r} in {store or DEFAULT_STORE}: {e}") from None
    return st


def attach(run_id: str, store: str | None = None) -> AttachedRun:
    """Open run ``run_id`` in ``store`` and rebuild its executor; LaunchError if impossible."""
    from crf.launcher.plan import make_executor, read_run_spec, saved_backend_options

    st = run_store(run_id, store)
    spec = read_run_spec(st)
    executor = make_executor(spec.backend, saved_backend_options(st))
    launches = layout.launch_numbers(st)
    launch_no = max(launches) if launches else 0
    try:
        record = st.get_json(layout.launch_key(launch_no))
    except (StoreError, OSError, ValueError):  # absent, unreadable or not JSON
        record = {}
    if not isinstance(record, dict):
        record = {}
    handles: list[ReplicaHandle] = []
    try:
        saved = st.get_json(layout.handles_key(launch_no))
        handles = [ReplicaHandle(**h) for h in saved.get("handles", [])]
    except (StoreError, OSError, ValueError, TypeError, AttributeError):  # none or damaged
        handles = []
    if not handles:
        try:
            handles = executor.find_replicas(spec.run_id, spec.run_uri, spec.replicas)
        except ExecutorError as e:
            raise LaunchError(_no_handles(run_id, launch_no, record, str(e))) from None
    handles.sort(key=lambda h: h.rank)
    attached = AttachedRun(spec, st, executor, launch_no, record, handles)
    if spec.rollout_workers:
        from crf.launcher.workers import read_worker_handles, saved_rollout_options

        attached.workers = read_worker_handles(st, launch_no)
        overrides = saved_rollout_options(st.uri)
        attached.worker_executor = (
            make_executor(spec.backend, {**saved_backend_options(st), **overrides})
            if overrides
            else executor
        )
    return attached


def _no_handles(run_id: str, launch_no: int, record: dict[str, Any], why: str) -> str:
    """Why a run has no replicas to attach to, from its launch record: a driver that is
    still starting them (its record has no end, and its process lives: try again in a
    moment), or one that ended (or died) before it started any."""
    from crf.launcher.liveness import driver_alive, launch_ended

    pid, host = record.get("pid"), record.get("host")
    if record and not launch_ended(record) and driver_alive(record) is not False:
        age = time.time() - float(record.get("started_at") or time.time())
        return (
            f"run {run_id} is still starting: its launch {launch_no} (driver pid {pid} on "
            f"{host}, {age:.0f}s ago) has not started its replicas yet; try again in a moment"
        )
    return f"run {run_id} has no saved replica handles and {why}; nothing to attach to"


def cancel_run(run: AttachedRun) -> list[ReplicaHandle]:
    """Stop every replica of ``run`` still running (and, once its summary is written, its
    rollout workers: before, the gather that writes it stops them); the replicas that
    were. The request is written to the store first (``launches/<k>/cancel.json``): a
    driver still watching the run would otherwise take the stopped replicas for dead ones
    and restart them."""
    live = [h for h, st, _ in run.statuses() if not st.terminal]
    if live:
        run.store.put_json(
            layout.cancel_key(run.launch_no),
            {"requested_at": time.time(), "host": socket.gethostname(), "pid": os.getpid()},
        )
    run.executor.cancel_all(live)
    gathered = run.result() is not None  # else gather cancels the workers, and says so
    if gathered and run.workers and run.worker_executor is not None:
        run.worker_executor.cancel_all(run.workers)  # they serve no one now
    return live


def gather(
    run: AttachedRun,
    *,
    report: bool = False,
    console: Any = None,
    cancelled: bool = False,
    cancelled_ranks: Iterable[int] = (),
) -> dict[str, Any]:
    """Write this launch's summary (all replicas have ended); return it. ``cancelled_ranks``:
    the replicas this process stopped (``cancel_run``), reported as cancelled, not failed."""
    from crf.launcher.driver import finish_run

    record = run.launch_record
    extra: dict[str, Any] = {"launch": run.launch_no, "ended_at": _last_beat(run)}
    damage = run.result_damage()
    if damage is not None:
        extra["warnings"] = [_rebuilt_note(run, damage, console)]
    if record.get("restart_policy"):
        extra["restart_policy"] = record["restart_policy"]
    if record.get("resumed_from_round") is not None:
        extra["resumed_from_round"] = record["resumed_from_round"]
    if run.workers and run.worker_executor is not None:
        from crf.launcher.workers import (
            RUN_CANCELLED,
            TRAINERS_ENDED,
            as_cancelled,
            drop_untaken,
            running_workers,
        )

        # the trainers have ended: so has what their workers generate for them
        running = running_workers(run.worker_executor, run.workers)
        with contextlib.suppress(Exception):  # best effort: a worker also ends by itself
            run.worker_executor.cancel_all(run.workers)
        drop_untaken(run.store, run.spec.replicas)
        why = RUN_CANCELLED if cancelled else TRAINERS_ENDED
        extra["workers"] = as_cancelled(run.worker_rows(), running, why)
    return finish_run(
        run.spec,
        run.store,
        run.executor,
        run.handles,
        launch_no=run.launch_no,
        started=float(record.get("started_at") or time.time()),
        extra=extra,
        cancelled=cancelled,
        cancelled_ranks=set(cancelled_ranks),
        report=report,
        console=console,
    )


def _rebuilt_note(run: AttachedRun, damage: str, console: Any) -> str:
    """The one line that says a damaged ``result.json`` is being rebuilt, and where: shown
    on ``console`` (the CLI's), else issued as a Python warning (an SDK caller's script
    decides what to show), and kept in the new summary's warnings."""
    from crf.launcher.plan import display_path

    where = display_path(run.store, layout.RESULT)
    note = (
        f"{where} was damaged ({damage}); rebuilt from what the store holds (the replicas' "
        f"results and round records of launch {run.launch_no})"
    )
    if console is not None:
        from rich.markup import escape

        console.print(f"[bold yellow]warning:[/] {escape(note)}", soft_wrap=True, highlight=False)
    else:
        import warnings

        warnings.warn(note, RuntimeWarning, stacklevel=4)  # the caller of Run.wait/cancel
    return note


def _last_beat(run: AttachedRun) -> float | None:
    """When the launch's replicas ended, as their last heartbeats say (None: none wrote
    one since the launch started: now). A detached run is gathered when someone asks (``crf
    status`` an hour later), and its wall time is the replicas', not the time until then."""
    from crf.launcher.liveness import read_heartbeat

    beats = []
    for h in run.handles:
        with contextlib.suppress(Exception):  # unreadable: it says nothing of the end
            beats.append(read_heartbeat(run.store, h.rank))
    return last_beat(beats, float(run.launch_record.get("started_at") or 0))


def last_beat(beats: Iterable[layout.Heartbeat | None], started: float) -> float | None:
    """The newest of ``beats``' updates since ``started`` (None when none is)."""
    times = [
        float(b.updated_at)
        for b in beats
        if b is not None
        and isinstance(b.updated_at, int | float)
        and started <= b.updated_at <= time.time()
    ]
    return max(times, default=None)


def _replica_lines(
    run: AttachedRun, h: ReplicaHandle, follow: bool, tail: int | None
) -> Iterator[str]:
    """One replica's log lines: the last ``tail`` of them (all when None), then, with
    ``follow``, the new ones as they come. A backend's follow starts from the beginning, so
    the lines it has now are counted first and that many less ``tail`` are skipped."""
    if tail is None:
        yield from run.executor.logs(h, follow=follow)
        return
    if not follow:
        yield from collections.deque(run.executor.logs(h, follow=False), maxlen=max(0, tail))
        return
    skip = max(0, sum(1 for _ in run.executor.logs(h, follow=False)) - tail)
    for i, line in enumerate(run.executor.logs(h, follow=True)):
        if i >= skip:
            yield line


def follow_logs(
    run: AttachedRun,
    rank: int | None,
    follow: bool,
    tail: int | None = None,
    role: str = layout.ROLE_TRAINER,
) -> Iterator[tuple[int, str]]:
    """(rank, line) for one replica, or for all of them one after the other (without follow)
    or interleaved as they arrive (with follow); ``tail``: only each replica's last lines.
    With ``role="rollout"``, the same for the rollout workers (``rank``: a worker's index)."""
    executor, handles = run.logs_of(role)
    if role == layout.ROLE_ROLLOUT:
        run = dataclasses.replace(run, executor=executor, handles=handles)
        if rank is not None and rank not in [h.rank for h in handles]:
            ids = ", ".join(str(h.rank) for h in handles)
            raise LaunchError(
                f"run {run.spec.run_id} has no rollout worker {rank} (workers: {ids})"
            )
    handles = [run.handle(rank)] if rank is not None else run.handles
    if not follow or len(handles) == 1:
        for h in handles:
            for line in _replica_lines(run, h, follow, tail):
                yield h.rank, line
        return
    import queue
    import threading

    q: queue.Queue[tuple[int, str] | None] = queue.Queue()

    def pump(h: ReplicaHandle) -> None:
        try:
            for line in _replica_lines(run, h, True, tail):
                q.put((h.rank, line))
        finally:
            q.put(None)

    for h in handles:
        threading.Thread(target=pump, args=(h,), daemon=True).start()
    ended = 0
    while ended < len(handles):
        item = q.get()
        if item is None:
            ended += 1
        else:
            yield item


def list_runs(
    store: str | None, status: Iterable[str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """One row per run folder under ``store``, newest first: id, backend, job, size, when,
    status; only the runs whose status is in ``status`` (all when None), at most ``limit``.

    The status is the newest launch's ``result.json`` status when it exists; otherwise
    ``running`` if a heartbeat is fresh, ``starting`` while that launch is still starting
    replicas that have not beaten yet, ``unknown`` (with a ``note`` saying why) when only
    the backend can say whether its cloud replicas still start, else ``stopped`` (a driver
    died, or a detached run that nobody gathered yet - ``crf status`` tells which). It
    reads the store alone: no backend request per run.
    """
    from crf.launcher.plan import store_base
    from crf.store import RunStore

    base = RunStore(store_base(store), retries=1)  # LaunchError: blank, a typo, credentials
    names = sorted(base.list())
    missing = None if names else base.missing_bucket()
    if missing:
        raise LaunchError(missing)
    rows = []
    for name in names:
        row = run_row(base.child(name))
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda r: r.get("created_at") or 0, reverse=True)
    wanted = set(status or ())
    if wanted:
        rows = [r for r in rows if r["status"] in wanted]
    return rows if limit is None else rows[: max(0, limit)]


#: the statuses a run can have in ``crf runs`` (result.json's, or what the heartbeats and
#: the newest launch's record say)
RUN_STATUSES = (
    "ok", "failed", "cancelled", "starting", "running", "stopped", "unknown", "damaged",
)  # fmt: skip


def status_record(run: AttachedRun) -> dict[str, Any]:
    """What ``crf status --json`` prints: the run, each replica as its backend and heartbeat
    see it, and its result (result.json of this launch) once written."""
    now = time.time()
    replicas = [_replica_record(h, st, beat, now) for h, st, beat in run.statuses()]
    result = run.result()
    live = any(r["state"] in ("pending", "running") for r in replicas)
    status = result["status"] if result else unended_status(run, live)
    record = {
        "run_id": run.spec.run_id,
        "backend": run.spec.backend,
        "job": run.spec.job_label,
        "status": status,
        "launch": run.launch_no,
        "rounds": run.spec.rounds,
        "replicas": replicas,
        "result": result,
    }
    if run.spec.rollout_workers:
        record["workers"] = run.worker_rows()
        record["worker_share"] = run.trainer_rollouts()
    return record


def unended_status(run: AttachedRun, live: bool) -> str:
    """The status of a launch without a summary, from whether its backend still runs any
    of its replicas (``live``): ``starting`` while none of them has written a heartbeat
    since the launch started (a container still starting, a replica still importing),
    ``running`` once one has, ``stopped`` when none runs."""
    from crf.launcher.liveness import beaten_since

    if not live:
        return "stopped"
    started = run.launch_record.get("started_at")
    since = float(started) if isinstance(started, int | float) else 0.0
    return "running" if beaten_since(run.store, run.spec.replicas, since) else "starting"


def _replica_record(
    h: ReplicaHandle, st: ReplicaStatus, beat: layout.Heartbeat | None, now: float
) -> dict[str, Any]:
    age = round(now - beat.updated_at, 1) if beat and beat.updated_at else None
    metrics = dict(beat.round_metrics or {}) if beat else {}
    return {
        "rank": h.rank,
        "state": str(st.state),
        "exit_code": st.exit_code,
        "restarts": int(getattr(st, "restarts", 0) or 0),
        "phase": beat.phase if beat else None,
        "round": beat.round if beat else None,
        "step": beat.step if beat else None,
        "loss": beat.round_loss if beat else None,  # the last finished round's mean
        "reward": metrics.get("reward"),
        "heartbeat_age_s": age,
    }


def remove_run(run_id: str, store: str | None) -> tuple[int, int]:
    """Delete every object of run ``run_id`` (``crf rm``); (objects, bytes) deleted.
    LaunchError, with nothing deleted, while any of its replicas may still be running: as its
    backend says, or - when no handle finds them - as its heartbeats say. A backend that
    refuses this process's credentials cannot say, and a cloud replica writes no heartbeat
    while its container starts, so a run with no summary is then kept."""
    from crf.launcher.liveness import live_replicas

    try:
        run = attach(run_id, store)
        st = run.store
        live = [f"replica {h.rank} {s.state}" for h, s, _ in run.statuses() if not s.terminal]
    except MissingAccess as e:
        raise LaunchError(
            f"cannot tell whether run {run_id}'s replicas still run, so nothing was deleted: {e}"
        ) from None
    except (LaunchError, ExecutorError):  # no handles, or the backend is out of reach
        st = run_store(run_id, store)  # (no such run: its LaunchError)
        try:
            spec = RunSpec.from_json(st.get(layout.RUN_SPEC).decode())
            live = live_replicas(st, spec.replicas, spec.run_id)
        except (ValueError, TypeError):  # a damaged run.json: nothing says what runs
            live = []
    if live:
        raise LaunchError(
            f"run {run_id} is still running ({', '.join(live)}); stop it first with "
            f"`crf cancel {run_id}`, then remove it"
        )
    if st.scheme == "file":
        _check_deletable(run_id, st.root)
    count, size = st.usage()
    try:
        st.delete("")
    except (StoreError, OSError) as e:
        raise LaunchError(_partly_deleted(run_id, st, count, e)) from None
    return count, size


def _check_deletable(run_id: str, root: str) -> None:
    """LaunchError, with nothing deleted, for a local run folder that ``crf rm`` could only
    delete in part: one that is a symbolic link (deleting the link, or what it points to,
    is the user's call), or one with a folder whose entries cannot be removed (no write
    permission, ``chattr +i``, a read-only mount: ``os.access`` asks the kernel, so it sees
    all three, for root too). A half-deleted run would lose its figure or result while
    still listed, and could no longer be resumed."""
    folder = root.rstrip("/")
    if os.path.islink(folder):
        raise LaunchError(
            f"run {run_id}'s folder {folder} is a symbolic link to {os.readlink(folder)}: "
            "crf rm does not follow it; delete the link or its target yourself"
        )
    walked = list(os.walk(folder))
    inside = [os.path.join(d, n) for d, names, _ in walked for n in names]
    folders = [os.path.dirname(folder), folder, *inside]  # the store's folder loses the run's
    for path in folders:
        if not os.path.islink(path) and not os.access(path, os.W_OK | os.X_OK):
            raise LaunchError(
                f"cannot delete run {run_id}: {path} does not let its entries be removed (no "
                "write permission, immutable, or read-only); nothing was deleted"
            )
    for path in (os.path.join(d, n) for d, _, files in walked for n in files):
        if _undeletable_flag(path):
            raise LaunchError(
                f"cannot delete run {run_id}: {path} is immutable or append-only (chattr); "
                "nothing was deleted"
            )


def _undeletable_flag(path: str) -> bool:
    """Whether a file carries the immutable or append-only attribute (Linux ``chattr +i`` /
    ``+a``), which refuses its unlink even to root in a writable folder. False where the
    attributes cannot be read (another OS, a file system without them)."""
    import array
    import fcntl

    get_flags, undeletable = 0x80086601, 0x10 | 0x20  # FS_IOC_GETFLAGS; IMMUTABLE | APPEND
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, get_flags, flags, True)
        return bool(flags[0] & undeletable)
    except OSError:
        return False
    finally:
        os.close(fd)


def _partly_deleted(run_id: str, st: Any, count: int, e: BaseException) -> str:
    """What ``crf rm`` says when the store refused a delete part way: what and why, and how
    many of the run's objects are gone (counted again, not assumed)."""
    from crf.launcher.errors import os_error_line

    why = os_error_line(e) if isinstance(e, OSError) else str(e)
    try:
        left = st.usage()[0]
    except (StoreError, OSError):
        return f"could not delete all of run {run_id}: {why}"
    return (
        f"could not delete all of run {run_id}: {why}; {count - left} of {count} object(s) "
        f"deleted, {left} left in {st.uri}"
    )


def run_row(st: Any) -> dict[str, Any] | None:
    """The ``crf runs`` row of one folder, or None if it holds no run. A run whose run.json
    cannot be read is listed as ``damaged`` with why (the file and the field), so one bad
    folder neither hides the others nor stops the listing."""
    from crf.launcher.plan import read_run_spec

    try:
        if not st.exists(layout.RUN_SPEC):
            return None
        spec = read_run_spec(st)
    except (StoreError, OSError) as e:  # it went away, or cannot be read now
        return _damaged_row(st, f"{type(e).__name__}: {e}")
    except LaunchError as e:
        return _damaged_row(st, str(e))
    status = "stopped"
    try:
        result = st.get_json(layout.RESULT)
        launches = layout.launch_numbers(st)
        if result_damage(result) is not None:  # crf status rebuilds it, and says so
            result = None
        elif int(result.get("launch", 0) or 0) == (max(launches) if launches else 0):
            status = str(result.get("status"))
    except (StoreError, OSError, ValueError, TypeError, AttributeError):  # none yet, or torn
        result = None
    note = None
    if result is None or status == "stopped":
        status, note = _unended_status(st, spec)
    row = {
        # the folder's name, which every command takes (a copied folder keeps its run.json)
        "run_id": st.uri.rstrip("/").rsplit("/", 1)[-1],
        "backend": spec.backend,
        "job": spec.job_label,
        "replicas": spec.replicas,
        "rounds": spec.rounds,
        "created_at": spec.created_at,
        "status": status,
    }
    if note is not None:  # why its status is unknown: crf status RUN asks the backend
        row["note"] = note
    return row


def _damaged_row(st: Any, why: str) -> dict[str, Any]:
    """The row of a run folder whose run.json cannot be read: its folder name and why."""
    name = st.uri.rstrip("/").rsplit("/", 1)[-1]
    empty = dict.fromkeys(("backend", "job", "replicas", "rounds", "created_at"))
    return {"run_id": name, **empty, "status": "damaged", "error": why}


def _unended_status(st: Any, spec: RunSpec) -> tuple[str, str | None]:
    """The status of a run whose newest launch has no summary, and for ``unknown`` why:
    ``running`` while a replica may still run by its heartbeat (crf/launcher/liveness.py
    ``live_replicas``: on this host its pid must still be the replica's, on another a
    heartbeat younger than ``LIVE_HEARTBEAT_S``; one that says done or failed has ended,
    however fresh), ``starting`` while its launch is still starting replicas that have not
    beaten yet, ``unknown`` when only the backend can say whether they still start
    (``launch_state``), else ``stopped``."""
    from crf.launcher.liveness import launch_state, live_replicas

    if live_replicas(st, spec.replicas, spec.run_id):
        return "running", None
    state = launch_state(st, spec.replicas, spec.run_id)
    if state is None:
        return "stopped", None
    status, why = state
    return status, (why if status == "unknown" else None)
