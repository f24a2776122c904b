"""The live progress table: one row per replica, from the backend and the store heartbeats.

Two sources, on purpose: the backend knows whether the *process* is alive (and its exit code);
only the replica knows its training phase, round, step and loss, which it publishes in
``replicas/<rank>/state.json``. A replica whose process runs but whose heartbeat is old is
shown with its heartbeat age in yellow, which is how a hang looks from outside. Once the
driver has restarted a replica, a ``restarts`` column appears (kept out of a clean run's table,
where it would only be zeros).

The table fits the console it is drawn on: every column has a priority, and the least
important ones (heartbeat age, sync time, exact match, phase...) are left out until the table
fits, so no value is ever cut (cells wrap rather than end in "..."). "loss" and the headline
metric (the composer's reward) are the means over the replica's last finished round, as in the
summary table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from crf import jsonsafe, layout
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


@dataclass
class Column:
    """One column of a table that fits its width: header, cells, and how much it matters
    (higher ``keep`` stays longer when the table must shrink)."""

    header: str
    cells: list[RenderableType] = field(default_factory=list)
    keep: int = 0
    justify: str = "right"


def fit_table(
    columns: Sequence[Column], width: int, *, title: str | None = None, caption: str | None = None
) -> Table:
    """A table of ``columns`` no wider than ``width``: the least important columns are left
    out until rich measures it to fit. Cells fold (wrap) rather than end in an ellipsis, so a
    value is never cut even when the narrowest table left must wrap."""
    shown = list(columns)
    # measured on a console wide enough not to clamp the measurement to ``width``
    probe = Console(width=10_000, file=_Null(), color_system=None)
    while True:
        table = _build(shown, title=title, caption=caption)
        droppable = [c for c in shown if c.keep < 80]  # rank, process, round, loss, reward stay
        if probe.measure(table).maximum <= width or not droppable:
            return table
        shown.remove(min(droppable, key=lambda c: c.keep))


class _Null:
    """A file that forgets: the probe console only measures."""

    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _build(columns: Sequence[Column], *, title: str | None, caption: str | None) -> Table:
    table = Table(
        title=title,
        caption=caption,
        title_justify="left",
        caption_justify="left",
        expand=False,
        box=box.SIMPLE_HEAD,  # no vertical rules and one space of padding: room for values
        padding=(0, 1, 0, 0),
        show_edge=False,
    )
    for c in columns:
        table.add_column(c.header, justify=c.justify, overflow="fold")  # type: ignore[arg-type]
    rows = max((len(c.cells) for c in columns), default=0)
    for i in range(rows):
        table.add_row(*(c.cells[i] if i < len(c.cells) else "" for c in columns))
    return table


def _fmt_number(value: Any, decimals: int) -> str:
    value = jsonsafe.number(value)  # as written to JSON, NaN is the string "NaN"
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{decimals}f}"


def fmt_metric(value: Any) -> str:
    """A metric in [0, 1] or so (reward, exact match): three decimals, "-" when absent."""
    return _fmt_number(value, 3)


def fmt_secs(value: Any) -> str:
    """Short seconds for a table cell: "0.4s", "95s", "12m"."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    if value < 10:
        return f"{value:.1f}s"
    return f"{value:.0f}s" if value < 600 else f"{value / 60:.0f}m"


def fmt_loss(value: Any) -> str:
    """A loss: four decimals, "-" when absent, NaN/inf as they are."""
    return _fmt_number(value, 4)


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
    width: int = 80,
) -> Group:
    """Build the table for one refresh of the live display, fitted to ``width`` columns, with
    its title above it (the run, how many replicas are done, the time, the held-out score)."""
    now = time.time() if now is None else now
    done = sum(v.status.terminal for v in views)
    beats = [v.heartbeat for v in views]
    cols = [
        Column("rank", [str(v.rank) for v in views], keep=100),
        Column("process", [process_text(v.status) for v in views], keep=90, justify="left"),
        Column("phase", [_phase_text(v) for v in views], keep=40, justify="left"),
        Column("round", [_round_text(hb, rounds) for hb in beats], keep=95),
        Column("step", [str(hb.step) if hb else "-" for hb in beats], keep=60),
        Column("loss", [fmt_loss(hb.round_loss if hb else None) for hb in beats], keep=80),
    ]
    for name, header, keep in _HEADLINE:
        if any(hb and name in hb.round_metrics for hb in beats):
            values = [fmt_metric(hb.round_metrics.get(name) if hb else None) for hb in beats]
            cols.append(Column(header, values, keep=keep))
    cols.append(Column("sync", [fmt_secs(hb.round_sync_s if hb else None) for hb in beats], 30))
    cols.append(Column("beat", [_age_text(v, now) for v in views], keep=45))
    if any(v.restarts for v in views):
        restarts = [Text(str(v.restarts) if v.restarts else "-", style="yellow") for v in views]
        cols.append(Column("restarts", restarts, keep=70))
    title = f"crf run {run_id}: {done}/{len(views)} done, {elapsed_s:.0f}s, H={sync_every}"
    table = fit_table(
        cols,
        width,
        caption=("loss, reward" if any(c.header == "reward" for c in cols) else "loss")
        + ": means over the replica's last finished round",
    )
    # the title above the table, not in it: a table's title wraps at the table's width
    return Group(Text(title + held_out_headline(beats)), table)


