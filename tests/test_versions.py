"""Replicas run the driver's versions: the bootstrap's requirement list pins
what the driver has installed, keeps the image's torch, and the summary warns when a replica
ran other torchft / trl / transformers. (A local run's results carry the versions:
tests/test_e2e_local.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from rich.console import Console

from crf.executors.bootstrap import BOOTSTRAP, base_requirements, pinned, requirements_for
from crf.launcher.summary import render_summary, version_warnings
from crf.versions import installed_versions, mismatches


def _name(requirement: str) -> str:
    return requirement.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()


@pytest.mark.parametrize(
    ("uri", "client"), [("s3://b/runs/x", "s3fs"), ("hf://buckets/a/b", "huggingface_hub")]
)
def test_the_requirements_of_a_store_scheme_pin_the_drivers_versions(uri: str, client: str) -> None:
    reqs = requirements_for(uri)
    by_name = {_name(r): r for r in reqs}
    assert set(by_name) >= {"torchft-nightly", "trl", "transformers", client}
    for name, req in by_name.items():
        if name == "torch":  # the image's own build is kept: the declared range, not a pin
            assert req in base_requirements() and "==" not in req
            continue
        assert req == f"{name}=={metadata.version(name).split('+')[0]}", req
    assert pinned("not-installed-anywhere>=1") == "not-installed-anywhere>=1"
    assert pinned("rich[jupyter]>=1") == f"rich[jupyter]=={metadata.version('rich')}"


def test_the_bootstrap_installs_only_what_differs_and_holds_the_images_torch(
    tmp_path: Path,
) -> None:
    """The container's program with a stand-in ``pip`` that records its arguments: a pinned
    requirement at the installed version is left alone, one at another version is installed,
    torch (importable) never is, and pip is held to the installed torch by a constraint."""
    fake = tmp_path / "fake" / "pip"
    fake.mkdir(parents=True)
    log = tmp_path / "pip-args.txt"
    fake.joinpath("__init__.py").write_text("")
    fake.joinpath("__main__.py").write_text(
        "import sys\n"
        f"args = sys.argv[1:]\nopen({str(log)!r}, 'w').write('\\n'.join(args))\n"
        "if '-c' in args: open(args[args.index('-c') + 1]).read() and open("
        f"{str(log)!r}, 'a').write('\\n' + open(args[args.index('-c') + 1]).read())\n"
        "sys.exit(7)\n"
    )
    same = pinned("rich>=1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path]),
           "CRF_REQUIREMENTS": f"torch==0.0.1 trl==0.0.1 {same}"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP, "true"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "crf bootstrap: installing trl==0.0.1" in proc.stdout
    args = log.read_text().splitlines()
    assert "trl==0.0.1" in args and same not in args and "torch==0.0.1" not in args
    torch_version = metadata.version("torch").split("+")[0]
    assert f"torch=={torch_version}" in args  # the constraint file's line


def test_the_bootstrap_replaces_a_torch_older_than_crfs_floor(tmp_path: Path) -> None:
    """An image whose torch is below the floor crf declares (here a floor above the installed
    one) gets a newer torch from pip, said in a line, and pip is not held to the old one."""
    fake = tmp_path / "fake" / "pip"
    fake.mkdir(parents=True)
    log = tmp_path / "pip-args.txt"
    fake.joinpath("__init__.py").write_text("")
    fake.joinpath("__main__.py").write_text(
        f"import sys\nopen({str(log)!r}, 'w').write('\\n'.join(sys.argv[1:]))\nsys.exit(7)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path]),
           "CRF_REQUIREMENTS": f"torch>=999.1 {pinned('rich>=1')}"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP, "true"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    torch_version = metadata.version("torch").split("+")[0]
    said = f"crf bootstrap: this image's torch {torch_version} is older than crf's torch>=999.1"
    assert said in proc.stdout
    args = log.read_text().splitlines()
    assert "torch>=999.1" in args and "-c" not in args
    assert pinned("rich>=1") not in args  # what is installed at its pin stays


def test_a_replica_on_other_versions_is_a_yellow_warning_in_the_summary() -> None:
    here = installed_versions()
    assert here["trl"] == metadata.version("trl") and here["torch"]
    other = {**here, "trl": "0.9.0", "torch": "0.0.1+cu999"}  # torch may differ: no warning
    rows = [
        {"rank": 0, "versions": dict(here)},
        {"rank": 1, "versions": other},
        {"rank": 2, "versions": None},  # a user's own entrypoint records none
    ]
    assert mismatches(other) == {"trl": ("0.9.0", here["trl"])}
    assert version_warnings(rows) == [f"replica 1 ran trl 0.9.0 (driver: {here['trl']})"]
    summary = {
        "run_id": "v", "status": "ok", "rounds": 1, "wall_s": 1.0, "weights_identical": True,
        "replicas": [{**row, "ok": True, "state": "succeeded", "exit_code": 0} for row in rows],
    }  # fmt: skip
    console = Console(record=True, width=200, force_terminal=True)
    render_summary(summary, console)
    text = console.export_text(styles=True)
    # in yellow, and only for replica 1
    assert f"\x1b[33mreplica 1 ran trl 0.9.0 (driver: {here['trl']})" in text
    assert "replica 0 ran" not in text and "replica 2 ran" not in text
