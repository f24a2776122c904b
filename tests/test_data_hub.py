"""A Hub dataset (``--dataset org/name``) checked before launch, as a URL is: its first rows
streamed from a loopback Hub (tests/emulators/hf_hub.py) through the real ``datasets`` and
``huggingface_hub`` clients, so a config or split it has not, a column it lacks or a bad row
is one line before any replica starts; and a replica that meets a missing config or split
says the same line."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import zstandard

from tests.test_cli import crf

WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 2  # 16 rows

#: a README whose YAML names two configs, each one split (as many Hub datasets do)
CONFIGS = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
# two configs
"""


def _rows(**change: Any) -> list[dict[str, Any]]:
    """GSM8K-shaped rows (question/answer), row 3 changed by ``change``."""
    rows: list[dict[str, Any]] = [{"question": f"{w}=", "answer": w[::-1]} for w in WORDS]
    rows[3] = {**rows[3], **change}
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def hub_data(hf_hub: Any, hf_hub_env: dict, tmp_path: Path) -> dict[str, str]:
    """Four dataset repos: ``configs`` (two configs, train only), ``splits`` (train and
    test files, no README), ``null`` (train, its row 3's question null) and ``zst`` (the
    same as a Zstandard-compressed file)."""
    two = tmp_path / "configs"
    (two / "README.md").parent.mkdir(parents=True)
    (two / "README.md").write_text(CONFIGS)
    _write(two / "main" / "train.jsonl", _rows())
    _write(two / "socratic" / "train.jsonl", _rows())
    hf_hub.add_repo("crf-test/configs", two, kind="dataset")
    splits = tmp_path / "splits"
    _write(splits / "data" / "train.jsonl", _rows())
    _write(splits / "data" / "test.jsonl", _rows())
    hf_hub.add_repo("crf-test/splits", splits, kind="dataset")
    null = tmp_path / "null"
    _write(null / "data" / "train.jsonl", _rows(question=None))
    hf_hub.add_repo("crf-test/null", null, kind="dataset")
    packed = tmp_path / "zst" / "data" / "train.jsonl"  # Zstandard, streamed decompressed
    _write(packed, _rows(question=None))
    packed.with_suffix(".jsonl.zst").write_bytes(zstandard.compress(packed.read_bytes()))
    packed.unlink()
    hf_hub.add_repo("crf-test/zst", tmp_path / "zst", kind="dataset")
    return {"store": str(tmp_path / "runs")}


def _launch(hub_data: dict[str, str], *args: str) -> Any:
    return crf("launch", "--store", hub_data["store"], "--dry-run", "--replicas", "2",
               "--column", "prompt=question", *args)  # fmt: skip


