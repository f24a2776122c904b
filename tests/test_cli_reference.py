"""docs/cli.md is generated from the declarations (crf/launcher/cli_reference.py): the committed
page must be exactly what the code generates now, so a new or changed option or command shows
up in the reference or fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from crf.launcher.cli import app
from crf.launcher.cli_reference import reference

ROOT = Path(__file__).resolve().parents[1]


def test_committed_cli_reference_is_the_generated_one() -> None:
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == reference(), (
        "docs/cli.md is stale: run `python -m crf.launcher.cli_reference > docs/cli.md`"
    )


def test_every_command_and_option_is_in_the_reference() -> None:
    text = reference()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        assert f"## crf {name}\n" in text
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                assert f"`{param.opts[0]}" in text, (name, param.opts)


def test_the_module_prints_the_page() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli_reference"], cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout == reference()
