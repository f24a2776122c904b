"""The ``sft`` job: TRL's SFTTrainer as a DiLoCo replica.

- the three SFT formats (text, prompt/completion, messages) and ``--column``, each trained by
  the real SFTTrainer; a file with none of them, or with a value of the wrong kind, is refused
  before launch in one line;
- ``trl.<field>`` (any SFTConfig field) checked before launch, with "did you mean";
- end to end: ``--job sft`` on a tiny Qwen2 folder (2 replica processes, a held-out file),
  then ``crf export`` (tests/test_example_sft_then_grpo.py trains ``--job composer --model``
  on such a folder, 2 replicas ending bit-identical).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from crf.launcher.errors import LaunchError
from crf.launcher.plan import prepare, validate_job
from crf.replica.evaluation import held_out, loss_per_round
from crf.replica.jobs import sft
from crf.replica.jobs.sft import Config, row_order
from tests.inprocess_replica import InProcessContext

WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"]
FORMATS = {
    "text": [{"body": f"{w}={w[::-1]}"} for w in WORDS],
    "prompt-completion": [{"q": f"{w}=", "a": w[::-1]} for w in WORDS],
    "messages": [
        {"conv": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}
        for w in WORDS
    ],
}
COLUMNS = {
    "text": {"text": "body"},
    "prompt-completion": {"prompt": "q", "completion": "a"},
    "messages": {"messages": "conv"},
}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("form", list(FORMATS))
def test_each_format_trains_with_the_column_mapping(tmp_path: Path, form: str) -> None:
    """SFTTrainer on the tiny model over each format, the file's columns mapped: one logged
    step per optimizer step, the held-out sums at each round end; with prompt/completion
    only the completion's tokens (and the EOS TRL appends) count."""
    data = _jsonl(tmp_path / "d.jsonl", FORMATS[form])
    spec = SimpleNamespace(
        dataset=data, dataset_config=None, dataset_split="train", eval_dataset=data,
        eval_split=None, eval_examples=4, columns=COLUMNS[form], sync_every=2,
        device="cpu", precision="fp32", report_to="none",
    )  # fmt: skip
    ctx = InProcessContext(spec=spec, seed=0, data_seed=1, rank=0, world_size=1,
                           total_steps=4, step=0, logged=[])  # fmt: skip
    cfg = Config(per_device_train_batch_size=4, hidden_size=16, num_heads=2, num_layers=1)
    metrics = sft.run(ctx, cfg)
    assert metrics["steps"] == 4 and len(ctx.logged) == 4
    assert all(s["loss"] > 0 for s in ctx.logged)
    ends = [s for s in ctx.logged if "eval/tokens" in s]
    assert len(ends) == 2 and all(s["eval_loss"] > 0 for s in ends)
    assert "eval_before/tokens" in ends[0] and "eval_before/tokens" not in ends[1]
    if form == "prompt-completion":
        held = [r for i, r in enumerate(FORMATS[form]) if i in _subsample(len(WORDS), 4)]
        assert ends[0]["eval/tokens"] == sum(len(r["a"]) + 1 for r in held)
    assert metrics["rounds"][1]["eval/loss_sum"] == ends[1]["eval/loss_sum"]


def _subsample(n: int, k: int) -> set[int]:
    from crf.replica.data import fixed_subsample

    return set(fixed_subsample(list(range(n)), k, 0))


def _prepare(tmp_path: Path, **options: Any) -> None:
    prepare({"job": "sft", "replicas": 2, **options}, store=str(tmp_path / "runs"),
            dry_run=True)  # fmt: skip


@pytest.mark.parametrize("form", list(FORMATS))
def test_prepare_accepts_each_format(tmp_path: Path, form: str) -> None:
    data = _jsonl(tmp_path / "d.jsonl", FORMATS[form])
    _prepare(tmp_path, dataset=data, columns=COLUMNS[form], eval_dataset=data)


