"""What a user gets from the repository itself: links that stay inside it, an sdist that
carries the tests, examples and docs, a build with no warnings, a license, a wheel whose own
declared requirements and package data run crf in a fresh virtualenv, and a Makefile that takes
torch's CPU build from PyTorch's own index where that answers and installs no test tooling for
the demo."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import threading
import tomllib
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_resolves_to_a_file_in_the_repository() -> None:
    broken = []
    for doc in _markdown_files():
        for target in _LINK.findall(doc.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path = (doc.parent / target).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_license_the_package_declares_is_in_the_repository() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def _copy_of_the_repository(dest: Path) -> Path:
    """The files a fresh clone has (no venv, no runs, no build output)."""
    junk = shutil.ignore_patterns(
        ".git", ".venv", "crf-runs", "build", "dist", "*.egg-info", "__pycache__",
        ".pytest_cache", ".ruff_cache",
    )  # fmt: skip
    shutil.copytree(ROOT, dest, ignore=junk)
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and, built from it, the wheel (``python -m build``, as a release would), from
    a copy of what a fresh clone has; shared by the module's tests: a build takes seconds."""
    tmp = tmp_path_factory.mktemp("dist")
    src = _copy_of_the_repository(tmp / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist")],
        cwd=src, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    (tmp / "dist" / "build.log").write_text(log)
    return tmp / "dist"


@pytest.mark.slow
def test_sdist_carries_tests_examples_and_docs_and_the_build_warns_nothing(dist: Path) -> None:
    log = (dist / "build.log").read_text()
    warnings = [line for line in log.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert warnings == []
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("LICENSE", "tests/conftest.py", "tests/emulators/hf_hub.py",
                   "examples/composer_custom.py", "docs/design.md", "Makefile"):  # fmt: skip
        assert needed in names
    assert not any("__pycache__" in n for n in names)
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = whl.read(meta_name).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in whl.namelist())
    assert "License-Expression: Apache-2.0" in meta
    for label in ("Homepage", "Documentation", "Source", "Issues"):
        assert f"Project-URL: {label}, " in meta


def _torch_index_args(index: str) -> str:
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(ROOT), "torch-index-args",
         f"TORCH_INDEX={index}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or not shutil.which("make"), reason="Linux make")
def test_make_takes_torch_from_the_cpu_index_when_it_answers_and_says_when_not(tmp_path):
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_port}/whl/cpu"
        assert _torch_index_args(index) == f"--index-url {index}"
        assert _torch_index_args(f"http://127.0.0.1:{server.server_port}/nothing") == ""
    finally:
        server.shutdown()
    assert _torch_index_args("") == ""  # TORCH_INDEX= : pip's configured index
    recipe = (ROOT / "Makefile").read_text()
    assert 'pip install -q $$index "$(TORCH)"' in recipe and "did not answer" in recipe


def test_readme_install_section_names_every_extra_and_the_projects_own_url() -> None:
    """The install commands use the distribution's name and pyproject's Source URL (one
    address, written twice), and the extras table lists exactly the declared extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    section = (ROOT / "README.md").read_text().split("## Install\n", 1)[1].split("\n## ", 1)[0]
    source, name = project["urls"]["Source"], project["name"]
    assert f"git clone {source} && cd {source.rsplit('/', 1)[1]}\n" in section
    assert f"pip install '{name}[s3] @ git+{source}'" in section
    assert all(url.startswith(source) for url in project["urls"].values())
    rows = re.findall(r"^\| (`.*?) \|", section, re.M)
    listed = {extra for row in rows for extra in re.findall(r"`([\w-]+)`", row)}
    assert listed == set(project["optional-dependencies"])


def _make_plan(target: str, venv: Path) -> list[str]:
    """The commands ``make TARGET`` would run on a fresh clone (``make -n``; nothing runs).
    Without the variables of a make this suite may run under (``make test-newest`` sets
    ``CONSTRAINTS=``, and make hands it on through ``MAKEFLAGS``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKEOVERRIDES", "MFLAGS")}
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}",
         "TORCH_INDEX="],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    return [line for line in out.stdout.splitlines() if "pip install" in line or "crf " in line]


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_demo_installs_the_runtime_only_and_make_test_the_dev_extra(tmp_path) -> None:
    demo = _make_plan("demo", tmp_path / "venv")
    installs = [line.split("pip install -q ")[-1] for line in demo if "pip install" in line]
    assert installs == ["--upgrade pip", '$index "torch==2.13.0"', "-e ."]
    assert demo[-1].endswith("bin/crf launch --backend local --replicas 4")
    test = _make_plan("test", tmp_path / "venv")
    # the dev extra, at the versions CI tests (constraints/ci.txt)
    assert any('pip install -q -c constraints/ci.txt -e ".[dev]"' in line for line in test)


# --- the wheel on its own -----------------------------------------------------------------
#
# A fresh virtualenv gets the wheel (pip, --no-deps) and, for its requirements, the files of
# exactly the distributions installed here that the wheel's own Requires-Dist pulls in (no
# extras), transitively, symlinked into the venv's site-packages. Nothing is downloaded, so it
# runs offline and in seconds, yet the venv has what `pip install composer-replication`
# resolves to here - no test tooling, no cloud SDK, no tracker, no source checkout - and a
# package crf imports without declaring it is missing there, as it would be for a user. What
# it does not check is that the package index serves those versions.


