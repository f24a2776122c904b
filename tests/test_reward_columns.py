"""Reward functions called as TRL's GRPOTrainer calls them, in the check before launch and in
the replicas alike: every column of the dataset as a keyword list, prompts and completions
in the form of the dataset's prompts (text stays text when a chat template is applied),
``async def`` rewards awaited; and what a reward that cannot be called that way is told."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crf.replica.data import job_row, kept_columns
from crf.replica.rewards import (
    PLAIN_PROMPT,
    RewardError,
    RewardFailed,
    build_rewards,
    call,
    in_dataset_form,
    is_async,
    parse_reward,
)
from tests.test_cli import crf

REPO = Path(__file__).resolve().parent.parent
WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 4  # 32 rows


# ---------------------------------------------------------------------- the pieces
def test_every_column_is_kept_and_a_mapping_wins_over_a_column_of_the_fields_name() -> None:
    names = ["question", "solution", "answer", "difficulty", "completions", "hint", "image"]
    keep = kept_columns({"question": "prompt", "solution": "answer", "hint": "hint"}, names)
    row = {"question": "ab=", "solution": "ba", "answer": "stale", "difficulty": None,
           "completions": "x", "hint": "", "image": {"bytes": b""}}  # fmt: skip
    assert job_row(row, keep) == {
        "prompt": "ab=",
        "answer": "ba",  # the fields, by the mapping
        "question": "ab=",
        "solution": "ba",  # and each column under its own name
        "difficulty": None,  # a reward gets a null as TRL gives it
    }  # fmt: skip
    # the stale `answer` column loses to the mapping, `completions` is TRL's own argument,
    # an image would be a vision model's input, and an empty hint is no hint


def test_a_column_that_mixes_kinds_reaches_the_reward_as_the_file_holds_it() -> None:
    """An extra column of text in one row and an object or a list in others is held as a
    ``Json`` column (as ``load_dataset`` holds it): the trainer's rows give back each value
    as it was; the job's own columns keep their plain types."""
    from crf.replica.jobs.composer import train_dataset

    rows = [{"prompt": "ab=", "meta": "x", "id": 1}, {"prompt": "ba=", "meta": {"k": 1}},
            {"prompt": "cd=", "meta": [1, "a"], "id": "three"}]  # fmt: skip
    ds = train_dataset(rows)
    assert str(ds.features["prompt"]) == "Value('string')"
    assert [ds[i]["meta"] for i in range(3)] == ["x", {"k": 1}, [1, "a"]]
    assert [ds[i]["id"] for i in range(3)] == [1, None, "three"]


def test_a_train_dataset_keeps_a_column_its_first_row_lacks() -> None:
    from crf.replica.jobs.composer import train_dataset

    ds = train_dataset(
        [{"prompt": "a", "answer": "a"}, {"prompt": "b", "answer": "b", "hint": "h"}]
    )
    assert ds.column_names == ["prompt", "answer", "hint"] and ds["hint"] == [None, "h"]


def test_text_prompts_sent_as_conversations_come_back_to_the_reward_as_text() -> None:
    seen: dict[str, Any] = {}

    def reward(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions, keys=sorted(kw))
        return [1.0] * len(prompts)

    fn = in_dataset_form(reward)
    assert fn.__name__ == "reward"
    native = [{"role": "user", "content": "q2"}]
    said = [[{"role": "assistant", "content": "a1"}], [{"role": "assistant", "content": "a2"}]]
    fn(prompts=[[{"role": "user", "content": "q1"}], native], completions=said,
       completion_ids=[[1], [2]], difficulty=[1, 2], **{PLAIN_PROMPT: ["q1", None]})  # fmt: skip
    assert seen["prompts"] == ["q1", native]  # the row the dataset gave as a conversation stays
    assert seen["completions"] == ["a1", [{"role": "assistant", "content": "a2"}]]
    assert seen["keys"] == ["completion_ids", "difficulty"]


