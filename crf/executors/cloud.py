"""What every cloud backend (Modal, HF Jobs, SageMaker) does the same way.

``CloudExecutor`` owns the parts that must not differ between backends, so each backend only
says how to submit one container, ask its state, read its logs and stop it:

* **Code.** The driver packs the ``crf`` package it runs (a deterministic tar.gz) into the run
  folder (``code/crf-<sha>.tar.gz``), and every container starts a small bootstrap
  (``python -c BOOTSTRAP <argv>``) that installs what the image lacks, fetches that exact code
  through fsspec, and runs ``python -m crf.replica`` with it first on ``PYTHONPATH``. Replicas
  therefore always run the driver's version of crf, on any stock Python/PyTorch image, and the
  image needs no rebuild when crf changes. A run's ``--workdir`` is shipped the same way
  (``code/workdir-<sha>.tar.gz``, named in run.json): the bootstrap unpacks it and runs the
  command in it, so ``--entrypoint "python train.py"`` needs no image of its own; its
  ``--pip`` packages join the requirements the bootstrap installs. (Modal too: its image only
  pre-installs the requirements, so the bootstrap finds them and goes straight to fetching
  the code.) The
  command runs under ``python -m crf.executors.redacted``, which hides the container's secrets
  from its output before the platform stores it.
* **Secrets.** Store credentials (``crf.executors.secrets.store_secrets``) and everything the
  caller passes as ``env`` go through the backend's secret mechanism; the plain environment
  holds only the replica contract (run URI, rank, world size, run id), public settings and
  the secrets' names (``CRF_SECRET_NAMES``), with which the container redacts its own output
  at the source. Every log line returned is redacted again.
* **Reachability.** A container cannot see this machine's disk: ``file://`` and ``memory://``
  run folders are refused before anything starts.
* **Labels.** Every container is labelled ``crf-run=<run id>``, ``crf-rank=<rank>`` so a later
  process can find a run's replicas (``find_replicas``) even if its handles were never saved.
"""

from __future__ import annotations

import hashlib
import io
import threading
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from crf import layout
from crf.executors.base import (
    BackendPlan,
    Entrypoint,
    ExecutorError,
    LaunchArgs,
    MissingAccess,
    ReadyCheck,
    ReplicaHandle,
    ServerlessExecutor,
    Workers,
    build_command,
    check_launch_args,
    prepare_launch,
    replica_env,
    unit_name,
)
from crf.executors.bootstrap import (
    BOOTSTRAP,
    ENV_CODE_KEY,
    ENV_REQUIREMENTS,
    STORE_EXTRAS,
    requirements_for,
)
from crf.executors.secrets import (
    MissingCredentials,
    redact,
    scheme_of,
    store_secrets,
)
from crf.executors.workdir import RunNeeds, reproducible_tar_gz, run_needs
from crf.layout import ENV_SECRET_NAMES, ENV_WORKDIR_KEY

#: the command a container runs when the user gives no entrypoint (``python`` of the image)
CONTAINER_ENTRYPOINT = ("python", "-m", "crf.replica")
#: a day: long enough for real runs, short enough that a forgotten run stops (Modal's maximum)
DEFAULT_TIMEOUT_S = 24 * 3600.0
LABEL_RUN, LABEL_RANK = "crf-run", "crf-rank"
#: on rollout workers only: ``crf-role=rollout`` (their crf-rank is the worker's index)
LABEL_ROLE = "crf-role"


