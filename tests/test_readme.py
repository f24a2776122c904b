"""Every ```python block in README.md runs as written (in a fresh folder, as a user would).

A block whose first line is ``# file: NAME.py`` is saved as NAME.py and run the way its
comment says (``crf launch ... --entrypoint "python NAME.py"``); a block whose first line is
``# not run: <reason>`` is skipped with that reason (cloud backends needing credentials).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        CRF_LOG_LEVEL="WARNING",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    code = BLOCKS[index]
    first = code.splitlines()[0]
    if first.startswith("# not run:"):
        pytest.skip(first.removeprefix("# not run:").strip())
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
        f"README block {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"
    )
