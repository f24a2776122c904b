"""SageMakerExecutor: each replica is one Amazon SageMaker training job, driven through boto3.

Why training jobs, one per replica: a training job is SageMaker's pay-per-second unit of "run
this container on that instance until it exits", with CloudWatch logs, tags, a stop call and a
hard time limit - exactly the container contract every crf backend needs. Replicas meet only
in the store, never over the network, so each job is a single instance (``InstanceCount=1``)
and none of SageMaker's distributed-training machinery is involved. Only boto3 is used (not
the ``sagemaker`` SDK): five API calls do not justify a heavy dependency with its own opinions
about code upload.

How the code gets in. SageMaker caps every ``ContainerEntrypoint``/``ContainerArguments`` item
at 256 characters, far less than the shared ``BOOTSTRAP`` (bootstrap.py), while ``Environment``
values may hold 512. So the bootstrap - preceded by a short step that loads the run's secret -
travels base64-encoded in ``CRF_BOOT_0..k`` environment chunks (public code, no secret), the
entrypoint is a one-line loader that joins and runs them (``python -c LOADER``), and the
replica command is ``ContainerArguments``. Everything else is the shared cloud path: the crf
source is uploaded to ``<run>/code/`` and fetched by the bootstrap.

Secrets. ``Environment`` is shown to anyone allowed to ``DescribeTrainingJob``, so no secret
ever goes there. For an ``s3://`` store the job's IAM execution role (``role_arn``, required)
grants the store access, exactly as it grants SageMaker itself access to S3, so the caller's
AWS keys are dropped rather than shipped. Whatever else a replica needs - a Hugging Face
token, a GCS key file, an S3 endpoint override, the caller's ``env`` - goes into one AWS
Secrets Manager secret per launch (``crf/<run-id>/<nonce>``, tagged ``crf-run``); the job's
``Environment`` carries only its ARN (``CRF_SECRET_ARN``), the container fetches it with its
role before the bootstrap runs, and ``collect`` deletes it once the run's replicas have ended
(also when a later ``crf status``/``crf cancel`` gathers a detached run). With a plain AWS S3
store no secret is created at all.

Restarts (why ``native_restarts`` is False). SageMaker's ``RetryStrategy`` retries a job only
after a SageMaker *InternalServerError*, never after the container itself fails (a crash, an
OOM kill, a store outage). Claiming native restarts would leave those replicas dead, so the
driver relaunches failed ranks itself (each attempt is a new job: names are single-use), and
``max_restarts`` is additionally passed as ``RetryStrategy`` so platform faults are retried
inside the same job. Those internal retries are visible only as extra ``Starting`` entries in
the job's status transitions, reported as ``ReplicaStatus.restarts``.

Logs are read from CloudWatch Logs, group ``/aws/sagemaker/TrainingJobs``, streams
``<job-name>/algo-1-<epoch>`` (one per container start).
"""

from __future__ import annotations

import base64
import difflib
import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import boto3  # imported through adaptors.import_with_extra: a missing boto3 names the extra
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from crf import jsonsafe
from crf.executors import adaptors, catalog
from crf.executors.base import (
    BackendPlan,
    Entrypoint,
    ExecutorError,
    MissingAccess,
    ReadyCheck,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    Workers,
)
from crf.executors.bootstrap import BOOTSTRAP, LOADER, SECRET_STEP
from crf.executors.cloud import LABEL_RANK, LABEL_ROLE, LABEL_RUN, CloudExecutor, Submission
from crf.executors.secrets import MissingCredentials, redact, scheme_of, store_secrets
from crf.layout import ENV_RUN_URI

DEFAULT_INSTANCE_TYPE = "ml.g5.xlarge"  # one A10G (24 GB): the cheapest current-gen GPU type
DEFAULT_VOLUME_GB = 30
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
#: where ``role_arn`` is read from when the option is not given
ROLE_ARN_ENV = "CRF_SAGEMAKER_ROLE_ARN"
ENV_SECRET_ARN = "CRF_SECRET_ARN"
ENV_BOOT_N, ENV_BOOT_PREFIX = "CRF_BOOT_N", "CRF_BOOT_"
#: SageMaker's request limits (CreateTrainingJob API reference)
MAX_ARG_CHARS, MAX_ENV_VALUE_CHARS, MAX_ENV_ENTRIES, MAX_ARGS = 256, 512, 100, 100
MAX_JOB_NAME = 63
MAX_RETRY_ATTEMPTS = 30
#: how old a DescribeTrainingJob answer ``status()`` may reuse
STATUS_MAX_AGE_S = 1.0
#: store variables the execution role makes unnecessary for an s3:// store
ROLE_REPLACES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)

_ROLE_ARN_RE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
_INSTANCE_RE = re.compile(r"^ml\.[a-z0-9]+(?:-[a-z0-9]+)*\.[a-z0-9]+$")
_JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_EXIT_RE = re.compile(r"exit(?:ed with)?[ _-]?(?:code|status)[\s:=]+(-?\d+)", re.IGNORECASE)

