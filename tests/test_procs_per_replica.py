"""A replica of K local ranks (``--procs-per-replica``; crf/replica/local_ranks.py): the
option's default from each backend's hardware, and, on CPU with gloo, 2 replicas x 2 local
ranks that end bit-identical across replicas, match a 2 x 1 run of the same global batch, and
survive a local rank's death (the replica fails and the driver restarts it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from crf.executors.base import ExecutorError, resolve_procs_per_replica
from crf.executors.hf_jobs import HFJobsExecutor, flavor_gpus
from crf.executors.local import LocalProcessExecutor
from crf.executors.modal import ModalExecutor
from crf.executors.sagemaker import instance_gpus
from crf.launcher.cli import app
from crf.replica.local_fsdp import PREPARE, SYNC, action_at
from crf.replica.local_ranks import LocalGroup
from tests.fake_job import register_fake_job
from tests.fault_helpers import describe, launch_lm

#: the largest |w(2 x 2) - w(2 x 1)| allowed over every final weight. DDP (and FSDP's
#: reduce-scatter) averages the two half-batch gradients (a sum in another order than one
#: full-batch backward), so each inner step's gradient differs by a few fp32 ulps (~1e-7 of
#: it); AdamW divides by sqrt(v) and can turn such a difference into one of up to 2 x lr
#: where a gradient is near zero, but over the run's 6 steps that stays far below 1e-5
#: (measured: 5e-8 on weights of size ~1, DDP and FSDP alike)
WEIGHT_ATOL = 1e-5


@dataclass
class _Knobs:
    size: int = 1


def test_default_is_the_gpus_of_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [flavor_gpus(f) for f in ("cpu-basic", "a10g-small", "l4x4", "a10g-largex2")] == [
        0,
        1,
        4,
        2,
    ]
    assert flavor_gpus("newgpux3") == 3  # a flavor newer than the catalog: its name's tail
    assert [instance_gpus(t) for t in ("ml.m5.large", "ml.g5.xlarge", "ml.g5.12xlarge")] == [
        0,
        1,
        4,
    ]
    assert ModalExecutor(gpu="H100:2").gpus_per_replica() == 2
    assert ModalExecutor().gpus_per_replica() == 0
    assert resolve_procs_per_replica(None, ModalExecutor(gpu="H100:2"), None, "lm") == 2
    assert resolve_procs_per_replica(None, HFJobsExecutor(flavor="l4x4"), None, "lm") == 4
    assert resolve_procs_per_replica(None, LocalProcessExecutor(), None, "lm") == 1  # CPU
    assert resolve_procs_per_replica(3, LocalProcessExecutor(), None, "lm") == 3
    assert resolve_procs_per_replica(None, ModalExecutor(gpu="H100:2"), None, "composer") == 2
    # a job that trains on one process, or an own command, keeps one process per replica
    one = register_fake_job(monkeypatch, _Knobs, "oneproc")
    assert resolve_procs_per_replica(None, ModalExecutor(gpu="H100:2"), None, one) == 1
    assert resolve_procs_per_replica(None, ModalExecutor(gpu="H100:2"), ["python", "x"], "lm") == 1
    with pytest.raises(ExecutorError, match="oneproc.*leave --procs-per-replica out"):
        resolve_procs_per_replica(2, LocalProcessExecutor(), None, one)
    with pytest.raises(ExecutorError, match="own --entrypoint"):
        resolve_procs_per_replica(2, LocalProcessExecutor(), ["python", "x"], "lm")


def test_the_dry_run_plan_shows_k(tmp_path: Path) -> None:
    base = ["launch", "--job", "lm", "--store", str(tmp_path), "--run-id", "p", "--dry-run"]
    out = CliRunner().invoke(app, [*base, "--procs-per-replica", "2"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "procs per replica" in out.output and "2 local ranks" in out.output
    fsdp = [*base, "--procs-per-replica", "2", "--local-parallel", "fsdp"]
    out = CliRunner().invoke(app, fsdp, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "2 local ranks (FSDP2 inside each replica" in out.output
    out = CliRunner().invoke(app, [*base, "--local-parallel", "zero3"])
    assert out.exit_code != 0 and "--local-parallel" in out.output and "fsdp" in out.output
    out = CliRunner().invoke(app, [*base, "--procs-per-replica", "0"])
    assert out.exit_code != 0 and "--procs-per-replica must be an integer between 1" in out.output


def test_each_local_rank_gets_its_own_slice_of_the_replica_batch() -> None:
    batch = torch.arange(8).reshape(8, 1)
    parts = [LocalGroup(rank, 2).part(batch) for rank in range(2)]
    assert torch.equal(torch.cat(parts), batch)  # together: the replica's batch, once
    with pytest.raises(ValueError, match="multiple of --procs-per-replica"):
        LocalGroup(0, 3).part(batch)


def test_fsdp_gathers_the_weights_where_diloco_reads_them() -> None:
    """The steps at which every local rank gathers the full weights onto rank 0 (the mirror
    DiLoCo wraps): a sync every H / fragments steps, and with a fragment sync delay d also d
    steps before it, where the fragment's exchange starts; no other step pays for it."""
    plain = SimpleNamespace(sync_period=3, fragment_sync_delay=0)
    assert [action_at(s, plain) for s in range(1, 7)] == [None, None, SYNC, None, None, SYNC]
    streaming = SimpleNamespace(sync_period=4, fragment_sync_delay=1)
    assert [action_at(s, streaming) for s in range(1, 9)] == [
        None, None, PREPARE, SYNC, None, None, PREPARE, SYNC,
    ]  # fmt: skip


