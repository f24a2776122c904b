"""The rollout worker as a process (``CRF_ROLE=rollout python -m crf.replica``) against a
publishing 'trainer' driven by the test: it loads and acknowledges the published policy,
writes TRL generation batches of its trainer, paces at the staleness bound, generates the
rows of a returned batch again first, and ends with its trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from crf import layout
from crf.rollouts import RolloutConfig
from crf.rollouts.batches import RolloutQueue
from crf.rollouts.policy import PolicyPublisher, read_acks
from crf.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
JOB = {"num_examples": 64, "prompts_per_step": 2, "num_generations": 2}


def run_spec(uri: str, **kw: Any) -> Any:
    from crf.spec import RunSpec

    fields = dict(run_id="rollout-test", run_uri=uri, job="composer", replicas=1, sync_every=2,
                  rounds=2, round_timeout_s=30.0, eval_examples=8, job_config=dict(JOB),
                  rollout_workers=1, max_staleness=1, rollout_wire="float32")  # fmt: skip
    return RunSpec(**{**fields, **kw}).validate()


def worker_env(uri: str, worker: int = 0, world: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        layout.ENV_RUN_URI: uri, layout.ENV_RANK: str(worker % world),
        layout.ENV_WORLD_SIZE: str(world), layout.ENV_RUN_ID: "rollout-test",
        layout.ENV_ROLE: layout.ROLE_ROLLOUT, layout.ENV_WORKER: str(worker),
        layout.ENV_TORCH_THREADS: "1", "PYTHONPATH": str(ROOT),
    })  # fmt: skip
    return env


def wait(what: Any, timeout: float = 240.0, proc: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker exited {proc.returncode}: {proc.stderr.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def state(store: RunStore, w: int = 0) -> layout.WorkerState:
    try:
        return layout.WorkerState.from_dict(store.get_json(layout.worker_state_key(w)))
    except Exception:  # noqa: BLE001 - not written yet
        return layout.WorkerState()


@pytest.mark.slow
def test_the_worker_generates_paces_and_ends_with_its_trainer(tmp_path: Path) -> None:
    from crf.replica.jobs import composer as job
    from crf.replica.jobs import job_config
    from crf.rollouts.worker import WorkerContext

    uri = f"file://{tmp_path}/run"
    spec = run_spec(uri)
    store = RunStore(uri)
    store.put(layout.RUN_SPEC, spec.to_json().encode())
    # the trainer: its model as build() makes it, publishing version 0
    setup = job.build(WorkerContext(spec, 0, 1), job_config("composer", spec.job_config))
    pub = PolicyPublisher(store, 0, RolloutConfig.from_spec(spec), run_id=spec.run_id,
                          sync_every=2)  # fmt: skip
    pub.start_round(0, setup.model)
    digest = pub.publish(0, setup.model)

    cmd = [sys.executable, "-m", "crf.replica"]
    proc = subprocess.Popen(cmd, env=worker_env(uri), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        q = RolloutQueue(store, 0)
        # trainer step 0, version 0, bound 1: two batches are admitted, then it paces
        wait(lambda: state(store).phase == "pacing", proc=proc)
        assert q.queued() == [(0, 0), (0, 1)]
        assert [(a.worker, a.step, a.digest) for a in read_acks(store, 0)] == [(0, 0, digest)]
        b = q.read(0, 0)
        assert (b.rank, b.worker, b.version, b.policy_digest) == (0, 0, 0, digest)
        assert len(b) == 4 and b.row_ids[0] == b.row_ids[1] != b.row_ids[2] == b.row_ids[3]
        assert [len(c) for c in b.completion_ids] == [len(lp) for lp in b.logprobs]
        assert all(lp <= 0 for row in b.logprobs for lp in row)
        assert b.sampling["num_generations"] == 2 and b.sampling["max_new_tokens"] == 5
        prompt = setup.tokenizer(setup.shard[b.row_ids[0]]["prompt"])["input_ids"]
        assert b.prompt_ids[0][-len(prompt) :] == prompt

        # the trainer moves to step 2 (version 2): batch 0 is now too stale and goes back;
        # the worker makes its rows again first, with the new version
        with torch.no_grad():
            next(setup.model.parameters()).add_(0.01)
        pub.publish(2, setup.model)
        taken, returned, _ = q.oldest_within(step=2, max_staleness=1, rollouts=4)
        assert taken is None and {(r.seq, r.version) for r in returned} == {(0, 0), (1, 0)}
        again = wait(lambda: [k for k in q.queued() if k[1] >= 2], proc=proc)
        first = q.read(*again[0])
        assert first.version == 2 and first.row_ids == b.row_ids
        assert first.policy_digest == pub.expected_digest(2)
        wait(lambda: state(store).returned >= 2, proc=proc)

        assert q.queued()  # written ahead, never taken
        # the trainer ends: so does its worker
        store.put_json(layout.result_key(0), {"rank": 0, "status": "ok"})
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    result = layout.WorkerState.from_dict(store.get_json(layout.worker_result_key(0)))
    assert result.status == "ok" and result.phase == "done" and result.batches >= 3
    assert read_acks(store, 0) == []  # it holds nothing any more
    # what it wrote that its finished trainer never took serves nobody: it went
    assert q.queued() == []


def test_a_worker_outside_the_contract_says_so_in_one_line(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/run"
    store = RunStore(uri)
    store.put(layout.RUN_SPEC, run_spec(uri).to_json().encode())
    env = worker_env(uri, worker=3)  # the run has one worker
    out = subprocess.run([sys.executable, "-m", "crf.replica"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "crf.replica (rollout worker): CRF_WORKER=3, but the run has 1 rollout worker(s)"
    ]


def test_a_worker_whose_model_folder_is_missing_exits_3_saying_why(tmp_path: Path) -> None:
    """An error while the worker builds its trainer's model (here a model folder it cannot
    find) would come again on every restart: exit 3 (the launcher does not restart it), the
    error in its result."""
    uri = f"file://{tmp_path}/run"
    store = RunStore(uri)
    missing = tmp_path / "model"
    missing.mkdir()  # there at launch, gone where the worker runs
    store.put(layout.RUN_SPEC, run_spec(uri, model=str(missing)).to_json().encode())
    missing.rmdir()
    out = subprocess.run([sys.executable, "-m", "crf.replica"], env=worker_env(uri),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 3, out.stderr
    result = layout.WorkerState.from_dict(store.get_json(layout.worker_result_key(0)))
    assert (result.phase, result.status) == ("failed", "failed")
    assert result.error == f"FileNotFoundError: --model {missing}: no such folder on this replica"
    assert "a restart cannot fix it" in out.stderr


def test_a_worker_failing_as_its_previous_attempt_did_is_not_restarted(tmp_path: Path) -> None:
    """An error while generating is a death the first time (exit 1: restarted); raised
    again by the restarted attempt (its previous attempt's result names it) it would come
    on every restart: exit 3. Another error, or an out-of-memory twice, stays a death."""
    from crf.rollouts.worker import RolloutWorker, _failed

    uri = f"file://{tmp_path}/run"
    store = RunStore(uri)
    spec = run_spec(uri)
    store.put(layout.RUN_SPEC, spec.to_json().encode())

    def attempt(error: Exception) -> int:
        return _failed(RolloutWorker(store, spec, 0, 1), error, "generating")

    bad = ValueError("token id 99 is out of the vocabulary (64)")
    assert RolloutWorker(store, spec, 0, 1).earlier_error is None  # the first attempt
    assert attempt(bad) == 1
    assert RolloutWorker(store, spec, 0, 1).earlier_error == f"ValueError: {bad}"
    assert attempt(bad) == 3
    result = layout.WorkerState.from_dict(store.get_json(layout.worker_result_key(0)))
    assert (result.status, result.error) == ("failed", f"ValueError: {bad}")
    assert attempt(RuntimeError("another error")) == 1  # not the one before: a death
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert attempt(oom) == 1 and attempt(oom) == 1  # the machine's, not the input's


def test_a_restarted_worker_goes_on_where_it_stopped(tmp_path: Path) -> None:
    from crf.rollouts.batches import RolloutBatch
    from crf.rollouts.worker import RolloutWorker

    uri = f"file://{tmp_path}/run"
    store = RunStore(uri)
    spec = run_spec(uri)
    before = layout.WorkerState(worker=0, serves=0, rollouts=12, batches=3, returned=1,
                                staleness_mean=0.5, generate_s=7.5)  # fmt: skip
    store.put_json(layout.worker_state_key(0), before.to_dict())
    w = RolloutWorker(store, spec, 0, 1)
    assert (w.beat.state.rollouts, w.beat.state.batches, w.beat.state.returned) == (12, 3, 1)
    # its staleness too: the summary shows the mean over every batch it wrote
    assert w.beat.state.staleness_mean == 0.5 and w.beat.state.generate_s == 7.5
    assert w.seq == 3  # its next batch does not overwrite one of the previous attempt's
    RolloutQueue(store, 0).put(RolloutBatch(0, 0, 5, 0, [0], [[1]], [[2]], [[-0.5]]))
    assert RolloutWorker(store, spec, 0, 1).seq == 6


def test_a_worker_that_loads_a_version_tells_its_trainer_the_weights_changed(
    tmp_path: Path,
) -> None:
    """With use_vllm TRL generates from vLLM's copy of the weights, pushed when
    ``_last_loaded_step`` differs from the step: every version the worker loads marks that
    copy stale, else it would sample its first version for the whole run."""
    from crf.rollouts.worker import RolloutWorker
    from tests.rollout_helpers import make_trainer

    uri = f"file://{tmp_path}/run"
    store = RunStore(uri)
    spec = run_spec(uri)
    trainer = make_trainer()
    pub = PolicyPublisher(store, 0, RolloutConfig.from_spec(spec), run_id=spec.run_id,
                          sync_every=2)  # fmt: skip
    pub.start_round(0, trainer.model)
    pub.publish(0, trainer.model)
    w = RolloutWorker(store, spec, 0, 1)
    w.trainer = trainer
    trainer.use_vllm, trainer._last_loaded_step = True, 0  # vLLM holds step 0's weights
    assert w.refresh() and w.reader.version == 0
    assert trainer._last_loaded_step == -1  # the next generation pushes the loaded ones
    trainer._last_loaded_step = 0
    assert w.refresh() and trainer._last_loaded_step == 0  # nothing newer: nothing to push
    pub.publish(1, trainer.model)
    assert w.refresh() and w.reader.version == 1 and trainer._last_loaded_step == -1
