"""Held-out evaluation (crf/replica/evaluation.py): the replicas' shares scored apart and added
up give the whole set's figures; the held-out rows are the same on every replica; the
launcher refuses held-out options that cannot work, before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crf.launcher.driver import LaunchError, prepare
from crf.replica.data import eval_source, load_eval
from crf.replica.evaluation import (
    AFTER,
    BEFORE,
    Partial,
    combine,
    held_out,
    replica_means,
    score,
    share,
)
from crf.replica.tracking import round_values

WORDS = ["ab", "abc", "ca", "dab", "cc", "bad", "dc", "acd", "bb", "cab", "da"]


def _rows(words: list[str] = WORDS) -> list[dict]:
    return [{"prompt": f"{w}=", "answer": w[::-1], "hint": w[::-1]} for w in words]


def _model():
    from crf.composer import char_tokenizer, tiny_qwen2
    from crf.composer.task import task_alphabet

    tokenizer = char_tokenizer(task_alphabet("abcd"))
    return tiny_qwen2(tokenizer, seed=3, hidden_size=32, num_layers=1, num_heads=2), tokenizer


def _first_letter(completions, answer, **_):
    """Partial credit a random model earns now and then: the first letter is right."""
    return [float(c[:1] == a[:1]) for c, a in zip(completions, answer, strict=True)]


def test_shares_scored_apart_add_up_to_the_whole_set() -> None:
    from crf.replica.rewards import exact_match

    model, tokenizer = _model()
    rows = _rows()
    rewards = {"reward_funcs": [exact_match, _first_letter], "reward_weights": [1.0, 0.5]}
    kw = dict(max_new=4, threshold=0.5, of=len(rows))
    whole = score(model, tokenizer, rows, rewards, **kw)
    parts = [score(model, tokenizer, share(rows, r, 3), rewards, **kw) for r in range(3)]
    assert [p.n for p in parts] == [4, 4, 3]  # rows r::3: nobody scores more than its third
    records = [{"round": 0, "committed": True, "metrics": p.to_metrics()} for p in parts]
    combined = combine(records)
    assert combined is not None
    assert (combined.n, combined.passed, combined.of) == (whole.n, whole.passed, len(rows))
    assert combined.sums == pytest.approx(whole.sums)
    assert set(whole.sums) == {"exact_match", "_first_letter"}
    # pass: weighted total >= 0.5, i.e. the first letter right (0.5) or the whole answer
    assert whole.passed == round(whole.sums["_first_letter"])


def test_combine_skips_uncommitted_records_and_says_how_many_rows_it_covers() -> None:
    a = Partial(n=3, passed=1, of=8, sums={"r": 1.5})
    b = Partial(n=3, passed=3, of=8, sums={"r": 3.0})
    c = Partial(n=2, passed=2, of=8, sums={"r": 2.0})
    metrics = {
        0: [{"round": 0, "committed": True, "metrics": {**a.to_metrics(),
             **Partial(n=3, passed=0, of=8, sums={"r": 0.0}).to_metrics(BEFORE)}}],
        1: [{"round": 0, "committed": True, "metrics": b.to_metrics()},
            {"round": 1, "committed": True, "metrics": b.to_metrics()}],
        # outside round 1's quorum: it did not hold the global model
        2: [{"round": 0, "committed": True, "metrics": c.to_metrics()},
            {"round": 1, "committed": False, "metrics": c.to_metrics()}],
    }  # fmt: skip
    h = held_out(metrics)
    assert h is not None
    assert h["per_round"][0] == {"examples": 8, "of": 8, "pass@1": 6 / 8, "reward/r": 6.5 / 8}
    # round 1: replica 0 missed it, replica 2's record is not committed: one share of three
    assert h["per_round"][1] == {"examples": 3, "of": 8, "pass@1": 1.0, "reward/r": 1.0}
    assert h["last_round"] == 1 and h["pass@1_after"] == 1.0
    assert h["before"]["examples"] == 3 and h["pass@1_before"] == 0.0
    assert held_out({0: [{"round": 0, "metrics": {"reward": 0.5}}]}) is None


def test_a_tracker_gets_the_replicas_own_means_not_sums() -> None:
    p = Partial(n=4, passed=1, of=8, sums={"exact_match": 1.0})
    got = round_values({"round": 2, "loss": 0.5, "metrics": {"reward": 0.3, **p.to_metrics()}})
    assert got["eval/pass@1"] == 0.25 and got["eval/reward/exact_match"] == 0.25
    assert got["eval/examples"] == 4.0 and got["reward"] == 0.3
    assert not [k for k in got if k.startswith(f"{AFTER}/sum")]
    assert replica_means({"x": 1.0}) == {"x": 1.0}


class _Spec:
    def __init__(self, **kw) -> None:
        self.dataset, self.dataset_config, self.dataset_split = None, None, "train"
        self.eval_split = self.eval_dataset = None
        self.eval_examples, self.seed, self.columns = 4, 7, {"prompt": "q", "answer": "a"}
        self.__dict__.update(kw)


def _jsonl(path: Path, words: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"q": f"{w}=", "a": w[::-1]}) + "\n" for w in words))
    return str(path)


def test_held_out_rows_are_a_fixed_subsample_of_the_split(tmp_path: Path) -> None:
    _jsonl(tmp_path / "d" / "train.jsonl", WORDS[:4])
    _jsonl(tmp_path / "d" / "test.jsonl", WORDS[4:])
    folder = _Spec(dataset=str(tmp_path / "d"), eval_split="test")
    assert eval_source(folder) == (str(tmp_path / "d"), None, "test")
    rows = load_eval(folder, needs_answer=True)
    assert len(rows) == 4 and {r["prompt"][:-1] for r in rows} <= set(WORDS[4:])
    assert rows == load_eval(folder, needs_answer=True)  # every replica: the same rows
    assert rows != load_eval(_Spec(dataset=folder.dataset, eval_split="test", seed=8), True)
    other = _Spec(eval_dataset=_jsonl(tmp_path / "held.jsonl", WORDS), eval_examples=100)
    assert [r["answer"] for r in load_eval(other, True)] == [w[::-1] for w in WORDS]


def _prepare(tmp_path: Path, **options):
    # a batch of 2 prompts: the small datasets here give each replica one at least
    if options.get("job", "composer") == "composer":
        options.setdefault("job_config", {"prompts_per_step": 2, "num_generations": 2})
    return prepare(
        {"replicas": 2, **options}, store=str(tmp_path / "runs"), dry_run=True
    )  # fmt: skip


def test_prepare_refuses_held_out_options_that_cannot_work(tmp_path: Path, monkeypatch) -> None:
    train = _jsonl(tmp_path / "train.jsonl", WORDS[:4])
    cols = {"prompt": "q", "answer": "a"}
    with pytest.raises(LaunchError, match="^--eval-split test names a split of --dataset"):
        _prepare(tmp_path, eval_split="test")
    with pytest.raises(LaunchError, match="is one file, one split; pass the held-out file as"):
        _prepare(tmp_path, dataset=train, columns=cols, eval_split="test")
    _jsonl(tmp_path / "d" / "train.jsonl", WORDS[:4])
    with pytest.raises(LaunchError, match="--eval-split train is the split the run trains on"):
        _prepare(tmp_path, dataset=str(tmp_path / "d"), columns=cols, eval_split="train")
    with pytest.raises(
        LaunchError,
        match=r"--dataset .*/d has no split .test.: its files",
    ):
        _prepare(tmp_path, dataset=str(tmp_path / "d"), columns=cols, eval_split="test")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "ab="}) + "\n")
    with pytest.raises(LaunchError, match=r"^--eval-dataset .*bad.jsonl has no column 'a'"):
        _prepare(tmp_path, dataset=train, columns=cols, eval_dataset=str(bad))
    with pytest.raises(LaunchError, match="for the composer and sft jobs, not lm"):
        _prepare(tmp_path, job="lm", eval_dataset=str(bad))
    monkeypatch.chdir(tmp_path)  # relative paths become absolute for the replicas
    _jsonl(tmp_path / "d" / "test.jsonl", WORDS[4:])
    plan = _prepare(tmp_path, dataset="d", columns=cols, eval_split="test")
    assert plan.spec.dataset == str(tmp_path / "d")
    plan = _prepare(tmp_path, dataset="train.jsonl", columns=cols, eval_dataset="d/test.jsonl")
    assert plan.spec.eval_dataset == str(tmp_path / "d" / "test.jsonl")


def test_the_closing_line_and_the_live_title_show_the_combined_figure() -> None:
    from crf.launcher.progress import held_out_headline
    from crf.launcher.summary import held_out_text
    from crf.layout import Heartbeat

    h = {"pass@1_before": 0.125, "pass@1_after": 0.4, "last_round": 3,
         "after": {"examples": 48, "of": 64}}  # fmt: skip
    assert held_out_text(h) == "held-out pass@1 0.125 (before) -> 0.400 (round 3, 48/64 rows)"
    beats = [
        Heartbeat(rank=k, last_round=r, round_metrics=Partial(n=2, passed=p, of=4).to_metrics())
        for k, r, p in ((0, 2, 1), (1, 2, 2), (2, 1, 0))
    ]
    assert held_out_headline([*beats, None]) == ", held-out pass@1 0.750 (round 2, 4/4 rows)"
    assert held_out_headline([None]) == ""
