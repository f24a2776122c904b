"""The check before launch of a ``--workdir`` reward (crf/launcher/reward_checks.py): a reward
that blocks (or a module that blocks as it imports) is stopped after a time limit, one that
exits or does not parse is named in one line (the user's own file, not the check's temporary
copy), what TRL's GRPOTrainer turns into its rewards tensor passes (bools, numpy and torch
arrays and scalars), a reward given twice or with weight 0 is warned about, and Ctrl-C or
SIGTERM during the check leaves no copy behind."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from crf.launcher import reward_checks
from tests.test_cli import crf

REPO = Path(__file__).resolve().parent.parent
WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 4  # 32 rows


def _setup(tmp: Path, body: str, name: str = "rw_chk") -> tuple[str, str]:
    """A workdir holding module ``name`` and a dataset: (workdir, dataset)."""
    (tmp / "wd").mkdir(exist_ok=True)
    (tmp / "wd" / f"{name}.py").write_text(body)
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n"
                            for w in WORDS))  # fmt: skip
    return str(tmp / "wd"), str(data)


def _args(tmp: Path, body: str, *reward: str, name: str = "rw_chk") -> list[str]:
    wd, data = _setup(tmp, body, name)
    rewards = [a for r in reward or (f"{name}:score",) for a in ("--reward", r)]
    return ["launch", "--store", str(tmp / "runs"), "--replicas", "2", "--dataset", data,
            "--workdir", wd, "--no-progress", *rewards]  # fmt: skip


def _process(
    tmp: Path, args: list[str], env: dict[str, str] | None = None, **kw: Any
) -> subprocess.Popen[str]:
    """``crf launch`` as a real process, its temporary files in ``tmp/tmp``."""
    (tmp / "tmp").mkdir(exist_ok=True)
    env = {**(env or os.environ), "TMPDIR": str(tmp / "tmp"), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "crf.launcher.cli", *args], cwd=REPO,
                            env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, **kw)  # fmt: skip


def _one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


# ---------------------------------------------------------------------- a reward that blocks
BLOCKS = """
import time

def score(completions, **kw):
    try:
        time.sleep(400)
    except Exception:  # a reward's own error handling does not keep it running
        time.sleep(400)
    return [0.0] * len(completions)
"""
BLOCKS_ASYNC = """
import asyncio

async def score(completions, **kw):
    await asyncio.sleep(400)
    return [0.0] * len(completions)
"""


@pytest.mark.parametrize("body", [BLOCKS, BLOCKS_ASYNC], ids=["def", "async-def"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["launch", "dry-run"])
def test_a_reward_that_blocks_is_refused_after_the_time_limit(
    body: str, dry_run: bool, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(reward_checks, "REWARD_CALL_S", 1.0)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    started = time.monotonic()
    result = crf(*_args(tmp_path, body), *(["--dry-run"] if dry_run else []))
    assert time.monotonic() - started < 300  # not the 400 s it blocks for
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert line.startswith("error: --reward rw_chk:score did not return within 1s on 8 row(s) "
                           f"of --dataset {tmp_path / 'train.jsonl'}"), line  # fmt: skip
    assert "make it return faster for 8 rows" in line and "every training step" in line
    assert not list(tmp_path.glob("crf-workdir-check-*"))
    assert not (tmp_path / "runs").exists()


#: a module that blocks as it imports (a download, a lock, input())
BLOCKS_AT_IMPORT = """
import time

time.sleep(400)

def score(completions, **kw):
    return [0.0] * len(completions)
"""


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_a_reward_module_that_blocks_at_import_is_refused_after_the_time_limit(
    job: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(reward_checks, "REWARD_CALL_S", 1.0)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    args = _args(tmp_path, BLOCKS_AT_IMPORT, name="rw_imp")
    if job == "sft":  # its rewards score held-out answers
        data = args[args.index("--dataset") + 1]
        args += ["--job", "sft", "--eval-dataset", data, "--column", "completion=answer"]
    started = time.monotonic()
    result = crf(*args)
    assert time.monotonic() - started < 300  # not the 400 s it blocks for
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert line.startswith("error: --reward rw_imp:score: importing rw_imp did not finish "
                           "within 1s"), line  # fmt: skip
    assert "load models or data on the reward's first call" in line
    assert not list(tmp_path.glob("crf-workdir-check-*"))
    assert not (tmp_path / "runs").exists()


#: BLOCKS, saying first that the check called it (a file named by CRF_TEST_CALLED)
BLOCKS_SAYS = """
import os, pathlib, time

