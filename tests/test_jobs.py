"""Jobs are named by a built-in name or by their module path, and imported from that name
(crf.replica.jobs): what the driver validates before launch and each replica runs."""

from __future__ import annotations

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
