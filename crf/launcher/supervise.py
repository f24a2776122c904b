"""Supervision: watch a launched run's replicas until they end, restarting failed ones.

The new process of a restarted replica resumes from the store by itself, so a restart is just
"run the same command again"; what the failed attempt left behind is kept under
``launches/<k>/attempts/`` first, so neither a restart nor the summary loses it.
"""

from __future__ import annotations

import contextlib
import errno
import re
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from crf import layout
from crf.executors.base import (
    ExecutorError,
    ReplicaHandle,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
)
from crf.launcher.liveness import read_heartbeat
from crf.store.errors import denies_access

if TYPE_CHECKING:
    from rich.console import Console

    from crf.launcher.plan import Plan
    from crf.store import RunStore

LOG_TAIL_LINES = 15
#: exit codes that a restart cannot fix (crf.replica): why, for the summary
NO_RESTART_EXIT_CODES = {
    2: "means its environment is broken",
    3: "means it failed with an error a restart cannot fix",
}


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
        #: set once ``crf cancel`` asked this launch to stop (launches/<k>/cancel.json)
        self.cancelled = False
        self.cancelled_ranks: set[int] = set()  # the replicas that cancel stopped
        #: the errors (``Type: message``) each rank failed with before its first committed
        #: round, over its attempts: one seen twice is a bug, not a death
        self.early_errors: dict[int, list[str]] = {h.rank: [] for h in handles}
        #: the errors each rank reported after a committed round: one its own restart
        #: reports again is a bug too (the restart resumed where it failed, and failed again)
        self.late_errors: dict[int, list[str]] = {h.rank: [] for h in handles}
        #: the run's one-line reason when an early error ended it (None: it did not)
        self.fatal: str | None = None
        #: the run's rollout workers (a crf.launcher.workers.WorkerPool, which imports this
        #: module; None: none): polled with the replicas, never deciding the run
        self.workers: Any = None

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def _why_not(self, rank: int, status: ReplicaStatus) -> str | None:
        policy = self.plan.restart
        if self.fatal is not None and self.stopped:
            return "a restart cannot fix its error (the run stopped)"
        if self.cancelled:
            self.cancelled_ranks.add(rank)
            return "the run was cancelled (crf cancel)"
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
            result = self.plan.store.get_json(layout.result_key(rank))
        except Exception:  # noqa: BLE001 - none (it died) or unreadable: the exit code decides
            return False
        return isinstance(result, dict) and result.get("restartable") is False

    def check(self, index: int, heartbeat: layout.Heartbeat | None) -> ReplicaStatus:
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
        if not self.cancelled and self._cancel_requested():
            self.cancelled = self.stopped = True  # stopped by crf cancel: not a death
        if not self.cancelled:  # a cancelled replica's error says nothing about the input
            self._judge_early_error(handle, status)
        reason = self._why_not(handle.rank, status)
        if reason is not None:
            self.not_restarted[handle.rank] = reason
            self._say(
                f"[red]replica {handle.rank} {escape(_what(status))}; not restarting it: "
                f"{escape(reason)}[/]"
            )
            return status
        if heartbeat and heartbeat.updated_at < handle.started_at - 1:
            heartbeat = None  # written by an earlier attempt: says nothing about this one
        refused = self._record(handle, status, heartbeat)
        if refused is not None and refuses_writes(refused):
            self._stop_for_store(handle.rank, refused)
            return status
        try:
            new = executor.relaunch(handle)
        except ExecutorError as e:
            self.not_restarted[handle.rank] = f"relaunch failed: {e}"
            self._say(f"[red]replica {handle.rank}: could not restart it: {escape(str(e))}[/]")
            return status
        self.restarts[handle.rank] += 1
        self.handles[index] = new
        save_handles(self.plan.store, self.launch_no, self.handles)
        where = f" in round {heartbeat.round}" if heartbeat else ""
        self._say(
            f"[yellow]replica {handle.rank} {escape(_what(status))}{where}: restarted it "
            f"({self.restarts[handle.rank]}/{self.plan.restart.max_restarts}); it resumes "
            "from the newest global state[/]"
        )
        return executor.status(new)

    def _cancel_requested(self) -> bool:
        """Whether ``crf cancel`` (from any process) asked this launch to stop: its replicas
        then end by a signal, which looks like a death to the backend."""
        try:
            return self.plan.store.exists(layout.cancel_key(self.launch_no))
        except Exception:  # noqa: BLE001 - unreadable: judge the replica as a death
            return False

    def _judge_early_error(self, handle: ReplicaHandle, status: ReplicaStatus) -> None:
        """End the run at once when ``handle``'s replica failed before its first committed
        round with an error that a restart cannot fix: one it says is deterministic (raised
        in setup, crf/replica/failures.py), or one whose type and message another replica,
        or its own earlier attempt, failed with before (its result's, or its log's for a
        replica that wrote none); at any round with an error every replica meets (a
        reward's own: the others would train on until they meet it, and the run end failed
        anyway); and after a committed round with the error its own earlier attempt
        reported (the restart resumed where it failed and failed the same way; another
        replica's alike error then is not enough, as two deaths may read alike). Deaths
        (killed, no word, or a transient error) restart as the policy allows."""
        rank = handle.rank
        found = self._early_error(handle, status)
        if found is None:
            return
        line, setup, where = found
        if where.startswith("after") and not setup:  # past a committed round: its own only
            before = [rank] if line in self.late_errors.setdefault(rank, []) else []
            self.late_errors[rank].append(line)
        else:
            before = [r for r, seen in self.early_errors.items() if line in seen]
            self.early_errors.setdefault(rank, []).append(line)
        if not setup and not before:
            return
        also = [r for r in before if r != rank]
        again = " (again)" if rank in before else ""
        others = f"; replica(s) {', '.join(map(str, also))} too" if also else ""
        then = self._then()
        self.fatal = (
            f"replica {rank} failed {where}{again} with {line}{others}: a restart cannot fix "
            f"it, so the run stopped; {then}"
        )
        self.stopped = True
        self._say(f"[red]{escape(self.fatal)}[/]")
        others_running = [h for h in self.handles if h.rank != rank]
        with contextlib.suppress(Exception):  # the run ends either way; cancel is best effort
            self.plan.executor.cancel_all(others_running)

    def _then(self) -> str:
        """What to do once the run stopped on an error of its input: continue it, when it
        has committed rounds to keep, with the fixed input (which a resume reads again from
        this machine), else launch it again; a --workdir run's replicas would get the code it
        shipped at its launch on a resume too."""
        spec = self.plan.spec
        try:
            kept = self.plan.resume is not None or bool(layout.global_rounds(self.plan.store))
        except Exception:  # noqa: BLE001 - the store cannot say: as for a run with none
            kept = self.plan.resume is not None
        if kept and not getattr(spec, "workdir", None):
            return f"fix the input, then continue with crf launch --resume {spec.run_id}"
        return "fix the input and launch again"

    def _early_error(
        self, handle: ReplicaHandle, status: ReplicaStatus
    ) -> tuple[str, bool, str] | None:
        """(the error's first line, whether it ends the run at once, where it failed: "at
        setup", "before its first round", "after N committed round(s)") of an attempt that
        failed before its first committed round, or at any round with an error every replica
        meets (``stops_run``: a reward's); None for a death, a transient error (a store or
        network outage repeats too, and a restart may outlive it) or another failure after
        a committed round. A replica that wrote no result (a
        user's entrypoint that never reached crf, killed or not) is judged by its exit and
        its log (:meth:`_logged_error`)."""
        try:
            result = self.plan.store.get_json(layout.result_key(handle.rank))
        except Exception:  # noqa: BLE001 - none: killed, OOM, lost, or it never wrote one
            return self._logged_error(handle, status)
        if not isinstance(result, dict) or result.get("status") != "failed":
            return None
        error = str(result.get("error") or "").strip()
        if not error or result.get("transient"):
            return None
        setup = result.get("failed_in") == "setup"
        where = "at setup" if setup else "before its first round"
        committed = int(result.get("rounds_committed") or 0)
        if result.get("stops_run") is True:  # a reward's error: every replica meets it
            where = f"after {committed} committed round(s)" if committed and not setup else where
            return error.splitlines()[0], True, where
        if committed:  # ends the run only when this rank's own restart reports it again
            return error.splitlines()[0], False, f"after {committed} committed round(s)"
        return error.splitlines()[0], setup and result.get("restartable") is False, where

    def _logged_error(
        self, handle: ReplicaHandle, status: ReplicaStatus
    ) -> tuple[str, bool, str] | None:
        """The last exception line of the log of an attempt that exited by itself with an
        error status (1..127: a Python traceback's 1, ``sys.exit(2)``; for torchrun, the
        first failing rank's, :func:`log_tail`), and where: before the run committed any
        round, or after (then only this rank's own restart failing alike ends the run, and
        torchrun's bare report of a rank's death is no error); None for a kill (a signal,
        or 128 + its number as a shell or a container reports an OOM kill's 137), an unknown
        exit, or a log with no exception line. Such an error repeats on every restart just
        as a reported one does."""
        code = status.exit_code
        if not isinstance(code, int) or not 0 < code < 128:
            return None
        try:
            committed = bool(layout.global_rounds(self.plan.store))
        except Exception:  # noqa: BLE001 - the store cannot say: restart, as for a death
            return None
        from crf.launcher.summary import last_exception

        line = last_exception(log_tail(self.plan.executor, handle))
        if not line or (committed and "ChildFailedError" in line):
            return None  # past a round, torchrun's own report says no more than a death
        # past its first round, only this rank's own restart failing the same way counts
        return line, False, "after a committed round" if committed else "before its first round"

    def _stop_for_store(self, rank: int, error: BaseException) -> None:
        """End the run: the run folder refuses the driver's writes, so it refuses the
        replicas' too (each of them died on it, or will), and every restart would only die
        the same way, --max-restarts times per replica."""
        from crf.launcher.plan import display_path

        where = display_path(self.plan.store)
        cause = " ".join(f"{type(error).__name__}: {error}".split())
        self.fatal = (
            f"the run folder {where} refuses writes ({cause}): a restart cannot fix it, so "
            f"the run stopped; make it writable, then continue with crf launch --resume "
            f"{self.plan.spec.run_id}"
        )
        self.not_restarted[rank] = "the run folder refuses writes"
        self.stopped = True
        self._say(f"[red]{escape(self.fatal)}[/]")
        others = [h for h in self.handles if h.rank != rank]
        with contextlib.suppress(Exception):  # the run ends either way; cancel is best effort
            self.plan.executor.cancel_all(others)

    def _record(
        self, handle: ReplicaHandle, status: ReplicaStatus, heartbeat: layout.Heartbeat | None
    ) -> BaseException | None:
        """Keep what the ended attempt left (see the class); the store's error when it
        refused the record, else None."""
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
            "phase": heartbeat.phase if heartbeat else None,
            "round": heartbeat.round if heartbeat else None,
            "step": heartbeat.step if heartbeat else None,
            "result": None,
        }
        try:
            key = layout.result_key(handle.rank)
            if store.exists(key):
                record["result"] = store.get_json(key)
            store.put_json(layout.attempt_key(self.launch_no, handle.rank, attempt), record)
            if record["result"] is not None:
                store.delete(key)
        except Exception as e:  # a store outage must not stop a restart (the caller judges)
            record["record_error"] = f"{type(e).__name__}: {e}"
            failure: BaseException | None = e
        else:
            failure = None
        slim = {k: v for k, v in record.items() if k != "result"}
        if isinstance(record["result"], dict):  # it failed cleanly and said why
            slim["error"] = record["result"].get("error")
            slim["rejected"] = record["result"].get("rejected") or []
        self.attempts[handle.rank].append(slim)
        return failure

    def _say(self, message: str) -> None:
        """Tell the user at once (above the live table): a restart is news, not a summary."""
        if self.console is not None:  # one line in a log, wrapped at words on a terminal
            self.console.print(message, highlight=False, soft_wrap=not self.console.is_terminal)


