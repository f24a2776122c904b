"""crf/resumed_options.py: the options a run holds now are its run.json's, as its resumes
changed them; only the limits a resume may change, and only through launch records."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from crf import layout
from crf.launcher.cli import app
from crf.resumed_options import apply, changed_since_launch, with_changes
from crf.spec import AT_RESUME, RUN_DEFINING, RunSpec, SpecError
from crf.store import RunStore


def _spec(tmp_path) -> RunSpec:
    return RunSpec(run_id="r", run_uri=str(tmp_path / "r")).validate()


def test_the_newest_change_of_each_option_holds(tmp_path) -> None:
    store = RunStore(str(tmp_path / "r"))
    spec = _spec(tmp_path)
    store.put_json(layout.launch_key(0), {"launch": 0})
    store.put_json(layout.launch_key(1), {"launch": 1, "changed": {"reward_timeout": 60.0}})
    store.put_json(
        layout.launch_key(2),
        {"launch": 2, "changed": {"round_timeout_s": 90.0, "rounds": 99}},  # rounds: not one
    )
    store.put(layout.launch_key(3), b"{torn")  # an unreadable record changes nothing
    assert changed_since_launch(store) == {"reward_timeout": 60.0, "round_timeout_s": 90.0}
    now = with_changes(store, spec)
    assert (now.reward_timeout, now.round_timeout_s, now.rounds) == (60.0, 90.0, spec.rounds)
    store.put_json(layout.launch_key(4), {"launch": 4, "changed": {"reward_timeout": 0}})
    assert with_changes(store, spec).reward_timeout == 0


def test_only_the_limits_on_waiting_may_change_and_within_range(tmp_path) -> None:
    assert set(AT_RESUME) == {"reward_timeout", "round_timeout_s", "rollout_grace"}
    assert not set(AT_RESUME) & set(RUN_DEFINING)
    spec = _spec(tmp_path)
    with pytest.raises(SpecError, match="--reward-timeout"):
        apply(spec, {"reward_timeout": -1})
    with pytest.raises(ValueError, match="rounds"):
        apply(spec, {"rounds": 3})


def test_resume_still_refuses_the_options_that_define_a_run(tmp_path) -> None:
    result = CliRunner().invoke(
        app, ["launch", "--resume", "r", "--rounds", "3", "--reward-timeout", "60",
              "--store", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "--rounds cannot be combined with --resume" in said, said
    assert "--reward-timeout" not in said.split("cannot")[0], said


def test_the_sdk_resume_takes_the_limits_and_refuses_the_rest(tmp_path) -> None:
    import crf
    from crf.launcher.errors import LaunchError

    with pytest.raises(LaunchError, match=r"^rounds cannot be combined with resume"):
        crf.resume("r", store=str(tmp_path), rounds=3, reward_timeout=60)
    with pytest.raises(LaunchError, match="nothing to resume at"):
        crf.resume("r", store=str(tmp_path), reward_timeout=60)


def test_a_resumes_dry_run_says_where_it_continues_and_what_it_changes(tmp_path) -> None:
    base = tmp_path / "runs"
    store = RunStore(f"file://{base}/old")
    spec = RunSpec(run_id="old", run_uri=store.uri, job="lm", replicas=2).validate()
    store.put_if_absent(layout.RUN_SPEC, spec.to_json().encode())
    result = CliRunner().invoke(
        app, ["launch", "--store", str(base), "--resume", "old", "--reward-timeout", "1800",
              "--dry-run"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.replace("│", " ").split())
    assert "resume starts over (the run committed no round), as launch 1" in said, said
    assert "--reward-timeout 1800 from this launch on" in said, said
    assert layout.launch_numbers(store) == []  # a dry run writes nothing