def test_an_async_reward_stays_async_and_is_named_when_it_raises(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "crf_test_async_rw.py").write_text(
        "async def score(completions, **kw):\n"
        "    if completions == ['boom']:\n"
        "        raise KeyError('k')\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("crf_test_async_rw", None)
    (fn,), _ = build_rewards(["crf_test_async_rw:score"])
    assert is_async(fn) and is_async(in_dataset_form(fn))  # TRL runs it on its event loop
    assert asyncio.run(fn(completions=["abc"])) == [3.0]

    async def inside_a_running_loop() -> Any:  # call() works where a loop already runs
        return call(in_dataset_form(fn), prompts=["p"], completions=["ab"])

    assert asyncio.run(inside_a_running_loop()) == [2.0]
    with pytest.raises(RewardFailed, match="reward crf_test_async_rw:score raised KeyError"):
        call(fn, completions=["boom"])


def test_a_reward_named_by_its_file_path_is_told_the_module_and_workdir() -> None:
    with pytest.raises(RewardError) as e:
        parse_reward("wd/rw_ok.py:score")
    assert "--workdir wd --reward rw_ok:score" in str(e.value)


# ---------------------------------------------------------------------- dry runs
@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template (tests/hub_models.py)."""
    from tests.hub_models import save_tiny_repo

    folder = tmp_path_factory.mktemp("model") / "tiny"
    save_tiny_repo(folder)
    return folder


def _data(path: Path, conversations: bool = False) -> str:
    rows = []
    for i, w in enumerate(WORDS):
        prompt: Any = [{"role": "user", "content": f"{w}="}] if conversations else f"{w}="
        # meta mixes kinds (text, an object): no job field, so it only travels to the rewards
        meta: Any = f"row {i}" if i % 2 else {"source": "seed", "i": i}
        rows.append({"question": prompt, "solution": w[::-1], "difficulty": 1 + i % 3,
                     "meta": meta})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dry_run(tmp: Path, model: Path, body: str, *extra: str, conversations: bool = False):
    (tmp / "wd").mkdir(exist_ok=True)
    (tmp / "wd" / "rw_user.py").write_text(body)
    data = _data(tmp / "train.jsonl", conversations)
    return crf("launch", "--store", str(tmp / "runs"), "--replicas", "2", "--dry-run",
               "--model", str(model), "--dataset", data, "--column", "prompt=question",
               "--column", "answer=solution", "--workdir", str(tmp / "wd"),
               "--reward", "rw_user:score", *extra)  # fmt: skip


READS_COLUMNS = """
def score(completions, difficulty, solution, answer, **kw):
    # its own column, and the original name of a mapped one beside the field's name
    assert solution == answer
    return [1.0 / d for d in difficulty]
"""
STRIPS = """
def score(completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""
ASYNC = """
import asyncio

async def score(completions, difficulty, log_metric, log_extra, trainer_state, **kw):
    await asyncio.sleep(0)
    log_metric("judge_calls", 1.0)
    log_extra("difficulty", difficulty)
    return [0.5 for _ in completions]
"""


@pytest.mark.parametrize(
    ("body", "conversations"),
    [(READS_COLUMNS, False), (STRIPS, False), (ASYNC, False), (ASYNC, True)],
    ids=["reads-its-columns", "text-completions-with-a-chat-model", "async", "async-chat"],
)
def test_a_reward_that_works_in_trl_passes_the_check(
    body: str, conversations: bool, tmp_path: Path, chat_model: Path
) -> None:
    result = _dry_run(tmp_path, chat_model, body, conversations=conversations)
    assert result.exit_code == 0, result.output
    assert "nothing was launched or written" in result.output


def test_a_column_named_text_reaches_a_composer_reward(tmp_path: Path, chat_model: Path) -> None:
    """``text`` and ``messages`` are sft formats, but in a composer dataset plain columns."""
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "rw_text.py").write_text(
        "def score(completions, text, **kw):\n    return [float(len(t)) for t in text]\n"
    )
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{w}=", "text": w}) + "\n" for w in WORDS))
    result = crf("launch", "--store", str(tmp_path / "runs"), "--replicas", "2", "--dry-run",
                 "--model", str(chat_model), "--dataset", str(data), "--workdir",
                 str(tmp_path / "wd"), "--reward", "rw_text:score")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_conversation_prompts_give_the_check_message_completions(
    tmp_path: Path, chat_model: Path
) -> None:
    """TRL hands a dataset of conversations message completions: a reward written for text
    fails on them, before launch."""
    result = _dry_run(tmp_path, chat_model, STRIPS, conversations=True)
    assert result.exit_code == 2
    assert "'list' object has no attribute 'strip'" in result.output
    assert len(result.output.strip().splitlines()) == 1


def _cli(tmp: Path, model: Path, body: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """The dry run as a real process (stderr kept: a warning would show there)."""
    (tmp / "wd").mkdir(exist_ok=True)
    (tmp / "wd" / "rw_user.py").write_text(body)
    data = _data(tmp / "train.jsonl")
    return subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--store", str(tmp / "runs"),
         "--replicas", "2", "--dry-run", "--model", str(model), "--dataset", data,
         "--column", "prompt=question", "--column", "answer=solution", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "args", "message"),
    [
        ("async def score(completions, **kw):\n    return [1 / 0 for _ in completions]\n",
         ["--reward", "rw_user:score"], "--reward rw_user:score raised ZeroDivisionError"),
        ("async def _s(completions, **kw):\n    return [1.0]\n"
         "def score(completions, **kw):\n    return _s(completions)\n",
         ["--reward", "rw_user:score"], "returned a coroutine"),
        ("", ["--reward", "wd/rw_user.py:score"], "--workdir wd --reward rw_user:score"),
        ("", ["--reward", "crf_nowhere_rw:score"], "pass --workdir FOLDER"),
        ("", ["--reward", "exact_match", "--column", "difficulty=difficulty"],
         "a reward function gets every column under its own name"),
    ],
    ids=["async-raises", "coroutine-from-a-def", "file-path", "no-workdir", "column-of-no-field"],
)  # fmt: skip
def test_a_reward_refused_before_launch_says_so_in_one_line(
    body: str, args: list[str], message: str, tmp_path: Path, chat_model: Path
) -> None:
    workdir = ["--workdir", str(tmp_path / "wd")] if "rw_user:score" in args else []
    proc = _cli(tmp_path, chat_model, body, *workdir, *args)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(out) == 1 and out[0].startswith("error: ") and message in out[0], out
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------- a real run
OBSERVER = """
import asyncio, json, os

LOG = {log!r}


def _seen(kind, prompts, completions, kw):
    with open(LOG, "a") as f:
        f.write(json.dumps({{
            "kind": kind, "pid": os.getpid(),
            "prompts": sorted({{type(p).__name__ for p in prompts}}),
            "completions": sorted({{type(c).__name__ for c in completions}}),
            "keys": sorted(kw), "difficulty": kw["difficulty"], "meta": kw["meta"],
            "state": kw["trainer_state"] is not None,
        }}) + "\\n")


def _text(c):
    return c if isinstance(c, str) else c[-1]["content"]


def plain(prompts, completions, **kw):
    _seen("plain", prompts, completions, kw)
    return [float(_text(c).strip() == a) / d
            for c, a, d in zip(completions, kw["solution"], kw["difficulty"])]


async def judge(prompts, completions, **kw):
    await asyncio.sleep(0)
    kw["log_metric"]("judge_calls", 1.0)
    _seen("judge", prompts, completions, kw)
    return [0.25 * d for d in kw["difficulty"]]
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_real_run_calls_the_rewards_as_trl_and_the_check_do(
    tmp_path: Path, chat_model: Path, monkeypatch
) -> None:
    """Two local replicas, a model with a chat template, text training prompts and a held-out
    file of conversations: a sync and an async reward read the dataset's own columns, get
    text completions for the text prompts (in training) and messages for the conversations
    (held-out), and the run trains."""
    from crf.launcher.driver import launch

    log = tmp_path / "seen.jsonl"
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "rw_obs.py").write_text(OBSERVER.format(log=str(log)))
    monkeypatch.chdir(tmp_path)
    summary = launch(
        {"job": "composer", "replicas": 2, "sync_every": 1, "rounds": 1, "run_id": "cols",
         "model": str(chat_model), "dataset": _data(tmp_path / "train.jsonl"),
         "eval_dataset": _data(tmp_path / "test.jsonl", conversations=True), "eval_examples": 4,
         "columns": {"prompt": "question", "answer": "solution"},
         "reward": ["rw_obs:plain", "rw_obs:judge=0.5"], "workdir": "wd",
         "job_config": {"prompts_per_step": 2, "num_generations": 2,
                        "max_completion_length": 4}},
        store=str(tmp_path / "runs"), progress=False, report=False,
    )  # fmt: skip
    assert summary["status"] == "ok", summary
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    seen = [s for s in seen if s["pid"] != os.getpid()]  # the replicas' calls, not the check's
    training = [s for s in seen if s["state"]]  # a trainer step (the check has no trainer)
    held_out = [s for s in seen if not s["state"] and s["prompts"] == ["list"]]
    assert {s["kind"] for s in training} == {"plain", "judge"}
    for s in training:  # text prompts: text, though the model saw them through its template
        assert s["prompts"] == ["str"] and s["completions"] == ["str"], s
        assert PLAIN_PROMPT not in s["keys"] and {"difficulty", "solution", "answer",
               "question", "log_metric", "log_extra"} <= set(s["keys"])  # fmt: skip
        assert set(s["difficulty"]) <= {1, 2, 3}
        assert all(m.startswith("row ") if isinstance(m, str) else m["source"] == "seed"
                   for m in s["meta"]), s["meta"]  # fmt: skip
        assert {type(m).__name__ for m in s["meta"]} <= {"str", "dict"}
    assert {s["kind"] for s in held_out} == {"plain", "judge"}  # each held-out scoring
    assert all(s["completions"] == ["list"] for s in held_out)  # conversations: messages
    after = summary["held_out"]["after"]
    assert after["examples"] == 4 and "reward/rw_obs.judge" in after


def test_the_check_gives_an_empty_hint_as_the_replicas_do(tmp_path: Path, chat_model) -> None:
    """A row with an empty hint takes no part in the hint channel: the replicas give a reward
    None for it, and so does the check, which so refuses a reward that cannot take it."""
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "rw_hint.py").write_text(
        "def score(completions, hint, **kw):\n    return [float(len(h.lower())) for h in hint]\n"
    )
    rows = [{"prompt": f"{w}=", "answer": w[::-1], "hint": "" if i == 1 else f"reverse {w}"}
            for i, w in enumerate(WORDS)]  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = crf("launch", "--store", str(tmp_path / "runs"), "--replicas", "2", "--dry-run",
                 "--model", str(chat_model), "--dataset", str(data), "--workdir",
                 str(tmp_path / "wd"), "--reward", "rw_hint:score")  # fmt: skip
    assert result.exit_code != 0, result.output
    assert "--reward rw_hint:score raised AttributeError" in result.output, result.output
