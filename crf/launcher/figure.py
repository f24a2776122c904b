"""The run's figure (``figure.png`` beside result.json): what shows whether the run learned.

A figure is a few panels, each drawn from the replicas' per-round records
(``metrics/<rank>/<r>.json``, :class:`crf.layout.RoundMetrics`). Which panels a run gets is
declared per job in :data:`JOB_PANELS`, since what "learning" looks like differs:

* **composer** (GRPO + hint distillation + trace replay): the mean reward and the held-out
  exact match per round, one line per replica - these rise when it learns -, the held-out
  pass@1 and reward means of each round's global model (one line each: the replicas' shares
  added up, crf/replica/evaluation.py; round -1 is the model before training), the loss channels
  (the total and each of GRPO, distillation and replay, averaged over replicas), and sync
  against compute time per round. The total loss alone misleads: GRPO's loss can rise while
  the reward climbs, which is why it is not the headline.
  With rollout workers (``--rollout-workers``) a panel more: each replica's share of
  rollouts that came from its workers, and their mean staleness, per round.
* **lm**: train loss (the round's mean over its inner steps) and eval loss (the round's global
  model on the shared held-out set), one line per replica.
* anything else (a custom ``--entrypoint``): the loss and every numeric metric the records
  carry, one panel each, plus sync against compute time.

Drawn on matplotlib's Agg canvas directly (no pyplot), so it works headless and does not touch
a global backend someone else chose. Filled markers are committed rounds, hollow ones rounds a
replica computed that did not make the quorum. Nothing here imports torch: ``crf plot``
redraws the figure from the store alone, for a finished or a running run on any backend.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crf import layout
from crf.store.errors import StoreError

Records = Mapping[int, Sequence[Mapping[str, Any]]]
#: the series of the held-out panels (crf/replica/evaluation.py): scores, and loss per token
HELD_OUT, HELD_OUT_LOSS = "held_out", "held_out_loss"
#: the rollout workers' panel (RoundMetrics.rollouts; crf/launcher/rollout_view.py)
ROLLOUTS = "rollouts"


@dataclass(frozen=True)
class Panel:
    """One axes: ``series`` are record fields (``loss``, ``sync_s``, ...) or job metrics
    (``metrics.<name>``); ``per_replica`` draws one line per replica of the one series,
    otherwise one line per series, averaged over replicas."""

    title: str
    ylabel: str
    series: tuple[str, ...]
    per_replica: bool = True
    labels: tuple[str, ...] = ()


#: the held-out evaluation: every replica's share added up per round (not one line per replica)
_HELD_OUT = Panel("held-out pass@1 and reward means (greedy; round -1: before training)",
                  "held-out score", (HELD_OUT,), per_replica=False)  # fmt: skip

#: the held-out loss per token (the sft job), every replica's share added up per round
_HELD_OUT_LOSS = Panel("held-out loss per round (round -1: before training)",
                       "loss per token", (HELD_OUT_LOSS,), per_replica=False)  # fmt: skip

#: with rollout workers: each replica's share of rollouts from its workers (solid) and the mean
#: staleness of those it used (dashed, right axis); absent from a run without workers
_ROLLOUTS = Panel("rollout workers: share of each replica's batch, staleness",
                  "share from workers", (ROLLOUTS,))  # fmt: skip

_TIME = Panel("sync vs compute time per round", "seconds (mean over replicas)",
              ("compute_s", "sync_s"), per_replica=False,
              labels=("compute (inner steps)", "sync (blocked on the exchange)"))  # fmt: skip

JOB_PANELS: dict[str, tuple[Panel, ...]] = {
    "composer": (
        Panel("mean reward per round", "reward", ("metrics.reward",)),
        Panel("held-out exact match per round", "exact match", ("metrics.exact_match",)),
        _HELD_OUT,
        _ROLLOUTS,
        Panel(
            "loss channels (mean over replicas)",
            "loss",
            ("loss", "metrics.grpo_loss", "metrics.distill_loss", "metrics.replay_loss"),
            per_replica=False,
            labels=("total", "GRPO", "distillation", "replay"),
        ),
        _TIME,
    ),  # fmt: skip
    "sft": (
        Panel("train loss per round", "mean train loss over the round", ("loss",)),
        _HELD_OUT_LOSS,
        _HELD_OUT,
        Panel(
            "token accuracy per round", "mean token accuracy", ("metrics.mean_token_accuracy",)
        ),  # fmt: skip
        _TIME,
    ),  # fmt: skip
    "lm": (
        Panel("train loss per round", "mean train loss over the round", ("loss",)),
        Panel("eval loss per round", "held-out loss of the round's model", ("metrics.eval_loss",)),
        _TIME,
    ),  # fmt: skip
}


def _value(record: Mapping[str, Any], field: str) -> float | None:
    if field.startswith("metrics."):
        value = (record.get("metrics") or {}).get(field.removeprefix("metrics."))
    else:
        value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None  # absent, or a non-finite value as JSON writes it ("NaN")
    return float(value)


#: record fields that count up over a replica's process (per round: the difference)
_CUMULATIVE = frozenset({"compute_s"})


def _points(records: Sequence[Mapping[str, Any]], field: str) -> list[tuple[int, float, bool]]:
    """(round, value, committed) of one replica's records that carry ``field``; a cumulative
    field as its growth since the replica's previous round (a restarted process counts from
    zero again: its first round is its value)."""
    out = []
    before: float | None = None
    for m in sorted(records, key=lambda m: m.get("round", 0)):
        value = _value(m, field)
        if value is None or not isinstance(m.get("round"), int):
            continue
        if field in _CUMULATIVE:
            value, before = (value - before if before is not None and value >= before
                             else value), value  # fmt: skip
        out.append((m["round"], value, m.get("committed") is not False))
    return out


def panels_for(job: str, metrics: Records) -> list[Panel]:
    """The panels of ``job``'s figure that its records have data for (a user's dataset has
    no held-out exact match, say); an unknown job gets one panel per numeric field."""
    declared = JOB_PANELS.get(job)
    if declared is None:
        names = sorted({k for rows in metrics.values() for m in rows
                        for k, v in (m.get("metrics") or {}).items()
                        if isinstance(v, int | float) and not isinstance(v, bool)})  # fmt: skip
        declared = (
            Panel("loss per round", "mean loss over the round", ("loss",)),
            *(Panel(f"{n} per round", n, (f"metrics.{n}",)) for n in names),
            _TIME,
        )
    return [
        p for p in declared
        if (_special_lines(p, metrics) if p.series[0] in (HELD_OUT, HELD_OUT_LOSS) else
            _has_rollouts(metrics) if p.series[0] == ROLLOUTS else
            any(_points(rows, field) for rows in metrics.values() for field in p.series))
    ]  # fmt: skip


def _has_rollouts(metrics: Records) -> bool:
    from crf.launcher.rollout_view import round_series

    return any(round_series(rows)["round"] for rows in metrics.values())


def _draw_rollouts(ax: Any, metrics: Records) -> None:
    """Each replica's share of rollouts from its workers per round (solid, left axis) and
    the mean staleness of those it used (dashed, right axis, in inner steps)."""
    from crf.launcher.rollout_view import round_series

    right = ax.twinx()
    worst = 1.0
    for rank, rows in sorted(metrics.items()):
        series = round_series(rows)
        if not series["round"]:
            continue
        (line,) = ax.plot(series["round"], series["share"], marker="o", markersize=4,
                          label=f"replica {rank}")  # fmt: skip
        right.plot(series["round"], series["staleness"], linestyle="--", marker="x",
                   color=line.get_color(), label=f"replica {rank} staleness")  # fmt: skip
        worst = max([worst, *(v for v in series["staleness"] if v is not None)])
    ax.set_ylim(-0.05, 1.05)
    # from 0: a scale fitted to the values alone puts a steady 0.9 steps at the panel's top,
    # where it reads as a share of 1
    right.set_ylim(-0.05 * worst, 1.05 * worst)
    right.set_ylabel("mean staleness (inner steps, dashed)")


def _held_out_lines(metrics: Records) -> dict[str, list[tuple[int, float]]]:
    """label -> (round, value) of the combined held-out evaluation: pass@1 and each reward's
    mean, the initial model at round -1."""
    from crf.replica.evaluation import AFTER, BEFORE, per_round

    lines: dict[str, list[tuple[int, float]]] = {}
    before = per_round(metrics, BEFORE)
    start = [(-1, before[min(before)])] if before else []
    for r, p in [*start, *per_round(metrics, AFTER).items()]:
        for key, value in p.means().items():
            if key not in ("examples", "of") and value is not None:
                label = key if key == "pass@1" else f"mean {key.removeprefix('reward/')}"
                lines.setdefault(label, []).append((r, value))
    return lines


def _held_out_loss_lines(metrics: Records) -> dict[str, list[tuple[int, float]]]:
    """The combined held-out loss per round, the initial model's at round -1."""
    from crf.replica.evaluation import AFTER, BEFORE, loss_per_round

    before = loss_per_round(metrics, BEFORE)
    points = [(-1, before[min(before)])] if before else []
    points += list(loss_per_round(metrics, AFTER).items())
    return {"held-out loss": points} if points else {}


