"""The names a launch setting is accepted by: one declaration, every spelling.

A run option is declared once, on its RunSpec field (``crf.spec.option``): the field's name
(``round_timeout_s``, the key in run.json) and its flag (``--round-timeout``). A user meets
both (the help shows the flag, run.json the field), so every surface that takes an option by
name - a config file's keys, the SDK's keywords and dict keys - accepts either, with ``-`` or
``_`` alike, and they all set the one option. A name that is none of them is one line with the
nearest valid one, never a TypeError.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from crf.launcher.errors import LaunchError
from crf.spec import run_options

#: launch settings that are not run options (not in run.json) but belong to a launch's recipe,
#: as a config file and the SDK take them: each name and its other spellings (``--timeout``
#: is the driver's ``timeout_s``)
LAUNCH_SETTINGS: dict[str, tuple[str, ...]] = {
    "store": (),
    "timeout": ("timeout_s",),
    "max_restarts": (),
    "max_run_restarts": (),
}
#: names of the per-replica hardware (``--hardware`` / ``--gpu`` / ``--flavor`` /
#: ``--instance-type``): each backend maps it to its own constructor option
HARDWARE_KEYS = ("hardware", "gpu", "flavor", "instance_type")


def spellings_of(*names: str) -> list[str]:
    """Each name with ``_`` and with ``-`` (a flag's name without its dashes is one)."""
    out: list[str] = []
    for name in names:
        for form in (name, name.replace("-", "_"), name.replace("_", "-")):
            if form and form not in out:
                out.append(form)
    return out


@functools.cache
def option_spellings() -> dict[str, str]:
    """Every accepted name of a run option -> its RunSpec field name: the field name and its
    flag without ``--`` (``round_timeout_s``, ``round-timeout``, ``column``, ``secret``,
    ``set``), each with dashes or underscores."""
    out: dict[str, str] = {}
    for name, declared in run_options().items():
        for spelling in spellings_of(name, (declared.flag or "").removeprefix("--")):
            out.setdefault(spelling, name)
    return out


@functools.cache
def setting_spellings() -> dict[str, str]:
    """Every accepted name of a launch setting (LAUNCH_SETTINGS) -> its name."""
    return {s: name for name, more in LAUNCH_SETTINGS.items() for s in spellings_of(name, *more)}


def did_you_mean(key: object, known: Iterable[str]) -> str:
    """``; did you mean 'x'?`` for the nearest known name, or nothing; never the name given
    (a name known elsewhere but not here would otherwise be suggested to itself)."""
    others = [name for name in known if name != key]
    near = difflib.get_close_matches(str(key), others, n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


def as_declared(name: str, value: Any) -> Any:
    """A run option's value as its field takes it: one string (or a tuple) for a list option
    is that list (``reward = "exact_match"``); an ``--entrypoint`` string is a command, left
    as it is."""
    declared = run_options()[name]
    if declared.base is list and declared.cli_type is None:
        if isinstance(value, str):
            return [value]
        if isinstance(value, tuple):
            return list(value)
    return value


def run_option_values(
    values: Mapping[Any, Any], *, what: str = "launch option", where: str = ""
) -> dict[str, Any]:
    """``values`` keyed by RunSpec field name, each as its field takes it (see as_declared).
    LaunchError, one line, for a name that is no run option (with the nearest one) or an
    option given twice under two spellings. ``where`` ends the message (`` in config file
    run.toml``)."""
    spellings = option_spellings()
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in values.items():
        name = spellings.get(key) if isinstance(key, str) else None
        if name is None:
            raise LaunchError(f"unknown {what} {key!r}{where}{did_you_mean(key, spellings)}")
        if name in out:
            raise LaunchError(f"{name} is given twice ({given_as[name]!r} and {key!r}){where}")
        out[name], given_as[name] = as_declared(name, value), key
    return out
