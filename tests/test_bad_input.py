"""Bad input that used to get through or end in a traceback.

Each case fails before launch with one red line that names what to fix, exit code 2, and
leaves the store as it was; a store that breaks after launch ends in one line too. The CLI
runs in-process through typer's CliRunner (as tests/test_cli.py), or as a real subprocess
where a cloud client's state must not leak between tests (S3, GCS credentials).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest

from crf.executors.local import local_replica_limit
from crf.spec import MAX_REPLICAS, MAX_SEED, RunSpec
from crf.store import RunStore
from tests import cloud_servers
from tests.test_cli import REPLICA_SCRIPT, crf, testjob  # noqa: F401 - testjob: autouse fixture

gcs_emulator = cloud_servers.gcs_emulator  # the fixtures, visible to this module's tests
gcs_env = cloud_servers.gcs_env

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "my_train.py"
    path.write_text(REPLICA_SCRIPT)
    return path


def _launch_args(base: Path, script: Path) -> list[str]:
    # --timeout bounds a run that main would have launched (this file must fail, not hang).
    # Cases that main would launch with a huge N or round count (its driver then grew to
    # 22 GB and was OOM-killed) add --dry-run: the same checks, and nothing could start.
    return ["launch", "--job", "testjob", "--store", str(base), "--run-id", "t1",
            "--entrypoint", f"python {script}", "--no-progress", "--timeout", "60"]  # fmt: skip


def _one_error_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1, output  # one line, no traceback
    assert lines[0].startswith("error: "), output
    return lines[0]


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run-id", "abc\n"], "run id 'abc\\n' is invalid"),
        (["--run-id", "abc\r"], "run id 'abc\\r' is invalid"),
        (["-H", str(10**12)], "--sync-every must be an integer >= 1 and at most 2147483647"),
        (
            ["--dry-run", "--rounds", str(10**30)],
            "--rounds must be an integer >= 1 and at most 2147483647",
        ),
        (
            ["--dry-run", "-H", "100000", "-r", "100000"],
            "--rounds x --sync-every is 10000000000 inner steps",
        ),
        (["--seed", str(2**70)], f"--seed must be an integer between 0 and {MAX_SEED}"),
        (["--seed", "-1"], f"--seed must be an integer between 0 and {MAX_SEED}"),
        (["--timeout", "nan"], "--timeout must be > 0 seconds, a finite number"),
        (["--timeout", "inf"], "--timeout must be > 0 seconds, a finite number"),
        (["--outer-lr", "inf"], "--outer-lr must be > 0 and finite (got inf)"),
        (["--outer-lr", "nan"], "--outer-lr must be > 0 and finite (got nan)"),
        (["--outer-momentum", "nan"], "--outer-momentum must be in [0, 1) (got nan)"),
        (["--outer-momentum", "-inf"], "--outer-momentum must be in [0, 1) (got -inf)"),
        (["--round-timeout", "inf"], "--round-timeout must be > 0 seconds, a finite number"),
        (["--round-timeout", "nan"], "--round-timeout must be > 0 seconds, a finite number"),
        (["--round-timeout", "1e300"], "--round-timeout must be > 0 seconds, a finite number"),
        (
            ["--dry-run", "--replicas", "100000"],
            "--replicas 100000 is more than the local backend can run",
        ),
    ],
)
def test_bad_values_fail_before_launch(
    args: list[str], message: str, tmp_path: Path, script: Path
) -> None:
    base = tmp_path / "runs"
    result = crf(*_launch_args(base, script), *args)
    assert result.exit_code == 2, result.output
    assert message in _one_error_line(result.output)
    assert not base.exists()  # nothing written: no run folder, not even the store's


def test_local_replicas_are_capped_by_the_machine(tmp_path: Path, script: Path) -> None:
    """One more replica than this machine's memory holds is refused, naming the limit."""
    limit, why = local_replica_limit()
    assert limit >= 1 and "GiB of memory" in why
    base = tmp_path / "runs"
    n = limit + 1
    result = crf(*_launch_args(base, script), "--dry-run", "--replicas", str(n))
    assert result.exit_code == 2, result.output
    line = _one_error_line(result.output)
    if n <= MAX_REPLICAS:
        assert f"--replicas {n} is more than the local backend can run: at most {limit}" in line
    else:  # a machine with > 256 GiB: the limit for every backend comes first
        assert f"--replicas must be an integer >= 1 and at most {MAX_REPLICAS}" in line
    assert not base.exists()


