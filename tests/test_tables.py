"""The live progress table and the summary table fit 80 columns without
cutting a value, and show the job's headline metric (the composer's reward, the lm's loss);
off a terminal the watch prints one plain line per replica per round and per event."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from rich.console import Console

from crf.executors.base import ReplicaState, ReplicaStatus
from crf.launcher.progress import PlainReporter, ReplicaView, render_progress
from crf.launcher.summary import render_summary
from crf.layout import Heartbeat

NOW = 1_800_000_000.0
ROOT = Path(__file__).resolve().parents[1]


def _beat(rank: int, job: str, **kw: Any) -> Heartbeat:
    metrics = {"reward": 0.4567, "exact_match": 0.25} if job == "composer" else {}
    fields: dict[str, Any] = {
        "rank": rank,
        "phase": "syncing",
        "step": 123456,
        "round": 12,
        "last_round": 11,
        "round_loss": 0.693147,
        "round_metrics": metrics,
        "round_sync_s": 12.34,
        "updated_at": NOW - 75,
    }
    fields.update(kw)
    return Heartbeat(**fields)


def _views(job: str, restarts: int = 0) -> list[ReplicaView]:
    failed = ReplicaStatus(ReplicaState.FAILED, exit_code=137, message="killed by SIGKILL")
    running = ReplicaStatus(ReplicaState.RUNNING)
    return [
        ReplicaView(r, failed if r == 0 else running, _beat(r, job), restarts=restarts * r)
        for r in range(3)
    ]


def _lines(console: Console) -> list[str]:
    return console.export_text(clear=False).splitlines()


def _assert_fits(lines: list[str], width: int = 80) -> None:
    assert lines
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    assert not any("…" in line for line in lines), "\n".join(lines)


@pytest.mark.parametrize("job", ["composer", "lm"])
@pytest.mark.parametrize("restarts", [0, 1])
def test_progress_table_fits_80_columns(job: str, restarts: int) -> None:
    console = Console(width=80, record=True, file=io.StringIO())
    table = render_progress(
        _views(job, restarts),
        run_id="20261125-075500-abcdef",
        rounds=20,
        sync_every=8,
        elapsed_s=1234,
        now=NOW,
        width=console.width,
    )
    console.print(table)
    lines = _lines(console)
    _assert_fits(lines)
    header = next(line for line in lines if line.startswith("rank"))
    assert "loss" in header.split()
    assert ("reward" in header.split()) is (job == "composer")
    text = "\n".join(lines)
    for whole in ("0.6931", "12/20", "failed (137)", "running"):
        assert whole in text  # values whole, not cut or folded
    if job == "composer":
        assert "0.457" in text
    if restarts:
        assert "restarts" in header
    assert "last finished round" in text  # says which loss it is


def test_progress_table_keeps_more_columns_when_wide() -> None:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(
        render_progress(
            _views("composer"), run_id="r", rounds=20, sync_every=8, elapsed_s=1, now=NOW, width=160
        )
    )
    header = next(line for line in _lines(console) if line.startswith("rank"))
    assert {"step", "exact", "sync", "beat", "phase"} <= set(header.split())


def test_progress_title_uses_the_terminal_width() -> None:
    """The title (run, time, held-out score) is one line on a wide terminal, not wrapped at
    the table's narrower width."""
    beats = [
        _beat(r, "composer", round_metrics={"eval/n": 32.0, "eval/of": 64.0, "eval/pass": 3.0})
        for r in range(2)
    ]
    views = [ReplicaView(r, ReplicaStatus(ReplicaState.RUNNING), beats[r]) for r in range(2)]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_progress(views, run_id="a-long-run-id-of-a-run", rounds=20,
                                  sync_every=8, elapsed_s=1, now=NOW, width=200))  # fmt: skip
    title = _lines(console)[0]
    assert title.startswith("crf run a-long-run-id-of-a-run: 0/2 done")
    assert title.rstrip().endswith("(round 11, 64/64 rows)"), _lines(console)


