"""A secret passed with ``env=`` never shows in ``crf logs``, from any process.

The launching driver knows the caller's ``env`` values and redacts them from what it prints;
a later ``crf logs`` in a fresh process does not know them (and a SageMaker run's secret is
deleted when the run ends). So the replica must hide them itself, before the platform stores
its output. Each cloud backend runs here through its loopback emulator (and the local backend,
whose log file is the platform's store): the SDK launches one
replica that prints the secret on stdout and stderr, then ``crf logs`` runs as its own process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.test_cli import REPLICA_SCRIPT

SECRET = "sk-caller-passed-this-0123456789"
FILE_SECRET = "wandb-key-read-from-a-file-98765"
PLAIN = "plain-project-name-visible"

# prints both secrets (to be redacted) and records what it saw as hashes (never the values)
PRINTS_SECRET = (
    "import hashlib, os, sys\n"
    "from crf.store import RunStore\n"
    "print('key on stdout: ' + os.environ['MY_API_KEY'], flush=True)\n"
    "print('key on stderr: ' + os.environ['MY_API_KEY'], file=sys.stderr, flush=True)\n"
    "print('file key: ' + os.environ['FILE_KEY'], flush=True)\n"
    "seen = {k: hashlib.sha256(os.environ.get(k, '').encode()).hexdigest()\n"
    "        for k in ('MY_API_KEY', 'FILE_KEY')}\n"
    "seen['PROJECT'] = os.environ.get('PROJECT')\n"
    "RunStore(os.environ['CRF_RUN_URI']).put_json('seen.json', seen)\n"
) + REPLICA_SCRIPT


def _hf(request: pytest.FixtureRequest) -> tuple[Any, str]:
    pytest.importorskip("huggingface_hub", reason="needs the hf extra")
    from tests import test_executor_hf_jobs as hf

    emu = request.getfixturevalue("hf_emu")
    request.getfixturevalue("hf_env")
    s3 = request.getfixturevalue("s3_env")
    return hf.make(emu), f"s3://{s3.new_bucket()}/runs"


def _sagemaker(request: pytest.FixtureRequest) -> tuple[Any, str]:
    pytest.importorskip("boto3", reason="needs the sagemaker extra")
    from tests import test_executor_sagemaker as sm

    aws = request.getfixturevalue("aws")
    return sm.executor(), f"s3://{aws.bucket}/runs"


def _modal(request: pytest.FixtureRequest) -> tuple[Any, str]:
    pytest.importorskip("modal", reason="needs the modal client")
    pytest.importorskip("grpclib", reason="the fake Modal servicer needs grpclib")
    from crf.executors.modal import ModalExecutor

    request.getfixturevalue("modal_env")
    s3 = request.getfixturevalue("s3_env")
    ex = ModalExecutor(timeout_s=120)
    request.addfinalizer(ex.close)
    return ex, f"s3://{s3.new_bucket()}/runs"


def _local(request: pytest.FixtureRequest) -> tuple[Any, str]:
    from crf.executors.local import LocalProcessExecutor

    tmp = request.getfixturevalue("tmp_path")
    return LocalProcessExecutor(), str(tmp / "runs")


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], tuple[Any, str]]] = {
    "hf": _hf,
    "local": _local,
    "sagemaker": _sagemaker,
    "modal": _modal,
}

# the emulators' fixtures, visible to this module (each module's own are used only when needed)
try:
    from tests.cloud_servers import moto_s3, s3_env  # noqa: F401
    from tests.test_executor_hf_jobs import emu as hf_emu  # noqa: F401
    from tests.test_executor_hf_jobs import hf_env  # noqa: F401
    from tests.test_executor_modal import fake, modal_env  # noqa: F401
    from tests.test_executor_sagemaker import aws  # noqa: F401
except pytest.skip.Exception:  # an extra is missing: the backend's case skips above
    pass


def _run_files(run_uri: str) -> dict[str, bytes]:
    """Every file of a run folder, on any store (run.json, backend.json, handles, launch
    records, results, local log files, the code tarball...)."""
    from crf.store import RunStore

    store = RunStore(run_uri)
    return {path: store.fs.cat_file(path) for path in store.fs.find(store.path(""))}


def _described(backend: str, request: pytest.FixtureRequest, handles: list[Any]) -> str:
    """What the platform shows anyone who may describe the replicas (a cloud backend's
    describe call), or what the local backend was given in plain view (nothing)."""
    if backend == "hf":
        from huggingface_hub import HfApi

        from tests.test_executor_hf_jobs import TOKEN, USER

        emu = request.getfixturevalue("hf_emu")
        api = HfApi(endpoint=emu.endpoint, token=TOKEN)
        jobs = [api.inspect_job(job_id=h.backend_id, namespace=USER) for h in handles]
        sent = [{k: v for k, v in emu.jobs[h.backend_id].spec.items() if k != "secrets"}
                for h in handles]  # fmt: skip
        return json.dumps([[j.environment, j.secrets, j.command] for j in jobs] + sent)
    if backend == "sagemaker":
        aws = request.getfixturevalue("aws")
        descs = [aws.sagemaker().describe_training_job(TrainingJobName=h.backend_id)
                 for h in handles]  # fmt: skip
        return json.dumps(descs, default=str)
    if backend == "modal":
        fake = request.getfixturevalue("modal_env")
        return " ".join(str(fake.sandboxes[h.backend_id].definition) for h in handles)
    return ""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_secret_a_replica_prints_is_hidden_from_crf_logs_in_a_fresh_process(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--secret MY_API_KEY --secret FILE_KEY=@file --env PROJECT=...`` through the SDK: the
    replica sees all three, and no file of the run folder, no log and no describe call holds
    a secret's value."""
    from crf import layout
    from crf.executors.base import ReplicaHandle
    from crf.launcher.driver import RestartPolicy, launch
    from crf.store import RunStore, join_uri, normalize_uri

    executor, store = BACKENDS[backend](request)
    script = tmp_path / "prints_secret.py"
    script.write_text(PRINTS_SECRET)
    monkeypatch.setenv("MY_API_KEY", SECRET)
    (tmp_path / "key").write_text(FILE_SECRET + "\n")
    run_id = f"leak-{backend}"
    summary = launch(
        {"job": "lm", "replicas": 1, "rounds": 1, "run_id": run_id,
         "entrypoint": f"python {script}", "env": {"PROJECT": PLAIN},
         "secrets": ["MY_API_KEY", f"FILE_KEY=@{tmp_path / 'key'}"]},
        store=store, executor=executor, restart=RestartPolicy(0),
        progress=False, report=False, plot=False, timeout_s=300,
    )  # fmt: skip
    assert summary["status"] == "ok", summary
    run = RunStore(join_uri(normalize_uri(store), run_id))
    seen = run.get_json("seen.json")  # the replica saw each value
    assert seen["MY_API_KEY"] == hashlib.sha256(SECRET.encode()).hexdigest()
    assert seen["FILE_KEY"] == hashlib.sha256(FILE_SECRET.encode()).hexdigest()
    assert seen["PROJECT"] == PLAIN
    files = _run_files(run.uri)
    assert any(p.endswith(layout.RUN_SPEC) for p in files)
    for path, data in files.items():
        assert SECRET.encode() not in data and FILE_SECRET.encode() not in data, path
    handles = [ReplicaHandle(**h) for h in run.get_json(layout.handles_key(0))["handles"]]
    shown = _described(backend, request, handles)
    assert SECRET not in shown and FILE_SECRET not in shown
    if backend in ("hf", "sagemaker"):
        assert PLAIN in shown  # --env is plain environment, shown like the contract
    logs = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "logs", f"leak-{backend}", "--store", store],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CRF_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    out = logs.stdout + logs.stderr
    assert logs.returncode == 0, out
    assert "key on stdout: ***" in out and "key on stderr: ***" in out, out  # it was printed
    assert "file key: ***" in out
    assert SECRET not in out and FILE_SECRET not in out


