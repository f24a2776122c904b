"""A job registered for one test: a module with a ``Config`` and a ``run`` that does nothing,
so the driver can check its options with no torch and no training."""

from __future__ import annotations

import sys
import types

import pytest

from crf.replica import jobs


def register_fake_job(monkeypatch: pytest.MonkeyPatch, config: type, name: str = "testjob") -> str:
    """Register job ``name`` (its module ``crf_test_<name>``) whose options are ``config``."""
    mod = types.ModuleType(f"crf_test_{name}")
    mod.Config = config  # type: ignore[attr-defined]
    mod.run = lambda ctx, cfg: {}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(jobs.JOBS, name, mod.__name__)
    return name