def score(completions, **kw):
    pathlib.Path(os.environ["CRF_TEST_CALLED"]).touch()
    time.sleep(400)
    return [0.0] * len(completions)
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_stopping_the_launch_during_the_check_removes_its_workdir_copy(
    how: signal.Signals, tmp_path: Path
) -> None:
    """Stopped while the reward check runs (the reward has said it was called: a signal
    at a time the test cannot see would make the test depend on the machine's load)."""
    called = tmp_path / "called"
    env = {**os.environ, "CRF_TEST_CALLED": str(called)}
    # Ctrl-C as a terminal delivers it: a CI job's background shell starts its processes with
    # SIGINT ignored, and Python then takes no KeyboardInterrupt from it
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = _process(tmp_path, _args(tmp_path, BLOCKS_SAYS), env=env, preexec_fn=default_sigint)
    deadline = time.monotonic() + 240
    while not called.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    assert list((tmp_path / "tmp").glob("crf-workdir-check-*"))
    proc.send_signal(how)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert _one_line(output) == "interrupted before launch: nothing was started"
    assert not list((tmp_path / "tmp").iterdir())
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------- exits, syntax errors
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("import sys\ndef score(completions, **kw):\n    sys.exit(1)\n",
         "--reward rw_chk:score called sys.exit(1) on 8 row(s) of --dataset"),
        ("import sys\ndef score(completions, **kw):\n    sys.exit('no key')\n",
         "--reward rw_chk:score called sys.exit('no key') on 8 row(s)"),
        ("async def score(completions, **kw):\n    raise SystemExit(3)\n",
         "--reward rw_chk:score called sys.exit(3)"),
        ("import sys\nsys.exit('config missing')\ndef score(completions, **kw):\n    pass\n",
         "--reward rw_chk:score: importing rw_chk called sys.exit('config missing')"),
    ],
    ids=["exit-1", "exit-message", "async-raises-systemexit", "exit-at-import"],
)  # fmt: skip
def test_a_reward_that_exits_is_named_in_one_line(body: str, message: str, tmp_path) -> None:
    proc = _process(tmp_path, [*_args(tmp_path, body), "--dry-run"])
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output
    line = _one_line(output)
    assert line.startswith("error: ") and message in line, line


def test_a_syntax_error_names_the_users_file_not_the_checks_copy(tmp_path: Path) -> None:
    body = "def score(completions, **kw)\n    return [0.0] * len(completions)\n"
    proc = _process(tmp_path, [*_args(tmp_path, body), "--dry-run"])
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output
    line = _one_line(output)
    assert f"raised SyntaxError: expected ':' ({tmp_path / 'wd' / 'rw_chk.py'}, line 1)" in line
    assert "crf-workdir-check" not in line


# ---------------------------------------------------------------------- what TRL accepts
ACCEPTED = {
    "bools": "[c == a for c, a in zip(completions, answer)]",
    "numpy-array": "np.zeros(len(completions))",
    "numpy-bools": "np.array([True] * len(completions))",
    "numpy-scalars": "[np.float32(0.5)] * len(completions)",
    "torch-tensor": "torch.ones(len(completions))",
    "torch-scalars": "[torch.tensor(1.0)] * len(completions)",
    "generator": "(0.0 for _ in completions)",
    "tuple-of-ints": "tuple(1 for _ in completions)",
}
REFUSED = {
    "strings": ("['1.0'] * len(completions)", "returned '1.0' for the 1st row"),
    "nan": ("[float('nan')] * len(completions)", "returned nan for the 1st row"),
    "inf-in-numpy": ("np.full(len(completions), np.inf)", "returned inf for the 1st row"),
    "nested": ("[[1.0]] * len(completions)", "returned [1.0] for the 1st row"),
    "2-d-array": ("np.zeros((len(completions), 1))", "returned array([0.]) for the 1st row"),
    "a-number": ("1.0", "returned a float"),
    "a-dict": ("{'r': 1.0}", "returned a dict"),
    "too-few": ("np.zeros(2)", "returned 2 values"),
    "past-float32": ("[1e40] * len(completions)", "returned 1e+40 for the 1st row"),  # inf
}
BODY = "import numpy as np\nimport torch\n\ndef score(completions, answer, **kw):\n    return {}\n"