def test_the_redacting_wrapper_hides_secrets_keeps_streams_exit_codes_and_signals() -> None:
    """``python -m crf.executors.redacted`` on its own: what every container's command runs
    under. Lines on both streams come through with the secret replaced (also one split over
    two writes), the exit code is the command's, and a stop signal reaches the command."""
    env = {**os.environ, "CRF_SECRET_NAMES": "MY_API_KEY,SHORT", "MY_API_KEY": SECRET,
           "SHORT": "abc"}  # fmt: skip
    code = (
        "import os, sys, time\n"
        "k = os.environ['MY_API_KEY']\n"
        "print('out ' + k, flush=True)\n"
        "sys.stdout.write('split ' + k[:5]); sys.stdout.flush(); time.sleep(0.2)\n"
        "print(k[5:] + ' end', flush=True)\n"
        "print('err ' + k + ' abc', file=sys.stderr, flush=True)\n"
        "sys.exit(3)\n"
    )
    wrapper = [sys.executable, "-m", "crf.executors.redacted"]
    p = subprocess.run([*wrapper, sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 3, p.stderr
    assert p.stdout.splitlines() == ["out ***", "split *** end"]
    assert p.stderr.splitlines() == ["err *** abc"]  # too short to be redacted: "abc"
    sleeper = subprocess.Popen(
        [*wrapper, sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
         "time.sleep(60)"],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sleeper.stdout is not None
        command_pid = int(sleeper.stdout.readline())
        sleeper.terminate()
        assert sleeper.wait(timeout=30) == -15  # the command got SIGTERM and died of it ...
        assert not psutil.pid_exists(command_pid)  # ... and was reaped, not left behind
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
