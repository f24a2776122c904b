"""LocalProcessExecutor: each replica is a subprocess on this machine.

Why each replica gets its own session (``start_new_session=True``): a replica may start
children (data loader workers, a user's helper processes). Putting every replica in its own
process group lets ``cancel`` stop the whole tree with one ``killpg``, and keeps a Ctrl-C in
the driver's terminal from reaching the replicas directly - the driver decides what to stop.

Output goes to ``<log_dir>/replica-<rank>.log`` (stdout and stderr interleaved, unbuffered),
which is what ``logs()`` reads. A restarted (``relaunch``) or resumed replica appends to the
same file after a separator line, so one file tells a rank's whole story. Replicas talk only
through the store given as ``run_uri``, so a ``memory://`` store (which lives inside one
process) is refused before anything starts. The environment carries the replica contract and
any caller extras (credentials included): nothing secret is ever put on the command line,
where ``ps`` would show it. On a machine with several GPUs each replica and rollout worker
sees its own (``CUDA_VISIBLE_DEVICES``: crf/executors/local_gpus.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crf.executors.base import (
    BackendPlan,
    Entrypoint,
    ExecutorError,
    LaunchArgs,
    ReplicaHandle,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    Workers,
    build_command,
    prepare_launch,
    replica_env,
    role_of,
    unit_name,
)
from crf.executors.local_gpus import CUDA_VISIBLE_DEVICES, GpuSlots, visible_gpus
from crf.executors.process import PidOwner, pid_owner, process_started_at
from crf.layout import (
    ENV_ROLE,
    ENV_RUN_ID,
    ENV_RUN_URI,
    ENV_SECRET_NAMES,
    ENV_WORLD_SIZE,
    ROLE_ROLLOUT,
    ROLE_TRAINER,
    heartbeat_key,
    worker_state_key,
)


@dataclass
class _Proc:
    popen: subprocess.Popen[bytes]
    pgid: int
    cancelled: bool = False


def _key(handle: ReplicaHandle) -> str:
    return f"{handle.run_id}/{handle.rank}/{handle.backend_id}"


def _memory_text() -> str:
    """This machine's physical memory as ", 62 GiB memory" (empty where the OS says none)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return ""
    return f", {total / 2**30:.0f} GiB memory" if total > 0 else ""


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def ended_as_recorded(
    result: Mapping[str, object] | None, heartbeat: Mapping[str, object] | None = None
) -> ReplicaStatus:
    """How a process this executor did not start (a saved run read by ``crf status``) ended,
    as its own records say: its exit code is its parent's to read, but the result it wrote
    (else its last heartbeat, marked ``done`` or ``failed``) says whether it finished. Only
    where neither says so is the end unknown."""
    record, what = result, "result"
    if record is None and heartbeat is not None and heartbeat.get("phase") in ENDED_PHASES:
        record, what = {**heartbeat, "status": ENDED_PHASES[str(heartbeat["phase"])]}, "heartbeat"
    status = record.get("status") if record is not None else None
    if status == "ok":
        return ReplicaStatus(ReplicaState.SUCCEEDED, None, f"finished (its {what} says so)")
    if status == "stopped":  # a rollout worker that ended by itself (crf/rollouts/lifeline.py)
        return ReplicaStatus(
            ReplicaState.SUCCEEDED, None, f"stopped by itself ({record.get('reason')})"
        )
    if record is None or status is None:
        return ReplicaStatus(
            ReplicaState.FAILED, None, "process ended without a result; exit code unknown"
        )
    error = record.get("error")
    said = f"its {what} says {status}" + (f": {error}" if error else "")
    state = ReplicaState.CANCELLED if status == "cancelled" else ReplicaState.FAILED
    return ReplicaStatus(state, None, said)


#: the heartbeat phases that say how a process ended, as a result's status
ENDED_PHASES = {"done": "ok", "failed": "failed"}


