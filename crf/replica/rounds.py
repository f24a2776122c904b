"""One replica's per-round bookkeeping, apart from :class:`~crf.replica.context.ReplicaContext`
so that each concern is one small object: the inner steps' loss and metrics until their round's
record is written (:class:`StepMetrics`), where the time went (:class:`TimeAccount`), and the
syncs of each outer round, which with Streaming DiLoCo are one per fragment and are merged into
one record once the round is over (:class:`SyncBook`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crf import layout
from crf.layout import Rejection


def heartbeat_fields(record: layout.RoundMetrics) -> dict[str, Any]:
    """The heartbeat's view of a closed round: its mean loss and metrics (the job's headline
    metric, e.g. the composer's reward), its sync time, how many bad objects it refused and
    the step it closed at, so the live table shows the same "loss" as the summary (the last
    round's mean) and a round's line its own step, not the one the replica has reached."""
    refused = (x for x in map(Rejection.from_dict, record.rejected) if not x.left_out)
    return {
        "last_round": record.round,
        "round_loss": record.loss,
        "round_metrics": dict(record.metrics),
        "round_sync_s": record.sync_s,
        "round_rejected": len(layout.rejected_keys(refused)),
        "round_step": record.step,
    }


def newest_round_record(store: Any, rank: int, last: int) -> layout.RoundMetrics | None:
    """Replica ``rank``'s newest round record with a loss, of a round up to ``last``; None
    when it wrote none that can be read. Records of later rounds belong to a stopped launch
    whose rounds are trained again."""
    try:
        rounds = [r for r in layout.metrics_rounds(store, rank) if r <= last]
    except Exception:  # noqa: BLE001 - the store's error: the loss shown is not worth a restart
        return None
    for r in sorted(rounds, reverse=True):
        try:
            record = layout.RoundMetrics.from_dict(store.get_json(layout.metrics_key(rank, r)))
        except Exception:  # noqa: BLE001 - unreadable or gone: an older record may serve
            continue
        if record.loss is not None:
            return record
    return None


@dataclass
class StepMetrics:
    """The inner steps' loss and metrics since the last round record, averaged into the record
    of the round whose sync ended them."""

    losses: list[float] = field(default_factory=list)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    round_losses: dict[int, float] = field(default_factory=dict)  # mean loss per recorded round
    #: the heartbeat's view of the last round record written (:func:`heartbeat_fields`)
    last_closed: dict[str, Any] = field(default_factory=dict)
    #: with rollout workers: the round's rollouts by source (``RoundMetrics.rollouts``)
    rollouts: dict[str, Any] = field(default_factory=dict)

    def add(self, loss: float | None, metrics: Mapping[str, float | None]) -> None:
        if loss is not None:
            self.losses.append(loss)
        for k, v in metrics.items():
            if v is None:
                continue
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.counts[k] = self.counts.get(k, 0) + 1

    def close_round(self, r: int) -> tuple[float | None, dict[str, float]]:
        """Round r's mean loss and metrics; the next round starts from nothing."""
        loss = sum(self.losses) / len(self.losses) if self.losses else None
        if loss is not None:
            self.round_losses[r] = loss
        metrics = {k: self.sums[k] / self.counts[k] for k in self.sums}
        self.losses, self.sums, self.counts = [], {}, {}
        return loss, metrics

    def final_loss(self, fallback: float | None) -> float | None:
        """The newest recorded round's mean loss (``fallback`` before any round was)."""
        return self.round_losses[max(self.round_losses)] if self.round_losses else fallback


@dataclass
class TimeAccount:
    """Where a replica's time went: blocked in the manager (starting an exchange, waiting for
    it, healing, snapshotting checkpoints) is ``sync_s``, the rest ``compute_s``. The manager
    keeps running totals; the marks are where they stood at the previous sync."""

    started_at: float = field(default_factory=time.time)
    compute_s: float = 0.0
    sync_s: float = 0.0
    mark: float = field(default_factory=time.monotonic)
    blocked_mark: float = 0.0
    transfer_mark: float = 0.0
    #: (clock, the manager's blocked seconds) where a sync step's own work ended
    outer_mark: tuple[float, float] | None = None

    def restart(self) -> None:
        """A new manager (totals from zero); compute time counts from now."""
        self.blocked_mark = self.transfer_mark = 0.0
        self.mark = time.monotonic()

    def charge(self, blocked_s: float, transfer_s: float) -> tuple[float, float]:
        """Account one sync from the manager's totals; returns its (sync_s, transfer_s)."""
        now = time.monotonic()
        sync_s, self.blocked_mark = blocked_s - self.blocked_mark, blocked_s
        transfer, self.transfer_mark = transfer_s - self.transfer_mark, transfer_s
        self.sync_s += sync_s
        self.compute_s += max(0.0, now - self.mark - sync_s)
        self.mark = now
        return sync_s, transfer

    def mark_outer(self, blocked_s: float) -> None:
        """A sync step's own work ends here (DiLoCo's hook comes next)."""
        self.outer_mark = (time.monotonic(), blocked_s)

    def take_outer(self, blocked_s: float) -> float | None:
        """Seconds since :meth:`mark_outer` that the manager did not count as blocked
        (DiLoCo's own work at the sync); None without a mark."""
        if self.outer_mark is None:
            return None
        (t0, blocked0), self.outer_mark = self.outer_mark, None
        return (time.monotonic() - t0) - (blocked_s - blocked0)

    def wall_s(self) -> float:
        return time.time() - self.started_at


def merge_syncs(r: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One outer round's facts from its syncs (one per fragment): committed if every sync
    was, participants those of every sync, times and bytes summed."""
    parts = set(entries[0]["participants"])
    for x in entries[1:]:
        parts &= set(x["participants"])
    errors = [x["error"] for x in entries if x["error"]]
    healed = [x["healed_from"] for x in entries if x["healed_from"] is not None]
    return {
        "round": r,
        "exchange_round": entries[-1]["exchange_round"],
        "committed": all(x["committed"] for x in entries),
        "participants": sorted(parts),
        "sync_s": sum(x["sync_s"] for x in entries),
        "transfer_s": sum(x["transfer_s"] for x in entries),
        "bytes_up": sum(x["bytes_up"] for x in entries),
        "bytes_down": sum(x["bytes_down"] for x in entries),
        "error": "; ".join(errors) or None,
        "rejected": [j for x in entries for j in x["rejected"]],
        "healed_from": healed[-1] if healed else None,
        "phases_s": _sum_phases(x.get("phases_s") or {} for x in entries),
        "fragments": entries,
    }


def _sum_phases(per_sync: Any) -> dict[str, float]:
    """The exchange's seconds per phase over an outer round's syncs."""
    out: dict[str, float] = {}
    for phases in per_sync:
        for k, v in phases.items():
            out[k] = round(out.get(k, 0.0) + v, 4)
    return out


@dataclass
class SyncBook:
    """Each sync's facts until its outer round (``sync_every`` steps) is over, then the
    round's facts, waiting to be written with the steps' metrics."""

    fragments: int
    sync_every: int
    entries: list[dict[str, Any]] = field(default_factory=list)  # per sync, round not over
    finished: list[dict[str, Any]] = field(default_factory=list)  # per round, not recorded
    outer_commits: dict[int, list[bool]] = field(default_factory=dict)
    n_rejected: int = 0  # how many of the manager's rejected entries are in an entry already
    snapshot_s: float = 0.0  # the manager's checkpoint snapshot seconds in an entry already

    def new_snapshot_s(self, total: float) -> float:
        """The checkpoint snapshot seconds of the manager's running ``total`` not seen yet."""
        fresh, self.snapshot_s = total - self.snapshot_s, total
        return fresh

    def new_rejections(self, rejected: list[Any]) -> list[Rejection]:
        """The entries of the manager's ``rejected`` (which grows over the run) not seen yet."""
        fresh, self.n_rejected = rejected[self.n_rejected :], len(rejected)
        return [Rejection.from_dict(x) for x in fresh]

    def add(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        self.outer_commits.setdefault(entry["round"], []).append(entry["committed"])

    def fold(self, step: int, *, final: bool) -> None:
        """Move the syncs of every outer round that is over (all of them if ``final``) into
        ``finished``, one record per round."""
        done: dict[int, list[dict[str, Any]]] = {}
        keep = []
        for entry in self.entries:
            r = entry["round"]
            if final or step >= (r + 1) * self.sync_every:
                done.setdefault(r, []).append(entry)
            else:
                keep.append(entry)
        self.entries = keep
        for r, entries in sorted(done.items()):
            if self.fragments == 1:
                (info,) = entries
                self.finished.append(info)
            else:
                self.finished.append(merge_syncs(r, entries))

    def take_finished(self) -> list[dict[str, Any]]:
        out, self.finished = self.finished, []
        return out

    def outer_rounds(self) -> tuple[int, list[int]]:
        """(committed, missed) outer rounds: one counts as committed when every one of its
        syncs was."""
        committed = sum(all(v) for v in self.outer_commits.values())
        missed = sorted(r for r, v in self.outer_commits.items() if not all(v))
        return committed, missed
