"""End to end: `crf launch --backend local` starts real replica processes that meet only
through a file:// store; every replica ends with bit-identical weights and the loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from crf import layout
from crf.replica.context import weights_sha256
from crf.store import RunStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def crf(
    *args: str, cwd: Path, timeout: float = 400, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_launch_local_lm_bit_identical_and_learns(tmp_path: Path) -> None:
    proc = crf(
        "launch",
        "--backend",
        "local",
        "--replicas",
        "3",
        "--job",
        "lm",
        "--sync-every",
        "10",
        "--rounds",
        "4",
        "--run-id",
        "e2e-lm",
        "--store",
        str(tmp_path / "runs"),
        "--no-progress",
        cwd=tmp_path,
        env={"CRF_LOG_LEVEL": "INFO"},  # the replica logs' round lines are checked below
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "e2e-lm"
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok"
    rows = result["replicas"]
    assert len(rows) == 3
    hashes = {r["weights_sha256"] for r in rows}
    assert len(hashes) == 1 and None not in hashes, rows
    assert result["weights_identical"] is True
    for r in rows:
        assert r["exit_code"] == 0 and r["rounds_committed"] == 4
        jm = r["job_metrics"]
        # clearly below the loss at step 0 (ln(vocab) ~ 3.3 for this corpus)
        assert jm["eval_loss_final"] < 0.8 * jm["eval_loss_initial"], jm
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
    # each replica recorded what it ran with: here, the driver's own environment
    from crf.versions import installed_versions

    for rank in range(3):
        res = json.loads((run / "results" / f"{rank}.json").read_text())
        assert res["versions"] == installed_versions() and res["versions"]["torchft"]
        assert isinstance(res["cuda_available"], bool)
    assert "ran trl" not in proc.stdout and "(driver:" not in proc.stdout  # no warning
    # the store holds what docs/design.md says
    assert json.loads((run / "run.json").read_text())["replicas"] == 3
    assert sorted(os.listdir(run / "metrics" / "0")) == ["0.json", "1.json", "2.json", "3.json"]
    parts = layout.global_parts(RunStore(f"file://{run}"), 3)
    assert len(parts) == 3  # one part per participant, the owner of its shard
    # the global checkpoint is plain safetensors files
    assert any(name.startswith("model/") for key in parts for name in load_file(run / key))
    # the trained model came out (the lowest replica that finished wrote run/model/):
    # `crf export` copies it and transformers loads it, with the replicas' final weights
    out = tmp_path / "exported"
    exported = crf("export", "e2e-lm", str(out), "--store", str(tmp_path / "runs"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert weights_sha256(loaded) == result["weights_sha256"] == rows[0]["weights_sha256"]
    assert AutoTokenizer.from_pretrained(out).decode([0, 1]) == " ."
    # the summary table is printed
    assert "e2e-lm" in proc.stdout and "rounds" in proc.stdout.lower()
    # each round's record carries its global model's eval loss; the figure shows it
    record = json.loads((run / "metrics" / "1" / "2.json").read_text())
    assert 0 < record["metrics"]["eval_loss"] < jm["eval_loss_initial"]
    # ... and where its exchange's time went; the lowest participant's records also count
    # the checkpoint snapshots on its training thread
    assert {"encode", "upload", "download", "decode"} <= set(record["phases_s"]), record
    # ... and DiLoCo's own work at the sync (pseudo-gradients, the outer step), in its wait
    assert 0 <= record["phases_s"]["outer"] <= record["sync_s"], record
    writer = [json.loads((run / "metrics" / "0" / f"{r}.json").read_text()) for r in range(4)]
    assert any(w["phases_s"].get("snapshot", 0) > 0 for w in writer), writer
    assert result["figure"] == str(run / "figure.png") and (run / "figure.png").stat().st_size
    # a replica's log: one line per round (what it learned, what the exchange cost), none of
    # torchft's per-sync lines at INFO, no known deprecation noise
    log = (run / "logs" / "replica-1.log").read_text()
    for r in range(4):
        assert f"round {r}: loss " in log
    assert "eval_loss" in log and "committed (3 replicas)" in log
    assert "Syncing" not in log and "Warning" not in log, log


def test_user_entrypoint_joins_the_exchange(tmp_path: Path) -> None:
    """A user's own script, using the SDK, runs under `crf launch --entrypoint`."""
    script = tmp_path / "my_train.py"
    script.write_text(
        "import torch\n"
        "from crf.replica import ReplicaContext\n"
        "with ReplicaContext.from_env() as ctx:\n"
        "    torch.manual_seed(ctx.seed)\n"
        "    model = torch.nn.Linear(8, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "    g = torch.Generator().manual_seed(ctx.data_seed)\n"
        "    with ctx.diloco(model, opt):\n"
        "        while ctx.step < ctx.total_steps:\n"
        "            x = torch.randn(16, 8, generator=g)\n"
        "            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()\n"
        "            opt.zero_grad(); loss.backward(); opt.step()\n"
        "            ctx.log_step(loss=loss.item())\n"
        "    ctx.finish({'final': loss.item()})\n"
    )
    proc = crf(
        "launch",
        "--replicas",
        "2",
        "--sync-every",
        "5",
        "--rounds",
        "3",
        "--entrypoint",
        f"{sys.executable} {script}",
        "--run-id",
        "user-ep",
        "--store",
        str(tmp_path / "runs"),
        "--no-progress",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "runs" / "user-ep" / "result.json").read_text())
    assert result["weights_identical"] is True
    assert all(r["rounds_committed"] == 3 for r in result["replicas"])


JOB_MODULE = """\
import dataclasses

import torch


@dataclasses.dataclass
class Config:
    lr: float = 0.05


def run(ctx, config):
    torch.manual_seed(ctx.seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    g = torch.Generator().manual_seed(ctx.data_seed)
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:
            x = torch.randn(8, 4, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log_step(loss=loss.item())
    return {"ran": __name__, "lr": config.lr}
"""


def test_job_given_by_module_path(tmp_path: Path) -> None:
    """`--job mypkg.myjob`: a job module that crf does not ship, importable where the driver
    and the replicas run (here on PYTHONPATH, which the local backend passes through), is
    validated by the driver, recorded in run.json by its path and run by every replica."""
    src = tmp_path / "src" / "myjobs"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "tiny.py").write_text(JOB_MODULE)
    path = os.pathsep.join(filter(None, [str(src.parent), os.environ.get("PYTHONPATH")]))
    proc = crf(
        "launch",
        "--replicas",
        "2",
        "--job",
        "myjobs.tiny",
        "--set",
        "lr=0.1",
        "--sync-every",
        "4",
        "--rounds",
        "2",
        "--run-id",
        "module-job",
        "--store",
        str(tmp_path / "runs"),
        "--no-progress",
        cwd=tmp_path,
        env={"PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "module-job"
    spec = json.loads((run / "run.json").read_text())
    assert spec["job"] == "myjobs.tiny" and spec["job_config"] == {"lr": 0.1}
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["weights_identical"] is True
    for r in result["replicas"]:
        assert r["exit_code"] == 0 and r["rounds_committed"] == 2
        assert r["job_metrics"] == {"ran": "myjobs.tiny", "lr": 0.1}
