"""LocalProcessExecutor with real subprocesses.

The replicas here are a small user entrypoint written into tmp_path that follows the contract
(reads CRF_*, writes a heartbeat and ``results/<rank>.json`` through RunStore): that is both a
stand-in for ``python -m crf.replica`` (crf's own entrypoint, not another project's API: the
real one runs in tests/test_e2e_local.py) and the proof that a user's own script works the same.
Modes that do not need the store skip importing it (it pulls in torch, ~1.5 s per process).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from crf.executors import (
    ENV_RANK,
    ENV_RUN_ID,
    ENV_RUN_URI,
    ENV_WORLD_SIZE,
    ExecutorError,
    ReplicaState,
    default_entrypoint,
    replica_env,
)
from crf.executors.base import build_command
from crf.executors.local import LocalProcessExecutor

REPLICA_SCRIPT = r"""
import json, os, signal, subprocess, sys, time

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
rank = int(os.environ["CRF_RANK"])
world = int(os.environ["CRF_WORLD_SIZE"])
print(f"replica {rank}/{world} of {os.environ['CRF_RUN_ID']} starting", flush=True)

if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "wait-file":  # run until the test creates a file
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    sys.exit(0)
if mode == "print":
    for i in range(5):
        print(f"line {i}", flush=True)
        time.sleep(0.1)
    sys.stdout.write("no newline at the end")
    sys.exit(0)
if mode == "sleep":  # a child in the same process group; both sleep until killed
    if "ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = ("import signal, sys, time\n"
            "if 'ignore-term' in sys.argv:\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, *sys.argv[3:]])
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(600)

