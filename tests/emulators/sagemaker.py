"""A loopback stand-in for the AWS APIs the SageMaker backend calls, spoken as boto3 speaks them.

Why our own: moto's SageMaker marks a training job Completed the moment it is created, drops
its ``Environment`` and cannot stop it, so nothing about running replicas could be tested with
it. This server (stdlib ``ThreadingHTTPServer``) answers the few calls crf makes, with the
request shapes and limits of the botocore service model, and actually runs the jobs. Point
boto3 at it with the service-specific endpoint variables (``client_env()``):
``AWS_ENDPOINT_URL_SAGEMAKER``, ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS``, ``AWS_ENDPOINT_URL_STS``.
S3 and Secrets Manager stay moto's (``AWS_ENDPOINT_URL``), as in the store tests.

Upstream it follows: the SageMaker API version 2017-07-24 and CloudWatch Logs 2014-03-28 as
botocore's service models describe them: the shapes and limits it checks are those of
botocore 1.43.117 (the release constraints/ci.txt pins), and the client is always the real
boto3. moto cannot run
a training job (above), so no test can use a real SageMaker server instead.

Which service a request is for is read from its SigV4 credential scope
(``Credential=<key>/<date>/<region>/<service>/aws4_request``):

* ``sagemaker`` (JSON 1.1, ``X-Amz-Target: SageMaker.<Op>``): CreateTrainingJob (validated
  like the API: name pattern and uniqueness, role ARN shape, at most 100 entrypoint/argument
  items of at most 256 characters - and single-line, a stricter reading of the API's ``.*``
  pattern -, at most 100 environment entries with values of at most 512 characters, an
  instance type from botocore's enum, InstanceCount 1, spot needing MaxWaitTimeInSeconds >=
  MaxRuntimeInSeconds, RetryStrategy 1..30), DescribeTrainingJob, StopTrainingJob,
  ListTrainingJobs (NameContains, StatusEquals, sort, MaxResults/NextToken pages), ListTags.
  An unknown job is ``ValidationException: Requested resource not found``, as on AWS.
* ``logs`` (JSON 1.1, ``Logs_20140328.<Op>``): DescribeLogStreams, GetLogEvents (group
  ``/aws/sagemaker/TrainingJobs``, stream ``<job>/algo-1-<epoch>``, forward tokens that come
  back unchanged at the end of a stream, as CloudWatch does).
* ``sts`` (query protocol, XML): GetCallerIdentity.

Credentials: a request signed with an access key outside ``accepted_keys`` is refused
(``UnrecognizedClientException`` / ``InvalidClientTokenId``), so "wrong credentials" can be
tested; signatures themselves are not verified.

How a job runs: ``ContainerEntrypoint + ContainerArguments`` run as a LOCAL SUBPROCESS in its
own process group and a fresh temporary folder. The "image" is the host environment: ``PATH``
starts with the folder of this Python, so ``python`` is the test virtualenv's interpreter;
``TrainingImage`` is only recorded. The process gets ``PATH``/``HOME``/``LANG``, the job's
``Environment``, ``TRAINING_JOB_NAME``/``TRAINING_JOB_ARN``, and ``role_env`` - what a real
instance gets from its execution role (credentials, and here moto's endpoint) - but never the
test process's own environment, so a replica reaches its store only through the role or the
secret it was given. stdout and stderr become CloudWatch events, one per line. States:
InProgress (Starting, then Training once the process runs), Completed (exit 0), Failed
(``AlgorithmError: ... exit code: N``), Stopping/Stopped on StopTrainingJob (SIGTERM to the
group, SIGKILL after ``grace_s``), Stopped/MaxRuntimeExceeded when MaxRuntimeInSeconds passes.

Not emulated: RetryStrategy (it acts only on SageMaker-internal errors, which cannot happen
here), spot interruptions, instance provisioning time, IAM, input channels, model upload.
The FailureReason wording is a guess shaped like AWS's. ``jobs`` keeps every job with the
exact request boto3 sent, for tests to inspect.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_ROLE_RE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
_ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_CRED_RE = re.compile(r"Credential=([^/,\s]+)/[^/]+/([^/]+)/([^/]+)/aws4_request")


class ApiError(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def _instance_types() -> set[str]:
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.operation_model("CreateTrainingJob").input_shape
    return set(shape.members["ResourceConfig"].members["InstanceType"].enum)


@dataclass
class Job:
    name: str
    arn: str
    request: dict[str, Any]
    created: float
    status: str = "InProgress"
    secondary: str = "Starting"
    failure: str | None = None
    transitions: list[dict[str, Any]] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    stream: str | None = None
    stream_created: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    workdir: str | None = None
    stop_requested: bool = False
    timed_out: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def tags(self) -> list[dict[str, str]]:
        return list(self.request.get("Tags") or [])


class SageMakerEmulator:
    """SageMaker training jobs, their CloudWatch logs and STS identity on 127.0.0.1."""

    def __init__(
        self,
        *,
        role_env: dict[str, str] | None = None,
        accepted_keys: set[str] | frozenset[str] = frozenset({"testing"}),
        account: str = "123456789012",
        grace_s: float = 5.0,
    ) -> None:
        self.role_env = dict(role_env or {})
        self.accepted_keys = set(accepted_keys)
        self.account = account
        self.grace_s = grace_s
        self.jobs: dict[str, Job] = {}
        self.calls: list[tuple[str, str]] = []  # (service, operation), in order
        self._lock = threading.Lock()
        self._types = _instance_types()
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ server
    def start(self) -> SageMakerEmulator:
        emu = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, payload = emu.handle(dict(self.headers.items()), body)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def client_env(self) -> dict[str, str]:
        """The variables that point boto3's sagemaker, logs and sts clients here."""
        return {
            "AWS_ENDPOINT_URL_SAGEMAKER": self.endpoint,
            "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": self.endpoint,
            "AWS_ENDPOINT_URL_STS": self.endpoint,
        }

    def close(self) -> None:
        for job in list(self.jobs.values()):
            self._kill(job, signal.SIGKILL)
        for job in list(self.jobs.values()):
            job.done.wait(10)
            if job.workdir:
                shutil.rmtree(job.workdir, ignore_errors=True)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ------------------------------------------------------------------ dispatch
    def handle(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        lower = {k.lower(): v for k, v in headers.items()}
        m = _CRED_RE.search(lower.get("authorization", ""))
        service = m.group(3) if m else ""
        try:
            if m is None:
                raise ApiError("MissingAuthenticationTokenException", "Missing Authentication")
            if service == "sts":
                return self._sts(m.group(1), body)
            if m.group(1) not in self.accepted_keys:
                raise ApiError(
                    "UnrecognizedClientException",
                    "The security token included in the request is invalid.",
                )
            target = lower.get("x-amz-target", "")
            prefix, _, op = target.partition(".")
            handler = {"SageMaker": "sm_", "Logs_20140328": "logs_"}.get(prefix)
            fn = getattr(self, f"{handler}{op}", None) if handler else None
            if fn is None:
                raise ApiError("UnknownOperationException", f"unsupported operation {target}")
            with self._lock:
                self.calls.append((service, op))
            out = fn(json.loads(body or b"{}"))
            return 200, self._json_headers(), json.dumps(out).encode()
        except ApiError as e:
            if service == "sts":
                return e.status, {"Content-Type": "text/xml"}, self._sts_error(e)
            headers = self._json_headers()
            headers["x-amzn-ErrorType"] = e.code
            return e.status, headers, json.dumps({"__type": e.code, "message": e.message}).encode()

    @staticmethod
    def _json_headers() -> dict[str, str]:
        return {"Content-Type": "application/x-amz-json-1.1", "x-amzn-RequestId": str(uuid.uuid4())}

    # ------------------------------------------------------------------ sts
    def _sts(self, key: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        action = parse_qs(body.decode()).get("Action", [""])[0]
        if action != "GetCallerIdentity":
            raise ApiError("InvalidAction", f"unsupported action {action}")
        if key not in self.accepted_keys:
            raise ApiError(
                "InvalidClientTokenId",
                "The security token included in the request is invalid.",
                403,
            )
        with self._lock:
            self.calls.append(("sts", action))
        xml = (
            '<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<GetCallerIdentityResult>"
            f"<Arn>arn:aws:iam::{self.account}:user/crf-test</Arn>"
            f"<UserId>AIDACRFTEST{self.account}</UserId><Account>{self.account}</Account>"
            "</GetCallerIdentityResult>"
            f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata>"
            "</GetCallerIdentityResponse>"
        )
        return 200, {"Content-Type": "text/xml"}, xml.encode()

    @staticmethod
    def _sts_error(e: ApiError) -> bytes:
        return (
            '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
            f"<Type>Sender</Type><Code>{e.code}</Code><Message>{e.message}</Message></Error>"
            f"<RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
        ).encode()

    # ------------------------------------------------------------------ sagemaker
    def _job(self, name: str) -> Job:
        job = self.jobs.get(name)
        if job is None:
            raise ApiError("ValidationException", "Requested resource not found.")
        return job

    def _validate(self, req: dict[str, Any]) -> None:
        def bad(msg: str) -> ApiError:
            return ApiError("ValidationException", msg)

        name = req.get("TrainingJobName", "")
        if not _NAME_RE.match(name):
            raise bad(f"TrainingJobName {name!r} fails [a-zA-Z0-9](-*[a-zA-Z0-9]){{0,62}}")
        if not _ROLE_RE.match(req.get("RoleArn", "")):
            raise bad("RoleArn is not an IAM role ARN")
        alg = req.get("AlgorithmSpecification") or {}
        if not alg.get("TrainingImage") or not alg.get("TrainingInputMode"):
            raise bad("AlgorithmSpecification needs TrainingImage and TrainingInputMode")
        for key in ("ContainerEntrypoint", "ContainerArguments"):
            items = alg.get(key) or []
            if len(items) > 100:
                raise bad(f"{key} has more than 100 items")
            for item in items:
                if len(item) > 256 or "\n" in item or "\r" in item:
                    raise bad(f"{key} item {item[:30]!r}... is over 256 characters or multi-line")
        env = req.get("Environment") or {}
        if len(env) > 100:
            raise bad("Environment has more than 100 entries")
        for k, v in env.items():
            if not _ENV_KEY_RE.match(k) or len(k) > 512 or len(v) > 512:
                raise bad(f"Environment entry {k} fails the key pattern or the 512 limit")
        rc = req.get("ResourceConfig") or {}
        if rc.get("InstanceType") not in self._types:
            raise bad(f"Value {rc.get('InstanceType')!r} at 'resourceConfig.instanceType' failed")
        if rc.get("InstanceCount") != 1:
            raise bad("this emulator runs InstanceCount=1 only")
        if int(rc.get("VolumeSizeInGB") or 0) < 1:
            raise bad("VolumeSizeInGB must be >= 1")
        stop = req.get("StoppingCondition") or {}
        if int(stop.get("MaxRuntimeInSeconds") or 0) < 1:
            raise bad("StoppingCondition.MaxRuntimeInSeconds must be >= 1")
        if req.get("EnableManagedSpotTraining"):
            wait = stop.get("MaxWaitTimeInSeconds")
            if wait is None or int(wait) < int(stop["MaxRuntimeInSeconds"]):
                raise bad("spot training needs MaxWaitTimeInSeconds >= MaxRuntimeInSeconds")
        if not str((req.get("OutputDataConfig") or {}).get("S3OutputPath", "")).startswith("s3://"):
            raise bad("OutputDataConfig.S3OutputPath must be an s3:// URI")
        retry = req.get("RetryStrategy")
        if retry is not None and not 1 <= int(retry.get("MaximumRetryAttempts", 0)) <= 30:
            raise bad("RetryStrategy.MaximumRetryAttempts must be in [1, 30]")
        if len(req.get("Tags") or []) > 50:
            raise bad("at most 50 tags")

    def sm_CreateTrainingJob(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        self._validate(req)
        name = req["TrainingJobName"]
        arn = f"arn:aws:sagemaker:us-east-1:{self.account}:training-job/{name.lower()}"
        with self._lock:
            if name in self.jobs:
                raise ApiError(
                    "ResourceInUse",
                    f"Training job names must be unique within an AWS account and region, "
                    f"and a training job with this name already exists ({arn})",
                )
            job = Job(name=name, arn=arn, request=req, created=time.time())
            self._transition(job, "Starting", "Preparing the instances for training")
            self.jobs[name] = job
        self._spawn(job)
        return {"TrainingJobArn": arn}

    def _transition(self, job: Job, status: str, message: str) -> None:
        now = time.time()
        if job.transitions:
            job.transitions[-1].setdefault("EndTime", now)
        job.transitions.append({"Status": status, "StartTime": now, "StatusMessage": message})
        job.secondary = status

    def _spawn(self, job: Job) -> None:
        alg = job.request["AlgorithmSpecification"]
        argv = list(alg.get("ContainerEntrypoint") or []) + list(
            alg.get("ContainerArguments") or []
        )
        job.workdir = tempfile.mkdtemp(prefix=f"sm-{job.name}-")
        env = {
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
            "HOME": os.environ.get("HOME", job.workdir),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TMPDIR": job.workdir,
        }
        env.update(self.role_env)
        env.update(job.request.get("Environment") or {})
        env.update(TRAINING_JOB_NAME=job.name, TRAINING_JOB_ARN=job.arn)
        with self._lock:
            job.stream = f"{job.name}/algo-1-{int(time.time())}"
            job.stream_created = time.time()
        try:
            if not argv:
                raise FileNotFoundError("the image has no entrypoint")
            job.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=job.workdir,
                start_new_session=True,
            )
        except OSError as e:
            with self._lock:
                self._log(job, f"exec failed: {e}")
                job.status, job.failure = "Failed", f"AlgorithmError: cannot start {argv[:1]}: {e}"
                self._transition(job, "Failed", job.failure)
                job.ended = time.time()
            job.done.set()
            return
        with self._lock:
            job.started = time.time()
            self._transition(job, "Training", "Training image download completed.")
        reader = threading.Thread(target=self._read, args=(job,), daemon=True)
        reader.start()
        threading.Thread(target=self._wait, args=(job, reader), daemon=True).start()

    def _log(self, job: Job, message: str) -> None:
        now = int(time.time() * 1000)
        job.events.append({"timestamp": now, "message": message, "ingestionTime": now})

    def _read(self, job: Job) -> None:
        assert job.proc is not None and job.proc.stdout is not None
        for raw in iter(job.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self._lock:
                self._log(job, line)
        job.proc.stdout.close()

    def _wait(self, job: Job, reader: threading.Thread) -> None:
        assert job.proc is not None
        limit = int(job.request["StoppingCondition"]["MaxRuntimeInSeconds"])
        try:
            code = job.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            job.timed_out = True
            self._kill(job, signal.SIGKILL)
            code = job.proc.wait()
        reader.join(10)
        with self._lock:
            job.ended = time.time()
            if job.timed_out:
                job.status = "Stopped"
                self._transition(job, "MaxRuntimeExceeded", "Job stopped: MaxRuntime exceeded")
            elif job.stop_requested:
                job.status = "Stopped"
                self._transition(job, "Stopped", "Training job stopped by the user")
            elif code == 0:
                job.status = "Completed"
                self._transition(job, "Completed", "Training job completed")
            else:
                job.status = "Failed"
                how = f"exit code: {code}" if code > 0 else f"killed by signal {-code}"
                job.failure = f"AlgorithmError: the training container failed, {how}"
                self._transition(job, "Failed", job.failure)
        job.done.set()

    def _kill(self, job: Job, sig: int) -> None:
        if job.proc is None or job.proc.poll() is not None:
            return
        try:
            os.killpg(job.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def sm_DescribeTrainingJob(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        with self._lock:
            job = self._job(req.get("TrainingJobName", ""))
            r = job.request
            out = {
                "TrainingJobName": job.name,
                "TrainingJobArn": job.arn,
                "TrainingJobStatus": job.status,
                "SecondaryStatus": job.secondary,
                "AlgorithmSpecification": r["AlgorithmSpecification"],
                "RoleArn": r["RoleArn"],
                "OutputDataConfig": r["OutputDataConfig"],
                "ResourceConfig": r["ResourceConfig"],
                "StoppingCondition": r["StoppingCondition"],
                "CreationTime": job.created,
                "LastModifiedTime": job.transitions[-1]["StartTime"],
                "SecondaryStatusTransitions": [dict(t) for t in job.transitions],
                "EnableManagedSpotTraining": bool(r.get("EnableManagedSpotTraining")),
                "Environment": dict(r.get("Environment") or {}),
            }
            for key, value in (
                ("FailureReason", job.failure),
                ("TrainingStartTime", job.started),
                ("TrainingEndTime", job.ended),
                ("RetryStrategy", r.get("RetryStrategy")),
            ):
                if value is not None:
                    out[key] = value
            return out

    def sm_StopTrainingJob(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        with self._lock:
            job = self._job(req.get("TrainingJobName", ""))
            if job.status != "InProgress":
                raise ApiError(
                    "ValidationException",
                    f"The request was rejected because the training job is in status {job.status}.",
                )
            job.status, job.stop_requested = "Stopping", True
            self._transition(job, "Stopping", "Stopping the training job")
        self._kill(job, signal.SIGTERM)

        def escalate() -> None:
            if not job.done.wait(self.grace_s):
                self._kill(job, signal.SIGKILL)

        threading.Thread(target=escalate, daemon=True).start()
        return {}

    def sm_ListTrainingJobs(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        with self._lock:
            jobs = list(self.jobs.values())
        contains = str(req.get("NameContains") or "").lower()
        jobs = [j for j in jobs if contains in j.name.lower()]
        if req.get("StatusEquals"):
            jobs = [j for j in jobs if j.status == req["StatusEquals"]]
        key = {"Name": lambda j: j.name, "Status": lambda j: j.status}.get(
            req.get("SortBy", "CreationTime"), lambda j: j.created
        )
        jobs.sort(key=key, reverse=req.get("SortOrder", "Ascending") == "Descending")
        start = int(req.get("NextToken") or 0)
        size = int(req.get("MaxResults") or 10)
        page = jobs[start : start + size]
        out: dict[str, Any] = {
            "TrainingJobSummaries": [
                {
                    "TrainingJobName": j.name,
                    "TrainingJobArn": j.arn,
                    "CreationTime": j.created,
                    "TrainingJobStatus": j.status,
                    "SecondaryStatus": j.secondary,
                }
                for j in page
            ]
        }
        if start + size < len(jobs):
            out["NextToken"] = str(start + size)
        return out

    def sm_ListTags(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        with self._lock:
            for job in self.jobs.values():
                if job.arn == req.get("ResourceArn"):
                    return {"Tags": job.tags}
        raise ApiError("ValidationException", "Requested resource not found.")

    # ------------------------------------------------------------------ logs
    def _stream(self, group: str, name: str) -> Job:
        if group != LOG_GROUP:
            raise ApiError("ResourceNotFoundException", "The specified log group does not exist.")
        for job in self.jobs.values():
            if job.stream == name:
                return job
        raise ApiError("ResourceNotFoundException", "The specified log stream does not exist.")

    def logs_DescribeLogStreams(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        with self._lock:
            if req.get("logGroupName") != LOG_GROUP or not any(
                j.stream for j in self.jobs.values()
            ):
                raise ApiError(
                    "ResourceNotFoundException", "The specified log group does not exist."
                )
            prefix = req.get("logStreamNamePrefix") or ""
            jobs = sorted(
                (j for j in self.jobs.values() if j.stream and j.stream.startswith(prefix)),
                key=lambda j: j.stream or "",
            )
            start = int(req.get("nextToken") or 0)
            size = int(req.get("limit") or 50)
            streams = []
            for j in jobs[start : start + size]:
                s = {
                    "logStreamName": j.stream,
                    "creationTime": int(j.stream_created * 1000),
                    "arn": f"arn:aws:logs:us-east-1:{self.account}:log-group:{LOG_GROUP}:"
                    f"log-stream:{j.stream}",
                    "storedBytes": 0,
                }
                if j.events:
                    s["firstEventTimestamp"] = j.events[0]["timestamp"]
                    s["lastEventTimestamp"] = j.events[-1]["timestamp"]
                    s["lastIngestionTime"] = j.events[-1]["ingestionTime"]
                streams.append(s)
        out: dict[str, Any] = {"logStreams": streams}
        if start + size < len(jobs):
            out["nextToken"] = str(start + size)
        return out

    def logs_GetLogEvents(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        with self._lock:
            job = self._stream(req.get("logGroupName", ""), req.get("logStreamName", ""))
            token = req.get("nextToken")
            if token:
                if not re.match(r"^[fb]/\d+$", token):
                    raise ApiError(
                        "InvalidParameterException", "The specified nextToken is invalid."
                    )
                start = int(token[2:])
            elif req.get("startFromHead"):
                start = 0
            else:  # CloudWatch starts at the newest events without startFromHead
                start = max(0, len(job.events) - int(req.get("limit") or 10000))
            size = int(req.get("limit") or 10000)
            events = [dict(e) for e in job.events[start : start + size]]
        end = start + len(events)
        return {
            "events": events,
            "nextForwardToken": f"f/{end}" if events or not token else token,
            "nextBackwardToken": f"b/{start}",
        }


__all__ = ["LOG_GROUP", "ApiError", "Job", "SageMakerEmulator"]
