"""docs/cli.md, generated from the declarations: the typer app's commands and options, and for
``crf launch`` the run options declared on RunSpec (crf/spec.py). A reference written from the
code cannot drift from it; tests/test_cli_reference.py checks that the committed page is this
text. Regenerate with ``python -m crf.launcher.cli_reference > docs/cli.md``."""

from __future__ import annotations

import sys
from typing import Any

import typer

from crf.spec import run_options

_HEADER = """\
# Command-line reference

Every `crf` command with its arguments and options, generated from the code's declarations
(`python -m crf.launcher.cli_reference > docs/cli.md`; a test checks that this page is up to
date). `crf COMMAND --help` prints the same. The run options of `crf launch` are the same
names in a config file (`-c`) and in the SDK (`crf.launch(...)`): the field name
(`round_timeout_s`) or the flag's name (`round-timeout`), with `-` or `_` alike.
"""


#: metavars that only name the value's type: the flag alone says as much
_TYPE_NAMES = {"TEXT", "INTEGER", "FLOAT", "BOOLEAN", "PATH"}


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(param: Any, declared: Any) -> str:
    """The default as the table writes it: on/off for a switch, `text` for a string."""
    value = declared.default if declared is not None else param.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == [] or value == () or value == {}:
        return ""
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int | float):
        return f"{value:g}"
    return _cell(str(value))


def _range(param: Any) -> str:
    """`` (>= 0.2)`` for an option whose type bounds it, as ``--help`` shows it."""
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is None and high is None:
        return ""
    if high is None:
        return f" (>= {low:g})"
    if low is None:
        return f" (<= {high:g})"
    return f" ({low:g} to {high:g})"


def _names(param: Any) -> str:
    names = [*param.opts, *getattr(param, "secondary_opts", [])]
    metavar = getattr(param, "metavar", None)
    shown = [f"`{n}`" for n in names]
    if metavar and metavar not in _TYPE_NAMES and not getattr(param, "is_flag", False):
        shown[0] = f"`{names[0]} {metavar}`"
    return ", ".join(shown)


def _options_table(params: list[Any], launch: bool) -> list[str]:
    declared = run_options() if launch else {}
    panels: dict[str, list[str]] = {}
    for param in params:
        if param.param_type_name != "option" or param.hidden:
            continue
        panel = getattr(param, "rich_help_panel", None) or "Options"
        row = (
            f"| {_names(param)} | {_default(param, declared.get(param.name or ''))} "
            f"| {_cell(param.help or '')}{_range(param)} |"
        )
        panels.setdefault(panel, []).append(row)
    lines: list[str] = []
    for panel, rows in panels.items():
        if len(panels) > 1:
            lines += [f"**{panel}**", ""]
        lines += ["| option | default | meaning |", "|---|---|---|", *rows, ""]
    return lines


def _argument(param: Any) -> str:
    return (param.metavar or param.name or "").upper()


def _command(name: str, command: Any) -> list[str]:
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    usage = " ".join([f"crf {name}", *map(_argument, arguments), "[OPTIONS]"])
    lines = [f"## crf {name}", "", f"`{usage}`", "", (command.help or "").strip(), ""]
    if arguments:
        lines += ["| argument | meaning |", "|---|---|"]
        for a in arguments:
            lines.append(f"| `{_argument(a)}` | {_cell(getattr(a, 'help', None) or '')} |")
        lines.append("")
    return lines + _options_table(command.params, launch=name == "launch")


def reference() -> str:
    """The page's text: a table of the commands, then each command in full."""
    from crf.launcher.cli import app

    group = typer.main.get_command(app)
    commands = group.commands  # type: ignore[attr-defined]
    lines = [_HEADER, "| command | what it does |", "|---|---|"]
    for name, command in commands.items():
        summary = (command.help or "").strip().split("\n\n")[0]
        lines.append(f"| [`crf {name}`](#crf-{name}) | {_cell(summary)} |")
    lines.append("")
    lines += _options_table(group.params, launch=False)
    for name, command in commands.items():
        lines += _command(name, command)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
