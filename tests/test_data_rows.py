"""A user's rows as each replica reads them, and the dataset forms crf reads.

The launcher checks every row of a local file (tests/test_bad_data.py); a Hub or URL
dataset is only sampled there, so each replica checks its own rows at setup by the same
rules (crf/replica/data.py ``check_values``) and stops with a DataError naming the row: a
restart cannot fix it, so the run stops once. Values are read decoded, never as the JSON
text ``datasets`` keeps a mixed column in. ``save_to_disk`` folders (a Dataset, or a
DatasetDict's split) are read with ``load_from_disk`` by the launcher and the replicas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crf.replica.data import DataError, load_eval, load_shard
from tests.test_cli import crf

REPO = Path(__file__).resolve().parent.parent
WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 4  # 32 rows
MAP = {"prompt": "question", "answer": "solution"}


def _rows(**late: Any) -> list[dict[str, Any]]:
    """32 rows; ``late`` sets row N's columns: ``r20={"solution": 7}``."""
    rows: list[dict[str, Any]] = [{"question": f"{w}=", "solution": w[::-1]} for w in WORDS]
    for key, change in late.items():
        rows[int(key[1:])] = {**rows[int(key[1:])], **change}
    return rows


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _shard(dataset: str, rank: int, world: int = 2, **kw: Any) -> list[dict[str, Any]]:
    return load_shard(dataset, config=None, split=kw.pop("split", "train"), columns=MAP,
                      rank=rank, world_size=world, needs_answer=True, **kw)  # fmt: skip


# ---------------------------------------------------------------------- each replica's rows
def test_a_url_dataset_with_a_null_answer_stops_the_replica_that_holds_it(tmp_path: Path) -> None:
    """Row 25 (rank 1 of 2) has a null answer: rank 1 refuses naming the row and the reward
    that reads it; rank 0's rows are all good."""
    url = "file://" + _jsonl(tmp_path / "d.jsonl", _rows(r25={"solution": None}))
    with pytest.raises(DataError, match=r"row 26 \(the first is row 1\): the answer in column "
                       r"'solution' \(for answer\) is null, which --reward exact_match cannot "
                       "read"):  # fmt: skip
        _shard(url, 1, reader="exact_match")
    assert len(_shard(url, 0, reader="exact_match")) == 16


def test_a_column_mixing_text_and_numbers_is_refused_not_quoted(tmp_path: Path) -> None:
    """datasets keeps such a column as JSON text ('"ba"', quotes and all): the replica holding
    the odd row refuses; no replica's answers are ever quoted."""
    url = "file://" + _jsonl(tmp_path / "d.jsonl", _rows(r20={"solution": 7}))
    with pytest.raises(DataError, match=r"row 21 \(the first is row 1\): 'solution' \(for "
                       r"answer\) is int while other rows hold text; make every value a "
                       "string"):  # fmt: skip
        _shard(url, 0)
    assert [r["answer"] for r in _shard(url, 1)] == [w[::-1] for w in WORDS[1::2]]


def test_messages_with_extra_keys_are_read_as_messages(tmp_path: Path) -> None:
    """A conversation whose messages differ in their keys is a List(Json) column to datasets;
    the replica reads each message as a dict, not as its JSON text."""
    rows = [{"question": [{"role": "user", "content": f"{w}="}], "solution": w[::-1]}
            for w in WORDS]  # fmt: skip
    rows[3]["question"][0]["name"] = "ann"
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    shard = _shard(path, 1)
    assert shard[1]["prompt"] == [{"role": "user", "content": "dd=", "name": "ann"}]
    assert all(isinstance(m, dict) for r in shard for m in r["prompt"])


