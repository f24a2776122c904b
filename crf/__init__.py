"""crf — serverless launcher and SDK for low-communication (DiLoCo) distributed training.

Public API is imported lazily so that ``import crf`` pulls in neither torch-heavy modules nor
any cloud SDK until they are used.
"""

from __future__ import annotations

import importlib as _importlib
from typing import Any as _Any

__version__ = "0.1.0"

_LAZY = {
    "RunSpec": "crf.spec",
    "RunStore": "crf.store",
    "ObjectStoreAllReduce": "crf.exchange.allreduce",
    "ObjectStoreManager": "crf.exchange.manager",
    "ReplicaContext": "crf.replica.context",
    "ServerlessExecutor": "crf.executors.base",
    "ReplicaHandle": "crf.executors.base",
    "ReplicaResult": "crf.executors.base",
    "LocalProcessExecutor": "crf.executors.local",
    "ModalExecutor": "crf.executors.modal",
    "HFJobsExecutor": "crf.executors.hf_jobs",
    "SageMakerExecutor": "crf.executors.sagemaker",
    "ComposerReplicationTrainer": "crf.composer",
    "ComposerConfig": "crf.composer",
    "compose_loss": "crf.composer",
    "DiLoCoCallback": "crf.composer",
    "RestartPolicy": "crf.launcher.plan",
    # what launch/dry_run/resume raise for input a user can fix: one line that says how
    "LaunchError": "crf.launcher.errors",
    # the SDK: what the CLI does, as functions that return typed objects
    "launch": "crf.sdk",
    "dry_run": "crf.sdk",
    "attach": "crf.sdk",
    "runs": "crf.sdk",
    "resume": "crf.sdk",
    "Run": "crf.sdk",
    "RunResult": "crf.results",
    "RunStatus": "crf.results",
    "RunInfo": "crf.results",
    "DryRun": "crf.results",
    "ReplicaSummary": "crf.results",
    "ReplicaProgress": "crf.results",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'crf' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API (what ``help(crf)`` and completion should offer), not this module's helpers."""
    return sorted([*_LAZY, "__version__"])
