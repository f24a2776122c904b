"""The options a run holds now: its ``run.json``, as the resumes since changed it.

A run's ``run.json`` is written once and never rewritten, so a resume that changes a limit
on waiting (``crf launch --resume RUN --reward-timeout 1800``: the options of
``crf.spec.AT_RESUME``, which never change what is trained) keeps the new value in its
launch's record (``launches/<k>.json``, ``changed``). Every process that reads the run's
options - its replicas, its rollout workers, the driver and ``crf status`` - reads them
through :func:`with_changes`, so they all see the same values: run.json's, each changed by
the newest launch that changed it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from crf import layout
from crf.spec import AT_RESUME, RunSpec


def changed_since_launch(store: Any) -> dict[str, Any]:
    """The options the run's resumes changed, by field name, the newest launch's value of
    each (an unreadable or older record changes nothing; names not in ``AT_RESUME``, as a
    newer crf's record might hold, are left out)."""
    out: dict[str, Any] = {}
    for k in layout.launch_numbers(store):
        try:
            changed = store.get_json(layout.launch_key(k)).get("changed") or {}
        except Exception:  # noqa: BLE001 - a launch record is informative; run.json rules
            continue
        if isinstance(changed, Mapping):
            out |= {name: value for name, value in changed.items() if name in AT_RESUME}
    return out


def apply(spec: RunSpec, changes: Mapping[str, Any]) -> RunSpec:
    """``spec`` with ``changes`` (names of ``AT_RESUME``) in place; validated, so a value
    out of range is the SpecError a launch would have raised."""
    unknown = sorted(set(changes) - set(AT_RESUME))
    if unknown:
        raise ValueError(f"not options a resume may change: {', '.join(unknown)}")
    changed = dataclasses.replace(spec, **dict(changes))
    changed.validate()
    return changed


def with_changes(store: Any, spec: RunSpec) -> RunSpec:
    """``spec`` (the run's run.json) as the run's resumes changed it."""
    changes = changed_since_launch(store)
    if not changes:
        return spec
    try:
        return apply(spec, changes)
    except Exception:  # noqa: BLE001 - a record the driver checked; keep run.json's values
        return spec