# SageMaker *training* on-demand list prices, USD per instance-hour, us-east-1: dated data in
# catalog/sagemaker.json. Other regions cost more or less; managed spot bills the spot price.
_CATALOG = catalog.load("sagemaker")
PRICES_DATE: str = _CATALOG.as_of
HOURLY_USD: dict[str, float] = dict(_CATALOG["usd_per_hour"])
#: NVIDIA GPUs per GPU instance type (--procs-per-replica's default)
GPUS_PER_INSTANCE: dict[str, int] = dict(_CATALOG["gpus_per_instance"])
#: (vCPUs, GiB of memory) per instance type: each replica's resources in the plan
VCPU_MEMORY_GIB: dict[str, tuple[int, int]] = {
    k: (int(v[0]), int(v[1])) for k, v in _CATALOG["vcpu_memory_gib"].items()
}
#: managed-spot prices where one is recorded (a spot run of another type: on-demand, labelled)
SPOT_HOURLY_USD: dict[str, float] = dict(_CATALOG["spot_usd_per_hour"])

# The AWS PyTorch training Deep Learning Container (boto3 has no image lookup; the sagemaker
# SDK's image_uris table is where these come from), Python 3.12. Its torch 2.8 is older than
# crf's floor, so the bootstrap installs a newer torch at start, with the rest (torchft, trl,
# s3fs...); an image with torch at crf's floor or newer (--image) starts without it.
DLC_REPOSITORY = "pytorch-training"
DLC_TAG_GPU = "2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker"
DLC_TAG_CPU = "2.8.0-cpu-py312-ubuntu22.04-sagemaker"
DLC_ACCOUNT = "763104351884"
_DLC_ACCOUNTS = {  # regions whose DLCs live in another AWS account
    "af-south-1": "626614931356",
    "ap-east-1": "871362719292",
    "ap-northeast-3": "364406365360",
    "ap-southeast-3": "907027046896",
    "eu-south-1": "692866216735",
    "il-central-1": "780543022126",
    "me-central-1": "914824155844",
    "me-south-1": "217643126080",
    "cn-north-1": "727897471807",
    "cn-northwest-1": "727897471807",
}


def boot_environment() -> dict[str, str]:
    """``CRF_BOOT_N`` and ``CRF_BOOT_<i>``: SECRET_STEP + BOOTSTRAP, base64, in chunks that fit
    SageMaker's 512-character limit on environment values."""
    data = base64.b64encode((SECRET_STEP + BOOTSTRAP).encode()).decode()
    chunks = [data[i : i + MAX_ENV_VALUE_CHARS] for i in range(0, len(data), MAX_ENV_VALUE_CHARS)]
    env = {f"{ENV_BOOT_PREFIX}{i}": c for i, c in enumerate(chunks)}
    env[ENV_BOOT_N] = str(len(chunks))
    return env


def slug(run_id: str) -> str:
    """A run id as job-name characters ([a-zA-Z0-9-])."""
    return re.sub(r"[^a-zA-Z0-9]+", "-", run_id).strip("-") or "run"


def job_name(run_id: str, rank: int | str) -> str:
    """``crf-<run>-r<rank>-<nonce>`` (a rollout worker's rank is ``w<k>``): valid (<= 63
    chars, [a-zA-Z0-9-]) and new on every call, because a training job name can never be
    used twice in an account and region."""
    tail = f"-r{rank}-{uuid.uuid4().hex[:6]}"
    name = f"crf-{slug(run_id)[: MAX_JOB_NAME - 4 - len(tail)]}{tail}"
    assert _JOB_NAME_RE.fullmatch(name), name
    return name


def known_instance_types() -> list[str]:
    """The training instance types the installed botocore knows (its API model's enum)."""
    try:
        session = adaptors.botocore.load("session")
        model = session.get_session().get_service_model("sagemaker")
        shape = model.operation_model("CreateTrainingJob").input_shape
        return list(shape.members["ResourceConfig"].members["InstanceType"].enum)
    except (*adaptors.botocore.errors(), KeyError, AttributeError):
        # a botocore without the model, or whose model is shaped differently: the priced ones
        return sorted(HOURLY_USD)


def has_gpu(instance_type: str) -> bool:
    """ml.p* and ml.g* families carry NVIDIA GPUs; the rest (m, c, r, t, trn...) do not."""
    family = instance_type.split(".")[1] if instance_type.count(".") == 2 else ""
    return family[:1] in ("p", "g")


def instance_gpus(instance_type: str) -> int:
    """GPUs of an instance type: the catalog's count, 1 for a GPU type it does not list."""
    if not has_gpu(instance_type):
        return 0
    return GPUS_PER_INSTANCE.get(instance_type, 1)


def default_image(region: str, instance_type: str) -> str:
    """The AWS PyTorch training DLC for ``region``, GPU or CPU build by instance type."""
    account = _DLC_ACCOUNTS.get(region, DLC_ACCOUNT)
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    tag = DLC_TAG_GPU if has_gpu(instance_type) else DLC_TAG_CPU
    return f"{account}.dkr.ecr.{region}.{domain}/{DLC_REPOSITORY}:{tag}"


def exit_code_from(reason: str) -> int | None:
    """The exit code SageMaker quotes in a FailureReason, if it quotes one."""
    m = _EXIT_RE.search(reason or "")
    return int(m.group(1)) if m else None


_NO_CREDENTIALS = (
    "no AWS credentials for SageMaker: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
    "AWS_PROFILE (`aws configure` writes ~/.aws/credentials; `aws sso login`)"
)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _msg(e: ClientError) -> str:
    err = e.response.get("Error", {})
    return f"{err.get('Code', '?')}: {err.get('Message', e)}"


#: error codes AWS answers for credentials it does not accept or a caller it does not allow:
#: they repeat on every call, so commands say them as missing access, not as a replica's state
_ACCESS_CODES = frozenset({
    "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken",
    "ExpiredTokenException", "InvalidSignatureException", "SignatureDoesNotMatch",
    "AccessDenied", "AccessDeniedException", "MissingAuthenticationTokenException",
})  # fmt: skip