def test_a_replica_without_a_heartbeat_yet_is_starting() -> None:
    """Its process runs but has written no heartbeat (it imports, loads its model): the
    phase says so rather than nothing; a process not started yet has no phase."""
    views = [
        ReplicaView(0, ReplicaStatus(ReplicaState.RUNNING), None),
        ReplicaView(1, ReplicaStatus(ReplicaState.PENDING), None),
    ]
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render_progress(views, run_id="r", rounds=4, sync_every=2, elapsed_s=1,
                                  now=NOW, width=160))  # fmt: skip
    rows = [line.split() for line in _lines(console) if line.strip()[:1].isdigit()]
    assert [row[:3] for row in rows] == [["0", "running", "starting"], ["1", "pending", "-"]]


def test_progress_table_reads_old_heartbeats() -> None:
    """A heartbeat written before it carried the round's metrics still renders (its loss is
    shown as absent, not as the last step's)."""
    old = Heartbeat.from_dict({"rank": 0, "phase": "training", "step": 3, "round": 1, "loss": 2.5})
    view = ReplicaView(0, ReplicaStatus(ReplicaState.RUNNING), old)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render_progress([view], run_id="r", rounds=4, sync_every=2, elapsed_s=1, now=NOW))
    _assert_fits(_lines(console))
    assert "1/4" in console.export_text(clear=False)


def _summary(job: str, faults: bool) -> dict[str, Any]:
    jm = {"reward_last_round": 0.6712, "exact_match_after": 0.61} if job == "composer" else {}
    rows = [
        {
            "rank": r,
            "state": "succeeded",
            "exit_code": 0,
            "ok": True,
            "rounds_committed": 19 if faults else 20,
            "rounds_missed": [3] if faults else [],
            "restarts": 1 if faults else 0,
            "objects_rejected": 2 if faults else 0,
            "final_loss": 1.234567,
            "bytes_up": 123_456_789,
            "bytes_down": 987_654_321,
            "compute_s": 1234.5,
            "sync_s": 56.7,
            "wire": "float16",
            "compression": 2.0,
            "job_metrics": jm,
            "weights_sha256": "ab" * 32,
        }
        for r in range(4)
    ]
    return {
        "run_id": "20261125-075500-abcdef",
        "rounds": 20,
        "replicas": rows,
        "status": "ok",
        "weights_identical": True,
        "wall_s": 1500.0,
        "final_loss": 1.234567,
        "job": job,
    }


@pytest.mark.parametrize("job", ["composer", "lm"])
@pytest.mark.parametrize("faults", [False, True])
def test_summary_table_fits_80_columns(job: str, faults: bool) -> None:
    console = Console(width=80, record=True, file=io.StringIO())
    render_summary(_summary(job, faults), console)
    lines = _lines(console)
    table = lines[: next(i for i, line in enumerate(lines) if line.startswith("run "))]
    _assert_fits(table)
    header = next(line for line in table if line.startswith("rank")).split()
    assert "loss" in header
    assert ("reward" in header) is (job == "composer")
    text = "\n".join(table)
    assert "1.2346" in text and ("19/20" if faults else "20/20") in text and "ok (0)" in text
    if job == "composer":
        assert "0.671" in text
    if faults:
        assert {"missed", "restarts", "rejected"} <= set(header)
    assert "last round" in text  # the same "loss" as the live table
    # a restarted replica's traffic and time are its last process's, and the table says so
    assert ("last process only" in " ".join(text.split())) is faults


def test_off_a_terminal_the_closing_line_is_one_line() -> None:
    """In a log or a pipe the closing line is not broken at 80 columns (a grep for it finds
    it whole); on a terminal it wraps at words."""
    error = "replica 1 failed after 3 committed round(s) with ValueError: " + "x" * 80
    summary = {**_summary("lm", False), "status": "failed", "error": error}
    for terminal in (False, True):
        console = Console(width=80, record=True, file=io.StringIO(), force_terminal=terminal)
        render_summary(summary, console)
        text = console.export_text()
        verdict = text[text.index("run failed") : text.index("ValueError:")]
        assert (len(verdict.splitlines()) == 1) is not terminal, text