def _special_lines(panel: Panel, metrics: Records) -> dict[str, list[tuple[int, float]]]:
    """The lines of a panel drawn from the replicas' shares added up (held-out panels)."""
    if panel.series == (HELD_OUT_LOSS,):
        return _held_out_loss_lines(metrics)
    return _held_out_lines(metrics)


def _draw(ax: Any, panel: Panel, metrics: Records) -> None:
    from matplotlib.ticker import MaxNLocator

    if panel.series[0] == ROLLOUTS:
        _draw_rollouts(ax, metrics)
    elif panel.series[0] in (HELD_OUT, HELD_OUT_LOSS):
        for label, points in _special_lines(panel, metrics).items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=4, label=label)
    elif panel.per_replica:
        for rank, rows in sorted(metrics.items()):
            label, points = f"replica {rank}", _points(rows, panel.series[0])
            if not points:
                continue
            xs, ys, ok = zip(*points, strict=True)
            (line,) = ax.plot(xs, ys, marker="o", markersize=4, label=label)
            missed = [(x, y) for x, y, c in zip(xs, ys, ok, strict=True) if not c]
            if missed:
                mx, my = zip(*missed, strict=True)
                ax.plot(mx, my, "o", markerfacecolor="white", color=line.get_color())
    else:
        labels = panel.labels or panel.series
        for field, label in zip(panel.series, labels, strict=True):
            per_round: dict[int, list[float]] = {}
            for rows in metrics.values():
                for r, v, _ in _points(rows, field):
                    per_round.setdefault(r, []).append(v)
            if per_round:
                xs = sorted(per_round)
                ax.plot(xs, [sum(per_round[x]) / len(per_round[x]) for x in xs],
                        marker="o", markersize=4, label=label)  # fmt: skip
    # rounds are whole numbers, even when only one was recorded (a run that failed in its
    # second round): not -0.045 ... 0.045
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_title(panel.title, fontsize="medium")
    ax.set_xlabel("round")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="x-small")


