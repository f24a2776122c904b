"""A corpus of a user's own bad data, models and rewards: each ends in one line.

Most are refused before launch (``crf launch --dry-run`` runs the same checks as a launch and
starts nothing): exit code 2, one ``error:`` line that names the fix, no traceback, and the
store untouched. The few that only a replica can meet (a job's own code raising while it
builds its trainer) are launched for real and must fail once: not restarted, the run's
reason one line, no traceback in the summary.
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard

from tests.test_cli import crf

REPO = Path(__file__).resolve().parent.parent
WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 4  # 32 rows


def _jsonl(path: Path, rows: list[Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _qa(**change: Any) -> list[dict[str, Any]]:
    """GSM8K-shaped rows (question/answer), row 1 changed by ``change``."""
    rows: list[dict[str, Any]] = [{"question": f"{w}=", "answer": w[::-1]} for w in WORDS]
    rows[1] = {**rows[1], **change}
    return rows


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hub_models import save_tiny_repo

    folder = tmp_path_factory.mktemp("model") / "tiny"
    save_tiny_repo(folder)
    return folder


def _model(tiny: Path, tmp: Path, change: Callable[[Path], None] | None = None) -> str:
    """A copy of the tiny model folder, changed by ``change``."""
    folder = tmp / "model"
    shutil.copytree(tiny, folder)
    if change is not None:
        change(folder)
    return str(folder)


def _edit_json(path: Path, **values: Any) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def _gpt2(folder: Path) -> None:
    """A GPT-2 (a learned table of 64 positions) in place of the tiny model, its tokenizer
    kept."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    (folder / "model.safetensors").unlink()
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(folder)


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _no_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)


def _headless(folder: Path) -> None:
    """The weights as an untied base model saves them: no lm_head.weight."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors.pop("lm_head.weight", None)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_json(folder / "config.json", tie_word_embeddings=False)


def _adapter(folder: Path) -> None:
    """A LoRA adapter's folder: adapter_config.json, no config.json."""
    (folder / "config.json").unlink()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))


def _broken_link(tmp: Path) -> str:
    (tmp / "model-link").symlink_to(tmp / "gone")
    return str(tmp / "model-link")