def _trl_rewards(out: Any) -> Any:
    """What TRL 1.x's GRPOTrainer._calculate_rewards makes of a sync reward's output."""
    import torch

    values = [r if r is not None else torch.nan for r in out]
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("expr", list(ACCEPTED.values()), ids=list(ACCEPTED))
def test_what_trl_turns_into_rewards_passes_the_check(expr: str, tmp_path: Path) -> None:
    import numpy as np
    import torch

    completions, answer = ["ab", "cd"], ["ab", "x"]
    got = _trl_rewards(eval(expr, {"np": np, "torch": torch, "completions": completions,  # noqa: S307
                                   "answer": answer}))  # fmt: skip
    assert got.shape == (2,) and bool(torch.isfinite(got).all())
    result = crf(*_args(tmp_path, BODY.format(expr)), "--dry-run")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("expr,message", list(REFUSED.values()), ids=list(REFUSED))
def test_what_trl_cannot_train_on_is_refused(expr: str, message: str, tmp_path: Path) -> None:
    import numpy as np
    import torch

    try:
        got = _trl_rewards(eval(expr, {"np": np, "torch": torch, "completions": ["a"] * 8}))  # noqa: S307
        trains = got.shape == (8,) and bool(torch.isfinite(got).all())
    except (TypeError, ValueError, RuntimeError):
        trains = False
    assert not trains  # TRL fails, or trains on values that are not numbers
    result = crf(*_args(tmp_path, BODY.format(expr)), "--dry-run")
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert line.startswith("error: --reward rw_chk:score ") and message in line, line


def test_check_values_reads_numbers_as_torch_does() -> None:
    import numpy as np
    import torch

    for value, number in [(True, 1.0), (np.bool_(False), 0.0), (np.int64(3), 3.0),
                          (torch.tensor(0.25), 0.25), (np.array(2.0), 2.0), (7, 7.0)]:  # fmt: skip
        assert reward_checks.reward_value(value) == number
    for value in ["1", None, [1.0], np.array([1.0]), torch.ones(2), b"1", 1j]:
        assert reward_checks.reward_value(value) is None
    assert math.isnan(reward_checks.reward_value(float("nan")) or 0.0)


ONE_ROW = """
def score(completions, answer, **kw):
    return [float({"ba": 1, "acb": 0, "bac": 2, "dd": 1, "cba": 0, "dc": 1}[a]) for a in answer]
"""
EVERY_ROW = "def score(completions, **kw):\n    return [float(kw['solution']) for _ in kw]\n"


def test_an_error_that_one_row_raises_names_its_line(tmp_path: Path) -> None:
    """A reward that fails on one row names that row's line in the file (the 7th row,
    'bad=', has an answer the reward's table lacks); an error of every row (a column the
    data does not have) is the call's, and names no row."""
    result = crf(*_args(tmp_path, ONE_ROW), "--dry-run")
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "--reward rw_chk:score raised KeyError: 'dab' on line 7 of --dataset" in line, line
    assert "(8 rows called)" in line
    (tmp_path / "every").mkdir()
    result = crf(*_args(tmp_path / "every", EVERY_ROW), "--dry-run")
    line = " ".join(result.output.split())
    assert "raised KeyError: 'solution' on 8 row(s) of" in line, line


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_a_reward_is_checked_on_the_embedded_task_too(tmp_path: Path, job: str) -> None:
    """Without --dataset the replicas train on the job's embedded task and call the rewards
    on its held-out rows as they set up: so does the check, before anything starts (else
    each replica fails at setup, after its start and model load)."""
    body = "def score(completions, solution, **kw):\n    return [0.0] * len(completions)\n"
    wd, _ = _setup(tmp_path, body, "rw_emb")
    args = ["launch", "--store", str(tmp_path / "runs"), "--workdir", wd, "--reward",
            "rw_emb:score", "--no-progress", "-n", "2", "-r", "1", "-H", "1",
            "--job", job]  # fmt: skip
    for extra in (["--dry-run"], []):
        result = crf(*args, *extra)
        assert result.exit_code == 2, result.output
        assert _one_line(result.output).startswith(
            "error: --reward rw_emb:score takes a parameter 'solution', which no column of "
            f"the {job} job's embedded task fills"
        ), result.output
    assert not (tmp_path / "runs").exists()
    (Path(wd) / "rw_emb.py").write_text(body.replace("solution, ", ""))
    assert crf(*args, "--dry-run").exit_code == 0


def test_a_reward_that_reads_the_trainer_state_is_told_it_is_none_here(tmp_path: Path) -> None:
    body = "def score(completions, trainer_state, **kw):\n" \
           "    return [trainer_state.global_step / 100] * len(completions)\n"  # fmt: skip
    result = crf(*_args(tmp_path, body), "--dry-run")
    assert result.exit_code == 2, result.output
    assert (
        "raised AttributeError: 'NoneType' object has no attribute 'global_step' on 8 row(s) of "
        f"--dataset {tmp_path / 'train.jsonl'} (trainer_state is None outside a training step: "
        "in the held-out evaluation and the check before launch); fix the function"
    ) in " ".join(result.output.split())


