"""ModalExecutor through the official ``modal`` client (1.6.4) against a FAKE Modal servicer.

Modal cannot run offline and publishes no emulator, so ``tests/emulators/modal_servicer.py``
is a fake: a grpclib server answering the RPCs the client makes, which runs each Sandbox's
command as a local subprocess (the "image" is this machine's Python). What these tests prove
is that crf drives the real client correctly - the requests it sends (image, GPU, timeout,
tags, secrets apart from the contract env) and how it reads the answers (exit codes 124/137,
stdout/stderr streams of V2 CPU and V1 GPU sandboxes, listing by tags) - and that the whole
stack runs a real DiLoCo exchange over the S3 emulator. Whether Modal itself behaves as the
fake does is covered only by the tests at the bottom, which need real credentials and skip
without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("modal", reason="needs the modal client (the dev extra pins 1.6.4)")
pytest.importorskip("grpclib", reason="the fake Modal servicer needs grpclib (dev extra)")

from crf.executors import registry  # noqa: E402
from crf.executors.base import ExecutorError, ReplicaHandle, ReplicaState  # noqa: E402
from crf.executors.modal import (  # noqa: E402
    GPU_USD_PER_S,
    ModalExecutor,
    hourly_price,
    parse_gpu,
)
from tests import cloud_servers  # noqa: E402
from tests.cloud_servers import MotoS3  # noqa: E402
from tests.emulators.modal_servicer import FakeModal  # noqa: E402

moto_s3 = cloud_servers.moto_s3  # the fixtures, visible to this module's tests
s3_env = cloud_servers.s3_env

pytestmark = pytest.mark.timeout(300)
TOKEN_ID, TOKEN_SECRET = "ak-crf-fake", "as-crf-fake-secret"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModal]:
    server = FakeModal(TOKEN_ID, TOKEN_SECRET).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def modal_env(fake: FakeModal, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeModal:
    """The client points at the fake with its token; no ~/.modal.toml is read."""
    monkeypatch.setenv("MODAL_SERVER_URL", fake.url)
    monkeypatch.setenv("MODAL_TOKEN_ID", TOKEN_ID)
    monkeypatch.setenv("MODAL_TOKEN_SECRET", TOKEN_SECRET)
    monkeypatch.delenv("MODAL_PROFILE", raising=False)
    monkeypatch.delenv("MODAL_ENVIRONMENT", raising=False)
    assert not fake.unimplemented, fake.unimplemented
    return fake


@pytest.fixture
def run_uri(s3_env: MotoS3, modal_env: FakeModal, request: pytest.FixtureRequest) -> str:
    bucket = s3_env.new_bucket()
    return f"s3://{bucket}/runs/{request.node.name.replace('[', '-').rstrip(']')[:40]}"


@pytest.fixture
def executor(modal_env: FakeModal) -> Iterator[ModalExecutor]:
    ex = ModalExecutor(timeout_s=120)
    yield ex
    ex.close()


def py(code: str) -> list[str]:
    """A replica command: the container's ``python`` running ``code``."""
    return ["python", "-c", code]