#: the job metrics a table shows when the replicas log them: (name, header, priority)
_HEADLINE = (("reward", "reward", 85), ("exact_match", "exact", 35))


def held_out_headline(beats: Sequence[Heartbeat | None]) -> str:
    """``, held-out pass@1 0.406 (round 2, 48/64 rows)``: the newest round any replica closed,
    its replicas' shares of the held-out evaluation added up so far ("" before any)."""
    from crf.replica.evaluation import combine

    done = [hb for hb in beats if hb is not None and hb.last_round is not None]
    if not done:
        return ""
    r = max(hb.last_round for hb in done)
    p = combine({"metrics": hb.round_metrics} for hb in done if hb.last_round == r)
    if p is None or not p.n:
        return ""
    return f", held-out pass@1 {p.passed / p.n:.3f} (round {r}, {p.n}/{p.of} rows)"


def _phase_text(v: ReplicaView) -> Text:
    """The replica's phase; before its first heartbeat, ``starting`` while its process runs
    (it is importing, loading its model: what its first heartbeat will say too)."""
    if v.heartbeat is not None:
        phase = v.heartbeat.phase
    else:
        phase = "starting" if v.status.state is ReplicaState.RUNNING else "-"
    return Text(phase, style=_PHASE_STYLE.get(phase, ""))


def _round_text(hb: Heartbeat | None, rounds: int) -> str:
    return f"{hb.round}/{rounds}" if hb is not None else "-"


def _age_text(v: ReplicaView, now: float) -> Text:
    """Seconds since the replica's last heartbeat; yellow when it is stale and the process
    still runs (how a hang looks from outside)."""
    updated = v.heartbeat.updated_at if v.heartbeat else None
    if not isinstance(updated, int | float) or updated <= 0:
        return Text("-", style="dim")
    secs = max(0.0, now - updated)
    stale = secs > STALE_AFTER_S and not v.status.terminal
    return Text(fmt_secs(secs), style="yellow" if stale else "dim")


