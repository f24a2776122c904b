"""bench/gpu.py on a 2-layer model on the CPU: every phase runs through the code a GPU run takes
(the offline model and tokenizer, HF generate, the composer trainer, a 2-replica crf launch),
writes its table, and puts it between docs/performance.md's markers. The GPU's numbers are the
benchmark's business; here it must not rot before a GPU machine runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402


def test_offline_tokenizer_decodes_every_id_of_the_model() -> None:
    tok = gpu.tokenizer_offline(600)
    assert len(tok) == 600
    assert tok.decode([599]) == "<|t599|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    assert tok.decode(ids) == text


def test_update_docs_replaces_only_the_marked_table(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(f"# P\n{gpu.SECTION}\nintro\n{gpu.BEGIN}\nold\n{gpu.END}\nafter\n")
    gpu.update_docs("| new |\n", str(doc))
    assert doc.read_text() == f"# P\n{gpu.SECTION}\nintro\n{gpu.BEGIN}\n| new |\n{gpu.END}\nafter\n"


def test_the_docs_have_the_markers() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    assert gpu.SECTION in text and gpu.BEGIN in text and gpu.END in text


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_run_of_every_phase(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "performance.md", repo / "docs" / "performance.md")
    (repo / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "gpu.py", repo / "bench" / "gpu.py")
    out = tmp_path / "out"
    cmd = [sys.executable, str(repo / "bench" / "gpu.py"), "--tiny", "--out", str(out),
           "--steps", "3", "--sync-every", "3", "--rounds", "2", "--completion", "8",
           "--prompts", "2", "--update-docs"]  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((out / "gpu.json").read_text())
    assert res["errors"] == {}
    assert [g["batch"] for g in res["generate"] if "batch" in g] == [16, 64]
    assert all(g["tokens_per_s"] > 0 for g in res["generate"] if "batch" in g)
    assert res["grpo"]["steps"] == 3 and res["grpo"]["step_s"] > 0
    assert res["grpo"]["learning_rate"] == 1e-6  # TRL's GRPO default, not the toy's
    run = res["crf"]
    assert run["weights_identical"] is True
    assert all(0 <= r["crf_share"] < 1 for r in run["replicas"])
    table = (out / "gpu.md").read_text()
    assert "crf's share of wall time" in table
    assert table in (repo / "docs" / "performance.md").read_text()
