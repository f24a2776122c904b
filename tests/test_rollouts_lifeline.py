"""A rollout worker ends by itself when it serves no one (crf/rollouts/lifeline.py): when the
run has ended, or when its trainer has shown no sign of life for ``--rollout-grace``; and
never while its trainer lives, however long one of its steps takes, since a replica keeps
its heartbeat alive (``alive_at``) through a long step (crf/replica/beacon.py).

The rule on a store the test writes; the heartbeat writer's thread; then real processes: a
detached local run whose trainer is killed (its worker ends within the grace, saying why)
and a trainer one of whose steps outlasts the grace (its worker goes on and ends with it).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crf import layout
from crf.replica.beacon import HeartbeatWriter
from crf.replica.context import HeartbeatPace
from crf.rollouts.lifeline import Lifeline
from crf.store import RunStore
from tests.test_rollouts_worker import ROOT, run_spec, worker_env

SHIM = str(ROOT / "tests" / "replica_shim.py")
JOB = {"num_examples": 32, "prompts_per_step": 2, "num_generations": 2}


def beat(store: RunStore, age_s: float, **fields: Any) -> None:
    """Trainer 0's heartbeat, written ``age_s`` ago."""
    record = {"rank": 0, "phase": "training", "updated_at": time.time() - age_s, **fields}
    store.put_json(layout.heartbeat_key(0), record)