def test_one_column_may_feed_two_fields(tmp_path: Path) -> None:
    """A solution replayed as the trace and read as the answer: both fields hold it (the
    answer was lost to the trace, and the launcher called it null)."""
    data = _jsonl(tmp_path / "d.jsonl", _rows())
    columns = {**MAP, "trace": "solution"}
    rows = load_shard(data, config=None, split="train", columns=columns, rank=0,
                      world_size=2, needs_answer=True, reader="exact_match")  # fmt: skip
    assert rows[0]["answer"] == rows[0]["trace"] == rows[0]["solution"] == "ba"
    result = _dry(tmp_path, "--dataset", data, "--column", "trace=solution",
                  "--reward", "exact_match")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_held_out_rows_are_checked_with_their_numbers(tmp_path: Path) -> None:
    class Spec:
        dataset, dataset_config, dataset_split = None, None, "train"
        eval_dataset = _jsonl(tmp_path / "test.jsonl", _rows(r30={"question": ""}))
        eval_split, eval_examples, seed, columns, reward = None, 64, 0, MAP, ["exact_match"]

    with pytest.raises(DataError, match=r"--eval-dataset .*test.jsonl row 31 \(the first is "
                       r"row 1\): the prompt in column 'question' \(for prompt\) is "
                       "empty"):  # fmt: skip
        load_eval(Spec, needs_answer=True)


def test_the_sft_job_checks_every_row_it_trains_on(tmp_path: Path) -> None:
    from crf.replica.sft_data import load_sft_rows

    rows = [{"prompt": f"{w}=", "completion": w[::-1]} for w in WORDS]
    rows[20]["completion"] = None
    url = "file://" + _jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(DataError, match=r"row 21 \(the first is row 1\): 'prompt' and "
                       r"'completion' must both be strings, .* \(got str and null\)"):  # fmt: skip
        load_sft_rows(url, config=None, split="train", columns={})


# ---------------------------------------------------------------------- save_to_disk folders
def _save(folder: Path, splits: tuple[str, ...] = ()) -> str:
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(_rows())
    held = Dataset.from_list(_rows()[:8])
    if splits:
        DatasetDict({s: ds if s == "train" else held for s in splits}).save_to_disk(folder)
    else:
        ds.save_to_disk(folder)
    return str(folder)


def test_a_saved_dataset_and_a_saved_dataset_dicts_splits_are_read(tmp_path: Path) -> None:
    one = _save(tmp_path / "one")
    assert [r["answer"] for r in _shard(one, 1)] == [w[::-1] for w in WORDS[1::2]]
    both = _save(tmp_path / "both", ("train", "test"))
    assert len(_shard(both, 0)) == 16
    assert len(_shard(both, 0, world=1, split="test")) == 8
    with pytest.raises(DataError, match="has no split 'validation'; its splits are train, test"):
        _shard(both, 0, split="validation")


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_a_dry_run_accepts_a_saved_dataset_dict_with_a_held_out_split(
    job: str, tmp_path: Path
) -> None:
    folder = _save(tmp_path / "saved", ("train", "test"))
    cols = ["--column", "prompt=question", "--column", "answer=solution"]
    if job == "sft":
        cols += ["--column", "completion=solution"]
    result = crf("launch", "--store", str(tmp_path / "runs"), "--dry-run", "--replicas", "2",
                 "--job", job, "--dataset", folder, *cols, "--eval-split", "test",
                 "--reward", "exact_match",
                 *(["--set", "prompts_per_step=2"] if job == "composer" else []))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "runs").exists()


