"""The composer job (TRL GRPO + distillation + replay) on a replica of K local ranks
(``--procs-per-replica``): the batch split and the plan's checks before launch, and on CPU
with gloo, 2 replicas x 2 local ranks that survive a local rank's death, end bit-identical,
and take the same first round as 2 x 1 at the same batch when sampling is made independent
of the split (tests/seeded_composer_job.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from crf.exchange.checkpoints import read_global_state
from crf.executors.local import LocalProcessExecutor
from crf.launcher import driver
from crf.launcher.cli import app
from crf.replica.context import weights_sha256
from crf.replica.jobs import composer
from crf.replica.local_ranks import LocalGroup, batch_error, trainer_args
from crf.store import RunStore

#: the largest |w(K=2) - w(K=1)| allowed over every weight of the global model after round 0
#: (2 inner steps, lr 5e-3, weights of size ~1). The two runs train on the same rollouts, so
#: only the order of float sums differs: DDP averages two half-batch gradients where one
#: process sums the whole batch, and the loss normalisers are gathered sums; each inner
#: step's gradient differs by a few fp32 ulps, which AdamW (dividing by sqrt(v)) can blow up
#: where a gradient is near zero. Measured: ~3e-6. A split that weighed the rows wrongly
#: (e.g. each rank's channel losses averaged over its own rows) is off by ~1e-2.
WEIGHT_ATOL = 1e-4
#: a tiny composer run: 4 prompts x 4 generations per inner step (8 rollouts per local rank)
TINY = {"num_examples": 64, "prompts_per_step": 4, "num_generations": 4}
SEEDED = "tests.seeded_composer_job"


def test_each_local_rank_trains_on_its_share_of_the_rollouts() -> None:
    cfg = composer.Config(**TINY)
    assert composer.LOCAL_RANKS and composer.replica_batch(cfg) == 16
    one, two = object(), type("Ctx", (), {"local": LocalGroup(1, 2)})()
    assert trainer_args(one, 16) == {"per_device_train_batch_size": 16}  # K = 1: as before
    assert trainer_args(two, 16) == {
        "per_device_train_batch_size": 8,
        "ddp_broadcast_buffers": False,
        "ddp_find_unused_parameters": False,
    }
    with pytest.raises(ValueError, match="multiple of --procs-per-replica"):
        trainer_args(type("Ctx", (), {"local": LocalGroup(0, 3)})(), 16)
    assert batch_error("composer", composer, cfg, 2) is None
    assert "16 rows per inner step" in (batch_error("composer", composer, cfg, 3) or "")


def test_the_plan_refuses_a_batch_k_cannot_split_and_warns_of_idle_gpus(tmp_path: Path) -> None:
    base = ["launch", "--job", "composer", "--store", str(tmp_path), "--dry-run"]
    env = {"COLUMNS": "250", "HF_TOKEN": ""}
    out = CliRunner().invoke(app, [*base, "--procs-per-replica", "3"], env=env)
    assert out.exit_code == 2, out.output
    assert out.output.count("\n") == 1 and "32 rows per inner step" in out.output
    assert "multiple of --procs-per-replica 3" in out.output
    ok = CliRunner().invoke(app, [*base, "--procs-per-replica", "2"], env=env)
    assert ok.exit_code == 0 and "2 local ranks" in ok.output and "warning" not in ok.output
    hf = [*base, "--backend", "hf", "--flavor", "l4x4"]
    out = CliRunner().invoke(app, [*hf, "--procs-per-replica", "1"], env=env)
    assert out.exit_code == 0, out.output
    assert "│ warning" in out.output and "4 GPUs but trains on 1 process(es), 3 idle" in out.output
    out = CliRunner().invoke(app, hf, env=env)  # K defaults to the flavor's 4 GPUs
    assert out.exit_code == 0 and "4 local ranks" in out.output and "warning" not in out.output


def _launch(base: Path, run_id: str, k: int, rounds: int, env: dict[str, str]) -> dict[str, Any]:
    summary = driver.launch(
        {
            "job": SEEDED,
            "replicas": 2,
            "sync_every": 2,
            "rounds": rounds,
            "run_id": run_id,
            "job_config": TINY,
            "eval_examples": 4,
            "procs_per_replica": k,
            "min_replicas": 2,
            "round_timeout_s": 180.0,  # the others wait for a restarted replica
        },
        store=str(base),
        env={"CRF_LOG_LEVEL": "WARNING", "PYTHONPATH": str(Path(__file__).parents[1]), **env},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=2),
        progress=False,
        report=False,
        plot=False,
        poll_s=0.1,
        timeout_s=400,
    )
    assert summary["status"] == "ok", summary
    return summary


def _global_model(run: Path, r: int) -> dict[str, Any]:
    return read_global_state(RunStore(str(run)), r)[0]["model"]


@pytest.mark.slow
@pytest.mark.e2e
def test_two_replicas_of_two_local_ranks(tmp_path: Path) -> None:
    """2 x 2 (gloo), replica 0's local rank 1 killed at inner step 3 (round 1): the replica
    fails, the driver restarts it, it resumes from global/0 and the run ends with both
    replicas bit-identical. Killed again while it writes the run's model, its local ranks
    restart with every step trained and finish the export (``restore_final``, a collective
    of the K ranks) with the final weights and the job's metrics it had. Round 0 (before
    the kill) matches a 2 x 1 run at the same batch: the global model both wrote as
    global/0."""
    runs = tmp_path / "runs"
    kill = {"CRF_FAULT": "rank=0,point=inner_step,step=3,local_rank=1;rank=0,point=saving"}
    four = _launch(runs, "k2", 2, rounds=2, env=kill)
    assert four["weights_identical"] is True
    dead, alive = four["replicas"]
    assert dead["restarts"] == 2 and any(a["exit_code"] == 1 for a in dead["attempts"]), dead
    assert dead["resumed_from"] == 1 and alive["restarts"] == 0
    assert dead["attempts"][-1]["phase"] == "saving", dead["attempts"]
    # the export's restart reports what it had: the final weights, its last round's loss,
    # the held-out exact match (the same greedy answers as the other replica's)
    assert dead["weights_sha256"] == alive["weights_sha256"] == four["weights_sha256"]
    last = json.loads((runs / "k2" / "metrics" / "0" / "1.json").read_text())
    assert dead["final_loss"] == last["loss"]
    exact = dead["job_metrics"].get("exact_match_after")
    assert exact is not None and exact == alive["job_metrics"]["exact_match_after"], dead
    model = AutoModelForCausalLM.from_pretrained(runs / "k2" / "model")
    assert weights_sha256(model) == four["weights_sha256"]
    for r in range(2):
        result = json.loads((runs / "k2" / "results" / f"{r}.json").read_text())
        assert result["local_ranks"] == 2 and result["status"] == "ok"

    _launch(runs, "k1", 1, rounds=1, env={})
    w2, w1 = _global_model(runs / "k2", 0), _global_model(runs / "k1", 0)
    assert w2.keys() == w1.keys()
    worst = max(float((w2[k] - w1[k]).abs().max()) for k in w2)
    assert worst <= WEIGHT_ATOL, worst
