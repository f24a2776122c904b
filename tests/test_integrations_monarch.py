"""crf.integrations.monarch: a replica whose local ranks are a Monarch proc mesh.

Each replica's ``--entrypoint`` (tests/integrations_scripts/monarch_replica.py) spawns a
2-process mesh on its host, one ``Learner`` actor on each; the learners join one gloo group
(rank = mesh rank), shard a small model with FSDP2 and call DiLoCoHook after each step, so
each exchanges its own shard with the same learner of the other replica. The replicas must
end bit-identical, shard by shard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hook_results import assert_sharded_replicas_agree

ROOT = Path(__file__).resolve().parents[1]
REPLICA = ROOT / "tests" / "integrations_scripts" / "monarch_replica.py"


@pytest.mark.e2e
@pytest.mark.slow
def test_monarch_learner_mesh_through_the_hook_ends_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("monarch.actor", reason="needs torchmonarch (the monarch extra)")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli",
         "launch", "--backend", "local", "--replicas", "2", "--sync-every", "3",
         "--rounds", "3", "--run-id", "mesh", "--store", str(tmp_path / "runs"),
         "--entrypoint", f"{sys.executable} {REPLICA} 2", "--no-progress",
         "--max-restarts", "0", "--round-timeout", "60", "--timeout", "150"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # two learners per replica, one gloo group, each exchanging its own shard
    assert_sharded_replicas_agree(tmp_path / "runs" / "mesh", rounds=3, steps=9)
