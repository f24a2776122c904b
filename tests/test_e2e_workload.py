"""End to end: two local replica processes train the composer job on a user's jsonl file
(custom column names) with a built-in and a module:function reward, weighted, the reward's
module shipped with ``--workdir``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from crf.launcher.driver import launch

pytestmark = [pytest.mark.e2e]

REWARD = """
def myreward(completions, answer, **kwargs):
    # partial credit for the right length: reads the dataset's answer column, renamed
    return [1.0 if len(c) == len(a) else 0.0 for c, a in zip(completions, answer)]
"""


def test_composer_on_a_jsonl_file_with_two_rewards(tmp_path: Path, monkeypatch) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 3))) for _ in range(32)]
    (tmp_path / "rev.jsonl").write_text(
        "".join(
            json.dumps({"question": f"{w}=", "solution": w[::-1], "tip": w[::-1]}) + "\n"
            for w in words
        )  # fmt: skip
    )
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "mymod.py").write_text(REWARD)  # not on the driver's path
    monkeypatch.chdir(tmp_path)  # the dataset's relative path is the driver's
    summary = launch(
        {
            "job": "composer",
            "replicas": 2,
            "sync_every": 2,
            "rounds": 1,
            "run_id": "data",
            "dataset": "rev.jsonl",
            "columns": {"prompt": "question", "answer": "solution", "hint": "tip"},
            "reward": ["exact_match=1", "mymod:myreward=0.5"],
            "job_config": {"prompts_per_step": 2, "num_generations": 2},
            "workdir": "code",  # each replica runs in its copy; mymod imports from it
        },
        store=str(tmp_path / "runs"),
        progress=False,
        report=False,
    )
    assert summary["status"] == "ok", summary
    run = tmp_path / "runs" / "data"
    spec = json.loads((run / "run.json").read_text())
    assert spec["dataset"] == str(tmp_path / "rev.jsonl")
    assert spec["reward"] == ["exact_match=1", "mymod:myreward=0.5"]
    assert spec["workdir"] == str(tmp_path / "code") and spec["workdir_key"]
    for rank in range(2):
        m = json.loads((run / "metrics" / str(rank) / "0.json").read_text())["metrics"]
        assert 0.0 <= m["reward"] <= 1.5  # weighted sum of a 0/1 and a 0/0.5 reward


def test_a_raising_reward_fails_the_replica_with_its_traceback(tmp_path: Path, monkeypatch) -> None:
    from crf.launcher.plan import RestartPolicy

    (tmp_path / "rev.jsonl").write_text(json.dumps({"prompt": "ab=", "answer": "ba"}) + "\n")
    (tmp_path / "badmod.py").write_text(
        "def boom(completions, **kwargs):\n    raise KeyError('no_such_field')\n"
    )
    monkeypatch.chdir(tmp_path)
    summary = launch(
        {"replicas": 1, "sync_every": 1, "rounds": 1, "run_id": "bad", "dataset": "rev.jsonl",
         "reward": ["badmod:boom"], "job_config": {"prompts_per_step": 1, "num_generations": 2}},
        store=str(tmp_path / "runs"), restart=RestartPolicy(max_restarts=0), progress=False,
        report=False,
    )  # fmt: skip
    assert summary["status"] == "failed", summary
    log = (tmp_path / "runs" / "bad" / "logs" / "replica-0.log").read_text()
    assert "RewardFailed: reward badmod:boom raised KeyError: 'no_such_field'" in log
    assert "in boom" in log and "raise KeyError('no_such_field')" in log  # the user's frame
