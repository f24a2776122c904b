"""Job registry: what a replica trains, keyed by name.

A job is a module exposing ``Config`` (a dataclass of the job's knobs, validated by the driver
before launch) and ``run(ctx: ReplicaContext, config: Config) -> dict`` (trains, calling
``ctx.diloco(model, inner_optimizer)`` once and ``ctx.log_step(...)`` after each inner optimizer
step; returns final job metrics). Modules are imported lazily so ``import crf`` stays light.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

from crf.spec import coerce_text

JOBS: dict[str, str] = {
    "lm": "crf.replica.jobs.lm",
    "composer": "crf.replica.jobs.composer",
}


def register_job(name: str, module: str) -> None:
    """Register a job module (``module`` must expose ``Config`` and ``run``)."""
    JOBS[name] = module


def get_job(name: str) -> ModuleType:
    if name not in JOBS:
        raise ValueError(f"unknown job {name!r}; available jobs: {', '.join(sorted(JOBS))}")
    return importlib.import_module(JOBS[name])


def job_config(name: str, values: dict[str, Any] | None) -> Any:
    """Build and validate the job's Config from plain values; errors name the bad key."""
    cls = get_job(name).Config
    values = dict(values or {})
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
            values[key] = coerce_text(val, default, f"job option {key}")
    cfg = cls(**values)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg
