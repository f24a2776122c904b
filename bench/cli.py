"""Benchmark: how fast the read-only commands answer (target: <= 1 s, without torch).

Makes one small finished run (the contract-following replica script of tests/test_cli.py, no
training stack), then times each read-only command as a fresh process, best of ``--repeat``,
against the floor measured in the same run: a Python process that only imports typer and
rich (what any typer CLI pays) and one that imports torch (what crf paid before).

Usage::

    python bench/cli.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _best(cmd: list[str], repeat: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True, check=True, timeout=120)
        times.append(time.perf_counter() - start)
    return min(times)


def _finished_run(base: Path, env: dict[str, str]) -> str:
    from tests.test_cli import REPLICA_SCRIPT

    script = base / "replica.py"
    script.write_text(REPLICA_SCRIPT)
    cli = [sys.executable, "-m", "crf.launcher.cli"]
    subprocess.run([*cli, "launch", "--job", "lm", "-n", "2", "--rounds", "3", "--run-id",
                    "bench", "--store", str(base / "runs"), "--no-progress",
                    "--entrypoint", f"{sys.executable} {script}"],
                   env=env, capture_output=True, check=True, timeout=300)  # fmt: skip
    result = json.loads((base / "runs" / "bench" / "result.json").read_text())
    assert result["status"] == "ok", result
    return "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    with tempfile.TemporaryDirectory(prefix="crf-bench-cli-") as tmp:
        base = Path(tmp)
        run_id = _finished_run(base, env)
        store = str(base / "runs")
        py = [sys.executable, "-c"]
        floor = _best([*py, "import typer, rich.table"], args.repeat, env)
        torch_s = _best([*py, "import torch"], args.repeat, env)
        cli = [sys.executable, "-m", "crf.launcher.cli"]
        rows = [
            ("crf --version", [*cli, "--version"]),
            ("crf --help", [*cli, "--help"]),
            ("crf runs", [*cli, "runs", "--store", store]),
            ("crf runs --json", [*cli, "runs", "--store", store, "--json"]),
            ("crf status RUN", [*cli, "status", run_id, "--store", store]),
            ("crf status RUN --json", [*cli, "status", run_id, "--store", store, "--json"]),
            ("crf logs RUN", [*cli, "logs", run_id, "--store", store]),
        ]
        drawn = ("crf plot RUN", [*cli, "plot", run_id, "--store", store])
        print(f"floor (python + typer + rich): {floor:.2f} s; python + torch: {torch_s:.2f} s")
        print(f"{'command':<24} {'best s':>7} {'x floor':>8} {'target':>7}")
        for name, cmd in rows:
            t = _best(cmd, args.repeat, env)
            verdict = "ok" if t <= 1.0 else "SLOW"
            print(f"{name:<24} {t:>7.2f} {t / floor:>8.1f} {verdict:>7}")
        t = _best(drawn[1], args.repeat, env)  # draws with matplotlib: not a read-only answer
        print(f"{drawn[0]:<24} {t:>7.2f} {t / floor:>8.1f} {'(draws)':>7}")


if __name__ == "__main__":
    main()