def _no_chat_template(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()
    _edit_json(folder / "tokenizer_config.json", chat_template=None)


def _no_pad_or_eos(folder: Path) -> None:
    data = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("pad_token", "eos_token"):
        data.pop(key, None)
    (folder / "tokenizer_config.json").write_text(json.dumps(data))


def _index_missing_shard(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )


def _reward_module(tmp: Path, name: str, body: str) -> list[str]:
    """--workdir with module ``name`` (``body``), and --reward name:score."""
    wd = tmp / "wd"
    wd.mkdir(exist_ok=True)
    (wd / f"{name}.py").write_text(body)
    return ["--workdir", str(wd), "--reward", f"{name}:score"]


@dataclass
class Case:
    """One bad input: ``args(tmp, tiny_model)`` are the launch's own flags; ``message`` is
    in the one error line."""

    id: str
    args: Callable[[Path, Path], list[str]]
    message: str


def _composer(tmp: Path, rows: list[Any] | None = None, *extra: str) -> list[str]:
    data = _jsonl(tmp / "train.jsonl", rows if rows is not None else _qa())
    cols = ["--column", "prompt=question"]
    return ["--job", "composer", "--dataset", data, *cols, *extra]


def _late(row: int, **change: Any) -> list[dict[str, Any]]:
    """GSM8K-shaped rows, row ``row`` (past the first rows a sample reads) changed."""
    rows: list[dict[str, Any]] = [{"question": f"{w}=", "answer": w[::-1]} for w in WORDS]
    rows[row] = {**rows[row], **change}
    return rows


def _raw(tmp: Path, name: str, data: bytes, *extra: str) -> list[str]:
    """A --dataset file of these bytes (GSM8K-shaped columns mapped)."""
    path = tmp / name
    path.write_bytes(data)
    return ["--job", "composer", "--dataset", str(path), "--column", "prompt=question", *extra]


def _loop(tmp: Path) -> str:
    """a.jsonl -> b.jsonl -> a.jsonl."""
    (tmp / "a.jsonl").symlink_to(tmp / "b.jsonl")
    (tmp / "b.jsonl").symlink_to(tmp / "a.jsonl")
    return str(tmp / "a.jsonl")


def _dangling(tmp: Path) -> str:
    """a.jsonl -> moved.jsonl, which is not there."""
    (tmp / "a.jsonl").symlink_to(tmp / "moved.jsonl")
    return str(tmp / "a.jsonl")


def _parquet() -> bytes:
    """GSM8K-shaped rows as a Parquet file's bytes."""
    import io

    import pandas as pd

    out = io.BytesIO()
    pd.DataFrame(_qa()).to_parquet(out)
    return out.getvalue()


def _pandas_json() -> bytes:
    """GSM8K-shaped rows as pandas' ``df.to_json()`` writes them by default (by column)."""
    import pandas as pd

    return pd.DataFrame(_qa()).to_json().encode()


def _lines(change: Callable[[list[bytes]], None]) -> bytes:
    lines = [json.dumps(r).encode() for r in _qa()]
    change(lines)
    return b"\n".join(lines) + b"\n"


def _set(lines: list[bytes], i: int, value: bytes) -> None:
    lines[i] = value


def _saved(tmp: Path, dict_splits: tuple[str, ...] = ()) -> str:
    """A save_to_disk folder of GSM8K-shaped rows: a DatasetDict of ``dict_splits``, or a
    Dataset."""
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(_qa())
    folder = str(tmp / "saved")
    (DatasetDict({s: ds for s in dict_splits}) if dict_splits else ds).save_to_disk(folder)
    return folder


def _gz(path: Path) -> bool:
    """A gzip-compressed Parquet file at ``path`` (True, for use in an expression)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("")
    pd.DataFrame(_qa()).to_parquet(plain)
    path.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    return True


def _linked(tmp: Path, data: str) -> str:
    """A folder whose one entry, ``data``, is a link to the folder holding ``data``."""
    (tmp / "outer").mkdir()
    (tmp / "outer" / "data").symlink_to(Path(data).parent, target_is_directory=True)
    return str(tmp / "outer")


def _sft(tmp: Path, rows: list[Any], *extra: str) -> list[str]:
    return ["--job", "sft", "--dataset", _jsonl(tmp / "train.jsonl", rows), *extra]


def _with_model(tiny: Path, tmp: Path, change: Callable[[Path], None] | None) -> list[str]:
    return ["--model", _model(tiny, tmp, change)]


RAISES = "def score(completions, **kw):\n    return [1 / 0 for _ in completions]\n"
NAN = "def score(completions, **kw):\n    return [float('nan')] * len(completions)\n"
READS_SOLUTION = "def score(completions, solution, **kw):\n    return [1.0] * len(solution)\n"

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}
    for w in WORDS
]

CASES = [
    # ---- the data, after --column mapping, in every split
    Case("null-prompt", lambda t, m: _composer(t, _qa(question=None)),
         "line 2: the prompt in column 'question' (for prompt) is null"),
    Case("numeric-prompt", lambda t, m: _composer(t, _qa(question=42)),
         "line 2: the prompt in column 'question' (for prompt) is int"),
    Case("empty-prompt", lambda t, m: _composer(t, _qa(question="  ")),
         "line 2: the prompt in column 'question' (for prompt) is empty"),
    Case("missing-column-after-mapping", lambda t, m: _composer(t, None, "--column",
         "answer=solution", "--reward", "exact_match"),
         "has no column 'solution' (for answer)"),
    Case("null-answer", lambda t, m: _composer(t, _qa(answer=None), "--reward", "exact_match"),
         "line 2: the answer in column 'answer' is null, which --reward exact_match cannot read"),
    Case("list-answer", lambda t, m: _composer(t, _qa(answer=["7"]), "--reward", "exact_match"),
         "the answer in column 'answer' is list"),
    Case("math-answer-without-numbers", lambda t, m: _composer(
         t, [{"question": "q", "answer": "no number here"}] * 32, "--reward", "math_answer"),
         "math_answer finds no number or expression in the answers of column 'answer'"),
    Case("held-out-without-answer", lambda t, m: [*_composer(t, None, "--reward", "exact_match"),
         "--eval-dataset", _jsonl(t / "test.jsonl", [{"question": "ab="}])],
         "--eval-dataset"),
    Case("held-out-null-prompt", lambda t, m: [*_composer(t), "--eval-dataset",
         _jsonl(t / "test.jsonl", _qa(question=None))],
         "--eval-dataset"),
    Case("empty-file", lambda t, m: _composer(t, []), "is empty (0 bytes): it needs rows"),
    Case("empty-held-out-split", lambda t, m: ["--job", "composer", "--dataset",
         str(Path(_jsonl(t / "d" / "train.jsonl", _qa())).parent), "--column", "prompt=question",
         "--eval-split", "test", *([] if (t / "d" / "test.jsonl").write_text("") else [])],
         "test"),
    Case("smaller-than-one-batch", lambda t, m: _composer(t, _qa()[:9]),
         "gets fewer than one batch of 8 prompts (prompts_per_step)"),
    Case("sft-empty-texts", lambda t, m: _sft(t, [{"text": ""}] * 8),
         "line 1: 'text' is empty: there is nothing to learn from it"),
    Case("sft-empty-completion", lambda t, m: _sft(
         t, [{"prompt": f"{w}=", "completion": ""} for w in WORDS]), "'completion' is empty"),
    Case("sft-null-prompt", lambda t, m: _sft(
         t, [{"prompt": None, "completion": w} for w in WORDS]), "'prompt' and 'completion'"),
    Case("sft-no-format", lambda t, m: _sft(t, [{"body": w} for w in WORDS]),
         "has none of the sft formats"),
    Case("sft-held-out-without-answer", lambda t, m: [*_sft(t, [{"text": w} for w in WORDS]),
         "--eval-dataset", _jsonl(t / "test.jsonl", [{"prompt": "ab=", "completion": "ba"}]),
         "--reward", "exact_match"], "has no column 'answer' for --reward"),
    # ---- every row of a local file, not only the first few
    Case("numeric-prompt-late", lambda t, m: _composer(t, _late(20, question=42)),
         "line 21: the prompt in column 'question' (for prompt) is int"),
    Case("null-answer-late", lambda t, m: _composer(t, _late(25, answer=None), "--reward",
         "exact_match"), "line 26: the answer in column 'answer' is null, which --reward "
         "exact_match cannot read"),
    Case("null-answer-late-default-reward", lambda t, m: _composer(t, _late(27, answer=None)),
         "line 28: the answer in column 'answer' is null, which the default reward cannot read"),
    Case("mixed-answer-kinds", lambda t, m: _composer(t, _late(20, answer=7), "--reward",
         "exact_match"),
         "line 21: 'answer' is int while other rows hold text; make every value a string"),
    Case("mixed-prompt-kinds", lambda t, m: _composer(t, _late(
         20, question=[{"role": "user", "content": "ab="}])),
         "line 21: 'question' (for prompt) is list while other rows hold text"),
    Case("non-text-hint-late", lambda t, m: _composer(t, _late(20, hint=3), "--column",
         "hint=hint"), "line 21: the hint in column 'hint' is int; a hint is text"),
    Case("chat-message-without-content", lambda t, m: _composer(t, [
         {"question": [{"role": "user", "text": "ab="}], "answer": "ba"}] * 32),
         "line 1: the prompt in column 'question' (for prompt) is a list of messages whose "
         "message 0 has no 'content'"),
    Case("conversations-without-a-model", lambda t, m: _composer(t, [
         {"question": [{"role": "user", "content": "ab="}], "answer": "ba"}] * 32),
         "holds conversations (lists of messages) but the composer job's embedded model has "
         "no chat template"),
    Case("chat-message-with-null-content", lambda t, m: [*_composer(t, [
         {"question": [{"role": "user", "content": None}], "answer": "ba"}] * 32),
         *_with_model(m, t, None)], "line 1: the prompt in column 'question' (for prompt) is a "
         "list of messages whose message 0 (user) has a content that is null, not text"),
    Case("sft-message-with-null-role", lambda t, m: _sft(t, [{"messages": [
         {"role": None, "content": w}]} for w in WORDS]),
         "line 1: 'messages' must be a list of {'role', 'content'} messages (got a list of "
         "messages whose message 0 has a role that is null, not a name)"),
    Case("sft-completion-message-with-numeric-content", lambda t, m: _sft(t, [
         {"prompt": [{"role": "user", "content": w}], "completion": [
          {"role": "assistant", "content": 7}]} for w in WORDS]),
         "line 1: 'completion' must be a list of {'role', 'content'} messages (got a list of "
         "messages whose message 0 (assistant) has a content that is int, not text)"),
    Case("column-naming-no-column", lambda t, m: _composer(t, None, "--column", "answer="),
         "--column answer= names no column: give the file's column after '='"),
    Case("sft-prompt-and-completion-one-column", lambda t, m: _sft(
         t, [{"text": w} for w in WORDS], "--column", "prompt=text", "--column",
         "completion=text"), "--column maps prompt and completion to one column 'text'"),
    Case("sft-null-completion-late", lambda t, m: _sft(t, [
         {"prompt": f"{w}=", "completion": None if i == 20 else w} for i, w in
         enumerate(WORDS)]), "line 21: 'prompt' and 'completion' must both be strings"),
    Case("sft-empty-text-late", lambda t, m: _sft(t, [{"text": "" if i == 30 else w} for i, w in
         enumerate(WORDS)]), "line 31: 'text' is empty"),
    # ---- a file that is not JSON lines, line by line
    Case("malformed-line-21", lambda t, m: _raw(t, "x.jsonl", _lines(
         lambda ls: _set(ls, 20, b'{"question": "oops, "answer": "x"}'))),
         "x.jsonl: line 21 is not valid JSON (Expecting ',' delimiter at column"),
    Case("latin1-line-26", lambda t, m: _raw(t, "x.jsonl", _lines(
         lambda ls: _set(ls, 25, b'{"question": "caf\xe9", "answer": "x"}'))),
         "x.jsonl: line 26 is not UTF-8 (byte 0xe9 at column 18)"),
    Case("latin1-csv", lambda t, m: _raw(t, "x.csv", b"question,answer\nab=,ba\ncaf\xe9,x\n"),
         "x.csv: line 3 is not UTF-8 (byte 0xe9 at column 4)"),
    Case("latin1-csv-url", lambda t, m: ["--job", "composer", "--dataset", "file://" + _raw(
         t, "x.csv", b"question,answer\nab=,ba\ncaf\xe9,x\n")[3], "--column", "prompt=question"],
         "x.csv cannot be read: 'utf-8' codec can't decode byte 0xe9"),
    Case("nan-answer", lambda t, m: _raw(t, "x.jsonl", _lines(
         lambda ls: _set(ls, 6, b'{"question": "ab=", "answer": NaN}'))),
         "line 7: the answer in column 'answer' is NaN (a missing value), which the default "
         "reward cannot read"),
    Case("line-not-an-object", lambda t, m: _raw(t, "x.jsonl", _lines(
         lambda ls: _set(ls, 4, b'["ab=", "ba"]'))), "line 5 is a JSON list, not an object"),
    Case("rows-nested-in-json", lambda t, m: _raw(t, "x.json", json.dumps(
         {"data": _qa()}).encode()), "rows are nested under 'data'"),
    Case("pandas-to-json-default", lambda t, m: _raw(t, "x.json", _pandas_json()),
         'x.json holds one JSON object of columns ({column: {row: value}}), as pandas\' '
         'to_json writes it without orient="records", lines=True: save it with '
         'df.to_json(path, orient="records", lines=True), as a .jsonl'),
    Case("pandas-to-json-default-as-jsonl", lambda t, m: _raw(t, "x.jsonl", _pandas_json()),
         "as pandas' to_json writes it without orient=\"records\""),
    Case("columns-as-lists-in-json", lambda t, m: _raw(t, "x.json", json.dumps(
         {"question": [r["question"] for r in _qa()], "answer": [r["answer"] for r in _qa()]}
         ).encode()), "x.json holds one JSON object of columns ({column: [values]}), not rows"),
    Case("one-object-over-lines", lambda t, m: _raw(t, "x.json", json.dumps(
         _qa()[0], indent=2).encode()), "holds one JSON object over several lines"),
    Case("byte-order-mark", lambda t, m: _raw(t, "x.jsonl", b"\xef\xbb\xbf" + _lines(
         lambda ls: None)), "starts with a byte-order mark (BOM): save it as UTF-8 without"),
    Case("parquet-named-jsonl", lambda t, m: _raw(t, "rows.jsonl", _parquet()),
         "rows.jsonl is a Parquet file, not .jsonl: rename it to rows.parquet"),
    Case("gzip-without-its-suffix", lambda t, m: _raw(t, "x.jsonl", gzip.compress(_lines(
         lambda ls: None))), "x.jsonl is gzip-compressed: rename it to x.jsonl.gz"),
    Case("zstd-without-its-suffix", lambda t, m: _raw(t, "x.csv", zstandard.compress(
         b"question,answer\nab=,ba\n")), "x.csv is Zstandard-compressed: rename it to x.csv.zst"),
    Case("empty-parquet", lambda t, m: _raw(t, "x.parquet", b""),
         "x.parquet is empty (0 bytes): it needs rows"),
    # ---- local paths that are not data crf reads
    Case("tsv-file", lambda t, m: _raw(t, "x.tsv", b"question\tanswer\nab=\tba\n"),
         "x.tsv is a local file, but crf reads only .jsonl, .json, .parquet, .csv files"),
    Case("txt-file", lambda t, m: _raw(t, "x.txt", _lines(lambda ls: None)),
         "x.txt is a local file, but crf reads only"),
    Case("file-without-suffix", lambda t, m: _raw(t, "rows", _lines(lambda ls: None)),
         "rows is a local file, but crf reads only"),
    Case("compressed-parquet", lambda t, m: _raw(t, "x.parquet.gz", gzip.compress(b"PAR1")),
         "x.parquet.gz is a compressed Parquet file, which datasets does not read: decompress"),
    Case("zip-jsonl", lambda t, m: _raw(t, "x.jsonl.zip", b"PK\x03\x04"),
         "x.jsonl.zip is compressed as .zip, which crf does not read: decompress it"),
    Case("zst-that-does-not-decompress", lambda t, m: _raw(t, "x.jsonl.zst", _lines(
         lambda ls: None)), "x.jsonl.zst does not decompress as .zst (zstd decompress"),
    Case("zst-cut-short", lambda t, m: _raw(t, "x.jsonl.zst", zstandard.compress(_lines(
         lambda ls: None))[:-40]), "x.jsonl.zst does not decompress as .zst (the file ends "
         "inside a frame: it was cut short)"),
    Case("gz-that-does-not-decompress", lambda t, m: _raw(t, "x.jsonl.gz", _lines(
         lambda ls: None)), "x.jsonl.gz does not decompress as .gz (Not a gzipped file"),
    Case("malformed-line-in-gz", lambda t, m: _raw(t, "x.jsonl.gz", gzip.compress(_lines(
         lambda ls: _set(ls, 20, b'{"question": "oops, "answer": "x"}')))),
         "x.jsonl.gz: line 21 is not valid JSON (Expecting ',' delimiter"),
    Case("na-answer-in-csv", lambda t, m: _raw(t, "x.csv", b"question,answer\n"
         + b"ab=,ba\ncd=,NA\n" * 16, "--reward", "exact_match"),
         "x.csv line 3: the answer in column 'answer' is null, which --reward exact_match "
         "cannot read; it needs text or a number on every row (map another with --column "
         "answer=COLUMN) (the CSV cell reads 'NA': pandas, which reads CSV files, takes an "
         "empty cell, NA, N/A, None, null or NaN for a missing value"),
    Case("null-prompt-in-csv-xz", lambda t, m: _raw(t, "x.csv.xz", lzma.compress(
         b"question,answer\nab=,ba\n,x\n")), "line 3: the prompt in column 'question' (for "
         "prompt) is null"),
    Case("null-answer-in-zst-url", lambda t, m: ["--job", "composer", "--dataset", "file://"
         + _raw(t, "x.jsonl.zst", zstandard.compress(_lines(lambda ls: _set(
             ls, 3, b'{"question": "ab=", "answer": null}'))))[3], "--column",
         "prompt=question"], "row 4 (the first is row 1): the answer in column 'answer' is null"),
    Case("upper-case-suffixes-in-a-folder", lambda t, m: ["--job", "composer", "--dataset",
         str(Path(_jsonl(t / "d" / "TRAIN.JSONL", _qa())).parent)],
         "holds TRAIN.JSONL, but datasets reads a folder's files by lower-case suffixes only"),
    Case("backup-beside-the-data-in-a-folder", lambda t, m: ["--job", "composer", "--dataset",
         str(Path(_jsonl(t / "d" / "train.jsonl", _qa())).parent)
         if _jsonl(t / "d" / "train.jsonl.bak", _qa(question=None)) else ""],
         "holds train.jsonl.bak, which datasets reads as rows of the 'train' split"),
    Case("compressed-parquet-in-a-folder", lambda t, m: ["--job", "composer", "--dataset",
         str(t / "d") if _gz(t / "d" / "train.parquet.gz") else ""],
         "d: train.parquet.gz is a compressed Parquet file"),
    Case("only-a-link-to-a-folder", lambda t, m: ["--job", "composer", "--dataset",
         _linked(t, _jsonl(t / "real" / "train.jsonl", _qa()))],
         "holds data, a link to a folder, which datasets does not follow: give that folder"),
    # ---- --dataset-config where --dataset has no configs
    Case("config-of-a-file", lambda t, m: _composer(t, None, "--dataset-config", "main"),
         "--dataset-config main: --dataset {t}/train.jsonl is one file, which has no configs; "
         "drop --dataset-config"),
    Case("config-of-a-url", lambda t, m: ["--job", "composer", "--dataset", "file://" + _jsonl(
         t / "x.jsonl", _qa()), "--column", "prompt=question", "--dataset-config", "main"],
         "x.jsonl is one file, which has no configs"),
    Case("config-of-a-saved-folder", lambda t, m: ["--job", "composer", "--dataset", _saved(t),
         "--column", "prompt=question", "--dataset-config", "main"],
         "saved is a save_to_disk folder, which has no configs"),
    Case("config-a-folder-lacks", lambda t, m: ["--job", "composer", "--dataset", str(Path(
         _jsonl(t / "d" / "train.jsonl", _qa())).parent), "--column", "prompt=question",
         "--dataset-config", "main"],
         "--dataset-config main: --dataset {t}/d has no such config (its configs: default)"),
    Case("config-without-a-dataset", lambda t, m: ["--job", "sft", "--dataset-config", "main"],
         "--dataset-config main names a part of --dataset, and there is none"),
    Case("split-of-a-file", lambda t, m: _composer(t, None, "--dataset-split", "tset"),
         "--dataset-split tset: --dataset {t}/train.jsonl is one split (a file, or a saved "
         "Dataset), which datasets reads whole as 'train'; drop --dataset-split"),
    Case("split-of-an-sft-file", lambda t, m: [*_sft(t, _qa()), "--dataset-split", "test"],
         "--dataset-split test: --dataset {t}/train.jsonl is one split"),
    Case("column-without-a-dataset", lambda t, m: ["--job", "composer", "--column",
         "prompt=question"], "--column prompt=question maps the columns of --dataset, and "
         "there is none"),
    Case("column-given-twice", lambda t, m: [*_composer(t), "--column", "prompt=answer"],
         "--column prompt is given twice ('question' and 'answer'): a field reads one column"),
    Case("prompt-and-answer-from-one-column", lambda t, m: [*_composer(t), "--column",
         "answer=question"], "--column maps prompt and answer to one column 'question'"),
    Case("empty-dataset-name", lambda t, m: ["--job", "composer", "--dataset", ""],
         "--dataset is an empty string: give its name, or leave it out"),
    Case("missing-dot-path", lambda t, m: ["--job", "composer", "--dataset",
         "./no/such/folder"], "--dataset ./no/such/folder: no such file or folder"),
    Case("link-that-loops", lambda t, m: ["--job", "composer", "--dataset", _loop(t)],
         "a.jsonl is a link that loops (it leads back to itself through links)"),
    Case("dangling-link", lambda t, m: ["--job", "composer", "--dataset", _dangling(t)],
         "a.jsonl is a link to {t}/moved.jsonl, which does not exist (a dangling link)"),
    Case("glob-pattern", lambda t, m: ["--job", "composer", "--dataset", str(t / "d" / "tr*.jsonl")
         if _jsonl(t / "d" / "train.jsonl", _qa()) else ""],
         "tr*.jsonl: no such file or folder, and crf does not expand patterns (* ? [): pass the "
         "folder that holds the files"),
    Case("missing-data-file", lambda t, m: ["--job", "composer", "--dataset",
         str(t / "nope.parquet")], "nope.parquet: no such file or folder"),
    Case("folder-without-data-files", lambda t, m: ["--job", "composer", "--dataset",
         str(t) if (t / "readme.txt").write_text("hi") else ""],
         "is a folder with no .jsonl, .json, .parquet, .csv files (it holds readme.txt)"),
    Case("parent-of-a-saved-folder", lambda t, m: ["--job", "composer", "--dataset",
         str(Path(_saved(t)).parent), "--column", "prompt=question"],
         "holds the save_to_disk folder saved: give that folder (--dataset "),
    Case("splits-in-two-formats", lambda t, m: ["--job", "composer", "--dataset", str(Path(
         _jsonl(t / "d" / "train.jsonl", _qa())).parent), "--column", "prompt=question",
         "--eval-split", "test", *([] if (t / "d" / "test.csv").write_text("question,answer\n"
         "ab=,ba\n") else [])], "d holds its splits in different formats (train: json, test: "
         "csv), and datasets reads a folder in one"),
    Case("folder-files-with-other-columns", lambda t, m: ["--job", "composer", "--dataset",
         str(Path(_jsonl(t / "d" / "a.jsonl", _qa())).parent), "--column", "prompt=question",
         *([] if _jsonl(t / "d" / "b.jsonl", [{"prompt": r["question"], "answer": r["answer"]}
                                              for r in _qa()]) is None else [])],
         "d: b.jsonl's columns differ from a.jsonl's: column 'question' is in a.jsonl but not "
         "in b.jsonl; datasets reads a folder's files as one table"),
    Case("folder-files-with-other-types", lambda t, m: ["--job", "composer", "--dataset",
         str(Path(_jsonl(t / "d" / "a.jsonl", _qa())).parent), "--column", "prompt=question",
         *([] if _jsonl(t / "d" / "b.jsonl", [{**r, "answer": 7} for r in _qa()]) is None
           else [])],
         "d: column 'answer' holds numbers in b.jsonl but text in a.jsonl; datasets reads a "
         "folder's files as one table, so a column holds one kind of value in every file"),
    Case("model-folder-as-dataset", lambda t, m: ["--job", "composer", "--dataset",
         _model(m, t)], "model is a model folder (config.json and weights), not data"),
    Case("saved-dict-without-the-split", lambda t, m: ["--job", "composer", "--dataset",
         _saved(t, ("train",)), "--column", "prompt=question", "--eval-split", "test"],
         "saved has no split 'test'; its splits are train"),
    Case("saved-dataset-with-eval-split", lambda t, m: ["--job", "composer", "--dataset",
         _saved(t), "--column", "prompt=question", "--eval-split", "test"],
         "is one file, one split"),
    # ---- the model folder
    Case("model-without-tokenizer", lambda t, m: [*_composer(t), *_with_model(m, t, _no_tokenizer)],
         "has no tokenizer files"),
    Case("truncated-weights", lambda t, m: [*_composer(t), *_with_model(m, t, _truncate)],
         "model.safetensors is truncated"),
    Case("unknown-model-type", lambda t, m: [*_composer(t), *_with_model(
         m, t, lambda f: _edit_json(f / "config.json", model_type="qwen9"))],
         "config.json's model_type 'qwen9' is unknown"),
    Case("tokenizer-larger-than-embedding", lambda t, m: [*_composer(t), *_with_model(
         m, t, lambda f: _edit_json(f / "config.json", vocab_size=4))],
         "but the model embeds 4 (config.json vocab_size)"),
    Case("config-of-a-larger-vocabulary", lambda t, m: [*_composer(t), *_with_model(
         m, t, lambda f: _edit_json(f / "config.json", vocab_size=151936))],
         "the config and the weights are of different models"),
    Case("no-config", lambda t, m: [*_composer(t), *_with_model(
         m, t, lambda f: (f / "config.json").unlink())], "has no config.json"),
    Case("no-weights", lambda t, m: [*_composer(t), *_with_model(
         m, t, lambda f: (f / "model.safetensors").unlink())], "has no weights"),
    Case("index-names-a-missing-shard", lambda t, m: [*_composer(t), *_with_model(
         m, t, _index_missing_shard)], "model-00002-of-00002.safetensors named by"),
    Case("model-is-a-file", lambda t, m: [*_composer(t), "--model",
         str(Path(_model(m, t)) / "config.json")], "is a file: give the model's folder ("),
    Case("model-is-a-broken-link", lambda t, m: [*_composer(t), "--model", _broken_link(t)],
         "is a link to"),
    Case("model-is-a-lora-adapter", lambda t, m: [*_composer(t), *_with_model(m, t, _adapter)],
         "is a LoRA adapter (of org/base), not a model: export it merged (crf export RUN DEST "
         "--merge)"),
    Case("model-without-its-lm-head", lambda t, m: [*_composer(t), *_with_model(m, t, _headless)],
         "its weights lack lm_head.weight: it was saved without its LM head (AutoModel?)"),
    Case("messages-without-chat-template", lambda t, m: [*_sft(t, CONVERSATIONS), *_with_model(
         m, t, _no_chat_template)], "holds conversations (lists of messages) but --model"),
    Case("completions-past-learned-positions", lambda t, m: [*_composer(t), *_with_model(
         m, t, _gpt2)], "and max_completion_length 512 need "),
    Case("completions-past-learned-positions-named", lambda t, m: [*_composer(t), *_with_model(
         m, t, _gpt2)], "(64, a learned table: a longer sequence fails, it does not run on); "
         "lower it (--set max_completion_length="),
    Case("sft-max-length-past-learned-positions", lambda t, m: [*_sft(t, [{"text": w} for w in
         WORDS]), *_with_model(m, t, _gpt2)], "--model {t}/model has 64 positions (a learned "
         "table: a longer sequence fails, it does not run on) but the sft job's max_length is "
         "1024: --set max_length=64 (or less)"),
    Case("no-pad-or-eos-token", lambda t, m: [*_composer(t), *_with_model(m, t, _no_pad_or_eos)],
         "no pad token and no EOS token"),
    # ---- the rewards, called on the sampled rows
    Case("reward-raises", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_raises", RAISES)],
         "--reward rw_raises:score raised ZeroDivisionError: division by zero"),
    Case("reward-returns-none", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_none", "def score(completions, **kw):\n    pass\n")],
         "--reward rw_none:score returned a null"),
    Case("reward-returns-nan", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_nan", NAN)],
         "--reward rw_nan:score returned nan for the 1st row"),
    Case("reward-returns-none-per-row", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_nones", "def score(completions, **kw):\n    return [None] * len(completions)\n")],
         "--reward rw_nones:score returned None for the 1st row"),
    Case("reward-returns-text", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_text", "def score(completions, **kw):\n    return ['1'] * len(completions)\n")],
         "returned '1' for the 1st row"),
    Case("reward-wrong-length", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_short", "def score(completions, **kw):\n    return [1.0]\n")],
         "returned 1 values on 8 row(s)"),
    Case("reward-reads-a-missing-column", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_col", READS_SOLUTION)],
         "--reward rw_col:score takes a parameter 'solution', which no column of --dataset"),
    Case("reward-column-of-text-that-reads-as-json", lambda t, m: [*_composer(t, [
         {**r, "zip": f"{i * 74:05d}" if i % 2 == 0 else i * 1000} for i, r in enumerate(_qa())]),
         *_reward_module(t, "rw_zip", "def score(completions, zip, **kw):\n"
                         "    return [0.0] * len(completions)\n")],
         "train.jsonl: column 'zip' mixes text (line 1: '00000') and other kinds (line 2: "
         "1000), and the replicas' reader (datasets) holds such a column as JSON, so the text "
         "'00000' would reach the rewards as 0: make every value of it text (e.g. '1000')"),
    Case("reward-module-syntax-error", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_syntax", "def score(completions, **kw)\n    return []\n")],
         "importing rw_syntax raised SyntaxError"),
    Case("reward-module-fails-to-import", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_import", "import not_installed_anywhere\n")],
         "cannot import it from the working directory (No module named 'not_installed_anywhere')"),
    Case("reward-module-raises-at-import", lambda t, m: [*_composer(t), *_reward_module(
         t, "rw_boom", "raise RuntimeError('needs API_KEY')\n")],
         "importing rw_boom raised RuntimeError: needs API_KEY"),
    Case("workdir-job-fails-to-import", lambda t, m: _workdir_job(t, "raise KeyError('x')\n"),
         "importing it raised KeyError"),
    Case("workdir-job-syntax-error", lambda t, m: _workdir_job(t, "def run(ctx, cfg)\n"),
         "importing it raised SyntaxError"),
]  # fmt: skip


def _workdir_job(tmp: Path, body: str) -> list[str]:
    pkg = tmp / "wd" / "userjobs"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "badjob.py").write_text(body)
    return ["--workdir", str(tmp / "wd"), "--job", "userjobs.badjob"]


def test_the_corpus_is_large() -> None:
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line(case: Case, tmp_path: Path, tiny_model: Path) -> None:
    base = tmp_path / "runs"
    args = case.args(tmp_path, tiny_model)
    result = crf("launch", "--store", str(base), "--run-id", "t1", "--replicas", "2",
                 "--dry-run", *args)  # fmt: skip
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    assert case.message.replace("{t}", str(tmp_path)) in lines[0], lines[0]
    assert not base.exists()  # nothing written


def test_a_refused_launch_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    """A real launch (not a dry run) refused for its data: the store's other runs keep every
    byte and time stamp."""
    base = tmp_path / "runs"
    (base / "old").mkdir(parents=True)
    (base / "old" / "run.json").write_text("{}")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in base.rglob("*") if p.is_file()}
    result = crf("launch", "--store", str(base), "--run-id", "t1", "--replicas", "2",
                 *_composer(tmp_path, _qa(question=None)))  # fmt: skip
    assert result.exit_code == 2, result.output
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in base.rglob("*") if p.is_file()}
    assert after == before
    assert not (base / "t1").exists()


def test_gsm8k_columns_with_a_held_out_split_are_accepted(tmp_path: Path) -> None:
    """The SFT job on GSM8K's own names (question/answer), a held-out split and a reward:
    the plan accepts it (the held-out split keeps the mapping)."""
    folder = tmp_path / "d"
    _jsonl(folder / "train.jsonl", _qa())
    _jsonl(folder / "test.jsonl", _qa())
    result = crf("launch", "--store", str(tmp_path / "runs"), "--dry-run", "--replicas", "2",
                 "--job", "sft", "--dataset", str(folder), "--column", "prompt=question",
                 "--column", "completion=answer", "--eval-split", "test",
                 "--reward", "exact_match")  # fmt: skip
    assert result.exit_code == 0, result.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: connections are refused


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    full.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "crf.launcher.cli", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "name"), [("--dataset", "openai/gsm8k"), ("--model", "Qwen/Qwen2.5-0.5B")]
)
def test_an_unreachable_hub_repo_is_refused_on_the_local_backend(
    flag: str, name: str, tmp_path: Path
) -> None:
    """No network to the Hub (HF_ENDPOINT on a closed loopback port, an empty cache): refused
    in one line, with the time it took inside the bound (the CLI's start included)."""
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    out = _cli("launch", "--store", str(tmp_path / "runs"), "--replicas", "2", "--job",
               "composer", flag, name, env=env)  # fmt: skip
    took = time.monotonic() - started
    lines = out.stderr.strip().splitlines() + out.stdout.strip().splitlines()
    assert out.returncode == 2, out
    assert len(lines) == 1 and "cannot be reached" in lines[0] and name in lines[0], lines
    assert took < 60  # a bound for a loaded machine; bench/data_checks.py measures it
    assert not (tmp_path / "runs").exists()


def test_a_cloud_backend_lists_an_unreachable_hub_repo_as_a_warning(tmp_path: Path) -> None:
    """The replicas of a cloud backend may reach what this machine cannot: the plan lists
    it, and does not refuse."""
    from huggingface_hub import constants

    from crf.launcher.plan import prepare

    saved = constants.ENDPOINT
    constants.ENDPOINT = f"http://127.0.0.1:{_closed_port()}"
    try:
        plan = prepare({"job": "composer", "dataset": "openai/gsm8k", "replicas": 2,
                        "backend": "modal"}, store="s3://bucket/runs", dry_run=True)  # fmt: skip
    finally:
        constants.ENDPOINT = saved
    assert any("--dataset openai/gsm8k" in n and "replicas must reach it" in n for n in plan.notes)


def test_the_launch_error_is_crfs_own(tmp_path: Path) -> None:
    """SDK users catch crf.LaunchError for the same one line."""
    import crf as crf_pkg

    with pytest.raises(crf_pkg.LaunchError, match="is empty"):
        crf_pkg.dry_run(job="composer", dataset=_jsonl(tmp_path / "x.jsonl", []))


# ---------------------------------------------------------------------- end to end
SETUP_BUG = """
from dataclasses import dataclass


@dataclass
class Config:
    pass


def run(ctx, cfg):
    rows = [{"prompt": "ab="}]
    return {"n": len(rows[0]["completion"])}  # the trainer's KeyError, raised while building
"""

TRAINING_BUG = """
from dataclasses import dataclass

import torch


@dataclass
class Config:
    pass


def run(ctx, cfg):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ctx.diloco(model, opt):
        raise ValueError("row 3 has no label")  # in the first step, on every replica
"""


def _launch_job(tmp_path: Path, body: str, run_id: str) -> tuple[subprocess.CompletedProcess, dict]:
    pkg = tmp_path / "wd" / "userjobs"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(body)
    base = tmp_path / "runs"
    out = _cli("launch", "--store", str(base), "--run-id", run_id, "--replicas", "2",
               "--job", "userjobs.job", "--workdir", str(tmp_path / "wd"), "-H", "2", "-r", "2",
               "--max-restarts", "3", "--no-progress", "--timeout", "300",
               env={"COLUMNS": "200", "CRF_LOG_LEVEL": "WARNING"})  # fmt: skip
    return out, json.loads((base / run_id / "result.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow
def test_an_error_at_setup_fails_once_and_is_never_restarted(tmp_path: Path) -> None:
    """The job's own code raises while it builds (what no check before launch can see): each
    replica fails once, none is restarted, the run's reason is the error in one line, and
    neither the summary nor the terminal shows a traceback."""
    out, summary = _launch_job(tmp_path, SETUP_BUG, "setup-bug")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert summary["status"] == "failed" and summary["restarts"] == 0, summary
    assert "failed at setup with KeyError: 'completion'" in summary["error"], summary["error"]
    assert "a restart cannot fix it" in summary["error"]
    assert "\n" not in summary["error"]
    assert "Traceback" not in text
    failed = [r for r in summary["replicas"] if r["state"] == "failed"]
    assert failed and all(r["failure"] == "setup error" for r in failed), summary["replicas"]
    assert "Traceback" not in json.dumps(summary)  # the log keeps it, the summary does not
    for row in summary["replicas"]:
        assert row["attempts"] == [] and row["restarts"] == 0, row
        assert (row["rounds_committed"] or 0) == 0  # it never trained: 0 rounds, not 2/2
    assert "failed at setup" in text and "0/2" in text


@pytest.mark.e2e
@pytest.mark.slow
def test_the_same_error_on_two_replicas_ends_the_run(tmp_path: Path) -> None:
    """An error raised in training before the first committed round is restarted only until
    it repeats (on the replica's restart or on the other replica): then the run ends with
    that error as its reason, not after --max-restarts x replicas attempts."""
    _, summary = _launch_job(tmp_path, TRAINING_BUG, "training-bug")
    assert summary["status"] == "failed", summary
    assert "ValueError: row 3 has no label" in summary["error"], summary["error"]
    assert "a restart cannot fix it" in summary["error"]
    assert summary["restarts"] <= 1, summary["restarts"]  # not 2 x --max-restarts 3


def test_a_math_answer_refusal_is_one_line_in_a_real_process(tmp_path: Path) -> None:
    """math-verify warns once per process that its timeouts are off (crf turns them off on
    purpose); in the CLI's own process, with no test harness catching log records, the
    refusal stays the one line."""
    args = _composer(tmp_path, [{"question": "q", "answer": "no number here"}] * 32,
                     "--reward", "math_answer")  # fmt: skip
    out = _cli("launch", *args, "--store", str(tmp_path / "runs"), "--dry-run", env={})
    lines = out.stderr.strip().splitlines() + out.stdout.strip().splitlines()
    assert out.returncode == 2, out
    assert len(lines) == 1 and "math_answer finds no number" in lines[0], lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_the_checks_show_a_spinner_on_a_terminal_and_leave_one_line(tmp_path: Path) -> None:
    """On a terminal the checks before launch (a big split, a Hub dataset's first rows) show
    what is going on; the spinner is gone when the refusal's one line is printed."""
    import pty
    import re

    main, child = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "crf.launcher.cli", "launch", "--dry-run",
                             "--store", str(tmp_path / "runs"), "--dataset",
                             str(tmp_path / "missing.jsonl")], stdin=child, stdout=child,
                            stderr=child, env=env, cwd=REPO)  # fmt: skip
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=120) == 2
    text = out.decode(errors="replace")
    assert "checking the data, model and rewards" in text
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n")
    lines = [line.strip() for line in shown.splitlines() if line.strip()]
    assert lines[-1] == f"error: --dataset {tmp_path / 'missing.jsonl'}: no such file or folder"
