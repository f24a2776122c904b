"""The Python SDK does what the CLI does: ``crf.launch(detach=True)``
returns a ``Run`` at once; its status, logs, wait, result and figure work on a real detached
local run (the contract-following replica script of test_cli.py as the entrypoint, so no
training stack is needed); ``crf.attach`` and ``crf.runs`` find it; ``cancel`` ends another;
results are typed and round-trip to the JSON they came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import crf
from crf.results import RunResult, RunStatus
from tests.test_cli import REPLICA_SCRIPT


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "my_train.py"
    path.write_text(REPLICA_SCRIPT)
    return path


def _options(script: Path, run_id: str) -> dict:
    return {"run_id": run_id, "job": "lm", "replicas": 2, "rounds": 3,
            "entrypoint": [sys.executable, str(script)]}  # fmt: skip


def test_detached_run_round_trip(tmp_path: Path, script: Path) -> None:
    base = str(tmp_path / "runs")
    run = crf.launch(_options(script, "sdk"), store=base, detach=True)
    assert isinstance(run, crf.Run) and run.id == "sdk" and run.store == base

    status = run.status()
    assert isinstance(status, RunStatus) and status.run_id == "sdk"
    assert [r.rank for r in status.replicas] == [0, 1]

    result = run.wait(timeout=120)
    assert isinstance(result, RunResult) and result.ok and result.status == "ok"
    assert [r.rank for r in result.replicas] == [0, 1] and result.replicas[0].ok
    assert result.weights_identical is True
    on_disk = json.loads((tmp_path / "runs" / "sdk" / "result.json").read_text())
    assert result.to_dict() == on_disk  # typed, and nothing lost
    assert RunResult.from_dict(on_disk).to_dict() == on_disk
    assert run.result == result and run.status().result == result
    assert run.figure == str(tmp_path / "runs" / "sdk" / "figure.png")
    assert Path(run.figure).read_bytes()[:4] == b"\x89PNG"

    lines = list(run.logs())
    assert (0, "replica 0 running job lm with {}") in lines
    assert list(run.logs(rank=1, tail=1)) == [line for line in lines if line[0] == 1][-1:]

    again = crf.attach("sdk", store=base)
    assert again == run and again.result == result
    (info,) = crf.runs(store=base)
    assert info.run_id == "sdk" and info.status == "ok" and info.replicas == 2
    assert crf.runs(store=base, status="failed") == []
    with pytest.raises(crf.launcher.errors.LaunchError, match="no run 'nope'"):
        crf.attach("nope", store=base)


def test_wait_times_out_and_cancel_ends_a_run(tmp_path: Path, script: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLEEP_RANKS", "0,1")  # the replicas inherit it: they never finish
    base = str(tmp_path / "runs")
    run = crf.launch(_options(script, "long"), store=base, detach=True)
    with pytest.raises(TimeoutError, match="still running"):
        run.wait(timeout=1, poll_s=0.2)
    result = run.cancel()
    assert result is not None and result.status == "cancelled"
    assert run.wait(timeout=30).status == "cancelled"


def test_a_blocking_launch_returns_the_finished_run(tmp_path: Path, script: Path) -> None:
    run = crf.launch(_options(script, "blocking"), store=str(tmp_path / "runs"))
    assert run.result is not None and run.result.ok


def test_the_api_is_what_dir_shows_and_executors_import_lazily() -> None:
    names = dir(crf)
    assert "launch" in names and "Run" in names and "ModalExecutor" in names
    assert "Any" not in names and "importlib" not in names
    probe = (
        "import sys; import crf.executors; assert 'modal' not in sys.modules; "
        "from crf.executors import ModalExecutor, SageMakerExecutor, HFJobsExecutor; "
        "from crf.executors import LocalProcessExecutor; print(ModalExecutor.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ModalExecutor", out.stderr