def test_a_cancelled_replicas_rounds_come_from_the_run_records() -> None:
    """A replica stopped by a cancel wrote no result of its own: its rounds are the ones the
    run's records say it committed, not "-"."""
    row = {"rank": 0, "state": "cancelled", "exit_code": None, "ok": False,
           "rounds_committed": None, "rounds_trained": 5, "rounds_missed": [],
           "restarts": 0, "error": "cancelled"}  # fmt: skip
    summary = {"run_id": "c", "rounds": 8, "replicas": [row], "status": "cancelled",
               "weights_identical": False}  # fmt: skip
    console = Console(width=80, record=True, file=io.StringIO())
    render_summary(summary, console)
    row_line = next(line for line in _lines(console) if line.strip().startswith("0 "))
    assert "5/8" in row_line.split(), row_line


def test_plain_reporter_one_line_per_replica_round_and_event() -> None:
    """Off a terminal: a line when a replica's heartbeat shows a newly finished round, none
    when it shows the same one again, and one when a replica ends or a round refused
    objects."""
    out = io.StringIO()
    console = Console(file=out, width=80)
    assert not console.is_terminal
    rep = PlainReporter(console, rounds=3)
    running = ReplicaStatus(ReplicaState.RUNNING)
    done = ReplicaStatus(ReplicaState.SUCCEEDED, exit_code=0)
    starting = Heartbeat(rank=1, phase="starting")

    def polled(r0: Heartbeat | None, r1: Heartbeat | None, s1: ReplicaStatus = running) -> None:
        rep.update([ReplicaView(0, running, r0), ReplicaView(1, s1, r1)])

    polled(None, starting)
    assert out.getvalue() == "replica 1 starting: loading its model and data\n"
    out.truncate(0), out.seek(0)
    r0 = _beat(0, "composer", last_round=0, step=4, round_loss=0.5)
    polled(r0, starting)
    polled(r0, starting)  # the same round again: no new line
    polled(_beat(0, "composer", last_round=1, step=8), _beat(1, "lm", last_round=0, step=4))
    polled(
        _beat(0, "composer", last_round=1, step=8),
        _beat(1, "lm", last_round=1, step=8, round_rejected=2),
        done,
    )
    lines = out.getvalue().splitlines()
    first = "replica 0 round 0 (1/3) step 4 loss 0.5000 reward 0.457 exact 0.250 sync 12s"
    assert lines[0] == first
    assert lines.count(lines[0]) == 1
    assert any(line.startswith("replica 0 round 1 (2/3) step 8 loss 0.6931") for line in lines)
    assert "replica 1 round 0 (1/3) step 4 loss 0.6931 sync 12s" in lines
    assert any(line.startswith("replica 1 round 1 (2/3)") for line in lines)
    assert "replica 1 round 1: rejected 2 object(s) (never averaged)" in lines
    assert "replica 1 ended: succeeded" in lines
    assert all("reward" not in line for line in lines if line.startswith("replica 1 round"))


def test_plain_reporter_says_when_a_replica_starts_trains_and_saves() -> None:
    """Off a terminal, what a replica does before its first round closes (minutes of model
    loading) shows too: a line the first time each replica attempt is seen starting,
    training, healing or saving, none for the phases of every round; a restarted replica
    starts again; the stopped launch's heartbeat (before ``since``) says nothing."""
    out = io.StringIO()
    rep = PlainReporter(Console(file=out, width=80), 3, None, 0, NOW - 100)
    running = ReplicaStatus(ReplicaState.RUNNING)
    failed = ReplicaStatus(ReplicaState.FAILED, exit_code=-9)

    def polled(phase: str, status=running, at: float = NOW, restarts: int = 0) -> None:
        beat = Heartbeat(rank=0, phase=phase, updated_at=at)
        rep.update([ReplicaView(0, status, beat, restarts)])

    polled("done", at=NOW - 200)  # the stopped launch's
    for phase in ("starting", "training", "syncing", "training", "syncing", "healing"):
        polled(phase)
    polled("healing", failed)
    polled("starting", at=NOW + 1)
    polled("saving", at=NOW + 2)
    # restarted by the driver between two polls: its last heartbeat is the killed attempt's
    polled("training", at=NOW + 3, restarts=1)
    polled("starting", at=NOW + 4, restarts=1)
    assert out.getvalue().splitlines() == [
        "replica 0 starting: loading its model and data",
        "replica 0 training",
        "replica 0 healing: loading the newest global state",
        "replica 0 ended: failed (-9)",
        "replica 0 starting: loading its model and data",
        "replica 0 saving the trained model",
        "replica 0 starting: loading its model and data",
    ]