def _one_line(result: Any) -> str:
    """The refusal: exit 2 and one error line (no traceback)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert "Traceback" not in result.output, result.output
    return " ".join(lines)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--dataset", "crf-test/configs"],
         "--dataset crf-test/configs has several configs ['main', 'socratic']: choose one "
         "with --dataset-config"),
        (["--dataset", "crf-test/configs", "--dataset-config", "Main"],
         "--dataset-config Main: --dataset crf-test/configs has no such config (its configs: "
         "main, socratic)"),
        (["--dataset", "crf-test/splits", "--dataset-split", "validation"],
         "--dataset-split validation: --dataset crf-test/splits has no such split (its "
         "splits: train, test)"),
        (["--dataset", "crf-test/configs", "--dataset-config", "main", "--eval-split", "test"],
         "--eval-split test: --dataset crf-test/configs has no such split (its splits: train)"),
        (["--dataset", "crf-test/splits", "--column", "answer=solution"],
         "no column 'solution'"),
        (["--dataset", "crf-test/null"], "row 4 (the first is row 1)"),
        (["--dataset", "crf-test/zst"], "row 4 (the first is row 1)"),
        (["--job", "sft", "--dataset", "crf-test/splits"], "has none of the sft formats"),
        (["--job", "sft", "--dataset", "crf-test/splits", "--column", "completion=answer",
          "--eval-split", "test", "--reward", "exact_match", "--column", "answer=nope"],
         "has no column 'nope' for --reward to check answers against"),
        (["--dataset", "crf-test/splits", "--eval-dataset", "crf-test/configs"],
         "--eval-dataset crf-test/configs has several configs ['main', 'socratic']: choose "
         "one with --eval-dataset-config"),
        (["--dataset", "crf-test/splits", "--eval-dataset", "crf-test/configs",
          "--eval-dataset-config", "Main"],
         "--eval-dataset-config Main: --eval-dataset crf-test/configs has no such config "
         "(its configs: main, socratic); name one of them, or drop --eval-dataset-config"),
        (["--dataset", "crf-test/splits", "--eval-dataset-config", "main"],
         "--eval-dataset-config main names a config of --eval-dataset, and there is none"),
    ],
    ids=["no-config", "unknown-config", "unknown-split", "unknown-eval-split", "no-column",
         "null-prompt", "null-prompt-zst", "sft-no-format", "sft-held-out-no-answer",
         "eval-no-config", "eval-unknown-config", "eval-config-alone"],
)  # fmt: skip
def test_a_hub_datasets_mistake_is_one_line_before_launch(
    hub_data: dict[str, str], args: list[str], says: str
) -> None:
    line = _one_line(_launch(hub_data, *args))
    assert says in line, line
    assert not Path(hub_data["store"]).exists()  # nothing written


def test_a_good_hub_dataset_passes_with_its_config_and_held_out_split(
    hub_data: dict[str, str],
) -> None:
    ok = _launch(hub_data, "--dataset", "crf-test/configs", "--dataset-config", "socratic")
    assert ok.exit_code == 0, ok.output
    held = _launch(hub_data, "--dataset", "crf-test/splits", "--eval-split", "test")
    assert held.exit_code == 0, held.output
    other = _launch(hub_data, "--dataset", "crf-test/splits", "--eval-dataset",
                    "crf-test/configs", "--eval-dataset-config", "socratic")  # fmt: skip
    assert other.exit_code == 0, other.output
    assert "crf-test/configs, config socratic, split train" in " ".join(other.output.split())
    sft = _launch(hub_data, "--job", "sft", "--dataset", "crf-test/splits", "--column",
                  "completion=answer", "--eval-split", "test", "--reward",
                  "exact_match")  # fmt: skip
    assert sft.exit_code == 0, sft.output


def test_a_config_for_a_held_out_file_is_refused(hub_data: dict[str, str], tmp_path: Path) -> None:
    """A file has no configs: --eval-dataset-config with one would read it whole whatever
    the name, so it is refused, naming the option."""
    held = tmp_path / "held.jsonl"
    _write(held, _rows())
    line = _one_line(_launch(hub_data, "--dataset", "crf-test/splits", "--eval-dataset",
                             str(held), "--eval-dataset-config", "main"))  # fmt: skip
    assert (
        f"--eval-dataset-config main: --eval-dataset {held} is one file, which has no "
        "configs; drop --eval-dataset-config" in line
    ), line


def test_a_replica_meets_a_missing_config_or_split_as_the_same_line(
    hub_data: dict[str, str],
) -> None:
    """What a replica reads (``load_shard``, the whole split) refuses a config or split the
    dataset has not with the launcher's line: a DataError, which the replica reports as an
    error no restart cures."""
    from crf.replica.data import DataError, load_shard

    def shard(config: str | None, split: str) -> list[dict[str, Any]]:
        return load_shard("crf-test/configs", config=config, split=split,
                          columns={"prompt": "question"}, rank=0, world_size=2,
                          needs_answer=True)  # fmt: skip

    assert len(shard("main", "train")) == len(WORDS) // 2
    with pytest.raises(DataError, match="has no such config .its configs: main, socratic"):
        shard("Main", "train")
    with pytest.raises(DataError, match="--dataset-split test: .* no such split"):
        shard("main", "test")


def test_rows_slower_than_the_bound_are_left_to_the_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Hub dataset whose first rows do not arrive in HUB_ROWS_S: the launch goes on with a
    warning that the replicas check their rows (a stalled read holds nothing up)."""
    from types import SimpleNamespace

    from crf.launcher import data_checks

    stalled = threading.Event()

    def stall(*args: Any) -> None:
        stalled.wait(30)

    monkeypatch.setattr(data_checks, "_sample", stall)
    monkeypatch.setattr(data_checks, "HUB_ROWS_S", 0.2)
    spec = SimpleNamespace(dataset="crf-test/slow", dataset_config=None, dataset_split="train",
                           eval_dataset=None, eval_split=None)  # fmt: skip
    warnings: list[str] = []
    try:
        assert data_checks.sample_splits(spec, set(), warnings) == []
    finally:
        stalled.set()
    assert len(warnings) == 1 and "did not arrive within 0.2s" in warnings[0], warnings
    assert "each replica checks its own rows" in warnings[0]


