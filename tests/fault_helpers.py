"""Shared pieces of the fault tests (test_faults, test_chaos, test_resume_cli): a tiny lm run
through the real driver and real replica processes, and readers for what it left in the store.

The numbers the docs quote (docs/faults.md) are printed by these tests: run them with ``-s``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from crf.executors.local import LocalProcessExecutor
from crf.launcher import driver

#: the lm job at its smallest: startup dominates, a round takes ~0.1 s of compute on a CPU
TINY = {"hidden_size": 32, "num_layers": 1, "seq_len": 32, "batch_size": 8}
TINY_SETS = [arg for k, v in TINY.items() for arg in ("--set", f"{k}={v}")]
SHIM = str(Path(__file__).with_name("replica_shim.py"))


def launch_lm(
    base: Path,
    run_id: str,
    *,
    replicas: int,
    sync_every: int,
    rounds: int,
    round_timeout_s: float,
    env: dict[str, str] | None = None,
    shim: bool = False,
    max_restarts: int = 2,
    max_run_restarts: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """One run of the lm job through ``crf.launcher.driver.launch``; returns the summary.

    ``shim``: start replicas through tests/replica_shim.py (store faults, stragglers, bad
    objects); without it they are the plain ``python -m crf.replica``.
    """
    return driver.launch(
        {
            "job": "lm",
            "replicas": replicas,
            "sync_every": sync_every,
            "rounds": rounds,
            "run_id": run_id,
            "job_config": TINY,
            "entrypoint": [sys.executable, SHIM] if shim else None,
            "round_timeout_s": round_timeout_s,
            **options,
        },
        store=str(base),
        env={"CRF_LOG_LEVEL": "WARNING", **(env or {})},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=max_restarts, max_run_restarts=max_run_restarts),
        progress=False,
        report=False,
        plot=False,
        poll_s=0.1,
        timeout_s=240,
    )


def metrics(run: Path, rank: int) -> dict[int, dict[str, Any]]:
    """metrics/<rank>/<r>.json by round."""
    out = {}
    for path in (run / "metrics" / str(rank)).glob("*.json"):
        data = json.loads(path.read_text())
        out[int(data["round"])] = data
    return dict(sorted(out.items()))


def committed_rounds(run: Path, rank: int) -> list[int]:
    return [r for r, m in metrics(run, rank).items() if m.get("committed")]


def worst_wait(run: Path, ranks: range | list[int], rounds: set[int] | None = None) -> float:
    """The longest a replica spent in one committed round's exchange (waiting included)."""
    waits = [
        m["sync_s"]
        for rank in ranks
        for r, m in metrics(run, rank).items()
        if m.get("committed") and (rounds is None or r in rounds)
    ]
    return max(waits) if waits else 0.0


def baseline_wait(run: Path, ranks: range | list[int]) -> float:
    """Median time of a committed round's exchange: what a round costs without a fault."""
    waits = sorted(
        m["sync_s"] for rank in ranks for m in metrics(run, rank).values() if m.get("committed")
    )
    return waits[len(waits) // 2] if waits else 0.0


def fired_faults(run: Path) -> list[str]:
    """The CRF_FAULT specs that fired (each leaves a marker in faults/)."""
    folder = run / "faults"
    return sorted(p.read_text() for p in folder.iterdir()) if folder.exists() else []


def describe(summary: dict[str, Any]) -> str:
    """One line per replica: what the summary says happened to it."""
    lines = [
        f"status={summary['status']} restarts={summary['restarts']} "
        f"rounds_completed={summary['rounds_completed']} lost={summary['rounds_lost']} "
        f"objects_rejected={summary['objects_rejected']} max_sync_s={summary['max_sync_s']} "
        f"identical={summary['weights_identical']}"
    ]
    for row in summary["replicas"]:
        lines.append(
            f"  rank {row['rank']}: {row['state']} exit={row['exit_code']} "
            f"restarts={row['restarts']} missed={row['rounds_missed']} "
            f"rejected={row['objects_rejected']} max_sync_s={row['max_sync_s']} "
            f"resumed_from={row['resumed_from']} error={row['error']}"
        )
        for a in row.get("attempts") or []:  # earlier attempts: why each one ended
            lines.append(
                f"    attempt {a.get('attempt')}: {a.get('state')} exit={a.get('exit_code')} "
                f"phase={a.get('phase')} round={a.get('round')} error={a.get('error')} "
                f"message={a.get('message')}"
            )
    return "\n".join(lines)


def kill_fired(run: Path, rank: int, point: str) -> bool:
    """Whether the CRF_FAULT kill of ``rank`` at ``point`` fired (its marker is in faults/)."""
    return any(f"'rank': '{rank}'" in m and f"'point': '{point}'" in m for m in fired_faults(run))


def took_part(run: Path, rank: int, r: int) -> bool:
    """Whether ``rank`` committed round r as one of its participants (per its metrics)."""
    m = metrics(run, rank).get(r)
    return bool(m and m.get("committed") and rank in (m.get("participants") or []))


def unexplained_attempts(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A replica's ended attempts that were neither a SIGKILL (a planned fault) nor the
    documented way out of a heal that cannot finish (``HealError``: the replica exits and its
    restart resumes from the newest global state - on a loaded machine, when a round's only
    global writer died and the next one is slow to come, a replica can meet it)."""
    return [
        a
        for a in row.get("attempts") or []
        if a.get("exit_code") != -9 and "HealError" not in str(a.get("error"))
    ]
