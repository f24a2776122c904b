"""Every ```python block in README.md and the user guide pages it links (docs/sdk.md,
docs/your-model.md, ...) runs as written (in a fresh folder, as a user would).

A block whose first line is ``# file: NAME.py`` is saved as NAME.py and run the way its
comment says (``crf launch ... --entrypoint "python NAME.py"``); a block whose first line is
``# not run: <reason>`` is skipped with that reason. A block whose first line is
``# emulated: <backend>`` is a cloud example: it runs against that backend's loopback emulator
(tests/emulators/, real official client) with moto's S3 as the store, ``CRF_STORE`` naming a
fresh bucket - the only thing that differs from a real run is where the endpoints point.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import cloud_servers

moto_s3 = cloud_servers.moto_s3

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/running.md", "docs/backends.md", "docs/your-model.md", "docs/sdk.md"]
PAGE_BLOCKS = [
    (page, code)
    for page in PAGES
    for code in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
]
BLOCKS = [code for _, code in PAGE_BLOCKS]

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        CRF_LOG_LEVEL="WARNING",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


@contextlib.contextmanager
def _emulated(backend: str, moto: cloud_servers.MotoS3, tmp: Path) -> Iterator[dict[str, str]]:
    """The environment a cloud README block runs in: its backend's emulator and moto S3."""
    env = {
        "CRF_STORE": f"s3://{moto.new_bucket()}/crf-runs",
        "AWS_ENDPOINT_URL": moto.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
        "HF_HOME": str(tmp / "hf-home"),
    }
    if backend == "modal":
        from tests.emulators.modal_servicer import FakeModal

        fake = FakeModal("ak-readme", "as-readme").start()
        try:
            yield env | {"MODAL_SERVER_URL": fake.url, "MODAL_TOKEN_ID": "ak-readme",
                         "MODAL_TOKEN_SECRET": "as-readme"}  # fmt: skip
        finally:
            fake.stop()
    elif backend == "hf":
        from tests.emulators.hf_jobs import HFJobsEmulator

        token = "hf_readme_token_0123456789"
        with HFJobsEmulator({token: "readme-user"}, {}) as emu:
            yield env | {"HF_TOKEN": token, "HF_ENDPOINT": emu.endpoint}
    elif backend == "sagemaker":
        from tests.emulators.sagemaker import SageMakerEmulator

        role_env = {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        role_env |= {"AWS_ENDPOINT_URL": moto.endpoint, "CRF_TORCH_THREADS": "1",
                     "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
        emu = SageMakerEmulator(role_env=role_env, accepted_keys={"testing"}, grace_s=3).start()
        try:
            role = "arn:aws:iam::123456789012:role/crf-readme"
            yield env | emu.client_env() | {"CRF_SAGEMAKER_ROLE_ARN": role}
        finally:
            emu.close()
    else:
        raise AssertionError(f"no emulator for backend {backend!r}")


@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"{p}:block{i}" for i, (p, _) in enumerate(PAGE_BLOCKS)]
)
def test_readme_block_runs(index: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    code = BLOCKS[index]
    first = code.splitlines()[0]
    if first.startswith("# not run:"):
        pytest.skip(first.removeprefix("# not run:").strip())
    if first.startswith("# emulated:"):
        backend = first.split(":", 1)[1].split()[0]
        (tmp_path / "block.py").write_text(code)
        with _emulated(backend, request.getfixturevalue("moto_s3"), tmp_path) as extra:
            proc = subprocess.run(
                [sys.executable, "block.py"], cwd=tmp_path, env=_env() | extra,
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        assert proc.returncode == 0, (
            f"{PAGE_BLOCKS[index][0]} block {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"
        )
        return
    if first.startswith("# file:"):
        name = first.split(":", 1)[1].split()[0]
        (tmp_path / name).write_text(code)
        m = re.search(r"run with: (crf launch .*)$", first)
        assert m, (
            f"block {index}: say how to run {name} ('# file: {name} — run with: crf launch ...')"
        )
        cmd = shlex.split(m.group(1)) + ["--no-progress", "--store", str(tmp_path / "runs")]
        cmd = [sys.executable, "-m", "crf.launcher.cli", *cmd[1:]]
    else:
        (tmp_path / "block.py").write_text(code)
        cmd = [sys.executable, "block.py"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (
        f"{PAGE_BLOCKS[index][0]} block {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"
    )
