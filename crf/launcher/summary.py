"""The end of a run: the driver's summary (``result.json``), its table, and where the figure is.

The summary joins what the backend saw (exit codes) with what each replica reported
(``results/<rank>.json``), so one file answers "did it work, did the replicas agree, what did
it cost". ``weights_identical`` is the DiLoCo invariant made visible: after the last outer step
every replica must hold the same bits.

It also says what went wrong on the way, because an elastic run that "finished ok" can hide a
lot: how often each replica was restarted (and how each attempt ended), which rounds each
replica missed (from ``metrics/<rank>/<r>.json``, so rounds it spent dead count too), which
store objects were rejected as corrupt or foreign (never averaged), and the worst time any
replica spent waiting in one round.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from crf import jsonsafe, layout
from crf.executors.base import ReplicaResult, ReplicaState
from crf.launcher.progress import Column, fit_table, fmt_loss, fmt_metric, fmt_secs
from crf.layout import Rejection
from crf.replica.evaluation import held_out

#: fields copied from results/<rank>.json into the summary rows
RESULT_FIELDS = (
    "rounds_committed",
    "rounds_missed",
    "syncs_caught_up",
    "final_loss",
    "weights_sha256",
    "bytes_up",
    "bytes_down",
    "sync_s",
    # the background exchanges' own time: against sync_s, how much of it training hid
    # (docs/design.md, "Streaming DiLoCo and overlap")
    "transfer_s",
    "compute_s",
    "bytes_per_round",
    "wire",
    "compression",
    "steps",
    "wall_s",
    "job_metrics",
    "versions",
    "cuda_available",
)


#: the last line of a Python traceback: "pkg.mod.SomeError: what happened", or any class a
#: module path names ("crf.store.s3.S3Unreachable: cannot reach ...")
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Timeout|Failed|Exit)\b|(?:[A-Za-z_]\w*\.)+[A-Z]\w*:).*"
)
#: where a traceback starts in a log tail: its header, or, when the tail begins inside one,
#: a frame or the carets under a frame's code
_TRACEBACK_START = re.compile(
    r"^(?:Traceback \(most recent call last\)|File \".*\", line \d+|[\^~]+$)"
)


def last_exception(lines: Sequence[str]) -> str | None:
    """The last exception line in a log tail, if any: the reason a replica that could not
    write its own result (e.g. its store was down) died, for the summary's error column."""
    for line in reversed(lines):
        text = _RANK_PREFIX.sub("", line.strip())  # torchrun's "[rank1]: " before a rank's
        if _EXCEPTION_LINE.match(text):
            return text
    return None


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


def before_traceback(lines: Sequence[str]) -> list[str]:
    """The lines of a log tail before its first traceback (all of them when it has none)."""
    for i, line in enumerate(lines):
        if _TRACEBACK_START.match(line.split("] ", 1)[-1].strip()):
            return list(lines[:i])
    return list(lines)


def rejected_objects(reported: Iterable[Any]) -> list[str]:
    """The distinct keys of the bad (not merely absent) objects among ``reported``
    rejections (records, their dicts, or the "key: reason" text of older runs), sorted by
    round: one bad object is reported by the replica that found it and again in the round
    failure every other replica sees, and counting keys counts objects."""
    return layout.rejected_keys(Rejection.from_dict(x) for x in reported)


def reported_rejections(
    result: Mapping[str, Any],
    attempts: Sequence[Mapping[str, Any]] = (),
    metrics: Sequence[Mapping[str, Any]] | None = None,
) -> list[Rejection]:
    """What one replica reported refusing or leaving out, over all its attempts: its result,
    what earlier attempts reported before dying, and what attempts that left no result logged
    per round."""
    reported = [Rejection.from_dict(x) for x in result.get("rejected") or ()]
    for attempt in attempts:
        reported.extend(Rejection.from_dict(x) for x in attempt.get("rejected") or ())
    for m in metrics or ():
        for x in m.get("rejected") or ():
            if (x := Rejection.from_dict(x)) not in reported:
                reported.append(x)
    return reported


