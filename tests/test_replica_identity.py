"""A saved pid that the OS gave to another process is not the replica.

An ended replica's pid may be reused by any later process. ``crf status`` must not call the
run running because of it, ``crf cancel`` (and the executor's ``cancel_all``) must not signal
it, and a resume must not wait for it. Real processes stand in for the stranger: a ``sleep``
in its own session (so its pid is also a process-group id, as a replica's is), once with a
plain environment and once with the run's own CRF_RUN_ID/CRF_RANK (only the start time recorded
at launch tells that one apart).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from crf.executors.base import ReplicaHandle
from crf.executors.local import LocalProcessExecutor
from crf.executors.process import PidOwner, pid_owner, process_started_at
from crf.launcher.liveness import live_replicas
from crf.store import RunStore
from tests import test_cli_attach
from tests.test_cli_attach import _launch, _wait_ended, crf

script = test_cli_attach.script  # the fixture, visible to this module's tests


@pytest.fixture
def strangers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start ``sleep`` processes on request (each in its own session); kill them at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _stranger(procs: list[subprocess.Popen[bytes]], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:  # fmt: skip
    p = subprocess.Popen(
        ["sleep", "120"], env={**os.environ, **(env or {})}, start_new_session=True
    )
    procs.append(p)
    # Popen returns once execve has begun; the new environment shows a moment later
    deadline = time.monotonic() + 30
    while not psutil.Process(p.pid).environ() and time.monotonic() < deadline:
        time.sleep(0.01)
    return p


def test_status_and_cancel_leave_a_process_that_took_a_replicas_pid_alone(
    tmp_path: Path, script: Path, strangers: list[subprocess.Popen[bytes]]
) -> None:
    base = tmp_path / "runs"
    code, out = _launch(base, script, "reused", "--detach")
    assert code == 0, out
    _wait_ended(base, "reused", 2)
    path = base / "reused" / "launches" / "0" / "handles.json"
    saved = json.loads(path.read_text())
    h0, h1 = saved["handles"]
    assert h0["extra"]["pid_started_at"]  # recorded at launch
    # rank 0's pid now belongs to a process with the run's own environment: only its start
    # time differs; rank 1's to a plain one, and its handle predates start times
    twin = _stranger(strangers, {"CRF_RUN_ID": "reused", "CRF_RANK": "0"})
    plain = _stranger(strangers)
    h0["backend_id"], h0["extra"]["pgid"] = str(twin.pid), twin.pid
    h1["backend_id"], h1["extra"]["pgid"] = str(plain.pid), plain.pid
    del h1["extra"]["pid_started_at"]
    path.write_text(json.dumps(saved))

    code, out = crf("status", "reused", "--store", str(base))
    assert code == 0, out
    assert "running" not in out and "run ok" in out, out
    code, out = crf("cancel", "reused", "--store", str(base))
    assert code == 0, out
    assert "cancelled 0 running replica(s)" in out, out
    assert twin.poll() is None and plain.poll() is None  # neither got a signal


def test_cancel_all_and_resume_check_tell_a_reused_pid_from_the_replica(
    tmp_path: Path, strangers: list[subprocess.Popen[bytes]]
) -> None:
    run_id = "ident"
    twin = _stranger(strangers, {"CRF_RUN_ID": run_id, "CRF_RANK": "0"})
    started = process_started_at(twin.pid)
    assert started is not None
    # when "the replica" that had this pid started (one clock tick earlier)
    if isinstance(started, str):
        boot, ticks = started.rsplit("/", 1)
        other_start: str | float = f"{boot}/{int(ticks) - 1}"
    else:
        other_start = started - 100.0
    assert pid_owner(twin.pid, run_id=run_id, rank=0, started_at=started) is PidOwner.REPLICA
    assert pid_owner(twin.pid, run_id=run_id, rank=0, started_at=other_start) is PidOwner.OTHER
    assert pid_owner(twin.pid, run_id="another-run", rank=0) is PidOwner.OTHER
    assert pid_owner(twin.pid, run_id=run_id, rank=1) is PidOwner.OTHER

    # the resume check: a heartbeat on this host whose pid is now someone else's
    store = RunStore(str(tmp_path / run_id))
    beat = {"rank": 0, "phase": "training", "updated_at": 0.0, "pid": twin.pid,
            "host": socket.gethostname(), "pid_started_at": other_start}  # fmt: skip
    store.put_json("replicas/0/state.json", beat)
    assert live_replicas(store, 1, run_id) == []
    store.put_json("replicas/0/state.json", {**beat, "pid_started_at": started})
    assert live_replicas(store, 1, run_id) == [f"replica 0 (pid {twin.pid} on this host)"]

    # cancel_all from an executor that did not start it (as `crf cancel` does)
    handle = ReplicaHandle(
        backend="local", run_id=run_id, rank=0, backend_id=str(twin.pid),
        run_uri=store.uri, world_size=1,
        extra={"pgid": twin.pid, "pid_started_at": other_start},
    )  # fmt: skip
    LocalProcessExecutor(grace_period_s=1.0).cancel_all([handle])
    assert twin.poll() is None
    handle.extra["pid_started_at"] = started  # now it is the replica: cancel stops it
    LocalProcessExecutor(grace_period_s=1.0).cancel_all([handle])
    assert twin.wait(timeout=30) is not None
