"""End to end on the local machine: one trainer replica and one rollout worker, each a real
``python -m crf.replica`` process with the layout's env, on the tiny composer job. The
trainer trains on the worker's batches; the worker is killed mid-run, and the run still ends
ok, the trainer generating the rest itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from crf import layout
from crf.rollouts.batches import RolloutQueue
from crf.store import RunStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
ROLLOUTS_PER_STEP = 4  # prompts_per_step 2 x num_generations 2


def start(uri: str, role: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update({
        layout.ENV_RUN_URI: uri, layout.ENV_RANK: "0", layout.ENV_WORLD_SIZE: "1",
        layout.ENV_RUN_ID: "rollouts-e2e", layout.ENV_ROLE: role, layout.ENV_TORCH_THREADS: "1",
        "CRF_LOG_LEVEL": "INFO", "PYTHONPATH": str(ROOT),
    })  # fmt: skip
    if role == layout.ROLE_ROLLOUT:
        env[layout.ENV_WORKER] = "0"
    out = log.open("w")
    return subprocess.Popen([sys.executable, "-m", "crf.replica"], env=env, stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip


def worker_state(store: RunStore) -> layout.WorkerState:
    try:
        return layout.WorkerState.from_dict(store.get_json(layout.worker_state_key(0)))
    except Exception:  # noqa: BLE001 - not written yet
        return layout.WorkerState()


def rounds(store: RunStore, n: int) -> list[dict[str, Any]]:
    return [store.get_json(layout.metrics_key(0, r)) for r in range(n)]


def test_a_trainer_uses_its_worker_and_outlives_it(tmp_path: Path) -> None:
    from crf.spec import RunSpec

    uri = f"file://{tmp_path}/run"
    spec = RunSpec(
        run_id="rollouts-e2e", run_uri=uri, job="composer", replicas=1, sync_every=2, rounds=5,
        round_timeout_s=60.0, eval_examples=4,
        job_config={"num_examples": 64, "prompts_per_step": 2, "num_generations": 2},
        rollout_workers=1, max_staleness=1, rollout_wire="float32",
        rollout_wait=300.0,  # a live worker is always waited for: its batches are used
    ).validate()  # fmt: skip
    store = RunStore(uri)
    store.put(layout.RUN_SPEC, spec.to_json().encode())
    trainer = start(uri, layout.ROLE_TRAINER, tmp_path / "trainer.log")
    worker = start(uri, layout.ROLE_ROLLOUT, tmp_path / "worker.log")
    try:
        deadline = time.monotonic() + 400
        while worker_state(store).batches < 3:  # so the trainer has taken one (bound 1)
            assert time.monotonic() < deadline, "the worker wrote no batches"
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.2)
        worker.send_signal(signal.SIGKILL)  # dies mid-run: no result, a stale heartbeat
        worker.wait(timeout=60)
        assert trainer.wait(timeout=600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    result = store.get_json(layout.result_key(0))
    assert result["status"] == "ok" and result["steps"] == 10
    records = rounds(store, 5)
    counts = [r["rollouts"] for r in records]
    from_workers = sum(c["workers"] for c in counts)
    local = sum(c["local"] for c in counts)
    # every generation came from one source or the other: nothing lost, nothing twice
    assert from_workers + local == 10 * ROLLOUTS_PER_STEP, counts
    assert from_workers >= ROLLOUTS_PER_STEP  # the worker's batches were trained on
    assert local >= ROLLOUTS_PER_STEP  # and after its death the trainer generated itself
    assert all(c["refused"] == 0 for c in counts), counts
    assert max(c["staleness_max"] or 0 for c in counts) <= 1  # never beyond the bound
    assert sum(c.get("w0", 0) for c in counts) == from_workers
    # the worker left no result (it was killed); its trainer cleaned its policy versions up
    assert not store.object_exists(layout.worker_result_key(0))
    assert [n for n in store.list(layout.policy_dir(0)) if n.isdigit()] == []
    # each log names who speaks: a worker's lines are not a replica's
    assert "[rollout worker w0] INFO" in (tmp_path / "worker.log").read_text()
    assert "[replica 0] INFO" in (tmp_path / "trainer.log").read_text()


def test_crf_launch_starts_a_worker_whose_batches_the_replica_trains_on(tmp_path: Path) -> None:
    """The whole chain on the local backend: ``crf launch --rollout-workers 1`` starts the
    worker beside the replica, the replica trains on its batches, the run ends ok."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "crf.launcher.cli", "launch", "--job", "composer",
           "--replicas", "1", "--rollout-workers", "1", "--sync-every", "2", "--rounds", "2",
           "--run-id", "cli", "--store", str(tmp_path), "--no-progress", "--eval-examples",
           "4", "--set", "num_examples=64", "--set", "prompts_per_step=2", "--set",
           "num_generations=2", "--rollout-wait", "300"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = RunStore(str(tmp_path / "cli"))
    assert store.get_json(layout.result_key(0))["status"] == "ok"
    counts = [r["rollouts"] for r in rounds(store, 2)]
    # a live worker is waited for, so every batch the replica trained on was the worker's
    assert sum(c["workers"] for c in counts) == 4 * ROLLOUTS_PER_STEP, counts
    assert sum(c["local"] + c["refused"] for c in counts) == 0, counts
    # what the worker wrote ahead that the finished replica never took went with the run
    queue = RolloutQueue(store, 0)
    assert queue.queued() == [] and queue.cursor() is None
    # so did the policy: versions, acknowledgements and the round bases
    left = [f"{d}/{k}" for d in ("base", "0", "0/acks") for k in store.list(f"policy/{d}")]
    assert left in ([], ["0/acks"]), left  # (an empty folder on a file store)
    # the worker wrote no batch for a step past the replica's last (4 steps): all it wrote
    # was trained on, or made again for being returned
    worker = layout.WorkerState.from_dict(store.get_json(layout.worker_result_key(0)))
    assert worker.rollouts == (4 + worker.returned) * ROLLOUTS_PER_STEP, worker
    # and each side's time: the worker's generating, the replica's waiting for its batches
    assert worker.generate_s > 0 and all(c["wait_s"] >= 0 for c in counts), counts