def written_since(record: Mapping[str, object], started_at: float) -> bool:
    """Whether ``record`` may be the process's started at ``started_at``: one stamped
    earlier (``updated_at``) is an earlier process's in the same place (a resumed launch's
    replica finds the stopped launch's last heartbeat, its worker that launch's result, until
    it writes its own), and must not tell how this one ended. A record without a stamp (a
    replica's result: a resume moves those aside) is taken as it is."""
    stamp = record.get("updated_at")
    if not isinstance(stamp, int | float) or isinstance(stamp, bool):
        return True
    return stamp >= started_at


def _live_groups(pgids: set[int]) -> set[int]:
    """Which of ``pgids`` still hold a live (non-zombie) process.

    ``killpg(pgid, 0)`` also succeeds for zombies, which in a container whose init does not
    reap would make every cancel wait out its whole grace period, so on Linux read /proc.
    """
    proc = Path("/proc")
    if not proc.joinpath("self").exists():
        alive = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            alive.add(pgid)
        return alive
    wanted = {str(p): p for p in pgids}
    alive = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command name: state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] in wanted and fields[0] != "Z":
            alive.add(wanted[fields[2]])
    return alive


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


#: memory one local replica needs at the least: a Python process that has imported torch,
#: transformers and trl (what a replica of the built-in jobs does first) is 250 MB resident
#: before it builds a model (measured on Linux, CPU torch)
LOCAL_REPLICA_BYTES = 256 * 2**20


