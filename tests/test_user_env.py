"""``--env`` and ``--secret``: checked and read before launch, only names written. The
end-to-end side (the replica sees the value; no run file, log or describe call
holds it, on every backend) is in tests/test_secret_logs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crf.launcher import driver
from crf.launcher.errors import LaunchError
from crf.launcher.resume import prepare_resume
from crf.launcher.user_env import resolve_secrets
from crf.spec import RunSpec

VALUE = "hf_user_token_0123456789abcdef"


def _prepare(tmp_path: Path, dry_run: bool = True, **options: object) -> driver.Plan:
    opts = {"job": "lm", "replicas": 1, "rounds": 1, "run_id": "u", **options}
    return driver.prepare(opts, store=str(tmp_path / "runs"), dry_run=dry_run)


def test_secret_values_are_read_at_launch_from_the_environment_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_TOKEN", VALUE)
    key_file = tmp_path / "key.txt"
    key_file.write_text("from-a-file-0123\n")  # `echo KEY > file` adds the newline
    plan = _prepare(
        tmp_path, secrets=["MY_TOKEN", f"FILE_KEY=@{key_file}"], env={"PROJECT": "grpo"}
    )
    assert plan.secret_env == {"MY_TOKEN": VALUE, "FILE_KEY": "from-a-file-0123"}
    assert plan.spec.env == {"PROJECT": "grpo"}
    written = plan.spec.to_json()  # what run.json holds: names and @path, never a value
    assert VALUE not in written and "from-a-file" not in written
    assert json.loads(written)["secrets"] == ["MY_TOKEN", f"FILE_KEY=@{key_file}"]
    assert VALUE not in repr(plan)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"secrets": ["NOT_SET_ANYWHERE"]},
            "--secret NOT_SET_ANYWHERE: not set in this environment; export it or use "
            "NOT_SET_ANYWHERE=@file",
        ),
        ({"secrets": ["K=@/nonexistent/key"]}, r"--secret K=@/nonexistent/key: cannot read"),
        ({"secrets": ["K=plain-value"]}, "give the name only"),
        ({"secrets": ["CRF_RANK"]}, "CRF_\\* variables are crf's own"),
        ({"env": {"CRF_RUN_URI": "x"}}, "--env CRF_RUN_URI: CRF_\\*"),
        ({"env": {"BAD NAME": "x"}}, "--env 'BAD NAME': not a variable name"),
        ({"env": {"A": 1}}, "--env A: the value must be a string"),
        ({"env": {"A": "1"}, "secrets": ["A"]}, "A is given twice"),
        ({"env": "A=1"}, "env must be a mapping"),
    ],
)
def test_bad_env_and_secrets_fail_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict, message: str
) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    monkeypatch.setenv("A", "set-in-the-environment")
    with pytest.raises(LaunchError, match=message):
        _prepare(tmp_path, dry_run=False, **options)
    assert not (tmp_path / "runs" / "u").exists()


def test_a_dry_run_lists_secrets_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unset --secret is a missing credential: a dry run lists it (after the plan) where a
    launch stops on it; a malformed one is bad input either way."""
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    plan = _prepare(tmp_path, secrets=["NOT_SET_ANYWHERE"])
    assert plan.missing == [
        "--secret NOT_SET_ANYWHERE: not set in this environment; export it or use "
        "NOT_SET_ANYWHERE=@file"
    ]
    with pytest.raises(LaunchError, match="CRF_\\* variables are crf's own"):
        _prepare(tmp_path, secrets=["CRF_RANK"])


def test_an_empty_variable_or_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMPTY", "")
    with pytest.raises(LaunchError, match="--secret EMPTY: empty in this environment"):
        _prepare(tmp_path, dry_run=False, secrets=["EMPTY"])
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(LaunchError, match="is empty"):
        _prepare(tmp_path, dry_run=False, secrets=[f"E=@{tmp_path / 'empty'}"])


