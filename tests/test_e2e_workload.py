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
        # right on the answers the check before launch passes it, wrong on generated text
        "def boom(completions, answer, **kwargs):\n"
        "    if completions != answer:\n"
        "        raise KeyError('no_such_field')\n"
        "    return [1.0] * len(completions)\n"
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


def test_held_out_split_scored_each_round_shared_by_the_replicas(
    tmp_path: Path, monkeypatch
) -> None:
    """A local folder with train/test files (datasets reads them as two splits), --eval-split
    test: each round's global model is scored on 5 held-out rows, replica 0 taking 3 and
    replica 1 taking 2; the summary and the figure add the shares up."""
    from crf.launcher.figure import HELD_OUT, panels_for, read_metrics
    from crf.store import RunStore

    rng = random.Random(1)
    words = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 3))) for _ in range(20)]
    (tmp_path / "rev").mkdir()
    for split, part in (("train", words[:12]), ("test", words[12:])):
        (tmp_path / "rev" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"q": f"{w}=", "a": w[::-1]}) + "\n" for w in part)
        )
    monkeypatch.chdir(tmp_path)
    summary = launch(
        {"job": "composer", "replicas": 2, "sync_every": 1, "rounds": 2, "run_id": "ev",
         "dataset": "rev", "eval_split": "test", "eval_examples": 5,
         "columns": {"prompt": "q", "answer": "a"}, "reward": ["exact_match"],
         "job_config": {"prompts_per_step": 2, "num_generations": 2}},
        store=str(tmp_path / "runs"), progress=False, report=False,
    )  # fmt: skip
    assert summary["status"] == "ok", summary
    run = tmp_path / "runs" / "ev"
    for rank, mine in ((0, 3), (1, 2)):  # rows r::2 of the 5
        assert summary["replicas"][rank]["job_metrics"]["eval_share"] == mine
        for r in range(2):
            m = json.loads((run / "metrics" / str(rank) / f"{r}.json").read_text())["metrics"]
            assert m["eval/n"] == mine and m["eval/of"] == 5
            assert 0 <= m["eval/pass"] <= m["eval/sum/exact_match"] + 1e-9 <= mine + 1e-9
            assert ("eval_before/n" in m) == (r == 0)  # the initial model, once
    h = summary["held_out"]
    assert sorted(map(int, h["per_round"])) == [0, 1]
    assert h["after"]["examples"] == h["after"]["of"] == h["before"]["examples"] == 5
    assert 0.0 <= h["pass@1_after"] <= 1.0 and 0.0 <= h["pass@1_before"] <= 1.0
    # exact_match is 0/1 and the threshold 1.0: pass@1 is its mean
    assert h["after"]["reward/exact_match"] == h["pass@1_after"]
    metrics = read_metrics(RunStore(f"file://{run}"), 2)
    assert any(p.series == (HELD_OUT,) for p in panels_for("composer", metrics))
