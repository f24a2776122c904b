"""End to end: the composer job (TRL GRPO + distillation + replay) as real replica processes
syncing through the store learns: mean reward in the last round is clearly above the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from crf import layout
from crf.replica.context import weights_sha256

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_composer_replicas_learn(tmp_path: Path) -> None:
    env = dict(os.environ, CRF_LOG_LEVEL="INFO")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crf.launcher.cli",
            "launch",
            "--job",
            "composer",
            "--replicas",
            "2",
            "--sync-every",
            "10",
            "--rounds",
            "5",
            "--run-id",
            "comp",
            "--store",
            str(tmp_path),
            "--no-progress",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "comp"
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["weights_identical"] is True
    # the trained model came out in Hugging Face format, with the replicas' final weights
    model = AutoModelForCausalLM.from_pretrained(run / layout.MODEL_DIR)
    assert weights_sha256(model) == result["weights_sha256"]

    def mean_reward(r: int) -> float:
        vals = [
            json.loads((run / "metrics" / str(k) / f"{r}.json").read_text())["metrics"]["reward"]
            for k in range(2)
        ]
        return sum(vals) / len(vals)

    first, last = mean_reward(0), mean_reward(4)
    assert last > first + 0.15, (first, last)
    # every channel's loss is in the per-round metrics
    m = json.loads((run / "metrics" / "0" / "4.json").read_text())["metrics"]
    assert {"reward", "grpo_loss", "distill_loss", "replay_loss"} <= set(m)
    # and the held-out exact match of each round's global model: the same on every replica
    exact = [
        json.loads((run / "metrics" / str(k) / "4.json").read_text())["metrics"]["exact_match"]
        for k in range(2)
    ]
    assert exact[0] == exact[1] and 0.0 <= exact[0] <= 1.0
    # the shared held-out evaluation of the same prompts: 32 rows each, added up by the driver;
    # the embedded reward is 1.0 only for the exact reversal, so pass@1 is the exact match
    h = result["held_out"]
    assert h["after"]["examples"] == h["after"]["of"] == 64 and h["last_round"] == 4
    assert h["pass@1_after"] == pytest.approx(exact[0])
    assert h["before"]["examples"] == 64 and h["pass@1_before"] is not None
    assert result["figure"] == str(run / "figure.png") and (run / "figure.png").stat().st_size
    # the replica logs carry a line per round and none of the libraries' known noise
    log = (run / "logs" / "replica-0.log").read_text()
    assert "round 4: loss " in log and "exact_match" in log
    assert "FutureWarning" not in log and "Syncing" not in log