#: errno values of a folder that refuses writes for good: no permission, a read-only file
#: system (a full disk, ENOSPC, may clear, and a store outage is retried by a restart)
_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS}


def refuses_writes(error: BaseException) -> bool:
    """Whether the run store's ``error`` (or one it was raised from) says it refuses writes
    for good, rather than that it is unreachable for a while: a folder's permissions, or an
    object store's answer that the credentials may not write there, no longer exist, or the
    bucket is gone (crf.store.errors.denies_access; an unreachable endpoint may pass)."""
    if denies_access(error):
        return True
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in _REFUSED:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def save_handles(store: RunStore, launch_no: int, handles: Sequence[ReplicaHandle]) -> None:
    """Keep the current handles in the store (plain data, no secrets) so ``crf status``,
    ``crf logs`` and ``crf cancel`` can reattach from any process."""
    with contextlib.suppress(Exception):  # bookkeeping must never stop a run
        store.put_json(layout.handles_key(launch_no), {"handles": [h.to_dict() for h in handles]})


def _what(status: ReplicaStatus) -> str:
    """'was killed by SIGKILL' / 'exited with code 1' for a failed replica."""
    if status.message.startswith("killed"):
        return f"was {status.message}"
    return status.message or f"failed (exit code {status.exit_code})"


