"""A replica killed while it writes the run's model (``CRF_FAULT`` point ``saving``) is
restarted with every inner step trained: it finishes the export from the final global
state, and the run's result reports what an uninterrupted run reports - its final loss and
a bit-identical ``weights_sha256`` - with the same weights in ``model/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from crf import layout
from crf.executors.local import LocalProcessExecutor
from crf.launcher import driver
from crf.replica.context import weights_sha256
from tests.fault_helpers import fired_faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY_COMPOSER = {"num_examples": 32, "prompts_per_step": 2, "num_generations": 2}


def _composer_run(base: Path, env: dict[str, str]) -> dict[str, Any]:
    """One replica of the tiny composer job, 2 rounds of 2 steps, restarted if it dies."""
    return driver.launch(
        {"job": "composer", "replicas": 1, "sync_every": 2, "rounds": 2, "run_id": "r",
         "eval_examples": 4, "job_config": TINY_COMPOSER, "round_timeout_s": 10},
        store=str(base), env={"CRF_LOG_LEVEL": "WARNING", **env},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=2),
        progress=False, report=False, plot=False, poll_s=0.1, timeout_s=600,
    )  # fmt: skip


def test_a_replica_killed_writing_the_model_finishes_it_on_restart(tmp_path: Path) -> None:
    whole = _composer_run(tmp_path / "whole", {})
    killed = _composer_run(tmp_path / "killed", {"CRF_FAULT": "rank=0,point=saving"})
    run = tmp_path / "killed" / "r"
    assert any("'point': 'saving'" in f for f in fired_faults(run)), "the kill never fired"
    assert killed["status"] == whole["status"] == "ok", json.dumps(killed)[-2000:]
    [row] = killed["replicas"]
    assert row["restarts"] == 1 and row["attempts"][0]["phase"] == "saving", row
    # its restart trained nothing, and reports what the uninterrupted replica did
    assert whole["weights_sha256"] is not None and whole["final_loss"] is not None
    assert killed["weights_sha256"] == whole["weights_sha256"]
    assert killed["final_loss"] == whole["final_loss"]
    assert row["weights_sha256"] == whole["replicas"][0]["weights_sha256"]
    # and the job's metrics (held-out exact match, last round's loss and reward) that the
    # replica had before it died, not none
    kept = {k: v for k, v in row["job_metrics"].items() if k in whole["replicas"][0]["job_metrics"]}
    assert kept == whole["replicas"][0]["job_metrics"], row["job_metrics"]
    assert row["job_metrics"]["steps_trained"] == 0
    # and the model it wrote is whole (its files, the config last), with the same weights
    # file byte for byte (config fields TRL sets while it trains, such as use_cache, may
    # differ: the restart trains nothing)
    mine, theirs = run / layout.MODEL_DIR, tmp_path / "whole" / "r" / layout.MODEL_DIR
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in mine.iterdir()) == names and "config.json" in names
    weights = "model.safetensors"
    assert (mine / weights).read_bytes() == (theirs / weights).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(mine)
    assert weights_sha256(model) == killed["weights_sha256"]