def _outside_run(tmp_path: Path, script: Path) -> tuple[Path, Path]:
    """A store folder, and a real stopped run outside it (two levels up, then elsewhere)."""
    store = tmp_path / "a" / "b"
    store.mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "run"
    outside.mkdir(parents=True)
    spec = RunSpec(run_id="run", run_uri=f"file://{outside}", job="testjob",
                   entrypoint=[sys.executable, str(script)], sync_every=2, rounds=2)  # fmt: skip
    (outside / "run.json").write_text(spec.to_json())
    return store, outside


@pytest.mark.parametrize(
    "command",
    [
        ["launch", "--dry-run", "--resume", "../../elsewhere/run"],
        ["launch", "--resume", "../../elsewhere/run", "--timeout", "60"],
        ["status", "../../elsewhere/run"],
        ["logs", "../../elsewhere/run"],
        ["cancel", "../../elsewhere/run"],
        ["launch", "--dry-run", "--resume", "abc\n"],
        ["status", "abc\n"],
    ],
)
def test_run_ids_cannot_reach_outside_the_store(
    command: list[str], tmp_path: Path, script: Path
) -> None:
    store, outside = _outside_run(tmp_path, script)
    (store.parent / "abc\n").mkdir()  # a folder whose name ends in a newline, beside the store
    before, outside_before = _snapshot(store), _snapshot(outside)
    result = crf(*command, "--store", str(store))
    assert result.exit_code == 2, result.output
    line = _one_error_line(result.output)
    assert "is invalid: use letters, digits" in line
    assert _snapshot(store) == before and _snapshot(outside) == outside_before
    assert sorted(p.name for p in outside.iterdir()) == ["run.json"]


_GOOD_SPEC = {"run_id": "r1", "run_uri": "file:///tmp/x", "job": "testjob"}


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"run_id": "r1", "replicas": ', "not valid JSON (Expecting value at line 1"),
        (b'{"run_id": "r1\xff\xfe"}', "not UTF-8 text (bad byte at offset 14)"),
        (b"[1, 2]", "it holds a JSON list, not the run's options"),
        (json.dumps({**_GOOD_SPEC, "replicas": "two"}).encode(), "--replicas must be an integer"),
        (json.dumps({**_GOOD_SPEC, "rounds": 1.5}).encode(), "--rounds must be an integer"),
        (json.dumps({**_GOOD_SPEC, "job_config": [1]}).encode(), "job_config must be a mapping"),
        (json.dumps({**_GOOD_SPEC, "backend": None}).encode(), "backend must be a string"),
        (json.dumps({"job": "testjob"}).encode(), "missing 2 required positional arguments"),
    ],
    ids=[
        "bad-json",
        "bad-utf8",
        "a-list",
        "str-int",
        "float-int",
        "list-dict",
        "none-str",
        "missing",
    ],  # fmt: skip
)
def test_a_damaged_run_json_is_named(
    command: str, content: bytes, reason: str, tmp_path: Path
) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run.json").write_bytes(content)
    before = _snapshot(run)
    result = crf(command, "r1", "--store", str(tmp_path / "runs"))
    assert result.exit_code == 2, result.output
    line = _one_error_line(result.output)
    assert f"{run / 'run.json'} is damaged: " in line and reason in line, line
    assert _snapshot(run) == before


def test_a_large_seed_gives_every_replica_a_seed_numpy_takes() -> None:
    """--seed up to 2**32 - 1 is accepted, so each replica's data seed must fit numpy (which
    transformers' set_seed calls): it did not above --seed 4294."""
    from crf.replica.context import ReplicaContext

    store = RunStore("memory://crf-test-seed/run")
    for seed in (0, 4295, MAX_SEED):
        spec = RunSpec(run_id="s", run_uri=store.uri, replicas=3, seed=seed).validate()
        for rank in range(3):
            ctx = ReplicaContext(store, spec, rank, 3)
            np.random.seed(ctx.data_seed)  # raises ValueError outside [0, 2**32)
            if seed == 0:  # unchanged where it fitted before
                assert ctx.data_seed == rank + 1


