"""Whether a run may still be running, from its run folder: its replicas' heartbeats, the
handles and record its newest launch saved, and (on this machine) their processes.

A second launch into a run folder, a resume, ``crf rm`` and ``crf runs`` all ask this
before they act or answer: two sets of replicas for one rank would both publish
contributions under that rank, and a run that is still starting its replicas is not one
that stopped. It reads the store and this machine's process table only; asking a backend
about its handles (``backend_live``) is the caller's choice, since that may be a cloud
request per replica.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from crf import layout
from crf.executors.base import ExecutorError, ReplicaHandle, ServerlessExecutor
from crf.executors.process import START_TIME_TOLERANCE_S, is_replica_process

if TYPE_CHECKING:
    from crf.store import RunStore

#: a replica on another host whose heartbeat is younger than this may still be running
LIVE_HEARTBEAT_S = 60.0
#: how long after its launch saved its handle a cloud replica may still be starting without
#: a heartbeat (a GPU container can wait for capacity: up to ~21 minutes on Modal; then it
#: installs and imports): past it, only the backend can say (``crf status``)
CLOUD_START_S = 1800.0


def read_heartbeat(store: RunStore, rank: int) -> layout.Heartbeat | None:
    """Replica ``rank``'s heartbeat record, or None when there is none (yet) to read."""
    try:
        data = store.get_json(layout.heartbeat_key(rank))
    except Exception:  # noqa: BLE001 - absent, torn or any client error: the watch goes on
        return None
    return layout.Heartbeat.from_dict(data) if isinstance(data, dict) else None