def test_plain_reporter_prints_rounds_that_closed_between_two_polls(tmp_path) -> None:
    """Short rounds close faster than the driver polls, and a heartbeat holds only the
    newest: the rounds in between are read from their records in the run store and printed
    in order; a resumed launch starts at its first round, an attached watcher at the round it
    first sees."""
    from crf import layout
    from crf.launcher.progress import round_records
    from crf.store import RunStore

    store = RunStore((tmp_path / "run").as_uri())
    for r in range(4):
        record = layout.RoundMetrics(round=r, rank=0, loss=0.1 * (r + 1), step=2 * (r + 1),
                                     sync_s=0.5)  # fmt: skip
        store.put_json(layout.metrics_key(0, r), record.to_dict())
    running = ReplicaStatus(ReplicaState.RUNNING)

    def shown(first: int | None, *last_rounds: int) -> list[str]:
        out = io.StringIO()
        rep = PlainReporter(Console(file=out, width=80), 8, round_records(store), first)
        for r in last_rounds:
            beat = _beat(0, "lm", last_round=r, step=2 * (r + 1), round_loss=0.1 * (r + 1))
            rep.update([ReplicaView(0, running, beat)])
        return [line.split(" step")[0] for line in out.getvalue().splitlines()]

    every = [f"replica 0 round {r} ({r + 1}/8)" for r in range(4)]
    assert shown(0, 1, 3) == every  # rounds 0 and 2 closed unseen
    assert shown(0, 3)[0].endswith("round 0 (1/8)")
    assert shown(2, 3) == every[2:]  # resumed: round 2 is its first
    assert shown(None, 2, 3) == every[2:]  # attached while round 2 was the newest
    text = io.StringIO()
    rep = PlainReporter(Console(file=text, width=80), 8, round_records(store), 0)
    rep.update([ReplicaView(0, running, _beat(0, "lm", last_round=2, step=6))])
    assert "replica 0 round 1 (2/8) step 4 loss 0.2000 sync 0.5s" in text.getvalue()
    # a record not there (yet): the round is left out, the newest still printed
    assert shown(0, 6) == [*every, "replica 0 round 6 (7/8)"]


def test_a_resumed_launch_prints_none_of_the_stopped_launchs_rounds(tmp_path) -> None:
    """A resumed launch continues from round 5: the stopped launch's heartbeats (still in
    the store until the new replicas write theirs) and a resumed replica's first one (which
    shows round 4, the round it continues from) print nothing; round 5 prints when it closes
    again, once."""
    started = NOW - 10
    out = io.StringIO()
    rep = PlainReporter(Console(file=out, width=80), 8, None, 5, started)
    running = ReplicaStatus(ReplicaState.RUNNING)

    def polled(**kw: Any) -> None:
        rep.update([ReplicaView(0, running, _beat(0, "lm", **kw))])

    polled(last_round=5, step=30, updated_at=started - 60)  # the stopped launch's
    polled(last_round=4, step=25, updated_at=started + 5)  # resumed: where it continues
    assert out.getvalue() == ""
    polled(last_round=5, step=30, updated_at=started + 9)
    polled(last_round=5, step=31, updated_at=started + 10)
    assert [line.split(" step")[0] for line in out.getvalue().splitlines()] == [
        "replica 0 round 5 (6/8)"
    ]


def test_plain_reporter_shows_the_step_a_round_closed_at() -> None:
    """A heartbeat is read a moment after its round closed, when the replica has trained on:
    the round's line shows the step the round closed at (as its record has it), not the one
    the replica has reached since; a heartbeat written before it said shows its step."""
    from crf import layout
    from crf.replica.rounds import heartbeat_fields

    record = layout.RoundMetrics(round=0, rank=1, loss=0.5, step=2, sync_s=0.1)
    beat = Heartbeat(rank=1, phase="training", step=3, **heartbeat_fields(record))
    out = io.StringIO()
    rep = PlainReporter(Console(file=out, width=80), rounds=2)
    running = ReplicaStatus(ReplicaState.RUNNING)
    rep.update([ReplicaView(1, running, beat)])
    rep.update([ReplicaView(0, running, _beat(0, "lm", last_round=0, step=7))])
    lines = [line for line in out.getvalue().splitlines() if " round " in line]
    assert lines[0] == "replica 1 round 0 (1/2) step 2 loss 0.5000 sync 0.1s"
    assert lines[1].startswith("replica 0 round 0 (1/2) step 7 ")  # an older heartbeat


