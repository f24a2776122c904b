"""The SageMaker backend through the real boto3 client.

Against loopback servers: ``tests/emulators/sagemaker.py`` answers SageMaker, CloudWatch Logs
and STS (and runs each training job as a local subprocess); moto answers S3 and Secrets
Manager. Nothing here is faked inside the process: the executor makes the same HTTP calls it
would make to AWS. The emulator is a stand-in only because there is no AWS here - its
docstring lists what it does not model. Tests against real AWS are at the end and skip
without credentials.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the sagemaker backend needs boto3 (the sagemaker extra)")

import boto3  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

from crf.executors import registry  # noqa: E402
from crf.executors.base import ExecutorError, ReplicaHandle, ReplicaState  # noqa: E402
from crf.executors.cloud import BOOTSTRAP  # noqa: E402
from crf.executors.sagemaker import (  # noqa: E402
    ENV_SECRET_ARN,
    HOURLY_USD,
    LOADER,
    ROLE_ARN_ENV,
    SECRET_STEP,
    SageMakerExecutor,
    boot_environment,
    default_image,
    exit_code_from,
    job_name,
)
from tests import cloud_servers  # noqa: E402
from tests.cloud_servers import MotoS3  # noqa: E402
from tests.emulators.sagemaker import SageMakerEmulator  # noqa: E402

moto_s3 = cloud_servers.moto_s3  # the fixtures, visible to this module's tests
s3_env = cloud_servers.s3_env

ROLE = "arn:aws:iam::123456789012:role/crf-test"
DRIVER_KEY = "AKIACRFDRIVERKEY0001"
DRIVER_SECRET = "driver-secret-key-that-must-never-leak"
CALLER_TOKEN = "hf_caller_token_passed_as_env_0001"
ROLE_KEY = "ASIACRFROLEKEY0001"

# A replica stand-in: prints its environment, proves it can write the store (with the role's
# credentials), then does what its mode says.
SCRIPT = r"""
import os, sys, time
from crf.store import RunStore

rank = int(os.environ["CRF_RANK"])
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
print(f"replica {rank} of {os.environ['CRF_WORLD_SIZE']} mode {mode}", flush=True)
for k in sorted(os.environ):
    print(f"env {k}={os.environ[k]}", flush=True)
store = RunStore(os.environ["CRF_RUN_URI"])
if mode == "fail3":
    print("failing on purpose", flush=True)
    sys.exit(3)
if mode == "sleep":
    print("sleeping", flush=True)
    time.sleep(600)
store.put_json(f"results/{rank}.json", {"rank": rank, "status": "ok", "mode": mode})
print("done", flush=True)
"""


@dataclass
class Aws:
    emu: SageMakerEmulator
    s3: MotoS3
    bucket: str

    def uri(self, run_id: str) -> str:
        return f"s3://{self.bucket}/runs/{run_id}"

    def secrets(self) -> Any:
        return boto3.client("secretsmanager", region_name="us-east-1")

    def sagemaker(self) -> Any:
        return boto3.client("sagemaker", region_name="us-east-1")


@pytest.fixture
def aws(s3_env: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Aws]:
    """The driver's identity (distinctive keys), the emulator for SageMaker/Logs/STS, moto for
    S3 and Secrets Manager; jobs get the "role" credentials instead of the driver's."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DRIVER_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DRIVER_SECRET)
    monkeypatch.delenv(ROLE_ARN_ENV, raising=False)
    role_env = {
        "AWS_ACCESS_KEY_ID": ROLE_KEY,
        "AWS_SECRET_ACCESS_KEY": "role-secret-from-instance-metadata",
        "AWS_SESSION_TOKEN": "role-session-token-0001",
        "AWS_ENDPOINT_URL": s3_env.endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        # the emulated instances share this machine's cores: one torch thread each
        "CRF_TORCH_THREADS": "1",
    }
    emu = SageMakerEmulator(role_env=role_env, accepted_keys={DRIVER_KEY}, grace_s=3).start()
    for key, value in emu.client_env().items():
        monkeypatch.setenv(key, value)
    try:
        yield Aws(emu, s3_env, s3_env.new_bucket())
    finally:
        emu.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "replica_standin.py"
    path.write_text(SCRIPT)
    return path


