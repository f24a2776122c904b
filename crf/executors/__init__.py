"""How replicas start: the ServerlessExecutor protocol and its backends.

Executors know nothing of training: they start a command N times with the replica contract in
its environment (docs/design.md, "Replica runtime"), report process state, and read each
replica's ``results/<rank>.json`` back from the store. Backends are imported lazily so that
``import crf.executors`` never needs a cloud SDK.
"""

import importlib as _importlib
from typing import Any as _Any

from crf.executors.base import (
    ExecutorError,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    default_entrypoint,
    replica_env,
)
from crf.layout import ENV_RANK, ENV_RUN_ID, ENV_RUN_URI, ENV_WORLD_SIZE

#: the backends, imported on first use (each needs its own SDK only then)
_BACKENDS = {
    "LocalProcessExecutor": "crf.executors.local",
    "ModalExecutor": "crf.executors.modal",
    "HFJobsExecutor": "crf.executors.hf_jobs",
    "SageMakerExecutor": "crf.executors.sagemaker",
}

__all__ = [
    *_BACKENDS,
    "ENV_RANK",
    "ENV_RUN_ID",
    "ENV_RUN_URI",
    "ENV_WORLD_SIZE",
    "ExecutorError",
    "ReplicaHandle",
    "ReplicaResult",
    "ReplicaState",
    "ReplicaStatus",
    "ServerlessExecutor",
    "default_entrypoint",
    "replica_env",
]


def __getattr__(name: str) -> _Any:
    if name in _BACKENDS:
        return getattr(_importlib.import_module(_BACKENDS[name]), name)
    raise AttributeError(f"module 'crf.executors' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
