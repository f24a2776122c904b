"""Every ```bash block of README.md and of the user guide pages runs as written, and every
sample dry run they print is what ``crf launch --dry-run`` prints now.

A bash block runs in a fresh folder holding a copy of examples/, with ``crf`` calling this
checkout's CLI, no credentials of any kind, no network (``HF_HUB_OFFLINE``) and a 100-column
terminal; it must exit 0. A block whose first line is ``# not run: <reason>`` is skipped with
that reason (it needs credentials, a GPU, your own data, or another test runs it). A block
(of any language, or none) whose first line is ``$ crf launch ... --dry-run`` is a sample:
the command is run the same way and its output, run ids aside, must equal the rest of the
block.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the pages whose commands this test runs: README and the user guide pages it links
PAGES = [
    "README.md",
    "docs/running.md",
    "docs/config-file.md",
    "docs/backends.md",
    "docs/your-model.md",
    "docs/troubleshooting.md",
]
_RUN_ID = re.compile(r"run-\d{8}-\d{6}-[0-9a-f]{6}")


def _blocks(pattern: str) -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        found += [(page, i, body) for i, body in enumerate(re.findall(pattern, text, re.S))]
    return found


BASH = _blocks(r"```bash\n(.*?)```")
SAMPLES = [(p, i, b) for p, i, b in _blocks(r"```\w*\n(\$ crf .*?)```")]


def _env(home: Path) -> dict[str, str]:
    """No credentials, no network, a known terminal width: what a newcomer's shell has."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TMPDIR") if k in os.environ}
    return keep | {
        "HOME": str(home),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "100",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(home / "hf"),
        "CRF_LOG_LEVEL": "WARNING",
        "CRF_PYTHON": sys.executable,
        "AWS_CONFIG_FILE": str(home / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def run_commands(script: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with bash in ``folder`` (a copy of examples/ beside it), ``crf`` being
    this checkout's CLI."""
    if not (folder / "examples").exists():
        shutil.copytree(ROOT / "examples", folder / "examples")
    home = folder / "home"
    home.mkdir(exist_ok=True)
    preamble = 'set -eo pipefail\ncrf() { "$CRF_PYTHON" -m crf.launcher.cli "$@"; }\n'
    return subprocess.run(
        ["bash", "-c", preamble + script], cwd=folder, env=_env(home), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index", "block"), BASH, ids=[f"{p}:bash{i}" for p, i, _ in BASH])
def test_bash_block_runs(page: str, index: int, block: str, tmp_path: Path) -> None:
    first = block.splitlines()[0]
    if first.startswith("# not run:"):
        pytest.skip(first.removeprefix("# not run:").strip())
    proc = run_commands(block, tmp_path)
    assert proc.returncode == 0, f"{page} bash block {index}:\n{block}\n{proc.stdout}{proc.stderr}"


def sample_output(command: str, folder: Path) -> str:
    """What ``command`` (a ``$ crf ...`` line) prints, run ids replaced by the sample's."""
    proc = run_commands(command.removeprefix("$ "), folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return "".join(line.rstrip() + "\n" for line in (proc.stdout + proc.stderr).splitlines())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "index", "block"), SAMPLES, ids=[f"{p}:sample{i}" for p, i, _ in SAMPLES]
)
def test_sample_dry_run_is_what_the_cli_prints(
    page: str, index: int, block: str, tmp_path: Path
) -> None:
    command, shown = block.split("\n", 1)
    printed = sample_output(command, tmp_path)
    ids = _RUN_ID.findall(shown)
    if ids:
        printed = _RUN_ID.sub(ids[0], printed)
    assert printed == shown, f"{page}: the sample of `{command}` differs from what it prints"


def test_every_page_has_its_commands_checked() -> None:
    assert len(BASH) >= 6 and len(SAMPLES) >= 2
    assert all((ROOT / page).exists() for page in PAGES)
