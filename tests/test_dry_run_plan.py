"""What the dry-run plan says about the workload and the price: model, dataset, reward,
held-out evaluation, tracker and job settings rows; each replica's CPU and memory; a spot run's
price basis; the worst case; idle GPUs; and a table that reads cleanly at 80 and 120 columns.

As in test_dry_run.py, no credential is set and HOME is empty; the CLI runs in-process and
nothing is launched (every test here is a dry run or a pure function).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crf.launcher.cli import app
from crf.launcher.plan_view import breakable
from tests import test_dry_run

no_account = test_dry_run.no_account  # the fixture, visible to this module's tests


def dry_run(*args: str, width: int = 200) -> tuple[int, str]:
    """``crf launch ... --dry-run`` at a terminal ``width``: (exit code, output as printed)."""
    result = CliRunner().invoke(app, ["launch", *args, "--dry-run"], env={"COLUMNS": str(width)})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def rows(out: str) -> dict[str, str]:
    """The plan table's rows, a value continued over several lines joined with spaces."""
    found: dict[str, str] = {}
    key = ""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 2:
            continue
        key = cells[0] or key
        found[key] = f"{found.get(key, '')} {cells[1]}".strip()
    return found


def test_the_plan_shows_the_workload(no_account: Path) -> None:
    data = no_account / "train.jsonl"
    # one batch of 8 prompts for each replica
    data.write_text("".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(32)))
    held = no_account / "held.jsonl"
    held.write_text(data.read_text())
    code, out = dry_run(
        "--dataset", str(data), "--column", "prompt=q", "--column", "answer=a",
        "--reward", "exact_match", "--eval-dataset", str(held), "--eval-examples", "5",
        "--report-to", "tensorboard",
    )  # fmt: skip
    assert code == 0, out
    plan = rows(out)
    assert plan["model"].startswith("the job's embedded tiny model")
    assert plan["dataset"] == f"{data}, split train, columns prompt=q, answer=a"
    assert plan["reward"] == "exact_match"
    assert plan["evaluation"].startswith(f"{held}, split train: 5 rows each round")
    assert plan["tracker"].startswith("tensorboard")
    assert "prompts_per_step=8" in plan["job settings"]
    assert "GRPOConfig" in plan["TRL settings"]

    code, out = dry_run("--job", "composer")  # the embedded task: its own held-out prompts
    plan = rows(out)
    assert code == 0 and "reverse strings of 2 to 3 of 'abcd'" in plan["dataset"]
    assert "reverse_reward" in plan["reward"] and "64 held-out prompts" in plan["evaluation"]
    assert plan["tracker"].startswith("none")


def test_the_sft_job_shows_its_settings_and_no_reward(no_account: Path) -> None:
    code, out = dry_run("--job", "sft", "--set", "trl.warmup_steps=3")
    assert code == 0, out
    plan = rows(out)
    assert "max_length=32" in plan["job settings"] and "learning_rate=0.003" in plan["job settings"]
    assert "warmup_steps=3" in plan["TRL settings"] and "SFTConfig" in plan["TRL settings"]
    assert "held-out loss" in plan["evaluation"] and "reward" not in plan
    printed = CliRunner().invoke(app, ["launch", "--job", "sft", "--print-config"])
    assert printed.exit_code == 0 and "# TRL SFTConfig fields that differ" in printed.output


def test_the_model_row_names_what_trains() -> None:
    from crf.launcher.plan_view import _model
    from crf.spec import RunSpec

    spec = RunSpec(run_id="r", run_uri="memory://r", model="Qwen/Qwen2.5-0.5B-Instruct",
                   lora_rank=16, lora_alpha=32, precision="bf16")  # fmt: skip
    assert _model(spec) == "Qwen/Qwen2.5-0.5B-Instruct (LoRA rank 16, alpha 32, precision bf16)"


@pytest.mark.parametrize(
    ("args", "idle"),
    [(["--job", "composer"], False), (["--job", "sft"], False),
     (["--job", "composer", "--procs-per-replica", "1"], True)],
)  # fmt: skip
def test_gpus_a_job_cannot_use_are_a_warning(no_account: Path, args: list, idle: bool) -> None:
    """l4x4: composer and sft train on the 4 GPUs (K defaults to them); one process per
    replica leaves 3 idle, and the plan says so."""
    code, out = dry_run("--backend", "hf", "--flavor", "l4x4", *args)
    assert code == 0, out
    plan = rows(out)
    if idle:
        assert plan["procs per replica"] == "1"
        assert "4 GPUs but trains on 1 process(es), 3 idle" in plan["warning"]
        assert "leave --procs-per-replica out" in plan["warning"]
    else:
        assert plan["procs per replica"].startswith("4 local ranks") and "warning" not in plan
    assert plan["cpu and memory"] == "48 vCPU, 186 GB RAM (the flavor's)"