@pytest.mark.parametrize(
    ("rows", "columns", "says"),
    [
        ([{"question": "a", "answer": "b"}], {},
         "has none of the sft formats: a 'text' column, 'prompt' and 'completion' columns, "
         "or 'messages'; its columns are question, answer"),
        ([{"q": "a", "answer": "b"}], {"prompt": "q"}, r"\(--column prompt=q\) has none"),
        ([{"text": 3}], {}, "line 1: 'text' must be a string"),
        ([{"messages": ["hi"]}], {}, "'messages' must be a list of {'role', 'content'}"),
        ([{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}], {},
         "'prompt' and 'completion' must both be strings, or both lists"),
        ([{"text": "a"}], {"trace": "text"}, "'trace' is no field of the sft job"),
    ],
)  # fmt: skip
def test_a_dataset_without_an_sft_format_is_refused_in_one_line(
    tmp_path: Path, rows: list[dict[str, Any]], columns: dict[str, str], says: str
) -> None:
    data = _jsonl(tmp_path / "d.jsonl", rows * 2)
    with pytest.raises(LaunchError, match=says) as err:
        _prepare(tmp_path, dataset=data, columns=columns)
    assert "\n" not in str(err.value)


def test_held_out_data_and_rewards_are_checked_too(tmp_path: Path) -> None:
    good = _jsonl(tmp_path / "good.jsonl", [{"text": w} for w in WORDS])
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "a"}])
    with pytest.raises(LaunchError, match="^--eval-dataset .*bad.jsonl has none of the sft"):
        _prepare(tmp_path, dataset=good, eval_dataset=bad)
    with pytest.raises(LaunchError, match="--reward with the sft job scores held-out answers"):
        _prepare(tmp_path, dataset=good, reward=["exact_match"])
    with pytest.raises(LaunchError, match="is plain text: --reward scores answers to prompts"):
        _prepare(tmp_path, dataset=good, eval_dataset=good, reward=["exact_match"])
    pairs = _jsonl(tmp_path / "pairs.jsonl", FORMATS["prompt-completion"])
    columns = COLUMNS["prompt-completion"]
    with pytest.raises(LaunchError, match="has no column 'answer' for --reward"):
        _prepare(tmp_path, dataset=pairs, eval_dataset=pairs, columns=columns,
                 reward=["exact_match"])  # fmt: skip
    _prepare(tmp_path, dataset=pairs, eval_dataset=pairs, reward=["exact_match"],
             columns={**columns, "answer": "a"})  # fmt: skip


def test_an_eval_split_of_one_file_is_refused_as_for_composer(tmp_path: Path) -> None:
    """A file has one split: --eval-split of a --dataset file would score the training rows
    as "held-out" rows, so it is refused, as without a dataset or naming the training split."""
    good = _jsonl(tmp_path / "good.jsonl", [{"text": w} for w in WORDS])
    with pytest.raises(LaunchError, match="is one file, one split; pass the held-out file"):
        _prepare(tmp_path, dataset=good, eval_split="test")
    with pytest.raises(LaunchError, match="names a split of --dataset, and there is none"):
        _prepare(tmp_path, eval_split="test")
    folder = tmp_path / "splits"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"text": w} for w in WORDS])
    _jsonl(folder / "test.jsonl", [{"text": w} for w in WORDS[:2]])
    with pytest.raises(LaunchError, match="is the split the run trains on"):
        _prepare(tmp_path, dataset=str(folder), eval_split="train")
    _prepare(tmp_path, dataset=str(folder), eval_split="test")  # a real held-out split


def test_trl_fields_are_checked_against_sftconfig() -> None:
    """``--set trl.NAME=VALUE`` and a ``trl`` table reach SFTConfig typed; a misspelt name
    gets "did you mean", one crf sets or a knob of the job says where it is set."""
    typed = validate_job("sft", {"trl.warmup_steps": "3", "trl": {"lr_scheduler_type": "cosine"}})
    assert typed["trl"] == {"warmup_steps": 3, "lr_scheduler_type": "cosine"}
    assert validate_job("sft", {"trl.eval_packing": "false"})["trl"] == {"eval_packing": False}
    for sets, says in [
        ({"trl.warmup_step": "3"}, "trl.warmup_step is no SFTConfig field; did you mean "
                                   "trl.warmup_steps?"),
        ({"trl.max_steps": "9"}, "trl.max_steps is set by crf: use -H/--sync-every x --rounds"),
        ({"trl.learning_rate": "1e-4"}, r"a knob of the sft job: set it as the job's own "
                                        r"learning_rate \(--set learning_rate=\.\.\., or "
                                        r"learning_rate = \.\.\. in \[job\]\)"),
        ({"trl.model_init_kwargs": '{"dtype": "float16"}'}, "use --precision for its dtype"),
        ({"trl.trust_remote_code": "true"}, "use --trust-remote-code"),
        ({"trl.warmup_steps": "many"}, "trl.warmup_steps='many' is not a valid int"),
        ({"trl.lr_scheduler_type": "wobbly"}, "SFTConfig refuses"),
    ]:  # fmt: skip
        with pytest.raises(LaunchError, match=says) as err:
            validate_job("sft", sets)
        assert "\n" not in str(err.value)