def wait_for(pred: Any, what: str, timeout: float = 400.0) -> Any:
    """Poll until ``pred()`` is truthy (a generous deadline, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


# ------------------------------------------------------------------------------- the rule
def test_a_worker_goes_on_while_its_trainer_shows_life(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    line = Lifeline(store, rank=0, grace_s=60, launch=0, check_every_s=0)
    assert line.why_stop() is None  # no heartbeat yet: silent only since the worker started
    beat(store, age_s=50)
    assert line.why_stop() is None
    # no news for longer than the grace, but its process said it lives (a long step)
    beat(store, age_s=600, alive_at=time.time() - 5)
    assert line.why_stop() is None


def test_a_worker_stops_when_its_trainer_is_silent_past_the_grace(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    line = Lifeline(store, rank=0, grace_s=60, launch=0, check_every_s=0)
    line.seen = time.time() - 120  # the worker started two minutes ago
    beat(store, age_s=90, alive_at=time.time() - 70)
    why = line.why_stop()
    assert why is not None and "its trainer (replica 0) has shown no sign of life" in why
    assert "--rollout-grace 60 s" in why
    # a heartbeat from before the worker started counts from the worker's start
    fresh = Lifeline(store, rank=0, grace_s=60, launch=0, check_every_s=0)
    assert fresh.why_stop() is None


def test_a_worker_stops_when_the_run_ended_or_was_cancelled(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    beat(store, age_s=0)
    line = Lifeline(store, rank=0, grace_s=600, launch=1, check_every_s=0)
    store.put_json(layout.RESULT, {"status": "failed", "launch": 0})  # an earlier launch's
    store.put_json(layout.cancel_key(0), {"requested_at": time.time()})
    assert line.why_stop() is None
    store.put_json(layout.cancel_key(1), {"requested_at": time.time()})
    assert line.why_stop() == "the run was cancelled (launch 1)"
    store.delete(layout.cancel_key(1))
    store.put_json(layout.RESULT, {"status": "failed", "launch": 1})
    assert line.why_stop() == "the run has ended (failed): its summary is written"
    store.delete(layout.RESULT)
    store.put_json(layout.launch_key(2), {"launch": 2})
    assert line.why_stop() == "the run was resumed (launch 2), with workers of its own"


def test_a_store_that_cannot_answer_stops_no_worker(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    line = Lifeline(store, rank=0, grace_s=1, launch=0, check_every_s=0)
    line.seen = time.time() - 3600
    store.put(layout.heartbeat_key(0), b"{torn")
    (tmp_path / "run" / layout.RESULT).mkdir(parents=True)  # reading it fails
    assert line.why_stop() is None


def test_the_worker_launch_is_the_runs_newest(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    assert Lifeline.of(store, 0, 60).launch is None
    for k in (0, 1):
        store.put_json(layout.launch_key(k), {"launch": k})
    assert Lifeline.of(store, 0, 60).launch == 1


# ------------------------------------------------------------------ the heartbeat's thread
def test_the_newest_heartbeat_is_kept_alive_while_none_is_written(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    key = layout.heartbeat_key(0)
    writer = HeartbeatWriter(lambda b: store.put_json(key, b), HeartbeatPace(), every_s=0.2)
    writer.write({"rank": 0, "step": 3, "updated_at": 1.0})
    kept = wait_for(lambda: store.get_json(key).get("alive_at"), "alive_at", timeout=60)
    record = layout.Heartbeat.from_dict(store.get_json(key))
    # the news it carries stays as it was; only the sign of life is new
    assert record.step == 3 and record.updated_at == 1.0 and record.seen_at == kept > 1.0
    writer.write({"rank": 0, "step": 4, "phase": "done", "updated_at": 2.0})
    writer.close()
    closed = store.get_json(key)
    time.sleep(1.0)  # several periods: a closed writer refreshes nothing
    assert store.get_json(key) == closed == {"rank": 0, "step": 4, "phase": "done",
                                             "updated_at": 2.0}  # fmt: skip


def test_a_dropped_writer_stops_its_thread() -> None:
    writes: list[dict[str, Any]] = []
    writer = HeartbeatWriter(writes.append, HeartbeatPace(), every_s=0.1)
    alive = [t for t in threading.enumerate() if t.name == "crf-heartbeat-alive"]
    del writer
    gc.collect()
    wait_for(lambda: not any(t.is_alive() for t in alive[-1:]), "the thread to end", 30)


def test_a_failed_write_pauses_the_refreshes() -> None:
    calls: list[dict[str, Any]] = []

    def put(b: dict[str, Any]) -> None:
        calls.append(b)
        raise OSError("store down")

    pace = HeartbeatPace()
    writer = HeartbeatWriter(put, pace, every_s=0.1)
    writer.write({"rank": 0, "updated_at": 1.0})
    assert pace.paused_until > time.time() + 20  # paused for HEARTBEAT_BACKOFF_S
    time.sleep(0.5)
    assert len(calls) == 1
    writer.close()


# --------------------------------------------------------------------- real processes
@pytest.mark.e2e
@pytest.mark.slow
def test_a_detached_runs_worker_ends_once_its_killed_trainer_is_not_restarted(
    tmp_path: Path,
) -> None:
    """A detached local run: its trainer is SIGKILLed and nobody restarts it (no driver
    watches); the worker ends by itself within the grace, with its line in its log and
    its result, and ``crf status`` gathers it as such."""
    from rich.console import Console
    from typer.testing import CliRunner

    from crf.launcher.cli import app
    from crf.launcher.driver import run
    from crf.launcher.plan import prepare
    from crf.launcher.workers import read_worker_handles

    base = tmp_path / "runs"
    options = {"job": "composer", "replicas": 1, "rounds": 200, "sync_every": 2,
               "rollout_workers": 1, "rollout_grace": 30.0, "eval_examples": 4,
               "job_config": JOB, "run_id": "away"}  # fmt: skip
    console = Console(file=open(os.devnull, "w"), width=160)  # noqa: SIM115
    out = run(prepare(options, store=str(base)), detach=True, console=console)
    assert out["status"] == "detached"
    store = RunStore(f"file://{base / 'away'}")

    def working() -> bool:  # both are past their setup: the worker generates for its trainer
        state = store.get_json(layout.worker_state_key(0)) if store.exists(
            layout.worker_state_key(0)) else {}  # fmt: skip
        return state.get("batches", 0) >= 1 and store.exists(layout.metrics_key(0, 0))

    wait_for(working, "the worker's first batch and the trainer's first round")
    assert not store.exists(layout.worker_result_key(0))  # it still serves its trainer
    os.kill(int(out["handles"][0]["backend_id"]), signal.SIGKILL)
    result = wait_for(lambda: store.exists(layout.worker_result_key(0)) and store.get_json(
        layout.worker_result_key(0)), "the worker to end by itself")  # fmt: skip
    assert result["status"] == "stopped" and result["phase"] == "done", result
    assert "its trainer (replica 0) has shown no sign of life" in result["reason"]
    [handle] = read_worker_handles(store, 0)
    from crf.executors.local import LocalProcessExecutor

    executor = LocalProcessExecutor()
    wait_for(lambda: executor.status(handle).terminal, "the worker's process to exit")
    assert str(executor.status(handle).state) == "succeeded"  # it ended cleanly
    logs = CliRunner().invoke(app, ["logs", "away", "--store", str(base), "--role", "rollout"])
    assert "rollout worker 0 stops: its trainer (replica 0) has shown no sign of life" in (
        logs.output)  # fmt: skip
    status = CliRunner().invoke(app, ["status", "away", "--store", str(base), "--json"])
    record = json.loads(status.output)
    assert record["result"]["status"] == "failed"  # its trainer was killed
    [row] = record["result"]["workers"]["workers"]
    assert (row["state"], row["status"]) == ("succeeded", "stopped"), row
    assert "no sign of life" in row["reason"]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_worker_of_a_slow_trainer_goes_on(tmp_path: Path) -> None:
    """Each of the trainer's steps after its first takes longer than the grace (it sleeps in
    it, writing no heartbeat of its own); its heartbeat is kept alive meanwhile, so the
    worker goes on and ends with its trainer, ok."""
    uri = f"file://{tmp_path}/run"
    spec = run_spec(uri, job_config=dict(JOB), rounds=2, rollout_grace=20.0)
    store = RunStore(uri)
    store.put(layout.RUN_SPEC, spec.to_json().encode())
    slow = {"rank": 0, "from_step": 1, "to_step": 3, "sleep_s": 25}
    trainer_env = {**worker_env(uri), layout.ENV_ROLE: layout.ROLE_TRAINER,
                   "CRF_TEST_SLOW": json.dumps(slow), "CRF_LOG_LEVEL": "INFO"}  # fmt: skip
    trainer_log, worker_log = tmp_path / "trainer.log", tmp_path / "worker.log"
    trainer = subprocess.Popen([sys.executable, SHIM], env=trainer_env,
                               stdout=trainer_log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    worker = None
    try:
        # the worker starts once its trainer has beaten (their start-up apart from the test)
        wait_for(lambda: store.exists(layout.heartbeat_key(0)), "the trainer's heartbeat")
        env = {**worker_env(uri), "CRF_LOG_LEVEL": "INFO"}
        out = worker_log.open("w")
        worker = subprocess.Popen([sys.executable, "-m", "crf.replica"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)  # fmt: skip
        assert trainer.wait(timeout=600) == 0, trainer_log.read_text()[-3000:]
        assert worker.wait(timeout=300) == 0, worker_log.read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p is not None and p.poll() is None:
                p.kill()
    result = store.get_json(layout.worker_result_key(0))
    assert result["status"] == "ok" and result["reason"] is None, result
    assert "loaded policy version" in worker_log.read_text()  # it did watch its trainer
    assert "stops:" not in worker_log.read_text()
    # the trainer slept past the grace in its steps, and said it lived meanwhile
    assert store.get_json(layout.metrics_key(0, 1))["compute_s"] >= 75
    assert layout.Heartbeat.from_dict(store.get_json(layout.heartbeat_key(0))).phase == "done"