def _call_error(e: ClientError | BotoCoreError, doing: str) -> ExecutorError:
    """A refused or failed SageMaker call as an ExecutorError: MissingAccess (what to fix)
    for credentials AWS rejects, none at all, or an endpoint out of reach."""
    if isinstance(e, NoCredentialsError):
        return MissingAccess(_NO_CREDENTIALS)
    if isinstance(e, BotoCoreError):
        return MissingAccess(f"cannot reach SageMaker to {doing}: {e}")
    if _code(e) in _ACCESS_CODES:
        return MissingAccess(
            f"AWS refused to {doing} ({_msg(e)}): check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or refresh them (`aws sso login`), "
            "and that they may use SageMaker"
        )
    return ExecutorError(f"cannot {doing}: {_msg(e)}")


def _did_you_mean(name: str, known: list[str], cutoff: float) -> str:
    """``did you mean A or B? `` with the known names closest to ``name`` (empty if none)."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=cutoff)
    return f"did you mean {' or '.join(close)}? " if close else ""


def _optional_float(value: Any, what: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ExecutorError(f"{what} must be a number of seconds (got {value!r})") from None


class SageMakerExecutor(CloudExecutor):
    """Run each replica as a SageMaker training job (one instance each).

    Args:
        instance_type: per-replica instance, ``ml.<family>.<size>`` (``--instance-type``).
        image: container image; default: the AWS PyTorch training DLC for the region.
        role_arn: the IAM execution role the jobs run as (required; or ``CRF_SAGEMAKER_ROLE_ARN``).
            It must be assumable by sagemaker.amazonaws.com and may read/write the store.
        region: AWS region (default: the boto3 default region).
        volume_gb: the job's EBS volume size.
        spot: use managed spot training (cheaper, may wait for capacity or be interrupted).
        max_wait_s: with ``spot``, how long a job may wait for capacity plus run
            (default ``timeout_s`` + 1 h).
        timeout_s: each job's ``MaxRuntimeInSeconds`` (default: a day).
        output_path: the S3 prefix SageMaker requires for job output (crf writes none there);
            default ``<run>/sagemaker`` for an s3:// store, required otherwise.
        poll_s: how often ``logs(follow=True)`` polls CloudWatch.
    """

    name = "sagemaker"
    kind = "SageMaker training job"
    hardware_option: ClassVar[str] = "instance_type"
    native_restarts = False  # see the module docstring: RetryStrategy skips container failures

    def __init__(
        self,
        instance_type: str = DEFAULT_INSTANCE_TYPE,
        *,
        image: str | None = None,
        role_arn: str | None = None,
        region: str | None = None,
        volume_gb: int = DEFAULT_VOLUME_GB,
        spot: bool = False,
        max_wait_s: float | None = None,
        timeout_s: float | None = None,
        output_path: str | None = None,
        poll_s: float = 2.0,
    ) -> None:
        super().__init__(image=image, timeout_s=_optional_float(timeout_s, "timeout_s"))
        self.instance_type = str(instance_type).strip()
        if not _INSTANCE_RE.fullmatch(self.instance_type):
            raise ExecutorError(
                f"{instance_type!r} is not a SageMaker instance type; they look like "
                f"ml.<family>.<size>, e.g. --instance-type {DEFAULT_INSTANCE_TYPE}"
            )
        self.role_arn = role_arn or os.environ.get(ROLE_ARN_ENV) or None
        if self.role_arn and not _ROLE_ARN_RE.fullmatch(self.role_arn):
            raise ExecutorError(
                f"role_arn {self.role_arn!r} is not an IAM role ARN; it looks like "
                "arn:aws:iam::123456789012:role/MySageMakerRole"
            )
        if not region:
            try:  # AWS_DEFAULT_REGION / AWS_REGION / the profile's region
                region = boto3.session.Session().region_name
            except BotoCoreError:  # e.g. AWS_PROFILE names a missing profile: say so later
                region = None
        self.region = region or None
        self.volume_gb = int(volume_gb)
        if self.volume_gb < 1:
            raise ExecutorError(f"volume_gb must be >= 1 (got {volume_gb})")
        self.spot = bool(spot)
        self.max_wait_s = _optional_float(max_wait_s, "max_wait_s")
        if self.max_wait_s is not None and not self.spot:
            raise ExecutorError("max_wait_s only applies to spot jobs: add -o spot=true")
        if self.spot and self.max_wait_s is not None and self.max_wait_s < self.timeout_s:
            raise ExecutorError(
                f"max_wait_s ({self.max_wait_s:.0f}) must be at least the job timeout "
                f"({self.timeout_s:.0f} s): it counts the wait for spot capacity plus the run"
            )
        if output_path is not None and not str(output_path).startswith("s3://"):
            raise ExecutorError(f"output_path must be an s3:// URI (got {output_path!r})")
        self.output_path = output_path
        self.poll_s = float(poll_s)
        self._clients: dict[tuple[str, str], Any] = {}
        self._run_secrets: dict[str, tuple[str, str]] = {}  # run id -> (ARN, payload)
        self._retries: dict[str, int] = {}  # run id -> RetryStrategy attempts
        self._described: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self._secrets_read: set[str] = set()  # ARNs whose values are known (for redaction)

    # ------------------------------------------------------------------ AWS plumbing
    def _region(self) -> str:
        if not self.region:
            raise MissingAccess(
                "no AWS region for SageMaker: pass --region (e.g. --region us-east-1) or set "
                "AWS_DEFAULT_REGION"
            )
        return self.region

    def _client(self, service: str, region: str | None = None) -> Any:
        region = region or self._region()
        with self._lock:
            client = self._clients.get((service, region))
            if client is None:
                client = boto3.session.Session().client(
                    service,
                    region_name=region,
                    config=Config(retries={"max_attempts": 6, "mode": "standard"}),
                )
                self._clients[(service, region)] = client
        return client

    def _handle_region(self, handle: ReplicaHandle) -> str:
        return str(handle.extra.get("region") or self._region())

    def _image(self, region: str | None = None) -> str:
        if self.image:
            return self.image
        region = region or self.region
        if not region:
            return default_image("<region>", self.instance_type)
        return default_image(region, self.instance_type)

    # ------------------------------------------------------------------ checks
    def check_command(
        self, entrypoint: Entrypoint, entrypoint_args: Sequence[str] = ()
    ) -> list[str]:
        """The replica command, which must fit SageMaker's ContainerArguments limits."""
        cmd = super().check_command(entrypoint, entrypoint_args)
        if len(cmd) > MAX_ARGS:
            raise ExecutorError(
                f"SageMaker allows at most {MAX_ARGS} container arguments (the command has "
                f"{len(cmd)}); put them in a script or a config file"
            )
        for arg in cmd:
            if len(arg) > MAX_ARG_CHARS or "\n" in arg or "\r" in arg:
                raise ExecutorError(
                    f"SageMaker limits each container argument to one line of at most "
                    f"{MAX_ARG_CHARS} characters; {arg[:40]!r}... does not fit: put it in a "
                    "script (or a job option) instead"
                )
        return cmd

    def _check_region(self) -> None:
        """A region botocore lists for SageMaker (every partition): a misspelt one would
        otherwise show only as an STS endpoint that cannot be reached
        (``sts.us-east-9.amazonaws.com``)."""
        if not self.region:
            return
        session = boto3.session.Session()
        known = sorted({
            r for p in session.get_available_partitions()
            for r in session.get_available_regions("sagemaker", partition_name=p)
        })  # fmt: skip
        if not known or self.region in known:
            return
        raise ExecutorError(
            f"unknown AWS region {self.region!r} for SageMaker; "
            f"{_did_you_mean(self.region, known, 0.6)}(boto3 "
            f"{boto3.__version__} knows {len(known)} SageMaker regions; upgrade it for newer ones)"
        )

    def _check_instance_type(self) -> None:
        known = known_instance_types()
        if self.instance_type in known:
            return
        raise ExecutorError(
            f"unknown SageMaker training instance type {self.instance_type!r}; "
            f"{_did_you_mean(self.instance_type, known, 0.75)}"
            f"e.g. ml.g5.xlarge (1 A10G), ml.g4dn.xlarge (1 T4), ml.m5.xlarge (CPU). "
            f"(boto3 {boto3.__version__} knows {len(known)} types; upgrade it for newer ones)"
        )

    def backend_checks(self) -> list[ReadyCheck]:
        """Instance type known; a role and a known region given; AWS accepts the credentials and
        lets them use SageMaker - each said apart."""
        return [
            self._check_instance_type, self._check_role, self._region, self._check_region,
            self._check_aws,
        ]  # fmt: skip

    def ready_checks(self, run_uri: str) -> list[ReadyCheck]:
        """The shared checks, then an S3 location for the jobs' output."""
        return [*super().ready_checks(run_uri), lambda: self._output_path(run_uri)]

    def missing(self, run_uri: str) -> list[str]:
        """The shared list, with the AWS credentials said once: an s3:// store's and
        SageMaker's are the same ones, from the same variables or profile."""
        found = super().missing(run_uri)
        if _NO_CREDENTIALS not in found or scheme_of(run_uri) != "s3":
            return found
        try:
            store_secrets(run_uri)
            return found
        except MissingCredentials as e:
            store_line = str(e)
        if store_line not in found:
            return found
        both = _NO_CREDENTIALS.replace("for SageMaker", f"(for SageMaker and the store {run_uri})")
        return [both if line == _NO_CREDENTIALS else line for line in found if line != store_line]

    def _check_role(self) -> None:
        if not self.role_arn:
            raise MissingAccess(
                "SageMaker jobs need an IAM execution role: -o role_arn=arn:aws:iam::<account>:"
                f"role/<name> (or set {ROLE_ARN_ENV}); see docs/backends/sagemaker.md"
            )

    def _check_aws(self) -> None:
        """The credentials found and accepted (STS), and allowed to use SageMaker in the
        region (without a region, ``_region`` says so and only their presence is checked)."""
        try:
            found = boto3.session.Session().get_credentials() is not None
        except BotoCoreError:  # e.g. AWS_PROFILE names a missing profile: STS says which
            found = True
        if not found:
            raise MissingAccess(_NO_CREDENTIALS)
        if not self.region:
            return
        region = self._region()
        try:
            ident = self._client("sts", region).get_caller_identity()
        except NoCredentialsError:
            raise MissingAccess(_NO_CREDENTIALS) from None
        except ClientError as e:
            raise MissingAccess(
                f"AWS rejected your credentials ({_msg(e)}); check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or refresh them (`aws sso login`)"
            ) from None
        except BotoCoreError as e:
            raise MissingAccess(f"cannot reach AWS STS in {region}: {e}") from None
        try:
            self._client("sagemaker", region).list_training_jobs(MaxResults=1)
        except ClientError as e:
            raise MissingAccess(
                f"{ident.get('Arn', 'your AWS identity')} cannot use SageMaker in {region} "
                f"({_msg(e)}); it needs sagemaker:CreateTrainingJob/DescribeTrainingJob/"
                f"StopTrainingJob/ListTrainingJobs/ListTags/AddTags and iam:PassRole on "
                f"{self.role_arn}"
            ) from None
        except BotoCoreError as e:
            raise MissingAccess(f"cannot reach SageMaker in {region}: {e}") from None

    def _output_path(self, run_uri: str) -> str:
        if self.output_path:
            return self.output_path
        if scheme_of(run_uri) == "s3":
            return f"{run_uri.rstrip('/')}/sagemaker"
        raise MissingAccess(
            "SageMaker requires an S3 location for job output (crf writes nothing there, "
            f"but the API insists): add -o output_path=s3://<bucket>/<prefix> (the store "
            f"{run_uri} is not on S3)"
        )

    # ------------------------------------------------------------------ secrets
    def secrets_for(self, run_uri: str, env: Mapping[str, str] | None) -> dict[str, str]:
        """What goes into the run's Secrets Manager secret: the store bundle minus what the
        execution role replaces (AWS keys and region for an s3:// store), plus ``env``.
        Everything dropped is still redacted from logs."""
        try:
            bundle = store_secrets(run_uri)
        except MissingCredentials as e:
            raise ExecutorError(str(e)) from None
        with self._lock:
            self._secret_values.update(bundle.values())
        if scheme_of(run_uri) == "s3":
            bundle = {k: v for k, v in bundle.items() if k not in ROLE_REPLACES}
        bundle.update({str(k): str(v) for k, v in (env or {}).items()})
        with self._lock:
            self._secret_values.update(bundle.values())
        return bundle

    def _secret_name(self, run_id: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9/_+=.@-]", "-", run_id)[:400]
        return f"crf/{safe}/{uuid.uuid4().hex[:8]}"

    def _ensure_secret(self, run_id: str, secrets: Mapping[str, str]) -> str | None:
        """The ARN of this launch's secret (created on first use); None when nothing is
        secret (a plain AWS S3 store: the role does it all)."""
        if not secrets:
            return None
        payload = jsonsafe.dumps(dict(secrets), sort_keys=True)
        with self._lock:
            known = self._run_secrets.get(run_id)
        if known is not None and known[1] == payload:
            return known[0]
        try:
            arn = self._client("secretsmanager").create_secret(
                Name=self._secret_name(run_id),
                SecretString=payload,
                Description=f"crf run {run_id}: what its SageMaker replicas need besides their "
                "role; deleted when the run is collected",
                Tags=[{"Key": LABEL_RUN, "Value": run_id}],
            )["ARN"]
        except ClientError as e:
            raise ExecutorError(
                f"could not create the run's Secrets Manager secret ({_msg(e)}); your identity "
                "needs secretsmanager:CreateSecret/TagResource/DeleteSecret on crf/*"
            ) from None
        with self._lock:
            self._run_secrets[run_id] = (arn, payload)
            self._secrets_read.add(arn)
        return arn

    def _delete_secret(self, arn: str) -> bool:
        region = arn.split(":")[3] if arn.count(":") >= 6 else None
        try:
            self._client("secretsmanager", region).delete_secret(
                SecretId=arn, ForceDeleteWithoutRecovery=True
            )
        except ClientError as e:
            if _code(e) != "ResourceNotFoundException":
                return False
        except BotoCoreError:
            return False
        with self._lock:
            for run_id, (known, _) in list(self._run_secrets.items()):
                if known == arn:
                    del self._run_secrets[run_id]
        return True

    def delete_secrets(self, handles: Sequence[ReplicaHandle]) -> list[str]:
        """Delete the Secrets Manager secrets these replicas were started with (best effort;
        works on handles from another process too: the ARN is in the handle, or in the
        job's Environment). Returns the ARNs deleted."""
        arns: set[str] = set()
        for h in handles:
            if "secret_arn" in h.extra:
                arn = h.extra.get("secret_arn")
            else:
                try:
                    arn = (self._describe(h).get("Environment") or {}).get(ENV_SECRET_ARN)
                except (ClientError, BotoCoreError, ExecutorError):
                    arn = None
            if arn:
                arns.add(str(arn))
        return [arn for arn in sorted(arns) if self._delete_secret(arn)]

    # ------------------------------------------------------------------ launch
    def container_argv(self, command: Sequence[str]) -> list[str]:
        """``python -c LOADER <command>``: the first three items are the ContainerEntrypoint,
        the command is ContainerArguments; the bootstrap itself is in the Environment."""
        return ["python", "-c", LOADER, *command]

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
        """As CloudExecutor's, plus: a secret created by a launch that fails is deleted."""
        with self._lock:
            before = {arn for arn, _ in self._run_secrets.values()}
        try:
            return super().launch_replicas(
                n_replicas,
                entrypoint,
                entrypoint_args,
                env,
                run_uri=run_uri,
                run_id=run_id,
                ranks=ranks,
                max_restarts=max_restarts,
                plain_env=plain_env,
                workers=workers,
            )
        except BaseException:
            with self._lock:
                created = {arn for arn, _ in self._run_secrets.values()} - before
            for arn in created:
                self._delete_secret(arn)
            raise

    def _environment(self, env: Mapping[str, str], secret_arn: str | None, region: str
                     ) -> dict[str, str]:  # fmt: skip
        out = dict(env)
        out["AWS_DEFAULT_REGION"] = region  # public; the role's credentials need a region
        if secret_arn:
            out[ENV_SECRET_ARN] = secret_arn
        out.update(boot_environment())
        if len(out) > MAX_ENV_ENTRIES:
            raise ExecutorError(f"too many environment variables for SageMaker ({len(out)})")
        for key, value in out.items():
            if not _ENV_KEY_RE.fullmatch(key) or len(value) > MAX_ENV_VALUE_CHARS:
                raise ExecutorError(
                    f"SageMaker cannot pass environment variable {key} (names are [A-Za-z_]"
                    f"[A-Za-z0-9_]*, values at most {MAX_ENV_VALUE_CHARS} characters)"
                )
        return out

    def _submit(self, sub: Submission) -> tuple[str, dict[str, Any]]:
        if not self.role_arn:
            raise ExecutorError("no role_arn: SageMaker jobs need an IAM execution role")
        region = self._region()
        output = self._output_path(sub.env[ENV_RUN_URI])
        secret_arn = self._ensure_secret(sub.run_id, sub.secrets)
        name = job_name(sub.run_id, sub.unit)
        stopping: dict[str, int] = {"MaxRuntimeInSeconds": max(1, math.ceil(self.timeout_s))}
        if self.spot:
            wait = self.max_wait_s if self.max_wait_s is not None else self.timeout_s + 3600
            stopping["MaxWaitTimeInSeconds"] = max(stopping["MaxRuntimeInSeconds"], math.ceil(wait))
        if sub.max_restarts > 0:  # relaunches (max_restarts=0) keep the run's first setting
            self._retries[sub.run_id] = min(int(sub.max_restarts), MAX_RETRY_ATTEMPTS)
        request: dict[str, Any] = {
            "TrainingJobName": name,
            "AlgorithmSpecification": {
                "TrainingImage": self._image(region),
                "TrainingInputMode": "File",
                "ContainerEntrypoint": sub.argv[:3],
                "ContainerArguments": sub.argv[3:],
            },
            "RoleArn": self.role_arn,
            "OutputDataConfig": {"S3OutputPath": output},
            "ResourceConfig": {
                "InstanceType": self.instance_type,
                "InstanceCount": 1,
                "VolumeSizeInGB": self.volume_gb,
            },
            "StoppingCondition": stopping,
            "EnableManagedSpotTraining": self.spot,
            "Environment": self._environment(sub.env, secret_arn, region),
            "Tags": [{"Key": k, "Value": v} for k, v in sub.labels.items()],
        }
        if self._retries.get(sub.run_id):
            request["RetryStrategy"] = {"MaximumRetryAttempts": self._retries[sub.run_id]}
        try:
            created = self._client("sagemaker", region).create_training_job(**request)
        except ClientError as e:
            msg = redact(_msg(e), self._secret_values)
            raise ExecutorError(f"SageMaker refused training job {name}: {msg}") from None
        extra = {
            "job_name": name,
            "job_arn": created.get("TrainingJobArn"),
            "region": region,
            "secret_arn": secret_arn,
            "instance_type": self.instance_type,
        }
        return name, extra

    # ------------------------------------------------------------------ status
    def _describe(self, handle: ReplicaHandle, max_age_s: float = 0.0) -> dict[str, Any]:
        """DescribeTrainingJob, or an answer at most ``max_age_s`` old: the driver asks for
        every replica's status twice a second, more than SageMaker's describe quota likes."""
        key = (self._handle_region(handle), handle.backend_id)
        now = time.monotonic()
        with self._lock:
            cached = self._described.get(key)
        if cached is not None and now - cached[0] <= max_age_s:
            return cached[1]
        client = self._client("sagemaker", key[0])
        desc = client.describe_training_job(TrainingJobName=handle.backend_id)
        with self._lock:
            self._described[key] = (now, desc)
        return desc

    @staticmethod
    def status_from(desc: Mapping[str, Any]) -> ReplicaStatus:
        """A DescribeTrainingJob answer as a ReplicaStatus."""
        state = desc.get("TrainingJobStatus")
        secondary = str(desc.get("SecondaryStatus") or "")
        starts = sum(
            1 for t in desc.get("SecondaryStatusTransitions") or [] if t.get("Status") == "Starting"
        )
        restarts = max(0, starts - 1)
        if state == "InProgress":
            running = secondary in ("Training", "Uploading")
            return ReplicaStatus(
                ReplicaState.RUNNING if running else ReplicaState.PENDING, None, secondary, restarts
            )
        if state == "Completed":  # SageMaker completes a job only when its container exits 0
            return ReplicaStatus(ReplicaState.SUCCEEDED, 0, "", restarts)
        if state == "Failed":
            reason = str(desc.get("FailureReason") or "failed")
            return ReplicaStatus(ReplicaState.FAILED, exit_code_from(reason), reason, restarts)
        if state in ("Stopped", "Stopping"):
            if secondary in ("MaxRuntimeExceeded", "MaxWaitTimeExceeded"):
                limit = (desc.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds")
                msg = f"stopped by SageMaker: {secondary} (MaxRuntimeInSeconds={limit})"
                return ReplicaStatus(ReplicaState.FAILED, 124, msg, restarts)
            msg = "stopped" if state == "Stopped" else "stopping"
            return ReplicaStatus(ReplicaState.CANCELLED, None, msg, restarts)
        return ReplicaStatus(ReplicaState.FAILED, None, f"SageMaker status {state}", restarts)

    def status(self, handle: ReplicaHandle) -> ReplicaStatus:
        try:
            desc = self._describe(handle, STATUS_MAX_AGE_S)
        except ClientError as e:
            if _code(e) in ("ValidationException", "ResourceNotFound"):
                return ReplicaStatus(
                    ReplicaState.FAILED,
                    None,
                    f"training job {handle.backend_id} not found in "
                    f"{self._handle_region(handle)} ({_msg(e)})",
                )
            raise _call_error(e, f"describe {handle.backend_id}") from None
        except BotoCoreError as e:
            raise _call_error(e, f"describe {handle.backend_id}") from None
        return self.status_from(desc)

    # ------------------------------------------------------------------ logs
    def _streams(self, logs: Any, job: str) -> list[str]:
        """The job's log streams (one per container start), oldest first."""
        found: list[tuple[int, str]] = []
        kw: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{job}/"}
        while True:
            try:
                page = logs.describe_log_streams(**kw)
            except ClientError as e:
                if _code(e) == "ResourceNotFoundException":  # no job has logged yet
                    return []
                raise
            for s in page.get("logStreams", []):
                found.append((int(s.get("creationTime") or 0), s["logStreamName"]))
            token = page.get("nextToken")
            if not token or token == kw.get("nextToken"):
                break
            kw["nextToken"] = token
        return [name for _, name in sorted(found)]

    def _new_events(self, logs: Any, job: str, tokens: dict[str, str | None]
                    ) -> Iterator[str]:  # fmt: skip
        for stream in self._streams(logs, job):
            while True:
                kw: dict[str, Any] = {
                    "logGroupName": LOG_GROUP,
                    "logStreamName": stream,
                    "startFromHead": True,
                }
                if tokens.get(stream):
                    kw["nextToken"] = tokens[stream]
                page = logs.get_log_events(**kw)
                for event in page.get("events", []):
                    yield str(event.get("message", "")).rstrip("\n")
                token = page.get("nextForwardToken")
                if not token or token == tokens.get(stream):
                    break  # the same token back means the end of the stream (for now)
                tokens[stream] = token

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        """Redacted log lines. A process that did not launch the run (``crf logs``) does not
        know what the caller passed in its secret, so it reads the secret (while it exists)
        and redacts those values too."""
        arn = handle.extra.get("secret_arn")
        if arn and arn not in self._secrets_read:
            try:
                got = self._client("secretsmanager", str(arn).split(":")[3]).get_secret_value(
                    SecretId=arn
                )
                values = json.loads(got["SecretString"]).values()
            except (ClientError, BotoCoreError, ValueError, IndexError, AttributeError):
                values = []  # deleted already, or not readable: redact what is known
            with self._lock:
                self._secret_values.update(str(v) for v in values)
                self._secrets_read.add(str(arn))
        return super().logs(handle, follow)

    def _raw_logs(self, handle: ReplicaHandle, follow: bool) -> Iterator[str]:
        logs = self._client("logs", self._handle_region(handle))
        tokens: dict[str, str | None] = {}
        final = False
        try:
            while True:
                n = 0
                for line in self._new_events(logs, handle.backend_id, tokens):
                    n += 1
                    yield line
                if not follow or final:
                    return
                if n:
                    continue
                if self.status(handle).terminal:
                    final = True  # one more pass for what was ingested after the last read
                time.sleep(self.poll_s)
        except ClientError as e:
            raise ExecutorError(f"cannot read the logs of {handle.backend_id}: {_msg(e)}") from None
        except BotoCoreError as e:
            raise ExecutorError(f"cannot reach CloudWatch Logs: {e}") from None

    # ------------------------------------------------------------------ cancel, collect
    def cancel(self, handle: ReplicaHandle) -> None:
        with self._lock:  # the next status() must see the stop
            self._described.pop((self._handle_region(handle), handle.backend_id), None)
        try:
            self._client("sagemaker", self._handle_region(handle)).stop_training_job(
                TrainingJobName=handle.backend_id
            )
        except ClientError as e:
            if _code(e) == "ValidationException":  # already ended (or never existed)
                return
            raise _call_error(e, f"stop {handle.backend_id}") from None
        except BotoCoreError as e:
            raise _call_error(e, f"stop {handle.backend_id}") from None

    def collect(
        self,
        handles: Sequence[ReplicaHandle],
        timeout: float | None = None,
        *,
        cancel_on_timeout: bool = True,
        poll_s: float = 0.2,
    ) -> list[ReplicaResult]:
        """As the base's, then the run's secret is deleted: no replica needs it any more."""
        results = super().collect(
            handles, timeout, cancel_on_timeout=cancel_on_timeout, poll_s=poll_s
        )
        if all(r.state.terminal for r in results):
            self.delete_secrets(handles)
        return results

    # ------------------------------------------------------------------ reattach
    def find_replicas(self, run_id: str, run_uri: str, world_size: int) -> list[ReplicaHandle]:
        """The newest training job of each rank tagged ``crf-run=<run_id>``."""
        region = self._region()
        sm = self._client("sagemaker", region)
        newest: dict[int, tuple[dict[str, Any], int]] = {}
        try:
            pages = sm.get_paginator("list_training_jobs").paginate(
                NameContains=f"crf-{slug(run_id)[:40]}",
                SortBy="CreationTime",
                SortOrder="Ascending",
            )
            for page in pages:
                for summary in page.get("TrainingJobSummaries", []):
                    tags = sm.list_tags(ResourceArn=summary["TrainingJobArn"]).get("Tags", [])
                    labels = {t["Key"]: t["Value"] for t in tags}
                    if labels.get(LABEL_RUN) != run_id or labels.get(LABEL_ROLE):
                        continue  # another run's job, or a rollout worker
                    try:
                        rank = int(labels.get(LABEL_RANK, ""))
                    except ValueError:
                        continue
                    if 0 <= rank < world_size:
                        attempts = newest[rank][1] + 1 if rank in newest else 0
                        newest[rank] = (summary, attempts)
        except ClientError as e:
            raise ExecutorError(f"cannot list SageMaker training jobs: {_msg(e)}") from None
        except BotoCoreError as e:
            raise ExecutorError(f"cannot reach SageMaker: {e}") from None
        if not newest:
            raise ExecutorError(
                f"no SageMaker training jobs tagged {LABEL_RUN}={run_id} in {region}"
            )
        handles = []
        for rank, (summary, attempt) in sorted(newest.items()):
            created = summary.get("CreationTime")
            handles.append(
                ReplicaHandle(
                    backend=self.name,
                    run_id=run_id,
                    rank=rank,
                    backend_id=summary["TrainingJobName"],
                    run_uri=run_uri,
                    world_size=world_size,
                    started_at=created.timestamp() if hasattr(created, "timestamp") else 0.0,
                    extra={
                        "job_name": summary["TrainingJobName"],
                        "job_arn": summary["TrainingJobArn"],
                        "region": region,
                        "attempt": attempt,
                    },
                )
            )
        return handles

    # ------------------------------------------------------------------ plan, config
    def _secret_names(self, run_uri: str) -> list[str]:
        try:
            bundle = store_secrets(run_uri)
        except MissingCredentials:
            return []
        if scheme_of(run_uri) == "s3":
            bundle = {k: v for k, v in bundle.items() if k not in ROLE_REPLACES}
        return sorted(bundle)

    def gpus_per_replica(self) -> int:
        return instance_gpus(self.instance_type)

    def gpu_bf16(self) -> bool | None:
        if not has_gpu(self.instance_type):
            return None
        family = self.instance_type.rsplit(".", 1)[0]
        return family not in _CATALOG["families_without_bf16"]

    def describe(self, n_replicas: int, command: Sequence[str] | None, run_uri: str) -> BackendPlan:
        region = self.region or "<default region>"
        notes = [
            f"each replica: training job crf-<run>-r<rank>-<nonce>, {self.instance_type} x 1, "
            f"{self.volume_gb} GB volume, role {self.role_arn or '<role_arn missing>'}",
            f"logs: CloudWatch {LOG_GROUP}, stream <job-name>/algo-1-*",
        ]
        if scheme_of(run_uri) == "s3":
            notes.append("store access: the job's IAM role (your AWS keys are not passed)")
        names = self._secret_names(run_uri)
        if names:
            notes.append(
                f"secrets: {', '.join(names)} go into a Secrets Manager secret crf/<run-id>/*, "
                "deleted when the run is collected; jobs see only its ARN"
            )
        if self.spot:
            wait = self.max_wait_s if self.max_wait_s is not None else self.timeout_s + 3600
            notes.append(
                f"managed spot: a job may wait for capacity, {wait:.0f} s in all (billed only "
                "while it trains)"
            )
        if self.region and self.region != "us-east-1":
            notes.append("price: us-east-1 list price; other regions differ")
        if self.instance_type not in HOURLY_USD:
            notes.append("price: not in crf's table; see https://aws.amazon.com/sagemaker/pricing/")
        hourly, basis = self._price()
        cpu_mem = VCPU_MEMORY_GIB.get(self.instance_type)
        bp = self.plan(
            n_replicas,
            command,
            run_uri,
            where=f"{n_replicas} {self.kind}(s) in {region}",
            image=self._image(),
            hardware=f"{self.instance_type}{' (spot)' if self.spot else ''}",
            resources=(
                f"{cpu_mem[0]} vCPU, {cpu_mem[1]} GiB (the instance type's)"
                if cpu_mem
                else "the instance type's"
            ),
            hourly_usd=hourly,
            price_basis=basis,
            notes=notes,
        )
        bp.secrets = names
        return bp

    def _price(self) -> tuple[float | None, str]:
        """The hourly price of one replica and what it is: the spot price where the catalog
        records one, else the on-demand price (labelled as such for a spot run)."""
        on_demand = HOURLY_USD.get(self.instance_type)
        if not self.spot:
            return on_demand, ""
        spot = SPOT_HOURLY_USD.get(self.instance_type)
        if spot is not None:
            return spot, f"managed spot price of {PRICES_DATE}"
        return on_demand, "on-demand price; managed spot bills less, at a rate not published"

    def config(self) -> dict[str, Any]:
        return {
            "instance_type": self.instance_type,
            "image": self.image,
            "role_arn": self.role_arn,
            "region": self.region,
            "volume_gb": self.volume_gb,
            "spot": self.spot,
            "max_wait_s": self.max_wait_s,
            "timeout_s": self.timeout_s,
            "output_path": self.output_path,
        }


__all__ = [
    "DEFAULT_INSTANCE_TYPE",
    "HOURLY_USD",
    "LOADER",
    "LOG_GROUP",
    "SageMakerExecutor",
    "boot_environment",
    "default_image",
    "exit_code_from",
    "job_name",
]