def test_defaults_follow_the_model() -> None:
    """With --model the trainer settings are SFTConfig's own; LoRA learns 10x faster."""
    from trl import SFTConfig

    from crf.replica.trl_settings import checkpointing

    trl = SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                    **checkpointing(SFTConfig, False))  # fmt: skip
    given = Config().settings(model=True, lora=False)
    assert given["learning_rate"] == trl.learning_rate
    assert given["per_device_train_batch_size"] == trl.per_device_train_batch_size
    assert given["max_length"] == trl.max_length and given["packing"] is trl.packing is False
    assert Config().settings(model=True, lora=True)["learning_rate"] == 10 * trl.learning_rate
    assert Config(learning_rate=1e-3).settings(model=True, lora=True)["learning_rate"] == 1e-3


def test_row_order_continues_where_a_replica_stopped() -> None:
    """Epoch after epoch a permutation from the seed: every row once per epoch, and the same
    order when recomputed (a restarted replica takes it up from its step)."""
    order = row_order(5, 12, seed=3)
    assert sorted(order[:5]) == sorted(order[5:10]) == list(range(5))
    assert order[5:10] != order[:5] and row_order(5, 12, seed=3) == order
    assert row_order(5, 12, seed=4) != order


def test_combined_eval_loss_weighs_the_replicas_by_tokens() -> None:
    records = {
        0: [{"round": 0, "metrics": {"eval/loss_sum": 6.0, "eval/tokens": 2.0,
                                     "eval_before/loss_sum": 9.0, "eval_before/tokens": 3.0}}],
        1: [{"round": 0, "metrics": {"eval/loss_sum": 2.0, "eval/tokens": 6.0}},
            {"round": 1, "committed": False, "metrics": {"eval/loss_sum": 1, "eval/tokens": 1}}],
    }  # fmt: skip
    assert loss_per_round(records) == {0: pytest.approx(1.0)}
    h = held_out(records)
    assert h["loss_before"] == pytest.approx(3.0) and h["loss_after"] == pytest.approx(1.0)
    assert loss_per_round({0: [{"round": 0, "metrics": {"eval/tokens": 0.0}}]}) == {}


# ---------------------------------------------------------------------- end to end
def _launch(tmp_path: Path, run_id: str, **options: Any) -> dict[str, Any]:
    from crf.executors.local import LocalProcessExecutor
    from crf.launcher import driver

    return driver.launch(
        {"replicas": 2, "sync_every": 2, "run_id": run_id, "round_timeout_s": 120.0,
         **options},
        store=str(tmp_path / "runs"),
        env={"CRF_LOG_LEVEL": "WARNING"},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=0),
        progress=False, report=False, plot=False, poll_s=0.1, timeout_s=300,
    )  # fmt: skip