def watch(
    sup: Supervisor,
    *,
    console: Console,
    progress: bool,
    timeout_s: float | None,
    poll_s: float,
    started: float,
) -> bool:
    """Poll process status and heartbeats until every replica ended (relaunching failed ones
    through ``sup``); True if the run timed out and was cancelled.

    On a terminal the progress is a live table fitted to the console's width; elsewhere (a
    file, a CI log) it is one plain line per replica per finished round and per event, as
    they happen (:class:`~crf.launcher.progress.PlainReporter`)."""
    from rich.live import Live

    from crf.launcher.progress import (
        PlainReporter,
        ReplicaView,
        render_progress,
        round_records,
    )

    plan = sup.plan
    spec, store, executor = plan.spec, plan.store, plan.executor
    beats: dict[int, layout.Heartbeat | None] = {h.rank: None for h in sup.handles}
    live = None
    plain = None
    if progress and console.is_terminal:
        live = Live(console=console, refresh_per_second=4, transient=False)
    elif progress:
        resumed = plan.resume.from_round if plan.resume is not None else None
        first = 0 if resumed is None else resumed + 1
        plain = PlainReporter(console, spec.rounds, round_records(store), first, started)

    def refresh() -> bool:
        views = []
        for i, h in enumerate(sup.handles):
            beats[h.rank] = read_heartbeat(store, h.rank) or beats[h.rank]
            st = sup.check(i, beats[h.rank])
            views.append(ReplicaView(h.rank, st, beats[h.rank], sup.restarts[h.rank]))
        worker_statuses = None
        if sup.workers is not None and not sup.stopped:
            worker_statuses = sup.workers.poll()
        if plain is not None:
            plain.update(views)
        if live is not None:
            table = render_progress(
                views,
                run_id=spec.run_id,
                rounds=spec.rounds,
                sync_every=spec.sync_every,
                elapsed_s=time.time() - started,
                width=console.width,
            )
            if worker_statuses is not None:  # the rollout workers below their trainers
                rows = sup.workers.live_rows(worker_statuses)
                table = with_workers(table, rows, console.width)
            live.update(table, refresh=True)
        return all(v.status.terminal for v in views)

    with live or contextlib.nullcontext():
        while True:
            if refresh():
                return False
            if timeout_s is not None and time.time() - started > timeout_s:
                sup.stopped = True
                executor.cancel_all(sup.handles)
                if sup.workers is not None:
                    sup.workers.stop()
                refresh()
                return True
            time.sleep(poll_s)