def _site_dirs() -> list[Path]:
    paths = (Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib"))
    return list(dict.fromkeys(paths))


def _runtime_closure(requires: list[str]) -> tuple[dict[str, metadata.Distribution], list[str]]:
    """The distributions installed here that ``requires`` (the wheel's Requires-Dist, no
    extras) reaches, by canonical name; and the direct requirements this environment does
    not satisfy."""
    here = {}
    for d in metadata.distributions(path=[str(p) for p in _site_dirs()]):
        here.setdefault(canonicalize_name(d.metadata["Name"]), d)
    unmet, closure = [], {}
    todo = [(Requirement(r), "", True) for r in requires]
    while todo:
        req, extra, direct = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        found = here.get(name)
        if found is None or not req.specifier.contains(found.version, prereleases=True):
            if direct:
                unmet.append(f"{req} (installed: {found.version if found else 'none'})")
            continue
        extras = sorted(req.extras) or [""]
        key = f"{name}[{','.join(extras)}]"
        if key in closure:
            continue
        closure[key] = found
        todo += [(Requirement(r), e, False) for r in found.requires or [] for e in extras]
    return {k.split("[")[0]: d for k, d in closure.items()}, unmet


def _mirror(dists: dict[str, metadata.Distribution], dest: Path) -> None:
    """Symlink into ``dest`` the files of ``dists`` (their RECORD) and nothing else: a folder
    that other distributions share (a namespace package such as ``google``) is made and filled
    entry by entry."""
    (site,) = _site_dirs()  # a venv on Linux or macOS: purelib is platlib
    keep = {f.parts for d in dists.values() for f in d.files or [] if f.parts[0] != ".."}
    other = {
        f.parts
        for d in metadata.distributions(path=[str(site)])
        if canonicalize_name(d.metadata["Name"]) not in dists
        for f in d.files or []
        if f.parts[0] != ".."
    }
    shared = {p[:n] for p in other for n in range(1, len(p) + 1)}
    heads, done = sorted({p[:n] for p in keep for n in range(1, len(p) + 1)}, key=len), set()
    for head in heads:
        if any(head[:n] in done for n in range(1, len(head))):
            continue
        target = dest.joinpath(*head)
        if head in shared and (site.joinpath(*head)).is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif site.joinpath(*head).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(site.joinpath(*head))
            done.add(head)


@pytest.fixture(scope="module")
def wheel_venv(dist: Path, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A virtualenv with only the wheel and its runtime closure, and the environment to run it
    in (no PYTHONPATH, no user site, offline Hugging Face)."""
    tmp = tmp_path_factory.mktemp("venv")
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist") or []
    closure, unmet = _runtime_closure(requires)
    assert unmet == [], "this environment does not satisfy the wheel's requirements"
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-index", "--no-compile", str(wheel)],
        check=True, timeout=120,
    )  # fmt: skip
    (site,) = (venv / "lib").glob("python3*/site-packages")
    _mirror(closure, site)  # where pip would have put them: under sys.prefix, as dill expects
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1", "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    return venv, env


_PROBE = """
import importlib.util as u, crf
from crf.executors import catalog
dev = "pytest moto gcp_storage_emulator modal s3fs gcsfs boto3 wandb trackio".split()
print(crf.__file__, ",".join(n for n in dev if u.find_spec(n) is None),
      ",".join(n for n in ("hf_jobs", "modal", "sagemaker") if catalog.load(n).as_of))
"""


def _run_in(venv_env: tuple[Path, dict[str, str]], cwd: Path, *argv: str, timeout: float = 60):
    """Run a command of the wheel's venv outside this checkout; its stdout (it must succeed)."""
    venv, env = venv_env
    out = subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


def _launched(cwd: Path, run_id: str, job: str, replicas: int) -> dict:
    result = json.loads((cwd / "runs" / run_id / "result.json").read_text())
    assert result["job"] == job
    assert [r["exit_code"] for r in result["replicas"]] == [0] * replicas
    return result


@pytest.mark.slow
@pytest.mark.e2e
def test_the_wheel_alone_runs_crf_in_a_fresh_venv(wheel_venv, tmp_path: Path) -> None:
    """`crf --version` and a one-round local `lm` run, from the installed wheel: its package
    data (the price catalogs) is in it, and no test, cloud or tracker package is needed."""
    where, missing, catalogs = _run_in(wheel_venv, tmp_path, "python", "-c", _PROBE).split()
    assert Path(where).is_relative_to(wheel_venv[0]), where  # the wheel, not this checkout
    assert missing == "pytest,moto,gcp_storage_emulator,modal,s3fs,gcsfs,boto3,wandb,trackio"
    assert catalogs == "hf_jobs,modal,sagemaker"
    assert _run_in(wheel_venv, tmp_path, "crf", "--version").strip() == "crf 0.1.0"
    _run_in(wheel_venv, tmp_path, "crf", "launch", "--backend", "local", "--replicas", "2",
            "--job", "lm", "--rounds", "1", "-H", "5", "--store", "runs", "--run-id", "lm",
            "--no-progress", timeout=240)  # fmt: skip
    assert _launched(tmp_path, "lm", "lm", 2)["final_loss"] > 0


@pytest.mark.slow
@pytest.mark.e2e
def test_the_demos_job_runs_from_the_wheel_without_the_dev_extra(wheel_venv, tmp_path) -> None:
    """What `make demo` runs (the default composer job: TRL GRPO on the embedded task), one
    short round, with only the wheel's run-time requirements."""
    _run_in(wheel_venv, tmp_path, "crf", "launch", "--backend", "local", "--replicas", "1",
            "--rounds", "1", "-H", "4", "--store", "runs", "--run-id", "demo", "--no-progress",
            timeout=300)  # fmt: skip
    assert "reward" in _launched(tmp_path, "demo", "composer", 1)["learning"]