def rounds_missed(metrics: Sequence[Mapping[str, Any]], rounds: int) -> list[int]:
    """Rounds this replica did not commit: it was out of the quorum, the round failed, or it
    was not running (dead, restarting, healed past it) - no committed metrics for it."""
    committed = {m.get("round") for m in metrics if m.get("committed")}
    return [r for r in range(rounds) if r not in committed]


def last_committed_loss(metrics: Sequence[Mapping[str, Any]]) -> float | None:
    """The mean loss of the last round this replica committed, as its record has it (None
    without one): the "loss" of a replica that wrote no result of its own."""
    committed = [m for m in metrics if m.get("committed") and isinstance(m.get("round"), int)]
    if not committed:
        return None
    return jsonsafe.number(max(committed, key=lambda m: m["round"]).get("loss"))


def replica_row(
    res: ReplicaResult,
    log_tail: Sequence[str] = (),
    *,
    rounds: int | None = None,
    metrics: Sequence[Mapping[str, Any]] | None = None,
    attempts: Sequence[Mapping[str, Any]] = (),
    restarts: int = 0,
    not_restarted: str | None = None,
) -> dict[str, Any]:
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
    if res.result is None and row["final_loss"] is None:  # it reported nothing (cancelled,
        row["final_loss"] = last_committed_loss(metrics or ())  # killed): its records say
    # rounds missed over the whole run, not just the last attempt, from the run's per-round
    # records (``rounds`` is None when there are none to go by): a replica with no record
    # committed nothing, as one that died before its first record landed; otherwise what
    # the replica itself reported
    if metrics is not None and rounds is not None:
        row["rounds_missed"] = rounds_missed(metrics, rounds)
    syncs = [m.get("sync_s") for m in metrics or ()]
    syncs = [float(v) for v in syncs if isinstance(v, int | float) and not isinstance(v, bool)]
    row["max_sync_s"] = round(max(syncs), 3) if syncs else None
    reported = reported_rejections(data, attempts, metrics)
    # bad objects (corrupt, foreign, wrong round or shape: never averaged) apart from parts
    # that were simply not there (a dead or late replica's: left out of the average), as the
    # records say
    row["rejected"] = [str(x) for x in reported if not x.left_out]
    row["left_out"] = [str(x) for x in reported if x.left_out]
    row["objects_rejected"] = len(layout.rejected_keys(reported))
    row["restarts"] = restarts
    row["attempts"] = [dict(a) for a in attempts]
    row["resumed_from"] = data.get("resumed_from")
    if not_restarted:
        row["not_restarted"] = not_restarted
    if data.get("restartable") is False:  # e.g. the replicas disagree on the model
        row["restartable"] = False
    row["failed_in"] = data.get("failed_in")
    row["failure"] = failure_kind(res, data)
    # committed rounds: over all attempts from the per-round metrics; without any, what the
    # last attempt reported (a replica that never trained committed nothing)
    if metrics is not None and (metrics or restarts):
        row["rounds_trained"] = sum(1 for m in metrics if m.get("committed"))
    if res.result is None and row["error"] and log_tail:  # it died without saying why
        reason = last_exception(log_tail)
        if reason:
            row["error"] = f"{row['error']}: {reason}"
            row["error_in_log"] = True  # its traceback adds nothing the line does not say
    # a death's log tail is its only word; a replica that reported its error said it in
    # one line, and its traceback stays in its log and results/<rank>.json
    if log_tail and row["failure"] not in ("error", "setup error"):
        row["log_tail"] = list(log_tail)
    return row


def failure_kind(res: ReplicaResult, data: Mapping[str, Any]) -> str | None:
    """How a replica's last attempt ended when not ok: ``error`` (it raised, and said so in
    its result: the input or the code; ``setup error`` before it trained), ``death`` (no
    word from it: killed, preempted, OOM-killed, its container lost), ``cancelled``."""
    if res.ok:
        return None
    if res.state is ReplicaState.CANCELLED:
        return "cancelled"
    if data.get("status") == "failed" and data.get("error"):
        return "setup error" if data.get("failed_in") == "setup" else "error"
    return "death"