#: the formats ``crf plot -o FILE`` writes, named by FILE's suffix (matplotlib's Agg canvas
#: draws each; jpg goes through Pillow, which matplotlib needs anyway)
FIGURE_FORMATS = ("png", "jpg", "jpeg", "pdf", "svg")


def figure_format(path: str, flag: str = "--out") -> str:
    """The format ``path``'s suffix names (one of FIGURE_FORMATS); LaunchError in one line
    for a path that cannot take the figure, before anything is drawn or written: no or an
    unknown suffix (a PNG under fig.jpg would be a lie), a folder, a folder that is missing
    or is a file. What the write itself may still meet (no permission) is the caller's."""
    from pathlib import Path

    from crf.launcher.errors import LaunchError

    target = Path(path).expanduser()
    suffixes = ", ".join(f".{f}" for f in FIGURE_FORMATS)
    if target.is_dir():
        raise LaunchError(f"{flag} {path} is a folder: give a file name in it ({path}/figure.png)")
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        named = f"ends in .{fmt}" if fmt else "has no suffix"
        raise LaunchError(
            f"{flag} {path} {named}: name a {suffixes} file (the suffix is the format)"
        )
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise LaunchError(f"{flag} {path}: {parent} is a file, not a folder")
    if parent != target.parent:
        raise LaunchError(f"{flag} {path}: folder {target.parent} does not exist: create it first")
    return fmt


def draw_figure(metrics: Records, *, job: str, title: str = "", fmt: str = "png") -> bytes | None:
    """The run's figure as ``fmt`` (PNG unless told: FIGURE_FORMATS); None when no replica
    recorded anything to draw yet."""
    panels = panels_for(job, metrics)
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = 1 if len(panels) == 1 else 2
    rows = (len(panels) + cols - 1) // cols
    fig = Figure(figsize=(6 * cols, 3.6 * rows), dpi=100)
    FigureCanvasAgg(fig)
    for i, panel in enumerate(panels):
        _draw(fig.add_subplot(rows, cols, i + 1), panel, metrics)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="jpeg" if fmt == "jpg" else fmt)
    return buf.getvalue()


def read_metrics(store: Any, world_size: int) -> dict[int, list[dict[str, Any]]]:
    """``metrics/<rank>/<r>.json`` for every rank, sorted by round; unreadable files skipped
    (a round half cleaned up, or a foreign object)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        rows = []
        for r in layout.metrics_rounds(store, rank):
            try:
                data = store.get_json(layout.metrics_key(rank, r))
            except (StoreError, OSError, ValueError):
                continue
            if isinstance(data, dict):
                data.setdefault("round", r)
                rows.append(data)
        rows.sort(key=lambda d: d.get("round", 0))
        out[rank] = rows
    return out


def figure_job(spec: Any) -> str:
    """The panels' key: the job, or "" (generic panels) for a custom entrypoint."""
    return "" if spec.entrypoint else spec.job


def figure_title(spec: Any) -> str:
    return f"crf run {spec.run_id} - {spec.job_label}, {spec.replicas} replicas"


def save_figure(spec: Any, store: Any, metrics: Records | None = None) -> str | None:
    """Draw the run's figure from ``metrics`` (read from the store when None), put it at
    ``figure.png`` in the run folder and return where it is; None when there is nothing to
    draw yet (no round recorded)."""
    from crf.launcher.plan import display_path

    if metrics is None:
        metrics = read_metrics(store, spec.replicas)
    png = draw_figure(metrics, job=figure_job(spec), title=figure_title(spec))
    if png is None:
        return None
    store.put(layout.FIGURE, png)
    return display_path(store, layout.FIGURE)
