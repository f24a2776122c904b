"""What a user gets from the repository itself (issue 16, item 7): links that stay inside it,
an sdist that carries the tests, examples and docs, a build with no warnings, a license, and
a Makefile that takes torch's CPU build from PyTorch's own index where that answers."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_sdist_carries_tests_examples_and_docs_and_the_build_warns_nothing(tmp_path) -> None:
    src = _copy_of_the_repository(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist")],
        cwd=src, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    warnings = [line for line in log.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert warnings == []
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("LICENSE", "tests/conftest.py", "tests/emulators/hf_hub.py",
                   "examples/composer_custom.py", "docs/design.md", "Makefile"):  # fmt: skip
        assert needed in names
    assert not any("__pycache__" in n for n in names)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = whl.read(meta_name).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in whl.namelist())
    assert "License-Expression: Apache-2.0" in meta


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