def _final(run: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Each replica's weights_sha256, and the final model the run saved (model/)."""
    hashes = [json.loads((run / "results" / f"{r}.json").read_text())["weights_sha256"]
              for r in range(2)]  # fmt: skip
    return hashes, load_file(run / "model" / "model.safetensors")


def _two_by_two_with_a_kill(base: Path, run_id: str, mode: str, common: dict) -> dict:
    """A 2 x 2 run whose replica 0 loses its local rank 1 at inner step 5 (round 1)."""
    summary = launch_lm(
        base,
        run_id,
        procs_per_replica=2,
        local_parallel=mode,
        round_timeout_s=180.0,  # the others wait for the restarted replica in round 0
        env={"CRF_FAULT": "rank=0,point=inner_step,step=5,local_rank=1"},
        **common,
    )
    assert summary["status"] == "ok", summary
    assert summary["weights_identical"] is True
    dead = summary["replicas"][0]
    assert dead["restarts"] == 1 and any(a["exit_code"] == 1 for a in dead["attempts"]), dead
    # the other replica waits for the restarted one, and lives on (a death costs one wait)
    log = base / run_id / "logs" / "replica-1.log"
    tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
    assert summary["replicas"][1]["restarts"] == 0, "\n".join([describe(summary), *tail])
    assert dead["resumed_from"] == 0, dead  # global/0, written before the kill
    for r in range(2):  # each result says how many processes trained the replica
        assert json.loads((base / run_id / "results" / f"{r}.json").read_text())["local_ranks"] == 2
    return summary


@pytest.mark.slow
def test_two_replicas_of_two_local_ranks_match_two_of_one(tmp_path: Path) -> None:
    """2 x 2 (gloo) vs 2 x 1 on the same global batch (batch_size 8: 4 rows per local rank),
    with DDP and with FSDP2 inside each replica. Replica 0's local rank 1 is killed at inner
    step 5 (round 1): the replica fails (its other local rank is ended by the launcher), the
    driver restarts it, its local rank 0 resumes from global/0 and its own inner state
    (FSDP: the full state it gathered) and hands both to local rank 1, and the run ends as
    one without the kill would (the other replica waits for it: min_replicas)."""
    common = {"replicas": 2, "sync_every": 3, "rounds": 2, "min_replicas": 2}
    runs = tmp_path / "runs"
    four = {mode: _two_by_two_with_a_kill(runs, mode, mode, common) for mode in ("ddp", "fsdp")}
    two = launch_lm(runs, "one", round_timeout_s=60.0, **common)
    assert two["status"] == "ok", two

    hashes2, w2 = _final(runs / "one")
    assert len(set(hashes2)) == 1
    for run_id in ("ddp", "fsdp"):
        hashes4, w4 = _final(runs / run_id)
        assert len(set(hashes4)) == 1, run_id  # bit-identical across replicas
        assert w4.keys() == w2.keys()
        worst = max(float((w4[k] - w2[k]).abs().max()) for k in w4)
        assert worst <= WEIGHT_ATOL, (run_id, worst)
    # one rank per replica exchanged: the store bytes of one process (the small JSON records
    # beside the tensors differ by a few bytes: timings, ids); the restarted replica 0's
    # result is its last attempt's, which synced one round of the two
    for mode, r, share in [(m, r, share) for m in four for r, share in ((0, 0.5), (1, 1.0))]:
        up4, up2 = four[mode]["replicas"][r]["bytes_up"], share * two["replicas"][r]["bytes_up"]
        assert abs(up4 - up2) <= 0.01 * up2, (mode, r, up4, up2)


_AGENT = """
import os, subprocess, sys, time
env = dict(os.environ, CRF_LOCAL_WORKER=str(os.getpid()))
code = "from crf.replica.local_ranks import die_with_agent; die_with_agent(); import time; " \\
       "print('armed', flush=True); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's parent-death signal")
def test_a_local_rank_does_not_outlive_its_agent() -> None:
    """The launcher starts workers in sessions of their own (a killpg of the replica misses
    them): a SIGKILLed agent still takes its local ranks with it."""
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(agent.stdout.readline())
    finally:
        agent.kill()
        agent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
