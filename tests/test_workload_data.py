"""--dataset / --column: files by path and fsspec URL loaded with `datasets`, one shard per
replica, and the errors `prepare` gives before launch (missing column, empty shard,
unreadable file)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest

from crf.launcher.driver import LaunchError, prepare
from crf.replica.data import DataError, load_shard

ROWS = [{"q": f"{s}=", "sol": s[::-1], "why": s[::-1]} for s in ("ab", "abc", "ca", "dab", "cc")]
MAP = {"prompt": "q", "answer": "sol", "hint": "why"}


def _write(path: str, kind: str, rows: list[dict] = ROWS) -> str:
    if kind == "jsonl":
        with fsspec.open(path, "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with fsspec.open(path, "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
    else:
        import csv

        with fsspec.open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def _shard(path: str, rank: int, world: int = 2, columns: dict = MAP) -> list[dict]:
    return load_shard(
        path, config=None, split="train", columns=columns, rank=rank, world_size=world,
        needs_answer=True,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv"])
def test_files_by_path_are_sharded_with_the_column_mapping(tmp_path: Path, kind: str) -> None:
    path = _write(str(tmp_path / f"d.{kind}"), kind)
    a, b = _shard(path, 0), _shard(path, 1)
    assert [r["prompt"] for r in a] == ["ab=", "ca=", "cc="]
    assert [r["prompt"] for r in b] == ["abc=", "dab="]
    # no trace column: absent; every column also under its own name (the rewards get them)
    assert a[0] == {"prompt": "ab=", "answer": "ba", "hint": "ba", "q": "ab=", "sol": "ba",
                    "why": "ba"}  # fmt: skip


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_urls(tmp_path: Path, scheme: str) -> None:
    where = f"memory://crf-test-{uuid.uuid4().hex}" if scheme == "memory" else tmp_path.as_uri()
    url = _write(f"{where}/d.jsonl", "jsonl")
    rows = _shard(url, 0, world=1, columns={"prompt": "q", "answer": "sol"})
    assert [r["answer"] for r in rows] == [r["sol"] for r in ROWS]
    assert "hint" not in rows[0]  # not mapped, and no `hint` column: channel 2 off


def test_empty_hint_values_are_dropped(tmp_path: Path) -> None:
    rows = [{"q": "ab=", "sol": "ba", "why": ""}, {"q": "ba=", "sol": "ab", "why": "ab"}]
    path = _write(str(tmp_path / "d.jsonl"), "jsonl", rows)
    got = _shard(path, 0, world=1)
    assert "hint" not in got[0] and got[1]["hint"] == "ab"


def _prepare(tmp_path: Path, **options) -> None:
    # 5 rows over 2 replicas: 2 prompts per step, so every share holds a whole GRPO batch
    fits = (
        {"job_config": {"prompts_per_step": 2}}
        if options.get("job", "composer") == "composer"
        else {}
    )
    options = {"job": "composer", "replicas": 2, **fits, **options}
    prepare(options, store=str(tmp_path / "runs"), dry_run=True)


def test_prepare_names_a_missing_column_and_lists_the_others(tmp_path: Path) -> None:
    path = _write(str(tmp_path / "d.jsonl"), "jsonl")
    with pytest.raises(LaunchError, match=r"no column 'question' \(for prompt\); its columns "
                       r"are q, sol, why"):  # fmt: skip
        _prepare(tmp_path, dataset=path, columns={"prompt": "question", "answer": "sol"})
    with pytest.raises(LaunchError, match="no column 'answer'"):
        _prepare(tmp_path, dataset=path, columns={"prompt": "q"}, reward=["exact_match"])
    # a reward that does not read `answer` needs no answer column
    _prepare(tmp_path, dataset=path, columns={"prompt": "q"}, reward=["format:^a"])
    with pytest.raises(LaunchError, match="'question' is no field of the job"):
        _prepare(tmp_path, dataset=path, columns={"question": "q"})


def test_prepare_refuses_an_empty_shard(tmp_path: Path) -> None:
    path = _write(str(tmp_path / "d.jsonl"), "jsonl", ROWS[:1])
    with pytest.raises(LaunchError, match="has 1 row\\(s\\) for 2 replicas"):
        _prepare(tmp_path, dataset=path, columns=MAP)
    with pytest.raises(DataError, match="has 1 row\\(s\\) for 2 replicas"):
        _shard(path, 1)


def test_prepare_names_an_unreadable_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(LaunchError, match=f"--dataset {missing}: no such file or folder"):
        _prepare(tmp_path, dataset=missing)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    with pytest.raises(LaunchError, match="broken.parquet cannot be read"):
        _prepare(tmp_path, dataset=str(broken))


def test_prepare_makes_a_local_path_absolute(tmp_path: Path, monkeypatch) -> None:
    _write(str(tmp_path / "d.jsonl"), "jsonl")
    monkeypatch.chdir(tmp_path)
    plan = prepare({"dataset": "d.jsonl", "columns": MAP, "replicas": 2,
                    "job_config": {"prompts_per_step": 2}}, store=str(tmp_path / "r"),
                   dry_run=True)  # fmt: skip
    assert plan.spec.dataset == str(tmp_path / "d.jsonl")


def test_prepare_refuses_data_options_for_the_lm_job(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="for the composer and sft jobs, not lm"):
        _prepare(tmp_path, job="lm", reward=["exact_match"])


def test_a_hub_dataset_by_id_through_the_real_client(
    tmp_path: Path, hf_hub, hf_hub_env: dict
) -> None:
    folder = tmp_path / "repo"
    (folder / "data").mkdir(parents=True)
    _write(str(folder / "data" / "train.jsonl"), "jsonl")
    hf_hub.add_repo("crf-test/reverse", folder, kind="dataset")
    rows = _shard("crf-test/reverse", 1, world=2)
    assert [r["prompt"] for r in rows] == ["abc=", "dab="]
    assert rows[0]["answer"] == "cba"


def test_cli_flags_column_and_reward_reach_the_checks(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    path = _write(str(tmp_path / "d.jsonl"), "jsonl")
    args = ["launch", "--dry-run", "--store", str(tmp_path / "r"), "--dataset", path,
            "--column", "prompt=q", "--reward", "exact_match=2",
            "--reward", "format:^a", "--set", "prompts_per_step=2"]  # fmt: skip
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code != 0 and "no column 'answer'" in bad.output, bad.output
    ok = CliRunner().invoke(app, [*args, "--column", "answer=sol"])
    assert ok.exit_code == 0, ok.output
