"""A user's own reward functions in real launches: what reaches the user, the run folder and
the driver's decisions when a reward misbehaves.

- a ``--secret``'s value that a reward prints or quotes in its error (a judge's HTTP error
  with the key in its URL) is hidden from the check's output and refusal, and from what a
  failed replica writes to the run folder (its result, the run's summary, the launch
  record), which the driver then prints;
- a reward that goes wrong mid-run (values TRL cannot train on, once the model's completions
  are not the answers the check before launch used) fails its replica with the reward's
  error, which no restart can fix: never restarted as a death; and since the same code
  scores every replica's completions, the run stops at the first replica that meets it,
  whatever the round, rather than let the others train on alone until they meet it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SECRET = "jt-judge-key-0123456789"

LEAKS_ITS_KEY = """
import os


def score(completions, **kwargs):
    key = os.environ["JUDGE_TOKEN"]
    print("calling the judge with key=" + key)
    raise RuntimeError("401 Unauthorized for url https://judge.example.com/score?key=" + key)
"""


LEAKS_IT_IN_TRAINING = LEAKS_ITS_KEY.replace(
    "    key = ",
    "    if kwargs.get('trainer_state') is None:  # the check, the held-out scoring\n"
    "        return [0.0] * len(completions)\n    key = ",
)


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "crf.launcher.cli", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _module(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(body)
    return folder


def _rows(path: Path, n: int = 32) -> str:
    words = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"]
    path.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n"
                            for w in (words * n)[:n]))  # fmt: skip
    return str(path)


def _files_holding(folder: Path, text: str) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_the_check_hides_a_secret_a_reward_prints_or_raises_with(tmp_path: Path) -> None:
    wd = _module(tmp_path / "wd", "judge", LEAKS_ITS_KEY)
    out = _cli("launch", "--dataset", _rows(tmp_path / "train.jsonl"), "--reward",
               "judge:score", "--secret", "JUDGE_TOKEN", "--store", str(tmp_path / "runs"),
               "--dry-run", cwd=wd, env={"JUDGE_TOKEN": SECRET})  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "--reward judge:score raised RuntimeError: 401 Unauthorized" in text, text
    assert "key=***" in text and SECRET not in text, text


@pytest.mark.e2e
@pytest.mark.slow
def test_a_failed_replica_writes_no_secret_to_the_run_folder(tmp_path: Path) -> None:
    """The reward fails in the replicas' first training step (the check before launch, like
    the held-out scoring, calls it without a trainer_state): the error is recorded (result,
    summary, launch record) and printed with the key hidden."""
    wd = _module(tmp_path / "wd", "judge", LEAKS_IT_IN_TRAINING)
    runs = tmp_path / "runs"
    out = _cli("launch", "-n", "2", "-r", "1", "-H", "1", "--reward", "judge:score",
               "--secret", "JUDGE_TOKEN", "--store", str(runs), "--run-id", "leak",
               "--no-progress", "--max-restarts", "0", "--timeout", "240", cwd=wd,
               env={"JUDGE_TOKEN": SECRET})  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    summary = json.loads((runs / "leak" / "result.json").read_text())
    assert "401 Unauthorized for url https://judge.example.com/score?key=***" in summary["error"]
    assert SECRET not in text, text
    assert _files_holding(runs / "leak", SECRET) == []


SHORT_FROM_STEP_3 = """
def score(completions, prompts, trainer_state=None, **kwargs):
    values = [float(len(c) == len(p) - 1) for p, c in zip(prompts, completions)]
    if trainer_state is not None and trainer_state.global_step >= 3:
        return values[:-1]  # drops a completion it cannot parse
    return values
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_reward_that_goes_wrong_mid_run_is_not_restarted(tmp_path: Path) -> None:
    """TRL raises its own ValueError for a wrong count, deep in a step, which reads as a
    death: the reward's error comes first, and no replica is restarted."""
    wd = _module(tmp_path / "wd", "short", SHORT_FROM_STEP_3)
    runs = tmp_path / "runs"
    out = _cli("launch", "-n", "2", "-r", "3", "-H", "2", "--reward", "short:score",
               "--store", str(runs), "--run-id", "short", "--no-progress",
               "--round-timeout", "60", "--timeout", "240", cwd=wd)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    summary = json.loads((runs / "short" / "result.json").read_text())
    assert summary["restarts"] == 0, summary
    reason = summary["error"] or summary["fatal_error"]  # the run's, or its replicas'
    assert "reward short:score returned 31 values for 32 completions" in reason, text
    assert "Traceback" not in text


