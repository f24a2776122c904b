"""How replicas start: the ServerlessExecutor protocol and its backends.

Executors know nothing of training: they start a command N times with the replica contract in
its environment (docs/design.md, "Replica runtime"), report process state, and read each
replica's ``results/<rank>.json`` back from the store. Backends are imported lazily so that
``import crf.executors`` never needs a cloud SDK.
"""

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

__all__ = [
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
