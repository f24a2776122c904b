"""HFJobsExecutor: each replica is one Hugging Face Job, driven by the official ``huggingface_hub``.

Why HF Jobs fits crf: a Job is "run this command in this Docker image on this flavor until it
exits", billed by the minute - exactly a replica. The shared cloud logic
(``crf.executors.cloud``) does the rest: the crf source is uploaded to ``<run>/code/`` and a
short bootstrap on the job's command line fetches it, store credentials and the caller's
``env`` travel as the job's ``secrets=`` (never ``env=``, which ``inspect_job`` shows to anyone
who can see the namespace), and every job is labelled ``crf-run``/``crf-rank`` so
``find_replicas`` can find a run again through ``list_jobs(labels=...)``.

What HF Jobs does not give, and how this backend copes:

* **No exit code.** A job ends COMPLETED (the command exited 0), ERROR (it did not, timed out,
  or could not start; ``status.message`` says which) or CANCELED. A COMPLETED job's outcome is
  the replica's own ``results/<rank>.json`` in the store: ``ok`` (or no result, for a user's
  script that does not write one) is SUCCEEDED with exit code 0, ``failed`` is FAILED. An ERROR
  job is FAILED with the stage message; when that message carries an exit code ("... exit code:
  N") it is reported, so the driver still refuses to restart a replica that exited 2 (a broken
  replica contract). The message wording is not documented by the Hub.
* **Retries are not used.** ``run_job(attempts=...)`` exists in huggingface_hub 2.4, but a
  JobInfo reports only the *configured* retry count, never how many attempts ran, so the driver
  could not count restarts or tell a retried replica from the first one. ``native_restarts`` is
  therefore False: the driver relaunches a failed rank as a new job (``relaunch``) and counts
  it itself, the same on every backend.
* **Namespace.** Every call passes ``namespace=``: without it the client asks ``whoami`` on
  every call, and whoami is strictly rate-limited. The default namespace is the token's user,
  resolved once in ``check_backend`` (and then saved in ``config()`` for reattaching).
* **Polling.** The driver polls every replica twice a second; a job's stage is fetched at most
  once per ``poll_s`` seconds and a terminal stage is never fetched again.

The token (``token=`` or ``HF_TOKEN`` / ``hf auth login``) controls the jobs and is never saved
in ``config()``; it is not given to the replicas either (an ``hf://`` store gets its own
``HF_TOKEN`` through the secrets, like any store credential).
"""

from __future__ import annotations

import difflib
import math
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from huggingface_hub import HfApi, JobHardware, get_token
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import JobNotFoundError

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
from crf.executors.cloud import (
    DEFAULT_TIMEOUT_S,
    LABEL_RANK,
    LABEL_ROLE,
    LABEL_RUN,
    CloudExecutor,
    Submission,
)
from crf.executors.secrets import redact
from crf.layout import ENV_RUN_ID, ENV_RUN_URI, ENV_WORLD_SIZE

#: the cheapest flavor (2 vCPU, 16 GB, $0.01/h): enough to try crf's small jobs; pick a GPU
#: flavor with --flavor for real training
DEFAULT_FLAVOR = "cpu-basic"
#: a stock PyTorch image from Docker Hub (CUDA build: it runs on CPU flavors as well), with
#: the torch crf's floor names, so the bootstrap keeps it
DEFAULT_IMAGE = "pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime"
#: the Hub's own default is 30 minutes; crf always sends timeout_s (a day by default)
HUB_DEFAULT_TIMEOUT_S = 30 * 60

#: flavor -> (what it is, list price in USD per hour per job): dated data in
#: catalog/hf_jobs.json (billed per minute while starting or running).
_CATALOG = catalog.load("hf_jobs")
FLAVORS: dict[str, tuple[str, float]] = {
    name: (row["what"], row["usd_per_hour"]) for name, row in _CATALOG["flavors"].items()
}

#: what the Hub client raises for a refused, failed or unreachable request (HfHubHTTPError,
#: the HTTP library's transport errors, OSError): reported, never a reason to crash the driver
HF_ERRORS = adaptors.huggingface_hub.errors()