def executor(instance_type: str = "ml.m5.large", **kw: Any) -> SageMakerExecutor:
    opts = {"role_arn": ROLE, "region": "us-east-1", "poll_s": 0.1, **kw}
    return SageMakerExecutor(instance_type, **opts)


def wait_for(predicate: Any, what: str, timeout: float = 90) -> None:
    """Poll until ``predicate()`` (a generous deadline, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def secret_exists(aws: Aws, arn: str) -> bool:
    try:
        aws.secrets().describe_secret(SecretId=arn)
    except ClientError as e:
        assert e.response["Error"]["Code"] == "ResourceNotFoundException"
        return False
    return True


# --------------------------------------------------------------------------- no server needed
def test_job_names_are_valid_and_new_every_time() -> None:
    import re

    pattern = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
    for run_id in ("run-20261123-0102-ab12", "x" * 200, "we/ird_run.id!!", "__", "r"):
        names = {job_name(run_id, rank) for rank in (0, 7, 123) for _ in range(3)}
        assert len(names) == 9
        for name in names:
            assert len(name) <= 63 and pattern.match(name), name
            assert name.startswith("crf-")


def test_bootstrap_travels_in_environment_chunks_within_limits() -> None:
    import base64

    env = boot_environment()
    n = int(env["CRF_BOOT_N"])
    assert all(len(v) <= 512 for v in env.values())
    joined = "".join(env[f"CRF_BOOT_{i}"] for i in range(n))
    assert base64.b64decode(joined).decode() == SECRET_STEP + BOOTSTRAP
    assert len(LOADER) <= 256 and "\n" not in LOADER


def test_bootstrap_loader_runs_the_command(tmp_path: Path) -> None:
    """The loader + secret step + shared bootstrap as a container runs them (no secret ARN:
    the step is skipped), fetching the code from a file store. The code is unpacked once per
    machine: a second container process there uses the same copy without fetching it."""
    from crf import layout
    from crf.executors.cloud import pack_source
    from crf.store import RunStore

    store = RunStore(f"file://{tmp_path}/run")
    data, sha = pack_source()
    assert pack_source()[1] == sha  # the same source, the same key: its copy is found again
    key = layout.code_key(sha[:16])
    store.put(key, data)
    (tmp_path / "tmp").mkdir()
    env = {
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "CRF_RUN_URI": f"file://{tmp_path}/run",
        "CRF_CODE_KEY": key,
        "CRF_REQUIREMENTS": "",
        "TMPDIR": str(tmp_path / "tmp"),  # the container's disk
        **boot_environment(),
    }
    probe = "import os, crf; print(crf.__file__, 'CRF_BOOT_0' in os.environ)"
    seen = []
    for _ in range(2):
        proc = subprocess.run(
            ["python", "-c", LOADER, "python", "-c", probe],
            env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "crf-src-" in proc.stdout and "False" in proc.stdout  # the source from the store
        seen.append(proc.stdout.strip().splitlines()[-1].split()[0])  # crf.__file__
        store.delete(key)  # the second process does not fetch it again
    assert seen[0] == seen[1] and seen[0].startswith(str(tmp_path / "tmp"))
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [Path(seen[0]).parent.parent.name]


def test_options_from_the_cli_and_config_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    ex = registry.make_executor(
        "sagemaker",
        {"instance_type": "ml.g5.2xlarge", "role_arn": ROLE, "spot": "true", "volume_gb": "50",
         "max_wait_s": "90000", "timeout_s": "3600"},
    )  # fmt: skip
    assert isinstance(ex, SageMakerExecutor)
    assert ex.spot is True and ex.volume_gb == 50 and ex.max_wait_s == 90000.0
    assert ex.region == "eu-west-1" and ex.timeout_s == 3600.0
    assert SageMakerExecutor.hardware_option == "instance_type"
    again = registry.make_executor("sagemaker", ex.config())
    assert again.config() == ex.config()
    assert "secret" not in json.dumps(ex.config()).lower()


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(ExecutorError, match="ml.<family>.<size>"):
        SageMakerExecutor("g5.xlarge", role_arn=ROLE)
    with pytest.raises(ExecutorError, match="not an IAM role ARN"):
        SageMakerExecutor(role_arn="arn:aws:iam::12:user/me")
    with pytest.raises(ExecutorError, match="spot=true"):
        SageMakerExecutor(role_arn=ROLE, max_wait_s=100)
    with pytest.raises(ExecutorError, match="at least the job timeout"):
        SageMakerExecutor(role_arn=ROLE, spot=True, max_wait_s=100, timeout_s=200)
    with pytest.raises(ExecutorError, match="s3://"):
        SageMakerExecutor(role_arn=ROLE, output_path="gs://b/x")


def test_unknown_instance_type_and_missing_role_fail_before_any_call() -> None:
    """No server is running: these checks must not need one."""
    with pytest.raises(ExecutorError, match="did you mean ml.g5.xlarge"):
        SageMakerExecutor("ml.g5.xlargee", role_arn=ROLE, region="us-east-1").check_backend()
    with pytest.raises(ExecutorError, match="unknown SageMaker training instance type"):
        SageMakerExecutor("ml.h100.huge", role_arn=ROLE, region="us-east-1").check_backend()
    with pytest.raises(ExecutorError, match="IAM execution role"):
        SageMakerExecutor(region="us-east-1").check_backend()
    # a misspelt region: it read as an STS endpoint that cannot be reached
    with pytest.raises(ExecutorError, match="unknown AWS region 'us-east-9'.*did you mean us-east"):
        SageMakerExecutor("ml.m5.large", role_arn=ROLE, region="us-east-9").check_backend()


def test_long_or_multiline_arguments_are_refused() -> None:
    ex = SageMakerExecutor(role_arn=ROLE, region="us-east-1")
    with pytest.raises(ExecutorError, match="256"):
        ex.check_command(["python", "-c", "x" * 300])
    with pytest.raises(ExecutorError, match="one line"):
        ex.check_command(["python", "-c", "import os\nprint(1)"])
    assert ex.check_command(None) == ["python", "-m", "crf.replica"]


def test_failure_reason_exit_codes() -> None:
    assert exit_code_from("AlgorithmError: the training container failed, exit code: 3") == 3
    assert exit_code_from("AlgorithmError: ExecuteUserScriptError:\nExitCode 1\nError") == 1
    assert exit_code_from("InternalServerError: We encountered an internal error") is None
    assert exit_code_from("ClientError: exited with code 137") == 137
    assert exit_code_from("") is None


def test_status_from_describe_answers() -> None:
    def desc(status: str, secondary: str, starts: int = 1, **kw: Any) -> dict[str, Any]:
        trans = [{"Status": "Starting"}, {"Status": "Training"}] * starts
        return {"TrainingJobStatus": status, "SecondaryStatus": secondary,
                "SecondaryStatusTransitions": trans, **kw}  # fmt: skip

    st = SageMakerExecutor.status_from
    assert st(desc("InProgress", "Starting")).state is ReplicaState.PENDING
    assert st(desc("InProgress", "Downloading")).state is ReplicaState.PENDING
    running = st(desc("InProgress", "Training", starts=3))  # retried twice by SageMaker
    assert running.state is ReplicaState.RUNNING and running.restarts == 2
    assert st(desc("Completed", "Completed")).exit_code == 0
    failed = st(desc("Failed", "Failed", FailureReason="AlgorithmError: x, exit code: 2"))
    assert failed.state is ReplicaState.FAILED and failed.exit_code == 2
    assert st(desc("Stopping", "Stopping")).state is ReplicaState.CANCELLED
    assert st(desc("Stopped", "Stopped")).state is ReplicaState.CANCELLED
    timed = st(desc("Stopped", "MaxRuntimeExceeded", StoppingCondition={"MaxRuntimeInSeconds": 9}))
    assert timed.state is ReplicaState.FAILED and timed.exit_code == 124 and "9" in timed.message


def test_default_image_follows_region_and_hardware() -> None:
    gpu = default_image("us-west-2", "ml.g5.xlarge")
    assert gpu.startswith("763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:")
    assert "-gpu-" in gpu and gpu.endswith("-sagemaker")
    assert "-cpu-" in default_image("us-west-2", "ml.m5.xlarge")
    assert default_image("af-south-1", "ml.g5.xlarge").startswith("626614931356.")
    assert ".amazonaws.com.cn/" in default_image("cn-north-1", "ml.g5.xlarge")


def test_file_and_memory_stores_are_refused(tmp_path: Path) -> None:
    ex = executor()
    for uri in (f"file://{tmp_path}/runs/x", str(tmp_path / "runs" / "x"), "memory://a/b"):
        with pytest.raises(ExecutorError, match="object store|memory://"):
            ex.check_ready(uri)
        with pytest.raises(ExecutorError, match="object store|memory://"):
            ex.launch_replicas(1, run_uri=uri)


def test_role_replaces_aws_keys_for_s3_stores(
    s3_env: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = executor()
    secrets = ex.secrets_for("s3://b/runs/x", {"MY_TOKEN": CALLER_TOKEN})
    assert set(secrets) == {"AWS_ENDPOINT_URL", "MY_TOKEN"}  # no keys, no region
    assert "testing" in ex._secret_values  # still redacted if a replica prints them
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert executor().secrets_for("s3://b/runs/x", None) == {}  # plain AWS S3: no secret at all
    plan = executor().describe(2, None, "s3://b/runs/x")
    assert plan.secrets == [] and any("IAM role" in n for n in plan.notes)


def test_dry_run_plan(s3_env: MotoS3) -> None:
    ex = executor(instance_type="ml.g5.xlarge")
    plan = ex.describe(3, None, "s3://b/runs/x")
    assert plan.backend == "sagemaker" and plan.replicas == 3
    assert plan.hardware == "ml.g5.xlarge" and plan.hourly_usd == HOURLY_USD["ml.g5.xlarge"]
    assert plan.total_hourly_usd == pytest.approx(3 * HOURLY_USD["ml.g5.xlarge"])
    assert plan.image == default_image("us-east-1", "ml.g5.xlarge")
    assert plan.secrets == ["AWS_ENDPOINT_URL"] and plan.region == "us-east-1"
    assert plan.command == ["python", "-m", "crf.replica"]
    unknown = executor(instance_type="ml.g6e.48xlarge", spot=True).describe(1, None, "s3://b/r/x")
    assert unknown.hourly_usd is None and unknown.hardware.endswith("(spot)")


# --------------------------------------------------------------------------- against the emulator
def test_check_backend_accepts_good_credentials(aws: Aws) -> None:
    executor().check_ready(aws.uri("ok"))
    assert ("sts", "GetCallerIdentity") in aws.emu.calls
    assert executor().missing(aws.uri("ok")) == []  # what --dry-run lists: nothing


def test_missing_lists_every_problem(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    """``missing`` (``--dry-run``) says each missing piece apart, where ``check_ready`` (a
    launch) stops at the first; a misspelt instance type is bad input, raised either way."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    found = executor(role_arn=None).missing("gs://bucket/runs/x")
    assert [line.split(":")[0] for line in found] == [
        "no Google credentials for gs",  # the store
        "SageMaker jobs need an IAM execution role",
        "no AWS credentials for SageMaker",
        "SageMaker requires an S3 location for job output (crf writes nothing there, but the "
        "API insists)",
    ]
    with pytest.raises(ExecutorError, match="did you mean ml.g5.xlarge"):
        executor("ml.g5.xlargee", role_arn=None).missing("gs://bucket/runs/x")
    assert not aws.emu.jobs