print(f"gpus={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
from crf.store import RunStore

store = RunStore(os.environ["CRF_RUN_URI"])
store.put_json(f"replicas/{rank}/state.json", {"rank": rank, "phase": "training", "round": 0,
               "step": 0, "loss": None, "updated_at": time.time(), "pid": os.getpid()})
fail = str(rank) in os.environ.get("FAIL_RANKS", "").split(",")
store.put_json(f"results/{rank}.json", {
    "rank": rank, "status": "failed" if fail else "ok", "error": "told to fail" if fail else None,
    "rounds_committed": 2, "rounds_missed": 0, "final_loss": 1.0 + rank,
    "weights_sha256": "same", "bytes_up": 10, "bytes_down": 20, "sync_s": 0.1,
    "compute_s": 0.2, "steps": 4, "wall_s": 0.3,
    "job_metrics": {"secret_ok": os.environ.get("MY_SECRET") == "s3cr3t"},
    "env": {k: os.environ[k] for k in ("CRF_RUN_URI", "CRF_RANK", "CRF_WORLD_SIZE", "CRF_RUN_ID")},
})
sys.exit(3 if fail else 0)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "my_replica.py"
    path.write_text(REPLICA_SCRIPT)
    return path


@pytest.fixture
def run_uri(tmp_path: Path) -> str:
    return f"file://{tmp_path}/runs/r1"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_file(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def test_contract_helpers() -> None:
    assert default_entrypoint() == [sys.executable, "-m", "crf.replica"]
    assert build_command(None) == default_entrypoint()
    assert build_command("python my_train.py --x 'a b'", ["--y"]) == [
        "python",
        "my_train.py",
        "--x",
        "a b",
        "--y",
    ]
    with pytest.raises(ExecutorError, match="empty"):
        build_command([])
    env = replica_env("file:///r/x", "x", 2, 4, {"CRF_RANK": "9", "OTHER": "1"})
    assert env == {
        ENV_RUN_URI: "file:///r/x",
        ENV_RANK: "2",
        ENV_WORLD_SIZE: "4",
        ENV_RUN_ID: "x",
        "OTHER": "1",
    }


def test_launch_three_and_collect(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor()
    handles = ex.launch_replicas(
        3, ["python", str(script)], ["ok"], {"MY_SECRET": "s3cr3t"}, run_uri=run_uri, run_id="r1"
    )
    assert [h.rank for h in handles] == [0, 1, 2]
    assert {h.backend for h in handles} == {"local"}
    assert all(h.world_size == 3 and h.run_id == "r1" for h in handles)
    # secrets travel in the environment only
    assert all("s3cr3t" not in str(h.to_dict()) for h in handles)

    results = ex.collect(handles, timeout=60)
    assert [r.rank for r in results] == [0, 1, 2]
    for r in results:
        assert r.state is ReplicaState.SUCCEEDED and r.exit_code == 0 and r.ok, r
        assert r.result is not None and r.result["status"] == "ok"
        assert r.result["env"] == {
            "CRF_RUN_URI": run_uri,
            "CRF_RANK": str(r.rank),
            "CRF_WORLD_SIZE": "3",
            "CRF_RUN_ID": "r1",
        }
        assert r.result["job_metrics"]["secret_ok"] is True
    # logs sit beside the results in the run folder when the store is a local folder
    logs = tmp_path / "runs" / "r1" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"replica-{i}.log" for i in range(3)]
    assert "replica 1/3 of r1 starting" in list(ex.logs(handles[1]))


def test_failed_replica_is_reported(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    handles = ex.launch_replicas(
        2, [sys.executable, str(script)], env={"FAIL_RANKS": "1"}, run_uri=run_uri
    )
    assert handles[0].run_id == "r1"  # from the URI when not given
    ok, bad = ex.collect(handles, timeout=60)
    assert ok.ok and ok.state is ReplicaState.SUCCEEDED
    assert bad.state is ReplicaState.FAILED and bad.exit_code == 3 and not bad.ok
    assert bad.result is not None and bad.result["status"] == "failed"
    assert bad.error == "told to fail"
    assert (tmp_path / "logs" / "replica-1.log").exists()


def test_another_process_reads_how_they_ended_from_their_records(
    script: Path, run_uri: str, tmp_path: Path
) -> None:
    """``crf status`` of a saved run asks an executor that did not start the processes: their
    exit codes are not its to read, but each one's result (a worker's ``result.json``), else
    its last heartbeat marked done or failed, says how it ended; only where nothing does is
    the end unknown."""
    from crf import layout
    from crf.store import RunStore

    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    go = tmp_path / "go"
    handles = ex.launch_replicas(
        3, [sys.executable, str(script)], env={"FAIL_RANKS": "1"}, run_uri=run_uri
    )
    (silent,) = ex.launch_replicas(1, ["python", str(script), "wait-file", str(go)],
                                   run_uri=f"{run_uri}-silent")  # fmt: skip
    go.touch()
    assert ex.wait([*handles, silent], timeout=60)
    # workers' handles: the rank is the worker's number, its records are under workers/<w>/
    w0, w1, w2 = (
        replace(handles[2], rank=w, extra={**handles[2].extra, "role": layout.ROLE_ROLLOUT})
        for w in range(3)
    )
    store = RunStore(run_uri)
    store.put_json(layout.worker_result_key(0), {"worker": 0, "status": "ok"})
    store.put_json(layout.worker_state_key(1), {"worker": 1, "phase": "done"})  # no result
    store.put_json(layout.worker_state_key(2), {"worker": 2, "phase": "generating"})

    other = LocalProcessExecutor()
    ok, bad = other.status(handles[0]), other.status(handles[1])
    assert (ok.state, ok.message) == (ReplicaState.SUCCEEDED, "finished (its result says so)")
    assert bad.state is ReplicaState.FAILED
    assert bad.message == "its result says failed: told to fail"
    done, beat = other.status(w0), other.status(w1)
    assert done.state is beat.state is ReplicaState.SUCCEEDED
    assert (done.message, beat.message) == (
        "finished (its result says so)", "finished (its heartbeat says so)"
    )  # fmt: skip
    for unknown in (other.status(w2), other.status(silent)):  # nothing says how they ended
        assert unknown.state is ReplicaState.FAILED and "exit code unknown" in unknown.message
    # what an earlier process in the same place wrote (a resumed launch's replica and worker
    # killed before their first write find the stopped launch's) says nothing of this one
    before = silent.started_at - 60.0
    RunStore(silent.run_uri).put_json(
        layout.heartbeat_key(0), {"rank": 0, "phase": "done", "updated_at": before}
    )
    w3 = replace(w2, rank=3)
    stale_ok = {"worker": 3, "phase": "done", "status": "ok", "updated_at": before}
    store.put_json(layout.worker_result_key(3), stale_ok)
    for stale in (other.status(silent), other.status(w3)):
        assert stale.state is ReplicaState.FAILED and "exit code unknown" in stale.message


def test_status_transitions(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    go = tmp_path / "go"
    (h,) = ex.launch_replicas(1, ["python", str(script), "wait-file", str(go)], run_uri=run_uri)
    assert ex.status(h).state is ReplicaState.RUNNING
    assert not ex.status(h).terminal
    go.touch()
    assert ex.wait([h], timeout=20)
    st = ex.status(h)
    assert st.state is ReplicaState.SUCCEEDED and st.exit_code == 0

    (h,) = ex.launch_replicas(1, f"python {script} exit 5", run_uri=run_uri)
    assert ex.wait([h], timeout=20)
    st = ex.status(h)
    assert st.state is ReplicaState.FAILED and st.exit_code == 5 and "5" in st.message
    (res,) = ex.collect([h], timeout=5)
    assert res.result is None and res.error == "exited with code 5"

    # another executor instance (e.g. after a driver restart) still answers from the OS
    other = LocalProcessExecutor()
    assert other.status(h).state is ReplicaState.FAILED


def _start_sleeper(ex: LocalProcessExecutor, script: Path, run_uri: str, tmp_path: Path, *extra):
    pidfile = tmp_path / f"pids-{len(list(tmp_path.iterdir()))}"
    (h,) = ex.launch_replicas(
        1,
        ["python", str(script), "sleep", str(pidfile), *extra],
        env={"MY_SECRET": "s3cr3t"},
        run_uri=run_uri,
    )
    leader, child = map(int, _wait_file(pidfile).split())
    # the replica's session is the handle's pid: the script itself, or the redacting wrapper
    # that runs it when env= gives it secrets (then the script is the wrapper's child)
    assert os.getpgid(leader) == int(h.backend_id)
    return h, leader, child


def test_cancel_kills_the_process_group(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", grace_period_s=5)
    h, leader, child = _start_sleeper(ex, script, run_uri, tmp_path)
    assert _alive(leader) and _alive(child)
    assert os.getpgid(child) == int(h.backend_id)  # the replica's child shares its group
    assert b"s3cr3t" not in Path(f"/proc/{leader}/cmdline").read_bytes()
    ex.cancel(h)
    assert not _alive(leader) and not _alive(child)
    st = ex.status(h)
    assert st.state is ReplicaState.CANCELLED and st.terminal
    ex.cancel(h)  # cancelling a finished replica is a no-op
    assert ex.status(h).state is ReplicaState.CANCELLED


def test_cancel_escalates_to_sigkill(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", grace_period_s=0.5)
    h, leader, child = _start_sleeper(ex, script, run_uri, tmp_path, "ignore-term")
    t0 = time.monotonic()
    ex.cancel(h)
    assert time.monotonic() - t0 >= 0.5
    assert not _alive(leader) and not _alive(child)
    assert ex.status(h).state is ReplicaState.CANCELLED


def test_collect_timeout_cancels_stragglers(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", grace_period_s=2)
    h, leader, child = _start_sleeper(ex, script, run_uri, tmp_path)
    with pytest.raises(TimeoutError, match="still running"):
        ex.collect([h], timeout=0.2, cancel_on_timeout=False)
    assert _alive(leader)
    (res,) = ex.collect([h], timeout=0.2)
    assert res.state is ReplicaState.CANCELLED and not res.ok
    assert "did not finish within" in (res.error or "")
    assert not _alive(leader) and not _alive(child)


def test_logs_and_follow(script: Path, run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", poll_s=0.02)
    (h,) = ex.launch_replicas(1, ["python", str(script), "print"], run_uri=run_uri)
    followed = list(ex.logs(h, follow=True))  # returns once the replica has ended
    assert ex.status(h).terminal
    expected = [
        "replica 0/1 of r1 starting",
        *(f"line {i}" for i in range(5)),
        "no newline at the end",
    ]
    assert followed == expected
    assert list(ex.logs(h)) == expected


def test_memory_store_is_refused(script: Path, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    with pytest.raises(ExecutorError, match=r"memory://.*file://"):
        ex.launch_replicas(2, ["python", str(script)], run_uri="memory://crf/r1")
    with pytest.raises(ExecutorError, match="memory://"):
        ex.check_run_uri("memory://crf/r1")
    assert not (tmp_path / "logs").exists()
    assert ex._procs == {}


def test_bad_inputs_start_nothing(run_uri: str, tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    with pytest.raises(ExecutorError, match="not found on PATH"):
        ex.launch_replicas(2, ["no-such-program-crf-test"], run_uri=run_uri)
    with pytest.raises(ExecutorError, match="does not exist"):
        ex.launch_replicas(2, ["./missing.sh"], run_uri=run_uri)
    with pytest.raises(ExecutorError, match=">= 1"):
        ex.launch_replicas(0, ["python"], run_uri=run_uri)
    assert not (tmp_path / "logs").exists()
    assert ex._procs == {}


# --------------------------------------------------------------------------- GPUs
def test_gpus_are_handed_out_in_rank_order() -> None:
    """K GPUs per replica, then one per rollout worker; in turn when there are more
    processes than GPUs; nothing with one GPU, or when K ranks need more than there are."""
    from crf.executors.local_gpus import GpuSlots, visible_gpus

    eight = GpuSlots(tuple(str(i) for i in range(8)), replicas=2, ranks_per_replica=4)
    assert [eight.replica(r) for r in (0, 1)] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert eight.worker(0) == ["0"]  # all 8 taken by the replicas: the workers share
    two = GpuSlots(("a", "b"), replicas=3)
    assert [two.replica(r) for r in range(3)] == [["a"], ["b"], ["a"]]
    assert [two.worker(w) for w in range(2)] == [["b"], ["a"]]
    assert two.assigns and "this machine's 2" in (two.describe() or "")
    assert not GpuSlots(("0",), replicas=4).assigns
    assert not GpuSlots(("0", "1"), replicas=1, ranks_per_replica=4).assigns
    assert GpuSlots(("0",), replicas=4).describe() is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, GPU-9f,3"}) == ["2", "GPU-9f", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_each_local_process_sees_its_own_gpus(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real processes, this machine's GPUs named by CUDA_VISIBLE_DEVICES: replicas of K
    ranks take K each (K from the run's run.json), rollout workers one each after them;
    a launch whose environment names the GPUs itself keeps its own."""
    from crf.executors.base import Workers
    from crf.spec import RunSpec
    from crf.store import RunStore

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,GPU-9f")
    ex = LocalProcessExecutor()
    uri = f"file://{tmp_path}/runs/k2"
    spec = RunSpec(run_id="k2", run_uri=uri, replicas=2, procs_per_replica=2)
    RunStore(uri).put("run.json", spec.to_json().encode())
    cmd = ["python", str(script)]

    def gpus(handles: list) -> list:
        ex.collect(handles, timeout=60)
        said = [[ln for ln in ex.logs(h) if ln.startswith("gpus=")] for h in handles]
        return [lines[0].strip().removeprefix("gpus=") for lines in said]

    assert gpus(ex.launch_replicas(2, cmd, run_uri=uri, run_id="k2")) == ["0,1", "2,GPU-9f"]
    workers = f"file://{tmp_path}/runs/w"
    launched = ex.launch_replicas(3, cmd, run_uri=workers, run_id="w", workers=Workers(2))
    assert gpus(launched) == ["2", "GPU-9f", "0"]  # after 2 replicas of one rank each
    mine = f"file://{tmp_path}/runs/mine"
    launched = ex.launch_replicas(2, cmd, env={"CUDA_VISIBLE_DEVICES": "1"}, run_uri=mine,
                                  run_id="mine")  # fmt: skip
    assert gpus(launched) == ["1", "1"]
    plain = f"file://{tmp_path}/runs/plain"  # --env CUDA_VISIBLE_DEVICES=... for every one
    launched = ex.launch_replicas(2, cmd, run_uri=plain, run_id="plain",
                                  plain_env={"CUDA_VISIBLE_DEVICES": "2"})  # fmt: skip
    assert gpus(launched) == ["2", "2"]
    assert any("GPUs: each replica" in n for n in ex.describe(2, None, uri).notes)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # one GPU: every process shares it
    one = f"file://{tmp_path}/runs/one"
    assert gpus(ex.launch_replicas(2, cmd, run_uri=one, run_id="one")) == ["3", "3"]
    assert not any("GPUs" in n for n in ex.describe(2, None, one).notes)
