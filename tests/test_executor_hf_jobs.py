"""HFJobsExecutor through the official ``huggingface_hub`` client against a loopback HF Jobs API.

HF Jobs cannot run offline and has no published emulator, so ``tests/emulators/hf_jobs.py`` is
a small REST server that answers the routes the client calls (whoami, hardware, run, inspect,
SSE logs, cancel, list by label) and runs each job's command as a local subprocess (the
"image" is this machine's Python). These tests prove that crf drives the real client
correctly - what it sends (flavor, timeout, labels, secrets apart from the plain env, always a
namespace) and how it reads the answers (stages without exit codes, the replica's result in the
store, SSE logs, lookups by label) - and that the whole stack runs a real DiLoCo exchange over
moto's S3 server. Whether the Hub itself behaves as the emulator does is covered only by the
tests at the bottom, which need a real token and skip without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub", reason="needs the hf extra: pip install -e .[hf]")

from huggingface_hub import HfApi  # noqa: E402

from crf.executors.base import ExecutorError, ReplicaHandle, ReplicaState  # noqa: E402
from crf.executors.hf_jobs import (  # noqa: E402
    DEFAULT_FLAVOR,
    DEFAULT_IMAGE,
    FLAVORS,
    HFJobsExecutor,
    known_flavors,
    label_value,
)
from crf.executors.registry import make_executor  # noqa: E402
from tests import cloud_servers  # noqa: E402
from tests.cloud_servers import MotoS3, closed_port_url  # noqa: E402
from tests.emulators import hf_jobs as emulator  # noqa: E402
from tests.emulators.hf_jobs import HFJobsEmulator  # noqa: E402

moto_s3 = cloud_servers.moto_s3  # the fixtures, visible to this module's tests
s3_env = cloud_servers.s3_env

TOKEN = "hf_emulator_token_0123456789"
USER, ORG = "crf-tester", "crf-org"
SECRET = "very-secret-api-key-31337"


@pytest.fixture(scope="module")
def emu() -> Iterator[HFJobsEmulator]:
    with HFJobsEmulator({TOKEN: USER}, {USER: [ORG]}) as server:
        yield server


@pytest.fixture
def hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The emulator's token in HF_TOKEN; no saved `hf auth login` token can leak in."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)


@pytest.fixture
def run_uri(s3_env: MotoS3, hf_env: None, request: pytest.FixtureRequest) -> str:
    return f"s3://{s3_env.new_bucket()}/runs/{label_value(request.node.name)[:40]}"


def make(emu: HFJobsEmulator, **kw: Any) -> HFJobsExecutor:
    return HFJobsExecutor(endpoint=emu.endpoint, poll_s=0.0, **kw)


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    """Poll until ``pred()`` is truthy (a generous deadline, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def ended(ex: HFJobsExecutor, h: ReplicaHandle) -> Any:
    """Wait until the replica's job has ended; its final status."""
    return wait_for(lambda: (s := ex.status(h)).terminal and s, f"job {h.backend_id} to end")


def py(code: str) -> list[str]:
    return ["python", "-c", code]


# --------------------------------------------------------------------------- options, plan
def test_registry_builds_it_from_cli_strings_and_config_round_trips(emu: HFJobsEmulator) -> None:
    ex = make_executor(
        "hf",
        {"flavor": "A10G-Small", "timeout_s": "120", "endpoint": emu.endpoint, "token": "tok"},
    )
    assert isinstance(ex, HFJobsExecutor)
    assert HFJobsExecutor.hardware_option == "flavor" and not HFJobsExecutor.native_restarts
    assert ex.flavor == "a10g-small" and ex.timeout_s == 120.0
    cfg = ex.config()
    assert "token" not in cfg and "tok" not in json.dumps(cfg)
    assert cfg == {
        "flavor": "a10g-small",
        "image": DEFAULT_IMAGE,
        "namespace": None,
        "endpoint": emu.endpoint,
        "timeout_s": 120.0,
    }
    again = make_executor("hf", cfg)
    assert isinstance(again, HFJobsExecutor) and again.config() == cfg
    with pytest.raises(ExecutorError, match="has no option region"):
        make_executor("hf", {"region": "eu"})


def test_a_gpu_name_for_a_flavor_suggests_the_flavors_of_that_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--gpu A10G` on the hf backend (a Modal habit) names HF's A10G flavors; the
    suggestions were a100x8 or a100x4, spelt alike but another GPU."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    out = _cli("launch", "--backend", "hf", "--gpu", "A10G", "-n", "2", "--job", "lm",
               "--store", "s3://bucket/runs", "--dry-run")  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "unknown HF Jobs flavor 'a10g'; did you mean a10g-large or a10g-small or" in (
        " ".join(out.stderr.split())
    )
    assert "Traceback" not in out.stderr


def test_defaults_and_price_table() -> None:
    ex = HFJobsExecutor()
    assert ex.flavor == DEFAULT_FLAVOR == "cpu-basic" and ex.image == DEFAULT_IMAGE
    assert ex.timeout_s == 24 * 3600
    # every flavor the client knows has a price, and the table has no invented names
    assert set(FLAVORS) == set(known_flavors())
    assert FLAVORS["cpu-basic"][1] == 0.01 and FLAVORS["a10g-small"][1] == 1.00


def test_dry_run_plan_needs_no_network_and_names_secrets_only(
    s3_env: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    ex = HFJobsExecutor(flavor="a10g-small", endpoint=closed_port_url())
    plan = ex.describe(3, None, "s3://bucket/runs/r1")
    assert plan.backend == "hf" and plan.replicas == 3
    assert plan.hardware.startswith("a10g-small") and "A10G" in plan.hardware
    assert plan.hourly_usd == 1.00 and plan.total_hourly_usd == 3.00
    assert plan.image == DEFAULT_IMAGE and plan.timeout_s == 24 * 3600
    assert plan.command == ["python", "-m", "crf.replica"]
    assert "AWS_SECRET_ACCESS_KEY" in plan.secrets
    assert "testing" not in json.dumps(plan.to_dict())  # names, never values
    assert "Hugging Face Job" in plan.where


# --------------------------------------------------------------------------- early failures
def test_check_ready_fails_early_with_what_to_fix(
    emu: HFJobsEmulator, s3_env: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    uri = f"s3://{s3_env.new_bucket()}/runs/early"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    before = len(emu.jobs)

    with pytest.raises(ExecutorError, match="no Hugging Face token.*HF_TOKEN"):
        make(emu).check_ready(uri)

    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_000000")
    with pytest.raises(ExecutorError, match="token was rejected.*401") as e:
        make(emu).check_ready(uri)
    assert "hf_wrong_token_000000" not in str(e.value)

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(ExecutorError, match="unknown HF Jobs flavor 'a10g-tiny'.*a10g-small"):
        make(emu, flavor="a10g-tiny").check_ready(uri)
    with pytest.raises(ExecutorError, match="namespace 'someone-else' is not yours"):
        make(emu, namespace="someone-else").check_ready(uri)
    with pytest.raises(ExecutorError, match="object store"):
        make(emu).check_ready(f"file://{tmp_path}/runs/x")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ExecutorError, match="no AWS credentials"):
        make(emu).check_ready(uri)
    assert len(emu.jobs) == before  # nothing was launched

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    ok = make(emu)
    ok.check_backend()
    assert ok.namespace == USER  # resolved once, then saved in config()
    assert ok.config()["namespace"] == USER
    make(emu, namespace=ORG).check_backend()  # an org of the token's user


def test_unreachable_endpoint_is_reported(hf_env: None) -> None:
    with pytest.raises(ExecutorError, match="cannot reach the Hugging Face Jobs API"):
        HFJobsExecutor(endpoint=closed_port_url()).check_backend()


def test_a_flavor_newer_than_the_client_is_checked_with_the_server(
    emu: HFJobsEmulator, hf_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = ("b300", "Nvidia B300", "30 vCPU", "256 GB", None, 9.0)
    monkeypatch.setattr(emulator, "HARDWARE", (*emulator.HARDWARE, extra))
    ex = make(emu, flavor="b300")
    ex.check_backend()  # unknown to huggingface_hub's enum, served by the API
    plan = ex.describe(1, None, "s3://b/r")
    assert plan.hourly_usd is None and any("no published price" in n for n in plan.notes)
    with pytest.raises(ExecutorError, match="unknown HF Jobs flavor 'b400'"):
        make(emu, flavor="b400").check_backend()


# --------------------------------------------------------------------------- launch, secrets
def test_secrets_travel_as_job_secrets_and_never_show(emu: HFJobsEmulator, run_uri: str) -> None:
    """A replica prints its whole environment; the values reach it, but neither the job
    description the API returns nor the logs crf hands back show a secret."""
    ex = make(emu)
    first_request = len(emu.requests)
    ex.check_ready(run_uri)
    dump = "import os\nfor k, v in sorted(os.environ.items()): print(f'{k}={v}')"
    (h,) = ex.launch_replicas(
        1, py(dump), env={"MY_API_KEY": SECRET}, run_uri=run_uri, plain_env={"PROJECT": "grpo"}
    )
    assert ended(ex, h).state is ReplicaState.SUCCEEDED
    job = emu.jobs[h.backend_id]
    spec = job.spec
    # --env is plain environment; secrets (store credentials, --secret) never are
    assert spec["environment"]["PROJECT"] == "grpo" and "PROJECT" not in spec["secrets"]
    assert spec["environment"]["CRF_SECRET_NAMES"].split(",").count("MY_API_KEY") == 1
    assert "PROJECT" not in spec["environment"]["CRF_SECRET_NAMES"].split(",")
    # what was sent: contract in env, credentials and the caller's env as secrets
    assert spec["environment"]["CRF_RANK"] == "0" and spec["environment"]["CRF_WORLD_SIZE"] == "1"
    assert spec["environment"]["CRF_RUN_URI"] == run_uri
    assert {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "MY_API_KEY"} <= set(
        spec["secrets"]
    )
    assert spec["flavor"] == "cpu-basic" and spec["timeoutSeconds"] == 24 * 3600
    assert spec["labels"]["crf-run"] == label_value(h.run_id) and spec["labels"]["crf-rank"] == "0"
    assert spec["dockerImage"] == DEFAULT_IMAGE
    sent = json.dumps({k: v for k, v in spec.items() if k != "secrets"})
    assert SECRET not in sent and "testing" not in sent
    # every call named a namespace: one whoami (the check), then only namespaced job routes
    mine = emu.requests[first_request:]
    assert [p for _, p, _ in mine if "whoami" in p] == ["/api/whoami-v2"]
    assert all(p.startswith(f"/api/jobs/{USER}") for _, p, _ in mine if "whoami" not in p)
    # what anyone who can read the namespace sees
    info = HfApi(endpoint=emu.endpoint, token=TOKEN).inspect_job(
        job_id=h.backend_id, namespace=USER
    )
    shown = json.dumps({"env": info.environment, "secrets": info.secrets, "cmd": info.command})
    assert SECRET not in shown and "testing" not in shown
    # the replica did get them, and hid them itself: the job's stored log holds none
    raw = "\n".join(line for _, line in job.logs)
    assert "MY_API_KEY=***" in raw and SECRET not in raw and "=testing" not in raw
    lines = list(ex.logs(h))
    assert "MY_API_KEY=***" in lines and "CRF_RANK=0" in lines and "PROJECT=grpo" in lines
    assert not any(SECRET in line or "=testing" in line for line in lines)
    # so a fresh executor (reattach), which cannot know the caller's env, shows none either
    fresh = make_executor("hf", ex.config())
    assert not any(SECRET in line or "=testing" in line for line in fresh.logs(h))


def test_outcomes_without_exit_codes_come_from_the_store(emu: HFJobsEmulator, run_uri: str) -> None:
    """COMPLETED + ok (or no) result -> succeeded; COMPLETED + failed result -> failed; ERROR ->
    failed with the exit code the stage message names."""
    code = (
        "import json, os, sys\n"
        "from crf.store import RunStore\n"
        "rank = int(os.environ['CRF_RANK'])\n"
        "store = RunStore(os.environ['CRF_RUN_URI'])\n"
        "if rank == 1: store.put_json('results/1.json', {'status': 'ok', 'rank': 1})\n"
        "if rank == 2: store.put_json('results/2.json', {'status': 'failed', 'error': 'boom'})\n"
        "print('rank', rank, 'exits', {3: 3, 4: 2}.get(rank, 0), flush=True)\n"
        "sys.exit({3: 3, 4: 2}.get(rank, 0))\n"
    )
    ex = make(emu)
    handles = ex.launch_replicas(5, py(code), run_uri=run_uri)
    results = ex.collect(handles, timeout=300, poll_s=0.2)
    states = [(r.state, r.exit_code) for r in results]
    assert states == [
        (ReplicaState.SUCCEEDED, 0),  # exit 0 without a result: the process is the authority
        (ReplicaState.SUCCEEDED, 0),
        (ReplicaState.FAILED, None),  # exit 0 but the replica reported failure
        (ReplicaState.FAILED, 3),
        (ReplicaState.FAILED, 2),  # the driver does not restart a broken contract
    ]
    assert [r.ok for r in results] == [True, True, False, False, False]
    assert "boom" in (results[2].error or "") and "exit code: 3" in (results[3].error or "")
    assert [emu.jobs[h.backend_id].exit_code for h in handles] == [0, 0, 0, 3, 2]


def test_status_logs_follow_and_cancel_a_live_job(emu: HFJobsEmulator, run_uri: str) -> None:
    code = "import time\nprint('tick', flush=True)\ntime.sleep(600)\n"
    ex = make(emu)
    (h,) = ex.launch_replicas(1, py(code), run_uri=run_uri)
    wait_for(lambda: ex.status(h).state is ReplicaState.RUNNING, "RUNNING")
    wait_for(lambda: "tick" in list(ex.logs(h)), "the first log line")

    followed: list[str] = []
    follower = threading.Thread(target=lambda: followed.extend(ex.logs(h, follow=True)))
    follower.start()
    wait_for(lambda: "tick" in followed, "the follower to see the line")
    assert follower.is_alive()  # still following: the job runs

    ex.cancel(h)
    st = ended(ex, h)
    assert st.state is ReplicaState.CANCELLED
    follower.join(timeout=120)
    assert not follower.is_alive()  # follow ends with the job
    assert followed.count("tick") == 1  # replays from the start are de-duplicated
    job = emu.jobs[h.backend_id]
    wait_for(lambda: job.popen is not None and job.popen.poll() is not None, "the process to die")
    ex.cancel(h)  # cancelling an ended job is a no-op


def test_the_job_timeout_is_the_executor_timeout(emu: HFJobsEmulator, run_uri: str) -> None:
    ex = make(emu, timeout_s=2.5)
    (h,) = ex.launch_replicas(1, py("import time; time.sleep(600)"), run_uri=run_uri)
    assert emu.jobs[h.backend_id].spec["timeoutSeconds"] == 3  # whole seconds, rounded up
    st = ended(ex, h)
    assert st.state is ReplicaState.FAILED and "timed out" in st.message


def test_a_fresh_executor_reattaches_by_handles_and_by_labels(
    emu: HFJobsEmulator, run_uri: str
) -> None:
    """What `crf status/logs/cancel` do: rebuild from config(), use saved handles, or find the
    jobs by their crf-run label; a relaunched rank is found as its newest job."""
    code = "import os, time\nprint('up', os.environ['CRF_RANK'], flush=True)\ntime.sleep(600)\n"
    ex = make(emu)
    ex.check_ready(run_uri)
    handles = ex.launch_replicas(2, py(code), run_uri=run_uri, run_id="re.attach")
    saved = json.loads(json.dumps([h.to_dict() for h in handles]))
    config = json.loads(json.dumps(ex.config()))
    assert "token" not in config

    fresh = make_executor("hf", config)
    again = [ReplicaHandle(**d) for d in saved]
    for h in again:
        wait_for(lambda h=h: fresh.status(h).state is ReplicaState.RUNNING, "RUNNING")
        wait_for(lambda h=h: f"up {h.rank}" in list(fresh.logs(h)), "the log line")

    found = make_executor("hf", config).find_replicas("re.attach", run_uri, 2)
    assert [(h.rank, h.backend_id) for h in found] == [(h.rank, h.backend_id) for h in handles]
    assert all(h.run_uri == run_uri and h.world_size == 2 for h in found)

    new0 = ex.relaunch(handles[0])
    assert new0.extra["attempt"] == 1 and new0.backend_id != handles[0].backend_id
    found = fresh.find_replicas("re.attach", run_uri, 2)
    assert [h.backend_id for h in found] == [new0.backend_id, handles[1].backend_id]
    with pytest.raises(ExecutorError, match="no HF Jobs labelled crf-run=re-attach2"):
        fresh.find_replicas("re.attach2", run_uri, 2)

    fresh.cancel_all([*found, handles[0]])
    for h in [*found, handles[0]]:
        assert ended(fresh, h).state is ReplicaState.CANCELLED


def test_launch_is_all_or_nothing(
    emu: HFJobsEmulator, run_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the API refuses the second job, the first is cancelled: no orphan half of a run."""
    ex = make(emu)
    ex.check_ready(run_uri)
    real = ex._api().run_job
    calls: list[str] = []

    def flaky(**kw: Any) -> Any:
        calls.append(kw["labels"]["crf-rank"])
        if len(calls) == 2:
            return real(**{**kw, "flavor": "no-such-flavor"})
        return real(**kw)

    monkeypatch.setattr(ex._api(), "run_job", flaky)
    with pytest.raises(ExecutorError, match="starting replica 1.*Invalid flavor"):
        ex.launch_replicas(2, py("import time; time.sleep(600)"), run_uri=run_uri)
    first = [j for j in emu.jobs.values() if j.spec["environment"]["CRF_RUN_URI"] == run_uri]
    assert len(first) == 1 and first[0].stage == "CANCELED"


def test_a_job_deleted_or_unknown_is_reported_not_raised(emu: HFJobsEmulator, hf_env: None) -> None:
    ex = make(emu, namespace=USER)
    h = ReplicaHandle("hf", "r", 0, "0123456789abcdef01234567", "s3://b/runs/r", 1)
    st = ex.status(h)
    assert st.state is ReplicaState.FAILED and "not found" in st.message
    assert list(ex.logs(h)) == []
    ex.cancel(h)
    # a job someone deleted on the Hub counts as cancelled, not as a failure to restart
    job = HfApi(endpoint=emu.endpoint, token=TOKEN).run_job(
        image="python:3.12", command=["python", "-c", "pass"], namespace=USER
    )
    wait_for(lambda: emu.jobs[job.id].output_closed, "the job to end")
    emu.jobs[job.id].stage = "DELETED"
    gone = ReplicaHandle("hf", "r", 0, job.id, "s3://b/runs/r", 1, extra={"namespace": USER})
    st = make(emu).status(gone)  # a fresh executor: the namespace comes from the handle
    assert st.state is ReplicaState.CANCELLED and "deleted" in st.message


# --------------------------------------------------------------------------- through the CLI
def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_two_replica_diloco_run_on_hf_jobs(
    emu: HFJobsEmulator, s3_env: MotoS3, hf_env: None
) -> None:
    """`crf launch --backend hf`: two jobs train the lm job with DiLoCo, exchanging through
    moto's S3 (reached with the credentials that travelled as job secrets)."""
    bucket = s3_env.new_bucket()
    proc = _cli(
        "launch", "--backend", "hf", "--flavor", "cpu-upgrade", "-o", f"endpoint={emu.endpoint}",
        "--replicas", "2", "--procs-per-replica", "2", "--job", "lm", "-H", "4", "--rounds", "2",
        "--set", "hidden_size=16", "--set", "num_layers=1", "--set", "corpus_sentences=400",
        "--set", "batch_size=4", "--set", "seq_len=32", "--set", "eval_batches=1",
        "--store", f"s3://{bucket}/runs", "--run-id", "hf-e2e", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s3 = s3_env.client()

    def get(key: str) -> dict[str, Any]:
        return json.loads(s3.get_object(Bucket=bucket, Key=f"runs/hf-e2e/{key}")["Body"].read())

    result = get("result.json")
    assert result["status"] == "ok", result
    rows = result["replicas"]
    assert [r["ok"] for r in rows] == [True, True]
    assert [r["exit_code"] for r in rows] == [0, 0]
    hashes = {r["weights_sha256"] for r in rows}
    assert len(hashes) == 1 and None not in hashes and result["weights_identical"] is True
    assert all(r["rounds_committed"] == 2 for r in rows)
    # each job ran its replica as 2 local ranks (gloo), one of which used the store
    assert [get(f"results/{rank}.json")["local_ranks"] for rank in range(2)] == [2, 2]
    backend = get("backend.json")
    assert backend["backend"] == "hf"
    assert backend["options"]["flavor"] == "cpu-upgrade"
    assert backend["options"]["namespace"] == USER
    assert TOKEN not in json.dumps(backend)
    jobs = [j for j in emu.jobs.values() if (j.spec.get("labels") or {}).get("crf-run") == "hf-e2e"]
    assert len(jobs) == 2 and all(j.stage == "COMPLETED" for j in jobs)
    assert all(j.spec["flavor"] == "cpu-upgrade" for j in jobs)


SLEEPER = """
import os, time
from crf.store import RunStore
rank = int(os.environ["CRF_RANK"])
store = RunStore(os.environ["CRF_RUN_URI"])
store.put_json(f"replicas/{rank}/state.json", {"rank": rank, "phase": "training", "round": 0,
               "step": 0, "loss": None, "updated_at": time.time(), "pid": os.getpid(),
               "host": "hf-job"})
print(f"replica {rank} is up", flush=True)
time.sleep(600)
"""


def _detached(emu: HFJobsEmulator, s3: Any, bucket: str, script: Path, run_id: str,
              *more: str) -> dict[str, Any]:  # fmt: skip
    """`crf launch --backend hf --detach` of 2 replicas running ``script`` into
    s3://bucket/runs; the handles it saved."""
    proc = _cli(
        "launch", "--backend", "hf", "-o", f"endpoint={emu.endpoint}", "--replicas", "2",
        "--job", "lm", "--rounds", "1", "--entrypoint", f"python {script}", *more,
        "--store", f"s3://{bucket}/runs", "--run-id", run_id, "--detach", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    key = f"runs/{run_id}/launches/0/handles.json"
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


#: SLEEPER, once the file $GATE exists: till then a container still starting, no heartbeat
GATED = (
    """
import os, time
while not os.path.exists(os.environ["GATE"]):
    time.sleep(0.1)
"""
    + SLEEPER
)


@pytest.mark.e2e
@pytest.mark.slow
def test_crf_runs_says_starting_of_a_detached_launch_whose_jobs_have_not_beaten(
    emu: HFJobsEmulator, s3_env: MotoS3, hf_env: None, tmp_path: Path
) -> None:
    """`crf launch --detach` on HF Jobs returns while its jobs start (here: until a file
    exists, writing no heartbeat). Its driver gone, `crf runs` - the store alone, no job
    request - says ``starting`` (it said ``stopped``), then ``unknown`` once a start would
    have taken far too long, pointing to `crf status`, which asks the backend; once the
    jobs beat, ``running``."""
    from crf.launcher.liveness import CLOUD_START_S

    bucket = s3_env.new_bucket()
    store = f"s3://{bucket}/runs"
    script, gate = tmp_path / "gated.py", tmp_path / "go"
    script.write_text(GATED)
    s3 = s3_env.client()
    handles_key = "runs/hf-starting/launches/0/handles.json"
    saved = _detached(emu, s3, bucket, script, "hf-starting", "--env", f"GATE={gate}")
    ids = [h["backend_id"] for h in saved["handles"]]

    def listed() -> dict[str, Any]:
        out = _cli("runs", "--store", store, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        return {r["run_id"]: r for r in json.loads(out.stdout)}["hf-starting"]

    try:
        assert listed()["status"] == "starting"
        out = _cli("status", "hf-starting", "--store", store, "--json")
        assert json.loads(out.stdout)["status"] == "starting", out.stdout + out.stderr
        # an hour later, still no heartbeat: only the backend knows
        for h in saved["handles"]:
            h["started_at"] -= CLOUD_START_S + 3600
        s3.put_object(Bucket=bucket, Key=handles_key, Body=json.dumps(saved).encode())
        row = listed()
        assert row["status"] == "unknown" and "none has written a heartbeat" in row["note"], row
        out = _cli("runs", "--store", store)
        flat = " ".join(out.stdout.split())
        assert f"ask it with crf status hf-starting --store {store}" in flat, flat
        gate.touch()
        wait_for(lambda: listed()["status"] == "running", "the jobs' heartbeats")
    finally:
        gate.touch()
        _cli("cancel", "hf-starting", "--store", store)
    for job_id in ids:
        job = emu.jobs[job_id]
        wait_for(lambda j=job: j.popen is not None and j.popen.poll() is not None, "killed")


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_detach_then_status_logs_cancel_from_other_processes(
    emu: HFJobsEmulator, s3_env: MotoS3, hf_env: None, tmp_path: Path
) -> None:
    """`crf launch --detach`, then `crf status/logs/cancel` rebuild the executor from
    backend.json (no token in it) - once with the saved handles, once by the jobs' labels."""
    bucket = s3_env.new_bucket()
    store = f"s3://{bucket}/runs"
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    s3 = s3_env.client()
    handles_key = "runs/hf-detached/launches/0/handles.json"
    saved = _detached(emu, s3, bucket, script, "hf-detached")
    ids = [h["backend_id"] for h in saved["handles"]]
    assert sorted(ids) == sorted(j.id for j in emu.jobs.values() if j.id in ids)
    for job_id in ids:
        wait_for(lambda j=job_id: any("is up" in line for _, line in emu.jobs[j].logs), "up")

    out = _cli("status", "hf-detached", "--store", store)
    assert out.returncode == 0 and "running" in out.stdout, out.stdout + out.stderr
    out = _cli("logs", "hf-detached", "--store", store, "--rank", "1")
    assert out.returncode == 0 and "replica 1 is up" in out.stdout, out.stdout + out.stderr

    # the driver "died" before saving handles: the labels find the jobs
    s3.delete_object(Bucket=bucket, Key=handles_key)
    out = _cli("status", "hf-detached", "--store", store)
    assert out.returncode == 0 and "running" in out.stdout, out.stdout + out.stderr

    out = _cli("cancel", "hf-detached", "--store", store)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cancelled 2" in out.stdout
    assert all(emu.jobs[j].stage == "CANCELED" for j in ids)
    for job_id in ids:
        job = emu.jobs[job_id]
        wait_for(lambda j=job: j.popen is not None and j.popen.poll() is not None, "killed")


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_refuses_bad_hf_settings_before_launching(
    emu: HFJobsEmulator, s3_env: MotoS3, hf_env: None, tmp_path: Path
) -> None:
    store = f"s3://{s3_env.new_bucket()}/runs"
    base = ["launch", "--backend", "hf", "-o", f"endpoint={emu.endpoint}", "--replicas", "2"]
    before = len(emu.jobs)
    out = _cli(*base, "--flavor", "h100-huge", "--store", store, "--run-id", "bad1")
    assert out.returncode == 2 and "unknown HF Jobs flavor 'h100-huge'" in out.stderr
    out = _cli(*base, "--store", str(tmp_path / "runs"), "--run-id", "bad2")
    assert out.returncode == 2 and "object store" in out.stderr
    env_bad = {**os.environ, "HF_TOKEN": "hf_not_a_real_token_42"}
    bad = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *base, "--store", store, "--run-id", "bad3"],
        capture_output=True,
        text=True,
        env=env_bad,
        timeout=300,
    )
    assert bad.returncode == 2 and "token was rejected" in bad.stderr
    assert "hf_not_a_real_token_42" not in bad.stdout + bad.stderr
    assert len(emu.jobs) == before
    out = _cli(*base, "--flavor", "a10g-small", "--store", store, "--dry-run", "--run-id", "d1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "a10g-small" in out.stdout and "$1.00/h per replica" in out.stdout


# --------------------------------------------------------------------------- the real service
REAL_TOKEN = os.environ.get("HF_TOKEN")
REAL_STORE = os.environ.get("CRF_HF_TEST_STORE")  # e.g. s3://bucket/crf-tests (with AWS creds)
real = pytest.mark.skipif(
    not REAL_TOKEN,
    reason="needs a real Hugging Face token in HF_TOKEN (talks to huggingface.co)",
)


@real
def test_real_hub_accepts_the_token_and_flavor() -> None:
    ex = HFJobsExecutor(endpoint="https://huggingface.co", token=REAL_TOKEN)
    ex.check_backend()
    assert ex.namespace
    with pytest.raises(ExecutorError, match="unknown HF Jobs flavor"):
        HFJobsExecutor(
            flavor="no-such-flavor", endpoint="https://huggingface.co", token=REAL_TOKEN
        ).check_backend()


@pytest.mark.slow
@pytest.mark.skipif(
    not (REAL_TOKEN and REAL_STORE),
    reason="runs a real HF job (about $0.01): needs HF_TOKEN and CRF_HF_TEST_STORE, a store the "
    "job can reach (s3://..., gs://... or hf://buckets/...) with its credentials set",
)
def test_real_job_runs_logs_and_is_found_by_label() -> None:
    import uuid

    ex = HFJobsExecutor(endpoint="https://huggingface.co", token=REAL_TOKEN, timeout_s=1800)
    uri = f"{REAL_STORE.rstrip('/')}/crf-hf-test-{uuid.uuid4().hex[:8]}"
    ex.check_ready(uri)
    (h,) = ex.launch_replicas(1, ["python", "-c", "print('crf-real-ok')"], run_uri=uri)
    try:
        found = ex.find_replicas(h.run_id, uri, 1)
        assert [f.backend_id for f in found] == [h.backend_id]
        (res,) = ex.collect([h], timeout=1800, poll_s=10)
        assert res.state is ReplicaState.SUCCEEDED, res.error
        assert "crf-real-ok" in list(ex.logs(h))
    finally:
        ex.cancel_all([h])
