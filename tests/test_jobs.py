"""Jobs are named by a built-in name or by their module path, and imported from that name
(crf.replica.jobs): what the driver validates before launch and each replica runs."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from crf.replica.jobs import JOBS, get_job, job_config

JOB = """\
import dataclasses


@dataclasses.dataclass
class Config:
    steps: int = 3

    def validate(self):
        if self.steps < 1:
            raise ValueError("steps must be >= 1")


def run(ctx, config):
    return {}
"""


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package folder on sys.path, forgotten (with its modules) after the test."""
    pkg = tmp_path / "userjobs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "userjobs" or n.startswith("userjobs.")]:
        monkeypatch.delitem(sys.modules, name)
    yield pkg
    for name in [n for n in sys.modules if n == "userjobs" or n.startswith("userjobs.")]:
        del sys.modules[name]


def test_builtin_jobs_by_name() -> None:
    for name, module in JOBS.items():
        assert get_job(name).__name__ == module


def test_a_job_by_module_path_is_imported_and_validated(on_path: Path) -> None:
    (on_path / "good.py").write_text(JOB)
    assert get_job("userjobs.good").__name__ == "userjobs.good"
    assert job_config("userjobs.good", {"steps": "5"}).steps == 5
    with pytest.raises(ValueError, match="steps must be >= 1"):
        job_config("userjobs.good", {"steps": 0})


def test_a_module_that_is_not_there_or_not_a_job_is_refused(on_path: Path) -> None:
    with pytest.raises(ValueError, match="no module 'userjobs.absent' can be imported"):
        get_job("userjobs.absent")
    with pytest.raises(ValueError, match="no module 'nosuchpkg.job' can be imported"):
        get_job("nosuchpkg.job")
    (on_path / "notajob.py").write_text("Config = dict\n")
    with pytest.raises(ValueError, match="is not a job .*no run"):
        get_job("userjobs.notajob")
    with pytest.raises(ValueError, match="unknown job 'nope'; available jobs:"):
        get_job("nope")


def test_a_job_missing_a_dependency_says_which(on_path: Path) -> None:
    (on_path / "needs.py").write_text("import crf_no_such_dependency\n" + JOB)
    with pytest.raises(ModuleNotFoundError, match="crf_no_such_dependency"):
        get_job("userjobs.needs")


def test_a_typo_or_a_folder_off_the_path_is_named(
    on_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (on_path / "good.py").write_text(JOB)
    with pytest.raises(ValueError, match=r"imported here \(did you mean userjobs.good\?\)"):
        get_job("userjobs.god")
    monkeypatch.chdir(tmp_path)  # ./userjobs is here; the crf program does not import from
    monkeypatch.delitem(sys.modules, "userjobs")  # the current folder by itself
    # nor from the current folder by its other names ('' in a worker process's path)
    here = ("", ".", str(tmp_path))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in here])
    with pytest.raises(ValueError, match=r"\(./userjobs is here but not on the path: PYTHONPA"):
        get_job("userjobs.good")


def test_a_config_that_is_not_a_dataclass_is_refused_in_one_line(on_path: Path) -> None:
    (on_path / "plain.py").write_text("class Config:\n    lr = 0.1\n\n\ndef run(ctx, c): ...\n")
    with pytest.raises(ValueError, match="its Config is not a dataclass; decorate it with @"):
        job_config("userjobs.plain", {})


def test_a_job_that_returns_no_dict_keeps_what_it_returned() -> None:
    """The contract asks for a dict; a job returning its last loss trained all the same, and
    its result keeps the value (the driver's summary reads job_metrics as a dict)."""
    from crf.replica.context import job_metrics_of

    assert job_metrics_of(None) == {}
    assert job_metrics_of({"a": 1}) == {"a": 1}
    assert job_metrics_of(0.25) == {"result": 0.25}


def test_a_summary_of_results_whose_job_metrics_are_no_dict_still_renders() -> None:
    import io

    from rich.console import Console

    from crf.executors.base import ReplicaHandle, ReplicaResult, ReplicaState
    from crf.launcher.summary import replica_row, replica_table

    handle = ReplicaHandle("local", "r", 0, "1", "file:///x", 1)
    result = {"status": "ok", "rounds_committed": 1, "final_loss": 1.0, "job_metrics": 0.25}
    row = replica_row(ReplicaResult(handle, ReplicaState.SUCCEEDED, 0, result), rounds=1)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(replica_table({"run_id": "r", "rounds": 1, "replicas": [row]}))
    assert "ok (0)" in console.export_text()


def test_a_job_stepping_past_the_last_step_is_refused_before_it_syncs(tmp_path: Path) -> None:
    """A job whose loop runs past ctx.total_steps would sync a round the run never asked
    for; the step is refused (a ContractError: no restart is for it) before it syncs."""
    import torch

    from crf import layout
    from crf.replica.context import ContractError, ReplicaContext
    from crf.spec import RunSpec
    from crf.store import RunStore

    uri = f"file://{tmp_path}/run"
    spec = RunSpec(run_id="own", run_uri=uri, replicas=1, rounds=1, sync_every=1)
    RunStore(uri).put(layout.RUN_SPEC, spec.validate().to_json().encode())
    ctx = ReplicaContext.from_env({"CRF_RUN_URI": uri, "CRF_RANK": "0", "CRF_WORLD_SIZE": "1"})
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ContractError, match=r"after ctx.step reached ctx.total_steps \(1: --r"):
        with ctx, ctx.diloco(model, opt):
            for _ in range(2):  # one step too many
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
    assert ctx.step == 1 and not (tmp_path / "run" / "rounds" / "1").exists()
    result = json.loads((tmp_path / "run" / "results" / "0.json").read_text())
    assert result["restartable"] is False
