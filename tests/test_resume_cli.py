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

from crf import layout
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
    ("checkpoint_every", "killed_round", "lose_inner"),
    [(1, 3, False), (3, 4, False), (1, 3, True)],
    ids=["every-round", "every-3rd", "inner-state-lost"],
)
def test_kill_everything_mid_run_then_resume(
    tmp_path: Path, checkpoint_every: int, killed_round: int, lose_inner: bool
) -> None:
    """The driver is SIGKILLed after round 0 (its replicas go on without it), then every
    replica is SIGKILLed in round ``killed_round``'s inner steps (CRF_FAULT). ``--resume``
    continues from the newest global state every replica saved its inner state for (global/2)
    and ends bit-identical to the same run left alone. With ``--checkpoint-every 3`` global/2
    is the newest (rounds 3 and 4 were committed but not saved): the resumed replicas train
    them again, from the saved state; that kill comes in round 5, ten inner steps after round
    2's sync, so the background writes of global/2 (the run's first global state) have landed
    even on a loaded machine (in round 4 the kill could come before them).
    ``inner-state-lost``: the last replica dies in its checkpoint writer instead, before its
    inner state of round 2 is uploaded (its part of global/2 is written before it, in the
    same writer), so round 1 is the newest with every inner state and the store keeps it:
    the resume sets global/2 aside (kept, not deleted) when it landed whole, starts from
    round 1 and still ends bit-identical."""
    base = tmp_path / "bucket"
    faults = [f"rank={k},point=inner_step,step={killed_round * H + 2}" for k in range(N)]
    if lose_inner:  # the last replica's inner state of the round before never lands
        faults[-1] = f"rank={N - 1},point=inner_write,round={killed_round - 1}"
    out = {name: open(tmp_path / f"{name}.log", "w") for name in ("ref", "victim")}  # noqa: SIM115
    launch = ["launch", "--store", str(base), "--no-progress", *COMMON]
    ref = subprocess.Popen(
        crf_cmd(*launch, "--run-id", "ref"), env=_env(), stdout=out["ref"], stderr=subprocess.STDOUT
    )
    victim = subprocess.Popen(
        crf_cmd(*launch, "--run-id", "victim", "--checkpoint-every", str(checkpoint_every)),
        env={**_env(), "CRF_FAULT": ";".join(faults)},
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
            f"every replica to be killed in round {killed_round}",
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

    # what the kill left: rounds 0-2 committed and saved, the killed round half-trained and
    # lost. The saves run in the background: a kill 2 inner steps into round 3 can land before
    # one of round 2's writes did (then the resume starts from global/1, which the test accepts)
    store = RunStore(f"file://{run}")
    # a global round is there once its state landed (a kill mid-write can leave its folder)
    globals_ = layout.global_rounds(store, complete=True)
    newest = globals_[-1]
    assert newest == 2 or (checkpoint_every == 1 and newest == 1), globals_
    complete = [
        g for g in globals_ if all(store.exists(f"replicas/{k}/inner/{g}.pt") for k in range(N))
    ]
    latest = complete[-1]  # where the resume must start
    assert latest in (newest, newest - 1), (globals_, complete)
    if lose_inner:  # the last replica's inner/2 never landed: global/1 was kept for it
        assert not store.exists(f"replicas/{N - 1}/inner/{killed_round - 1}.pt")
        assert latest == killed_round - 2, (globals_, complete)
    set_aside = [g for g in globals_ if g > latest]
    inner = [
        decode_blob(store.get(f"replicas/{k}/inner/{latest}.pt"))[1]["round"] for k in range(N)
    ]
    assert inner == [latest] * N, (latest, inner)
    aside_bytes = {key: store.get(key) for g in set_aside for key in layout.global_parts(store, g)}
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
    for g in set_aside:
        assert "set aside" in proc.stdout and f"global/{g}" in proc.stdout, proc.stdout
    for key, data in aside_bytes.items():  # set aside, byte for byte, and written again
        assert (run / layout.superseded_key(1, key)).read_bytes() == data
    assert "start it afresh" not in proc.stdout

    result = json.loads((run / "result.json").read_text())
    reference = json.loads((base / "ref" / "result.json").read_text())
    assert result["status"] == "ok" and result["launch"] == 1
    assert result["resumed_from_round"] == latest
    # as many rounds as the uninterrupted run; none lost, none trained twice
    assert result["rounds_completed"] == reference["rounds_completed"] == ROUNDS
    assert result["rounds_lost"] == []
    assert layout.global_complete(store, ROUNDS - 1)
    for row in result["replicas"]:
        assert row["resumed_from"] == latest and row["steps"] == ROUNDS * H, row
        assert row["rounds_missed"] == [], row
        logged = sorted(int(p.stem) for p in (run / "metrics" / str(row["rank"])).glob("*.json"))
        assert logged == list(range(ROUNDS)), logged
    assert {p: p.stat().st_mtime_ns for p in done_before} == done_before  # none redone
    if checkpoint_every > 1:  # the last periodic global (a resume's start) and the last
        assert layout.global_rounds(store, complete=True) == [5, 7]
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


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_of_one_replica_resumes_where_it_was_killed(tmp_path: Path) -> None:
    """A run of one replica exchanges nothing, but it writes its global state as any run
    does: killed in round 3 (and not restarted), ``--resume`` continues from a round it
    committed, not from the start, and ends bit-identical to the run left alone."""
    base, rounds = tmp_path / "bucket", 6
    one = ["--store", str(base), "--no-progress", "--job", "lm", "-n", "1", "-H", str(H),
           "-r", str(rounds), "--round-timeout", "30", *TINY_SETS]  # fmt: skip
    ref = subprocess.run(crf_cmd("launch", *one, "--run-id", "ref"), env=_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    fault = f"rank=0,point=inner_step,step={3 * H + 2}"
    killed = subprocess.run(
        crf_cmd("launch", *one, "--run-id", "victim", "--max-restarts", "0"),
        env={**_env(), "CRF_FAULT": fault}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode != 0, killed.stdout + killed.stderr
    run = RunStore(f"file://{base / 'victim'}")
    assert layout.global_rounds(run, complete=True), "a run of one replica saved no round"
    resumed = subprocess.run(
        crf_cmd("launch", "--resume", "victim", "--store", str(base), "--no-progress"),
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    result = json.loads((base / "victim" / "result.json").read_text())
    reference = json.loads((base / "ref" / "result.json").read_text())
    # the background write of round 2 may not have landed before the kill: then round 1
    assert result["resumed_from_round"] in (1, 2), result["resumed_from_round"]
    assert result["status"] == "ok" and result["rounds_completed"] == rounds
    assert result["weights_sha256"] == reference["weights_sha256"]


@pytest.mark.e2e
def test_a_run_whose_replicas_all_finished_is_not_resumed_but_gathered(tmp_path: Path) -> None:
    """A detached run nobody gathered: its replicas all reported ok after their last step,
    and no summary exists. ``--resume`` would start every replica again to train nothing;
    it says the run finished and that ``crf status`` writes its summary, which it does."""
    base = tmp_path / "bucket"
    launch = subprocess.run(
        crf_cmd("launch", "--store", str(base), "--run-id", "det", "--detach", "--job", "lm",
                "-n", "2", "-H", "2", "-r", "2", *TINY_SETS),
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launch.returncode == 0, launch.stdout + launch.stderr
    run = base / "det"

    def finished() -> bool:
        try:
            results = [json.loads((run / f"results/{k}.json").read_text()) for k in (0, 1)]
        except (OSError, ValueError):
            return False
        return all(r["status"] == "ok" for r in results)

    _wait(finished, 240, "both replicas to finish")
    pids = [json.loads((run / f"replicas/{k}/state.json").read_text())["pid"] for k in (0, 1)]
    _wait(lambda: not any(_alive(p) for p in pids), 60, "the replica processes to exit")
    assert not (run / "result.json").exists()
    resumed = _cli("launch", "--resume", "det", "--store", str(base))
    assert resumed.exit_code == 2, resumed.output
    assert "run det already finished: every replica reported ok" in resumed.output
    assert f"crf status det --store file://{base}" in resumed.output
    assert sorted(p.name for p in (run / "launches").glob("*.json")) == ["0.json"]
    assert _cli("status", "det", "--store", str(base)).exit_code == 0
    assert json.loads((run / "result.json").read_text())["status"] == "ok"


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
    said = refused("--run-id", "old", "--job", "lm")  # and --resume is not suggested for it
    assert "choose another --run-id (it cannot be resumed: run old already finished" in said
    assert "continue it with --resume" not in said
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
    # its driver (this process) lives and has started no replica yet: another resume now
    # would start a second set of replicas
    with pytest.raises(
        LaunchError, match=f"launch 1 \\(driver pid {os.getpid()} on .*\\) is starting"
    ):
        driver.prepare_resume("old", store=str(base))
    record = store.get_json("launches/1.json")  # once that driver has ended its launch
    store.put_json("launches/1.json", record | {"ended_at": time.time(), "status": "failed"})
    assert driver.prepare_resume("old", store=str(base)).resume.launch == 2


def test_a_resume_is_refused_while_the_backend_runs_replicas_without_heartbeats(
    tmp_path: Path,
) -> None:
    """Right after a detached launch its replicas have written no heartbeat yet (seconds on
    this host, minutes while a cloud container starts): the launch's saved handles and the
    backend say they run, and a resume then would start a second replica for each rank."""
    from crf.executors.base import ReplicaHandle

    base = tmp_path / "runs"
    store = _fake_run(base)
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "CRF_RUN_ID": "old", "CRF_RANK": "1"},
    )
    try:
        handle = ReplicaHandle(backend="local", run_id="old", rank=1, world_size=2,
                               backend_id=str(sleeper.pid), run_uri=store.uri)  # fmt: skip
        store.put_json(layout.launch_key(0), {"launch": 0, "started_at": time.time()})
        store.put_json(layout.handles_key(0), {"handles": [handle.to_dict()]})
        assert not store.exists("replicas/1/state.json")  # no heartbeat
        with pytest.raises(LaunchError) as refused:
            driver.prepare_resume("old", store=str(base))
        said = str(refused.value)
        assert "still has running replicas: replica 1 (running on local)" in said, said
        assert "crf cancel old" in said
    finally:
        sleeper.kill()
        sleeper.wait()
    assert driver.prepare_resume("old", store=str(base)).resume is not None  # it ended


def test_crf_runs_says_running_only_of_a_run_whose_replicas_may_run(tmp_path: Path) -> None:
    """``crf runs`` judges liveness as a resume does: a fresh heartbeat from this host whose
    pid has ended (a killed replica) is a stopped run, one from another host is running;
    and a copied run folder is listed under its own name, which the commands take."""
    import shutil

    from crf.launcher.attach import list_runs

    base = tmp_path / "runs"
    store = _fake_run(base)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    beat = {"phase": "training", "pid": ended.pid, "host": socket.gethostname(),
            "run_id": "old", "rank": 0, "updated_at": time.time()}  # fmt: skip
    store.put_json("replicas/0/state.json", beat)
    assert [(r["run_id"], r["status"]) for r in list_runs(str(base))] == [("old", "stopped")]
    store.put_json("replicas/0/state.json", beat | {"host": "elsewhere", "pid": 1})
    assert [r["status"] for r in list_runs(str(base))] == ["running"]
    store.put_json("replicas/0/state.json", beat | {"host": "elsewhere", "updated_at": 1.0})
    shutil.copytree(base / "old", base / "copy")
    assert sorted((r["run_id"], r["status"]) for r in list_runs(str(base))) == [
        ("copy", "stopped"), ("old", "stopped"),
    ]  # fmt: skip


def test_crf_runs_says_a_cloud_launch_whose_driver_is_gone_is_starting_then_unknown(
    tmp_path: Path,
) -> None:
    """A detached cloud launch (its driver gone) whose replicas have not beaten: ``crf
    runs`` reads only the store, so it calls the run ``starting`` while a container may
    still be starting (``CLOUD_START_S`` after its handles), then ``unknown`` with why -
    never ``stopped``, which it may not be. A resume still asks the backend itself."""
    from crf.executors.base import ReplicaHandle
    from crf.launcher.attach import list_runs
    from crf.launcher.liveness import CLOUD_START_S

    base = tmp_path / "runs"
    store = _fake_run(base)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.time()
    record = {"launch": 0, "started_at": started, "host": socket.gethostname(),
              "pid": gone.pid, "backend": "modal"}  # fmt: skip
    store.put_json(layout.launch_key(0), record)

    def save(at: float) -> None:
        handles = [ReplicaHandle(backend="modal", run_id="old", rank=k, world_size=2,
                                 backend_id=f"sb-{k}", run_uri=store.uri, started_at=at)
                   for k in range(2)]  # fmt: skip
        store.put_json(layout.handles_key(0), {"handles": [h.to_dict() for h in handles]})

    save(started)
    [row] = list_runs(str(base))
    assert row["status"] == "starting" and "note" not in row, row
    save(started - CLOUD_START_S - 60)  # long past any container's start
    [row] = list_runs(str(base))
    assert row["status"] == "unknown", row
    assert "started its replicas on modal 31 min ago and none has written a heartbeat" in (
        row["note"])  # fmt: skip
    assert [r["run_id"] for r in list_runs(str(base), status=["unknown"])] == ["old"]
    result = _cli("runs", "--store", str(base))
    flat = " ".join(result.output.split())
    assert result.exit_code == 0 and f"ask it with crf status old --store {base}" in flat, flat
    # once a replica beats, it says what its heartbeat says; a summary ends the question
    beat = {"rank": 0, "phase": "training", "host": "elsewhere", "updated_at": time.time()}
    store.put_json("replicas/0/state.json", beat)
    assert [r["status"] for r in list_runs(str(base))] == ["running"]
    store.put_json("replicas/0/state.json", beat | {"updated_at": started - 1})  # older
    store.put_json(layout.RESULT, {"run_id": "old", "status": "failed", "launch": 0})
    assert [r["status"] for r in list_runs(str(base))] == ["failed"]


def test_a_resume_checks_the_runs_data_again_before_its_replicas_start(tmp_path: Path) -> None:
    """A local run's data file edited since its launch (a null prompt) would stop every
    replica at setup: the resume refuses it in one line, and says to continue once fixed."""
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{w}=", "answer": w[::-1]} for w in ["ab", "bca", "cab", "dd"] * 8]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = tmp_path / "runs"
    store = RunStore(f"file://{base}/old")
    spec = RunSpec(run_id="old", run_uri=store.uri, replicas=2, dataset=str(data)).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    assert driver.prepare_resume("old", store=str(base)).resume is not None  # as launched
    rows[5] = {"prompt": None, "answer": "x"}
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(LaunchError) as refused:
        driver.prepare_resume("old", store=str(base))
    said = str(refused.value)
    assert f"--dataset {data} line 6: the prompt" in said, said
    assert said.endswith("fix it, then run crf launch --resume old again)")
    assert not store.exists(layout.launch_key(1)) and "\n" not in said


SCORE = "def score(completions, **kw):\n    return [1.0 for _ in completions]\n"


def test_a_resume_checks_the_runs_rewards_again_before_its_replicas_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local run's reward module edited since its launch, into one that fails as the
    trainer calls it or as it is imported, would stop every replica: the resume refuses it
    in one line that says to continue once fixed, and imports the module anew each time
    (this process imported it at the first resume check)."""
    monkeypatch.chdir(tmp_path)  # the replicas' working directory: the driver's
    module = tmp_path / "rw_again.py"
    module.write_text(SCORE)
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{w}=", "answer": w[::-1]} for w in ["ab", "bca", "cab", "dd"] * 8]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = tmp_path / "runs"
    store = RunStore(f"file://{base}/old")
    spec = RunSpec(run_id="old", run_uri=store.uri, replicas=2, dataset=str(data),
                   reward=["rw_again:score"]).validate()  # fmt: skip
    store.put_if_absent("run.json", spec.to_json().encode())
    assert driver.prepare_resume("old", store=str(base)).resume is not None  # as launched

    def refused() -> str:
        with pytest.raises(LaunchError) as e:
            driver.prepare_resume("old", store=str(base))
        said = str(e.value)
        assert said.endswith("(checked again to continue run old: fix it, then run crf launch "
                             "--resume old again)"), said  # fmt: skip
        assert "\n" not in said and not store.exists(layout.launch_key(1))
        return said

    module.write_text("def score(completions, **kw):\n    raise KeyError('answer')\n")
    assert "--reward rw_again:score raised KeyError: 'answer'" in refused()
    module.write_text("import no_such_module_anywhere\n" + SCORE)
    assert "--reward rw_again:score: cannot import it" in refused()
    module.write_text(SCORE)
    assert driver.prepare_resume("old", store=str(base)).resume is not None
    assert "rw_again" not in sys.modules  # the checks' imports are not left behind


def test_a_resume_checks_the_rewards_its_shipped_workdir_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --workdir the replicas import their rewards from the copy shipped into the run
    folder at launch, not from that folder as it is now: the resume checks that copy, even
    from inside the folder (where the folder's own module would import first otherwise)."""
    from crf.executors.workdir import pack_workdir

    wd = tmp_path / "code"
    wd.mkdir()
    monkeypatch.chdir(wd)
    base = tmp_path / "runs"

    def shipped(run_id: str, body: str) -> None:
        (wd / "rw_shipped.py").write_text(body)
        packed = pack_workdir(wd)
        store = RunStore(f"file://{base}/{run_id}")
        key = layout.workdir_key(packed.sha256[:16])
        spec = RunSpec(run_id=run_id, run_uri=store.uri, replicas=2, workdir=str(wd),
                       reward=["rw_shipped:score"], workdir_key=key)  # fmt: skip
        store.put(spec.workdir_key, packed.data)
        store.put_if_absent("run.json", spec.validate().to_json().encode())

    shipped("broken", "def (:\n" + SCORE)
    shipped("fine", SCORE)
    (wd / "rw_shipped.py").write_text(SCORE)  # the folder now: fixed, but not what shipped
    with pytest.raises(LaunchError) as refused:
        driver.prepare_resume("broken", store=str(base))
    said = str(refused.value)  # the shipped file, named as the user's (not the check's copy)
    assert "importing rw_shipped raised SyntaxError" in said, said
    assert f"({wd}/rw_shipped.py, line 1)" in said and "crf-workdir-check" not in said, said
    (wd / "rw_shipped.py").write_text("import no_such_module_anywhere\n" + SCORE)
    assert driver.prepare_resume("fine", store=str(base)).resume is not None
    assert "rw_shipped" not in sys.modules


def test_crf_launch_resume_refuses_a_reward_module_edited_into_an_error(tmp_path: Path) -> None:
    """A real run with a ``module:function`` reward fails; its reward module is then edited
    into one that raises as it is imported: ``crf launch --resume`` says so in one line
    before any replica starts (no new launch is claimed), and continues the run once the
    module is fixed."""
    from tests.test_cli import REPLICA_SCRIPT

    (tmp_path / "replica.py").write_text(REPLICA_SCRIPT)
    module = tmp_path / "rw_edit.py"
    module.write_text(SCORE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def crf(*args: str, fail: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "crf.launcher.cli", *args, "--store",
                               "runs", "--no-progress"], cwd=tmp_path, capture_output=True,
                              text=True, env={**env, "FAIL_RANKS": fail}, timeout=300)  # fmt: skip

    first = crf("launch", "--run-id", "rw", "-n", "2", "--rounds", "3", "--reward",
                "rw_edit:score", "--entrypoint", "python replica.py", fail="1")  # fmt: skip
    assert first.returncode == 1, first.stdout + first.stderr
    module.write_text("raise RuntimeError('edited since the launch')\n" + SCORE)
    again = crf("launch", "--resume", "rw")
    out = again.stdout + again.stderr
    assert again.returncode == 2 and len(out.strip().splitlines()) == 1, out
    assert "--reward rw_edit:score: importing rw_edit raised RuntimeError: edited since" in out
    assert "fix it, then run crf launch --resume rw again" in " ".join(out.split())
    assert sorted(os.listdir(tmp_path / "runs" / "rw" / "launches")) == ["0", "0.json"]
    module.write_text(SCORE)
    fixed = crf("launch", "--resume", "rw")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert json.loads((tmp_path / "runs/rw/result.json").read_text())["status"] == "ok"


def test_resume_point_is_the_newest_global_every_inner_state_exists_for() -> None:
    """A checkpoint is global/<r> plus each replica's inner/<r>: the resume starts from the
    newest complete one and sets the newer ones aside; with none complete, from the newest."""
    spec = RunSpec(run_id="x", run_uri="memory://x", job="lm", replicas=3, rounds=8).validate()
    every = {k: {0, 1, 2} for k in range(3)}
    assert driver.resume_point(spec, [], every) == (None, [], [])
    assert driver.resume_point(spec, [0, 1, 2], every) == (2, [], [])
    lost = every | {2: {0, 1}}  # replica 2's inner/2 never landed
    assert driver.resume_point(spec, [0, 1, 2], lost) == (1, [2], [])
    assert driver.resume_point(spec, [2], lost) == (2, [], [2])  # none complete: the newest
    none_saved = RunSpec(**{**spec.__dict__, "save_inner_state": False}).validate()
    assert driver.resume_point(none_saved, [1, 2], {}) == (2, [], [])
    # --checkpoint-every 3: inner states exist for the periodic rounds (2, 5) and the last (7)
    k3 = RunSpec(**{**spec.__dict__, "checkpoint_every": 3}).validate()
    assert driver.resume_point(k3, [2, 5], {k: {2, 5} for k in range(3)}) == (5, [], [])
    # a global written on request (round 3, to heal someone) has no inner states: not a cut
    assert driver.resume_point(k3, [2, 3], {k: {2} for k in range(3)}) == (2, [3], [])


def test_resume_sets_aside_a_global_state_without_its_inner_states(tmp_path: Path) -> None:
    """On a real folder: prepare_resume picks global/1 when replica 1's inner/2 is missing;
    claiming the launch moves global/2 under launches/1/superseded/ byte for byte (nothing
    lost) and leaves global/1 and every inner state where it was."""
    base = tmp_path / "runs"
    store = _fake_run(base)  # 2 replicas
    for g in (1, 2):
        store.put(layout.global_key(g), f"state {g}".encode())
        for k in range(2):
            if (g, k) != (2, 1):
                store.put(f"replicas/{k}/inner/{g}.pt", f"inner {k} {g}".encode())
    store.put("rounds/2/quorum.json", b"{}")  # the stopped launch's round 2: redone
    plan = driver.prepare_resume("old", store=str(base))
    assert plan.resume is not None
    assert (plan.resume.from_round, plan.resume.superseded) == (1, [2])
    assert plan.resume.fresh_inner == []
    assert store.exists(layout.global_key(2))  # nothing moves before the launch is claimed
    assert driver._start_launch(plan, time.time()) == 1
    assert sorted(store.list("global")) == ["1"]
    assert store.get(layout.superseded_key(1, layout.global_key(2))) == b"state 2"
    assert store.get(layout.global_key(1)) == b"state 1"
    assert store.get("replicas/0/inner/2.pt") == b"inner 0 2"
    assert not store.exists("rounds/2")
    # the next resume (once that launch's driver ended it) finds global/1 complete again:
    # nothing more to set aside
    record = store.get_json("launches/1.json")
    store.put_json("launches/1.json", record | {"ended_at": time.time(), "status": "failed"})
    again = driver.prepare_resume("old", store=str(base))
    assert again.resume is not None and again.resume.superseded == []
    assert again.resume.from_round == 1


def test_a_global_folder_whose_state_never_landed_is_not_a_round(tmp_path: Path) -> None:
    """A kill during a global state's write can leave ``global/<r>/`` holding only the
    writer's temp file. Every replica saved its inner state of round 2, but global/2 never
    landed: the resume starts from global/1 (whole), not from a round with no state. Claiming
    the launch deletes that folder: left in place, it told every resumed replica that the
    others were past round 2 already, and they all waited to heal from a global/2 nobody
    wrote (a HealError for each, seen on a loaded machine)."""
    base = tmp_path / "runs"
    store = _fake_run(base)  # 2 replicas
    store.put(layout.global_key(1), b"state 1")
    # the write a kill cut short
    store.put(f"{layout.global_dir(2)}/.state.safetensors.tmp-crf", b"half a st")
    for g in (1, 2):
        for k in range(2):
            store.put(f"replicas/{k}/inner/{g}.pt", f"inner {k} {g}".encode())
    plan = driver.prepare_resume("old", store=str(base))
    assert plan.resume is not None
    assert (plan.resume.from_round, plan.resume.superseded) == (1, [])
    assert driver._start_launch(plan, time.time()) == 1
    assert sorted(store.list("global")) == ["1"]  # the cut write is gone
    assert store.get(layout.global_key(1)) == b"state 1"
    assert store.get("replicas/1/inner/2.pt") == b"inner 1 2"  # inner states stay


def test_a_global_round_with_a_part_missing_is_not_a_round(tmp_path: Path) -> None:
    """global/2 has part 0 of 2 but not part 1 (its writer was killed): the resume starts from
    global/1, whose parts are all there, and claiming the launch deletes global/2's folder
    (nothing in it can be read) and keeps global/1's parts as they are."""
    base = tmp_path / "runs"
    store = _fake_run(base)  # 2 replicas
    for g in (1, 2):
        for s in range(2):
            if (g, s) != (2, 1):
                store.put(layout.global_part_key(g, s, 2), f"part {s} of {g}".encode())
        for k in range(2):
            store.put(f"replicas/{k}/inner/{g}.pt", f"inner {k} {g}".encode())
    assert layout.global_rounds(store, complete=True) == [1]
    plan = driver.prepare_resume("old", store=str(base))
    assert plan.resume is not None
    assert (plan.resume.from_round, plan.resume.superseded) == (1, [])
    assert driver._start_launch(plan, time.time()) == 1
    assert sorted(store.list("global")) == ["1"]
    assert store.get(layout.global_part_key(1, 1, 2)) == b"part 1 of 1"