def _reversals(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 3))) for _ in range(n)]
    return [{"prompt": f"{w}=", "completion": w[::-1]} for w in words]


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_then_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    """2 replica processes SFT a tiny Qwen2 folder on a jsonl file (held-out file scored each
    round, split between them) and end bit-identical; the held-out loss per token, combined
    from both replicas' shares, falls; ``crf export`` writes a folder from_pretrained loads.
    (The composer job training ``--model`` an exported SFT folder, 2 replicas ending
    bit-identical, is tests/test_example_sft_then_grpo.py's GRPO run.)"""
    from transformers import AutoModelForCausalLM

    from crf.launcher.export import export
    from tests.hub_models import save_tiny_repo

    save_tiny_repo(tmp_path / "base")
    train = _jsonl(tmp_path / "train.jsonl", _reversals(64, 0))
    held = _jsonl(tmp_path / "test.jsonl", _reversals(8, 1))
    summary = _launch(
        tmp_path, "sft", job="sft", model=str(tmp_path / "base"), dataset=train,
        eval_dataset=held, eval_examples=8, rounds=2,
        job_config={"learning_rate": 3e-3, "per_device_train_batch_size": 8},
    )  # fmt: skip
    rows = summary["replicas"]
    assert summary["status"] == "ok", [r.get("error") for r in rows]
    assert summary["weights_identical"] is True and all(r["steps"] == 4 for r in rows)
    run = tmp_path / "runs" / "sft"
    for r in range(2):
        records = [json.loads((run / "metrics" / str(k) / f"{r}.json").read_text())
                   for k in range(2)]  # fmt: skip
        shares = [rec["metrics"]["eval/tokens"] for rec in records]
        assert all(s > 0 for s in shares) and all("eval_loss" in x["metrics"] for x in records)
    h = summary["held_out"]
    assert h["loss_after"] < h["loss_before"], h
    assert sorted(h["loss_per_round"]) == [0, 1]

    export("sft", str(tmp_path / "sft-model"), store=str(tmp_path / "runs"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sft-model")
    assert loaded.config.model_type == "qwen2"


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_across_two_local_ranks_matches_one(tmp_path: Path) -> None:
    """One replica of 2 local ranks (gloo, each with half of every batch) trains the embedded
    task to the weights one rank reaches with the whole batch: SFT draws no random numbers,
    so only the order of float sums differs (DDP averages two half-batch gradients, and the
    loss is normalised by the tokens of all ranks). Tolerance 1e-4 per weight after 4 AdamW
    steps; the held-out loss is reported the same way."""
    from safetensors.torch import load_file

    weights = {}
    for k in (1, 2):
        summary = _launch(
            tmp_path, f"k{k}", job="sft", replicas=1, rounds=2, procs_per_replica=k,
            job_config={"num_examples": 64},
        )  # fmt: skip
        assert summary["status"] == "ok", [r.get("error") for r in summary["replicas"]]
        assert summary["held_out"]["loss_after"] < summary["held_out"]["loss_before"]
        weights[k] = load_file(str(tmp_path / "runs" / f"k{k}" / "model" / "model.safetensors"))
    assert weights[1].keys() == weights[2].keys()
    worst = max(float((weights[1][n] - weights[2][n]).abs().max()) for n in weights[1])
    assert worst < 1e-4, worst


def test_held_out_keeps_the_mapping_when_the_answer_column_is_the_completion(
    tmp_path: Path,
) -> None:
    """GSM8K's columns (question/answer) mapped to prompt/completion: the held-out split,
    which also keeps ``answer`` for --reward, still has its completion."""
    from crf.replica.sft_data import load_sft_rows

    path = _jsonl(
        tmp_path / "test.jsonl", [{"question": f"{w}=", "answer": w[::-1]} for w in WORDS]
    )
    columns = {"prompt": "question", "completion": "answer"}
    ds, form = load_sft_rows(path, config=None, split="train", columns=columns, keep=("answer",))
    assert form == "prompt-completion"
    assert set(ds.column_names) == {"prompt", "completion", "answer"}
    assert ds[0]["completion"] == ds[0]["answer"] == WORDS[0][::-1]
    assert ds[0]["prompt"] == f"{WORDS[0]}="


RECORDS_COLUMNS = """
import json


def score(completions, difficulty, answer, **kw):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"difficulty": difficulty, "answer": answer,
                             "keys": sorted(kw)}}) + "\\n")
    return [1.0 / d for d in difficulty]
"""


def _graded(path: Path) -> str:
    rows = [{"q": f"{w}=", "a": w[::-1], "difficulty": 1 + i % 3} for i, w in enumerate(WORDS)]
    return _jsonl(path, rows)


def test_held_out_rewards_get_every_column_of_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As TRL hands a GRPO reward every dataset column, the sft job's held-out rewards get the
    row's other columns under their own names (``difficulty`` here) beside ``answer``; what
    SFTTrainer evaluates holds the format's columns only."""
    log = tmp_path / "seen.jsonl"
    (tmp_path / "rw_sft.py").write_text(RECORDS_COLUMNS.format(log=str(log)))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _graded(tmp_path / "d.jsonl")
    spec = SimpleNamespace(
        dataset=data, dataset_config=None, dataset_split="train", eval_dataset=data,
        eval_split=None, eval_examples=4, sync_every=2, device="cpu", precision="fp32",
        report_to="none", reward=["rw_sft:score"],
        columns={"prompt": "q", "completion": "a", "answer": "a"},
    )  # fmt: skip
    ctx = InProcessContext(spec=spec, seed=0, data_seed=1, rank=0, world_size=1,
                           total_steps=2, step=0, logged=[])  # fmt: skip
    cfg = Config(per_device_train_batch_size=4, hidden_size=16, num_heads=2, num_layers=1)
    setup = sft.build(ctx, cfg)
    assert set(setup.held_out.column_names) == {"prompt", "completion"}
    chosen = sorted(_subsample(len(WORDS), 4))
    assert [r["difficulty"] for r in setup.eval_rows] == [1 + i % 3 for i in chosen]
    assert all(set(r) == {"prompt", "answer", "difficulty"} for r in setup.eval_rows)
    metrics = sft.run(ctx, cfg)
    assert metrics["steps"] == 2
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen and all(s["difficulty"] == [1 + i % 3 for i in chosen] for s in seen)
    assert all(s["answer"] == [WORDS[i][::-1] for i in chosen] for s in seen)
    assert not {"q", "a", "prompt", "completion"} & {k for s in seen for k in s["keys"]}


def test_the_check_before_launch_calls_held_out_rewards_with_every_column(
    tmp_path: Path,
) -> None:
    """The launch check calls an sft reward as the replicas will: with the held-out row's
    other columns; a reward that needs a column the file lacks is refused in one line."""
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "rw_sft.py").write_text(RECORDS_COLUMNS.format(log=str(tmp_path / "l")))
    data = _graded(tmp_path / "d.jsonl")
    columns = {"prompt": "q", "completion": "a", "answer": "a"}
    options = dict(dataset=data, eval_dataset=data, columns=columns, reward=["rw_sft:score"],
                   workdir=str(tmp_path / "wd"))  # fmt: skip
    _prepare(tmp_path, **options)
    plain = _jsonl(tmp_path / "plain.jsonl", FORMATS["prompt-completion"])
    plain_columns = {**COLUMNS["prompt-completion"], "answer": "a"}
    needs = "--reward rw_sft:score takes a parameter 'difficulty', which no column of"
    with pytest.raises(LaunchError, match=needs) as err:
        _prepare(tmp_path, **{**options, "eval_dataset": plain, "columns": plain_columns})
    assert "\n" not in str(err.value)


def test_answers_are_checked_only_where_a_reward_reads_them(tmp_path: Path) -> None:
    """The sft job reads ``answer`` only in held-out rows, and only with --reward: an
    answer column of mixed kinds in training rows, or held-out answers without a reward,
    launch; null held-out answers a reward compares against are refused before launch, and
    by the replica itself (a Hub or URL dataset), naming the flag and the row."""
    from crf.replica.data import DataError

    rows = [{"q": f"{w}=", "a": w[::-1], "answer": i if i % 2 else "n/a"}
            for i, w in enumerate(WORDS)]  # fmt: skip
    mixed = _jsonl(tmp_path / "mixed.jsonl", rows)
    columns = {"prompt": "q", "completion": "a"}
    _prepare(tmp_path, dataset=mixed, columns=columns)
    nulls = _jsonl(tmp_path / "nulls.jsonl", [{**r, "answer": None} for r in rows])
    _prepare(tmp_path, dataset=mixed, eval_dataset=nulls, columns=columns)
    with pytest.raises(LaunchError, match=r"^--eval-dataset .*nulls.jsonl line 1: ") as err:
        _prepare(tmp_path, dataset=mixed, eval_dataset=nulls, columns=columns,
                 reward=["exact_match"])  # fmt: skip
    assert "\n" not in str(err.value)
    spec = SimpleNamespace(
        dataset=mixed, dataset_config=None, dataset_split="train", eval_dataset=nulls,
        eval_split=None, eval_examples=4, columns=columns, reward=["exact_match"],
    )  # fmt: skip
    with pytest.raises(DataError, match=r"^--eval-dataset .*nulls.jsonl row \d+ \(the first is "):
        sft._rows(SimpleNamespace(spec=spec, seed=0), Config())
