"""Benchmark: what the checks before launch of the user's data, model and rewards cost.

Builds a tiny model folder and a 64-row dataset, then times ``prepare(..., dry_run=True)``
(what ``crf launch --dry-run`` runs) for the composer and sft jobs with a held-out split and
a reward, alternately with :func:`crf.launcher.data_checks.check_inputs` and with it
replaced by a no-op in one process (the difference is the checks' cost), then the checks'
own time inside a cold dry run in fresh processes (imports they pay included). Target for
both: < 1 s.
Then times the checks of a Hub dataset served by a loopback Hub (its first rows streamed;
target: < 5 s), and the refusal of a Hub dataset on a closed loopback port (target: <= 10 s).

Usage::

    python bench/data_checks.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _data(folder: Path) -> None:
    folder.mkdir(parents=True)
    words = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 8
    for split in ("train", "test"):
        rows = [{"question": f"{w}=", "answer": w[::-1]} for w in words]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _child(folder: str) -> None:
    """One cold dry run in this fresh process: the whole plan's time and the checks' own
    share of it (imports they pay first included), on stdout."""
    from crf.launcher import data_checks, plan

    spent: list[float] = []

    def timed(spec: object, local: bool, dry_run: bool = False) -> data_checks.Found:
        t = time.perf_counter()
        try:
            return data_checks.check_inputs(spec, local=local, dry_run=dry_run)
        finally:
            spent.append(time.perf_counter() - t)

    plan.check_inputs = timed
    options = {"job": "composer", "model": f"{folder}/model", "dataset": f"{folder}/data",
               "eval_split": "test", "columns": {"prompt": "question"},
               "reward": ["exact_match"], "replicas": 2}  # fmt: skip
    t = time.perf_counter()
    plan.prepare(options, store=f"{folder}/runs", dry_run=True)
    print(time.perf_counter() - t, spent[0])


def _cold(folder: Path, repeat: int) -> None:
    """Fresh processes: what a first dry run pays, and the checks' share of it. (Two totals
    compared would drown a few milliseconds in start-up noise on a busy machine.)"""
    totals, checks = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--child", str(folder)], env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
        total, own = map(float, out.stdout.strip().splitlines()[-1].split())
        totals.append(total)
        checks.append(own)
    print(f"cold      dry run: {statistics.median(totals):.3f} s, of which the checks "
          f"{statistics.median(checks):.3f} s (fresh processes; target < 1 s)")  # fmt: skip


def _hub(tmp: Path, repeat: int) -> None:
    """A dry run on a Hub dataset served by the loopback Hub (tests/emulators/hf_hub.py):
    its first rows streamed through the real datasets client, against the same dry run
    with the checks replaced by a no-op; the first run pays the module resolution cold."""
    from datasets import config as datasets_config
    from huggingface_hub import constants

    from crf.launcher import data_checks, plan
    from tests.emulators.hf_hub import HubEmulator

    repo = tmp / "hub-data"
    _data(repo / "data")
    with HubEmulator(tmp / "hub-repos") as emu:
        emu.add_repo("bench/data", repo, kind="dataset")
        os.environ.update(HF_ENDPOINT=emu.endpoint, HF_HOME=str(tmp / "hf-home"))
        constants.ENDPOINT = datasets_config.HF_ENDPOINT = emu.endpoint
        constants.HUGGINGFACE_CO_URL_TEMPLATE = (
            emu.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        constants.HF_HUB_OFFLINE = False
        options = {"job": "composer", "dataset": "bench/data", "replicas": 2,
                   "eval_split": "test", "columns": {"prompt": "question"},
                   "reward": ["exact_match"]}  # fmt: skip
        real = data_checks.check_inputs
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeat + 1):
            for on in (True, False):
                plan.check_inputs = (
                    real if on else (lambda spec, local, dry_run=False: data_checks.Found())
                )
                t = time.perf_counter()
                plan.prepare(options, store=str(tmp / "runs"), dry_run=True)
                times[on].append(time.perf_counter() - t)
        plan.check_inputs = real
    first = times[True][0] - times[False][0]
    warm = statistics.median(times[True][1:]) - statistics.median(times[False][1:])
    print(
        f"Hub dataset (loopback Hub) dry run: +{first:.3f} s for its checks the first time, "
        f"+{warm:.3f} s after (train and test splits' first rows; target < 5 s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return

    from crf.launcher import data_checks, plan
    from crf.launcher.errors import LaunchError
    from tests.hub_models import save_tiny_repo

    tmp = Path(tempfile.mkdtemp(prefix="crf-bench-checks-"))
    save_tiny_repo(tmp / "model")
    _data(tmp / "data")
    common = {"model": str(tmp / "model"), "dataset": str(tmp / "data"), "replicas": 2,
              "eval_split": "test", "columns": {"prompt": "question"},
              "reward": ["exact_match"]}  # fmt: skip
    runs = {
        "composer": {"job": "composer", **common},
        "sft": {"job": "sft", **common, "columns": {"prompt": "question",
                                                    "completion": "answer"}},
    }  # fmt: skip
    real = data_checks.check_inputs
    for name, options in runs.items():
        with_s, without_s = [], []
        plan.prepare(options, store=str(tmp / "runs"), dry_run=True)  # warm the imports
        for _ in range(args.repeat):
            for on, times in ((True, with_s), (False, without_s)):
                plan.check_inputs = (
                    real if on else (lambda spec, local, dry_run=False: data_checks.Found())
                )
                t = time.perf_counter()
                plan.prepare(options, store=str(tmp / "runs"), dry_run=True)
                times.append(time.perf_counter() - t)
        plan.check_inputs = real
        a, b = statistics.median(with_s), statistics.median(without_s)
        print(f"{name:9s} dry run: {a:.3f} s with the checks, {b:.3f} s without: "
              f"+{a - b:.3f} s (warm process; target < 1 s)")  # fmt: skip
    _cold(tmp, args.repeat)
    _hub(tmp, args.repeat)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from huggingface_hub import constants

    constants.ENDPOINT = f"http://127.0.0.1:{port}"
    os.environ.pop("HF_HUB_OFFLINE", None)
    constants.HF_HUB_OFFLINE = False
    t = time.perf_counter()
    try:
        # a launch's plan (a dry run lists the repo as missing instead); nothing starts
        plan.prepare({"job": "composer", "dataset": "openai/gsm8k", "replicas": 2},
                     store=str(tmp / "runs"))  # fmt: skip
        refused = "not refused"
    except LaunchError as e:
        refused = str(e)
    took = time.perf_counter() - t
    print(f"unreachable Hub dataset: refused in {took:.2f} s (target <= 10 s): {refused[:90]}")


if __name__ == "__main__":
    main()
