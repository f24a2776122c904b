"""What every cloud backend (Modal, HF Jobs, SageMaker) does the same way.

``CloudExecutor`` owns the parts that must not differ between backends, so each backend only
says how to submit one container, ask its state, read its logs and stop it:

* **Code.** The driver packs the ``crf`` package it runs (a deterministic tar.gz) into the run
  folder (``code/crf-<sha>.tar.gz``), and every container starts a small bootstrap
  (``python -c BOOTSTRAP <argv>``) that installs what the image lacks, fetches that exact code
  through fsspec, and runs ``python -m crf.replica`` with it first on ``PYTHONPATH``. Replicas
  therefore always run the driver's version of crf, on any stock Python/PyTorch image, and the
  image needs no rebuild when crf changes. (Modal too: its image only pre-installs the
  requirements, so the bootstrap finds them and goes straight to fetching the code.) The
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
import tarfile
import threading
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from crf.executors.base import (
    BackendPlan,
    Entrypoint,
    ExecutorError,
    LaunchRecord,
    ReplicaHandle,
    ServerlessExecutor,
    build_command,
    check_launch_args,
    check_ranks,
    replica_env,
    run_id_from_uri,
)
from crf.executors.secrets import (
    ENV_SECRET_NAMES,
    MissingCredentials,
    redact,
    scheme_of,
    store_secrets,
)

#: the command a container runs when the user gives no entrypoint (``python`` of the image)
CONTAINER_ENTRYPOINT = ("python", "-m", "crf.replica")
#: a day: long enough for real runs, short enough that a forgotten run stops (Modal's maximum)
DEFAULT_TIMEOUT_S = 24 * 3600.0
LABEL_RUN, LABEL_RANK = "crf-run", "crf-rank"
ENV_CODE_KEY = "CRF_CODE_KEY"
ENV_REQUIREMENTS = "CRF_REQUIREMENTS"
#: installed by the bootstrap when the image lacks them (the image's own torch is kept)
BASE_REQUIREMENTS = (
    "torch>=2.6",
    "torchft-nightly",
    "trl>=1.0",
    "transformers",
    "fsspec>=2024.12",
    "typer",
    "rich",
    "matplotlib",
    "xxhash>=3.4",
    "psutil>=5.9",
)
STORE_REQUIREMENTS = {
    "s3": ("s3fs>=2024.12", "boto3"),
    "gs": ("gcsfs>=2024.12",),
    "gcs": ("gcsfs>=2024.12",),
    "hf": ("huggingface_hub>=2.4",),
}

# Runs inside the container with only the standard library guaranteed. Kept short: it is on
# the job's command line (it holds no secret: credentials are read from the environment).
BOOTSTRAP = r"""
import importlib.util as u, io, os, subprocess, sys, tarfile, tempfile
need = os.environ.get("CRF_REQUIREMENTS", "").split()
mods = {"torch": "torch", "torchft": "torchft-nightly", "trl": "trl", "fsspec": "fsspec",
        "typer": "typer", "rich": "rich", "s3fs": "s3fs", "gcsfs": "gcsfs",
        "huggingface_hub": "huggingface_hub", "transformers": "transformers",
        "matplotlib": "matplotlib", "xxhash": "xxhash", "psutil": "psutil"}
missing = [r for r in need if any(r.startswith(p) and u.find_spec(m) is None
                                  for m, p in mods.items())]
if missing:
    print("crf bootstrap: installing " + " ".join(missing), flush=True)
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *missing])
data = os.environ.pop("CRF_GCS_CREDENTIALS_JSON", "")
if data and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
    fd, p = tempfile.mkstemp(suffix=".json"); os.write(fd, data.encode()); os.close(fd)
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = p
import fsspec
uri = os.environ["CRF_RUN_URI"].rstrip("/") + "/" + os.environ["CRF_CODE_KEY"]
with fsspec.open(uri, "rb") as f:
    blob = f.read()
src = tempfile.mkdtemp(prefix="crf-src-")
tarfile.open(fileobj=io.BytesIO(blob)).extractall(src, filter="data")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("PYTHONUNBUFFERED", "1")
argv = sys.argv[1:]
if argv and argv[0] in ("python", "python3"):
    argv[0] = sys.executable
print("crf bootstrap: code " + os.environ["CRF_CODE_KEY"], flush=True)
os.execvpe(sys.executable, [sys.executable, "-m", "crf.executors.redacted", *argv], os.environ)
"""


def pack_source() -> tuple[bytes, str]:
    """The ``crf`` package the driver runs, as a reproducible tar.gz, and its SHA-256."""
    import crf

    root = Path(crf.__file__).resolve().parent
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
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


def requirements_for(run_uri: str) -> list[str]:
    """What the bootstrap installs if the image lacks it, for this store's scheme."""
    return [*BASE_REQUIREMENTS, *STORE_REQUIREMENTS.get(scheme_of(run_uri), ())]


