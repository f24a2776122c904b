"""ModalExecutor: each replica is a Modal Sandbox.

Why Sandboxes and not Functions: a replica is a long, self-contained process (``python -m
crf.replica``) whose only contract is its environment and its exit code. A Sandbox runs exactly
that - an argv in an image, with secrets, a GPU, a timeout and tags - and needs no deployed
App code, no pickled function and no ``modal run`` on the driver's side. Everything below is
the official ``modal`` client (pinned to 1.6.4; the fake servicer in ``tests/emulators`` speaks
that version's protocol).

* **Code** reaches the container the way it does on every cloud backend (``CloudExecutor``): the
  driver uploads its crf source to ``<run>/code/`` and the Sandbox runs the shared bootstrap
  (``python -c BOOTSTRAP python -m crf.replica``). The image is ``debian_slim`` (or your registry
  image) plus a cached ``pip_install`` of crf's requirements, so the bootstrap normally installs
  nothing. Modal's native ``add_local_python_source`` would upload the source as a Modal mount
  instead; the store path was chosen because it is the one path every backend shares and the one
  the tests can exercise end to end (the fake servicer runs the real bootstrap, which really
  fetches the code from the S3 emulator).
* **Secrets** - store credentials and the caller's ``env`` - go in one ``modal.Secret.from_dict``;
  the replica contract (``CRF_RUN_URI``/``CRF_RANK``/...) goes in ``env=``. Modal 1.6.4 sends both
  the same way (inline secret sources on V2 sandboxes, ephemeral Secrets on V1), and no Modal API
  returns a Sandbox's environment; only the argv is visible, and it holds no secret.
* **Labels** are Sandbox tags ``crf-run``/``crf-rank``; ``find_replicas`` lists by them. Modal lists
  only *running* Sandboxes, so a finished replica cannot be found again without its handle.
* **Timeout**: Modal's default Sandbox lifetime is 300 s; every Sandbox gets ``timeout_s``
  instead (24 h at most, Modal's limit). A timed-out Sandbox exits 124, a terminated one 137.
* **Cancel** tags the Sandbox ``crf-cancelled=1`` before ``terminate()``, so any process - not
  only the one that cancelled - reports it as cancelled rather than killed.
* **Credentials**: ``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or ``~/.modal.toml`` (``modal token
  new``), read through ``modal.config``. ``check_backend`` makes one authenticated call,
  ``ClientHello`` - the call ``modal token new --verify`` makes - so a wrong token fails before
  anything is created or uploaded.
* **Restarts**: Sandboxes have no retry policy, so ``native_restarts`` is False and the driver
  relaunches a failed rank itself (``relaunch``).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from crf.executors import adaptors, catalog
from crf.executors.base import (
    BackendPlan,
    ExecutorError,
    MissingAccess,
    ReadyCheck,
    ReplicaHandle,
    ReplicaState,
    ReplicaStatus,
)
from crf.executors.bootstrap import ENV_REQUIREMENTS
from crf.executors.cloud import LABEL_RANK, LABEL_ROLE, LABEL_RUN, CloudExecutor, Submission

#: the longest a Modal Sandbox may live (``timeout=``), in seconds
MAX_TIMEOUT_S = 24 * 3600
#: the Sandbox tag ``cancel`` sets before terminating, read back by ``status``
TAG_CANCELLED = "crf-cancelled"
#: Python series the default image uses when the driver's own is not one Modal builds
_PYTHON_SERIES = ("3.10", "3.11", "3.12", "3.13")

# GPU names Modal accepts for ``gpu=`` and the most of each one container may request
# (``"H100:8"``), and Modal's list prices in USD per second: dated data in catalog/modal.json.
_CATALOG = catalog.load("modal")
PRICES_DATE: str = _CATALOG.as_of
GPU_TYPES: dict[str, int] = dict(_CATALOG["gpu_max_per_container"])
GPU_USD_PER_S: dict[str, float] = dict(_CATALOG["gpu_usd_per_s"])
_PRICE_ALIASES: dict[str, str] = dict(_CATALOG["price_aliases"])
SANDBOX_CPU_USD_PER_CORE_S: float = _CATALOG["sandbox_cpu_usd_per_core_s"]
SANDBOX_MEM_USD_PER_GIB_S: float = _CATALOG["sandbox_mem_usd_per_gib_s"]
#: what Modal itself reserves when a Sandbox asks for no ``cpu``/``memory``
DEFAULT_CPU_CORES = 0.125
DEFAULT_MEMORY_MB = 128
#: crf's reservation when ``cpu``/``memory_mb`` are not given, per GPU of a GPU replica:
#: Modal's 0.125 core and 128 MiB would leave a GPU's data loading, tokenization and
#: rollout bookkeeping on one throttled thread, and Modal bills CPU and memory at max(request,
#: use) anyway, so a reservation the replica uses costs nothing extra
CPU_CORES_PER_GPU = 4.0
MEMORY_MB_PER_GPU = 16 * 1024
#: ... and of a CPU-only replica: a training process keeps its cores busy, and Modal sizes
#: OMP_NUM_THREADS (torch's threads) from the reservation
CPU_ONLY_CORES = 2.0
CPU_ONLY_MEMORY_MB = 4 * 1024
_END = object()


def _modal() -> Any:
    """The modal SDK (through its adaptor); ExecutorError naming the extra when missing."""
    try:
        return adaptors.modal.load()
    except adaptors.MissingSDK:
        raise MissingAccess(
            "the modal backend needs the modal client: pip install 'composer-replication[modal]'"
        ) from None


def _errors() -> tuple[type[BaseException], ...]:
    """What the modal client raises for a refused, failed or unreachable call
    (modal.exception.Error, gRPC errors, OSError)."""
    return adaptors.modal.errors()


def parse_gpu(gpu: str | None) -> tuple[str, int] | None:
    """``"h100:2"`` -> ``("H100", 2)``; None for CPU only; ExecutorError for unknown names."""
    if gpu is None or str(gpu).strip().lower() in ("", "none", "cpu"):
        return None
    name, sep, count_s = str(gpu).strip().partition(":")
    name = name.strip().upper()
    known = ", ".join(GPU_TYPES)
    if name not in GPU_TYPES:
        raise ExecutorError(
            f"unknown Modal GPU {gpu!r}; Modal's GPU names are: {known} "
            "(add ':N' for N GPUs per replica, e.g. H100:2; leave --gpu out for CPU only)"
        )
    try:
        count = int(count_s) if sep else 1
    except ValueError:
        raise ExecutorError(f"bad GPU count in {gpu!r}: write NAME:N, e.g. H100:2") from None
    if not 1 <= count <= GPU_TYPES[name]:
        raise ExecutorError(
            f"Modal gives a container 1 to {GPU_TYPES[name]} {name} GPUs (got {count} in {gpu!r})"
        )
    return name, count


def reservation(gpu: str | None, cpu: float | None, memory_mb: int | None) -> tuple[float, int]:
    """The CPU cores and MiB one replica reserves: as given, else crf's default for its
    hardware (:data:`CPU_CORES_PER_GPU` and :data:`MEMORY_MB_PER_GPU` per GPU; CPU-only
    replicas :data:`CPU_ONLY_CORES` and :data:`CPU_ONLY_MEMORY_MB`)."""
    parsed = parse_gpu(gpu)
    gpus = parsed[1] if parsed else 0
    default_cpu = CPU_CORES_PER_GPU * gpus if gpus else CPU_ONLY_CORES
    default_mem = MEMORY_MB_PER_GPU * gpus if gpus else CPU_ONLY_MEMORY_MB
    return (cpu or default_cpu), (memory_mb or default_mem)


def hourly_price(gpu: str | None, cpu: float | None, memory_mb: int | None) -> float:
    """List price of one replica per hour: GPUs plus the CPU and memory it reserves (crf's
    default reservation for what is not given, see :func:`reservation`)."""
    cpu, memory_mb = reservation(gpu, cpu, memory_mb)
    per_s = cpu * SANDBOX_CPU_USD_PER_CORE_S
    per_s += memory_mb / 1024 * SANDBOX_MEM_USD_PER_GIB_S
    parsed = parse_gpu(gpu)
    if parsed is not None:
        name, count = parsed
        per_s += GPU_USD_PER_S[_PRICE_ALIASES.get(name, name)] * count
    return per_s * 3600


def modal_credentials() -> tuple[str, str] | None:
    """(token id, token secret) from MODAL_TOKEN_ID/SECRET or ~/.modal.toml, else None."""
    _modal()  # ExecutorError naming the pip extra when the client is missing
    config = adaptors.modal.load("config").config
    token_id, token_secret = config.get("token_id"), config.get("token_secret")
    return (token_id, token_secret) if token_id and token_secret else None


def _number(value: Any, kind: type, name: str) -> Any:
    if value is None or value == "":
        return None
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise ExecutorError(f"{name} must be a number (got {value!r})") from None
    if out <= 0:
        raise ExecutorError(f"{name} must be > 0 (got {value!r})")
    return out


class ModalExecutor(CloudExecutor):
    """Run replicas as Modal Sandboxes (one per rank) in app ``app_name``.

    Args:
        gpu: Modal GPU per replica, e.g. ``"A10G"``, ``"H100"``, ``"H100:2"``; None for CPU only.
        image: a registry image (``modal.Image.from_registry``) with Python and pip; default
            ``debian_slim`` with this driver's Python series. crf's requirements are added
            with ``pip_install`` either way (an image's own torch is kept when it is new
            enough).
        app_name: the Modal App the Sandboxes belong to (created if missing).
        cpu: physical cores reserved per replica (default: 4 per GPU, 2 without a GPU;
            see :func:`reservation`). Modal bills max(reservation, use).
        memory_mb: memory reserved per replica in MiB (default: 16 GiB per GPU, 4 GiB
            without a GPU).
        region: pin the Sandboxes to a Modal region (costs Modal's regional multiplier).
        timeout_s: Sandbox lifetime; Modal stops it after that (at most 24 h).
        environment_name: Modal environment (default: the profile's).
        log_wait_s: ``logs()`` of a running replica without ``follow`` reads for at most this
            long (less once the output has been quiet for a second): Modal's streams have no
            "end of what is there now".
    """

    name = "modal"
    kind = "Modal sandbox"
    hardware_option: ClassVar[str] = "gpu"
    native_restarts = False

    def __init__(
        self,
        gpu: str | None = None,
        *,
        image: str | None = None,
        app_name: str = "crf",
        cpu: float | None = None,
        memory_mb: int | None = None,
        region: str | None = None,
        timeout_s: float | None = None,
        environment_name: str | None = None,
        log_wait_s: float = 3.0,
    ) -> None:
        super().__init__(image=image, timeout_s=timeout_s, region=region)
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ExecutorError(
                f"Modal Sandboxes live at most 24 h ({MAX_TIMEOUT_S} s); got a timeout of "
                f"{self.timeout_s:g} s: lower --timeout, or resume the run in a new launch"
            )
        self.gpu = None if gpu is None or str(gpu).strip() == "" else str(gpu).strip()
        self.app_name = app_name
        self.cpu = _number(cpu, float, "cpu")
        self.memory_mb = _number(memory_mb, int, "memory_mb")
        self.environment_name = environment_name or None
        self.log_wait_s = float(log_wait_s)
        self._client_obj: Any = None
        self._app_obj: Any = None
        self._images: dict[tuple[str, ...], Any] = {}
        self._sandboxes: dict[str, Any] = {}
        self._cancelled: set[str] = set()

    # ------------------------------------------------------------------ client
    def _client(self) -> Any:
        """A client of this executor's own (not the process-wide ``from_env`` singleton), so
        the credentials checked are the ones the current configuration names."""
        with self._lock:
            if self._client_obj is None:
                modal = _modal()
                creds = modal_credentials()
                if creds is not None:
                    self._client_obj = modal.Client.from_credentials(*creds)
                else:
                    config = adaptors.modal.load("config").config
                    if not config.get("oauth_refresh_token"):
                        raise MissingAccess(
                            "no Modal credentials: run `modal token new` or set "
                            "MODAL_TOKEN_ID/MODAL_TOKEN_SECRET"
                        )
                    self._client_obj = modal.Client.from_env()
            return self._client_obj

    def _app(self) -> Any:
        if self._app_obj is None:
            self._app_obj = _modal().App.lookup(
                self.app_name,
                create_if_missing=True,
                environment_name=self.environment_name,
                client=self._client(),
            )
        return self._app_obj

    def close(self) -> None:
        """Release the client's connections (an executor is usable again afterwards)."""
        with self._lock:
            client, self._client_obj, self._app_obj = self._client_obj, None, None
            self._sandboxes.clear()
            self._images.clear()
        if client is not None:
            try:
                client.close()
            except _errors():
                pass

    def _translate(self, e: Exception, what: str) -> ExecutorError:
        exc = adaptors.modal.load("exception")

        if isinstance(e, exc.AuthError):
            return MissingAccess(
                f"Modal rejected the credentials while trying to {what} ({e}): run `modal token "
                "new` or set MODAL_TOKEN_ID/MODAL_TOKEN_SECRET to a valid token"
            )
        if isinstance(e, exc.ConnectionError):
            return MissingAccess(f"cannot reach Modal to {what}: {e}")
        if isinstance(e, exc.NotFoundError):
            return ExecutorError(f"Modal cannot {what}: {e}")
        return ExecutorError(f"Modal failed to {what}: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ checks
    def backend_checks(self) -> list[ReadyCheck]:
        """The GPU name known; a token present, and accepted by Modal (``ClientHello``)."""
        return [lambda: parse_gpu(self.gpu), self.check_token]

    def check_token(self) -> None:
        """MissingAccess when no token is found (``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET``,
        ``~/.modal.toml`` from ``modal token new``) or Modal refuses it."""
        if modal_credentials() is None:
            config = adaptors.modal.load("config").config
            if not config.get("oauth_refresh_token"):
                raise MissingAccess(
                    "no Modal credentials: run `modal token new` (writes ~/.modal.toml) or set "
                    "MODAL_TOKEN_ID/MODAL_TOKEN_SECRET"
                )
        try:
            self._client().hello()
        except ExecutorError:
            raise
        except _errors() as e:
            raise self._translate(e, "verify the token") from None

    # ------------------------------------------------------------------ launch
    def _image(self, requirements: str) -> Any:
        """The image with ``requirements`` (the container's CRF_REQUIREMENTS: crf's, the
        run's extras and --pip) pre-installed, cached per list."""
        modal = _modal()
        reqs = tuple(requirements.split())
        if reqs not in self._images:
            if self.image:
                base = modal.Image.from_registry(self.image)
            else:
                series = f"{sys.version_info.major}.{sys.version_info.minor}"
                base = modal.Image.debian_slim(
                    python_version=series if series in _PYTHON_SERIES else "3.12"
                )
            self._images[reqs] = base.pip_install(*reqs)
        return self._images[reqs]

    def _submit(self, sub: Submission) -> tuple[str, dict[str, Any]]:
        # a bad name fails here, before Modal is asked
        cpu, memory_mb = reservation(self.gpu, self.cpu, self.memory_mb)
        modal = _modal()
        try:
            app = self._app()
            sb = modal.Sandbox.create(
                *sub.argv,
                app=app,
                image=self._image(sub.env[ENV_REQUIREMENTS]),
                env=sub.env,
                secrets=[modal.Secret.from_dict(sub.secrets)] if sub.secrets else [],
                gpu=self.gpu,
                cpu=cpu,
                memory=memory_mb,
                region=self.region,
                timeout=max(1, int(round(self.timeout_s))),
                tags=sub.labels,
                client=self._client(),
            )
        except ExecutorError:
            raise
        except _errors() as e:
            from crf.executors.secrets import redact

            what = "replica" if sub.workers is None else "rollout worker"
            err = self._translate(e, f"create the Sandbox of {what} {sub.rank}")
            raise ExecutorError(redact(str(err), sub.secrets.values())) from None
        with self._lock:
            self._sandboxes[sb.object_id] = sb
        extra = {"app_id": app.app_id, "app_name": self.app_name, "gpu": self.gpu}
        return sb.object_id, extra

    # ------------------------------------------------------------------ status / cancel
    def _sandbox(self, handle: ReplicaHandle) -> Any:
        sb = self._sandboxes.get(handle.backend_id)
        if sb is None:
            try:
                sb = _modal().Sandbox.from_id(handle.backend_id, client=self._client())
            except ExecutorError:
                raise
            except _errors() as e:
                raise self._translate(e, f"find Sandbox {handle.backend_id}") from None
            with self._lock:
                self._sandboxes[handle.backend_id] = sb
        return sb

    def status(self, handle: ReplicaHandle) -> ReplicaStatus:
        sb = self._sandbox(handle)
        try:
            code = sb.poll()
        except _errors() as e:
            raise self._translate(e, f"poll Sandbox {handle.backend_id}") from None
        if code is None:
            return ReplicaStatus(ReplicaState.RUNNING)
        if code == 0:
            return ReplicaStatus(ReplicaState.SUCCEEDED, 0)
        if code == 124:
            return ReplicaStatus(
                ReplicaState.FAILED,
                124,
                f"timed out: Modal stopped the Sandbox after its timeout of {self.timeout_s:g} s",
            )
        if code == 137:
            if self._was_cancelled(handle, sb):
                return ReplicaStatus(ReplicaState.CANCELLED, 137, "cancelled")
            return ReplicaStatus(
                ReplicaState.FAILED, 137, "terminated or killed (exit 137, e.g. out of memory)"
            )
        return ReplicaStatus(ReplicaState.FAILED, code, f"exited with code {code}")

    def _was_cancelled(self, handle: ReplicaHandle, sb: Any) -> bool:
        if handle.backend_id in self._cancelled:
            return True
        try:
            return sb.get_tags().get(TAG_CANCELLED) == "1"
        except _errors():
            return False

    def cancel(self, handle: ReplicaHandle) -> None:
        sb = self._sandbox(handle)
        try:
            if sb.poll() is not None:
                return
            try:  # mark it first, so every process reads "cancelled", not "killed"
                sb.set_tags(
                    {LABEL_RUN: handle.run_id, LABEL_RANK: str(handle.rank), TAG_CANCELLED: "1"}
                )
            except _errors():
                pass
            with self._lock:
                self._cancelled.add(handle.backend_id)
            sb.terminate()
        except _errors() as e:
            raise self._translate(e, f"terminate Sandbox {handle.backend_id}") from None

    # ------------------------------------------------------------------ logs
    def _raw_logs(self, handle: ReplicaHandle, follow: bool) -> Iterator[str]:
        """stdout and stderr lines (each in order; the two interleaved as they arrive).

        A fresh Sandbox object is read each time (a stream reader keeps its position). Without
        ``follow``, a finished replica's output is read to its end and a running one's for
        ``log_wait_s`` at most (until it has been quiet for a second, if sooner).
        """
        client = self._client()
        q: queue.Queue[Any] = queue.Queue()
        stop = threading.Event()

        async def pump() -> None:
            modal = _modal()
            tasks: list[asyncio.Task[None]] = []
            try:
                sb = await modal.Sandbox.from_id.aio(handle.backend_id, client=client)
                finished = sb.returncode is not None
                bounded = not follow and not finished
                started = time.monotonic()
                last = [started]

                async def read(stream: Any) -> None:
                    async for line in stream:
                        last[0] = time.monotonic()
                        q.put(line.rstrip("\n").rstrip("\r"))

                tasks = [asyncio.create_task(read(s)) for s in (sb.stdout, sb.stderr)]
                while not all(t.done() for t in tasks):
                    await asyncio.wait(tasks, timeout=0.2)
                    if stop.is_set():
                        break
                    now = time.monotonic()
                    if bounded and (
                        now - started > self.log_wait_s or now - last[0] > min(1.0, self.log_wait_s)
                    ):
                        break
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        q.put(t.exception())
                        break
            except Exception as e:  # noqa: BLE001 - any error goes to the reading thread
                q.put(e)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                q.put(_END)

        threading.Thread(target=asyncio.run, args=(pump(),), daemon=True).start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise self._translate(item, f"read the logs of Sandbox {handle.backend_id}")
                yield item
        finally:
            stop.set()

    # ------------------------------------------------------------------ reattach
    def find_replicas(self, run_id: str, run_uri: str, world_size: int) -> list[ReplicaHandle]:
        """The running Sandboxes tagged ``crf-run=<run_id>`` in this app, one per rank (the
        newest). Modal lists only running Sandboxes: finished replicas are not found."""
        modal = _modal()
        client = self._client()
        try:
            app = modal.App.lookup(
                self.app_name, environment_name=self.environment_name, client=client
            )
            found: dict[int, ReplicaHandle] = {}
            for sb in modal.Sandbox.list(
                app_id=app.app_id, tags={LABEL_RUN: run_id}, client=client
            ):
                tags = sb.get_tags()
                if tags.get(LABEL_ROLE):
                    continue  # a rollout worker, not a replica
                try:
                    rank = int(tags.get(LABEL_RANK, ""))
                except ValueError:
                    continue
                if rank in found or not 0 <= rank < world_size:
                    continue  # newest first: an older Sandbox of the same rank was replaced
                found[rank] = ReplicaHandle(
                    backend=self.name,
                    run_id=run_id,
                    rank=rank,
                    backend_id=sb.object_id,
                    run_uri=run_uri,
                    world_size=world_size,
                    extra={"app_id": app.app_id, "app_name": self.app_name, "gpu": self.gpu},
                )
        except _errors() as e:
            raise self._translate(e, f"list the Sandboxes of run {run_id}") from None
        if not found:
            raise ExecutorError(
                f"no running Modal Sandbox is tagged {LABEL_RUN}={run_id} in app "
                f"{self.app_name!r} (Modal lists only running Sandboxes; finished replicas "
                "left their results in the store)"
            )
        return [found[r] for r in sorted(found)]

    # ------------------------------------------------------------------ plan / config
    def gpus_per_replica(self) -> int:
        """The N of ``--gpu NAME:N`` (1 without ``:N``; 0 without a GPU)."""
        parsed = parse_gpu(self.gpu)
        return parsed[1] if parsed else 0

    def gpu_bf16(self) -> bool | None:
        parsed = parse_gpu(self.gpu)
        return None if parsed is None else parsed[0] not in _CATALOG["gpus_without_bf16"]

    def describe(self, n_replicas: int, command: Sequence[str] | None, run_uri: str) -> BackendPlan:
        parsed = parse_gpu(self.gpu)
        gpu = f"{parsed[1]}x {parsed[0]}" if parsed else "no GPU"
        cpu, memory_mb = reservation(self.gpu, self.cpu, self.memory_mb)
        given = self.cpu is not None and self.memory_mb is not None
        resources = f"{cpu:g} CPU core(s), {memory_mb / 1024:g} GiB reserved" + (
            "" if given else " (crf's default for this hardware; -o cpu=N -o memory_mb=MIB)"
        )
        env = f", environment {self.environment_name}" if self.environment_name else ""
        return self.plan(
            n_replicas,
            command,
            run_uri,
            where=f"{n_replicas} Modal Sandbox(es) in app {self.app_name!r}{env}",
            image=(self.image or "modal debian_slim") + " + pip_install(crf requirements)",
            hardware=gpu,
            resources=resources,
            hourly_usd=hourly_price(self.gpu, self.cpu, self.memory_mb),
            notes=[
                f"price: Modal list prices of {PRICES_DATE}; CPU and memory bill at max(request, "
                "use), so a busy replica costs more than its reservation"
                + ("; region pinning adds Modal's regional multiplier" if self.region else ""),
                f"timeout: each Sandbox stops after {self.timeout_s:g} s (exit 124)",
            ],
        )

    def config(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "image": self.image,
            "app_name": self.app_name,
            "cpu": self.cpu,
            "memory_mb": self.memory_mb,
            "region": self.region,
            "timeout_s": self.timeout_s,
            "environment_name": self.environment_name,
        }


__all__ = [
    "GPU_TYPES",
    "GPU_USD_PER_S",
    "MAX_TIMEOUT_S",
    "ModalExecutor",
    "hourly_price",
    "reservation",
    "modal_credentials",
    "parse_gpu",
]