READS_ITS_VARIABLES = """
import os

URL = os.environ["JUDGE_URL"]  # read as the module is imported


def score(completions, **kw):
    print("judge key " + os.environ["JUDGE_TOKEN"])
    return [0.5] * len(completions)
"""


def test_a_reward_sees_the_runs_env_and_secrets_in_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replicas get --env and --secret KEY=@file: so does the check, which imports and
    calls the reward in this process, so a reward the replicas will run passes; this
    process's environment is as it was afterwards, and the key is not printed."""
    monkeypatch.delenv("JUDGE_URL", raising=False)
    monkeypatch.delenv("JUDGE_TOKEN", raising=False)
    (tmp_path / "key").write_text("jk-from-a-file-0123\n")
    args = [*_args(tmp_path, READS_ITS_VARIABLES), "--env", "JUDGE_URL=https://judge.example.com",
            "--secret", f"JUDGE_TOKEN=@{tmp_path / 'key'}", "--dry-run"]  # fmt: skip
    result = crf(*args)
    assert result.exit_code == 0, result.output
    assert "judge key ***" in result.output and "jk-from-a-file" not in result.output
    assert "JUDGE_URL" not in os.environ and "JUDGE_TOKEN" not in os.environ
    result = crf(*[a for a in args if not a.startswith("JUDGE_URL=") and a != "--env"])
    assert result.exit_code == 2 and "raised KeyError: 'JUDGE_URL'" in result.output


# ---------------------------------------------------------------------- cloud replicas
def _cloud_dry_run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``crf launch --backend modal --dry-run`` in ``cwd``: the plan and what is missing (no
    credentials here), or the one line of a refusal."""
    full = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "crf.launcher.cli", "launch", "--backend",
                          "modal", "--gpu", "T4", "--store", "s3://bucket/runs", "--dry-run",
                          *args], cwd=cwd, env=full, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    return out.stdout + out.stderr


def test_a_reward_the_cloud_replicas_cannot_import_is_refused(tmp_path: Path) -> None:
    """A reward module in the working directory (or on PYTHONPATH) imports here, but a cloud
    replica runs elsewhere: without --workdir shipping it, each replica would fail at setup,
    after its container started. Shipped, or from crf itself, it passes."""
    body = "def score(completions, **kw):\n    return [0.5] * len(completions)\n"
    (tmp_path / "proj" / "pkg").mkdir(parents=True)
    (tmp_path / "proj" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "proj" / "pkg" / "judge.py").write_text(body)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "onpath.py").write_text(body)
    proj = tmp_path / "proj"
    text = _cloud_dry_run(proj, "--reward", "pkg.judge:score")
    assert (
        f"error: --reward pkg.judge:score: pkg.judge is imported from {proj / 'pkg' / 'judge.py'} "
        "on this machine, which the modal replicas cannot read (no --workdir); ship its folder "
        f"with --workdir {proj}, or install it in their image (--pip, --image)"
    ) in text, text
    text = _cloud_dry_run(
        proj, "--reward", "onpath:score", env={"PYTHONPATH": f"{REPO}:{tmp_path / 'lib'}"}
    )
    assert f"with --workdir {tmp_path / 'lib'}," in text, text
    for args in (["--workdir", str(proj), "--reward", "pkg.judge:score"],
                 ["--reward", "crf.composer.task:reverse_reward"],
                 ["--image", "me/rewards:1", "--reward", "pkg.judge:score"]):  # fmt: skip
        text = _cloud_dry_run(proj, *args)
        assert "error:" not in text and "nothing was launched" in text, (args, text)


# ---------------------------------------------------------------------- warnings
def test_a_reward_given_twice_or_weighted_zero_is_warned_about(tmp_path: Path) -> None:
    body = "def score(completions, **kw):\n    return [0.0] * len(completions)\n"
    args = _args(tmp_path, body, "rw_chk:score", "rw_chk:score=2", "exact_match=0")
    result = crf(*args, "--dry-run")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (
        "warning: --reward rw_chk:score is given 2 times (weights 1, 2): it is called "
        "once per entry and logged under one name; give it once, as rw_chk:score=3"
    ) in text
    assert ("warning: --reward exact_match=0 has weight 0: it is called and logged, but adds "
            "nothing to the reward trained on") in text  # fmt: skip
    assert reward_checks.reward_warnings(["exact_match=0"]) == [
        "every --reward has weight 0: the reward trained on is 0 for every completion, so "
        "GRPO has nothing to learn from; give a reward a weight other than 0"
    ]
    assert reward_checks.reward_warnings(["exact_match", "format:x=0.5"]) == []


# ---------------------------------------------------------------------- a reward with no values
def test_a_step_where_a_reward_gave_no_value_is_recorded_and_warned_about() -> None:
    from crf.composer.callback import missing_rewards
    from crf.launcher.summary import reward_warnings, rewards_missing

    logs = {"loss": 0.1, "reward": 0.5, "rewards/rw.a/mean": float("nan"), "rewards/rw.b/mean": 1.0}
    assert missing_rewards(logs) == {"reward_missing/rw.a": 1.0, "reward_missing/rw.b": 0.0}
    records = {
        0: [{"round": 0, "metrics": {"reward_missing/rw.a": 1.0, "reward_missing/rw.b": 0.5}},
            {"round": 1, "metrics": {"reward_missing/rw.a": 0.5}}],
        1: [{"round": 1, "metrics": {"reward_missing/rw.a": 1.0}}],
    }  # fmt: skip
    assert rewards_missing(records) == {"rw.a": [0, 1]}
    (line,) = reward_warnings(rewards_missing(records))
    assert line.startswith("reward rw.a gave no value (None or NaN for every completion) in "
                           "round(s) 0, 1: ")  # fmt: skip


TRAINS = """
import numpy as np