def parse_kv(items: Sequence[str] | Mapping[str, str] | None, what: str) -> dict[str, str]:
    """``["a=1", "b=2"]`` (or a mapping) -> dict; ExecutorError naming ``what`` otherwise."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        return {str(k): str(v) for k, v in items.items()}
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ExecutorError(f"{what} expects KEY=VALUE (got {item!r})")
        out[key] = value
    return out


class CloudExecutor(ServerlessExecutor):
    """Shared launch logic for container backends; subclasses implement ``_submit`` and the
    per-replica ``status`` / ``_raw_logs`` / ``cancel`` against their official client."""

    #: set by subclasses: what ``--dry-run`` says replicas run in ("Modal sandbox", ...)
    kind: ClassVar[str] = "container"

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
        if scheme not in STORE_REQUIREMENTS:
            raise ExecutorError(
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

    def check_ready(self, run_uri: str) -> None:
        """Store reachable from containers, store credentials present, backend credentials
        and options valid (``check_backend``) - all before anything is launched."""
        self.check_run_uri(run_uri)
        try:
            store_secrets(run_uri)
        except MissingCredentials as e:
            raise ExecutorError(str(e)) from None
        self.check_backend()

    @abstractmethod
    def check_backend(self) -> None:
        """Backend credentials present and accepted, hardware/flavor names known."""

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
        key = f"code/crf-{sha[:16]}.tar.gz"
        store = RunStore(run_uri)
        if not store.exists(key):
            store.put_if_absent(key, data)
        return key

    def container_env(self, run_uri: str, run_id: str, rank: int, world: int, code_key: str
                      ) -> dict[str, str]:  # fmt: skip
        """The plain (visible) environment: the replica contract and public settings only."""
        env = replica_env(run_uri, run_id, rank, world)
        env[ENV_CODE_KEY] = code_key
        env[ENV_REQUIREMENTS] = " ".join(requirements_for(run_uri))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def container_argv(self, command: Sequence[str]) -> list[str]:
        """``python -c BOOTSTRAP <command>``: fetch the code, then run the replica command."""
        return ["python", "-c", BOOTSTRAP, *command]

    def labels(self, run_id: str, rank: int) -> dict[str, str]:
        return {LABEL_RUN: run_id, LABEL_RANK: str(rank)}

    @abstractmethod
    def _submit(
        self,
        *,
        run_id: str,
        rank: int,
        world_size: int,
        argv: list[str],
        env: dict[str, str],
        secrets: dict[str, str],
        labels: dict[str, str],
        max_restarts: int,
    ) -> tuple[str, dict[str, Any]]:
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
    ) -> list[ReplicaHandle]:
        check_launch_args(n_replicas, run_uri, in_process=False)
        self.check_run_uri(run_uri)
        to_start = check_ranks(ranks, n_replicas)
        from crf.store import normalize_uri

        run_uri = normalize_uri(run_uri)
        run_id = run_id or run_id_from_uri(run_uri)
        command = self.check_command(entrypoint, entrypoint_args)
        secrets = self.secrets_for(run_uri, env)
        try:
            code_key = self.upload_source(run_uri)
        except Exception as e:
            raise ExecutorError(f"could not upload the crf source to {run_uri}: {e}") from e
        argv = self.container_argv(command)
        handles: list[ReplicaHandle] = []
        try:
            for rank in to_start:
                backend_id, extra = self._submit(
                    run_id=run_id,
                    rank=rank,
                    world_size=n_replicas,
                    argv=argv,
                    env={
                        **self.container_env(run_uri, run_id, rank, n_replicas, code_key),
                        # names only: the container hides these variables' values itself
                        ENV_SECRET_NAMES: ",".join(sorted(secrets)),
                    },
                    secrets=secrets,
                    labels=self.labels(run_id, rank),
                    max_restarts=max_restarts,
                )
                handles.append(
                    ReplicaHandle(
                        backend=self.name,
                        run_id=run_id,
                        rank=rank,
                        backend_id=backend_id,
                        run_uri=run_uri,
                        world_size=n_replicas,
                        extra=extra,
                    )
                )
        except ExecutorError:
            self.cancel_all(handles)  # all or nothing: no orphan half of a paid run
            raise
        except Exception as e:
            self.cancel_all(handles)
            raise ExecutorError(
                f"{self.name} refused to start replica {len(handles)}: "
                f"{redact(f'{type(e).__name__}: {e}', secrets.values())}"
            ) from None
        self.remember_launch(
            LaunchRecord(
                n_replicas=n_replicas,
                entrypoint=entrypoint,
                entrypoint_args=tuple(str(a) for a in entrypoint_args),
                env={str(k): str(v) for k, v in (env or {}).items()},
                run_uri=run_uri,
                run_id=run_id,
            )
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
    "LABEL_RUN",
    "CloudExecutor",
    "pack_source",
    "parse_kv",
    "requirements_for",
]
