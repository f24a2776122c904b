"""`crf launch --resume RUN`: a run whose driver and replicas were all killed mid-run continues
from its last committed round, loses no committed round, retrains nothing, and ends with as
many rounds as an uninterrupted run - with the same bits.

The uninterrupted reference runs at the same time in the same store folder, so the test also
shows two live runs in one bucket staying apart. Refusals (nothing to resume, options that
would change the run, live replicas, a finished run, two drivers resuming at once) need no
replicas and run in-process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crf.launcher import driver
from crf.launcher.cli import app
from crf.launcher.errors import LaunchError
from crf.spec import RunSpec
from crf.store import RunStore, decode_blob
from tests.fault_helpers import TINY_SETS

N, H, ROUNDS = 3, 4, 8
COMMON = [
    "--job",
    "lm",
    "-n",
    str(N),
    "-H",
    str(H),
    "-r",
    str(ROUNDS),
    "--round-timeout",
    "30",
    *TINY_SETS,
]


def crf_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "crf.launcher.cli", *args]


def _env() -> dict[str, str]:
    return dict(os.environ, CRF_LOG_LEVEL="WARNING")


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint_every", "killed_round"), [(1, 3), (3, 4)], ids=["every-round", "every-3rd"]
)
def test_kill_everything_mid_run_then_resume(
    tmp_path: Path, checkpoint_every: int, killed_round: int
) -> None:
    """The driver is SIGKILLed after round 0 (its replicas go on without it), then every
    replica is SIGKILLed in round ``killed_round``'s inner steps (CRF_FAULT). ``--resume``
    continues from global/2 and ends bit-identical to the same run left alone. With
    ``--checkpoint-every 3`` global/2 is the newest (round 3 was committed but not saved):
    the resumed replicas train round 3 again, from the saved state."""
    base = tmp_path / "bucket"
    faults = ";".join(f"rank={k},point=inner_step,step={killed_round * H + 2}" for k in range(N))
    out = {name: open(tmp_path / f"{name}.log", "w") for name in ("ref", "victim")}  # noqa: SIM115
    launch = ["launch", "--store", str(base), "--no-progress", *COMMON]
    ref = subprocess.Popen(
        crf_cmd(*launch, "--run-id", "ref"), env=_env(), stdout=out["ref"], stderr=subprocess.STDOUT
    )
    victim = subprocess.Popen(
        crf_cmd(*launch, "--run-id", "victim", "--checkpoint-every", str(checkpoint_every)),
        env={**_env(), "CRF_FAULT": faults},
        stdout=out["victim"],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run = base / "victim"
    try:
        _wait(
            lambda: (run / "metrics/0/0.json").exists() or victim.poll() is not None,
            180,
            "round 0",
        )
        assert victim.poll() is None, (tmp_path / "victim.log").read_text()
        os.killpg(victim.pid, signal.SIGKILL)  # the driver goes first: the replicas go on
        victim.wait(10)
        pids = [json.loads((run / f"replicas/{k}/state.json").read_text())["pid"] for k in range(N)]
        _wait(
            lambda: not any(_alive(p) for p in pids),
            120,
            "every replica to be killed in round 3",
        )
        assert ref.wait(300) == 0, (tmp_path / "ref.log").read_text()
    finally:
        for proc in (ref, victim):
            if proc.poll() is None:
                proc.kill()
        for f in out.values():
            f.close()
    assert len(list((run / "faults").iterdir())) == N  # each one died at its kill point
    assert not (run / "result.json").exists()  # the driver died before it could write one

    # what the kill left: rounds 0-2 committed and saved, round 3 half-trained and lost
    store = RunStore(f"file://{run}")
    latest = max(int(n) for n in store.list("global") if n.isdigit())
    inner = [
        decode_blob(store.get(f"replicas/{k}/inner/{latest}.pt"))[1]["round"] for k in range(N)
    ]
    assert latest == 2 and inner == [latest] * N, (latest, inner)
    spec_before = (run / "run.json").read_bytes()
    done_before = {
        p: p.stat().st_mtime_ns
        for k in range(N)
        for p in (run / "metrics" / str(k)).glob("*.json")
        if int(p.stem) <= latest
    }
    assert len(done_before) == N * (latest + 1)

    proc = subprocess.run(
        crf_cmd("launch", "--resume", "victim", "--store", str(base), "--no-progress"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resuming (launch 1): replicas continue from round {latest + 1}" in proc.stdout

    result = json.loads((run / "result.json").read_text())
    reference = json.loads((base / "ref" / "result.json").read_text())
    assert result["status"] == "ok" and result["launch"] == 1
    assert result["resumed_from_round"] == latest
    # as many rounds as the uninterrupted run; none lost, none trained twice
    assert result["rounds_completed"] == reference["rounds_completed"] == ROUNDS
    assert result["rounds_lost"] == []
    assert (run / "global" / str(ROUNDS - 1) / "state.pt").exists()
    for row in result["replicas"]:
        assert row["resumed_from"] == latest and row["steps"] == ROUNDS * H, row
        assert row["rounds_missed"] == [], row
        logged = sorted(int(p.stem) for p in (run / "metrics" / str(row["rank"])).glob("*.json"))
        assert logged == list(range(ROUNDS)), logged
    assert {p: p.stat().st_mtime_ns for p in done_before} == done_before  # none redone
    if checkpoint_every > 1:  # periodic globals plus the last round's
        assert sorted(int(n) for n in store.list("global")) == [2, 5, 7]
    # the same bits as the run nobody killed: the resumed replicas retrained nothing and
    # skipped nothing (weights, outer momentum, inner optimizer and data position restored)
    assert result["weights_identical"] is True
    assert result["weights_sha256"] == reference["weights_sha256"]
    # the run keeps its spec and its history
    assert (run / "run.json").read_bytes() == spec_before
    launches = {p.name: json.loads(p.read_text()) for p in (run / "launches").glob("*.json")}
    assert set(launches) == {"0.json", "1.json"}
    assert "status" not in launches["0.json"]  # that driver was killed
    assert launches["1.json"]["status"] == "ok"
    assert launches["1.json"]["resumed_from_round"] == latest
    # two runs in one bucket, at the same time: neither saw the other's objects
    assert result["objects_rejected"] == 0 and reference["objects_rejected"] == 0
    assert reference["status"] == "ok" and reference["launch"] == 0
    print(f"\nkilled in round {killed_round}; resumed from global/{latest}; bit-identical")


# ---------------------------------------------------------------------- refusals


def _fake_run(base: Path, run_id: str = "old") -> RunStore:
    store = RunStore(f"file://{base}/{run_id}")
    spec = RunSpec(run_id=run_id, run_uri=store.uri, job="lm", replicas=2).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    return store


def _cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_resume_refusals(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    store = _fake_run(base)
    spec_bytes = store.get("run.json")

    def refused(*args: str) -> str:
        result = _cli("launch", "--store", str(base), *args)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        return " ".join(result.output.split())

    assert "nothing to resume" in refused("--resume", "nope")
    msg = refused("--resume", "old", "-n", "3", "--set", "lr=1")
    assert "--replicas, --set cannot be combined with --resume" in msg
    assert "was launched on backend 'local'" in refused("--resume", "old", "--backend", "modal")
    assert "--max-restarts must be an integer >= 0" in refused(
        "--resume", "old", "--max-restarts", "-1"
    )
    # a replica of this run that still runs on this host
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "CRF_RUN_ID": "old"},
    )
    try:
        beat = {"phase": "training", "pid": sleeper.pid, "host": socket.gethostname()}
        store.put_json("replicas/1/state.json", beat | {"updated_at": time.time()})
        assert "still has running replicas: replica 1 (pid" in refused("--resume", "old")
    finally:
        sleeper.kill()
        sleeper.wait()
    # its pid reused by a process of something else (here: this test) does not count
    store.put_json("replicas/1/state.json", beat | {"pid": os.getpid()})
    assert driver.prepare_resume("old", store=str(base)).resume is not None
    # nor does a live heartbeat from a replica that finished
    store.put_json("replicas/1/state.json", beat | {"phase": "done"})
    # a run that finished is not resumed, and a new launch never reuses its folder
    store.put_json("result.json", {"status": "ok"})
    assert "already finished" in refused("--resume", "old")
    assert "continue it with --resume old" in refused("--run-id", "old", "--job", "lm")
    assert store.get("run.json") == spec_bytes

    # two drivers resuming at once: the second one to claim the launch loses
    store.put_json("result.json", {"status": "failed"})
    store.put_json("results/0.json", {"status": "failed", "rank": 0})
    first = driver.prepare_resume("old", store=str(base))
    second = driver.prepare_resume("old", store=str(base))
    assert first.resume is not None and first.resume.launch == 1
    assert driver._start_launch(first, time.time()) == 1
    with pytest.raises(LaunchError, match="another driver is resuming run old"):
        driver._start_launch(second, time.time())
    # what the resumed launch replaces is kept, not overwritten
    assert store.get_json("launches/1/previous/result.json") == {"status": "failed"}
    assert store.get_json("launches/1/previous/results/0.json")["status"] == "failed"
    assert not store.exists("results/0.json")
    assert store.get("run.json") == spec_bytes
    assert driver.prepare_resume("old", store=str(base)).resume.launch == 2