RAISES_ON_REPLICA_0_FROM_STEP_3 = """
import os


def score(completions, prompts, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 3 and (
        os.environ["CRF_RANK"] == "0"
    ):
        raise ValueError("cannot parse the judge's answer")
    return [float(len(c) == len(p) - 1) for p, c in zip(prompts, completions)]
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_reward_that_raises_mid_run_stops_the_run(tmp_path: Path) -> None:
    """Replica 0's reward raises in round 1: the run stops there with one line naming the
    reward and saying to continue the run once it is fixed; replica 1 does not train on
    alone to the last round, only for the run to end failed anyway."""
    wd = _module(tmp_path / "wd", "late", RAISES_ON_REPLICA_0_FROM_STEP_3)
    runs = tmp_path / "runs"
    out = _cli("launch", "-n", "2", "-r", "4", "-H", "2", "--reward", "late:score",
               "--store", str(runs), "--run-id", "late", "--no-progress",
               "--round-timeout", "60", "--timeout", "240", cwd=wd)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    summary = json.loads((runs / "late" / "result.json").read_text())
    assert summary["error"] == (
        "replica 0 failed after 1 committed round(s) with RewardFailed: reward late:score "
        "raised ValueError: cannot parse the judge's answer: a restart cannot fix it, so the "
        "run stopped; fix the input, then continue with crf launch --resume late"
    ), summary["error"]
    assert summary["restarts"] == 0
    states = {r["rank"]: r["state"] for r in summary["replicas"]}
    assert states == {0: "failed", 1: "cancelled"}, summary["replicas"]
    assert "Traceback" not in text


SLEEPS_IN_TRAINING = """
import time


def score(completions, trainer_state=None, **kwargs):
    if trainer_state is not None:  # a training step (the check and held-out scoring: None)
        time.sleep(3)  # a judge slower than the run allows
    return [0.0] * len(completions)
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_reward_call_past_its_time_limit_stops_the_run(tmp_path: Path) -> None:
    """TRL has no time limit on a reward call: one that hangs would hold the run until its
    --timeout. Past --reward-timeout the replica stops with one line naming the reward, the
    limit and the option that raises it; it is not restarted (it would be too slow again).
    The run is then continued with a larger limit: ``--resume`` takes a new
    --reward-timeout (and refuses one out of range in one line), keeps it in the launch's
    record, not in run.json, and every replica of that launch honours it."""
    wd = _module(tmp_path / "wd", "slow", SLEEPS_IN_TRAINING)
    runs = tmp_path / "runs"
    out = _cli("launch", "-n", "2", "-r", "1", "-H", "2", "--reward", "slow:score",
               "--reward-timeout", "1", "--store", str(runs), "--run-id", "slow",
               "--no-progress", "--round-timeout", "60", "--timeout", "900", cwd=wd)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    summary = json.loads((runs / "slow" / "result.json").read_text())
    assert summary["restarts"] == 0, summary
    assert summary["error"].startswith("replica "), summary["error"]
    said = summary["error"]  # which replica meets it first, and whether the other too: timing
    assert (
        "with RewardTimedOut: reward slow:score did not return within 1s (--reward-timeout 1);"
        " make it return sooner (give a call it waits on a timeout of its own) or launch with "
        "a larger --reward-timeout (0: no limit; a resume takes one too)"
    ) in said, said
    assert "a restart cannot fix it, so the run stopped" in said, said
    assert "did not return within 1s" in " ".join(text.split()), text
    assert "Traceback" not in text

    bad = _cli("launch", "--resume", "slow", "--reward-timeout", "-1", "--store", str(runs),
               "--no-progress", cwd=wd)  # fmt: skip
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "--reward-timeout" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    out = _cli("launch", "--resume", "slow", "--reward-timeout", "60", "--store", str(runs),
               "--no-progress", "--timeout", "900", cwd=wd)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((runs / "slow" / "result.json").read_text())["status"] == "ok"
    assert json.loads((runs / "slow" / "run.json").read_text())["reward_timeout"] == 1
    assert json.loads((runs / "slow" / "launches" / "1.json").read_text())["changed"] == {
        "reward_timeout": 60.0
    }


EDITS_ITSELF = """
from pathlib import Path

VERSION = 1
EDITED = "VERSION = " + "2\\ndef score(completions, **kwargs):\\n" \\
    "    raise RuntimeError('the edited reward ran')\\n"


def score(completions, prompts, trainer_state=None, **kwargs):
    here = Path(__file__)  # the user's file, whichever copy of its code runs
    if trainer_state is not None and not here.read_text().startswith("VERSION = 2"):
        here.write_text(EDITED)  # the user edits the reward while the run trains
    return [float(len(c) == len(p) - 1) for p, c in zip(prompts, completions)]
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_restarted_replica_runs_the_reward_code_its_peers_run(tmp_path: Path) -> None:
    """A local run without --workdir: its reward file is edited in round 0 (by the reward
    itself, so before any restart), then replica 0 is killed in round 1. The restarted
    replica imports the code the launch checked, as its peer still runs it, not the edited
    file (whose reward raises): the run finishes ok after one restart."""
    wd = _module(tmp_path / "wd", "rw_pin", EDITS_ITSELF)
    runs = tmp_path / "runs"
    out = _cli("launch", "-n", "2", "-r", "3", "-H", "2", "--reward", "rw_pin:score",
               "--store", str(runs), "--run-id", "pin", "--no-progress",
               "--round-timeout", "60", "--timeout", "400", cwd=wd,
               env={"CRF_FAULT": "rank=0,point=uploading,round=1"})  # fmt: skip
    text = out.stdout + out.stderr
    assert (wd / "rw_pin.py").read_text().startswith("VERSION = 2")  # before the restart
    assert out.returncode == 0, text
    summary = json.loads((runs / "pin" / "result.json").read_text())
    assert summary["status"] == "ok" and summary["restarts"] == 1, summary
    assert "the edited reward ran" not in (runs / "pin" / "logs" / "replica-0.log").read_text()