_EXIT_CODE = re.compile(r"exit code\D{0,3}(-?\d+)", re.IGNORECASE)
_TOKEN_HELP = (
    "set HF_TOKEN to a Hugging Face token allowed to run Jobs (create one at "
    "https://huggingface.co/settings/tokens), or run `hf auth login` (saves it in "
    "~/.cache/huggingface/token)"
)


def flavor_gpus(flavor: str) -> int:
    """GPUs of an HF Jobs flavor: the catalog's "4x Nvidia L4 ...", else the name's ``xN``
    tail (``l4x4``, ``a10g-largex2``; a flavor newer than the catalog); 0 for ``cpu-*``."""
    what = FLAVORS.get(flavor, ("", 0.0))[0]
    counted = re.match(r"(\d+)x ", what)
    if counted:
        return int(counted.group(1))
    if flavor.startswith("cpu"):
        return 0
    tail = re.search(r"x(\d+)$", flavor)
    return int(tail.group(1)) if tail else 1


def flavor_parts(flavor: str) -> tuple[str, str]:
    """A catalog flavor as (its GPUs, its CPU and memory): ``l4x4`` -> ("4x Nvidia L4 96 GB",
    "48 vCPU, 186 GB RAM"); ("no GPU", ...) for ``cpu-*``; ("", "") for a flavor the
    catalog does not list."""
    what = FLAVORS.get(flavor, ("", 0.0))[0]
    if not what:
        return "", ""
    first, _, rest = what.partition(", ")
    return (first, rest) if re.match(r"\d+x ", first) else ("no GPU", what)


def unknown_flavor(flavor: str, known: list[str]) -> str:
    """The one-line refusal of a flavor name, with the closest known names first: those it
    begins (a GPU's name, ``--gpu A10G``: a10g-large, a10g-small...), shortest first, then
    those spelt alike."""
    begun = sorted((k for k in known if k.startswith(flavor)), key=lambda k: (len(k), k))
    alike = difflib.get_close_matches(flavor, known, n=3, cutoff=0.6)
    close = list(dict.fromkeys([*begun, *alike]))[:3]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (
        f"unknown HF Jobs flavor {flavor!r}; {hint}known flavors: {', '.join(known)} "
        "(see https://huggingface.co/docs/hub/jobs-pricing)"
    )


def known_flavors() -> list[str]:
    """The flavors the installed client knows (its JobHardware enum) plus the price table."""
    return sorted({h.value for h in JobHardware} | set(FLAVORS))