def _total(values: Iterable[Any]) -> int | float | None:
    """The sum of the values reported; None, not 0, when none was (the traffic of a run
    whose replicas were all cancelled before they could report it)."""
    known = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return sum(known) if known else None


def _mean(values: Sequence[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    nums = [v for v in nums if math.isfinite(v)]
    return sum(nums) / len(nums) if nums else None


def learning_curve(metrics: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per-round means over replicas of the loss and of the job's reward (if it logs one):
    the numbers a user checks to see the run learned, first round against last."""
    out: dict[str, Any] = {}
    for name in ("loss", "reward"):
        per_round: dict[int, list[float]] = {}
        for rows in metrics.values():
            for m in rows:
                v = m.get(name) if name == "loss" else (m.get("metrics") or {}).get(name)
                if isinstance(v, int | float) and isinstance(m.get("round"), int):
                    per_round.setdefault(m["round"], []).append(float(v))
        if per_round:
            curve = {r: sum(v) / len(v) for r, v in sorted(per_round.items())}
            first, last = min(curve), max(curve)
            out[name] = {
                "per_round": curve,
                "first": curve[first],
                "last": curve[last],
                "first_round": first,
                "last_round": last,
            }
    return out


def nonfinite_loss(
    rows: Sequence[Mapping[str, Any]], metrics: Mapping[int, Sequence[Mapping[str, Any]]]
) -> str | None:
    """Where the loss went NaN/Inf (the first round of the first replica it did), or None. A
    loss is read as the replica wrote it: a non-finite float is the string "NaN"/"Infinity"
    in its JSON (:mod:`crf.jsonsafe`)."""
    bad: list[tuple[int, int, str]] = []
    for rank, rows_of in metrics.items():
        for m in rows_of:
            if jsonsafe.is_nonfinite(m.get("loss")) and isinstance(m.get("round"), int):
                bad.append((m["round"], rank, str(m["loss"])))
    if bad:
        r, rank, value = min(bad)
        return f"the loss is {value} on replica {rank} from round {r}"
    for row in rows:
        if jsonsafe.is_nonfinite(row.get("final_loss")):
            return f"the final loss of replica {row.get('rank')} is {row['final_loss']}"
    return None


def build_summary(
    *,
    spec: Any,
    results: Sequence[ReplicaResult],
    started_at: float,
    ended_at: float | None = None,
    cancelled: bool = False,
    error: str | None = None,
    log_tails: dict[int, list[str]] | None = None,
    attempts: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    restarts: Mapping[int, int] | None = None,
    not_restarted: Mapping[int, str] | None = None,
    metrics: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    launch: int = 0,
    restart_policy: Mapping[str, Any] | None = None,
    resumed_from_round: int | None = None,
) -> dict[str, Any]:
    """The dict written to ``result.json`` (and returned by ``crf.launch``).

    ``status`` is ``ok`` only if every replica's last attempt exited cleanly and none reported
    a failure: an elastic run may finish with fewer replicas, but a replica that stayed dead
    is still a failure someone should look at. A replica that died and was restarted, and
    then finished, is ok - its restarts are in the row and in ``restarts``. A run whose loss
    went NaN/Inf is never ok, whatever the exit codes say.
    """
    ended_at = time.time() if ended_at is None else ended_at
    metrics, attempts = metrics or {}, attempts or {}
    rows = [
        replica_row(
            r,
            (log_tails or {}).get(r.rank, ()),
            # rounds the run got to; no record: the replicas' own counts
            rounds=min(spec.rounds, last_reached(metrics) + 1) if any(metrics.values()) else None,
            metrics=metrics.get(r.rank),
            attempts=attempts.get(r.rank, ()),
            restarts=(restarts or {}).get(r.rank, 0),
            not_restarted=(not_restarted or {}).get(r.rank),
        )
        for r in results
    ]
    reported = [x for r in results for x in _rejections(r, attempts, metrics)]
    hashes = [row["weights_sha256"] for row in rows]
    identical = bool(hashes) and None not in hashes and len(set(hashes)) == 1
    rounds = None if resumed_from_round else spec.rounds  # a resumed run exchanged before
    status, error = run_status(rows, metrics, cancelled=cancelled, error=error, rounds=rounds,
                               entrypoint=bool(spec.entrypoint))  # fmt: skip
    problems = run_problems(rows, reported, metrics, spec.rounds)
    missing = rewards_missing(metrics)  # a reward that gave no value in a round: said so
    notes = {"rewards_missing": missing, "warnings": reward_warnings(missing)} if missing else {}
    return {
        "run_id": spec.run_id,
        "run_uri": spec.run_uri,
        "backend": spec.backend,
        "job": spec.job_label,
        "status": status,
        "error": error,
        "fatal_error": problems.pop("fatal_error"),
        "world_size": spec.replicas,
        "rounds": spec.rounds,
        "sync_every": spec.sync_every,
        "weights_identical": identical,
        "weights_sha256": hashes[0] if identical else None,
        "final_loss": _mean([row["final_loss"] for row in rows if row["ok"]]),
        "bytes_up": _total(row["bytes_up"] for row in rows),
        "bytes_down": _total(row["bytes_down"] for row in rows),
        "launch": launch,
        "resumed_from_round": resumed_from_round,
        "restart_policy": dict(restart_policy or {}),
        "restarts": sum(row["restarts"] for row in rows),
        **problems,
        "learning": learning_curve(metrics),
        # the replicas' shares of the held-out evaluation, added up per round
        "held_out": held_out(metrics),
        "started_at": started_at,
        "ended_at": ended_at,
        "wall_s": round(ended_at - started_at, 3),
        "replicas": rows,
        "figure": None,
        **notes,
    }


def _rejections(
    result: ReplicaResult,
    attempts: Mapping[int, Sequence[Mapping[str, Any]]],
    metrics: Mapping[int, Sequence[Mapping[str, Any]]],
) -> list[Any]:
    """What replica ``result``'s attempts and round records report of refused exchanges."""
    rank = result.rank
    return list(reported_rejections(result.result or {}, attempts.get(rank, ()), metrics.get(rank)))


def run_status(
    rows: Sequence[Mapping[str, Any]],
    metrics: Mapping[int, Sequence[Mapping[str, Any]]],
    *,
    cancelled: bool,
    error: str | None,
    rounds: int | None = None,
    entrypoint: bool = True,
) -> tuple[str, str | None]:
    """The run's verdict and error (see :func:`build_summary`): ``cancelled`` unless every
    replica had already reported its own ok result; a loss that went NaN/Inf
    fails a run whatever its exit codes, and is added to the error; so does a run that asked
    for ``rounds`` and exchanged none (:func:`never_exchanged`)."""
    idle = never_exchanged(rows, metrics, rounds, entrypoint) if rounds is not None else None
    # a cancel that came once every replica had reported its own ok result stopped nothing
    # (Ctrl-C as the run ended): the run finished
    finished = bool(rows) and all(r["ok"] and r.get("reported_status") == "ok" for r in rows)
    if cancelled and not finished:
        status = "cancelled"
    elif error is not None or not rows or not all(row["ok"] for row in rows):
        status = "failed"
    elif idle is not None:
        status, error = "failed", idle
    else:
        status = "ok"
    diverged = nonfinite_loss(rows, metrics)
    if diverged is not None and status != "cancelled":
        status = "failed"
        error = f"{error}; {diverged}" if error else diverged
    return status, error


def never_exchanged(
    rows: Sequence[Mapping[str, Any]],
    metrics: Mapping[int, Sequence[Mapping[str, Any]]],
    rounds: int,
    entrypoint: bool = True,
) -> str | None:
    """Why a run whose replicas all exited cleanly is still not ok: it asked for ``rounds``
    exchange rounds and no replica committed one (no per-round record says so, no result
    counts one). The usual cause is an ``--entrypoint`` (verl, PRIME-RL, a torchrun script)
    that trains but never calls ``DiLoCoHook.step``, so its replicas trained alone, or a
    job module (``entrypoint`` False) that trains outside ``ctx.diloco``. None when some
    round was exchanged, or when a replica failed anyway (its own error says more)."""
    if not rows or not all(row["ok"] for row in rows):
        return None
    if any(m.get("committed") for ms in metrics.values() for m in ms):
        return None
    if any((row.get("rounds_committed") or 0) > 0 for row in rows):
        return None
    return (
        f"no round was exchanged: {len(rows)} replica(s) exited cleanly but none committed any "
        f"of the {rounds} round(s) asked for; "
        + (
            "the entrypoint likely never calls DiLoCoHook.step after its optimizer step "
            "(docs/integrations.md)"
            if entrypoint
            else "the job likely trains outside ctx.diloco(model, optimizer), or takes no "
            "step in it (docs/extending.md)"
        )
    )


def last_reached(metrics: Mapping[int, Sequence[Mapping[str, Any]]]) -> int:
    """The last round any replica recorded (0 when none did): the rounds after it were never
    reached (a cancelled or failed run), so no replica missed them and nobody lost them."""
    recorded = [m.get("round") for ms in metrics.values() for m in ms]
    return max((r for r in recorded if isinstance(r, int)), default=0)


def run_problems(
    rows: Sequence[Mapping[str, Any]],
    reported: Sequence[Rejection],
    metrics: Mapping[int, Sequence[Mapping[str, Any]]],
    rounds: int,
) -> dict[str, Any]:
    """The run-wide totals of what went wrong: rounds nobody committed, bad objects (counted
    by key, from the replicas' rejection records), parts left out, the worst sync, and what
    stopped the run for good (an error no restart can fix)."""
    committed = {m.get("round") for ms in metrics.values() for m in ms if m.get("committed")}
    committed &= set(range(rounds))
    # a round is lost when the run got to it and nobody committed it; the rounds after the
    # last one any replica recorded were never reached (a cancelled or failed run), not lost
    reached = last_reached(metrics)
    all_rejected = layout.rejected_keys(reported)
    syncs = [row["max_sync_s"] for row in rows if row["max_sync_s"] is not None]
    fatal = next(
        (f"replica {r['rank']}: {r['error']}" for r in rows if r.get("restartable") is False),
        None,
    )
    return {
        "fatal_error": fatal,
        # rounds at least one replica committed, and rounds the run reached that nobody did
        # (e.g. a bad object failed the round for everyone); None when no replica logged
        # per-round metrics
        "rounds_completed": len(committed) if metrics else None,
        "rounds_lost": sorted(set(range(min(reached + 1, rounds))) - committed)
        if metrics
        else None,
        "objects_rejected": len(all_rejected),
        "rejected_objects": all_rejected,
        "contributions_left_out": len({x.key for x in reported if x.left_out}),
        "max_sync_s": max(syncs) if syncs else None,
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
    if row.get("failure") == "setup error":
        return Text(f"failed at setup ({code})", style="bold red")
    return Text(f"failed ({code})" if code is not None else "failed", style="bold red")


def _rounds_text(row: dict[str, Any], rounds: Any) -> str:
    """Committed rounds: the replica's own count, or - when it ran in several attempts (a
    restart, a resume) or reported none (cancelled, killed) - the whole run's count from its
    per-round metrics."""
    committed = row.get("rounds_committed")
    several = row.get("restarts") or row.get("resumed_from") is not None
    if (several or committed is None) and isinstance(row.get("rounds_trained"), int):
        committed = row["rounds_trained"]
    return f"{committed}/{rounds}" if committed is not None else "-"


def _count(value: Any) -> str:
    n = len(value) if isinstance(value, list) else value
    return str(n) if isinstance(n, int) and n else "-"


def _attempt_text(a: Mapping[str, Any]) -> str:
    how = a.get("message") or a.get("state") or "failed"
    if a.get("error"):
        how = f"{how}: {a['error']}"
    where = f" in round {a['round']} ({a.get('phase')})" if a.get("round") is not None else ""
    return f"attempt {a.get('attempt', '?')} {how}{where}"


def _wire_text(row: Mapping[str, Any]) -> str:
    ratio = row.get("compression")
    return f"{row.get('wire') or '-'}" + (f" {ratio:.1f}x" if ratio and ratio != 1 else "")


def print_workers(summary: Mapping[str, Any], console: Console) -> None:
    """The rollout workers' section (crf.launcher.rollout_view), when the run had workers."""
    if summary.get("workers"):
        from crf.launcher.rollout_view import print_workers as show

        show(summary, console)


def render_summary(
    summary: dict[str, Any],
    console: Console,
    *,
    result_path: str | None = None,
    plot_path: str | None = None,
) -> None:
    """Print the per-replica table, what went wrong on the way (restarts, rejected objects),
    the verdict, and where result.json / figure.png are."""
    console.print(replica_table(summary, console.width))
    print_restarts(summary["replicas"], console)
    print_workers(summary, console)
    print_failures(summary, console)
    print_version_warnings(summary, console)
    for line in [
        *unreported_warnings(summary),
        *reward_warnings(summary.get("rewards_missing") or {}),
    ]:
        console.print(f"[bold yellow]warning:[/] {escape(line)}", soft_wrap=True, highlight=False)
    # one line in a log or a pipe (grep finds it whole); wrapped at words on a terminal
    console.print("run " + " - ".join(verdict_parts(summary)), soft_wrap=not console.is_terminal)
    if result_path:
        console.print(f"result: {result_path}", soft_wrap=True, highlight=False)
    if plot_path:
        console.print(f"figure: {plot_path}", soft_wrap=True, highlight=False)


def replica_table(summary: Mapping[str, Any], width: int = 80) -> Table:
    """One row per replica: exit, rounds, (when anything went wrong) missed rounds, restarts
    and rejected objects, then loss, the job's headline metric, traffic and time - fitted to
    ``width`` columns (the least important columns are left out; no value is cut)."""
    rounds = summary.get("rounds")
    rows = summary["replicas"]
    # a result's job_metrics is a dict (crf.replica.context.job_metrics_of); one written
    # otherwise (by hand, or an older replica) shows no headline metric, not a crash
    jm = [m if isinstance(m := row.get("job_metrics"), dict) else {} for row in rows]
    cols = [
        Column("rank", [str(row["rank"]) for row in rows], keep=100),
        Column("exit", [_exit_text(row) for row in rows], keep=95, justify="left"),
        Column("rounds", [_rounds_text(row, rounds) for row in rows], keep=90),
    ]
    # the fault columns only when something happened: in a clean run they are all zeros
    if any(
        row.get("restarts") or row.get("objects_rejected") or row.get("rounds_missed")
        for row in rows
    ):
        cols += [
            Column("missed", [_count(row.get("rounds_missed")) for row in rows], keep=75),
            Column("restarts", [_count(row.get("restarts")) for row in rows], keep=76),
            Column("rejected", [_count(row.get("objects_rejected")) for row in rows], keep=74),
        ]
    cols.append(Column("loss", [fmt_loss(row.get("final_loss")) for row in rows], keep=85))
    for key, header, keep in _SUMMARY_HEADLINE:
        if any(m.get(key) is not None for m in jm):
            cols.append(Column(header, [fmt_metric(m.get(key)) for m in jm], keep=keep))
    cols += [
        Column("sent", [fmt_size(row.get("bytes_up")) for row in rows], keep=50),
        Column("recv", [fmt_size(row.get("bytes_down")) for row in rows], keep=45),
        Column("compute", [fmt_secs(row.get("compute_s")) for row in rows], keep=60),
        Column("sync", [fmt_secs(row.get("sync_s")) for row in rows], keep=55),
        Column("wire", [_wire_text(row) for row in rows], keep=30),
    ]
    caption = "loss, reward: means over the last round; exact: held-out exact match at the end"
    if not any(m.get(k) is not None for m in jm for k, _, _ in _SUMMARY_HEADLINE):
        caption = "loss: mean over each replica's last round"
    if summary.get("launch") or any(row.get("restarts") for row in rows):
        # a replica's own counters start again with each process; rounds come from the
        # run's records
        caption += "; sent, recv, compute, sync: each replica's last process only"
    return fit_table(cols, width, title=f"crf run {summary['run_id']}: summary", caption=caption)


#: the job's headline metrics in the summary (from each replica's ``job_metrics``)
_SUMMARY_HEADLINE = (("reward_last_round", "reward", 80), ("exact_match_after", "exact", 65))


def fmt_size(n: Any) -> str:
    """Short bytes for a table cell: "512B", "3.4M", "1.2G"."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return "-"
    size = float(n)
    for unit in ("B", "K", "M", "G"):
        if abs(size) < 1000:
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1000
    return f"{size:.1f}T"


def print_restarts(rows: Sequence[Mapping[str, Any]], console: Console) -> None:
    """Per replica: how each restarted attempt ended, the rounds it was late for, and the
    rounds it missed."""
    for row in rows:
        attempts = row.get("attempts") or []
        # an attempt that ended the replica (its restart refused, or failed to start) is
        # recorded too: only those followed by a restart are counted here (print_failures
        # says why the last one was not)
        restarts = row.get("restarts")
        attempts = attempts[:restarts] if isinstance(restarts, int) else attempts
        if attempts:
            console.print(
                f"[yellow]replica {row['rank']}[/] restarted {len(attempts)} time(s): "
                + escape("; ".join(_attempt_text(a) for a in attempts)),
                soft_wrap=True,
                highlight=False,
            )
        late = row.get("syncs_caught_up")
        if isinstance(late, list) and late:
            console.print(
                f"replica {row['rank']} was late for exchange round(s) "
                f"{', '.join(map(str, late))} and took the published average (no checkpoint "
                "load)",
                highlight=False,
            )
        if isinstance(row.get("rounds_missed"), list) and row["rounds_missed"] and attempts:
            console.print(
                f"    rounds missed: {', '.join(map(str, row['rounds_missed']))}",
                highlight=False,
            )


def print_failures(summary: Mapping[str, Any], console: Console) -> None:
    """Each failed replica's error, log tail and log path, then the rejected objects."""
    for row in summary["replicas"]:
        if row["ok"] or row["state"] == ReplicaState.CANCELLED:
            continue  # a cancelled replica is in the table; its log tail says nothing new
        console.print(
            f"[bold red]replica {row['rank']}[/]: {escape(str(row.get('error') or 'failed'))}"
        )
        if row.get("not_restarted"):
            console.print(f"    not restarted: {escape(row['not_restarted'])}", highlight=False)
        # an error the replica reported says it in one line (its traceback is in
        # results/<rank>.json); the log tail is for a death, which left no word
        tail = row.get("log_tail", [])
        if row.get("error_in_log"):  # the exception is in the line above: not its traceback
            tail = before_traceback(tail)
        for line in tail:
            console.print(Text(f"    {line}", style="dim"), soft_wrap=True)
        if row.get("log_path"):
            console.print(f"    log: {row['log_path']}", soft_wrap=True, highlight=False)
    if summary.get("rejected_objects"):
        keys = summary["rejected_objects"]
        console.print(
            f"[yellow]{len(keys)} object(s) rejected (never averaged):[/] "
            + escape(", ".join(keys[:10]))
            + (" ..." if len(keys) > 10 else ""),
            soft_wrap=True,
            highlight=False,
        )


def verdict_parts(summary: Mapping[str, Any]) -> list[str]:
    """The pieces of the closing "run ..." line: status, wall time, loss, reward, restarts,
    lost rounds, whether the weights agree, and the errors."""
    status = summary["status"]
    style = {"ok": "bold green", "failed": "bold red"}.get(status, "bold yellow")
    parts = [f"[{style}]{status}[/]", f"wall {fmt_seconds(summary.get('wall_s'))}"]
    if summary.get("launch"):
        parts.append(f"launch {summary['launch']} (resumed)")
    if summary.get("final_loss") is not None:
        parts.append(f"final loss {fmt_loss(summary['final_loss'])}")
    reward = (summary.get("learning") or {}).get("reward")
    if reward and reward["last_round"] > reward["first_round"]:
        parts.append(
            f"mean reward {reward['first']:.3f} (round {reward['first_round']}) -> "
            f"{reward['last']:.3f} (round {reward['last_round']})"
        )
    if summary.get("held_out"):
        parts.append(held_out_text(summary["held_out"]))
    if summary.get("restarts"):
        parts.append(f"[yellow]{summary['restarts']} restart(s)[/]")
    if summary.get("rounds_lost"):
        lost = ", ".join(map(str, summary["rounds_lost"]))
        parts.append(f"[yellow]round(s) {lost} committed by nobody[/]")
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
    fatal = summary.get("fatal_error")
    if fatal and fatal.split(": ", 1)[-1] not in str(summary.get("error") or ""):
        parts.append(f"[red]a restart cannot fix it: {escape(fatal)}[/]")
    return parts


def held_out_text(h: Mapping[str, Any]) -> str:
    """``held-out pass@1 0.125 (before) -> 0.400 (round 3, 64/64 rows)``: the summary's
    held-out section in the closing line (rows: how many the replicas' shares added up to)."""
    after = h.get("after") or {}
    before = h.get("pass@1_before")
    loss = ""
    if h.get("loss_after") is not None:
        was = h.get("loss_before")
        loss = "held-out loss " + (f"{was:.3f} (before) -> " if was is not None else "")
        loss += f"{h['loss_after']:.3f}"
        if h.get("pass@1_after") is None:
            return loss + f" (round {h['last_round']})"
        loss += ", "
    text = loss + "held-out pass@1 " + (f"{before:.3f} (before) -> " if before is not None else "")
    if h.get("pass@1_after") is None:
        return text + "-"
    rows = f"{after.get('examples')}/{after.get('of')}" if after.get("of") else after["examples"]
    return text + f"{h['pass@1_after']:.3f} (round {h['last_round']}, {rows} rows)"


#: crf/composer/callback.py's MISSING (not imported: that module imports transformers)
_MISSING = "reward_missing/"


def rewards_missing(metrics: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, list[int]]:
    """Each reward that gave no value (None or NaN for every completion) in every logged step
    of a round on some replica: its name (as TRL logs it) and those rounds. The round records
    carry ``reward_missing/<name>``, the share of such steps (crf/composer/callback.py)."""
    out: dict[str, set[int]] = {}
    for rows_of in metrics.values():
        for m in rows_of:
            for key, share in (m.get("metrics") or {}).items():
                if key.startswith(_MISSING) and share == 1.0 and isinstance(m.get("round"), int):
                    out.setdefault(key.removeprefix(_MISSING), set()).add(m["round"])
    return {name: sorted(rounds) for name, rounds in sorted(out.items())}


def reward_warnings(missing: Mapping[str, Sequence[int]]) -> list[str]:
    """One line per reward of :func:`rewards_missing`."""
    return [
        f"reward {name} gave no value (None or NaN for every completion) in round(s) "
        f"{', '.join(map(str, rounds))}: TRL leaves such completions out of it, so it "
        "trained nothing there; make it return a number for the completions it scores"
        for name, rounds in missing.items()
    ]


def unreported_warnings(summary: Mapping[str, Any]) -> list[str]:
    """A line for the replicas that exited cleanly without writing their result: a script
    that never called ``DiLoCoHook.close()``. Its rounds are in the run folder (the run may
    be ok), but its row shows none of them, and its job metrics are lost."""
    silent = [str(r.get("rank")) for r in summary.get("replicas") or []
              if r.get("exit_code") == 0 and "reported_status" in r
              and r["reported_status"] is None]  # fmt: skip
    if not silent:
        return []
    return [
        f"replica(s) {', '.join(silent)} exited cleanly without writing a result: the "
        "script never called DiLoCoHook.close() (or ctx.finish()), so the table shows none "
        "of their rounds and their job metrics are lost (docs/integrations.md)"
    ]


def version_warnings(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per replica whose torchft / trl / transformers (its result's ``versions``)
    differ from this process's (the driver's): the run may not behave as it does here."""
    from crf.versions import mismatches

    out = []
    for row in rows:
        diff = mismatches(row.get("versions"))
        if diff:
            said = ", ".join(f"{name} {got} (driver: {want})" for name, (got, want) in diff.items())
            out.append(f"replica {row.get('rank')} ran {said}")
    return out


def print_version_warnings(summary: Mapping[str, Any], console: Console) -> None:
    """The warnings of :func:`version_warnings`, in yellow."""
    for line in version_warnings(summary.get("replicas") or []):
        console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True, highlight=False)