def test_check_backend_rejects_bad_credentials(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY00000000")
    with pytest.raises(ExecutorError, match="AWS rejected your credentials.*InvalidClientTokenId"):
        executor().check_ready(aws.uri("bad"))
    assert not aws.emu.jobs


def test_check_backend_without_credentials(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ExecutorError, match="no AWS credentials"):
        executor().check_ready(aws.uri("none"))  # the store's check says it first
    with pytest.raises(ExecutorError, match="no AWS credentials for SageMaker"):
        executor().check_backend()


def test_rejected_credentials_are_missing_access_not_a_replica_state(
    aws: Aws, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status or a stop that AWS refuses for the caller's credentials says what to fix
    (MissingAccess), so crf status/cancel/rm stop with it instead of reading the replica
    as failed (a cancel then stopped nothing)."""
    from crf.executors.base import MissingAccess

    ex = executor()
    (h,) = ex.launch_replicas(1, ["python", str(script), "sleep"], run_uri=aws.uri("refused"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY00000000")
    refused = executor()  # a new process's executor: the wrong key is read now
    with pytest.raises(MissingAccess, match="AWS refused to describe .*UnrecognizedClient"):
        refused.status(h)
    with pytest.raises(MissingAccess, match="AWS refused to stop"):
        refused.cancel(h)
    assert DRIVER_SECRET not in str(h) and aws.emu.jobs[h.backend_id].status == "InProgress"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DRIVER_KEY)
    ex.cancel(h)


def test_gs_store_needs_an_s3_output_path(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    with pytest.raises(ExecutorError, match="output_path=s3://"):
        executor().check_ready("gs://bucket/runs/x")
    executor(output_path=f"s3://{aws.bucket}/out").check_ready("gs://bucket/runs/x")


def test_live_job_status_logs_follow_cancel_and_no_secret_leaks(aws: Aws, script: Path) -> None:
    ex = executor()
    uri = aws.uri("live")
    handles = ex.launch_replicas(
        2, ["python", str(script), "sleep"], env={"MY_TOKEN": CALLER_TOKEN}, run_uri=uri,
        max_restarts=2, plain_env={"PROJECT": "grpo"},
    )  # fmt: skip
    assert [h.rank for h in handles] == [0, 1]
    assert all(h.backend == "sagemaker" and h.extra["region"] == "us-east-1" for h in handles)
    arn = handles[0].extra["secret_arn"]
    assert arn and arn == handles[1].extra["secret_arn"] and secret_exists(aws, arn)

    # what anyone allowed to DescribeTrainingJob sees: the ARN, never a secret
    for h in handles:
        desc = aws.sagemaker().describe_training_job(TrainingJobName=h.backend_id)
        env = desc["Environment"]
        assert env[ENV_SECRET_ARN] == arn and env["CRF_RANK"] == str(h.rank)
        assert env["PROJECT"] == "grpo"  # --env: plain, shown like the contract
        blob = json.dumps(desc, default=str)
        for value in (DRIVER_KEY, DRIVER_SECRET, CALLER_TOKEN, aws.s3.endpoint):
            assert value not in blob
        assert desc["ResourceConfig"] == {
            "InstanceType": "ml.m5.large", "InstanceCount": 1, "VolumeSizeInGB": 30,
        }  # fmt: skip
        assert desc["RetryStrategy"] == {"MaximumRetryAttempts": 2}
        assert desc["StoppingCondition"]["MaxRuntimeInSeconds"] == 24 * 3600
        tags = aws.sagemaker().list_tags(ResourceArn=desc["TrainingJobArn"])["Tags"]
        assert {"Key": "crf-run", "Value": "live"} in tags
        assert {"Key": "crf-rank", "Value": str(h.rank)} in tags

    followed: list[str] = []
    follower = threading.Thread(
        target=lambda: followed.extend(ex.logs(handles[0], follow=True)), daemon=True
    )
    follower.start()
    wait_for(lambda: "sleeping" in followed, "rank 0 to print 'sleeping'")
    assert ex.status(handles[0]).state is ReplicaState.RUNNING
    assert "replica 0 of 2 mode sleep" in followed
    # the secret reached the process (it printed its env) but never the driver's terminal
    assert "env MY_TOKEN=***" in followed
    assert "env AWS_ENDPOINT_URL=***" in followed
    assert "env AWS_ACCESS_KEY_ID=***" in followed  # the role's key, hidden by the replica too
    assert not any(name.startswith("env CRF_BOOT") for name in followed)
    assert not any(ENV_SECRET_ARN in line for line in followed)
    # the replica hid them itself: what CloudWatch stored holds none of them
    raw = [e["message"] for job in aws.emu.jobs.values() for e in job.events]
    assert "env MY_TOKEN=***" in raw
    assert not any(CALLER_TOKEN in line or ROLE_KEY in line for line in raw)
    assert not any(DRIVER_SECRET in line or DRIVER_KEY in line for line in raw)
    # the role, not the driver's keys, gives the job its identity: they are not in the secret
    shipped = aws.secrets().get_secret_value(SecretId=arn)["SecretString"]
    assert CALLER_TOKEN in shipped and DRIVER_KEY not in shipped and DRIVER_SECRET not in shipped

    # another process (crf logs) learns the caller's values from the secret itself
    fresh = registry.make_executor("sagemaker", ex.config())
    again = list(fresh.logs(ReplicaHandle(**json.loads(json.dumps(handles[0].to_dict())))))
    assert "env MY_TOKEN=***" in again and not any(CALLER_TOKEN in line for line in again)

    ex.cancel_all(handles)
    follower.join(60)
    assert not follower.is_alive(), "logs(follow=True) did not end after the job stopped"
    results = ex.collect(handles, timeout=60)
    assert [r.state for r in results] == [ReplicaState.CANCELLED] * 2
    assert not secret_exists(aws, arn)  # collected: the secret is gone
    ex.cancel(handles[0])  # a stopped job: nothing to do, no error


def test_failed_job_exit_code_relaunch_and_launch_cleanup(aws: Aws, script: Path) -> None:
    ex = executor()
    uri = aws.uri("fails")
    (h,) = ex.launch_replicas(1, ["python", str(script), "fail3"], run_uri=uri, max_restarts=1)
    wait_for(lambda: ex.status(h).terminal, "the job to fail")
    st = ex.status(h)
    assert st.state is ReplicaState.FAILED and st.exit_code == 3, st
    assert "failing on purpose" in list(ex.logs(h))
    new = ex.relaunch(h)
    assert new.rank == 0 and new.extra["attempt"] == 1 and new.backend_id != h.backend_id
    assert new.extra["secret_arn"] == h.extra["secret_arn"]  # one secret per launch
    request = aws.emu.jobs[new.backend_id].request
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": 1}  # kept on relaunch
    wait_for(lambda: ex.status(new).terminal, "the relaunched job to fail")
    ex.collect([h, new])
    assert not secret_exists(aws, h.extra["secret_arn"])

    # a launch that fails half-way stops what it started and deletes its secret
    original = aws.emu.sm_CreateTrainingJob
    calls = []

    def second_fails(req: dict[str, Any]) -> dict[str, Any]:
        calls.append(req["TrainingJobName"])
        if len(calls) == 2:
            from tests.emulators.sagemaker import ApiError

            raise ApiError("ResourceLimitExceeded", "The account-level service limit is 1")
        return original(req)

    aws.emu.sm_CreateTrainingJob = second_fails  # type: ignore[method-assign]
    with pytest.raises(ExecutorError, match="ResourceLimitExceeded"):
        ex.launch_replicas(2, ["python", str(script), "sleep"], run_uri=aws.uri("half"))
    first = aws.emu.jobs[calls[0]]
    assert first.status in ("Stopping", "Stopped")
    arn = first.request["Environment"][ENV_SECRET_ARN]
    assert not secret_exists(aws, arn)


def test_spot_job_stopped_by_its_time_limit(aws: Aws, script: Path) -> None:
    ex = executor(spot=True, timeout_s=2)
    (h,) = ex.launch_replicas(1, ["python", str(script), "sleep"], run_uri=aws.uri("limit"))
    request = aws.emu.jobs[h.backend_id].request
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 2, "MaxWaitTimeInSeconds": 3602}
    wait_for(lambda: ex.status(h).terminal, "the time limit to stop the job")
    st = ex.status(h)
    assert st.state is ReplicaState.FAILED and st.exit_code == 124, st
    assert "MaxRuntimeExceeded" in st.message


def test_reattach_from_config_and_by_tags(aws: Aws, script: Path) -> None:
    ex = executor()
    uri = aws.uri("again")
    handles = ex.launch_replicas(2, ["python", str(script), "ok"], run_uri=uri)
    other = ex.launch_replicas(1, ["python", str(script), "ok"], run_uri=aws.uri("again-2"))
    wait_for(lambda: all(ex.status(h).terminal for h in handles + other), "the jobs to end")
    retried = ex.relaunch(handles[1])
    wait_for(lambda: ex.status(retried).terminal, "the relaunched job to end")

    # a fresh process: executor from config(), handles from their saved dicts
    fresh = registry.make_executor("sagemaker", json.loads(json.dumps(ex.config())))
    saved = [ReplicaHandle(**json.loads(json.dumps(h.to_dict()))) for h in (handles[0], retried)]
    assert [fresh.status(h).state for h in saved] == [ReplicaState.SUCCEEDED] * 2
    assert "done" in list(fresh.logs(saved[1]))

    found = fresh.find_replicas("again", uri, 2)
    assert [h.backend_id for h in found] == [handles[0].backend_id, retried.backend_id]
    assert [h.extra["attempt"] for h in found] == [0, 1]
    assert all(h.run_uri == uri and h.world_size == 2 for h in found)
    results = fresh.collect(found)
    assert all(r.ok and r.result == {"rank": r.rank, "status": "ok", "mode": "ok"} for r in results)
    # the secret is found through the job's Environment and deleted
    assert not secret_exists(aws, handles[0].extra["secret_arn"])
    with pytest.raises(ExecutorError, match="no SageMaker training jobs tagged crf-run=nope"):
        fresh.find_replicas("nope", aws.uri("nope"), 2)


# --------------------------------------------------------------------------- through the CLI
def crf(*args: str, timeout: float = 600) -> tuple[int, str]:
    env = {**os.environ, "COLUMNS": "200", "CRF_LOG_LEVEL": "WARNING"}
    p = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    return p.returncode, p.stdout + p.stderr


def sm_flags() -> list[str]:
    return ["--backend", "sagemaker", "--instance-type", "ml.m5.xlarge", "--region",
            "us-east-1", "-o", f"role_arn={ROLE}"]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_two_replica_diloco_run_over_s3(aws: Aws) -> None:
    """`crf launch --backend sagemaker`: two training jobs run the real lm job, exchange
    through moto S3 with the role's credentials, and end with identical weights."""
    from crf.store import RunStore

    store = f"s3://{aws.bucket}/runs"
    code, out = crf(
        "launch", *sm_flags(), "--replicas", "2", "--store", store, "--job", "lm",
        "--procs-per-replica", "2",
        "-H", "3", "--rounds", "2", "--run-id", "sm-e2e", "--no-progress",
        "--set", "corpus_sentences=2000",
    )  # fmt: skip
    assert code == 0, out
    run = RunStore(f"{store}/sm-e2e")
    result = run.get_json("result.json")
    assert result["status"] == "ok", result
    rows = result["replicas"]
    assert len(rows) == 2 and all(r["ok"] and r["exit_code"] == 0 for r in rows), rows
    hashes = {r["weights_sha256"] for r in rows}
    assert len(hashes) == 1 and None not in hashes and result["weights_identical"] is True
    assert all(r["rounds_committed"] == 2 for r in rows)
    jm = rows[0]["job_metrics"]
    assert jm["eval_loss_final"] < jm["eval_loss_initial"], jm
    # each training job ran its replica as 2 local ranks (gloo), one of which used the store
    assert [run.get_json(f"results/{r}.json")["local_ranks"] for r in range(2)] == [2, 2]
    jobs = list(aws.emu.jobs.values())
    assert len(jobs) == 2 and all(j.status == "Completed" for j in jobs)
    for job in jobs:
        blob = json.dumps(job.request)
        assert DRIVER_SECRET not in blob and DRIVER_KEY not in blob
        assert not secret_exists(aws, job.request["Environment"][ENV_SECRET_ARN])
    assert json.loads(run.get("backend.json"))["options"]["role_arn"] == ROLE


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_dry_run_detach_status_logs_cancel(aws: Aws, script: Path) -> None:
    store = f"s3://{aws.bucket}/runs"
    common = [*sm_flags(), "--replicas", "2", "--store", store, "--job", "lm",
              "--entrypoint", f"python {script} sleep", "--no-progress"]  # fmt: skip
    code, out = crf("launch", *common, "--run-id", "plan", "--dry-run")
    assert code == 0, out
    assert "SageMaker training job" in out and "ml.m5.xlarge" in out and "$0.23/h" in out
    assert "nothing was launched" in out and not aws.emu.jobs

    code, out = crf("launch", *common, "--run-id", "det", "--detach")
    assert code == 0, out
    assert "detached" in out and len(aws.emu.jobs) == 2
    wait_for(
        lambda: all(
            any(e["message"] == "sleeping" for e in j.events) for j in aws.emu.jobs.values()
        ),
        "both jobs to start sleeping",
    )
    code, out = crf("status", "det", "--store", store)
    assert code == 0 and "running" in out, out
    code, out = crf("logs", "det", "--store", store, "--rank", "1")
    assert code == 0 and "replica 1 of 2 mode sleep" in out, out
    assert DRIVER_SECRET not in out and "env AWS_ENDPOINT_URL=***" in out

    # the handles are lost: reattach by tags
    from crf.store import RunStore

    RunStore(f"{store}/det").delete("launches/0/handles.json")
    code, out = crf("cancel", "det", "--store", store)
    assert code == 0, out
    assert "cancelled 2 running replica(s)" in out
    assert all(j.status in ("Stopping", "Stopped") for j in aws.emu.jobs.values())
    result = RunStore(f"{store}/det").get_json("result.json")
    assert result["status"] == "cancelled"
    arns = {j.request["Environment"][ENV_SECRET_ARN] for j in aws.emu.jobs.values()}
    assert len(arns) == 1 and not secret_exists(aws, arns.pop())


def test_cli_early_failures(aws: Aws, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing access is listed after the plan (exit 2 with --strict); bad input is one
    error line."""
    base = ["launch", "--replicas", "2", "--job", "lm", "--run-id", "x", "--dry-run", "--strict"]
    s3 = ["--store", f"s3://{aws.bucket}/runs"]
    listed = "missing before this run can launch"
    code, out = crf(*base, *sm_flags(), "--store", str(tmp_path / "runs"))
    assert code == 2 and listed in out and "use an object store" in out, out
    code, out = crf(*base, *sm_flags(), *s3, "--instance-type", "ml.g5.xlargee")
    assert code == 2 and "did you mean ml.g5.xlarge" in out and listed not in out, out
    code, out = crf(*base, "--backend", "sagemaker", "--region", "us-east-1", *s3)
    assert code == 2 and listed in out and "IAM execution role" in out, out
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY00000000")
    code, out = crf(*base, *sm_flags(), *s3)
    assert code == 2 and listed in out and "AWS rejected your credentials" in out, out
    code, out = crf(*base[:-1], *sm_flags(), *s3)  # without --strict: the same list, exit 0
    assert code == 0 and "AWS rejected your credentials" in out, out
    assert not aws.emu.jobs and "Traceback" not in out


# --------------------------------------------------------------------------- real AWS
LIVE_STORE = os.environ.get("CRF_TEST_SAGEMAKER_STORE")  # e.g. s3://my-bucket/crf-tests
live = pytest.mark.skipif(
    not (LIVE_STORE and os.environ.get(ROLE_ARN_ENV) and boto3.session.Session().get_credentials()),
    reason="real SageMaker test: set AWS credentials, CRF_SAGEMAKER_ROLE_ARN and "
    "CRF_TEST_SAGEMAKER_STORE=s3://bucket/prefix (it runs one ml.m5.large job, a few cents)",
)


@live
@pytest.mark.e2e
@pytest.mark.slow
def test_real_sagemaker_job_runs_logs_and_cleans_up() -> None:
    import uuid

    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SAGEMAKER", "AWS_ENDPOINT_URL_STS"):
        assert not os.environ.get(var), f"unset {var} for the real-AWS test"
    ex = SageMakerExecutor("ml.m5.large", timeout_s=3600, poll_s=10)
    uri = f"{LIVE_STORE.rstrip('/')}/live-{uuid.uuid4().hex[:8]}"
    ex.check_ready(uri)
    (h,) = ex.launch_replicas(1, ["python", "-c", "print('crf-sagemaker-live-ok')"], run_uri=uri)
    try:
        (result,) = ex.collect([h], timeout=3000)
        assert result.state is ReplicaState.SUCCEEDED, result
        assert "crf-sagemaker-live-ok" in list(ex.logs(h))
    finally:
        ex.cancel_all([h])