def pack_source() -> tuple[bytes, str]:
    """The ``crf`` package the driver runs, as a reproducible tar.gz, and its SHA-256."""
    import crf

    root = Path(crf.__file__).resolve().parent
    buf = io.BytesIO()
    with reproducible_tar_gz(buf) as tar:
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo") or path.is_dir():
                continue
            info = tar.gettarinfo(str(path), arcname=str(Path("crf") / path.relative_to(root)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Submission:
    """One container to start: what ``CloudExecutor.launch_replicas`` asks a backend's
    ``_submit`` for (the plain env, the secrets apart, the labels that find it again)."""

    run_id: str
    rank: int
    world_size: int
    argv: list[str]
    env: dict[str, str]
    secrets: dict[str, str]
    labels: dict[str, str]
    max_restarts: int
    #: set for rollout workers (``rank`` is then the worker's index)
    workers: Workers | None = None

    @property
    def unit(self) -> str:
        """The rank, or ``w<k>`` for rollout worker k: what job names and messages say."""
        return unit_name(self.rank, self.workers)


class CloudExecutor(ServerlessExecutor):
    """Shared launch logic for container backends; subclasses implement ``_submit`` and the
    per-replica ``status`` / ``_raw_logs`` / ``cancel`` against their official client."""

    #: set by subclasses: what ``--dry-run`` says replicas run in ("Modal sandbox", ...)
    kind: ClassVar[str] = "container"
    #: the bootstrap pip-installs a run's --pip packages and the extras its options use
    installs_packages: ClassVar[bool] = True

    def __init__(
        self,
        *,
        image: str | None = None,
        timeout_s: float | None = None,
        region: str | None = None,
    ) -> None:
        self.image = image
        self.timeout_s = float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S
        if self.timeout_s <= 0:
            raise ExecutorError(f"timeout must be > 0 seconds (got {timeout_s})")
        self.region = region
        self._secret_values: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ checks
    def check_run_uri(self, run_uri: str) -> None:
        check_launch_args(1, run_uri, in_process=False)
        scheme = scheme_of(run_uri)
        if scheme not in STORE_EXTRAS:
            raise MissingAccess(
                f"replicas on {self.name} run in the cloud and cannot reach the run folder "
                f"{run_uri!r} on this machine; use an object store: --store s3://bucket/prefix, "
                "gs://bucket/prefix or hf://buckets/<user>/<bucket>"
            )

    def check_command(
        self, entrypoint: Entrypoint, entrypoint_args: Sequence[str] = ()
    ) -> list[str]:
        if entrypoint is None:
            return [*CONTAINER_ENTRYPOINT, *map(str, entrypoint_args)]
        return build_command(entrypoint, entrypoint_args)

    def ready_checks(self, run_uri: str) -> list[ReadyCheck]:
        """Store reachable from containers, store credentials present, then the backend's
        own checks (``backend_checks``) - all before anything is launched."""
        return [
            lambda: self.check_run_uri(run_uri),
            lambda: self.check_store_credentials(run_uri),
            *self.backend_checks(),
        ]

    def check_store_credentials(self, run_uri: str) -> None:
        """MissingAccess naming the variable (or login) that would give the store's
        credentials, when this machine has none to pass to the containers."""
        try:
            store_secrets(run_uri)
        except MissingCredentials as e:
            raise MissingAccess(str(e)) from None

    @abstractmethod
    def backend_checks(self) -> list[ReadyCheck]:
        """The backend's own checks: hardware/flavor names known (ExecutorError), its
        credentials present and accepted (MissingAccess naming where they come from)."""

    def check_backend(self) -> None:
        """The backend's own checks (``backend_checks``), stopping at the first failure."""
        for check in self.backend_checks():
            check()

    # ------------------------------------------------------------------ launch
    def secrets_for(self, run_uri: str, env: Mapping[str, str] | None) -> dict[str, str]:
        """Store credentials plus the caller's ``env``: all of it goes through the secret
        mechanism (a caller's env is where credentials are passed, so it is never plain)."""
        try:
            secrets = store_secrets(run_uri)
        except MissingCredentials as e:
            raise ExecutorError(str(e)) from None
        secrets.update({str(k): str(v) for k, v in (env or {}).items()})
        with self._lock:
            self._secret_values.update(secrets.values())
        return secrets

    def upload_source(self, run_uri: str) -> str:
        """Put the crf source into the run folder (once per content); return its key."""
        from crf.store import RunStore

        data, sha = pack_source()
        key = layout.code_key(sha[:16])
        store = RunStore(run_uri)
        if not store.exists(key):
            store.put_if_absent(key, data)
        return key

    def container_env(self, run_uri: str, run_id: str, rank: int, world: int, code_key: str,
                      needs: RunNeeds | None = None) -> dict[str, str]:  # fmt: skip
        """The plain (visible) environment: the replica contract and public settings only
        (with the run's workdir key and its extra requirements, from its run.json)."""
        needs = needs or RunNeeds()
        env = replica_env(run_uri, run_id, rank, world)
        env[ENV_CODE_KEY] = code_key
        env[ENV_REQUIREMENTS] = " ".join(requirements_for(run_uri, needs.extras, needs.pip))
        if needs.workdir_key:
            env[ENV_WORKDIR_KEY] = needs.workdir_key
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def container_argv(self, command: Sequence[str]) -> list[str]:
        """``python -c BOOTSTRAP <command>``: fetch the code, then run the replica command."""
        return ["python", "-c", BOOTSTRAP, *command]

    def labels(self, run_id: str, rank: int) -> dict[str, str]:
        return {LABEL_RUN: run_id, LABEL_RANK: str(rank)}

    def unit_labels(self, run_id: str, rank: int, workers: Workers | None) -> dict[str, str]:
        """A replica's labels; a rollout worker's also say ``crf-role=rollout`` (so looking
        a run's replicas up by label leaves its workers out)."""
        labels = self.labels(run_id, rank)
        if workers is not None:
            labels[LABEL_ROLE] = layout.ROLE_ROLLOUT
        return labels

    @abstractmethod
    def _submit(self, sub: Submission) -> tuple[str, dict[str, Any]]:
        """Start one container; return (backend id, extra handle fields)."""

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: Entrypoint = None,
        entrypoint_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        run_uri: str,
        run_id: str | None = None,
        ranks: Sequence[int] | None = None,
        max_restarts: int = 0,
        plain_env: Mapping[str, str] | None = None,
        workers: Workers | None = None,
    ) -> list[ReplicaHandle]:
        """Start one container per rank (with ``workers``, per rollout worker: see
        :class:`~crf.executors.base.Workers`), all or none."""
        check_launch_args(n_replicas, run_uri, in_process=False)
        self.check_run_uri(run_uri)
        run_uri, run_id, to_start = prepare_launch(n_replicas, run_uri, run_id, ranks)
        command = self.check_command(entrypoint, entrypoint_args)
        secrets = self.secrets_for(run_uri, env)
        try:
            code_key = self.upload_source(run_uri)
        except Exception as e:  # noqa: BLE001 - whatever the store's client raises, said as one error
            raise ExecutorError(f"could not upload the crf source to {run_uri}: {e}") from e
        try:
            needs = run_needs(run_uri)  # the run's workdir and packages (its run.json)
        except Exception as e:  # noqa: BLE001 - the store's client or a damaged run.json
            raise ExecutorError(f"could not read the run's run.json at {run_uri}: {e}") from e
        argv = self.container_argv(command)
        handles: list[ReplicaHandle] = []
        role_extra = {} if workers is None else {"role": layout.ROLE_ROLLOUT}
        try:
            for rank in to_start:
                env_ = self.container_env(run_uri, run_id, rank, n_replicas, code_key, needs)
                if workers is not None:
                    env_.update(workers.env(rank))
                plain = {str(k): str(v) for k, v in (plain_env or {}).items()}
                # secrets by name only: the container hides these variables' values itself
                env_ = {**plain, **env_, ENV_SECRET_NAMES: ",".join(sorted(secrets))}
                sub = Submission(run_id, rank, n_replicas, argv, env_, secrets,
                                 self.unit_labels(run_id, rank, workers),
                                 max_restarts if workers is None else 0, workers)  # fmt: skip
                backend_id, extra = self._submit(sub)
                world = n_replicas if workers is None else workers.trainers
                handles.append(ReplicaHandle(self.name, run_id, rank, backend_id, run_uri, world,
                                             extra={**extra, **role_extra}))  # fmt: skip
        except ExecutorError:
            self.cancel_all(handles)  # all or nothing: no orphan half of a paid run
            raise
        except Exception as e:  # noqa: BLE001 - anything that escapes a submit: no orphans left
            self.cancel_all(handles)
            what = "replica" if workers is None else "rollout worker"
            raise ExecutorError(
                f"{self.name} refused to start {what} {len(handles)}: "
                f"{redact(f'{type(e).__name__}: {e}', secrets.values())}"
            ) from None
        self.remember_launch(
            LaunchArgs.of(
                n_replicas, entrypoint, entrypoint_args, env, run_uri, run_id, plain_env, workers
            )  # fmt: skip
        )
        return handles

    # ------------------------------------------------------------------ logs
    @abstractmethod
    def _raw_logs(self, handle: ReplicaHandle, follow: bool) -> Iterator[str]:
        """The backend's log lines for one replica, unredacted."""

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        """Log lines with every known secret value replaced by ``***``."""
        values = set(self._secret_values)
        try:  # a reattaching process knows the same store credentials from its environment
            values.update(store_secrets(handle.run_uri).values())
        except MissingCredentials:
            pass
        for line in self._raw_logs(handle, follow):
            yield redact(line, values)

    # ------------------------------------------------------------------ plan
    def plan(self, n_replicas: int, command: Sequence[str] | None, run_uri: str, **kw: Any
             ) -> BackendPlan:  # fmt: skip
        """A BackendPlan with the shared fields filled in (subclasses add hardware/price)."""
        cmd = self.check_command(command)
        try:
            names = sorted(store_secrets(run_uri))
        except MissingCredentials:
            names = []
        kw.setdefault("notes", []).append(
            "code: this crf source is uploaded to <run>/code/ and fetched by each container"
        )
        return BackendPlan(
            backend=self.name,
            replicas=n_replicas,
            command=cmd,
            store=run_uri,
            region=self.region,
            timeout_s=self.timeout_s,
            secrets=names,
            **kw,
        )

    def config(self) -> dict[str, Any]:
        return {"image": self.image, "timeout_s": self.timeout_s, "region": self.region}


__all__ = [
    "BOOTSTRAP",
    "CONTAINER_ENTRYPOINT",
    "DEFAULT_TIMEOUT_S",
    "LABEL_RANK",
    "LABEL_ROLE",
    "LABEL_RUN",
    "CloudExecutor",
    "pack_source",
    "requirements_for",
]