def with_workers(table: Any, rows: Sequence[Mapping[str, Any]], width: int) -> Any:
    """The live display of a run with rollout workers: the replicas' table, then one row per
    worker (whom it serves, its phase, the policy it holds, rollouts made, staleness)."""
    from rich.console import Group

    from crf.launcher.rollout_view import workers_table

    return Group(table, workers_table(rows, width)) if rows else table


def log_tail(executor: ServerlessExecutor, handle: ReplicaHandle) -> list[str]:
    """The last lines of the replica's log; when the log ends with torchrun's report of a
    failed rank (``ChildFailedError``, whose table pushes the cause out of the tail), then
    also the first exception line that the report's root-cause rank printed in that attempt
    (``[rank1]: KeyError: 'x'``), when that rank exited with an error code: a rank killed by
    a signal is a death, whatever the other ranks printed after it."""
    try:
        tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        report = _TorchrunReport()
        for line in executor.logs(handle):
            tail.append(line)
            report.read(line)
    except Exception:  # logs are a courtesy; never let them hide the real result
        return []
    cause = report.cause()
    if cause is not None and tail and tail[-1].startswith("=" * 20):  # the report's end
        tail.append(cause)
    return list(tail)


#: an exception line that torchrun prefixes with the rank that printed it
_RANK_EXCEPTION = re.compile(r"^\[rank(\d+)\]:\s*[A-Za-z_][\w.]*(?:Error|Exception)\b.*:")
#: the exception line that opens torchrun's report (not the ``raise`` above it)
_REPORT_START = re.compile(r"^[\w.]*ChildFailedError:")
#: a field of a rank's entry in torchrun's report ("  rank      : 1 (local_rank: 1)")
_REPORT_FIELD = re.compile(r"^\s+(rank|exitcode)\s*:\s*(-?\d+)")


class _TorchrunReport:
    """Reads a log line by line: each rank's first exception line in the attempt under way,
    and, from torchrun's last report, its root-cause rank and that rank's exit code."""

    def __init__(self) -> None:
        self.firsts: dict[str, str] = {}  # rank -> its first exception line, this attempt
        self.reported: dict[str, str] = {}  # the same, of the attempt the report ended
        self.root: dict[str, str] = {}  # the report's root-cause entry: rank, exitcode
        self.in_root = False

    def read(self, line: str) -> None:
        if _REPORT_START.match(line):
            self.reported, self.firsts, self.root, self.in_root = self.firsts, {}, {}, False
        elif line.startswith("Root Cause"):
            self.in_root = True
        elif self.in_root and (field := _REPORT_FIELD.match(line)):
            self.root.setdefault(field.group(1), field.group(2))
        elif found := _RANK_EXCEPTION.match(line):
            self.firsts.setdefault(found.group(1), line.strip())

    def cause(self) -> str | None:
        """The root-cause rank's first exception line, when it exited with an error code."""
        if self.firsts or int(self.root.get("exitcode", "0")) <= 0:
            return None  # an attempt after the report, or a rank killed by a signal
        return self.reported.get(self.root.get("rank", ""))
