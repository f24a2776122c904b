"""Read-only commands answer without importing torch: `crf runs`,
`crf status`, `crf logs`, `crf --help` and `crf version` on a finished run import neither
torch nor transformers/trl - the tensor codec and the jobs load on first use only. Asserted on
what is imported, not on a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_cli_attach import _launch, _wait_ended, script  # noqa: F401 (fixture)

_PROBE = """
import json, sys
from typer.testing import CliRunner
from crf.launcher.cli import app
base, run_id = sys.argv[1], sys.argv[2]
out = {}
for args in (["runs", "--store", base], ["status", run_id, "--store", base],
             ["logs", run_id, "--store", base], ["--help"], ["version"]):
    r = CliRunner().invoke(app, args)
    heavy = sorted(m for m in ("torch", "transformers", "trl", "torchft") if m in sys.modules)
    out[" ".join(args[:1])] = [r.exit_code, heavy, r.output[-300:]]
print(json.dumps(out))
"""


def test_read_only_commands_do_not_import_torch(tmp_path: Path, script: Path) -> None:  # noqa: F811
    base = tmp_path / "runs"
    code, out = _launch(base, script, "light", "--detach")
    assert code == 0, out
    _wait_ended(base, "light", 2)
    p = subprocess.run([sys.executable, "-c", _PROBE, str(base), "light"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    seen = json.loads(p.stdout.splitlines()[-1])
    for command, (exit_code, heavy, output) in seen.items():
        assert exit_code == 0, (command, output)
        assert heavy == [], f"crf {command} imported {heavy}"


def test_version_flag_and_command() -> None:
    from typer.testing import CliRunner

    from crf import __version__
    from crf.launcher.cli import app

    for args in (["--version"], ["version"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0 and r.output.strip() == f"crf {__version__}"