def test_a_replica_log_gets_no_progress_bars() -> None:
    """A replica's output is a log file: the libraries' progress bars (transformers' "Writing
    model shards", datasets' map under TRL) are off in its process, unless its environment
    asks for them."""
    code = (
        "from crf.replica import logs; logs.configure('0')\n"
        "from datasets.utils import logging as d; import transformers.utils.logging as t\n"
        "print(d.is_progress_bar_enabled(), t.is_progress_bar_enabled())"
    )
    env = {k: v for k, v in _cli_env().items() if "PROGRESS_BARS" not in k}
    env["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "0"  # datasets' bars asked for; not the hub's
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.stdout.split() == ["True", "False"], proc.stderr


def test_heartbeat_round_fields_round_trip() -> None:
    beat = _beat(0, "composer", round_rejected=1)
    again = Heartbeat.from_dict(beat.to_dict())
    assert again == beat
    assert Heartbeat.from_dict({"rank": 2}).round_metrics == {}  # an old heartbeat


# ---------------------------------------------------------------------- --help at 80 columns
_HELP_ALL = r"""
import json, typer.main
from typer.testing import CliRunner
from crf.launcher.cli import app
group = typer.main.get_command(app)
out = {"": CliRunner().invoke(app, ["--help"]).output}
for name, cmd in group.commands.items():
    opts = [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    out[name] = {"help": CliRunner().invoke(app, [name, "--help"]).output, "opts": opts}
print(json.dumps(out))
"""


def _cli_env(columns: int = 80) -> dict[str, str]:
    return {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT)}


def _assert_help_whole(text: str, opts: list[str]) -> None:
    _assert_fits(text.splitlines())
    words = set(re.findall(r"-{1,2}[A-Za-z][\w-]*", text))
    missing = [o for o in opts if o not in words]
    assert not missing, f"option names not shown whole: {missing}\n{text}"


def test_launch_help_at_80_columns_cuts_nothing() -> None:
    """`crf launch --help` in an 80-column terminal: no line over 80, no "…", and every
    option name (aliases and negations included) whole."""
    from crf.launcher.cli import app

    launch = typer.main.get_command(app).commands["launch"]  # type: ignore[attr-defined]
    opts = [o for p in launch.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    assert "--fragment-sync-delay" in opts and "--gpu" in opts
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--help"],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    _assert_help_whole(proc.stdout, opts)


def test_every_help_at_80_columns_cuts_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_ALL],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    helps = json.loads(proc.stdout)
    _assert_fits(helps.pop("").splitlines())
    assert helps, "no commands"
    for name, h in helps.items():
        assert "Usage:" in h["help"], name
        _assert_help_whole(h["help"], h["opts"])


# ---------------------------------------------------------------------- a real run, piped
@pytest.mark.slow
def test_piped_launch_prints_a_line_per_replica_round(tmp_path: Path) -> None:
    """`crf launch` with its output piped (not a terminal) shows progress as it happens: a
    plain line for each replica's rounds and one when each replica ends - not one frame of
    a live table at the end."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "crf.launcher.cli", "launch", "--backend", "local",
            "--replicas", "2", "--job", "lm", "--sync-every", "2", "--rounds", "2",
            "--run-id", "piped", "--store", str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        env={**_cli_env(), "CRF_LOG_LEVEL": "WARNING"},
        cwd=tmp_path,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        # at least its last round (the heartbeat keeps the last finished round), never a
        # count that depends on how often the driver polled
        assert any(
            re.match(rf"replica {rank} round \d \(\d/2\) step \d+ loss \d", x) for x in lines
        )
        assert f"replica {rank} ended: succeeded" in lines
    assert "rank" in proc.stdout and "summary" in proc.stdout
    title = next(i for i, x in enumerate(lines) if x.rstrip().endswith(": summary"))
    _assert_fits(lines[title : title + 6])
