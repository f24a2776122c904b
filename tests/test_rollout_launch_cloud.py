"""Rollout workers on the Modal and SageMaker backends, through their emulators: the workers
are containers of their own hardware, with the replicas' image, code and secrets handling,
labelled ``crf-role=rollout`` so a lookup of the run's replicas by label leaves them out, and
relaunched as workers. (HF Jobs: tests/test_rollout_launch.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("modal", reason="needs the modal extra: pip install -e .[modal]")
pytest.importorskip("boto3", reason="needs the sagemaker extra: pip install -e .[sagemaker]")

from crf.executors.base import ReplicaState  # noqa: E402
from crf.executors.modal import ModalExecutor  # noqa: E402
from crf.launcher.workers import split_options  # noqa: E402
from tests import test_executor_modal as modal_tests  # noqa: E402
from tests import test_executor_sagemaker as sm_tests  # noqa: E402
from tests.emulators.modal_servicer import FakeModal  # noqa: E402

# the fixtures, visible to this module's tests
moto_s3, s3_env = modal_tests.moto_s3, modal_tests.s3_env
fake, modal_env, run_uri = modal_tests.fake, modal_tests.modal_env, modal_tests.run_uri
aws, script = sm_tests.aws, sm_tests.script

pytestmark = pytest.mark.timeout(300)
SECRET = "hf_worker_secret_value_0001"
ROLE_CODE = (
    "import os, time\n"
    "print('role', os.environ.get('CRF_ROLE'), 'worker', os.environ.get('CRF_WORKER'),"
    " 'rank', os.environ['CRF_RANK'], flush=True)\n"
    "time.sleep(600)\n"
)


def test_modal_workers_run_in_sandboxes_of_their_own_gpu(
    run_uri: str, modal_env: FakeModal
) -> None:
    trainer_opts, rollout_opts = split_options("modal", {"timeout_s": 120, "rollout_gpu": "T4"})
    trainers, workers = ModalExecutor(**trainer_opts), ModalExecutor(**trainer_opts, **rollout_opts)
    try:
        (replica,) = trainers.launch_replicas(1, modal_tests.py(ROLE_CODE), run_uri=run_uri)
        handles = workers.launch_workers(2, 1, modal_tests.py(ROLE_CODE), env={"K": SECRET},
                                         run_uri=run_uri, run_id=replica.run_id)  # fmt: skip
        sb = modal_tests.sandbox(modal_env, handles[1])
        # the secret travels in the credentials' Secret, never in the plain contract or the
        # sandbox's description (a GPU sandbox names its Secrets by id)
        sources = [modal_env.secrets[s["secret_id"]] for s in sb.secret_sources]
        (creds,) = [s for s in sources if "AWS_SECRET_ACCESS_KEY" in s]
        (plain,) = [s for s in sources if "CRF_RANK" in s]
        assert creds["K"] == SECRET and "CRF_ROLE" not in creds
        assert plain["CRF_ROLE"] == "rollout" and SECRET not in str(plain)
        assert SECRET not in str(sb.definition) and SECRET not in str(sb.tags)
        assert sb.tags == {"crf-run": replica.run_id, "crf-rank": "1", "crf-role": "rollout"}
        assert "crf-role" not in modal_tests.sandbox(modal_env, replica).tags
        assert sb.definition.resources.gpu_config.gpu_type == "T4"
        assert not modal_tests.sandbox(modal_env, replica).definition.resources.gpu_config.gpu_type
        modal_tests.wait_for_line(workers, handles[1], "role rollout worker 1 rank 0")
        found = trainers.find_replicas(replica.run_id, run_uri, 1)
        assert [h.backend_id for h in found] == [replica.backend_id]
        workers.cancel(handles[0])
        assert modal_tests.wait_terminal(workers, handles[0]).state is ReplicaState.CANCELLED
        again = workers.relaunch(handles[0])
        assert again.extra["role"] == "rollout" and again.extra["attempt"] == 1
        modal_tests.wait_for_line(workers, again, "role rollout worker 0 rank 0")
        workers.cancel_all([*handles, again])
        trainers.cancel_all([replica])
    finally:
        trainers.close()
        workers.close()
    assert not modal_env.unimplemented


def test_sagemaker_workers_are_training_jobs_of_their_own_instance_type(
    aws: sm_tests.Aws, script: Path
) -> None:
    uri = aws.uri("roles")
    trainers = sm_tests.executor("ml.m5.large")
    workers = sm_tests.executor("ml.g5.xlarge")
    (replica,) = trainers.launch_replicas(1, ["python", str(script), "ok"], run_uri=uri)
    token = {"MY_TOKEN": sm_tests.CALLER_TOKEN}
    handles = workers.launch_workers(2, 1, ["python", str(script), "ok"], run_uri=uri,
                                     run_id="roles", env=token)  # fmt: skip
    request = aws.emu.jobs[handles[1].backend_id].request
    # what anyone allowed to DescribeTrainingJob sees of a worker: the secret's ARN only
    desc = aws.sagemaker().describe_training_job(TrainingJobName=handles[1].backend_id)
    assert desc["Environment"][sm_tests.ENV_SECRET_ARN] == handles[1].extra["secret_arn"]
    blob = json.dumps(desc, default=str)
    for value in (sm_tests.CALLER_TOKEN, sm_tests.DRIVER_KEY, sm_tests.DRIVER_SECRET):
        assert value not in blob
    assert request["ResourceConfig"]["InstanceType"] == "ml.g5.xlarge"
    assert (
        aws.emu.jobs[replica.backend_id].request["ResourceConfig"]["InstanceType"] == "ml.m5.large"
    )
    assert "-rw1-" in handles[1].backend_id and "-r0-" in replica.backend_id
    tags = {t["Key"]: t["Value"] for t in request["Tags"]}
    assert tags == {"crf-run": "roles", "crf-rank": "1", "crf-role": "rollout"}
    env = request["Environment"]
    assert (env["CRF_ROLE"], env["CRF_WORKER"], env["CRF_RANK"]) == ("rollout", "1", "0")
    for h in [replica, *handles]:
        sm_tests.wait_for(lambda h=h: workers.status(h).terminal, "the jobs to end")
    found = trainers.find_replicas("roles", uri, 1)
    assert [h.backend_id for h in found] == [replica.backend_id]
    assert "env CRF_ROLE=rollout" in list(workers.logs(handles[0]))
