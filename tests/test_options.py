"""Run options are declared once, on RunSpec (crf.spec.option), and read from there.

The CLI's flags, the driver's launch options, the ranges RunSpec.validate checks, the options
``crf launch --resume`` refuses and the option tables of docs/cli.md (generated from them, see
tests/test_cli_reference.py) all follow the declarations, so a
new option is one declaration plus its use (docs/extending.md, "Add a run option").
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import typer

from crf.launcher import driver
from crf.launcher import plan as launch_plan
from crf.launcher.cli import app
from crf.launcher.errors import LaunchError
from crf.spec import RUN_DEFINING, Option, RunSpec, SpecError, run_options

ROOT = Path(__file__).resolve().parents[1]


def _launch_params() -> dict[str, Any]:
    command = typer.main.get_command(app).commands["launch"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def _reference_rows() -> list[tuple[str, str]]:
    """(flags, default) of each row of the ``crf launch`` option tables in docs/cli.md."""
    section = (ROOT / "docs" / "cli.md").read_text().split("## crf launch", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return [(cells[0], cells[1]) for cells in rows]


def _shown(default: Any) -> str | None:
    """How the reference writes a default (None: nothing to compare, e.g. a generated id)."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, str):
        return f"`{default}`"
    if isinstance(default, int | float):
        return f"{default:g}"
    return None


def _command_line_options() -> list[Option]:
    """Every option a user can set from ``crf launch``: made from its declaration, or (like
    ``--set``) declared by the CLI itself under the option's name."""
    params = _launch_params()
    return [o for o in run_options().values() if o.cli or o.name in params]


def test_every_declared_option_is_a_launch_flag_with_its_default_and_help() -> None:
    params = _launch_params()
    for declared in _command_line_options():
        param = params[declared.name]
        assert declared.flag in param.opts, (declared.name, param.opts)
        assert set(declared.short) <= set(param.opts), (declared.name, param.opts)
        assert param.help == declared.help
        if declared.cli and not (declared.base is dict and declared.cli_type is None):
            assert param.default == declared.default, declared.name
        # (a mapping's flag is a list of KEY=VALUE items, its default filled in by launch)


def test_every_command_line_option_is_in_the_reference_with_its_flag_and_default() -> None:
    rows = _reference_rows()
    for declared in _command_line_options():
        names = [declared.flag, *declared.short]
        pattern = "|".join(rf"(?<![\w-]){re.escape(n)}(?![\w-])" for n in names)
        matching = [(flags, default) for flags, default in rows if re.search(pattern, flags)]
        assert matching, f"{declared.flag} is not in docs/cli.md's option tables"
        (flags, default), *_ = matching
        for name in names:
            assert name in flags, f"docs/cli.md's row for {declared.flag} lacks {name}"
        shown = _shown(declared.default)
        if shown is not None:
            assert shown in default, f"docs/cli.md's default for {declared.flag}: {default!r}"


def test_run_defining_options_come_from_the_declarations() -> None:
    assert set(RUN_DEFINING) == {n for n, o in run_options().items() if o.run_defining}
    assert {"replicas", "sync_every", "rounds", "job", "job_config", "entrypoint"} <= set(
        RUN_DEFINING
    )
    assert "backend" not in RUN_DEFINING
    # every RunSpec field is either a run option or filled in by the driver
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    assert launch_plan._MANAGED == fields - set(run_options())
    assert launch_plan._MANAGED == {
        "run_uri",
        "backend_options",
        "created_at",
        "version",
        "workdir_key",
    }


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("replicas", 0, "--replicas must be an integer >= 1 and at most 1024 (got 0)"),
        ("outer_lr", -1.0, "--outer-lr must be > 0 and finite (got -1.0)"),
        ("outer_momentum", 1.0, "--outer-momentum must be in [0, 1) (got 1.0)"),
        ("min_replicas", 5, "--min-replicas must be between 1 and --replicas=2 (got 5)"),
        ("num_shards", 0, "--num-shards must be an integer >= 1 (got 0)"),
        ("wire_dtype", "fp8", "--wire-dtype 'fp8' is unknown; choose one of float32"),
        ("error_feedback", "yes", "error_feedback must be true or false (got 'yes')"),
        ("wire_dtype", "topk3", "--wire-dtype 'topk3' is unknown; choose one of float32"),
        (
            "sparse_density",
            0.5,
            "--sparse-density must be in [0.005, 0.1] (got 0.5): a sparse wire keeps 0.5% to "
            "10% of each chunk's values",
        ),
        ("sparse_outer", "adam", "--sparse-outer 'adam' is unknown; choose one of sparseloco"),
        ("job_config", [1], "job_config must be a mapping (got [1])"),
    ],
)
def test_declared_ranges_are_checked(field: str, value: Any, message: str) -> None:
    spec = RunSpec(run_id="r", run_uri="memory://x")
    spec.validate()
    setattr(spec, field, value)
    with pytest.raises(SpecError) as caught:
        spec.validate()
    assert message in str(caught.value)


def test_launch_takes_the_options_as_one_mapping_or_a_run_spec(tmp_path: Path) -> None:
    store = str(tmp_path / "runs")
    plan = driver.prepare({"job": "lm", "replicas": 3, "run_id": "m"}, store=store, dry_run=True)
    assert (plan.spec.replicas, plan.spec.sync_every) == (3, RunSpec.sync_every)
    spec = RunSpec(run_id="s", run_uri="ignored", job="lm", rounds=7, wire_dtype="int8")
    plan = driver.prepare(spec, store=store, dry_run=True)
    assert (plan.spec.rounds, plan.spec.wire_dtype, plan.spec.run_id) == (7, "int8", "s")
    assert plan.spec.run_uri.endswith("/runs/s")
    with pytest.raises(LaunchError, match="unknown launch option"):
        driver.prepare({"replica": 3}, store=store, dry_run=True)
    with pytest.raises(LaunchError, match=r"run options go in the first argument.*replicas"):
        driver.launch({"job": "lm"}, store=store, replicas=3)