def test_a_saved_dataset_with_a_bad_row_is_refused_before_launch(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_list(_rows(r29={"question": None})).save_to_disk(tmp_path / "saved")
    result = crf("launch", "--store", str(tmp_path / "runs"), "--dry-run", "--replicas", "2",
                 "--job", "composer", "--dataset", str(tmp_path / "saved"),
                 "--column", "prompt=question", "--column", "answer=solution")  # fmt: skip
    assert result.exit_code == 2
    said = "row 30 (the first is row 1): the prompt in column 'question' (for prompt) is null"
    assert said in result.output


# ---------------------------------------------------------------------- real runs
def _launch(tmp_path: Path, dataset: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    base = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "CRF_LOG_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--store", str(base), "--run-id",
         "r", "--replicas", "2", "--job", "composer", "--dataset", dataset, "--column",
         "prompt=question", "--column", "answer=solution", "--reward", "exact_match", "-H", "2",
         "-r", "1", "--no-progress", "--timeout", "300", "--set", "prompts_per_step=2",
         "--set", "num_generations=2", "--set", "max_completion_length=4", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    return out, json.loads((base / "r" / "result.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow
def test_a_bad_row_past_the_sample_stops_the_run_once(tmp_path: Path) -> None:
    """A URL dataset (only its first rows are read before launch) with a null answer in row
    25: the replica holding it fails at setup naming the row, nothing restarts, and the run
    ends at once with that line as its reason."""
    url = "file://" + _jsonl(tmp_path / "d.jsonl", _rows(r25={"solution": None}))
    out, summary = _launch(tmp_path, url)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert summary["status"] == "failed" and summary["restarts"] == 0, summary
    said = "row 26 (the first is row 1): the answer in column 'solution' (for answer) is null"
    assert said in summary["error"]
    assert "Traceback" not in text


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_trains_on_compressed_files_and_warns_of_a_file_not_read(tmp_path: Path) -> None:
    """A folder of train.jsonl.gz and a stray extra.csv, launched for real: the replicas
    train on the compressed rows, and the launch warns, before any replica starts, that
    extra.csv is not read (as its dry run does); the result keeps the warning."""
    import gzip

    folder = tmp_path / "packed"
    folder.mkdir()
    plain = Path(_jsonl(tmp_path / "train.jsonl", _rows()))
    (folder / "train.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (folder / "extra.csv").write_text("question,solution\nab=,ba\n")
    out, summary = _launch(tmp_path, str(folder))
    text = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stdout + out.stderr
    assert summary["status"] == "ok", summary
    warning = f"warning: --dataset {folder}: extra.csv not read (a folder is read in one format"
    assert warning in text, text
    assert text.index(warning) < text.index("summary")  # said before the run, not after
    assert "Traceback" not in out.stdout + out.stderr
    # and kept in the result, for a caller that launched without watching
    (kept,) = summary["warnings"]
    assert kept.startswith(f"--dataset {folder}: extra.csv not read"), kept
    from crf.results import RunResult

    assert RunResult.from_dict(summary).warnings == [kept]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_trains_on_a_saved_dataset_dict(tmp_path: Path) -> None:
    folder = _save(tmp_path / "saved", ("train", "test"))
    out, summary = _launch(tmp_path, folder, "--eval-split", "test")
    assert out.returncode == 0, out.stdout + out.stderr
    assert summary["status"] == "ok", summary
    assert summary["held_out"] is not None


# ---------------------------------------------------------------------- folders of files
def _dry(tmp_path: Path, *args: str):
    return crf("launch", "--store", str(tmp_path / "runs"), "--dry-run", "--replicas", "2",
               "--job", "composer", "--column", "prompt=question", "--column",
               "answer=solution", "--set", "prompts_per_step=2", *args)  # fmt: skip


def _accepted(tmp_path: Path, folder: Path) -> str:
    """The dry run of ``--dataset folder``, which must pass: its output on one line."""
    result = _dry(tmp_path, "--dataset", str(folder))
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_every_row_of_a_folders_held_out_split_is_checked(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", _rows())
    _jsonl(folder / "test.jsonl", _rows(r12={"question": None}))
    result = _dry(tmp_path, "--dataset", str(folder), "--eval-split", "test")
    assert result.exit_code == 2, result.output
    said = f"--eval-split {folder} line 13 of test.jsonl: the prompt in column 'question'"
    assert said in result.output


def test_a_row_of_a_folder_of_files_is_named_by_its_file_and_line(tmp_path: Path) -> None:
    """A folder's files are one split; a bad row is named where the user finds it, its own
    file's line (or row), not its place in the split."""
    import pandas as pd

    folder = tmp_path / "parts"
    folder.mkdir()
    _jsonl(folder / "train-0.jsonl", _rows())
    (folder / "train-1.jsonl").write_text(
        "\n" + "".join(json.dumps(r) + "\n" for r in _rows(r4={"question": None}))
    )  # a blank first line: the row's line is 6, its place in the file 5, in the split 37
    refused = " ".join(_dry(tmp_path, "--dataset", str(folder)).output.split())
    assert "line 6 of train-1.jsonl: the prompt in column 'question'" in refused, refused
    parquet = tmp_path / "pq"
    parquet.mkdir()
    pd.DataFrame(_rows()).to_parquet(parquet / "a.parquet")
    pd.DataFrame(_rows(r2={"question": None})).to_parquet(parquet / "b.parquet")
    said = " ".join(_dry(tmp_path, "--dataset", str(parquet)).output.split())
    assert "row 3 of b.parquet (the first is row 1): the prompt in column" in said, said


def test_a_folder_with_configs_reads_the_config_named(tmp_path: Path) -> None:
    """A cloned Hub repo: a README's YAML names each config's files, as datasets reads it."""
    import pandas as pd

    folder = tmp_path / "clone"
    for config, rows in (("main", _rows()), ("other", _rows(r3={"question": None}))):
        (folder / config).mkdir(parents=True)
        pd.DataFrame(rows).to_parquet(folder / config / "train-00000-of-00001.parquet")
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
            for c in ("main", "other")
        )  # fmt: skip
        + "---\n"
    )
    assert _dry(tmp_path, "--dataset", str(folder), "--dataset-config", "main").exit_code == 0
    refused = _dry(tmp_path, "--dataset", str(folder), "--dataset-config", "other")
    said = "row 4 of other/train-00000-of-00001.parquet (the first is row 1): the prompt in "
    assert said in " ".join(refused.output.split())
    missing = _dry(tmp_path, "--dataset", str(folder))
    assert missing.exit_code == 2
    assert "has several configs ['main', 'other']: choose one with --dataset-config" in (
        missing.output
    )


def test_a_folder_is_seen_as_datasets_sees_it(tmp_path: Path) -> None:
    """A data file deep in a folder (``load_dataset``'s ``**`` finds it) is data, with or
    without a trailing slash; a folder without one names what it holds; a README with many
    configs names them all, however long the list."""
    from crf.replica.data_files import local_problem, split_files

    deep = tmp_path / "deep"
    (deep / "a" / "b" / "c").mkdir(parents=True)
    _jsonl(deep / "a" / "b" / "c" / "train.jsonl", _rows())
    assert local_problem(str(deep)) is None and local_problem(f"{deep}/") is None
    (tmp_path / "docs" / "x").mkdir(parents=True)
    (tmp_path / "docs" / "x" / "notes.txt").write_text("hi")
    assert "(it holds x/notes.txt)" in str(local_problem(str(tmp_path / "docs")))
    many = tmp_path / "many"
    names = [f"config_number_{i:02d}" for i in range(30)]
    for c in names:
        (many / c).mkdir(parents=True)
        _jsonl(many / c / "train.jsonl", _rows())
    (many / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/*\n" for c in names
        )  # fmt: skip
        + "---\n"
    )
    with pytest.raises(DataError, match="has several configs") as err:
        split_files(str(many), None, "train", "--dataset")
    assert names[-1] in str(err.value) and "choose one with --dataset-config" in str(err.value)


@pytest.mark.parametrize("layout", ["train.parquet/part-00000-abc.snappy.parquet",
                                    "rows.jsonl/train.jsonl"])  # fmt: skip
def test_a_folder_named_like_a_file_is_read_as_a_folder(tmp_path: Path, layout: str) -> None:
    """Spark and pandas write a "file" as a folder of parts (``train.parquet/part-*``, beside
    a ``_SUCCESS`` marker): the checks before launch and each replica (composer and sft
    alike) read it as the folder it is, not as one file of its suffix."""
    import pandas as pd

    from crf.replica.sft_data import load_sft_rows

    part = tmp_path / layout
    part.parent.mkdir()
    (part.parent / "_SUCCESS").write_text("")
    rows = _rows()
    for r in rows:
        r["completion"] = r["solution"]
    if part.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(part)
    else:
        _jsonl(part, rows)
    folder = str(part.parent)
    assert _accepted(tmp_path, part.parent)
    assert [r["answer"] for r in _shard(folder, 1)] == [w[::-1] for w in WORDS[1::2]]
    sft, form = load_sft_rows(folder, config=None, split="train",
                              columns={"prompt": "question"})  # fmt: skip
    assert form == "prompt-completion" and len(sft) == 32


def test_a_csv_answer_written_with_leading_zeros_is_warned_of(tmp_path: Path) -> None:
    """pandas reads a CSV's 0007 as the number 7, in the launcher and in every replica
    (datasets' CSV reader): exact_match would compare against "7", so the dry run warns,
    naming the line, what it is read as and how to keep the text; a text column's leading
    zeros (kept as written) say nothing."""
    data = tmp_path / "codes.csv"
    body = "".join(f"{w}=,{i:04d},{w}\n" for i, w in enumerate(WORDS))
    data.write_text("question,solution,note\n" + body)
    text = " ".join(
        _dry(tmp_path, "--dataset", str(data), "--reward", "exact_match").output.split()
    )
    assert "warning: --dataset " in text  # the path itself may wrap mid-word on a narrow terminal
    assert (
        "sv: the answer column 'solution' (for answer) holds "
        "numbers written with leading zeros ('0000' on line 2 is read as 0; 32 such "
        "row(s)), which pandas, reading a CSV, drops, so --reward exact_match compares "
        "answers against '0'; to keep them as text, convert the file to JSON lines: "
        "pandas.read_csv(path, dtype=str, keep_default_na=False)"
    ) in text, text
    as_text = tmp_path / "text.csv"
    as_text.write_text("question,solution\n" + "".join(f"{w}=,0{w}\n" for w in WORDS))
    quiet = " ".join(_dry(tmp_path, "--dataset", str(as_text)).output.split())
    assert "leading zeros" not in quiet, quiet


def test_a_folders_files_of_another_format_are_named_as_unread(tmp_path: Path) -> None:
    """datasets reads a folder's splits by their names and lower-case suffixes, and skips
    notes.csv (no split's name) and train-2.JSONL beside train.jsonl without a word: the dry
    run warns, naming them (the rows read are the .jsonl's, as the replicas')."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", _rows())
    (folder / "notes.csv").write_text("question,solution\nab=,ba\n")
    _jsonl(folder / "train-2.JSONL", _rows())  # datasets finds lower-case suffixes only
    (folder / "dataset_infos.json").write_text("{}")  # a Hub repo's description: no rows
    text = _accepted(tmp_path, folder)
    assert f"warning: --dataset {folder}: notes.csv, train-2.JSONL not read (a folder is" in text
    assert "and by lower-case suffixes" in text and "convert or rename such files" in text
    assert "dataset_infos.json" not in text


@pytest.mark.parametrize(("first", "second"), [("part1.jsonl", "part2.csv"),
                                               ("train.jsonl", "train-2.parquet")])  # fmt: skip
def test_a_split_in_two_formats_is_refused(tmp_path: Path, first: str, second: str) -> None:
    """datasets puts both files in the split, then reads one format only (the most common;
    a tie, either) and drops the other's rows without a word: refused before launch, naming
    the formats and the files."""
    import pandas as pd

    folder = tmp_path / "two"
    folder.mkdir()
    _jsonl(folder / first, _rows())
    frame = pd.DataFrame(_rows())
    if second.endswith(".csv"):
        frame.to_csv(folder / second, index=False)
    else:
        frame.to_parquet(folder / second)
    result = _dry(tmp_path, "--dataset", str(folder))
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    fmt = "csv" if second.endswith(".csv") else "parquet"
    assert f"--dataset {folder} holds split 'train' in two formats" in said, said
    named = said.split("two formats, ", 1)[1].split(", and datasets", 1)[0]
    assert named in (f"json ({first}) and {fmt} ({second})",
                     f"{fmt} ({second}) and json ({first})"), said  # fmt: skip
    assert "convert them to one format (e.g. all to .jsonl)" in said
    assert "Traceback" not in said


@pytest.mark.parametrize(("name", "pack"), [("d.jsonl.gz", "gzip"), ("d.json.bz2", "bz2"),
                                            ("d.csv.xz", "lzma"), ("d.csv.zst", "zstandard"),
                                            ("d.jsonl.zstd", "zstandard")])  # fmt: skip
def test_a_compressed_file_is_read_as_its_plain_form(tmp_path: Path, name: str, pack: str) -> None:
    """datasets decompresses .gz/.bz2/.xz/.zst itself: the checks before launch read the same
    rows (every row, by the same rules), and so does each replica's loader."""
    import importlib

    import pandas as pd

    from crf.replica.data_files import read_rows

    plain = tmp_path / name.rsplit(".", 1)[0]
    if plain.suffix == ".csv":
        pd.DataFrame(_rows()).to_csv(plain, index=False)
    elif plain.suffix == ".json":
        plain.write_text(json.dumps(_rows()))  # a JSON list
    else:
        _jsonl(plain, _rows())
    packed = tmp_path / name
    packed.write_bytes(importlib.import_module(pack).compress(plain.read_bytes()))
    assert read_rows(str(packed), "train").columns == read_rows(str(plain), "train").columns
    assert _shard(str(packed), 1) == _shard(str(plain), 1)
    if name.startswith("d.jsonl"):  # the CLI's dry run takes it, as a file and in a folder
        assert _dry(tmp_path, "--dataset", str(packed)).exit_code == 0
        (tmp_path / "f").mkdir()
        packed.rename(tmp_path / "f" / f"train{packed.name[1:]}")
        result = _dry(tmp_path, "--dataset", str(tmp_path / "f"))
        assert result.exit_code == 0, result.output


def test_a_zstandard_file_of_several_frames_is_read_whole(tmp_path: Path) -> None:
    """A .zst file may hold several frames (zstd's own tools write one per input they
    concatenate): the checks read every frame, as datasets does, not the first alone."""
    import zstandard

    from crf.replica.data_files import read_rows

    plain = Path(_jsonl(tmp_path / "d.jsonl", _rows()))
    data = plain.read_bytes()
    cut = data.index(b"\n", len(data) // 2) + 1
    packed = tmp_path / "d.jsonl.zst"
    packed.write_bytes(zstandard.compress(data[:cut]) + zstandard.compress(data[cut:]))
    assert read_rows(str(packed), "train").columns == read_rows(str(plain), "train").columns
    assert _shard(str(packed), 1) == _shard(str(plain), 1)


@pytest.mark.parametrize("form", ["jsonl", "csv", "parquet", "saved", "folder"])
def test_a_split_too_large_to_read_whole_is_checked_on_its_first_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Above CHECKED_BYTES the launcher reads a split's first CHECKED_ROWS rows only (held
    as Python values, a file of several GB would take several times its size), says so in
    the dry run's notes, and leaves a bad row further on to the replica that holds it."""
    import pandas as pd
    from datasets import Dataset

    from crf.replica import data_files

    monkeypatch.setattr(data_files, "CHECKED_BYTES", 200)
    monkeypatch.setattr(data_files, "CHECKED_ROWS", 12)
    rows = _rows(r20={"solution": None})  # past the first 12
    if form == "jsonl":
        data = _jsonl(tmp_path / "big.jsonl", rows)
        with open(data, "a") as f:
            f.write("not json\n")  # never read
    elif form == "csv":
        data = str(tmp_path / "big.csv")
        pd.DataFrame(rows).to_csv(data, index=False)
    elif form == "parquet":
        data = str(tmp_path / "big.parquet")
        pd.DataFrame(rows).to_parquet(data, row_group_size=8)
    elif form == "saved":
        data = str(tmp_path / "saved")
        Dataset.from_list(rows * 4).save_to_disk(data)
    else:
        folder = tmp_path / "folder"
        folder.mkdir()
        for i in range(3):  # three files of one split: the third is not read
            _jsonl(folder / f"train-{i}.jsonl", rows[:10])
        data = str(folder)
    every = data_files.read_rows(data, "train")
    assert every.partial and 1 <= every.count <= 12
    assert every.first(2)[0]["question"] == "ab="
    result = _dry(tmp_path, "--dataset", data)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # however the terminal wraps the note
    assert "rows were checked here (a split this large is not read whole)" in said, said


def test_the_checks_leave_the_users_logging_as_it_was(tmp_path: Path) -> None:
    """The SDK runs in the user's process: reading a folder's splits, a dataset and a
    tokenizer turns datasets' bars and transformers' warnings off only while crf reads."""
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as hf_logging

    from crf.replica.data import _load
    from crf.replica.data_files import split_files
    from crf.replica.model import local_tokenizer

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    datasets_logging.enable_progress_bar()
    try:
        _jsonl(tmp_path / "train.jsonl", _rows())
        split_files(str(tmp_path), None, "train", "--dataset")
        _load(str(tmp_path / "train.jsonl"), None, "train")
        assert local_tokenizer(str(tmp_path / "no-model")) is None
        assert hf_logging.get_verbosity() == hf_logging.INFO
        assert datasets_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity(before)


# ---------------------------------------------------------------------- unreadable paths
_READ = """
import sys
from crf.replica.data_files import DataError, read_rows
for name in sys.argv[1:]:
    try:
        read_rows(name, "train")
        print("read", name)
    except DataError as e:
        print(e)
"""


def _as_a_user(tmp_path: Path) -> list[str]:
    """A command prefix under which file permissions hold: none for a user; for root (who
    reads any file), a user namespace without a mapping (``unshare -U``)."""
    if os.geteuid() != 0:
        return []
    probe = tmp_path / "probe"
    probe.write_text("")
    probe.chmod(0)
    try:
        denied = subprocess.run(["unshare", "-U", "cat", str(probe)], capture_output=True)
    except OSError:
        denied = None
    if denied is None or denied.returncode == 0 or b"Permission denied" not in denied.stderr:
        pytest.skip("root here reads any file, and no user namespace is allowed to drop that")
    return ["unshare", "-U"]


def test_an_unreadable_file_or_folder_is_named_in_one_line(tmp_path: Path) -> None:
    """A file, a folder, and a folder's file this user may not read: each is one line saying
    so and how to fix it, not a PermissionError's traceback nor a folder that "holds
    nothing"."""
    prefix = _as_a_user(tmp_path)
    for name in ("file.jsonl", "folder/train.jsonl", "inner/train.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        _jsonl(tmp_path / name, _rows())
    (tmp_path / "file.jsonl").chmod(0)
    (tmp_path / "folder").chmod(0)
    (tmp_path / "inner" / "train.jsonl").chmod(0)
    names = [str(tmp_path / n) for n in ("file.jsonl", "folder", "inner")]
    out = subprocess.run([*prefix, sys.executable, "-c", _READ, *names], cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    (tmp_path / "folder").chmod(0o755)  # for tmp_path's clean-up
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
    assert lines[0] == (f"--dataset {names[0]} cannot be read (Permission denied): make it "
                        "readable by the user running crf (chmod u+r), or copy it somewhere "
                        "readable")  # fmt: skip
    assert lines[1].startswith(f"--dataset {names[1]} cannot be read (Permission denied)")
    assert "(chmod u+rx)" in lines[1]
    assert lines[2].startswith(f"--dataset {names[2]}: train.jsonl cannot be read (Permission")


def test_a_conversation_needs_named_roles_and_text_contents() -> None:
    """A null or numeric content would reach the chat template as "None" or "7"; a tool
    call's null content is TRL's format and stays a conversation."""
    from crf.replica.data import is_messages, messages_problem

    call = {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}
    assert is_messages([{"role": "user", "content": "ab="}, call])
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab="}]}]
    assert is_messages(parts)
    assert messages_problem([{"role": "user", "content": None}]) == (
        "a list of messages whose message 0 (user) has a content that is null, not text"
    )
    assert "role that is empty" in messages_problem([{"role": " ", "content": "x"}])


def test_a_linked_folder_beside_data_files_is_named_as_unread(tmp_path: Path) -> None:
    """datasets follows a linked file but not a linked folder: a folder's train.jsonl beside
    ``more/ -> elsewhere`` (which holds rows) trains on train.jsonl alone, so the dry run
    warns, naming the link; a link to a folder without data files says nothing."""
    folder = tmp_path / "d"
    for made in (folder / "data", tmp_path / "elsewhere", tmp_path / "notes"):
        made.mkdir(parents=True)
    _jsonl(folder / "data" / "train-0.jsonl", _rows())
    _jsonl(tmp_path / "elsewhere" / "train-1.jsonl", _rows())
    (tmp_path / "notes" / "readme.txt").write_text("no rows")
    (folder / "more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (folder / "data" / "deeper").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (folder / "docs").symlink_to(tmp_path / "notes", target_is_directory=True)
    text = _accepted(tmp_path, folder)
    assert f"warning: --dataset {folder}: data/deeper/ (a link), more/ (a link) not read" in text
    assert "not into linked folders" in text and "copy them in" in text
    assert "docs/" not in text