@pytest.mark.parametrize(
    ("run_uri", "name"),
    [
        ("hf://buckets/me/b/runs/u", "HF_TOKEN"),
        ("s3://bucket/runs/u", "AWS_SECRET_ACCESS_KEY"),
        ("gs://bucket/runs/u", "GOOGLE_APPLICATION_CREDENTIALS"),
    ],
)
def test_the_stores_own_credentials_are_refused(run_uri: str, name: str) -> None:
    """crf passes them itself; a second value under the same name would fight it."""
    spec = RunSpec(run_id="u", run_uri=run_uri, secrets=[name])
    with pytest.raises(LaunchError, match=f"--secret {name}: {name} is a credential of the"):
        resolve_secrets(spec, {name: "whatever-value"})
    # another store's credential is a user's secret like any other (a gated model's token)
    other = RunSpec(run_id="u", run_uri="file:///tmp/runs/u", secrets=[name])
    assert resolve_secrets(other, {name: "whatever-value"}) == {name: "whatever-value"}


def test_resume_reads_the_secret_values_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.json keeps the names; a resume reads the values anew (a rotated token is used)
    and refuses to start when one is gone."""
    store = tmp_path / "runs"
    spec = RunSpec(run_id="r", run_uri=(store / "r").as_uri(), job="lm", replicas=1,
                   secrets=["MY_TOKEN"], env={"PROJECT": "grpo"})  # fmt: skip
    (store / "r").mkdir(parents=True)
    (store / "r" / "run.json").write_text(spec.to_json())
    monkeypatch.setenv("MY_TOKEN", "rotated-token-0123")
    plan = prepare_resume("r", store=str(store))
    assert plan.secret_env == {"MY_TOKEN": "rotated-token-0123"}
    assert plan.spec.env == {"PROJECT": "grpo"}
    monkeypatch.delenv("MY_TOKEN")
    with pytest.raises(LaunchError, match="--secret MY_TOKEN: not set in this environment"):
        prepare_resume("r", store=str(store))


def test_the_secret_flag_is_repeatable_and_fails_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``crf launch --secret A --secret B=@file``, made from the declaration (cli.py builds
    list options as repeatable flags); the dry run shows no value."""
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    monkeypatch.setenv("MY_TOKEN", VALUE)
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    (tmp_path / "key").write_text("from-a-file-0123")
    base = ["launch", "--job", "lm", "--store", str(tmp_path / "runs"), "--dry-run"]
    runner = CliRunner()
    ok = runner.invoke(app, [*base, "--secret", "MY_TOKEN", "--secret", f"K=@{tmp_path / 'key'}"])
    assert ok.exit_code == 0, ok.output
    assert VALUE not in ok.output and "from-a-file" not in ok.output
    assert "MY_TOKEN, K" in " ".join(ok.output.split())  # the plan names them, no value
    bad = [*base, "--secret", "MY_TOKEN", "--secret", "NOT_SET_ANYWHERE"]
    listed = runner.invoke(app, bad)  # a dry run lists it after the plan
    assert listed.exit_code == 0, listed.output
    assert "--secret NOT_SET_ANYWHERE: not set in this environment" in listed.output
    assert runner.invoke(app, [*bad, "--strict"]).exit_code == 2
    launch = runner.invoke(app, [a for a in bad if a != "--dry-run"])  # a launch stops on it
    assert launch.exit_code == 2
    assert "--secret NOT_SET_ANYWHERE: not set in this environment" in launch.output
    assert not (tmp_path / "runs").exists()


def test_local_replicas_get_env_plain_and_secrets_hidden_also_after_a_relaunch(
    tmp_path: Path,
) -> None:
    """The local backend: ``plain_env`` is ordinary environment (printed as is), ``env`` is
    secret (the replica's log shows ``***``), and a relaunch of the rank gets both again."""
    import sys

    from crf.executors.local import LocalProcessExecutor

    ex = LocalProcessExecutor()
    code = "import os; print('saw', os.environ['PROJECT'], os.environ['MY_TOKEN'], flush=True)"
    (h,) = ex.launch_replicas(1, [sys.executable, "-c", code], env={"MY_TOKEN": VALUE},
                              plain_env={"PROJECT": "grpo-plain"},
                              run_uri=str(tmp_path / "runs" / "r"))  # fmt: skip
    assert ex.wait([h], timeout=60)
    again = ex.relaunch(h)
    assert ex.wait([again], timeout=60)
    lines = [line for line in ex.logs(again) if line.startswith("saw")]
    assert lines == ["saw grpo-plain ***", "saw grpo-plain ***"], lines
