"""`crf launch --dry-run / --detach` and `crf runs / status / logs / cancel` from other processes.

Every command runs as its own `crf` process (the launcher exits after --detach; status, logs
and cancel then reattach through the store alone), with the contract-following replica script
of test_cli.py as the entrypoint, so no training stack is needed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_cli import REPLICA_SCRIPT

CRF = [sys.executable, "-m", "crf.launcher.cli"]


def crf(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    p = subprocess.run([*CRF, *args], capture_output=True, text=True, env=full_env, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "my_train.py"
    path.write_text(REPLICA_SCRIPT)
    return path


def _launch(base: Path, script: Path, run_id: str, *extra: str, env=None) -> tuple[int, str]:
    return crf(
        "launch", "--job", "lm", "--store", str(base), "--run-id", run_id, "-n", "2",
        "--rounds", "3", "--entrypoint", f"python {script}", "--no-progress", *extra, env=env,
    )  # fmt: skip


def _wait_ended(base: Path, run_id: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [base / run_id / "replicas" / str(r) / "state.json" for r in range(n)]
        if all(p.exists() and json.loads(p.read_text())["phase"] == "done" for p in done):
            time.sleep(0.5)  # the processes exit right after their last heartbeat
            return
        time.sleep(0.2)
    raise AssertionError("replicas did not finish")


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path, script: Path) -> None:
    base = tmp_path / "runs"
    code, out = _launch(base, script, "dry", "--dry-run")
    assert code == 0, out
    words = ("backend", "local", "replicas", "hardware", "cost", "free", "nothing was launched")
    for word in words:
        assert word in out
    assert not (base / "dry").exists()


def test_dry_run_cloud_backend_lists_a_local_store(tmp_path: Path, script: Path) -> None:
    """A store the containers cannot reach is missing, not bad input: listed after the plan
    (exit 0), exit 2 with --strict; a launch refuses it."""
    code, out = _launch(tmp_path / "runs", script, "x", "--backend", "hf", "--dry-run",
                        "--strict")  # fmt: skip
    assert code == 2
    assert "missing before this run can launch" in out and "cost" in out
    assert "use an object store" in out and "Traceback" not in out
    code, out = _launch(tmp_path / "runs", script, "x", "--backend", "hf")
    assert code == 2 and "use an object store" in out and "cost" not in out
    assert not (tmp_path / "runs" / "x").exists()


def test_backend_options_are_checked(tmp_path: Path, script: Path) -> None:
    code, out = _launch(tmp_path / "runs", script, "x", "--gpu", "A10G")
    assert code == 2 and "local backend has no --hardware option" in out
    code, out = _launch(tmp_path / "runs", script, "x", "-o", "nope=1")
    assert code == 2 and "has no option nope" in out
    code, out = _launch(tmp_path / "runs", script, "x", "-o", "novalue")
    assert code == 2 and "--opt expects KEY=VALUE" in out
    assert not (tmp_path / "runs" / "x").exists()


def test_detach_then_status_logs_and_runs(tmp_path: Path, script: Path) -> None:
    base = tmp_path / "runs"
    code, out = _launch(base, script, "det", "--detach")
    assert code == 0, out
    assert "detached" in out and "crf status det" in out
    handles = json.loads((base / "det" / "launches" / "0" / "handles.json").read_text())
    assert [h["rank"] for h in handles["handles"]] == [0, 1]
    backend = json.loads((base / "det" / "backend.json").read_text())
    assert backend["backend"] == "local"
    _wait_ended(base, "det", 2)
    assert not (base / "det" / "result.json").exists()  # nobody gathered yet

    code, out = crf("logs", "det", "--store", str(base))
    assert code == 0, out
    assert "[0] replica 0 running job lm" in out and "[1] replica 1 running job lm" in out
    code, out = crf("logs", "det", "--store", str(base), "--rank", "1", "--follow")
    assert code == 0 and "replica 1 running job lm" in out and "[1]" not in out

    code, out = crf("status", "det", "--store", str(base))
    assert code == 0, out
    assert "succeeded" in out and "run ok" in out
    result = json.loads((base / "det" / "result.json").read_text())
    assert result["status"] == "ok" and result["launch"] == 0
    assert [r["ok"] for r in result["replicas"]] == [True, True]
    # its wall time is the replicas' (their last heartbeats), not the time until gathered
    beats = [json.loads((base / "det" / "replicas" / str(r) / "state.json").read_text())
             for r in (0, 1)]  # fmt: skip
    assert result["ended_at"] == max(b["updated_at"] for b in beats)
    assert result["wall_s"] == round(result["ended_at"] - result["started_at"], 3)
    # and the table above it says the same time, not the time since the run started
    shown = re.search(r"2/2 done, (\d+)s,", out)
    assert shown and abs(int(shown[1]) - result["wall_s"]) <= 1, out

    code, out = crf("runs", "--store", str(base))
    assert code == 0 and "det" in out and "ok" in out
    code, out = crf("runs", "--store", str(base), "--status", "failed", "--status", "stopped")
    assert code == 0 and out.strip() == f"no failed or stopped runs in {base}", out


def test_cancel_a_detached_run_from_another_process(tmp_path: Path, script: Path) -> None:
    base = tmp_path / "runs"
    code, out = _launch(base, script, "long", "--detach", env={"SLEEP_RANKS": "0,1"})
    assert code == 0, out
    pids = [
        int(h["backend_id"])
        for h in json.loads((base / "long/launches/0/handles.json").read_text())["handles"]
    ]
    code, out = crf("status", "long", "--store", str(base))
    assert code == 0 and "running" in out
    code, out = crf("runs", "--store", str(base))
    assert "running" in out

    code, out = crf("cancel", "long", "--store", str(base))
    assert code == 0, out
    assert "cancelled 2 running replica(s)" in out
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    result = json.loads((base / "long" / "result.json").read_text())
    assert result["status"] == "cancelled"
    # the replicas it stopped are cancelled, not failed (to its executor they died of SIGTERM)
    assert [r["state"] for r in result["replicas"]] == ["cancelled", "cancelled"]
    assert (base / "long" / "launches" / "0" / "cancel.json").exists()
    code, out = crf("status", "long", "--store", str(base))
    assert code == 130 and "cancelled" in out
    # the replicas' table says so too, not "failed" over a summary that says "cancelled"
    assert "failed" not in out, out


def test_status_of_an_ended_run_shows_its_restarts_and_exit_codes(
    tmp_path: Path, script: Path
) -> None:
    """Replica 1 is killed once and restarted by the driver: `crf status` from another
    process (whose backend knows neither the driver's restarts nor the exit codes of
    processes it did not start) shows them as the summary records them."""
    marker = tmp_path / "killed"
    killer = tmp_path / "killer.py"
    killer.write_text(
        "import os, signal\n"
        f"if os.environ['CRF_RANK'] == '1' and not os.path.exists({str(marker)!r}):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n" + script.read_text()
    )
    base = tmp_path / "runs"
    code, out = _launch(base, killer, "re")
    assert code == 0 and marker.exists(), out
    code, out = crf("status", "re", "--store", str(base), "--json")
    assert code == 0, out
    replicas = json.loads(out)["replicas"]
    assert [(r["restarts"], r["exit_code"]) for r in replicas] == [(0, 0), (1, 0)], replicas
    # the table's time is the summary's wall time (here made 100 s), not its replicas'
    path = base / "re" / "result.json"
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "ended_at": result["started_at"] + 100.0}))
    code, out = crf("status", "re", "--store", str(base))
    assert code == 0 and "2/2 done, 100s," in out, out


def test_status_of_an_unknown_run_says_how_to_find_runs(tmp_path: Path) -> None:
    code, out = crf("status", "nope", "--store", str(tmp_path))
    assert code == 2 and "no run 'nope'" in out and "crf runs" in out


def test_a_damaged_run_is_listed_as_damaged_and_named_by_status(tmp_path: Path) -> None:
    """One run folder whose run.json has a field of the wrong type, another whose run.json is
    not JSON: ``crf runs`` still lists the store (exit 0), each damaged run as ``damaged``
    with why; ``crf status`` on one is one line naming the file and the field; ``crf rm``
    removes it."""
    import crf as sdk
    from crf.spec import RunSpec

    base = tmp_path / "runs"
    good = RunSpec(run_id="good", run_uri=(base / "good").as_uri(), job="lm", rounds=2)
    (base / "good").mkdir(parents=True)
    (base / "good" / "run.json").write_text(good.to_json())
    (base / "good" / "result.json").write_text(json.dumps({"run_id": "good", "status": "ok"}))
    wrong = json.loads(good.to_json()) | {"run_id": "typed", "replicas": "4"}
    (base / "typed").mkdir()
    (base / "typed" / "run.json").write_text(json.dumps(wrong))
    (base / "torn").mkdir()
    (base / "torn" / "run.json").write_text('{"run_id": "torn", "repl')

    code, out = crf("runs", "--store", str(base), "--json")
    assert code == 0, out
    rows = {r["run_id"]: r for r in json.loads(out)}
    assert rows["good"]["status"] == "ok" and rows["good"]["rounds"] == 2
    assert rows["typed"]["status"] == rows["torn"]["status"] == "damaged"
    assert "typed/run.json is damaged: field replicas" in rows["typed"]["error"]
    assert "torn/run.json is damaged: not valid JSON" in rows["torn"]["error"]
    code, out = crf("runs", "--store", str(base))
    assert code == 0 and "good" in out and out.count("damaged") >= 4, out  # rows and reasons
    code, out = crf("runs", "--store", str(base), "--status", "damaged", "--json")
    assert code == 0 and sorted(r["run_id"] for r in json.loads(out)) == ["torn", "typed"]
    assert {i.run_id: i.status for i in sdk.runs(str(base))}["typed"] == "damaged"

    code, out = crf("status", "typed", "--store", str(base))
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "run.json is damaged: field replicas: --replicas must be an integer" in out
    code, out = crf("rm", "torn", "--store", str(base), "--yes")
    assert code == 0 and not (base / "torn").exists(), out


def test_cancel_while_the_launch_is_still_starting_says_to_try_again(tmp_path: Path) -> None:
    """Between run.json and the replicas' handles the driver is still starting them: crf
    cancel (status, logs) says so and to try again, rather than that nothing runs; once
    that driver is gone, it says there is nothing to attach to."""
    import socket

    from crf.spec import RunSpec
    from crf.store import RunStore

    base = tmp_path / "runs"
    store = RunStore(f"file://{base}/early")
    spec = RunSpec(run_id="early", run_uri=store.uri, job="lm", replicas=2).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"launch": 0, "started_at": time.time(), "host": socket.gethostname(),
                  "pid": driver.pid, "backend": "local"}  # fmt: skip
        store.put_json("launches/0.json", record)
        code, out = crf("cancel", "early", "--store", str(base))
        flat = " ".join(out.split())
        assert code == 2 and "run early is still starting: its launch 0" in flat, out
        assert "try again in a moment" in flat
        code, out = crf("runs", "--store", str(base), "--json")
        assert code == 0 and json.loads(out)[0]["status"] == "starting", out
        # a resume now would start a second set of replicas: refused, and not offered
        starting = f"launch 0 (driver pid {driver.pid} on {socket.gethostname()}) is starting"
        code, out = crf("launch", "--resume", "early", "--store", str(base), "--dry-run")
        assert code == 2 and starting in " ".join(out.split()), out
        code, out = crf("launch", "--job", "lm", "--run-id", "early", "--store", str(base))
        flat = " ".join(out.split())
        assert code == 2 and f"it is still running ({starting}" in flat, out
        assert "crf cancel early" in flat and "--resume" not in flat, out
    finally:
        driver.kill()
        driver.wait()
    code, out = crf("cancel", "early", "--store", str(base))
    assert code == 2 and "nothing to attach to" in out and "still starting" not in out, out
    code, out = crf("runs", "--store", str(base), "--json")
    assert code == 0 and json.loads(out)[0]["status"] == "stopped", out
    code, out = crf("launch", "--resume", "early", "--store", str(base), "--dry-run")
    assert code == 0, out


def test_a_damaged_result_is_rebuilt_with_a_warning(tmp_path: Path, script: Path) -> None:
    """A result.json that cannot be read (torn, hand-edited) is rebuilt from what the store
    holds when the run is gathered again, and ``crf status`` (and the SDK's wait) says so
    in one line naming the file, rather than replacing it without a word."""
    import warnings

    import crf as sdk

    base = tmp_path / "runs"
    code, out = _launch(base, script, "torn", "--detach")
    assert code == 0, out
    _wait_ended(base, "torn", 2)
    result = base / "torn" / "result.json"
    result.write_text('{"run_id": "torn", "stat')
    code, out = crf("runs", "--store", str(base), "--json")
    assert code == 0 and json.loads(out)[0]["status"] == "stopped", out  # no summary to read

    code, out = crf("status", "torn", "--store", str(base))
    assert code == 0, out
    flat = " ".join(out.split())
    said = f"warning: {result} was damaged (not valid JSON: Unterminated string"
    assert said in flat and "rebuilt from what the store holds" in flat, out
    assert flat.count("was damaged") == 1 and "Traceback" not in out
    rebuilt = json.loads(result.read_text())
    assert rebuilt["status"] == "ok" and rebuilt["launch"] == 0
    assert any("was damaged" in w for w in rebuilt["warnings"])
    code, out = crf("status", "torn", "--store", str(base))
    assert code == 0 and "was damaged" not in out, out  # read as it is now: nothing to say

    result.write_text("[1, 2]")  # JSON, but not a summary
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sdk.attach("torn", store=str(base)).wait(timeout=60)
    lines = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(lines) == 1 and "it holds a JSON list, not a summary" in lines[0], lines
    assert got.ok and any("was damaged" in w for w in got.warnings)
    assert json.loads(result.read_text())["status"] == "ok"


#: the replica script, held before its first heartbeat until the file $GATE exists
GATED_SCRIPT = (
    "import os, time\n"
    "while not os.path.exists(os.environ['GATE']):\n"
    "    time.sleep(0.05)\n" + REPLICA_SCRIPT
)


def _until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _statuses(base: Path) -> dict[str, str]:
    code, out = crf("runs", "--store", str(base), "--json")
    assert code == 0, out
    return {r["run_id"]: r["status"] for r in json.loads(out)}


def test_a_launch_whose_replicas_have_not_beaten_is_starting(tmp_path: Path) -> None:
    """A real crf launch whose replicas wait (before their first heartbeat) for a file:
    while its driver runs, and after a detached driver is gone while the replica processes
    it started still run, ``crf runs`` and ``crf status`` say ``starting``, not ``stopped``;
    once the replicas beat and end, the run is what they did."""
    import crf as sdk

    base, gate = tmp_path / "runs", tmp_path / "go"
    script = tmp_path / "gated.py"
    script.write_text(GATED_SCRIPT)
    env = {**os.environ, "GATE": str(gate)}
    args = [*CRF, "launch", "--job", "lm", "--store", str(base), "-n", "2", "--rounds", "3",
            "--entrypoint", f"python {script}", "--no-progress"]  # fmt: skip
    with (tmp_path / "driver.log").open("w") as log:
        driver = subprocess.Popen([*args, "--run-id", "held"], env=env, stdout=log, stderr=log)
    try:
        _until(lambda: (base / "held/launches/0/handles.json").exists(), "the replicas' handles")
        assert driver.poll() is None
        assert _statuses(base) == {"held": "starting"}
        code, out = crf("runs", "--store", str(base), "--status", "starting")
        assert code == 0 and "held" in out and "starting" in out, out
        code, out = crf("status", "held", "--store", str(base), "--json")
        assert code == 0 and json.loads(out)["status"] == "starting", out
        status = sdk.attach("held", store=str(base)).status()
        assert status.status == "starting" and status.running
        gate.touch()
        assert driver.wait(timeout=120) == 0, (tmp_path / "driver.log").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert _statuses(base) == {"held": "ok"}

    gate.unlink()
    code, out = crf(*args[len(CRF) :], "--run-id", "bg", "--detach", env={"GATE": str(gate)})
    assert code == 0 and "detached" in out, out
    assert _statuses(base)["bg"] == "starting"  # its driver has exited; its replicas wait
    code, out = crf("status", "bg", "--store", str(base))
    assert code == 0 and "starting (launch 0 on local)" in " ".join(out.split()), out
    gate.touch()
    _wait_ended(base, "bg", 2)
    assert _statuses(base)["bg"] == "stopped"  # ended, and nobody gathered it yet
    code, out = crf("status", "bg", "--store", str(base))
    assert code == 0 and _statuses(base) == {"held": "ok", "bg": "ok"}, out


def test_a_launch_into_a_run_that_still_runs_points_to_status_and_cancel(
    tmp_path: Path,
) -> None:
    """A second launch into the folder of a run whose replicas still run (real local
    processes, found by their heartbeats' pids) is refused in one line that says so and
    names crf status and crf cancel, not --resume (a resume would be refused too); once
    the run is cancelled, the line offers --resume."""
    import socket

    base = tmp_path / "runs"
    here = tmp_path / "here.py"  # the replica script, its heartbeats naming this host
    here.write_text("import socket\n" + REPLICA_SCRIPT.replace('"test"', "socket.gethostname()"))
    code, out = _launch(base, here, "busy", "--detach", env={"SLEEP_RANKS": "0,1"})
    assert code == 0, out
    beats = [base / "busy" / "replicas" / str(r) / "state.json" for r in (0, 1)]
    _until(lambda: all(p.exists() for p in beats), "the replicas' first heartbeats")
    assert json.loads(beats[0].read_text())["host"] == socket.gethostname()
    spec = (base / "busy" / "run.json").read_text()

    code, out = _launch(base, here, "busy")
    flat = " ".join(out.split())
    assert code == 2 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    pid = json.loads(beats[0].read_text())["pid"]
    assert f"it is still running (replica 0 (pid {pid} on this host), replica 1" in flat, out
    assert f"crf status busy --store {base} --watch" in flat, out
    assert f"crf cancel busy --store {base}" in flat and "--resume" not in flat, out
    assert (base / "busy" / "run.json").read_text() == spec  # nothing was written

    code, out = crf("cancel", "busy", "--store", str(base))
    assert code == 0, out
    code, out = _launch(base, here, "busy")
    flat = " ".join(out.split())
    assert code == 2 and "continue it with --resume busy" in flat, out
    assert "still running" not in flat
