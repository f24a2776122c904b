"""A run whose replicas all exit cleanly but never exchange a round is not ``ok``: its
summary and exit code say no round was exchanged and name the likely cause (an entrypoint
that never calls ``DiLoCoHook.step``, as a verl or PRIME-RL program run unchanged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crf.executors.base import ReplicaHandle, ReplicaResult, ReplicaState
from crf.launcher.summary import build_summary
from crf.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]


def _ok(rank: int, result: dict | None = None) -> ReplicaResult:
    handle = ReplicaHandle(backend="local", run_id="idle", rank=rank, backend_id=str(rank),
                           run_uri="memory://idle", world_size=2)  # fmt: skip
    return ReplicaResult(handle=handle, state=ReplicaState.SUCCEEDED, exit_code=0, result=result)


def test_clean_exits_without_a_committed_round_fail_the_run() -> None:
    spec = RunSpec(run_id="idle", run_uri="memory://idle", replicas=2, rounds=3,
                   entrypoint=["python", "train.py"])  # fmt: skip
    summary = build_summary(spec=spec, results=[_ok(0), _ok(1)], started_at=0.0)
    assert summary["status"] == "failed"
    assert summary["error"].startswith("no round was exchanged: 2 replica(s) exited cleanly")
    assert "DiLoCoHook.step" in summary["error"] and "3 round(s)" in summary["error"]
    # a job module (no --entrypoint) is told of ctx.diloco, not of the hook
    job = RunSpec(run_id="idle", run_uri="memory://idle", replicas=2, rounds=3, job="my.job")
    told_job = build_summary(spec=job, results=[_ok(0), _ok(1)], started_at=0.0)["error"]
    assert "ctx.diloco(model, optimizer)" in told_job and "DiLoCoHook" not in told_job
    # one committed round anywhere (a record, or a replica's result) is an exchange
    metrics = {0: [{"round": 0, "committed": True}], 1: []}
    ok = build_summary(spec=spec, results=[_ok(0), _ok(1)], started_at=0.0, metrics=metrics)
    assert ok["status"] == "ok"
    told = build_summary(spec=spec, results=[_ok(0, {"rounds_committed": 3}), _ok(1)],
                         started_at=0.0)  # fmt: skip
    assert told["status"] == "ok"
    # a resumed run that had nothing left to exchange is not blamed
    done = build_summary(spec=spec, results=[_ok(0), _ok(1)], started_at=0.0,
                         resumed_from_round=3)  # fmt: skip
    assert done["status"] == "ok"


def test_clean_exits_without_a_result_are_said_to_lack_hook_close() -> None:
    """Rounds were exchanged (the run is ok), but no replica wrote its result: the script
    never called DiLoCoHook.close(), and the summary says so rather than show empty rows."""
    import io

    from rich.console import Console

    from crf.launcher.summary import render_summary

    spec = RunSpec(run_id="idle", run_uri="memory://idle", replicas=2, rounds=1,
                   entrypoint=["python", "train.py"])  # fmt: skip
    metrics = {r: [{"round": 0, "committed": True}] for r in (0, 1)}
    summary = build_summary(spec=spec, results=[_ok(0), _ok(1)], started_at=0.0,
                            metrics=metrics)  # fmt: skip
    console = Console(width=200, record=True, file=io.StringIO())
    render_summary(summary, console)
    text = console.export_text()
    assert summary["status"] == "ok"
    assert "replica(s) 0, 1 exited cleanly without writing a result: the script never " in text
    assert "DiLoCoHook.close()" in text


@pytest.mark.e2e
def test_an_entrypoint_that_never_calls_the_hook_exits_failed(tmp_path: Path) -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "PYTHONPATH": path, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--backend", "local",
         "--replicas", "2", "--rounds", "2", "--run-id", "idle", "--no-progress",
         "--store", str(tmp_path / "runs"), "--max-restarts", "0",
         "--entrypoint", f"{sys.executable} -c pass"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, None), out
    assert "no round was exchanged" in " ".join(out.split()), out
    result = json.loads((tmp_path / "runs" / "idle" / "result.json").read_text())
    assert result["status"] == "failed" and "DiLoCoHook.step" in result["error"]