def bools(completions, answer, **kw):
    return np.array([c.strip() == a for c, a in zip(completions, answer)])

def nan_in_training(completions, trainer_state=None, **kw):
    return [0.0 if trainer_state is None else float("nan") for _ in completions]
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_trains_on_a_numpy_bools_reward_and_warns_of_one_that_gave_no_value(
    tmp_path: Path,
) -> None:
    args = _args(tmp_path, TRAINS, "rw_chk:bools", "rw_chk:nan_in_training")
    proc = _process(tmp_path, [*args, "--rounds", "1", "-H", "2"])
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    text = " ".join(output.split())
    assert ("warning: reward rw_chk.nan_in_training gave no value (None or NaN for every "
            "completion) in round(s) 0") in text  # fmt: skip
    (result,) = (tmp_path / "runs").glob("*/result.json")
    summary = json.loads(result.read_text())
    assert summary["status"] == "ok" and summary["rewards_missing"] == {
        "rw_chk.nan_in_training": [0]
    }
    assert any("rw_chk.nan_in_training gave no value" in w for w in summary["warnings"])
    assert summary["learning"]["reward"]["last"] is not None  # the bools reward trained


# ---------------------------------------------------------------------- a column that is not there
def test_a_reward_parameter_no_column_fills_names_the_columns_there_are(tmp_path: Path) -> None:
    """TRL passes each column under its own name: a reward whose parameter names a column
    the data lacks said "score() missing 1 required positional argument: 'solution'"; it is
    told which columns a reward gets, and the two fixes."""
    body = "def score(completions, solution, **kw):\n    return [0.0 for _ in completions]\n"
    args = _args(tmp_path, body)
    result = crf(*args, "--dry-run")
    assert result.exit_code == 2, result.output
    assert _one_line(result.output) == (
        f"error: --reward rw_chk:score takes a parameter 'solution', which no column of "
        f"--dataset {tmp_path / 'train.jsonl'} fills (a reward gets each column under its own "
        "name; here: answer): name the parameter after a column, or give it a default"
    )


def test_a_missing_column_lists_the_first_columns_there_are(tmp_path: Path) -> None:
    """The column a job or a reward needs, missing from a file of many columns: the line
    lists the first of those it has, and how many in all."""
    data = tmp_path / "wide.jsonl"
    data.write_text("".join(json.dumps({"question": f"{w}=", **{f"feature_{i}": i
                                        for i in range(30)}}) + "\n" for w in WORDS))  # fmt: skip
    shown = ", ".join(["question", *(f"feature_{i}" for i in range(11))])
    for job, says in [
        ("composer", f"has no column 'prompt'; its columns are {shown}, ... (31 in all) (map "
                     "one with --column prompt=COLUMN)"),
        ("sft", f"has none of the sft formats: a 'text' column, 'prompt' and 'completion' "
                f"columns, or 'messages'; its columns are {shown}, ... (31 in all) (map one "
                "with --column text=COLUMN, or prompt=... and completion=...)"),
    ]:  # fmt: skip
        result = crf("launch", "--job", job, "--dataset", str(data), "--store",
                     str(tmp_path / "runs"), "--dry-run")  # fmt: skip
        assert result.exit_code == 2, result.output
        said = _one_line(result.output)
        assert said == f"error: --dataset {data} {says}", said