def live_replicas(
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
        hb = read_heartbeat(store, rank)
        if not hb or hb.phase in ("done", "failed"):
            continue
        pid, seen = hb.pid, hb.seen_at  # alive_at too: a long step writes no news
        age = now - seen if seen > 0 else None
        if hb.host == host and isinstance(pid, int):
            started = hb.pid_started_at
            started = started if isinstance(started, str | int | float) else None
            if is_replica_process(pid, run_id=run_id, rank=rank, started_at=started):
                live.append(f"replica {rank} (pid {pid} on this host)")
        elif age is not None and age < LIVE_HEARTBEAT_S:
            live.append(f"replica {rank} (on {hb.host}, heartbeat {age:.0f}s ago)")
    return live


def saved_handles(store: RunStore, launch_no: int) -> list[ReplicaHandle] | None:
    """The replica handles launch ``launch_no`` saved (``launches/<k>/handles.json``), or
    None when it saved none (yet) or they cannot be read."""
    try:
        saved = store.get_json(layout.handles_key(launch_no))
        return [ReplicaHandle(**h) for h in saved.get("handles", [])]
    except Exception:  # noqa: BLE001 - none saved, or damaged: nothing to ask about
        return None


def backend_live(store: RunStore, executor: ServerlessExecutor, launches: list[int]) -> list[str]:
    """Replicas of the newest launch that its backend still runs, each as a short
    description. Heartbeats alone miss a replica that has not written one yet (a few seconds
    after a detached launch on this host, minutes while a cloud container starts): its
    handle (``launches/<k>/handles.json``) says it was started, and the backend whether it
    still runs. A backend that cannot be asked leaves it to the heartbeats."""
    handles = saved_handles(store, max(launches)) if launches else None
    live = []
    for h in sorted(handles or [], key=lambda h: h.rank):
        try:
            status = executor.status(h)
        except ExecutorError:
            continue
        if not status.terminal:
            live.append(f"replica {h.rank} ({status.state} on {h.backend or 'its backend'})")
    return live


def newest_launch(store: RunStore) -> tuple[int, dict[str, Any]] | None:
    """The newest launch's number and record (``launches/<k>.json``; empty when it cannot
    be read), or None for a run folder without one."""
    launches = layout.launch_numbers(store)
    if not launches:
        return None
    k = max(launches)
    try:
        record = store.get_json(layout.launch_key(k))
    except Exception:  # noqa: BLE001 - absent, torn or any client error: nothing it says
        record = {}
    return k, record if isinstance(record, dict) else {}


def launch_ended(record: dict[str, Any]) -> bool:
    """Whether a launch record says its driver saw the launch end (or gathered it)."""
    return record.get("ended_at") is not None or record.get("status") is not None


def driver_alive(record: dict[str, Any]) -> bool | None:
    """Whether the driver process that wrote a launch record still runs: True or False on
    this host (its pid, held by a process that started before the launch did: pids get
    reused), None on another host, where nothing can ask."""
    import psutil

    pid, host = record.get("pid"), record.get("host")
    if host != socket.gethostname():
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    started = record.get("started_at")
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        born = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it lives, and may be the driver
        return True
    return not isinstance(started, int | float) or born <= started + START_TIME_TOLERANCE_S


def beaten_since(store: RunStore, replicas: int, since: float) -> bool:
    """Whether any replica has written a heartbeat since ``since`` (a launch's start):
    an older one is a previous launch's, which says nothing of this one's replicas."""
    for rank in range(replicas):
        hb = read_heartbeat(store, rank)
        updated = hb.updated_at if hb is not None else None
        if isinstance(updated, int | float) and updated >= since:
            return True
    return False


def launch_starting(
    store: RunStore, replicas: int, run_id: str, *, known_only: bool = False
) -> str | None:
    """Why the newest launch of a run is still starting its replicas (a short
    description), or None when it is not. It is when none of its replicas has beaten yet,
    neither its record nor a ``result.json`` says it ended, and: it has saved no replica
    handles yet and its driver still runs on this host, or runs on another host (where
    nothing can ask); or it has saved them and a local replica process it started still
    runs here (a detached launch's, its driver gone), or its driver, still running here,
    watches cloud replicas start, or it saved cloud replicas' handles less than
    ``CLOUD_START_S`` ago (its driver gone or elsewhere: a detached launch's containers
    may take many minutes to start). A driver that lives on after its replicas started (a
    notebook's ``crf.launch(detach=True)``) says nothing of them by itself.

    ``known_only``: only a driver seen running on this host before it saved any handle
    counts, and the handles are left to the backend (``backend_live``). What refuses a
    resume must know: a driver elsewhere that died before it saved any handle would
    otherwise keep the run from ever being continued."""
    state = launch_state(store, replicas, run_id, known_only=known_only)
    return state[1] if state is not None and state[0] == "starting" else None


def launch_state(
    store: RunStore, replicas: int, run_id: str, *, known_only: bool = False
) -> tuple[str, str] | None:
    """The newest launch of a run whose replicas have not beaten yet, as ``crf runs`` says
    it from the store alone: ``("starting", why)`` (``launch_starting``), ``("unknown",
    why)`` for cloud replicas that have not beaten ``CLOUD_START_S`` after their launch, its
    driver gone (whether they still start, or never will, only the backend can say), or
    None: nothing says it may still start."""
    newest = newest_launch(store)
    if newest is None:
        return None
    k, record = newest
    if not record or launch_ended(record) or _summarized(store, k):
        return None
    started = record.get("started_at")
    if beaten_since(store, replicas, float(started) if isinstance(started, int | float) else 0):
        return None
    alive = driver_alive(record)
    where = f"driver pid {record.get('pid')} on {record.get('host')}"
    handles = saved_handles(store, k)
    if not handles:
        if alive:
            return "starting", f"launch {k} ({where}) is starting its replicas"
        unknown = alive is None and not known_only
        why = f"launch {k} ({where}) has not started its replicas yet"
        return ("starting", why) if unknown else None
    if known_only:
        return None
    booting = [h.rank for h in handles if _local_replica_runs(h, run_id)]
    if booting:
        ranks = ", ".join(map(str, booting))
        return "starting", f"launch {k}: replica(s) {ranks} started, no heartbeat yet"
    cloud = [h for h in handles if h.backend != "local"]
    if not cloud:
        return None
    if alive:
        return "starting", f"launch {k} ({where}) is waiting for its replicas to start"
    return _cloud_start(k, cloud)


def _cloud_start(k: int, cloud: list[ReplicaHandle]) -> tuple[str, str]:
    """A launch's cloud replicas that have not beaten, its driver gone: still starting
    within ``CLOUD_START_S`` of their start, unknown after it."""
    since = max(float(h.started_at or 0) for h in cloud)
    age = time.time() - since
    on = cloud[0].backend or "its backend"
    if age < CLOUD_START_S:
        return "starting", f"launch {k}: replicas started on {on} {age:.0f}s ago, no heartbeat yet"
    return "unknown", (
        f"launch {k} started its replicas on {on} {age / 60:.0f} min ago and none has written "
        "a heartbeat: only the backend can say whether they still start"
    )


def _summarized(store: RunStore, launch_no: int) -> bool:
    """Whether ``result.json`` is launch ``launch_no``'s summary (a launch that could not
    start its replicas writes one, and leaves its record open)."""
    try:
        data = store.get_json(layout.RESULT)
    except Exception:  # noqa: BLE001 - absent, torn or any client error: no summary
        return False
    return isinstance(data, dict) and data.get("launch", 0) == launch_no


def _local_replica_runs(handle: ReplicaHandle, run_id: str) -> bool:
    """Whether a local replica's process (its handle's pid, held by that replica: same
    start, run id and rank) still runs on this host."""
    if handle.backend != "local":
        return False
    try:
        pid = int(handle.backend_id)
    except (TypeError, ValueError):
        return False
    started = (handle.extra or {}).get("pid_started_at")
    started = started if isinstance(started, str | int | float) else None
    return is_replica_process(pid, run_id=run_id, rank=handle.rank, started_at=started)
