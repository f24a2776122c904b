"""Jobs: what a replica trains.

A job is a module exposing ``Config`` (a dataclass of the job's knobs, validated by the driver
before launch) and ``run(ctx: ReplicaContext, config: Config) -> dict`` (trains, calling
``ctx.diloco(model, inner_optimizer)`` once and ``ctx.log_step(...)`` after each inner optimizer
step; returns final job metrics), and may expose ``check_launch(spec)``: the driver calls it
before launch to check the run's data for the job (a DataError says what to fix). A job is
named either by a built-in name (:data:`JOBS`) or by its module path (``mypkg.myjob``).
``run.json`` records the name as given, and every replica (a fresh process, which knows only
what it can import) imports the job from that name: a module-path job must therefore be
importable where the replicas run (installed, or on their ``PYTHONPATH``), as it must be
where the driver validates its options before launch.
Modules are imported lazily so ``import crf`` stays light. How to write one:
docs/extending.md, "Add a job".
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

from crf.spec import coerce_text

#: the built-in jobs, by name; any other job is given by its module path
JOBS: dict[str, str] = {
    "lm": "crf.replica.jobs.lm",
    "composer": "crf.replica.jobs.composer",
    "sft": "crf.replica.jobs.sft",
}


def job_module(name: str) -> str:
    """The module that holds job ``name``: a built-in's, or ``name`` itself when it is a
    module path (it has a dot)."""
    if name in JOBS:
        return JOBS[name]
    if "." in name and all(part.isidentifier() for part in name.split(".")):
        return name
    raise ValueError(
        f"unknown job {name!r}; available jobs: {', '.join(sorted(JOBS))}, "
        "or a job module's path (mypkg.myjob)"
    )


def get_job(name: str) -> ModuleType:
    """Import job ``name`` (a built-in name or a module path); ValueError if there is no
    such module or it is not a job (no ``Config`` or ``run``). ImportError from inside the
    module (a dependency it lacks) goes up as it is."""
    module = job_module(name)
    try:
        job = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if name in JOBS or (e.name != module and not module.startswith(f"{e.name}.")):
            raise  # a built-in or the job's own dependency is missing: an install problem
        raise ValueError(
            f"job {name!r}: no module {module!r} can be imported here{_hint(module)}; a job "
            "given by module path must be installed, or on PYTHONPATH, where the driver and "
            "the replicas run"
        ) from None
    missing = [attr for attr in ("Config", "run") if not hasattr(job, attr)]
    if missing:
        raise ValueError(
            f"job {name!r}: module {module!r} is not a job (it has no {' and no '.join(missing)}"
            "; a job module exposes a Config dataclass and run(ctx, config))"
        )
    if not dataclasses.is_dataclass(job.Config):
        raise ValueError(
            f"job {name!r}: its Config is not a dataclass; decorate it with "
            "@dataclasses.dataclass (its fields, with defaults, are the job's options)"
        )
    return job


def _hint(module: str) -> str:
    """Why ``module`` may not import: a close name in its package (a typo), or a folder of
    that name here that is not on the path (``crf`` does not import from the current
    folder by itself, as ``python -m`` does)."""
    import difflib
    import os
    import pkgutil

    parent, _, leaf = module.rpartition(".")
    try:
        package = importlib.import_module(parent)
    except ImportError:
        top = module.split(".")[0]
        if os.path.isdir(top) or os.path.isfile(f"{top}.py"):
            return f" (./{top} is here but not on the path: PYTHONPATH=. crf launch ...)"
        return ""
    names = [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
    close = difflib.get_close_matches(leaf, names, n=1)
    return f" (did you mean {parent}.{close[0]}?)" if close else ""


def nest_dotted(values: dict[str, Any] | None) -> dict[str, Any]:
    """``{"trl.top_p": "0.9"}`` (``--set trl.top_p=0.9``) as ``{"trl": {"top_p": "0.9"}}``,
    merged into a ``trl`` table given as such (a config file's ``[job.trl]``, the SDK's
    ``job_config={"trl": {...}}``); a dotted key wins over the table's, as a flag over the
    file."""
    out: dict[str, Any] = {}
    dotted: list[tuple[str, str, Any]] = []
    for key, value in (values or {}).items():
        table, dot, rest = key.partition(".")
        if dot and table and rest:
            dotted.append((table, rest, value))
        else:
            out[key] = value
    for table, rest, value in dotted:
        given = out.get(table)
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"job option {table} is not a table: {table}.{rest} cannot be set")
        out[table] = {**(given or {}), rest: value}
    return out


def job_config(name: str, values: dict[str, Any] | None) -> Any:
    """Build and validate the job's Config from plain values; errors name the bad key."""
    cls = get_job(name).Config
    values = nest_dotted(values)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"job {name!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(sorted(fields))}"
        )
    for key, val in list(values.items()):
        default = fields[key].default
        if default is not dataclasses.MISSING:
            _check_scalar(key, val, default)
            values[key] = coerce_text(val, default, f"job option {key}")
    cfg = cls(**values)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def _check_scalar(key: str, value: Any, default: Any) -> None:
    """ValueError naming the option for a table or a list where it takes one number, string
    or bool (its default's type): the job's own checks would compare it and fail with a
    TypeError that names neither."""
    scalar = (bool, int, float, str)
    if isinstance(default, scalar) and not isinstance(value, scalar):
        kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        kind = kinds[type(default)] if type(default) in kinds else type(default).__name__
        raise ValueError(
            f"job option {key} takes {kind}, like {default!r} (got {type(value).__name__} "
            f"{value!r})"
        )
