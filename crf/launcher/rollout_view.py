"""How a run's rollout workers are shown: ``crf status``'s workers table, the summary's
workers section, and the figure's per-round series.

Two sources, each the authority on its side (docs/rollout-workers.md):

- a worker's own record, ``workers/<w>/state.json`` while it lives and
  ``workers/<w>/result.json`` at its end (:class:`crf.layout.WorkerState`): what it produced
  (rollouts, batches, batches returned as too stale) and the staleness at which it wrote them;
- each trainer's round metrics, ``RoundMetrics.rollouts``: what it actually trained on, by
  source (``workers``, ``local``, per worker ``w<k>``), the batches it ``refused`` and the
  staleness of what it used. The share of a trainer's batch its workers supplied comes from
  here, since a rollout a worker wrote is not one its trainer used until the trainer says so.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from crf import layout

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def trainer_rollouts(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One trainer's rollouts over its rounds (``RoundMetrics.rollouts`` of each): how many
    came from its workers and how many it generated, the workers' share, the batches it
    refused, the mean and maximum staleness of what it used, the seconds it spent waiting
    for its workers' batches, and per worker its rollouts."""
    workers = local = refused = waited = 0.0
    weighted = 0.0
    worst: float | None = None
    per_worker: dict[str, float] = {}
    for r in rounds:
        ro = r.get("rollouts") or {}
        if not isinstance(ro, Mapping) or not ro:
            continue
        used = _num(ro.get("workers"))
        workers += used
        local += _num(ro.get("local"))
        refused += _num(ro.get("refused"))
        waited += _num(ro.get("wait_s"))
        weighted += _num(ro.get("staleness_mean")) * used
        if ro.get("staleness_max") is not None:
            worst = max(worst or 0.0, _num(ro.get("staleness_max")))
        for key, value in ro.items():
            if key.startswith("w") and key[1:].isdigit():
                per_worker[key] = per_worker.get(key, 0.0) + _num(value)
    total = workers + local
    return {
        "worker_rollouts": int(workers),
        "local_rollouts": int(local),
        "share": round(workers / total, 4) if total else None,
        "refused": int(refused),
        "staleness_mean": round(weighted / workers, 3) if workers else None,
        "staleness_max": worst,
        "wait_s": round(waited, 1),
        "by_worker": {k: int(v) for k, v in sorted(per_worker.items())},
    }


def round_series(rounds: Sequence[Mapping[str, Any]]) -> dict[str, list[float | None]]:
    """One trainer's per-round workers' share and mean staleness (the figure's panel); empty
    lists when no round recorded rollouts (a run without workers)."""
    out: dict[str, list[float | None]] = {"round": [], "share": [], "staleness": []}
    for r in rounds:
        ro = r.get("rollouts") or {}
        if not isinstance(ro, Mapping) or not ro:
            continue
        used, local = _num(ro.get("workers")), _num(ro.get("local"))
        out["round"].append(_num(r.get("round")))
        out["share"].append(used / (used + local) if used + local else None)
        out["staleness"].append(_num(ro.get("staleness_mean")) if used else None)
    return out


def worker_row(
    worker: int, state: str, record: layout.WorkerState | None, restarts: int = 0,
    message: str = "",
) -> dict[str, Any]:  # fmt: skip
    """One worker as the summary and ``crf status --json`` show it. A worker that ended by
    itself (its own record: done, ok) while the driver cancelled the ones still running is
    ``succeeded``: the cancel only raced its exit, and the process state would say it was
    stopped short."""
    rec = record or layout.WorkerState(worker=worker)
    if state == "cancelled" and record is not None and (rec.phase, rec.status) == ("done", "ok"):
        state, message = "succeeded", ""
    return {
        "worker": worker,
        "serves": rec.serves if record is not None else None,
        "state": state,
        "message": message,
        "phase": rec.phase if record is not None else None,
        "status": rec.status,
        "version": rec.version,
        "rollouts": rec.rollouts,
        "batches": rec.batches,
        "returned": rec.returned,
        "staleness_mean": rec.staleness_mean,
        "generate_s": round(rec.generate_s, 1),
        "restarts": restarts,
        "error": rec.error,
        "reason": rec.reason,
        "heartbeat_age_s": round(time.time() - rec.updated_at, 1) if rec.updated_at else None,
    }