# ----------------------------------------------------------------------------- cloud stores
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict[str, str], cwd: Path) -> tuple[int, str, float]:
    """The real `crf` in a fresh process (a cloud client's cached state cannot leak)."""
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_unreachable_s3_endpoint_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}",  # nothing listens there
        "AWS_ACCESS_KEY_ID": "crf-test",
        "AWS_SECRET_ACCESS_KEY": "crf-test",
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "AWS_MAX_ATTEMPTS": "1",
    }
    for args in (
        ["launch", "--job", "lm", "--store", "s3://crf-bucket/x"],
        ["status", "r1", "--store", "s3://crf-bucket/x"],
    ):
        code, out, _ = _cli(*args, env=env, cwd=tmp_path)
        assert code == 2, out
        assert "cannot reach the S3 endpoint" in _one_error_line(out)
    # a dry run lists it after the plan; --strict makes that exit 2
    code, out, _ = _cli("launch", "--dry-run", "--strict", "--job", "lm", "--store",
                        "s3://crf-bucket/x", env=env, cwd=tmp_path)  # fmt: skip
    assert code == 2 and "missing before this run can launch" in out, out
    assert "cannot reach the S3 endpoint" in out and "Traceback" not in out


class _RefusingTokenServer(BaseHTTPRequestHandler):
    """An OAuth token endpoint that refuses every refresh, as Google does for a revoked grant
    or a wrong key (HTTP 400 invalid_grant)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"error": "invalid_grant", "error_description": "Bad Request"})
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_gcs_wrong_credentials_is_one_line_at_once(tmp_path: Path) -> None:
    """gcsfs retries a failed credentials refresh six times (~35 s) before its 401: the store
    refreshes once when it opens, and says it in one line."""
    if importlib.util.find_spec("gcsfs") is None:  # not imported here: see gcs_env
        pytest.skip("needs the gcs extra")
    rsa = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
    from cryptography.hazmat.primitives import serialization

    server = HTTPServer(("127.0.0.1", 0), _RefusingTokenServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # a service-account key file whose key Google would not accept (made up here, and its
    # token endpoint is the refusing server above: google-auth honours token_uri for these)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    creds = tmp_path / "wrong-credentials.json"
    creds.write_text(json.dumps({
        "type": "service_account", "project_id": "crf-test", "private_key_id": "k1",
        "private_key": key.decode(), "client_email": "crf@crf-test.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": f"http://127.0.0.1:{server.server_port}/token",
    }))  # fmt: skip
    env = {
        "GOOGLE_APPLICATION_CREDENTIALS": str(creds),
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "STORAGE_EMULATOR_HOST": "",
        "CLOUDSDK_CONFIG": str(tmp_path / "no-gcloud"),
        "NO_GCE_CHECK": "True",  # google-auth: do not probe for a GCE metadata server
    }
    try:
        for args in (
            ["launch", "--job", "lm", "--store", "gs://crf-bucket/x"],
            ["status", "r1", "--store", "gs://crf-bucket/x"],
        ):
            code, out, took = _cli(*args, env=env, cwd=tmp_path)
            assert code == 2, out
            assert "not authenticated to gs://crf-bucket" in _one_error_line(out)
            # gcsfs's own retries of the refresh sleep >= 1 + 2 + 4 + 8 + 16 = 31 s
            assert took < 30, took
    finally:
        server.shutdown()


_DELETE_BUCKET = r"""
import os, sys
import gcsfs
bucket = os.environ["CRF_RUN_URI"].split("://", 1)[1].split("/", 1)[0]
fs = gcsfs.GCSFileSystem(token="anon", project="crf-test")
if os.environ["CRF_RANK"] == "0":
    fs.rm(f"{bucket}/", recursive=True)  # every object, then the bucket itself
    try:
        fs.rmdir(bucket)
    except FileNotFoundError:
        pass
print("bucket deleted", flush=True)
sys.exit(1)
"""


def test_gcs_bucket_deleted_mid_run_is_one_line(
    gcs_env: cloud_servers.GcsEmulator, tmp_path: Path
) -> None:
    """The run's bucket disappears while replicas run: the driver still shows its summary,
    and says in one line that result.json could not be written (exit 1: the run started)."""
    bucket = gcs_env.new_bucket()
    entry = tmp_path / "delete_bucket.py"
    entry.write_text(_DELETE_BUCKET)
    result = crf("launch", "--job", "testjob", "--store", f"gs://{bucket}/runs", "--run-id",
                 "gone", "--entrypoint", f"python {entry}", "-n", "1", "--max-restarts", "0",
                 "--no-progress", "--timeout", "120")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    said = " ".join(result.output.split())  # the summary's error, unwrapped from the terminal
    assert said.count("could not be written") == 1, result.output
    assert f"result.json could not be written to gs://{bucket}/runs/gone: GCS bucket" in said
    assert f"GCS bucket {bucket!r} not found" in said
