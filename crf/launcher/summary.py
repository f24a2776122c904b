"""The end of a run: the driver's summary (``result.json``), its table, and the loss plot.

The summary joins what the backend saw (exit codes) with what each replica reported
(``results/<rank>.json``), so one file answers "did it work, did the replicas agree, what did
it cost". ``weights_identical`` is the DiLoCo invariant made visible: after the last outer step
every replica must hold the same bits.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from crf.executors.base import ReplicaResult, ReplicaState
from crf.launcher.progress import fmt_loss

#: fields copied from results/<rank>.json into the summary rows
RESULT_FIELDS = (
    "rounds_committed",
    "rounds_missed",
    "final_loss",
    "weights_sha256",
    "bytes_up",
    "bytes_down",
    "sync_s",
    "compute_s",
    "steps",
    "wall_s",
    "job_metrics",
)


def replica_row(res: ReplicaResult, log_tail: Sequence[str] = ()) -> dict[str, Any]:
    data = res.result or {}
    row: dict[str, Any] = {
        "rank": res.rank,
        "state": str(res.state),
        "exit_code": res.exit_code,
        "ok": res.ok,
        "reported_status": data.get("status"),
        "error": res.error,
        "log_path": res.handle.log_path,
        "backend_id": res.handle.backend_id,
    }
    for key in RESULT_FIELDS:
        row[key] = data.get(key)
    if log_tail:
        row["log_tail"] = list(log_tail)
    return row


def _mean(values: Sequence[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    nums = [v for v in nums if math.isfinite(v)]
    return sum(nums) / len(nums) if nums else None


def build_summary(
    *,
    spec: Any,
    results: Sequence[ReplicaResult],
    started_at: float,
    ended_at: float | None = None,
    cancelled: bool = False,
    error: str | None = None,
    log_tails: dict[int, list[str]] | None = None,
) -> dict[str, Any]:
    """The dict written to ``result.json`` (and returned by ``crf.launch``).

    ``status`` is ``ok`` only if every replica exited cleanly and none reported a failure:
    an elastic run may finish with fewer replicas, but a replica that died is still a failure
    someone should look at.
    """
    ended_at = time.time() if ended_at is None else ended_at
    rows = [replica_row(r, (log_tails or {}).get(r.rank, ())) for r in results]
    hashes = [row["weights_sha256"] for row in rows]
    identical = bool(hashes) and None not in hashes and len(set(hashes)) == 1
    if cancelled:
        status = "cancelled"
    elif error is not None or not rows or not all(row["ok"] for row in rows):
        status = "failed"
    else:
        status = "ok"
    return {
        "run_id": spec.run_id,
        "run_uri": spec.run_uri,
        "backend": spec.backend,
        "job": spec.job,
        "status": status,
        "error": error,
        "world_size": spec.replicas,
        "rounds": spec.rounds,
        "sync_every": spec.sync_every,
        "weights_identical": identical,
        "weights_sha256": hashes[0] if identical else None,
        "final_loss": _mean([row["final_loss"] for row in rows if row["ok"]]),
        "bytes_up": sum(row["bytes_up"] or 0 for row in rows),
        "bytes_down": sum(row["bytes_down"] or 0 for row in rows),
        "started_at": started_at,
        "ended_at": ended_at,
        "wall_s": round(ended_at - started_at, 3),
        "replicas": rows,
        "loss_plot": None,
    }


# ---------------------------------------------------------------------- formatting
def fmt_bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover


def fmt_seconds(s: Any) -> str:
    if not isinstance(s, int | float):
        return "-"
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}min"


def _exit_text(row: dict[str, Any]) -> Text:
    state = row["state"]
    code = row["exit_code"]
    if row["ok"]:
        return Text(f"ok ({code})" if code is not None else "ok", style="green")
    if state == ReplicaState.CANCELLED:
        return Text("cancelled", style="yellow")
    if state == ReplicaState.SUCCEEDED:  # exited 0 but reported failure
        return Text(f"failed (reported, exit {code})", style="bold red")
    return Text(f"failed ({code})" if code is not None else "failed", style="bold red")


def render_summary(
    summary: dict[str, Any],
    console: Console,
    *,
    result_path: str | None = None,
    plot_path: str | None = None,
) -> None:
    """Print the per-replica table, the verdict, and where result.json / loss.png are."""
    rounds = summary.get("rounds")
    table = Table(title=f"crf run {summary['run_id']} - summary", title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("exit")
    table.add_column("rounds", justify="right")
    table.add_column("final loss", justify="right")
    table.add_column("sent", justify="right")
    table.add_column("received", justify="right")
    table.add_column("sync time", justify="right")
    for row in summary["replicas"]:
        committed = row.get("rounds_committed")
        table.add_row(
            str(row["rank"]),
            _exit_text(row),
            f"{committed}/{rounds}" if committed is not None else "-",
            fmt_loss(row.get("final_loss")),
            fmt_bytes(row.get("bytes_up")),
            fmt_bytes(row.get("bytes_down")),
            fmt_seconds(row.get("sync_s")),
        )
    console.print(table)

    for row in summary["replicas"]:
        if row["ok"] or row["state"] == ReplicaState.CANCELLED:
            continue  # a cancelled replica is in the table; its log tail says nothing new
        console.print(
            f"[bold red]replica {row['rank']}[/]: {escape(str(row.get('error') or 'failed'))}"
        )
        for line in row.get("log_tail", []):
            console.print(Text(f"    {line}", style="dim"), soft_wrap=True)
        if row.get("log_path"):
            console.print(f"    log: {row['log_path']}", soft_wrap=True, highlight=False)

    status = summary["status"]
    style = {"ok": "bold green", "failed": "bold red"}.get(status, "bold yellow")
    parts = [f"[{style}]{status}[/]", f"wall {fmt_seconds(summary.get('wall_s'))}"]
    if summary.get("final_loss") is not None:
        parts.append(f"final loss {fmt_loss(summary['final_loss'])}")
    if summary["weights_identical"]:
        parts.append("[green]weights identical across replicas[/]")
    else:
        hashes = [r.get("weights_sha256") for r in summary["replicas"]]
        if len({h for h in hashes if h}) > 1:
            parts.append("[bold red]replica weights differ[/]")
        elif any(hashes):
            parts.append("[yellow]not every replica reported its weights hash[/]")
    if summary.get("error"):
        parts.append(f"[red]{escape(summary['error'])}[/]")
    console.print("run " + " - ".join(parts))
    if result_path:
        console.print(f"result: {result_path}", soft_wrap=True, highlight=False)
    if plot_path:
        console.print(f"loss plot: {plot_path}", soft_wrap=True, highlight=False)


# ---------------------------------------------------------------------- metrics + plot
def read_metrics(store: Any, world_size: int) -> dict[int, list[dict[str, Any]]]:
    """``metrics/<rank>/<r>.json`` for every rank, sorted by round; unreadable files skipped."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        rows = []
        for name in store.list(f"metrics/{rank}"):
            stem = name.removesuffix(".json")
            if not name.endswith(".json") or not stem.isdigit():
                continue
            try:
                data = store.get_json(f"metrics/{rank}/{name}")
            except Exception:  # a half-GC'd or foreign file must not break the summary
                continue
            if isinstance(data, dict):
                data.setdefault("round", int(stem))
                rows.append(data)
        rows.sort(key=lambda d: d.get("round", 0))
        out[rank] = rows
    return out


def plot_losses(metrics: dict[int, list[dict[str, Any]]], *, title: str = "") -> bytes | None:
    """PNG of per-replica mean loss per round; None when no replica logged a loss.

    Filled markers are committed rounds, hollow ones rounds the replica computed but that did
    not make the quorum. Uses the Agg canvas directly (no pyplot) so it works headless and
    does not touch a global matplotlib backend someone else chose.
    """
    series = {
        rank: [(m["round"], m["loss"]) for m in rows if isinstance(m.get("loss"), int | float)]
        for rank, rows in metrics.items()
    }
    if not any(series.values()):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for rank, points in sorted(series.items()):
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        (line,) = ax.plot(xs, ys, marker="o", label=f"replica {rank}")
        missed = [
            (m["round"], m["loss"])
            for m in metrics[rank]
            if m.get("committed") is False and isinstance(m.get("loss"), int | float)
        ]
        if missed:
            mx, my = zip(*missed, strict=True)
            ax.plot(mx, my, "o", markerfacecolor="white", color=line.get_color())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("mean loss over the round")
    ax.set_title(title or "loss per replica")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
