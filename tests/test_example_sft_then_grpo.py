"""examples/sft-then-grpo, as its README runs it (the four commands through the real CLI, the
config files as shipped), the GRPO run cut to 10 rounds: held-out pass@1 rises in the SFT run
and again in the GRPO run that starts from the exported SFT model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft-then-grpo"


def _crf(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args], cwd=cwd, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_then_export_then_grpo_raise_held_out_pass_at_1(tmp_path: Path) -> None:
    work = tmp_path / "work"
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(work)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    store = ["--store", str(tmp_path / "runs")]
    paths = ["--dataset", str(work / "data")]
    _crf("launch", "-c", str(EXAMPLE / "sft.toml"), "--run-id", "sft", "--model",
         str(work / "base"), *paths, *store, cwd=tmp_path)  # fmt: skip
    _crf("export", "sft", str(work / "sft-model"), *store, cwd=tmp_path)
    _crf("launch", "-c", str(EXAMPLE / "grpo.toml"), "--run-id", "grpo", "--model",
         str(work / "sft-model"), "--rounds", "10", *paths, *store, cwd=tmp_path)  # fmt: skip
    for run in ("sft", "grpo"):
        result = json.loads((tmp_path / "runs" / run / "result.json").read_text())
        assert result["weights_identical"] is True
        held = result["held_out"]
        assert held["after"]["examples"] == held["after"]["of"] == 302
        assert held["pass@1_after"] > held["pass@1_before"], (run, held)
        assert (tmp_path / "runs" / run / "figure.png").is_file()