def test_a_hub_dataset_that_cannot_be_streamed_is_left_to_the_replicas(
    hub_data: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streaming read that fails for a reason no option names (here the connection, cut
    as the rows come) is no refusal: the replicas download the split whole and may read it.
    The launch goes on, saying so in a warning."""
    from crf.replica import data

    real = data._load

    def cut(dataset: str, config: Any, split: str, streaming: bool = False, **kw: Any) -> Any:
        if streaming:
            raise ConnectionError("Connection reset by peer")
        return real(dataset, config, split, streaming, **kw)

    monkeypatch.setattr(data, "_load", cut)
    out = _launch(hub_data, "--dataset", "crf-test/splits")
    text = " ".join(out.output.split())
    assert out.exit_code == 0, out.output
    assert ("warning: --dataset crf-test/splits cannot be read: Connection reset by peer: its "
            "first rows could not be streamed here") in text, text  # fmt: skip
    assert "each replica downloads the split and checks its own rows" in text


def test_in_time_returns_the_value_or_raises_the_error() -> None:
    from crf.launcher.data_checks import in_time

    assert in_time(lambda: 7, 30) == 7
    with pytest.raises(KeyError, match="x"):
        in_time(lambda: {}["x"], 30)


def _run(hub_data: dict[str, str], env: dict, dataset: str, *extra: str) -> tuple[Any, dict]:
    """A real local launch (the CLI in a process of its own, replicas too) on a Hub dataset,
    the replicas downloading it from the loopback Hub."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    full = {**os.environ, **env, "PYTHONPATH": str(repo), "COLUMNS": "200",
            "CRF_LOG_LEVEL": "WARNING"}  # fmt: skip
    full.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--store", hub_data["store"],
         "--run-id", "r", "--replicas", "2", "--dataset", dataset, "--column",
         "prompt=question", "--reward", "exact_match", "-H", "2", "-r", "1", "--no-progress",
         "--timeout", "300", "--set", "prompts_per_step=2", "--set", "num_generations=2",
         "--set", "max_completion_length=4", *extra],
        cwd=repo, env=full, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    return out, json.loads((Path(hub_data["store"]) / "r" / "result.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow
def test_replicas_train_on_a_hub_dataset_and_score_its_held_out_split(
    hub_data: dict[str, str], hf_hub_env: dict
) -> None:
    out, summary = _run(hub_data, hf_hub_env, "crf-test/splits", "--eval-split", "test")
    assert out.returncode == 0, out.stdout + out.stderr
    assert summary["status"] == "ok" and summary["restarts"] == 0, summary
    assert summary["held_out"] is not None and summary["weights_identical"] is True


@pytest.mark.e2e
@pytest.mark.slow
def test_a_bad_row_past_a_hub_datasets_first_rows_stops_the_run_once(
    hf_hub: Any, hf_hub_env: dict, hub_data: dict[str, str], tmp_path: Path
) -> None:
    """The launcher reads a Hub dataset's first rows only: a null question in row 12 is met
    by the replica holding it, at setup, naming the row; nothing restarts."""
    folder = tmp_path / "late"
    rows = _rows()
    rows[12] = {**rows[12], "question": None}
    _write(folder / "data" / "train.jsonl", rows)
    hf_hub.add_repo("crf-test/late", folder, kind="dataset")
    out, summary = _run(hub_data, hf_hub_env, "crf-test/late")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert summary["status"] == "failed" and summary["restarts"] == 0, summary
    said = summary["error"]
    assert "--dataset crf-test/late row 13 (the first is row 1)" in said, said
    assert "Traceback" not in text
