"""Benchmark: what reading and checking every row of a local dataset costs a dry run.

Writes a 64-row and a 100,000-row dataset of the same shape (GSM8K-like question/solution
rows) as JSON lines, Parquet and CSV, then times ``prepare(..., dry_run=True)`` (what ``crf
launch --dry-run`` runs: every row is read and checked, crf/replica/data_files.py) on each in
fresh processes, imports included, and prints the large file's time beside the small one's
measured in the same run. Target: the 100,000-row dry run within 2 s, i.e. within about a
second of the small one's.

Usage::

    python bench/data_rows.py [--rows 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORDS = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"]


def _write(folder: Path, rows: int) -> dict[str, str]:
    import pandas as pd

    frame = pd.DataFrame(
        {
            "question": [f"What is {WORDS[i % 8]} reversed?" for i in range(rows)],
            "solution": [WORDS[i % 8][::-1] for i in range(rows)],
        }
    )
    paths = {kind: str(folder / f"d{rows}.{kind}") for kind in ("jsonl", "parquet", "csv")}
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in frame.to_dict("records"))
    frame.to_parquet(paths["parquet"])
    frame.to_csv(paths["csv"], index=False)
    return paths


def _child(dataset: str, store: str) -> None:
    """One cold dry run in this fresh process; its seconds on stdout."""
    from crf.launcher import plan

    options = {"job": "composer", "dataset": dataset, "replicas": 2, "reward": ["exact_match"],
               "columns": {"prompt": "question", "answer": "solution"}}  # fmt: skip
    t = time.perf_counter()
    plan.prepare(options, store=store, dry_run=True)
    print(time.perf_counter() - t)


def _cold(dataset: str, store: str, repeat: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--child", dataset, store], env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    tmp = Path(tempfile.mkdtemp(prefix="crf-bench-rows-"))
    small, large = _write(tmp, 64), _write(tmp, args.rows)
    store = str(tmp / "runs")
    for kind in small:
        a = _cold(small[kind], store, args.repeat)
        b = _cold(large[kind], store, args.repeat)
        print(f"{kind:8s} dry run: {args.rows} rows {b:.3f} s, 64 rows {a:.3f} s: "
              f"+{b - a:.3f} s, x{b / a:.2f} (fresh processes; target < 2 s)")  # fmt: skip


if __name__ == "__main__":
    main()
