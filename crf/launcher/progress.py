"""The live progress table: one row per replica, from the backend and the store heartbeats.

Two sources, on purpose: the backend knows whether the *process* is alive (and its exit code);
only the replica knows its training phase, round, step and loss, which it publishes in
``replicas/<rank>/state.json``. A replica whose process runs but whose heartbeat is old is
shown with its heartbeat age in yellow, which is how a hang looks from outside. Once the
driver has restarted a replica, a ``restarts`` column appears (kept out of a clean run's table,
where it would only be zeros).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from crf import jsonsafe
from crf.executors.base import ReplicaState, ReplicaStatus
from crf.layout import Heartbeat

STALE_AFTER_S = 60.0

_STATE_STYLE = {
    ReplicaState.PENDING: "dim",
    ReplicaState.RUNNING: "cyan",
    ReplicaState.SUCCEEDED: "green",
    ReplicaState.FAILED: "bold red",
    ReplicaState.CANCELLED: "yellow",
}
_PHASE_STYLE = {
    "starting": "dim",
    "training": "cyan",
    "syncing": "magenta",
    "healing": "yellow",
    "done": "green",
    "failed": "bold red",
}


@dataclass
class ReplicaView:
    """What the driver knows about one replica at one moment."""

    rank: int
    status: ReplicaStatus
    heartbeat: Heartbeat | None
    restarts: int = 0


def fmt_loss(value: Any) -> str:
    value = jsonsafe.number(value)  # as written to JSON, NaN is the string "NaN"
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4f}"


def process_text(status: ReplicaStatus) -> Text:
    label = str(status.state)
    if status.state is ReplicaState.FAILED:
        label = f"failed ({status.exit_code})" if status.exit_code is not None else "failed"
    return Text(label, style=_STATE_STYLE.get(status.state, ""))


def render_progress(
    views: Sequence[ReplicaView],
    *,
    run_id: str,
    rounds: int,
    sync_every: int,
    elapsed_s: float,
    now: float | None = None,
) -> Table:
    """Build the table for one refresh of the live display."""
    now = time.time() if now is None else now
    done = sum(v.status.terminal for v in views)
    table = Table(
        title=f"crf run {run_id} - {done}/{len(views)} replicas finished - {elapsed_s:.0f}s "
        f"(H={sync_every})",
        title_justify="left",
        expand=False,
    )
    table.add_column("rank", justify="right")
    table.add_column("process")
    table.add_column("phase")
    table.add_column("round", justify="right")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("heartbeat", justify="right")
    show_restarts = any(v.restarts for v in views)
    if show_restarts:
        table.add_column("restarts", justify="right")
    for v in views:
        hb = v.heartbeat
        phase = hb.phase if hb else "-"
        rnd = hb.round if hb else None
        step = hb.step if hb else None
        age = ""
        age_style = "dim"
        updated = hb.updated_at if hb else None
        if isinstance(updated, int | float) and updated > 0:
            secs = max(0.0, now - updated)
            age = f"{secs:.0f}s ago"
            if secs > STALE_AFTER_S and not v.status.terminal:
                age_style = "yellow"
        cells: list[Any] = [
            str(v.rank),
            process_text(v.status),
            Text(phase, style=_PHASE_STYLE.get(phase, "")),
            f"{rnd}/{rounds}" if rnd is not None else "-",
            f"{step}" if step is not None else "-",
            fmt_loss(hb.loss if hb else None),
            Text(age or "-", style=age_style),
        ]
        if show_restarts:
            cells.append(Text(str(v.restarts) if v.restarts else "-", style="yellow"))
        table.add_row(*cells)
    return table