class PlainReporter:
    """The live display when the output is not a terminal (a file, a CI log): instead of a
    redrawn table, one line per replica per finished round and one per event (a replica
    ended, a round refused objects), printed as they happen so a log shows progress. New
    rounds are found by comparing each replica's heartbeat with the previous poll's; a
    heartbeat only holds the newest round, so rounds that closed between two polls (short
    rounds) are read from their records (``records(rank, r)``: the round's
    :class:`~crf.layout.RoundMetrics`, or None) and printed in order. ``first_round`` is the
    first round this launch closes (after a resume, the one after the round it continues
    from), so a resumed run does not print the earlier launches' rounds again; None (a
    watcher that attached to a running run) starts at the round it first sees. ``since``
    (the launch's start) leaves out the heartbeats written before it: the stopped launch's,
    still in the store until a resumed replica writes its first."""

    def __init__(
        self,
        console: Console,
        rounds: int,
        records: Callable[[int, int], layout.RoundMetrics | None] | None = None,
        first_round: int | None = 0,
        since: float | None = None,
    ) -> None:
        self.console = console
        self.rounds = rounds
        self.records = records
        self.first_round = first_round
        self.since = since
        self.last_round: dict[int, int | None] = {}
        self.ended: set[int] = set()
        self.phases: dict[int, set[str]] = {}  # the phases announced, per replica attempt
        self.restarts: dict[int, int] = {}
        # restarted replicas whose new process has not been seen starting: until it is, the
        # heartbeat may still be the attempt before's
        self.restarting: set[int] = set()

    def _news(self, hb: Heartbeat) -> bool:
        """Whether ``hb`` shows a round of this launch: written since it started, and not a
        round before its first (a resumed replica shows the round it continues from)."""
        if hb.last_round is None:
            return False
        if self.since is not None and hb.updated_at < self.since:
            return False
        return self.first_round is None or hb.last_round >= self.first_round

    def update(self, views: Sequence[ReplicaView]) -> None:
        for v in views:
            hb = v.heartbeat
            restarted = v.restarts != self.restarts.setdefault(v.rank, v.restarts)
            if restarted or (not v.status.terminal and v.rank in self.ended):
                self.restarts[v.rank] = v.restarts  # restarted: it starts (and ends) again
                self.ended.discard(v.rank)
                self.phases.pop(v.rank, None)
                self.restarting.add(v.rank)
            self._phase(v)
            if hb is not None and hb.last_round is not None and self._news(hb):
                shown = self.last_round.get(v.rank)
                if shown != hb.last_round:
                    self.last_round[v.rank] = hb.last_round
                    start = shown + 1 if shown is not None else self.first_round
                    start = hb.last_round if start is None else start
                    for r in range(start, hb.last_round):  # closed between two polls
                        missed = self._record(v.rank, r)
                        if missed is not None:
                            self._round(v.rank, missed)
                    self._round(v.rank, hb)
            if v.status.terminal and v.rank not in self.ended:
                self.ended.add(v.rank)
                self._say(f"replica {v.rank} ended: {process_text(v.status).plain}")

    def _phase(self, v: ReplicaView) -> None:
        """A line the first time a replica (attempt) is seen in a phase that is not part of
        every round (loading before its first step can take minutes: a log shows it)."""
        hb = v.heartbeat
        if hb is None or hb.phase not in _ANNOUNCED or v.status.terminal:
            return
        if self.since is not None and hb.updated_at < self.since:
            return  # the stopped launch's heartbeat
        if v.rank in self.restarting:
            if hb.phase != "starting":
                return  # the attempt before's, or the new one's seen after it started
            self.restarting.discard(v.rank)
        seen = self.phases.setdefault(v.rank, set())
        if hb.phase not in seen:
            seen.add(hb.phase)
            self._say(f"replica {v.rank} {_ANNOUNCED[hb.phase]}")

    def _record(self, rank: int, r: int) -> layout.Heartbeat | None:
        """Round ``r`` of ``rank`` as the heartbeat showed it when it closed (None: no
        record to read, or none yet)."""
        if self.records is None:
            return None
        from crf.replica.rounds import heartbeat_fields

        try:
            record = self.records(rank, r)
        except Exception:  # noqa: BLE001 - progress lines never stop a run
            return None
        if record is None:
            return None
        return layout.Heartbeat(rank=rank, step=record.step, **heartbeat_fields(record))

    def _round(self, rank: int, hb: layout.Heartbeat) -> None:
        self._say(round_line(rank, hb, self.rounds))
        if hb.round_rejected:
            self._say(
                f"replica {rank} round {hb.last_round}: rejected "
                f"{hb.round_rejected} object(s) (never averaged)"
            )

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


#: the phases a plain log announces, once per replica attempt, and what it says of them
_ANNOUNCED = {
    "starting": "starting: loading its model and data",
    "training": "training",
    "healing": "healing: loading the newest global state",
    "saving": "saving the trained model",
}


def round_records(store: Any) -> Callable[[int, int], layout.RoundMetrics | None]:
    """What :class:`PlainReporter` reads a missed round from: the run store's round record
    (``metrics/<rank>/<r>.json``), None while it is not there."""
    from crf.store import ObjectNotFound

    def read(rank: int, r: int) -> layout.RoundMetrics | None:
        try:
            return layout.RoundMetrics.from_dict(store.get_json(layout.metrics_key(rank, r)))
        except (ObjectNotFound, ValueError, TypeError):
            return None

    return read


def round_line(rank: int, hb: Heartbeat, rounds: int) -> str:
    """``replica 0 round 2 (3/3) step 12 loss 0.6931 reward 0.412 sync 0.3s``: one replica's
    finished round (numbered from 0, as in the run folder; then how many of the run's)."""
    r = hb.last_round if hb.last_round is not None else 0
    step = hb.round_step if hb.round_step is not None else hb.step  # older heartbeats: now's
    parts = [f"replica {rank} round {r} ({r + 1}/{rounds})", f"step {step}"]
    parts.append(f"loss {fmt_loss(hb.round_loss)}")
    for name, header, _ in _HEADLINE:
        if name in hb.round_metrics:
            parts.append(f"{header} {fmt_metric(hb.round_metrics[name])}")
    from crf.replica.evaluation import Partial

    mine = Partial.from_metrics(hb.round_metrics)
    if mine is not None and mine.n:  # this replica's share of the held-out rows
        parts.append(f"held-out {mine.passed}/{mine.n} passed")
    if hb.round_sync_s is not None:
        parts.append(f"sync {fmt_secs(hb.round_sync_s)}")
    return " ".join(parts)