def local_replica_limit() -> tuple[int, str]:
    """How many replicas fit this machine: its physical memory over LOCAL_REPLICA_BYTES
    (more would be killed by the OOM killer or swap for ever, after launching)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf names here: assume 8 GiB
        memory = 8 * 2**30
    limit = max(1, memory // LOCAL_REPLICA_BYTES)
    why = (
        f"each replica is a process of at least {LOCAL_REPLICA_BYTES // 2**20} MiB and this "
        f"machine has {memory / 2**30:.1f} GiB of memory"
    )
    return limit, why


class LocalProcessExecutor(ServerlessExecutor):
    """Run replicas as local subprocesses, one process group each.

    Args:
        log_dir: where ``replica-<rank>.log`` files go. Default: ``<run folder>/logs`` when the
            store is a local folder (so a run's logs sit with its results), else a new
            temporary folder.
        grace_period_s: how long ``cancel`` waits after SIGTERM before SIGKILL.
        cwd: working directory of the replicas (default: the driver's); a run with a
            ``--workdir`` runs each replica in its own unpacked copy of it instead.
        inherit_env: start from the driver's environment (PATH, virtualenv, credentials
            already exported). With False, replicas get only PATH/HOME/LANG plus ``env``.
    """

    name = "local"

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        grace_period_s: float = 10.0,
        cwd: str | os.PathLike[str] | None = None,
        inherit_env: bool = True,
        poll_s: float = 0.1,
    ) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.grace_period_s = grace_period_s
        self.cwd = os.fspath(cwd) if cwd is not None else None
        self.inherit_env = inherit_env
        self.poll_s = poll_s
        self._procs: dict[str, _Proc] = {}
        self._lock = threading.Lock()

    def replica_limit(self) -> tuple[int, str] | None:
        return local_replica_limit()

    # ------------------------------------------------------------------ launch
    def _default_log_dir(self, run_uri: str, run_id: str) -> Path:
        if run_uri.startswith("file://"):
            return Path(run_uri.removeprefix("file://")) / "logs"
        return Path(tempfile.mkdtemp(prefix=f"crf-{run_id}-logs-"))

    def _base_env(self) -> dict[str, str]:
        if self.inherit_env:
            env = dict(os.environ)
        else:
            env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        # Live logs: without this a Python replica's prints sit in a buffer until it exits.
        env["PYTHONUNBUFFERED"] = "1"
        # The replica runs the same crf as the driver, even from a source checkout that was
        # never pip-installed.
        import crf

        root = str(Path(crf.__file__).resolve().parent.parent)
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in parts:
            parts.append(root)
        env["PYTHONPATH"] = os.pathsep.join(parts)
        return env

    def check_command(
        self, entrypoint: Entrypoint, entrypoint_args: Sequence[str] = ()
    ) -> list[str]:
        """The argv to run; fails before anything starts if the program cannot be found.

        A bare ``python``/``python3`` program means the driver's own interpreter, so a user's
        script sees the same virtualenv (and crf) as the driver even when the shell's PATH
        points elsewhere.
        """
        cmd = build_command(entrypoint, entrypoint_args)
        if cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable
        prog = cmd[0]
        if os.sep in prog or (os.altsep and os.altsep in prog):
            path = prog if os.path.isabs(prog) else os.path.join(self.cwd or os.getcwd(), prog)
            if not os.access(path, os.X_OK):
                raise ExecutorError(
                    f"entrypoint program {prog!r} does not exist or is not executable"
                )
            return cmd
        if shutil.which(prog) is None:
            raise ExecutorError(
                f"entrypoint program {prog!r} was not found on PATH; "
                "give a full path or a command that exists here"
            )
        return cmd

    def check_script(self, cmd: Sequence[str]) -> None:
        """ExecutorError when ``cmd`` runs a Python script (``python [options] FILE ...``)
        that is not there, or does not compile: every replica would fail the same way the
        moment it starts, so the launch is refused before any starts. Relative to where the
        replicas start (without ``--workdir``: its copy is checked where it is packed)."""
        script = python_script(cmd)
        if script is None:
            return
        path = Path(self.cwd or os.getcwd(), script)
        if not path.is_file():
            raise ExecutorError(f"entrypoint script {script!r} does not exist (no file {path})")
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            where = f" line {e.lineno}:" if isinstance(e, SyntaxError) and e.lineno else ""
            message = e.msg if isinstance(e, SyntaxError) else str(e)
            raise ExecutorError(
                f"entrypoint script {script!r} does not compile:{where} "
                f"{type(e).__name__}: {message}"
            ) from None

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
        workers: Workers | None = None,
    ) -> list[ReplicaHandle]:
        """Start the replicas as subprocesses (with ``workers``, rollout workers: see
        :class:`~crf.executors.base.Workers`; their logs are ``worker-<w>.log``). Local
        processes have no platform retries: ``max_restarts`` is ignored and the driver
        relaunches failed ranks itself."""
        run_uri, run_id, to_start = prepare_launch(n_replicas, run_uri, run_id, ranks)
        cmd = self.check_command(entrypoint, entrypoint_args)
        log_dir = self.log_dir or self._default_log_dir(run_uri, run_id)
        log_dir.mkdir(parents=True, exist_ok=True)
        base_env = {**self._base_env(), **{str(k): str(v) for k, v in (plain_env or {}).items()}}
        spec = self._run_spec(run_uri)
        workdir = self._fetch_workdir(run_uri, spec)
        gpus = self._gpu_slots(spec, n_replicas, workers)
        if any(CUDA_VISIBLE_DEVICES in (e or {}) for e in (env, plain_env)):
            gpus = GpuSlots((), 0)  # the launch names its GPUs itself
        handles: list[ReplicaHandle] = []
        what = "replica" if workers is None else "rollout worker"
        try:
            for rank in to_start:
                child_env = {**base_env, **replica_env(run_uri, run_id, rank, n_replicas, env)}
                if workers is not None:
                    child_env.update(workers.env(rank))
                if gpus.assigns:
                    mine = gpus.replica(rank) if workers is None else gpus.worker(rank)
                    child_env[CUDA_VISIBLE_DEVICES] = ",".join(mine)
                cwd = self.cwd
                if workdir is not None:
                    unit = unit_name(rank, workers)
                    cwd = self._unpack_for(workdir, run_uri, run_id, unit, child_env)
                name = "replica" if workers is None else "worker"
                log = log_dir / f"{name}-{rank}.log"
                handles.append(self._start(cmd, child_env, env, log, cwd, rank, what))
        except OSError as e:
            self.cancel_all(handles)  # all or nothing: no orphan half of a run
            raise ExecutorError(f"could not start {what} {rank}: {e}") from e
        self.remember_launch(
            LaunchArgs.of(
                n_replicas, entrypoint, entrypoint_args, env, run_uri, run_id, plain_env, workers
            )  # fmt: skip
        )
        return handles

    @staticmethod
    def _run_spec(run_uri: str) -> Any:
        """The run's RunSpec from its run.json; None without one (the executor driven
        directly, without the driver)."""
        from crf.executors.workdir import run_spec

        try:
            return run_spec(run_uri)
        except Exception as e:  # noqa: BLE001 - the store's client error, said as one line
            raise ExecutorError(f"could not read the run's run.json from {run_uri}: {e}") from e

    @staticmethod
    def _gpu_slots(spec: Any, n: int, workers: Workers | None) -> GpuSlots:
        """The GPUs this launch hands out (crf/executors/local_gpus.py): the replicas and
        their local ranks from the run's ``spec`` (``n`` replicas of one rank without one),
        the rollout workers after them."""
        replicas = workers.trainers if workers is not None else n
        if spec is not None:
            replicas = int(spec.replicas)
        k = int(getattr(spec, "procs_per_replica", None) or 1)
        return GpuSlots(tuple(visible_gpus()), replicas, k)

    @staticmethod
    def _fetch_workdir(run_uri: str, spec: Any) -> bytes | None:
        """The run's packed ``--workdir`` (named in its run.json), or None without one."""
        from crf.executors.workdir import RunNeeds, fetch_workdir

        key = RunNeeds.of(spec).workdir_key if spec is not None else None
        try:
            return fetch_workdir(run_uri, key) if key else None
        except Exception as e:  # noqa: BLE001 - the store's client error, said as one line
            raise ExecutorError(f"could not read the run's workdir from {run_uri}: {e}") from e

    def _unpack_for(self, workdir: bytes, run_uri: str, run_id: str, rank: int | str,
                    child_env: dict[str, str]) -> str:  # fmt: skip
        """A fresh unpacked copy of the workdir for one replica (as a cloud container gets),
        first on its PYTHONPATH after crf: ``<run folder>/workdir/<rank>`` on a local store
        (removed with the run, beside its logs), else a temporary folder."""
        from crf.executors.workdir import unpack_workdir

        if run_uri.startswith("file://"):
            dest = Path(run_uri.removeprefix("file://")) / "workdir" / str(rank)
        else:
            dest = Path(tempfile.mkdtemp(prefix=f"crf-{run_id}-workdir-{rank}-"))
        where = str(unpack_workdir(workdir, dest))
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (child_env.get("PYTHONPATH"), where) if p
        )
        return where

    def _start(self, cmd: list[str], child_env: dict[str, str], env: Mapping[str, str] | None,
               log_path: Path, cwd: str | None, rank: int, what: str) -> ReplicaHandle:  # fmt: skip
        """Start one replica's (or worker's) process, its output appended to ``log_path``."""
        argv = cmd
        secret_names = sorted(k for k in env or {} if not k.startswith("CRF_"))
        if secret_names:
            # as on every cloud backend, the caller's env= values are secrets: the replica's
            # output passes through the redacting wrapper before it reaches the log file, so
            # no later `crf logs` can show them
            child_env[ENV_SECRET_NAMES] = ",".join(secret_names)
            argv = [sys.executable, "-m", "crf.executors.redacted", *cmd]
        with open(log_path, "ab") as log_file:
            if log_file.tell() > 0:  # a restart or a resume: mark where it begins
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                mark = f"----- crf: {what} {rank} started again at {stamp} -----\n"
                log_file.write(mark.encode())
                log_file.flush()
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
            )
        handle = ReplicaHandle(
            backend=self.name,
            run_id=child_env[ENV_RUN_ID],
            rank=rank,
            backend_id=str(popen.pid),
            run_uri=child_env[ENV_RUN_URI],
            world_size=int(child_env[ENV_WORLD_SIZE]),
            log_path=str(log_path),
            # the start time tells this process from a later one given the same pid
            extra={
                "pgid": popen.pid,
                "program": cmd[0],
                "pid_started_at": process_started_at(popen.pid),
            },
        )
        if what != "replica":
            handle.extra["role"] = child_env[ENV_ROLE]
        with self._lock:
            self._procs[_key(handle)] = _Proc(popen, pgid=popen.pid)
        return handle

    def describe(self, n_replicas: int, command: Sequence[str] | None, run_uri: str) -> BackendPlan:
        """Replicas share this machine's cores (``python -m crf.replica`` splits them)."""
        cores = os.cpu_count() or 1
        return BackendPlan(
            backend=self.name,
            replicas=n_replicas,
            where=f"{n_replicas} subprocess(es) on this machine",
            image=f"this Python ({sys.executable})",
            hardware=f"{cores} CPU core(s) shared, {max(1, cores // n_replicas)} thread(s) each",
            command=self.check_command(command),
            store=run_uri,
            notes=[
                f"logs: {self.log_dir or '<run folder>/logs'}/replica-<rank>.log",
                *filter(None, [GpuSlots(tuple(visible_gpus()), n_replicas).describe()]),
            ],
            resources=f"this machine's {cores} CPU core(s){_memory_text()}, shared",
        )

    def config(self) -> dict[str, object]:
        return {"log_dir": os.fspath(self.log_dir) if self.log_dir else None}

    # ------------------------------------------------------------------ status
    def status(self, handle: ReplicaHandle) -> ReplicaStatus:
        proc = self._procs.get(_key(handle))
        if proc is None:
            return self._foreign_status(handle)
        code = proc.popen.poll()
        if code is None:
            return ReplicaStatus(ReplicaState.RUNNING)
        if proc.cancelled:
            return ReplicaStatus(ReplicaState.CANCELLED, code, "cancelled")
        if code == 0:
            return ReplicaStatus(ReplicaState.SUCCEEDED, 0)
        if code < 0:
            return ReplicaStatus(ReplicaState.FAILED, code, f"killed by {_signal_name(code)}")
        return ReplicaStatus(ReplicaState.FAILED, code, f"exited with code {code}")

    @staticmethod
    def _owner(handle: ReplicaHandle) -> PidOwner:
        """Who holds the handle's pid now: the replica only if its start time (recorded at
        launch; absent from older handles) and its run id and rank match - pids get reused."""
        started = handle.extra.get("pid_started_at")
        trainer = role_of(handle) == ROLE_TRAINER  # a worker's CRF_RANK is its trainer's
        return pid_owner(
            int(handle.backend_id),
            run_id=handle.run_id,
            rank=handle.rank if trainer else None,
            started_at=started if isinstance(started, str | int | float) else None,
        )

    def _foreign_status(self, handle: ReplicaHandle) -> ReplicaStatus:
        """A handle from another executor instance (e.g. a saved run): ask the OS and store."""
        if self._owner(handle) is PidOwner.REPLICA:
            return ReplicaStatus(ReplicaState.RUNNING)
        result, _ = self.read_result(handle)
        if result is not None and not written_since(result, handle.started_at):
            result = None  # an earlier process's (a resumed launch's worker had none yet)
        return ended_as_recorded(result, None if result else self._last_heartbeat(handle))

    @staticmethod
    def _last_heartbeat(handle: ReplicaHandle) -> dict[str, object] | None:
        """The heartbeat this process left (a worker's ``workers/<w>/state.json``), or None;
        one written before it started is an earlier process's, and says nothing of it."""
        from crf.store import RunStore  # lazy: the store pulls in fsspec

        rollout = role_of(handle) == ROLE_ROLLOUT
        key = worker_state_key(handle.rank) if rollout else heartbeat_key(handle.rank)
        try:
            data = RunStore(handle.run_uri).get_json(key)
        except Exception:  # noqa: BLE001 - absent or unreadable: it says nothing
            return None
        if not isinstance(data, dict) or not written_since(data, handle.started_at):
            return None
        return data

    # ------------------------------------------------------------------ logs
    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        if not handle.log_path or not os.path.exists(handle.log_path):
            return iter(())
        return self._follow(handle) if follow else self._read_all(handle.log_path)

    @staticmethod
    def _read_all(path: str) -> Iterator[str]:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                yield line.rstrip("\n")

    def _follow(self, handle: ReplicaHandle) -> Iterator[str]:
        """Tail the log until the replica has ended and everything it wrote was read."""
        assert handle.log_path is not None
        with open(handle.log_path, "rb") as f:
            pending = b""
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    if self.status(handle).terminal:
                        chunk = f.read()  # whatever was written between the read and exit
                        if not chunk:
                            break
                    else:
                        time.sleep(self.poll_s)
                        continue
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", errors="replace")
            if pending:
                yield pending.decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ cancel
    def cancel(self, handle: ReplicaHandle) -> None:
        self.cancel_all([handle])

    def cancel_all(self, handles: Sequence[ReplicaHandle]) -> None:
        """SIGTERM every group at once, wait one grace period in total, then SIGKILL.

        The whole group is signalled, so children the replica started stop with it; a
        replica that has already exited keeps its own status even if a stray child of it is
        cleaned up here. A handle this executor did not start (a saved run) is signalled only
        while its pid is not held by another process: a pid that was reused names a stranger's
        group. (While any member of the replica's group lives, the OS does not reuse its id.)
        """
        groups: dict[int, _Proc | None] = {}
        foreign: dict[int, ReplicaHandle] = {}
        for h in handles:
            proc = self._procs.get(_key(h))
            pgid = int(h.extra.get("pgid", h.backend_id))
            if proc is None:
                if self._owner(h) is PidOwner.OTHER:
                    continue
                foreign[pgid] = h
            groups[pgid] = proc
            if proc is not None and proc.popen.poll() is None:
                proc.cancelled = True
        alive = _live_groups(set(groups))
        if not alive:
            return
        for pgid in alive:
            _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            for pgid in alive:
                proc = groups[pgid]
                if proc is not None:
                    proc.popen.poll()  # reap, so a dead leader stops counting as alive
            alive = _live_groups(alive)
        # a foreign group that emptied during the grace period may have a new owner by now
        alive = {
            p for p in alive if p not in foreign or self._owner(foreign[p]) is not PidOwner.OTHER
        }
        for pgid in alive:
            _killpg(pgid, signal.SIGKILL)
        # SIGKILL is delivered asynchronously: return only once the groups are really gone.
        deadline = time.monotonic() + 5.0
        while alive and time.monotonic() < deadline:
            for pgid in alive:
                proc = groups[pgid]
                if proc is not None:
                    proc.popen.poll()
            alive = _live_groups(alive)
            if alive:
                time.sleep(0.01)
        for proc in groups.values():
            if proc is not None:
                try:
                    proc.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                    pass


#: the Python interpreter's options that take a value as the next argument
_PYTHON_VALUE_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")


def python_script(cmd: Sequence[str]) -> str | None:
    """The script file ``cmd`` runs when it is a Python interpreter's command line
    (``python -u train.py --lr 1``: ``train.py``); None for ``-m``, ``-c``, stdin or another
    program (torchrun's and other launchers' arguments are theirs to read)."""
    if not cmd or not Path(cmd[0]).name.startswith("python"):
        return None
    args = iter(cmd[1:])
    for arg in args:
        if arg == "-" or (arg.startswith("-") and not arg.startswith("--") and
                          ("c" in arg[1:] or "m" in arg[1:])):  # fmt: skip
            return None
        if arg in _PYTHON_VALUE_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None
