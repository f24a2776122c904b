"""Settings and models every replica would fail on, refused before launch in one line: a
``trl`` setting that needs a package the replicas will not have, ``generation_kwargs``
GenerationConfig refuses, ``assistant_only_loss`` with a chat template that marks no
assistant turns, and tokenizers generation or SFT cannot use."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from crf.replica import trl_settings
from tests.test_cli import crf


def _dry_run(tmp_path: Path, *args: str) -> str:
    """The output of a refused ``crf launch --dry-run`` (one line, nothing written)."""
    result = crf("launch", *args, "--store", str(tmp_path / "runs"), "--dry-run")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "runs").exists()
    return result.output


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_liger_kernel_not_installed_is_refused_locally(tmp_path: Path, job: str) -> None:
    out = _dry_run(tmp_path, "--job", job, "--set", "trl.use_liger_kernel=true")
    assert "trl.use_liger_kernel needs liger-kernel, which is not installed" in out
    assert "pip install liger-kernel" in out


def test_liger_kernel_on_a_cloud_backend_must_be_in_pip() -> None:
    fields = {"use_liger_kernel": True}
    with pytest.raises(trl_settings.SettingError, match="add --pip liger-kernel"):
        trl_settings.check_packages(fields, SimpleNamespace(pip=["scipy"]), local=False)
    trl_settings.check_packages(fields, SimpleNamespace(pip=["Liger_Kernel>=0.5"]), local=False)
    trl_settings.check_packages({"use_liger_kernel": False}, SimpleNamespace(pip=[]), local=True)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"max_new_tokens": "x"}', "GenerationConfig refuses max_new_tokens='x': '<='"),
        ('{"max_new_tokens": 0}', "refuses max_new_tokens=0: `max_new_tokens` must be greater"),
        ("[1, 2]", "trl.generation_kwargs must be a table of GenerationConfig fields"),
    ],
)
def test_generation_kwargs_generation_config_refuses(tmp_path: Path, value: str, says: str) -> None:
    out = _dry_run(tmp_path, "--set", f"trl.generation_kwargs={value}")
    assert says in out


def test_good_generation_kwargs_pass() -> None:
    trl_settings.check_generation_kwargs({"generation_kwargs": {"min_tokens": 2, "top_k": 5}})


def test_zero_completion_tokens_is_the_default() -> None:
    from crf.replica.jobs import job_config

    assert job_config("composer", {"max_completion_length": "0"}).max_completion_length is None