def wait_terminal(ex: ModalExecutor, handle: ReplicaHandle, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ex.status(handle)
        if st.terminal:
            return st
        time.sleep(0.2)
    raise AssertionError(f"replica {handle.rank} did not end: {ex.status(handle)}")


def wait_for_line(ex: ModalExecutor, handle: ReplicaHandle, text: str) -> None:
    with contextlib.closing(ex.logs(handle, follow=True)) as lines:
        for line in lines:
            if text in line:
                return
    raise AssertionError(f"{text!r} never appeared in the logs")


def sandbox(fake: FakeModal, handle: ReplicaHandle) -> Any:
    return fake.sandboxes[handle.backend_id]


# --------------------------------------------------------------------------- options, plan
def image_commands(fake: FakeModal, image_id: str) -> list[str]:
    """The Dockerfile commands of an image and of the images it is built on, base first."""
    image = fake.images[image_id]
    base = [c for b in image.base_images for c in image_commands(fake, b.image_id)]
    return [*base, *image.dockerfile_commands]


def test_gpu_names_follow_modal() -> None:
    assert parse_gpu(None) is None and parse_gpu("") is None
    assert parse_gpu("a10g") == ("A10G", 1)
    assert parse_gpu("H100:2") == ("H100", 2)
    assert parse_gpu("h100!") == ("H100!", 1)
    assert parse_gpu("A100-80GB:8") == ("A100-80GB", 8)
    with pytest.raises(ExecutorError, match="unknown Modal GPU 'V100'.*H100"):
        parse_gpu("V100")
    with pytest.raises(ExecutorError, match="1 to 4 A10G"):
        parse_gpu("A10G:8")
    with pytest.raises(ExecutorError, match="bad GPU count"):
        parse_gpu("H100:two")


def test_price_table() -> None:
    cpu_only = hourly_price(None, None, None)  # crf's CPU-only reservation: 2 cores, 4 GiB
    assert cpu_only == pytest.approx(2 * 0.00003942 * 3600 + 4 * 0.00000672 * 3600)
    h100x2 = hourly_price("H100:2", 8, 32768)
    assert h100x2 == pytest.approx(
        2 * GPU_USD_PER_S["H100"] * 3600 + 8 * 0.00003942 * 3600 + 32 * 0.00000672 * 3600
    )
    assert hourly_price("A100", None, None) == hourly_price("A100-40GB", None, None)


def test_registry_builds_it_from_cli_strings_and_config_round_trips() -> None:
    ex = registry.make_executor(
        "modal",
        {"gpu": "A10G", "cpu": "2", "memory_mb": "4096", "timeout_s": "600", "app_name": "x"},
    )
    assert isinstance(ex, ModalExecutor) and ModalExecutor.hardware_option == "gpu"
    assert (ex.gpu, ex.cpu, ex.memory_mb, ex.timeout_s) == ("A10G", 2.0, 4096, 600.0)
    again = registry.make_executor("modal", ex.config())
    assert again.config() == ex.config()
    assert not any("token" in k.lower() or "secret" in k.lower() for k in ex.config())
    with pytest.raises(ExecutorError, match="at most 24 h"):
        ModalExecutor(timeout_s=2 * 86400)
    with pytest.raises(ExecutorError, match="cpu must be a number"):
        ModalExecutor(cpu="lots")
    # a value that is not a number names its option, not only the value
    with pytest.raises(ExecutorError, match=r"modal backend \(-o timeout_s=abc\): could not"):
        registry.make_executor("modal", {"timeout_s": "abc"})


def test_describe_is_the_dry_run_plan(s3_env: MotoS3) -> None:
    ex = ModalExecutor(gpu="H100:2", cpu=8, memory_mb=32768, timeout_s=3600, region="us-east")
    plan = ex.describe(3, None, "s3://bucket/runs/r1")
    assert plan.backend == "modal" and plan.replicas == 3
    assert "2x H100" in plan.hardware and plan.resources == "8 CPU core(s), 32 GiB reserved"
    assert plan.hourly_usd == pytest.approx(hourly_price("H100:2", 8, 32768))
    assert plan.total_hourly_usd == pytest.approx(3 * plan.hourly_usd)
    assert plan.command == ["python", "-m", "crf.replica"]
    assert plan.timeout_s == 3600 and plan.region == "us-east"
    assert "AWS_SECRET_ACCESS_KEY" in plan.secrets  # names only
    assert "testing" not in json.dumps(plan.to_dict())
    with pytest.raises(ExecutorError, match="unknown Modal GPU"):
        ModalExecutor(gpu="K80").describe(1, None, "s3://bucket/runs/r1")


def test_dry_run_of_a_complete_setup_lists_nothing(s3_env: MotoS3, modal_env: FakeModal) -> None:
    """Token accepted by the (fake) Modal, store answering with its credentials: --dry-run
    --strict has nothing to list and exits 0."""
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    store = f"s3://{s3_env.new_bucket()}/runs"
    sandboxes, hellos = len(modal_env.sandboxes), modal_env.calls.count("ClientHello")
    args = ["launch", "--backend", "modal", "-n", "2", "--job", "lm", "--store", store]
    result = CliRunner().invoke(app, [*args, "--dry-run", "--strict"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "nothing missing" in result.output and "missing before" not in result.output
    assert ModalExecutor().missing(f"{store}/x") == []
    assert modal_env.calls.count("ClientHello") > hellos  # the token was really checked
    assert len(modal_env.sandboxes) == sandboxes  # and nothing started


# --------------------------------------------------------------------------- early failures
def test_no_credentials_fail_before_anything(
    s3_env: MotoS3, fake: FakeModal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODAL_SERVER_URL", fake.url)
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setattr("modal.config._user_config", {})  # no ~/.modal.toml either
    calls = len(fake.calls)
    with pytest.raises(ExecutorError, match="modal token new.*MODAL_TOKEN_ID/MODAL_TOKEN_SECRET"):
        ModalExecutor().check_ready("s3://bucket/runs/r1")
    assert len(fake.calls) == calls  # nothing reached Modal


def test_wrong_token_is_rejected_by_the_check(
    s3_env: MotoS3, fake: FakeModal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODAL_SERVER_URL", fake.url)
    monkeypatch.setenv("MODAL_TOKEN_ID", TOKEN_ID)
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong")
    sandboxes = len(fake.sandboxes)
    with pytest.raises(ExecutorError, match="Modal rejected the credentials.*modal token new"):
        ModalExecutor().check_ready("s3://bucket/runs/r1")
    assert fake.rejected[-1] == "ClientHello"
    assert len(fake.sandboxes) == sandboxes


def test_unknown_gpu_fails_before_modal_is_asked(modal_env: FakeModal, s3_env: MotoS3) -> None:
    calls = len(modal_env.calls)
    with pytest.raises(ExecutorError, match="unknown Modal GPU 'A10X'"):
        ModalExecutor(gpu="A10X").check_ready("s3://bucket/runs/r1")
    assert len(modal_env.calls) == calls


def test_local_store_is_refused(modal_env: FakeModal, tmp_path: Path) -> None:
    with pytest.raises(ExecutorError, match="use an object store"):
        ModalExecutor().check_ready(f"file://{tmp_path}/runs/r1")
    with pytest.raises(ExecutorError, match="use an object store"):
        ModalExecutor().launch_replicas(1, run_uri=str(tmp_path / "runs" / "r1"))


def test_missing_store_credentials(modal_env: FakeModal, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ExecutorError, match="no AWS credentials"):
        ModalExecutor().check_ready("s3://bucket/runs/r1")


# --------------------------------------------------------------------------- launch and run
PRINT_ENV = (
    "import os, sys\n"
    "for k in sorted(os.environ): print(f'{k}={os.environ[k]}')\n"
    "print('to stderr', file=sys.stderr)\n"
)


def test_launch_runs_the_bootstrap_with_secrets_apart(
    executor: ModalExecutor, run_uri: str, modal_env: FakeModal
) -> None:
    """CPU sandbox (the client's V2 path): contract in env, credentials in the Secret, code
    fetched from the store by the real bootstrap, logs read and redacted."""
    executor.check_ready(run_uri)
    (h,) = executor.launch_replicas(
        1, py(PRINT_ENV), env={"MY_API_TOKEN": "tok-0123456789"}, run_uri=run_uri,
        plain_env={"PROJECT": "grpo"},
    )  # fmt: skip
    st = wait_terminal(executor, h)
    assert st.state is ReplicaState.SUCCEEDED and st.exit_code == 0
    sb = sandbox(modal_env, h)
    assert sb.v2 and h.backend == "modal" and h.extra["app_name"] == "crf"
    # what Modal was asked for
    d = sb.definition
    assert d.timeout_secs == 120
    assert list(d.entrypoint_args[:2]) == ["python", "-c"]  # the shared bootstrap
    assert list(d.entrypoint_args[-3:]) == py(PRINT_ENV)
    assert sb.tags == {"crf-run": h.run_id, "crf-rank": "0"}
    image = modal_env.images[d.image_id]
    pip = " ".join(cmd for cmd in image.dockerfile_commands if "pip install" in cmd)
    assert "s3fs" in pip and "torchft-nightly" in pip
    # the credentials travelled in their own secret source, the contract in another
    (secret_src,) = [s for s in sb.secret_sources if "AWS_SECRET_ACCESS_KEY" in s.get("env", {})]
    assert secret_src["env"]["MY_API_TOKEN"] == "tok-0123456789"
    assert "CRF_RANK" not in secret_src["env"]
    (plain,) = [s for s in sb.secret_sources if "CRF_RANK" in s.get("env", {})]
    assert not {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "MY_API_TOKEN"} & set(plain["env"])
    assert plain["env"]["CRF_RUN_URI"] == run_uri and plain["env"]["CRF_WORLD_SIZE"] == "1"
    assert plain["env"]["PROJECT"] == "grpo" and "PROJECT" not in secret_src["env"]
    assert "testing" not in " ".join(d.entrypoint_args)
    # the replica saw both, and its printed environment comes back redacted
    lines = list(executor.logs(h))
    assert any(line.startswith("crf bootstrap: code code/crf-") for line in lines)
    assert "CRF_RANK=0" in lines and "to stderr" in lines
    assert "MY_API_TOKEN=***" in lines and "AWS_SECRET_ACCESS_KEY=***" in lines
    assert not any("tok-0123456789" in line for line in lines)
    assert not any(line.endswith("=testing") for line in lines)
    assert not modal_env.unimplemented


def test_gpu_sandbox_uses_the_v1_path(run_uri: str, modal_env: FakeModal) -> None:
    """A GPU makes the client create a V1 sandbox: Secrets by id, logs via SandboxGetLogs."""
    ex = ModalExecutor(gpu="T4:2", cpu=2, memory_mb=2048, timeout_s=90)
    try:
        (h,) = ex.launch_replicas(1, py(PRINT_ENV), run_uri=run_uri)
        assert wait_terminal(ex, h).state is ReplicaState.SUCCEEDED
        sb = sandbox(modal_env, h)
        assert not sb.v2
        res = sb.definition.resources
        assert (res.gpu_config.gpu_type, res.gpu_config.count) == ("T4", 2)
        # the default image (debian_slim) holds a C compiler for Triton: the trainer's
        # compiled decoding (crf/composer/generation.py) runs there
        commands = image_commands(modal_env, sb.definition.image_id)
        assert any("apt-get install" in cmd and "gcc" in cmd for cmd in commands), commands
        assert (res.milli_cpu, res.memory_mb, sb.definition.timeout_secs) == (2000, 2048, 90)
        by_id = [modal_env.secrets[s["secret_id"]] for s in sb.secret_sources]
        (creds,) = [s for s in by_id if "AWS_SECRET_ACCESS_KEY" in s]
        assert "CRF_RANK" not in creds
        lines = list(ex.logs(h))
        assert "CRF_RANK=0" in lines and "AWS_SECRET_ACCESS_KEY=***" in lines
        assert "SandboxGetLogs" in modal_env.calls and not modal_env.unimplemented
    finally:
        ex.close()


def test_exit_code_and_failure(executor: ModalExecutor, run_uri: str) -> None:
    (h,) = executor.launch_replicas(1, py("import sys; print('bye'); sys.exit(3)"), run_uri=run_uri)
    st = wait_terminal(executor, h)
    assert st.state is ReplicaState.FAILED and st.exit_code == 3 and "code 3" in st.message
    assert "bye" in list(executor.logs(h))


def test_timeout_comes_from_the_run(run_uri: str, modal_env: FakeModal) -> None:
    ex = ModalExecutor(timeout_s=3)
    try:
        (h,) = ex.launch_replicas(1, py("import time; time.sleep(120)"), run_uri=run_uri)
        assert sandbox(modal_env, h).definition.timeout_secs == 3
        st = wait_terminal(ex, h)
        assert st.state is ReplicaState.FAILED and st.exit_code == 124
        assert "timed out" in st.message
    finally:
        ex.close()


def test_status_logs_follow_cancel_and_reattach(
    executor: ModalExecutor, run_uri: str, modal_env: FakeModal
) -> None:
    code = (
        "import time\n"
        "for i in range(10000):\n"
        "    print(f'tick {i}', flush=True)\n"
        "    time.sleep(0.1)\n"
    )
    handles = executor.launch_replicas(2, py(code), run_uri=run_uri)
    assert [h.rank for h in handles] == [0, 1]
    for h in handles:
        assert executor.status(h).state is ReplicaState.RUNNING
    wait_for_line(executor, handles[1], "tick 3")
    # logs without follow return what is there (the replica keeps running)
    lines = list(executor.logs(handles[0]))
    assert "tick 0" in lines and executor.status(handles[0]).state is ReplicaState.RUNNING

    # a fresh executor rebuilt from config() reads the saved handles ...
    saved = json.loads(json.dumps([h.to_dict() for h in handles]))
    other = registry.make_executor("modal", executor.config())
    try:
        again = [ReplicaHandle(**d) for d in saved]
        assert other.status(again[0]).state is ReplicaState.RUNNING
        wait_for_line(other, again[0], "tick 5")
        # ... and finds the running replicas by their tags alone
        found = other.find_replicas(handles[0].run_id, run_uri, 2)
        assert [(f.rank, f.backend_id) for f in found] == [(h.rank, h.backend_id) for h in handles]
        # cancel from the other process: both ends read "cancelled"
        other.cancel(again[1])
        st = wait_terminal(other, again[1])
        assert st.state is ReplicaState.CANCELLED and st.exit_code == 137
        assert wait_terminal(executor, handles[1]).state is ReplicaState.CANCELLED
        assert sandbox(modal_env, handles[1]).tags["crf-cancelled"] == "1"
        # follow ends when the replica does
        executor.cancel_all(handles)
        assert wait_terminal(executor, handles[0]).state is ReplicaState.CANCELLED
        tail = list(other.logs(again[0], follow=True))
        assert tail[0].startswith("crf bootstrap") and "tick 5" in tail
        other.cancel(again[0])  # already ended: a no-op
        with pytest.raises(ExecutorError, match="no running Modal Sandbox"):
            other.find_replicas(handles[0].run_id, run_uri, 2)
    finally:
        other.close()  # type: ignore[attr-defined]
    assert not modal_env.unimplemented


def test_relaunch_starts_the_rank_again(executor: ModalExecutor, run_uri: str) -> None:
    (h,) = executor.launch_replicas(1, py("import sys; sys.exit(1)"), run_uri=run_uri)
    wait_terminal(executor, h)
    new = executor.relaunch(h)
    assert new.rank == 0 and new.backend_id != h.backend_id and new.extra["attempt"] == 1
    assert wait_terminal(executor, new).exit_code == 1


def test_unknown_sandbox_id(executor: ModalExecutor, run_uri: str) -> None:
    h = ReplicaHandle("modal", "r", 0, "sb-v2-doesnotexist", run_uri, 1)
    with pytest.raises(ExecutorError, match="not found"):
        executor.status(h)


def test_the_fake_refuses_calls_it_does_not_cover(modal_env: FakeModal) -> None:
    """An RPC the fake does not implement fails loudly instead of answering something made up."""
    import modal
    from modal.exception import Error as ModalError

    client = modal.Client.from_credentials(TOKEN_ID, TOKEN_SECRET)
    try:
        with pytest.raises(ModalError, match="fake modal servicer: SandboxGetFromName"):
            modal.Sandbox.from_name("crf", "no-such-sandbox", client=client)
    finally:
        client.close()
    assert modal_env.unimplemented == ["SandboxGetFromNameV2"]
    modal_env.unimplemented.clear()


# --------------------------------------------------------------------------- end to end
def read_json(s3: MotoS3, bucket: str, key: str) -> Any:
    return json.loads(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_crf_launch_on_modal_two_replicas_over_s3(
    s3_env: MotoS3, modal_env: FakeModal, tmp_path: Path
) -> None:
    """`crf launch --backend modal` runs a real 2-replica DiLoCo lm run: sandboxes (local
    processes of the fake) exchange through the moto S3 server with credentials they got only
    through the Modal Secret, and end with bit-identical weights."""
    bucket = s3_env.new_bucket()
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "COLUMNS": "200"}
    cmd = [
        sys.executable, "-m", "crf.launcher.cli", "launch", "--backend", "modal",
        "--replicas", "2", "--procs-per-replica", "2", "--job", "lm", "-H", "4", "--rounds", "2",
        "--set", "corpus_sentences=400", "--set", "hidden_size=32", "--set", "seq_len=32",
        "--set", "batch_size=8", "--set", "eval_batches=1",
        "--store", f"s3://{bucket}/runs", "--run-id", "modal-e2e", "--timeout", "900",
        "--no-progress",
    ]  # fmt: skip
    before = set(modal_env.sandboxes)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    result = read_json(s3_env, bucket, "runs/modal-e2e/result.json")
    assert result["status"] == "ok", result
    rows = result["replicas"]
    assert len(rows) == 2 and all(r["ok"] and r["exit_code"] == 0 for r in rows), rows
    assert result["weights_identical"] is True
    hashes = {r["weights_sha256"] for r in rows}
    assert len(hashes) == 1 and None not in hashes
    assert all(r["rounds_committed"] == 2 for r in rows)
    # each sandbox ran its replica as 2 local ranks (gloo), one of which used the store
    for rank in range(2):
        assert read_json(s3_env, bucket, f"runs/modal-e2e/results/{rank}.json")["local_ranks"] == 2
    started = [modal_env.sandboxes[s] for s in set(modal_env.sandboxes) - before]
    assert len(started) == 2
    assert {sb.tags["crf-rank"] for sb in started} == {"0", "1"}
    backend = read_json(s3_env, bucket, "runs/modal-e2e/backend.json")
    assert "testing" not in json.dumps(backend)
    # the Sandbox timeout is the executor's, which --timeout set (the CLI adds a margin)
    assert backend["backend"] == "modal"
    timeout_s = backend["options"]["timeout_s"]
    assert timeout_s >= 900
    assert all(sb.definition.timeout_secs == int(timeout_s) for sb in started)
    assert "testing" not in out
    assert not modal_env.unimplemented


SLEEPER = (
    "import os, time; "
    "print(f'replica {os.environ[\"CRF_RANK\"]} waiting', flush=True); time.sleep(600)"
)


def crf_cli(*args: str, timeout: float = 300) -> tuple[int, str]:
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "COLUMNS": "200"}
    p = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout + p.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_dry_run_detach_status_logs_cancel(s3_env: MotoS3, modal_env: FakeModal) -> None:
    """The CLI's reattaching commands on a detached Modal run, each in its own process: they
    rebuild the executor from backend.json and use the saved handles, or the Sandbox tags
    once the handles are gone."""
    store = f"s3://{s3_env.new_bucket()}/runs"
    before = len(modal_env.sandboxes)
    code, out = crf_cli(
        "launch", "--backend", "modal", "--gpu", "H100:2", "-n", "3", "--job", "lm",
        "--store", store, "--run-id", "dry", "--dry-run",
    )  # fmt: skip
    assert code == 0, out
    assert "modal" in out and "2x H100" in out and "nothing was launched" in out
    assert f"{3 * hourly_price('H100:2', None, None):.2f}" in out  # the run's hourly cost
    assert len(modal_env.sandboxes) == before

    code, out = crf_cli(
        "launch", "--backend", "modal", "-n", "2", "--job", "lm", "--store", store,
        "--run-id", "det", "--entrypoint", f"python -c {shlex.quote(SLEEPER)}", "--detach",
    )  # fmt: skip
    assert code == 0, out
    ids = {sb.tags["crf-rank"]: sid for sid, sb in modal_env.sandboxes.items()
           if sb.tags.get("crf-run") == "det"}  # fmt: skip
    assert sorted(ids) == ["0", "1"]
    for sid in ids.values():
        wait_output(modal_env.sandboxes[sid], "waiting")

    code, out = crf_cli("status", "det", "--store", store)
    assert code == 0 and out.count("running") >= 2, out
    code, out = crf_cli("logs", "det", "--store", store, "--rank", "1")
    assert code == 0 and "replica 1 waiting" in out, out

    bucket, prefix = store.removeprefix("s3://").split("/", 1)
    s3_env.client().delete_object(Bucket=bucket, Key=f"{prefix}/det/launches/0/handles.json")
    code, out = crf_cli("status", "det", "--store", store)  # found by the Sandbox tags
    assert code == 0 and out.count("running") >= 2, out

    code, out = crf_cli("cancel", "det", "--store", store)
    assert code == 0 and "cancelled 2" in out, out
    for sid in ids.values():
        sb = modal_env.sandboxes[sid]
        deadline = time.monotonic() + 30
        while not sb.done and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sb.terminated and sb.tags["crf-cancelled"] == "1"
    assert read_json(s3_env, bucket, f"{prefix}/det/result.json")["status"] == "cancelled"
    assert not modal_env.unimplemented


def wait_output(sb: Any, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in sb.output(1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert text in sb.output(1), sb.output(1) + sb.output(2)


BEATING_SLEEPER = (
    "import os, time; from crf import layout; from crf.store import RunStore; "
    "r = int(os.environ['CRF_RANK']); "
    "RunStore(os.environ['CRF_RUN_URI']).put_json(layout.heartbeat_key(r), {'rank': r, "
    "'phase': 'training', 'round': 0, 'step': 0, 'updated_at': time.time(), 'host': 'sb'}); "
    "print(f'replica {r} waiting', flush=True); time.sleep(600)"
)


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_with_a_rejected_token_changes_nothing_and_says_so(
    s3_env: MotoS3, modal_env: FakeModal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status, cancel, logs and rm of a running run with a token Modal rejects: one line
    naming the token, exit 2; the replicas keep running and the run folder stays whole. The
    refusal was taken for failed replicas: status showed them failed, cancel stopped none
    and rm deleted the running run."""
    store = f"s3://{s3_env.new_bucket()}/runs"
    code, out = crf_cli(
        "launch", "--backend", "modal", "-n", "2", "--job", "lm", "--store", store,
        "--run-id", "tok", "--entrypoint", f"python -c {shlex.quote(BEATING_SLEEPER)}",
        "--detach",
    )  # fmt: skip
    assert code == 0, out
    ids = [sid for sid, sb in modal_env.sandboxes.items() if sb.tags.get("crf-run") == "tok"]
    for sid in ids:
        wait_output(modal_env.sandboxes[sid], "waiting")
    bucket, prefix = store.removeprefix("s3://").split("/", 1)
    keys = sorted(o["Key"] for o in s3_env.client().list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/tok/")["Contents"])  # fmt: skip

    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-expired-secret")
    for command in (("status",), ("cancel",), ("logs",), ("rm", "-y")):
        code, out = crf_cli(command[0], "tok", *command[1:], "--store", store)
        assert code == 2, out
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) == 1 and "Modal rejected the credentials" in lines[0], out
        assert "as-expired-secret" not in out and "Traceback" not in out
    assert all(not modal_env.sandboxes[sid].done for sid in ids)
    after = sorted(o["Key"] for o in s3_env.client().list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/tok/")["Contents"])  # fmt: skip
    assert after == keys

    monkeypatch.setenv("MODAL_TOKEN_SECRET", TOKEN_SECRET)
    code, out = crf_cli("cancel", "tok", "--store", store)
    assert code == 0 and "cancelled 2" in out, out


# --------------------------------------------------------------------------- real Modal
REAL = pytest.mark.skipif(
    not (os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"))
    or bool(os.environ.get("MODAL_SERVER_URL")),
    reason="real Modal tests need MODAL_TOKEN_ID/MODAL_TOKEN_SECRET (and no MODAL_SERVER_URL)",
)


@REAL
def test_real_modal_token_is_accepted() -> None:
    ex = ModalExecutor()
    try:
        ex.check_backend()  # one ClientHello: costs nothing
    finally:
        ex.close()


@REAL
@pytest.mark.skipif(
    not os.environ.get("CRF_TEST_S3_STORE"),
    reason="a real Modal launch also needs CRF_TEST_S3_STORE=s3://bucket/prefix with AWS creds",
)
def test_real_modal_sandbox_runs_logs_and_cancels() -> None:
    """About a minute of a CPU sandbox (well under $0.01)."""
    run_uri = os.environ["CRF_TEST_S3_STORE"].rstrip("/") + f"/crf-modal-test-{int(time.time())}"
    ex = ModalExecutor(timeout_s=900)
    try:
        ex.check_ready(run_uri)
        (h,) = ex.launch_replicas(
            1, py("import time\nprint('hello from modal', flush=True)\ntime.sleep(600)"),
            run_uri=run_uri,
        )  # fmt: skip
        wait_for_line(ex, h, "hello from modal")
        assert [f.backend_id for f in ex.find_replicas(h.run_id, run_uri, 1)] == [h.backend_id]
        ex.cancel(h)
        assert wait_terminal(ex, h, timeout=120).state is ReplicaState.CANCELLED
    finally:
        ex.close()


def test_workdir_entrypoint_runs_in_a_modal_sandbox(
    s3_env: MotoS3, modal_env: FakeModal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--workdir DIR --entrypoint "python train.py" --pip PKG --secret KEY` on a cloud
    backend, no image built: the driver puts the packed folder in the S3 run folder, the real
    bootstrap in the sandbox unpacks it, runs train.py there (its helper module importable,
    the secret in its environment) and was told to install the --pip package; the secret's
    value is in no object of the run folder and in no plain environment of the sandbox."""
    import hashlib

    from crf.launcher import driver
    from tests.test_workdir import make_workdir

    value = "s3cr3t-" + "workdir-run-0123456789"
    monkeypatch.setenv("MY_SECRET", value)
    bucket = s3_env.new_bucket()
    root = make_workdir(tmp_path / "code")
    ex = ModalExecutor(timeout_s=120)
    try:
        summary = driver.launch(
            {
                "backend": "modal", "replicas": 1, "rounds": 1, "run_id": "wd-modal",
                "workdir": str(root), "entrypoint": "python train.py", "pip": ["packaging"],
                "secrets": ["MY_SECRET"],
            },
            store=f"s3://{bucket}/runs", executor=ex, progress=False, report=False, plot=False,
        )  # fmt: skip
        assert summary["status"] == "ok", summary
        seen = read_json(s3_env, bucket, "runs/wd-modal/results/0.json")
        assert seen["helper"] == 42 and seen["cwd"] != str(root)
        assert "crf-workdir-" in seen["cwd"]
        assert "train.py" in seen["files"] and "data" not in seen["files"]
        assert not (root / "written-by-replica.txt").exists()
        assert seen["secret_sha256"] == hashlib.sha256(value.encode()).hexdigest()
        client = s3_env.client()
        for obj in client.list_objects_v2(Bucket=bucket, Prefix="runs/wd-modal/")["Contents"]:
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            assert value.encode() not in body, obj["Key"]
        ((sid, sb),) = [
            (i, s) for i, s in modal_env.sandboxes.items() if s.tags["crf-run"] == "wd-modal"
        ]
        (plain,) = [s["env"] for s in sb.secret_sources if "CRF_RANK" in s.get("env", {})]
        assert plain["CRF_WORKDIR_KEY"].startswith("code/workdir-")
        assert plain["CRF_REQUIREMENTS"].split()[-1] == "packaging"
        assert value not in json.dumps(plain) and "MY_SECRET" in plain["CRF_SECRET_NAMES"]
        handle = ReplicaHandle("modal", "wd-modal", 0, sid, plain["CRF_RUN_URI"], 1)
        lines = list(ex.logs(handle))
        assert any(line.startswith("crf bootstrap: workdir code/workdir-") for line in lines)
        assert not modal_env.unimplemented
    finally:
        ex.close()
