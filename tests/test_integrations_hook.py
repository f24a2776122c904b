"""DiLoCoHook: DiLoCo through the store inside a loop crf does not own.

The end-to-end case runs a plain torchrun script (tests/integrations_scripts/fsdp_loop.py, not
a crf job) as each replica's ``--entrypoint``: 2 replicas x 2 FSDP2 ranks over gloo, each rank
exchanging its own shard. The replicas must end bit-identical, shard by shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hook_results import assert_sharded_replicas_agree

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "tests" / "integrations_scripts" / "fsdp_loop.py"


def _crf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
def test_fsdp_loop_through_the_hook_ends_bit_identical(tmp_path: Path) -> None:
    entry = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 {LOOP}"
    proc = _crf(
        "launch", "--backend", "local", "--replicas", "2", "--sync-every", "3",
        "--rounds", "3", "--run-id", "hooked", "--store", str(tmp_path / "runs"),
        "--entrypoint", entry, "--no-progress", "--max-restarts", "0",
        "--round-timeout", "60", "--timeout", "150",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "hooked"
    assert_sharded_replicas_agree(run, rounds=3, steps=9)
    # the replicas trained on different data, so the rounds did average something
    assert all(m["loss"] is not None for m in map(json.loads, _metrics(run)))


def _metrics(run: Path) -> list[str]:
    return [p.read_text() for p in sorted((run / "metrics").rglob("*.json"))]


def test_an_optimizer_that_is_no_torch_optimizer_is_refused_in_one_line() -> None:
    """e.g. PRIME-RL's CPU-offload optimizers, which wrap one: DiLoCo needs its step hooks."""
    import torch

    from crf.integrations.hook import DiLoCoHook

    class CPUOffloadOptimizer:  # a wrapper with a step(), not a torch.optim.Optimizer
        def step(self) -> None: ...

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got CPUOffloadOptim") as e:
        DiLoCoHook(model, CPUOffloadOptimizer(), environ={})
    assert "\n" not in str(e.value)