def workers_summary(
    rows: Sequence[Mapping[str, Any]], metrics: Mapping[int, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """The summary's ``workers`` section: each worker's row and each trainer's rollouts."""
    trainers = {str(rank): trainer_rollouts(rounds) for rank, rounds in sorted(metrics.items())}
    produced = sum(int(r.get("rollouts") or 0) for r in rows)
    used = sum(t["worker_rollouts"] for t in trainers.values())
    local = sum(t["local_rollouts"] for t in trainers.values())
    return {
        "count": len(rows),
        "rollouts_produced": produced,
        "rollouts_used": used,
        "share": round(used / (used + local), 4) if used + local else None,
        "workers": [dict(r) for r in rows],
        "trainers": trainers,
    }


def workers_table(
    rows: Sequence[Mapping[str, Any]], width: int = 80, title: str = "rollout workers"
) -> Table:
    """One row per worker: whom it serves, its state (its phase while it runs), the policy
    version it holds, what it produced, the staleness it wrote at, its restarts, the seconds
    it spent generating - fitted to ``width`` columns (the least important left out, no
    value cut)."""
    from crf.launcher.progress import Column, fit_table

    def cells(key: str) -> list[Any]:
        return [_fmt(r.get(key)) for r in rows]

    state = [  # its phase while it runs; its process's state before its first heartbeat
        str((r.get("state") in ("running", "pending") and r.get("phase")) or r.get("state"))
        for r in rows
    ]
    cols = [
        Column("worker", [f"w{r['worker']}" for r in rows], keep=100),
        Column("serves", cells("serves"), keep=95),
        Column("state", state, keep=90, justify="left"),
        Column("rollouts", cells("rollouts"), keep=88),
        Column("stale", cells("staleness_mean"), keep=86),
        Column("policy", cells("version"), keep=70),
        Column("batches", cells("batches"), keep=60),
        Column("returned", cells("returned"), keep=65),
        Column("restarts", cells("restarts"), keep=75),
        Column("gen time", [_seconds(r.get("generate_s")) for r in rows], keep=68),
    ]
    return fit_table(cols, width, title=title)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{_num(value):.1f}s"


def trainers_table(trainers: Mapping[str, Mapping[str, Any]], width: int = 80) -> Table:
    """One row per trainer: rollouts from its workers and its own, the workers' share of its
    batches, the batches it refused, the staleness of what it used, the seconds it spent
    waiting for its workers' batches."""
    from crf.launcher.progress import Column, fit_table

    rows = list(trainers.items())

    def cells(key: str) -> list[Any]:
        return [_fmt(t.get(key)) for _, t in rows]

    share = [("-" if t.get("share") is None else f"{t['share']:.0%}") for _, t in rows]
    cols = [
        Column("replica", [rank for rank, _ in rows], keep=100),
        Column("from workers", cells("worker_rollouts"), keep=95),
        Column("local", cells("local_rollouts"), keep=94),
        Column("share", share, keep=96),
        Column("refused", cells("refused"), keep=85),
        Column("stale mean", cells("staleness_mean"), keep=84),
        Column("stale max", cells("staleness_max"), keep=70),
        Column("waited", [_seconds(t.get("wait_s")) for _, t in rows], keep=60),
    ]
    return fit_table(cols, width, title="rollouts each replica trained on")


def failure_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per failed worker: why it failed, in its own words where it recorded them
    (its result's error), else the backend's (how its process ended); and one per worker
    that stopped by itself before its trainer had a result, saying why."""
    out = []
    for r in rows:
        if r.get("status") == "stopped" and r.get("state") != "failed":
            out.append(f"w{r.get('worker')} stopped by itself: {r.get('reason') or 'no reason'}")
        if r.get("state") != "failed":
            continue
        said = [str(x) for x in (r.get("error"), r.get("message")) if x]
        out.append(f"w{r.get('worker')} failed: {'; '.join(said) or 'no reason recorded'}")
    return out


def print_failures(rows: Sequence[Mapping[str, Any]], console: Console) -> None:
    for line in failure_lines(rows):
        console.print(line, highlight=False, markup=False)


def print_workers(summary: Mapping[str, Any], console: Console) -> None:
    """The summary's workers section (nothing for a run without workers)."""
    section = summary.get("workers")
    if not isinstance(section, Mapping) or not section.get("count"):
        return
    console.print(workers_table(section.get("workers") or (), console.width))
    print_failures(section.get("workers") or (), console)
    console.print(trainers_table(section.get("trainers") or {}, console.width))
    share = section.get("share")
    said = "-" if share is None else f"{share:.0%}"
    console.print(
        f"rollout workers: {section.get('rollouts_produced', 0)} rollout(s) produced, "
        f"{section.get('rollouts_used', 0)} trained on ({said} of the replicas' batches)",
        highlight=False,
    )