def label_value(text: str) -> str:
    """A Job label value: letters, digits, '-' and '_' only (run ids may also hold '.')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)[:100]


def _status_code(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


class HFJobsExecutor(CloudExecutor):
    """Run replicas as Hugging Face Jobs (one job per replica).

    Args:
        flavor: hardware of each job, e.g. ``cpu-basic`` (default), ``a10g-small``,
            ``h200`` (``crf launch --flavor``); see ``FLAVORS`` for prices.
        image: Docker image (Docker Hub name, or ``hf.co/spaces/<id>``). Default: a stock
            PyTorch image; the bootstrap installs what it lacks (torchft, trl, the store client).
        namespace: user or organisation the jobs run (and are billed) in. Default: the
            token's user, looked up once when the backend is checked.
        token: token for the Jobs API. Default: ``HF_TOKEN`` or the ``hf auth login`` token.
            Never saved anywhere.
        endpoint: Hub URL (default: ``HF_ENDPOINT`` or https://huggingface.co).
        timeout_s: the job's timeout; HF stops (and stops billing) a job that runs longer.
        poll_s: a job's stage is fetched at most once per this many seconds.
    """

    name = "hf"
    kind = "HF Job"
    hardware_option: ClassVar[str] = "flavor"
    native_restarts = False

    def __init__(
        self,
        *,
        flavor: str = DEFAULT_FLAVOR,
        image: str = DEFAULT_IMAGE,
        namespace: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = 2.0,
    ) -> None:
        super().__init__(image=image or DEFAULT_IMAGE, timeout_s=timeout_s)
        self.flavor = str(flavor or DEFAULT_FLAVOR).strip().lower()
        self.namespace = namespace or None
        self._token = token or None
        self.endpoint = (endpoint or hf_constants.ENDPOINT).rstrip("/")
        self.poll_s = float(poll_s)
        self._api_client: HfApi | None = None
        self._flavor_checked = False
        self._seen: dict[str, tuple[float, ReplicaStatus]] = {}
        self._final: dict[str, ReplicaStatus] = {}
        self._status_lock = threading.Lock()
        if self._token:
            self._secret_values.add(self._token)

    # ------------------------------------------------------------------ client
    def _resolve_token(self) -> str:
        token = self._token or get_token()
        if not token:
            raise MissingAccess(f"no Hugging Face token for the Jobs API: {_TOKEN_HELP}")
        self._secret_values.add(token)
        return token

    def _api(self) -> HfApi:
        if self._api_client is None:
            self._api_client = HfApi(endpoint=self.endpoint, token=self._resolve_token())
        return self._api_client

    def _explain(self, e: BaseException, doing: str) -> ExecutorError:
        """An ExecutorError that says what to fix, with no secret in it."""
        code = _status_code(e)
        detail = redact(f"{type(e).__name__}: {e}".replace("\n", " "), self._secret_values)
        if code == 401:
            return MissingAccess(
                f"the Hugging Face token was rejected by {self.endpoint} while {doing} "
                f"(401): {_TOKEN_HELP}"
            )
        if code == 403:
            return MissingAccess(
                f"the Hugging Face token may not {doing} in namespace {self.namespace!r} "
                f"(403): use a token with access to it, or choose another -o namespace=... "
                f"({detail})"
            )
        if code is None:
            return MissingAccess(
                f"cannot reach the Hugging Face Jobs API at {self.endpoint} while {doing}: "
                f"{detail} (check the network, or -o endpoint=...)"
            )
        return ExecutorError(f"Hugging Face Jobs failed while {doing}: {detail}")

    def _ns(self) -> str:
        """The namespace every call passes (the token's user unless one was given)."""
        if self.namespace is None:
            try:
                me = self._api().whoami(cache=True)
            except ExecutorError:
                raise
            except HF_ERRORS as e:
                raise self._explain(e, "looking up your user (whoami)") from None
            self.namespace = str(me["name"])
        return self.namespace

    @staticmethod
    def _handle_ns(handle: ReplicaHandle, fallback: str | None) -> str | None:
        return handle.extra.get("namespace") or fallback

    # ------------------------------------------------------------------ checks
    def _check_flavor(self) -> None:
        """Known to the installed client or, for a newer flavor, to the server."""
        if self._flavor_checked or self.flavor in known_flavors():
            self._flavor_checked = True
            return
        try:
            served = {h.name for h in self._api().list_jobs_hardware()}
        except ExecutorError:
            raise
        except HF_ERRORS:
            served = set()
        if self.flavor not in served:
            raise ExecutorError(unknown_flavor(self.flavor, sorted(served | set(known_flavors()))))
        self._flavor_checked = True

    def backend_checks(self) -> list[ReadyCheck]:
        return [self._check_flavor_name, self._check_account]

    def _check_flavor_name(self) -> None:
        """A flavor this machine cannot vouch for is bad input (ExecutorError, which stops a
        dry run as a misspelt Modal GPU does): one the installed client and crf's catalog do
        not know, when there is no token to ask the Hub whether it is newer than both."""
        if self.flavor in known_flavors() or self._token or get_token():
            return  # known here, or _check_account asks the Hub (list_jobs_hardware)
        raise ExecutorError(unknown_flavor(self.flavor, known_flavors()))

    def _check_account(self) -> None:
        """Token present and accepted, namespace allowed, flavor known - nothing launched."""
        api = self._api()
        try:
            me = api.whoami(cache=True)
        except HF_ERRORS as e:
            raise self._explain(e, "checking the token (whoami)") from None
        user = str(me.get("name"))
        allowed = [user] + [str(o.get("name")) for o in me.get("orgs") or [] if o.get("name")]
        if self.namespace is None:
            self.namespace = user
        elif self.namespace not in allowed:
            raise ExecutorError(
                f"HF Jobs namespace {self.namespace!r} is not yours: the token belongs to "
                f"{user!r}, who can run jobs in {', '.join(allowed)}; fix -o namespace=..."
            )
        self._check_flavor()

    # ------------------------------------------------------------------ launch
    def labels(self, run_id: str, rank: int) -> dict[str, str]:
        return {LABEL_RUN: label_value(run_id), LABEL_RANK: str(rank)}

    def _submit(self, sub: Submission) -> tuple[str, dict[str, Any]]:
        """One ``run_job``; ``sub.max_restarts`` is ignored (no native restarts, see above)."""
        self._check_flavor()
        ns = self._ns()
        try:
            job = self._api().run_job(
                image=str(self.image),
                command=sub.argv,
                env=sub.env,
                secrets=sub.secrets,
                flavor=self.flavor,
                timeout=int(math.ceil(self.timeout_s)),
                labels=sub.labels,
                name=label_value(f"crf-{sub.run_id}-{sub.unit}"),
                namespace=ns,
            )
        except HF_ERRORS as e:
            what = "replica" if sub.workers is None else "rollout worker"
            raise self._explain(e, f"starting {what} {sub.rank}") from None
        return job.id, {"namespace": ns, "url": job.url, "flavor": self.flavor}

    # ------------------------------------------------------------------ status
    def _to_status(self, handle: ReplicaHandle, stage: str, message: str | None) -> ReplicaStatus:
        stage = str(getattr(stage, "value", stage))
        msg = message or ""
        if stage == "SCHEDULING":
            return ReplicaStatus(ReplicaState.PENDING, None, msg or "scheduling")
        if stage == "RUNNING":
            return ReplicaStatus(ReplicaState.RUNNING, None, msg)
        if stage == "COMPLETED":
            result, problem = self.read_result(handle)
            if result is not None and result.get("status") == "failed":
                error = result.get("error") or "the replica reported failure"
                return ReplicaStatus(ReplicaState.FAILED, None, f"job completed; {error}")
            return ReplicaStatus(ReplicaState.SUCCEEDED, 0, problem or "")
        if stage == "ERROR":
            m = _EXIT_CODE.search(msg)
            return ReplicaStatus(
                ReplicaState.FAILED, int(m.group(1)) if m else None, msg or "job ended in ERROR"
            )
        if stage == "CANCELED":
            return ReplicaStatus(ReplicaState.CANCELLED, None, msg or "cancelled")
        if stage == "DELETED":
            return ReplicaStatus(ReplicaState.CANCELLED, None, msg or "the job was deleted")
        return ReplicaStatus(ReplicaState.PENDING, None, f"unknown HF Jobs stage {stage!r}")

    def status(self, handle: ReplicaHandle) -> ReplicaStatus:
        job_id = handle.backend_id
        with self._status_lock:
            final = self._final.get(job_id)
            seen = self._seen.get(job_id)
        if final is not None:
            return final
        if seen is not None and time.monotonic() - seen[0] < self.poll_s:
            return seen[1]
        ns = self._handle_ns(handle, self.namespace) or self._ns()
        try:
            job = self._api().inspect_job(job_id=job_id, namespace=ns)
        except JobNotFoundError:
            st = ReplicaStatus(
                ReplicaState.FAILED, None, f"HF Job {job_id} not found in namespace {ns}"
            )
            with self._status_lock:
                self._final[job_id] = st
            return st
        except ExecutorError:
            raise
        except HF_ERRORS as e:
            if _status_code(e) in (401, 403):
                raise self._explain(e, f"reading job {job_id}") from None
            # a network blip or a 5xx must not stop the driver: keep the last known state
            note = f"status unavailable ({type(e).__name__}); last known state"
            if seen is not None:
                return ReplicaStatus(seen[1].state, seen[1].exit_code, note)
            return ReplicaStatus(ReplicaState.PENDING, None, note)
        st = self._to_status(handle, job.status.stage, job.status.message)
        with self._status_lock:
            if st.terminal:
                self._final[job_id] = st
            self._seen[job_id] = (time.monotonic(), st)
        return st

    # ------------------------------------------------------------------ logs, cancel
    def _raw_logs(self, handle: ReplicaHandle, follow: bool) -> Iterator[str]:
        ns = self._handle_ns(handle, self.namespace) or self._ns()
        try:
            yield from self._api().fetch_job_logs(
                job_id=handle.backend_id, namespace=ns, follow=follow
            )
        except JobNotFoundError:
            return
        except ExecutorError:
            raise
        except HF_ERRORS as e:
            raise self._explain(e, f"reading the logs of job {handle.backend_id}") from None

    def cancel(self, handle: ReplicaHandle) -> None:
        if self.status(handle).terminal:
            return
        ns = self._handle_ns(handle, self.namespace) or self._ns()
        try:
            self._api().cancel_job(job_id=handle.backend_id, namespace=ns)
        except JobNotFoundError:
            pass
        except ExecutorError:
            raise
        except HF_ERRORS as e:
            raise self._explain(e, f"cancelling job {handle.backend_id}") from None
        with self._status_lock:
            self._seen.pop(handle.backend_id, None)

    # ------------------------------------------------------------------ reattach
    def find_replicas(self, run_id: str, run_uri: str, world_size: int) -> list[ReplicaHandle]:
        """The newest job of each rank labelled ``crf-run=<run id>`` in the namespace."""
        from crf.store import normalize_uri

        ns = self._ns()
        want_uri = normalize_uri(run_uri).rstrip("/")
        newest: dict[int, Any] = {}
        try:
            labels = {LABEL_RUN: label_value(run_id)}
            jobs = list(self._api().list_jobs(labels=labels, namespace=ns))
        except HF_ERRORS as e:
            raise self._explain(e, f"listing the jobs of run {run_id}") from None
        for job in jobs:
            env = job.environment or {}
            if env.get(ENV_RUN_ID) != run_id:
                continue  # another run whose id maps to the same label value
            if env.get(ENV_RUN_URI) and normalize_uri(env[ENV_RUN_URI]).rstrip("/") != want_uri:
                continue
            if (job.labels or {}).get(LABEL_ROLE):
                continue  # a rollout worker, not a replica
            try:
                rank = int((job.labels or {})[LABEL_RANK])
            except (KeyError, ValueError):
                continue
            created = job.created_at.timestamp() if job.created_at else 0.0
            if rank not in newest or created >= newest[rank][0]:
                newest[rank] = (created, job)
        if not newest:
            raise ExecutorError(
                f"no HF Jobs labelled {LABEL_RUN}={label_value(run_id)} in namespace {ns} "
                f"at {self.endpoint}"
            )
        handles = []
        for rank in sorted(newest):
            created, job = newest[rank]
            env = job.environment or {}
            handles.append(
                ReplicaHandle(
                    backend=self.name,
                    run_id=run_id,
                    rank=rank,
                    backend_id=job.id,
                    run_uri=env.get(ENV_RUN_URI) or run_uri,
                    world_size=int(env.get(ENV_WORLD_SIZE) or world_size),
                    started_at=created or time.time(),
                    extra={"namespace": ns, "url": job.url, "flavor": str(job.flavor or "")},
                )
            )
        return handles

    # ------------------------------------------------------------------ plan, config
    def gpus_per_replica(self) -> int:
        return flavor_gpus(self.flavor)

    def gpu_bf16(self) -> bool | None:
        if not flavor_gpus(self.flavor):
            return None
        return self.flavor not in _CATALOG["flavors_without_bf16"]

    def describe(self, n_replicas: int, command: Sequence[str] | None, run_uri: str) -> BackendPlan:
        price = FLAVORS.get(self.flavor, (None, None))[1]
        gpus, resources = flavor_parts(self.flavor)
        ns = self.namespace or "your user (looked up at launch)"
        notes = [
            "no native retries: the driver relaunches a failed replica as a new job "
            "(--max-restarts)",
            "billed per minute while a job is starting or running; the timeout stops it",
        ]
        if price is None:
            notes.append(f"no published price for flavor {self.flavor!r} in crf's table")
        return self.plan(
            n_replicas,
            command,
            run_uri,
            where=f"{n_replicas} Hugging Face Job(s) in namespace {ns} at {self.endpoint}",
            image=str(self.image),
            hardware=f"{self.flavor} ({gpus})" if gpus else self.flavor,
            resources=f"{resources} (the flavor's)" if resources else "the flavor's",
            hourly_usd=price,
            notes=notes,
        )

    def config(self) -> dict[str, Any]:
        """Options that rebuild this executor elsewhere; the token is never among them."""
        return {
            "flavor": self.flavor,
            "image": self.image,
            "namespace": self.namespace,
            "endpoint": self.endpoint,
            "timeout_s": self.timeout_s,
        }


__all__ = [
    "DEFAULT_FLAVOR",
    "DEFAULT_IMAGE",
    "FLAVORS",
    "HFJobsExecutor",
    "known_flavors",
    "label_value",
]
