"""The Python SDK does what the CLI does: ``crf.launch(detach=True)``
returns a ``Run`` at once; its status, logs, wait, result and figure work on a real detached
local run (the contract-following replica script of test_cli.py as the entrypoint, so no
training stack is needed); ``crf.attach`` and ``crf.runs`` find it; ``cancel`` ends another;
results are typed and round-trip to the JSON they came from."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import crf
from crf.executors.local import LocalProcessExecutor
from crf.launcher.errors import LaunchError
from crf.results import DryRun, RunResult, RunStatus
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
    # each row's fields are the row's: how it ended, and what it reported itself
    assert [(r.state, r.status) for r in result.replicas] == [("succeeded", "ok")] * 2
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
    # the replicas' progress says what the summary says: cancelled, not failed
    assert [r.state for r in run.status().replicas] == ["cancelled", "cancelled"]
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


#: a tiny real launch: what the refusals below are tried with
SMALL = {"backend": "local", "replicas": 2, "job": "lm", "rounds": 1, "sync_every": 2}


@pytest.mark.parametrize(
    ("args", "keywords", "message"),
    [
        ((), {"restart": 3}, "restart takes a crf.RestartPolicy"),
        (("replicas=2",), {}, "the options argument takes a dict or a RunSpec"),
        ((), {"executor": "local"}, "executor takes an executor object; to choose a backend"),
        ((), {"executor": LocalProcessExecutor}, "(got the class LocalProcessExecutor)"),
        ((), {"backend_options": ["gpu"]}, "backend_options takes a dict"),
        ((), {"run_id": 123}, "run id 123 is invalid"),
        ((), {"store": 123}, "store takes a path or a URI string"),
        ((), {"detach": "yes"}, "detach takes True or False (got str 'yes')"),
        ((), {"secret_values": ["X"]}, "secret_values takes a dict"),
        ((), {"secret_values": {"bad name": "v"}}, "secret_values 'bad name': not a variable"),
        ((), {"secret_values": {"CRF_RANK": "7"}}, "CRF_* variables are crf's own"),
        ((), {"secret_values": {"X": 1}}, "secret_values X: the value must be a string"),
        ((), {"timeout": -1}, "--timeout must be > 0 seconds"),
        ((), {"timeout": math.nan}, "--timeout must be > 0 seconds"),
        ((), {"timeout": "10"}, "--timeout must be > 0 seconds"),
        ((), {"job_config": "hidden_size=16"}, "job_config takes a dict of the job's options, "
                                                "like {'hidden_size': 16}"),
        ((), {"set": ["hidden_size=16"]}, "like {'hidden_size': 16} (got list"),
        ((), {"job_config": {"hidden_size": {"a": 1}}}, "job option hidden_size takes an integer"),
        ((), {"config": "run.toml"}, "crf.launcher.config_file.launch_config("),
        (({"replicas": 3},), {}, "replicas is given twice ('replicas' in the options mapping "
                                 "and 'replicas' as a keyword)"),
        (({"created_at": 1.0, "version": 1},), {}, "created_at, version: recorded in run.json"),
        (({"dry_run": True},), {}, "dry_run is a keyword of crf.launch, not a run option"),
        ((), {"executor": LocalProcessExecutor(), "gpu": "A10G"}, "set them on that executor"),
        ((), {"executor": LocalProcessExecutor(), "backend": "modal"},
         "backend='modal' and executor=LocalProcessExecutor(...) (the local backend) disagree"),
    ],
)  # fmt: skip
def test_a_wrong_keyword_is_one_launch_error_and_nothing_is_written(
    args: tuple[Any, ...], keywords: dict[str, Any], message: str, tmp_path: Path
) -> None:
    store = tmp_path / "runs"
    call = {**SMALL, "run_id": "refused", "store": str(store), **keywords}
    with pytest.raises(LaunchError) as caught:
        crf.dry_run(*args, **call)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(LaunchError) as caught:  # a launch: the same line, nothing written
        crf.launch(*args, **call)
    assert message in str(caught.value)
    assert not store.exists() and crf.runs(store) == []


def test_a_runspecs_run_uri_is_where_its_run_goes(tmp_path: Path) -> None:
    uri = (tmp_path / "elsewhere" / "spec-run").as_uri()
    spec = crf.RunSpec(run_id="spec-run", run_uri=uri, **SMALL)
    assert crf.dry_run(spec).store == "file://" + str(tmp_path / "elsewhere" / "spec-run")
    assert crf.dry_run(spec, store=tmp_path / "elsewhere").run_id == "spec-run"
    with pytest.raises(LaunchError, match="disagree: give one of them"):
        crf.dry_run(spec, store=str(tmp_path / "runs"))
    spec.run_id = 5  # type: ignore[assignment]
    with pytest.raises(LaunchError, match="run id 5 is invalid"):
        crf.dry_run(spec, store=str(tmp_path / "elsewhere"))
    command = crf.RunSpec(run_id="cmd", run_uri=(tmp_path / "cmd").as_uri(),
                          entrypoint=["python", "x.py"], job_config={"lr": 1})  # fmt: skip
    with pytest.raises(LaunchError, match="--set configures crf's built-in jobs"):
        crf.dry_run(command)  # as --set with --entrypoint and no --job
    assert not any(tmp_path.iterdir())


def test_resume_checks_a_stopped_run_with_dry_run_and_writes_nothing(tmp_path: Path) -> None:
    from crf.store import RunStore

    store = RunStore((tmp_path / "runs" / "stopped").as_uri())  # a run whose driver died
    spec = crf.RunSpec(run_id="stopped", run_uri=store.uri, **SMALL).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    plan = crf.resume("stopped", store=tmp_path / "runs", dry_run=True)  # --resume --dry-run
    assert isinstance(plan, DryRun) and plan.run_id == "stopped" and plan.replicas == 2
    assert store.list() == ["run.json"]
    with pytest.raises(LaunchError, match="crf.resume takes no executor"):
        crf.resume("stopped", store=tmp_path / "runs", executor=LocalProcessExecutor())


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> crf.Run:
    """A finished tiny run, launched with a store relative to the working directory then."""
    home = tmp_path_factory.mktemp("sdk-home")
    here = os.getcwd()
    os.chdir(home)
    try:
        run = crf.launch(SMALL, job_config={"hidden_size": 16, "num_layers": 1}, run_id="done",
                         store="relstore", plot=False)  # fmt: skip
    finally:
        os.chdir(here)
    assert isinstance(run, crf.Run) and run.store == str(home / "relstore")
    return run


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda run: run.wait(timeout="1"), "timeout takes seconds, a number >= 0"),
        (lambda run: run.wait(timeout=math.nan), "(got float nan)"),
        (lambda run: run.wait(timeout=1, poll_s=0), "poll_s takes seconds between looks"),
        (lambda run: run.logs(tail="2"), "tail takes an integer >= 0 (got str '2')"),
        (lambda run: run.logs(tail=-1), "tail takes an integer >= 0 (got int -1)"),
        (lambda run: run.logs(rank="0"), "rank takes a replica's rank, an int"),
        (lambda run: crf.runs(run.store, limit="2"), "limit takes an integer >= 1"),
        (lambda run: crf.runs(run.store, limit=0), "limit takes an integer >= 1 (got int 0)"),
        (lambda run: crf.runs(run.store, status="okay"), "unknown status okay (one of: ok,"),
        (lambda run: crf.runs(run.store, status=["ok", 5]), "status takes status names"),
        (lambda run: crf.runs("ftp://h/x"), "cannot list runs in ftp://h/x: store scheme 'ftp'"),
        (lambda run: crf.resume(run.id, store=run.store, restart=3), "restart takes a crf.Rest"),
        (lambda run: crf.resume(run.id, store=run.store, executor=1), "crf.resume takes no exec"),
        (lambda run: crf.resume(run.id, store=run.store, timeout=-1), "--timeout must be > 0"),
    ],
)  # fmt: skip
def test_a_wrong_argument_of_a_run_is_one_launch_error(
    call: Any, message: str, finished: crf.Run
) -> None:
    with pytest.raises(LaunchError) as caught:
        call(finished)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_keeps_its_store_absolute_and_takes_paths(
    finished: crf.Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # elsewhere than the launch: the run is found all the same
    assert finished.result is not None and finished.result.ok
    assert finished.status().status == "ok"
    assert crf.attach("done", store=Path(finished.store)) == finished
    assert [i.run_id for i in crf.runs(Path(finished.store), status="ok", limit=1)] == ["done"]
    assert [rank for rank, _ in finished.logs(rank=1, tail=1)] == [1]