def test_modal_reserves_cpu_and_memory_sized_for_the_hardware(no_account: Path) -> None:
    pytest.importorskip("modal")
    from crf.executors.modal import hourly_price, reservation

    assert reservation("A10G:2", None, None) == (8.0, 32768)
    assert reservation(None, None, None) == (2.0, 4096)
    assert reservation("H100", 1.5, 2048) == (1.5, 2048)
    code, out = dry_run("--backend", "modal", "--gpu", "A10G:2", "--replicas", "3")
    assert code == 0, out
    plan = rows(out)
    assert plan["hardware"] == "2x A10G"
    assert plan["cpu and memory"].startswith("8 CPU core(s), 32 GiB reserved (crf's default")
    assert f"${hourly_price('A10G:2', 8, 32768):.2f}/h per replica" in plan["cost"]
    code, out = dry_run("--backend", "modal", "-o", "cpu=2", "-o", "memory_mb=3072")
    assert rows(out)["cpu and memory"] == "2 CPU core(s), 3 GiB reserved"


def test_spot_is_priced_as_spot_or_labelled_on_demand(
    no_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crf.executors import sagemaker

    base = ("--backend", "sagemaker", "--region", "us-east-1", "--replicas", "2")
    code, out = dry_run(*base)
    assert code == 0 and rows(out)["cost"] == "$1.41/h per replica, $2.82/h for 2"
    code, out = dry_run(*base, "-o", "spot=true")
    cost = rows(out)["cost"]
    assert cost.startswith("$1.41/h per replica, $2.82/h for 2 (on-demand price; managed spot")
    assert rows(out)["worst case"].endswith("(on-demand price)")
    monkeypatch.setitem(sagemaker.SPOT_HOURLY_USD, "ml.g5.xlarge", 0.5)
    code, out = dry_run(*base, "-o", "spot=true")
    assert rows(out)["cost"].startswith("$0.50/h per replica, $1.00/h for 2 (managed spot price")


def test_the_worst_case_is_timeout_times_rate_times_replicas(no_account: Path) -> None:
    code, out = dry_run("--backend", "hf", "--flavor", "l4x1", "-n", "4", "--timeout", "3600")
    assert code == 0, out
    # the platform's timeout is --timeout plus a 600 s margin: 4200 s x $0.80/h x 4
    assert rows(out)["worst case"] == (
        f"${4200 / 3600 * 0.8 * 4:,.2f}: 4 replica(s) x 1 h 10 min (the timeout that stops "
        "each one) x $0.80/h"
    )
    code, out = dry_run("--backend", "hf", "--flavor", "a10g-small")  # a day by default
    assert rows(out)["worst case"].startswith("$48.00: 2 replica(s) x 24 h")
    code, out = dry_run("--job", "lm")
    assert rows(out)["cost"] == "free (this machine)" and "worst case" not in rows(out)


@pytest.mark.parametrize("width", [80, 120])
def test_the_plan_reads_cleanly_at_80_and_120_columns(no_account: Path, width: int) -> None:
    """Nothing wider than the terminal, no value cut with an ellipsis, the SageMaker image
    broken only after a separator, and the missing AWS credentials said once."""
    from crf.executors.sagemaker import default_image

    code, out = dry_run("--backend", "sagemaker", "--region", "us-east-1",
                        "--store", "s3://bucket/runs", width=width)  # fmt: skip
    assert code == 0, out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width and "…" not in out
    start = next(i for i, line in enumerate(lines) if "│ image" in line)
    pieces = [lines[start].split("│")[2].strip()]
    for line in lines[start + 1 :]:
        key, value = (c.strip() for c in line.split("│")[1:3])
        if key:
            break
        pieces.append(value)
    assert "".join(pieces) == default_image("us-east-1", "ml.g5.xlarge"), pieces
    assert all(p[-1] in "/:-._" for p in pieces[:-1]), pieces
    flat = " ".join(out.split())
    assert flat.count("no AWS credentials") == 1
    assert "no AWS credentials (for SageMaker and the store s3://bucket/runs/" in flat


def test_breakable_splits_long_words_after_separators() -> None:
    uri = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-sagemaker"
    out = breakable(f"image {uri} and more", 50)
    assert out.replace("\n", "") == f"image {uri} and more"
    assert all(len(line) <= 50 for word in out.split(" ") for line in word.split("\n"))
    assert out.split("\n")[0].endswith("amazonaws.com/")
    assert breakable("short words stay", 10) == "short words stay"
    assert breakable("x" * 30, 20) == "x" * 30  # nothing to break at: rich folds it


def test_a_misspelt_hf_flavor_stops_a_dry_run(no_account: Path) -> None:
    code, out = dry_run("--backend", "hf", "--flavor", "l4x5")
    assert code == 2 and "│" not in out
    assert re.match(r"error: unknown HF Jobs flavor 'l4x5'; did you mean l4x4\b", out), out
    code, out = dry_run("--backend", "hf", "--flavor", "a10g-smal")
    assert code == 2 and "did you mean a10g-small" in out
    code, out = dry_run("--backend", "hf", "--flavor", "a10g-small")
    assert code == 0 and "no Hugging Face token" in out  # known: only the token is missing
