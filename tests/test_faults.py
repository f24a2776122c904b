"""Replicas die, the run goes on: kills at every point of a round, restarts, stragglers, bad
objects in the store, store errors, and two runs sharing one bucket.

Real replica processes of the lm job (tiny config) through the real driver; faults come from
``CRF_FAULT`` (a replica SIGKILLs itself at a named point, once per run) and from
tests/replica_shim.py (store errors, slowness, bad objects). Round deadlines are a few seconds
so a dead replica costs little wall time. Figures quoted in docs/faults.md are printed here
(``pytest -s``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from crf.exchange.contribution import read_manifest
from crf.executors.base import ExecutorError, ReplicaState
from crf.executors.local import LocalProcessExecutor
from crf.launcher.errors import LaunchError
from crf.layout import Rejection
from crf.store import RunStore, decode_tensor
from tests.fault_helpers import (
    baseline_wait,
    committed_rounds,
    describe,
    kill_fired,
    launch_lm,
    metrics,
    took_part,
    unexplained_attempts,
    worst_wait,
)
from tests.flaky_store import FaultPlan, install

# ---------------------------------------------------------------------- store errors (unit)


def test_a_single_failed_get_or_put_is_retried(tmp_path: Path) -> None:
    store = install(RunStore(f"file://{tmp_path}/run"), plan := FaultPlan())
    plan.fail_first = {"put": 1, "get": 1, "list": 1, "exists": 1}
    t0 = time.monotonic()
    store.put("a/b.json", b"{}")  # first PUT fails, its retry lands
    assert store.get("a/b.json") == b"{}"
    assert store.list("a") == ["b.json"]
    assert store.exists("a/b.json")
    assert plan.failures == 4
    assert time.monotonic() - t0 >= 4 * store.retry_backoff_s  # backed off before each retry
    # slow responses are only slow
    plan.slow_every, plan.slow_s = 1, 0.05
    assert store.put_if_absent("c", b"1") and not store.put_if_absent("c", b"2")
    assert store.get("c") == b"1" and plan.slowed >= 3


def test_a_store_that_stays_down_fails_within_a_bounded_time(tmp_path: Path) -> None:
    store = install(RunStore(f"file://{tmp_path}/run"), FaultPlan(down_from_key=""))
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match="store unreachable: GET x"):
        store.get("x")
    took = time.monotonic() - t0
    # 1 + 4 attempts, backing off 0.2 + 0.4 + 0.8 + 1.6 s in between
    assert 3.0 <= took < 4.5, took
    print(f"\n[figure] one request against a dead store gives up after {took:.2f}s")


# ---------------------------------------------------------------------- kills


def test_sigkill_at_every_point_never_blocks_the_others(tmp_path: Path) -> None:
    """A replica SIGKILLed during inner steps, while uploading, after the quorum, while it
    owns a shard, and after reducing (five replicas, one point each): the others close each
    round by its deadline (plus the shard grace period when a dead participant owned a
    shard), the driver restarts the dead one, it resumes from the newest global state and
    rejoins, and all end bit-identical. How fast a restart comes back depends on the machine
    (5-25 s on a loaded 2-core one), and the others do not wait for a dead replica after the
    round it died in: the test asserts what holds whatever the timing."""
    # every round takes >= 1.2 s (everyone sleeps 0.3 s a step), so on a quiet machine a
    # restart comes back while the run goes on and commits later rounds
    n, h, rounds, deadline = 5, 4, 18, 2.5
    everyone = {"rank": "*", "from_step": 0, "to_step": 10**6, "sleep_s": 0.3}
    kills = {  # (rank, point) -> round it dies in; each rank dies once
        (1, "inner_step"): 1,
        (2, "uploading"): 3,
        (3, "after_quorum"): 5,
        (0, "owning_shard"): 7,  # rank 0 is also the round's global/<r> writer
        (4, "after_reduce"): 9,
    }
    faults = ";".join(
        f"rank={rank},point={point},step={r * h + 2}"
        if point == "inner_step"
        else f"rank={rank},point={point},round={r}"
        for (rank, point), r in kills.items()
    )
    summary = launch_lm(
        tmp_path / "runs",
        "kills",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=deadline,
        env={"CRF_FAULT": faults, "CRF_TEST_SLOW": json.dumps(everyone)},
        shim=True,
        max_restarts=2,
        max_run_restarts=10,
    )
    run = tmp_path / "runs" / "kills"
    print("\n" + describe(summary))
    assert summary["status"] == "ok", describe(summary)
    assert summary["weights_identical"] is True
    assert summary["rounds_completed"] == rounds and summary["rounds_lost"] == []
    assert summary["objects_rejected"] == 0
    for row in summary["replicas"]:  # every attempt that ended was a kill or said why
        assert not unexplained_attempts(row), row

    grace = min(30.0, deadline)
    # a round's worst case: the deadline for a contribution that never comes, then a grace
    # period for a dead owner's shard (and one more for a part uploaded late after a
    # degraded quorum moved its shard), plus slack for a loaded 2-core machine
    bound = deadline + 2 * grace + 1.5
    fired = 0
    for (rank, point), r in kills.items():
        row = summary["replicas"][rank]
        if not kill_fired(run, rank, point):
            # the only way a replica alive from the start misses its kill: it was not in
            # that round (late on a loaded machine, it caught up or healed past it)
            assert not took_part(run, rank, r), (rank, point, metrics(run, rank).get(r))
            print(f"[figure] kill {point:13s} (rank {rank}, round {r}): not in that round")
            continue
        fired += 1
        # the summary says when it died; it was restarted, and it came back and committed
        # later rounds - or, a restart slower than the rest of the run, came back after the
        # others finished and took the final global state: either way it ends as they do.
        # (It may even redo its death round: a dead lowest participant left no global/<r>,
        # so its restart resumes from global/<r-1> and commits round r from the shards.)
        assert any(a["round"] == r and a["exit_code"] == -9 for a in row["attempts"]), row
        assert row["restarts"] >= 1, row
        rejoined = any(c > r for c in committed_rounds(run, rank))
        assert rejoined or row["resumed_from"] == rounds - 1, (rank, point, row)
        # the others: their wait in the kill round is bounded by the round deadline (a
        # contribution that never came) plus the shard grace (a shard nobody reduced)
        others = [k for k in range(n) if k != rank]
        wait = worst_wait(run, others, {r})
        print(f"[figure] kill {point:13s} (rank {rank}, round {r}): others waited {wait:.2f}s")
        assert wait <= bound, (point, wait)
    assert fired >= 1 and summary["restarts"] >= fired, describe(summary)
    worst = worst_wait(run, range(n))
    print(
        f"[figure] {fired} of {len(kills)} kills fired and survived; worst wait in a committed "
        f"round {worst:.2f}s (deadline {deadline}s, grace {grace}s); "
        f"{summary['contributions_left_out']} dead replicas' parts left out"
    )
    assert worst <= bound


def test_two_level_rounds_survive_a_dead_member_and_a_dead_leader(tmp_path: Path) -> None:
    """``--reduce-group-size 2`` with 4 real replica processes (groups {0, 1} and {2, 3}):
    rank 1 dies after round 1's quorum, before publishing its group's sum of slice 1 (slice
    1's leader computes that sum from the contributions after the grace period), and rank 3,
    round 3's leader of slice 1 (member 1 of group 3 mod 2), dies while publishing that slice
    (a gatherer computes it from the group sums). Both are restarted, resume and rejoin; the
    run commits every round and every replica ends with the same bits."""
    n, h, rounds, deadline = 4, 3, 6, 2.5
    kills = {(1, "after_quorum"): 1, (3, "owning_shard"): 3}
    summary = launch_lm(
        tmp_path / "runs",
        "groups",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=deadline,
        env={"CRF_FAULT": ";".join(f"rank={k},point={p},round={r}" for (k, p), r in kills.items())},
        max_restarts=2,
        max_run_restarts=10,
        reduce_group_size=2,
    )
    run = tmp_path / "runs" / "groups"
    print("\n" + describe(summary))
    assert summary["status"] == "ok", describe(summary)
    assert summary["weights_identical"] is True
    assert summary["rounds_completed"] == rounds and summary["rounds_lost"] == []
    assert summary["objects_rejected"] == 0
    # two levels ran (in a round still in the store: on a loaded machine a round may be
    # decided by fewer than G + 1 replicas, which one level reduces)
    assert any((d / "partial").is_dir() for d in (run / "rounds").iterdir())
    for row in summary["replicas"]:
        assert not unexplained_attempts(row), row
    grace = min(30.0, deadline)
    for (rank, point), r in kills.items():
        if not kill_fired(run, rank, point):  # late on a loaded machine: not in that round
            assert not took_part(run, rank, r), (rank, point, metrics(run, rank).get(r))
            continue
        row = summary["replicas"][rank]
        assert any(a["round"] == r and a["exit_code"] == -9 for a in row["attempts"]), row
        # the others closed that round within the deadline and two grace periods (a late
        # group sum, then a missing slice), plus slack for a loaded 2-core machine
        wait = worst_wait(run, [k for k in range(n) if k != rank], {r})
        print(f"[figure] two levels, kill {point} (rank {rank}, round {r}): others {wait:.2f}s")
        assert wait <= deadline + 2 * grace + 1.5, (point, wait)


def test_restart_policy_caps_and_reports(tmp_path: Path) -> None:
    """--max-restarts 0: a killed replica stays dead, the others finish without it, and the
    summary says why it was not restarted (the run is then failed, not silently ok)."""
    summary = launch_lm(
        tmp_path / "runs",
        "capped",
        replicas=2,
        sync_every=3,
        rounds=4,
        # long enough that a loaded machine's slow start does not leave rank 0 out of round 0
        # (rank 1 deciding it alone at the deadline); the dead replica costs one deadline
        round_timeout_s=10.0,
        env={"CRF_FAULT": "rank=1,point=uploading,round=1"},
        max_restarts=0,
    )
    print("\n" + describe(summary))
    ok, dead = summary["replicas"]
    assert summary["status"] == "failed" and summary["restarts"] == 0
    assert ok["ok"] and ok["rounds_committed"] == 4 and ok["rounds_missed"] == []
    assert dead["exit_code"] == -9 and "killed by SIGKILL" in dead["error"]
    assert "--max-restarts" in dead["not_restarted"]
    assert dead["rounds_missed"] == [1, 2, 3]


def test_a_dead_replica_costs_one_deadline_per_run_not_one_per_round(tmp_path: Path) -> None:
    """Rank 3 of 4 is SIGKILLed in round 1 before its upload and never restarted. Round 1
    waits its deadline for it; later rounds do not: it was no member of round 1 and its
    heartbeat stopped, so each later round is decided as soon as the three live replicas
    arrived ("all live arrived", rank 3 recorded as not waited for). One permanent death
    adds one round deadline to the run, not one per round."""
    n, h, rounds, deadline = 4, 4, 5, 10.0
    summary = launch_lm(
        tmp_path / "runs",
        "dead",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=deadline,
        env={"CRF_FAULT": "rank=3,point=uploading,round=1"},
        max_restarts=0,
        keep_rounds=100,  # keep every round's decision to read it
    )
    run = tmp_path / "runs" / "dead"
    print("\n" + describe(summary))
    assert summary["status"] == "failed" and summary["replicas"][3]["exit_code"] == -9
    survivors = [0, 1, 2]
    for k in survivors:
        assert summary["replicas"][k]["ok"], describe(summary)
        assert committed_rounds(run, k) == list(range(rounds)), metrics(run, k)
    assert len({summary["replicas"][k]["weights_sha256"] for k in survivors}) == 1
    # the wait the death added to the run, per survivor: its exchanges from round 1 on
    # (round 0 holds start-up skew). Without liveness this is ~(rounds - 1) deadlines
    added = max(sum(m["sync_s"] for r, m in metrics(run, k).items() if r >= 1) for k in survivors)
    print(
        f"[figure] one permanent death (round 1 of {rounds}, deadline {deadline:.0f}s): "
        f"the survivors' exchanges took {added:.2f}s in all from round 1 on"
    )
    assert added < deadline + 0.5 * deadline, added
    quorum = {
        r: json.loads((run / "rounds" / str(r) / "quorum.json").read_text()) for r in range(rounds)
    }
    assert quorum[1]["participants"] == survivors and quorum[1]["reason"] == "deadline"
    for r in range(2, rounds):  # decided once the live ones were in, nobody waited for 3
        assert quorum[r]["participants"] == survivors, quorum[r]
        assert quorum[r]["reason"] == "all live arrived", quorum[r]
        assert quorum[r]["not_waited_for"] == [3], quorum[r]


def test_a_death_after_the_quorum_costs_one_wait(tmp_path: Path) -> None:
    """Rank 0 of 3 is SIGKILLed after round 2's quorum and never restarted. The survivors
    wait the shard grace in round 2 for the shard it owned, and nothing more in round 3:
    though it was a member of round 2, it has no contribution to round 3 and its heartbeat
    is older than the freshness window by then, so round 3 is decided as soon as the two
    live replicas arrived ("all live arrived", rank 0 not waited for)."""
    n, h, rounds, deadline = 3, 3, 5, 8.0
    summary = launch_lm(
        tmp_path / "runs",
        "quiet",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=deadline,
        env={"CRF_FAULT": "rank=0,point=after_quorum,round=2"},
        max_restarts=0,
        keep_rounds=100,  # keep every round's decision to read it
    )
    run = tmp_path / "runs" / "quiet"
    print("\n" + describe(summary))
    assert summary["replicas"][0]["exit_code"] == -9 and kill_fired(run, 0, "after_quorum")
    survivors = [1, 2]
    for k in survivors:
        assert summary["replicas"][k]["ok"], describe(summary)
        assert committed_rounds(run, k) == list(range(rounds)), metrics(run, k)
    assert len({summary["replicas"][k]["weights_sha256"] for k in survivors}) == 1
    grace = min(30.0, deadline)
    in_kill_round = worst_wait(run, survivors, {2})
    after = worst_wait(run, survivors, set(range(3, rounds)))
    print(
        f"[figure] a death after round 2's quorum (deadline {deadline:.0f}s, grace "
        f"{grace:.0f}s): the survivors waited {in_kill_round:.2f}s in round 2, at most "
        f"{after:.2f}s in a round after it"
    )
    assert in_kill_round >= grace - 0.5, in_kill_round  # its shard waited for its owner
    assert after < 0.5 * deadline, after  # no second wait: a deadline before
    quorum = {
        r: json.loads((run / "rounds" / str(r) / "quorum.json").read_text()) for r in range(rounds)
    }
    assert 0 in quorum[2]["participants"], quorum[2]
    for r in range(3, rounds):
        assert quorum[r]["participants"] == survivors, quorum[r]
        assert quorum[r]["reason"] == "all live arrived", quorum[r]
        assert quorum[r]["not_waited_for"] == [0], quorum[r]


def test_a_restarted_replica_is_waited_for_again_and_rejoins(tmp_path: Path) -> None:
    """Rank 2 of 3 is SIGKILLed in round 1 and restarted. While it is down the others go on
    without it (no deadline per round); once its restart resumed, its heartbeat makes the
    others wait for it again and it takes part in the rounds up to the last one. Every
    round takes >= 1.6 s (everyone sleeps 0.4 s a step), 45 s in all, so the restart, which
    needs 5-25 s to start on a 2-core machine (quiet to loaded), comes back with rounds to
    spare."""
    n, h, rounds, deadline = 3, 4, 28, 3.0
    everyone = {"rank": "*", "from_step": 0, "to_step": 10**6, "sleep_s": 0.4}
    summary = launch_lm(
        tmp_path / "runs",
        "back",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=deadline,
        env={"CRF_FAULT": "rank=2,point=uploading,round=1", "CRF_TEST_SLOW": json.dumps(everyone)},
        shim=True,
        max_restarts=1,
    )
    run = tmp_path / "runs" / "back"
    print("\n" + describe(summary))
    assert summary["status"] == "ok" and summary["restarts"] == 1, describe(summary)
    assert summary["weights_identical"] is True
    assert summary["rounds_completed"] == rounds and summary["rounds_lost"] == []
    back = committed_rounds(run, 2)
    # it rejoined: it committed rounds after its death, the last one among them
    assert any(r > 1 for r in back) and rounds - 1 in back, back
    joined = min(r for r in back if r > 1)
    # the others waited one deadline for the dead replica (round 1) and, when it came back,
    # for it to catch up (less than a deadline): never a deadline per round while it was down
    added = max(sum(m["sync_s"] for r, m in metrics(run, k).items() if r >= 1) for k in (0, 1))
    print(
        f"[figure] killed in round 1, restarted, rejoined in round {joined}: the others' "
        f"exchanges took {added:.2f}s in all from round 1 on (deadline {deadline:.0f}s)"
    )
    assert added < 2 * deadline + 0.5 * deadline, added


def test_executor_relaunches_one_rank(tmp_path: Path) -> None:
    """relaunch() starts the same rank with the same command and environment (kept in memory
    only: it may hold credentials), appending to the same log; ranks= starts a subset."""
    code = (
        "import os; print('hi'); open(os.environ['OUT'] + os.environ['CRF_RANK'], 'a').write('x')"
    )
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    env = {"OUT": str(tmp_path / "out-"), "MY_SECRET": "s3cr3t"}
    uri = f"file://{tmp_path}/runs/r"
    (h,) = ex.launch_replicas(3, [sys.executable, "-c", code], env=env, run_uri=uri, ranks=[1])
    assert (h.rank, h.world_size, h.extra.get("attempt", 0)) == (1, 3, 0)
    assert ex.wait([h], timeout=30)
    again = ex.relaunch(h)
    assert (again.rank, again.extra["attempt"]) == (1, 1) and again.backend_id != h.backend_id
    assert ex.wait([again], timeout=30) and ex.status(again).state is ReplicaState.SUCCEEDED
    assert (tmp_path / "out-1").read_text() == "xx" and not (tmp_path / "out-0").exists()
    log = (tmp_path / "logs" / "replica-1.log").read_text().splitlines()
    assert log[0] == "hi" and "replica 1 started again" in log[1] and log[2] == "hi", log
    assert "s3cr3t" not in json.dumps([h.to_dict(), again.to_dict()])
    with pytest.raises(ExecutorError, match=r"rank 3 is not in \[0, 3\)"):
        ex.launch_replicas(3, [sys.executable, "-c", code], run_uri=uri, ranks=[3])
    with pytest.raises(ExecutorError, match="not launched by this executor"):
        LocalProcessExecutor().relaunch(h)


def test_an_attempt_that_was_not_restarted_is_not_counted_as_a_restart() -> None:
    """A replica whose one failed attempt was recorded but never restarted (the run folder
    refused writes, or its relaunch failed) has no restart line: the summary said 'restarted
    1 time(s)' above 'not restarted: the run folder refuses writes'."""
    from rich.console import Console

    from crf.launcher.summary import print_restarts

    attempt = {"attempt": 0, "message": "exited with code 1", "round": 11, "phase": "syncing"}
    console = Console(record=True, width=150)
    print_restarts([{"rank": 0, "restarts": 0, "attempts": [attempt]}], console)
    print_restarts([{"rank": 1, "restarts": 1, "attempts": [attempt, attempt]}], console)
    text = console.export_text()
    assert "replica 0 restarted" not in text
    assert "replica 1 restarted 1 time(s): attempt 0 exited with code 1 in round 11" in text


def test_a_death_on_a_store_error_is_its_line_not_its_traceback() -> None:
    """A replica that died raising (its store out of reach: it could write no result) is
    summed up by its exception's line, whatever the class is called, and the summary shows
    the log's lines before the traceback, not the traceback."""
    from rich.console import Console

    from crf.executors.base import ReplicaHandle, ReplicaResult, ReplicaState
    from crf.launcher.summary import print_failures, replica_row

    error = (
        "crf.store.s3.S3Unreachable: cannot reach the S3 endpoint for s3://b (endpoint: "
        "http://127.0.0.1:9): check AWS_ENDPOINT_URL"
    )
    tail = [
        "2026-11-30 00:03:14,424 [replica 0] INFO crf.replica: round 11 committed",
        "2026-11-30 00:03:14,424 [replica 0] ERROR crf.replica: replica failed",
        "Traceback (most recent call last):",
        '  File "/x/crf/layout.py", line 381, in global_rounds',
        "    rounds = numbered(store.list(GLOBAL))",
        "                      ^^^^^^^^^^^^^^^^^^",
        '  File "/x/crf/store/run_store.py", line 349, in _raise_explained',
        "    raise explained from None",
        error,
    ]
    handle = ReplicaHandle(
        backend="local", run_id="r", rank=0, backend_id="1", run_uri="file:///x", world_size=2,
        log_path="/x/r0.log",
    )  # fmt: skip
    res = ReplicaResult(handle, ReplicaState.FAILED, 1, None, "exited with code 1")
    row = replica_row(res, tail)
    cut = replica_row(res, tail[5:])  # a tail that begins inside the traceback
    assert row["error"] == f"exited with code 1: {error}"
    console = Console(record=True, width=400)
    print_failures({"replicas": [row, cut]}, console)
    text = console.export_text()
    assert error in text and "round 11 committed" in text and "log: /x/r0.log" in text
    assert "Traceback" not in text and "File " not in text and "^^^" not in text


def test_fault_columns_in_tables() -> None:
    """The summary table grows missed/restarts/rejected columns once something happened; the
    live table a restarts column once a replica was restarted."""
    from rich.console import Console

    from crf.executors.base import ReplicaStatus
    from crf.launcher.progress import ReplicaView, render_progress
    from crf.launcher.summary import render_summary

    row = {
        "rank": 0,
        "state": "succeeded",
        "exit_code": 0,
        "ok": True,
        "rounds_committed": 3,
        "rounds_missed": [1],
        "restarts": 1,
        "objects_rejected": 2,
        "resumed_from": 0,
        "syncs_caught_up": [2],
        "attempts": [{"attempt": 0, "message": "killed by SIGKILL", "round": 1, "phase": "x"}],
    }
    summary = {
        "run_id": "t",
        "rounds": 4,
        "replicas": [row],
        "status": "ok",
        "weights_identical": True,
        "restarts": 1,
        "rejected_objects": ["rounds/1/contrib/1/0", "rounds/2/contrib/1/0"],
    }
    console = Console(record=True, width=150)
    render_summary(summary, console)
    text = console.export_text()
    assert all(col in text for col in ("missed", "restarts", "rejected", "3/4"))
    assert "replica 0 restarted 1 time(s): attempt 0 killed by SIGKILL in round 1" in text
    assert "2 object(s) rejected (never averaged): rounds/1/contrib/1/0" in text
    assert "1 restart(s)" in text
    assert "replica 0 was late for exchange round(s) 2 and took the published average" in text
    view = ReplicaView(0, ReplicaStatus(ReplicaState.RUNNING), None)
    for restarts, shown in ((0, False), (2, True)):
        view.restarts = restarts
        console = Console(record=True, width=150)
        console.print(render_progress([view], run_id="t", rounds=4, sync_every=2, elapsed_s=1))
        assert ("restarts" in console.export_text()) is shown


# ---------------------------------------------------------------------- stragglers


@pytest.mark.parametrize(
    ("sleep_s", "keep_rounds", "checkpoint_every"),
    [(1.0, 3, 1), (3.0, 2, 1), (3.0, 2, 100)],
    ids=["behind-by-a-round", "behind-past-garbage-collection", "past-gc-no-periodic-globals"],
)
def test_straggler_does_not_stall_the_others_and_rejoins(
    tmp_path: Path, sleep_s: float, keep_rounds: int, checkpoint_every: int
) -> None:
    """Rank 2 is made slow in round 2 (its 4 inner steps take ``sleep_s`` more each, deadline
    2 s): the others close round 2 at the deadline without it. A few seconds late, it takes
    round 2's published average - or, if the others decided a later round meanwhile, heals
    from the newest global state - and takes part in the later rounds again, ending with the
    same weights. Whether it catches up in round 2 only, or in round 3 too, or heals, depends
    on how the machine schedules the replicas: the test asserts what must hold in every case.
    In the other cases it lags so far that its round's folder was garbage-collected: it must
    still catch up, never decide a quorum of its own for a round the others committed long
    ago - also when global states are written only at the end and on request
    (``checkpoint_every`` 100): a later round in the store tells it that it is behind, and it
    asks for a global state under heal/. The others wait for it at most in round 2 (its
    deadline) and round 3 (while its fresh heartbeat says it is one round behind), never in
    later rounds while it is far behind: every round takes >= 1 s (everyone sleeps 0.25 s a
    step), so the ~12 s straggler wakes with rounds to spare."""
    n, h, rounds, deadline = 3, 4, 16, 2.0
    slow = [
        {"rank": "*", "from_step": 0, "to_step": 10**6, "sleep_s": 0.25},
        {"rank": 2, "from_step": 2 * h + 1, "to_step": 3 * h, "sleep_s": sleep_s},
    ]
    summary = launch_lm(
        tmp_path / "runs",
        "straggler",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=deadline,
        env={"CRF_TEST_SLOW": json.dumps(slow)},
        shim=True,
        keep_rounds=keep_rounds,
        checkpoint_every=checkpoint_every,
    )
    run = tmp_path / "runs" / "straggler"
    print("\n" + describe(summary))
    assert summary["status"] == "ok" and summary["restarts"] == 0
    assert summary["weights_identical"] is True
    assert summary["rounds_completed"] == rounds and summary["rounds_lost"] == []
    straggler = summary["replicas"][2]
    result = json.loads((run / "results" / "2.json").read_text())
    healed = [r for r, m in metrics(run, 2).items() if m.get("healed_from") is not None]
    caught_up = result["syncs_caught_up"]
    # round 2 is the one it was late for: it either took round 2's average or healed
    assert 2 in caught_up or 2 in straggler["rounds_missed"], (caught_up, straggler)
    if 2 in straggler["rounds_missed"]:
        assert healed, metrics(run, 2)
    if checkpoint_every > 1:  # globals: on request and the last round's, not every round
        globals_ = sorted(int(n) for n in os.listdir(run / "global"))
        assert rounds - 1 in globals_ and len(globals_) < rounds, globals_
        assert not (run / "heal").exists() or not os.listdir(run / "heal")
    # from the round it was late for on, it never committed a round alone (that would fork
    # the weights until it healed). Before that it is not a straggler: on a loaded machine
    # the replicas' start can be further apart than the 2 s deadline, so any of them, rank 2
    # included, may decide round 0 alone and the others catch up on it
    for r, m in metrics(run, 2).items():
        assert r < 2 or not m["committed"] or m["participants"] != [2], (r, m)
    if keep_rounds == 2:  # ~12 s late: round 2's folder was gone, it saw it was behind
        late = metrics(run, 2).get(2)  # none: it started later still and healed past it
        assert (late is None and healed) or late["participants"] == [], (late, healed)
    # it rejoined: it took part in the last rounds, not forever one behind
    assert rounds - 1 in committed_rounds(run, 2) and rounds - 2 in committed_rounds(run, 2)
    others = [0, 1]
    wait = worst_wait(run, others)
    # what the straggler cost the others in all, beyond a round's own exchange: the deadline
    # of round 2, at most one more in round 3 (while its heartbeat says it is one round
    # behind), and, when it comes back, the wait for it to catch up (less than a deadline)
    # - not a deadline in every round while it is far behind
    base = baseline_wait(run, others)
    added = max(
        sum(m["sync_s"] - base for r, m in metrics(run, k).items() if r >= 1) for k in others
    )
    print(
        f"[figure] straggler ({4 * sleep_s:.0f}s late, missed {straggler['rounds_missed']}, "
        f"caught up {caught_up}): the others' worst wait in a round {wait:.2f}s, "
        f"{added:.2f}s added in all (deadline {deadline}s)"
    )
    assert wait <= deadline + 1.5
    assert added <= 3 * deadline + 2.0, added
    assert summary["replicas"][0]["rounds_missed"] in ([], [0])  # round 0: start-up skew only


# ---------------------------------------------------------------------- bad objects

BAD = [  # (rank that publishes it, round, kind, what the reader says)
    (1, 1, "truncate", "truncated"),
    (2, 2, "bitflip", "checksum mismatch"),
    (1, 3, "shape", "does not match"),
    (2, 4, "foreign_run", "another-run"),
    (0, 5, "old_round", "'round': 4"),
]


def test_bad_objects_are_rejected_reported_and_never_averaged(tmp_path: Path) -> None:
    """Each replica publishes a bad part of a shard (truncated, bit-flipped, wrong shape,
    another run's, an old round's): the shard's owner detects it, leaves it out of that
    shard's average (the published reduced shard lists the parts it used), reports it in its
    per-round metrics and result, and the driver's summary lists every bad object. The round
    still commits, every replica applies the same reduced shards, and weights stay identical."""
    n, h, rounds = 3, 3, 8
    corrupt = [{"rank": rank, "round": r, "kind": kind} for rank, r, kind, _ in BAD]
    summary = launch_lm(
        tmp_path / "runs",
        "bad",
        replicas=n,
        sync_every=h,
        rounds=rounds,
        round_timeout_s=20.0,
        env={"CRF_TEST_CORRUPT": json.dumps(corrupt)},
        shim=True,
        keep_rounds=100,  # keep every round's objects, to check what was averaged
    )
    run = tmp_path / "runs" / "bad"
    print("\n" + describe(summary))
    assert summary["status"] == "ok" and summary["weights_identical"] is True
    bad_keys = [f"rounds/{r}/contrib/{rank}#{(rank + 1) % n}" for rank, r, _, _ in BAD]
    assert summary["objects_rejected"] == len(BAD)
    assert summary["rejected_objects"] == bad_keys
    assert summary["rounds_lost"] == [] and summary["rounds_completed"] == rounds
    for (rank, r, kind, said), key in zip(BAD, bad_keys, strict=True):
        shard = (rank + 1) % n  # its owner in a full quorum is the replica of that rank
        owner = summary["replicas"][shard]
        # detected and reported: in the owner's per-round metrics and in its result
        m = metrics(run, shard)[r]
        assert m["committed"] is True
        said_there = [str(Rejection.from_dict(x)) for x in m["rejected"]]
        assert any(key in x and said in x for x in said_there), (kind, m["rejected"])
        assert any(key in x for x in owner["rejected"]), (kind, owner["rejected"])
        # never averaged: the published shard (the one every replica applies) left it out
        _, header = decode_tensor((run / "rounds" / str(r) / "reduced" / str(shard)).read_bytes())
        assert header["participants"] == sorted(set(range(n)) - {rank}), (kind, header)
        assert not (run / "rounds" / str(r) / "failed.json").exists()
    for r in range(rounds):  # every other shard of every round was averaged over everyone
        for s in range(n):
            _, header = decode_tensor((run / "rounds" / str(r) / "reduced" / str(s)).read_bytes())
            if (r, s) not in {(br, (rank + 1) % n) for rank, br, _, _ in BAD}:
                assert header["participants"] == [0, 1, 2], (r, s, header)
            assert header["run_id"] == "bad"
    print(
        f"[figure] {len(BAD)} bad objects published, {summary['objects_rejected']} rejected; "
        f"a fault-free round's exchange takes {baseline_wait(run, range(n)):.3f}s (median)"
    )


# ---------------------------------------------------------------------- store errors (e2e)


def test_store_errors_in_replicas(tmp_path: Path) -> None:
    """Every replica's store fails one request in 13 and stalls one in 17 for 0.2 s: no
    replica dies of it. Rank 1's store then goes down for good (from its round-3 upload): it
    ends with a clear error in bounded time and the others finish without it."""
    flaky = {
        "*": {"fail_every": 13, "slow_every": 17, "slow_s": 0.2},
        "1": {"fail_every": 13, "down_from_key": "rounds/3/contrib"},
    }
    summary = launch_lm(
        tmp_path / "runs",
        "flaky",
        replicas=3,
        sync_every=4,
        rounds=6,
        round_timeout_s=3.0,
        env={"CRF_TEST_FLAKY": json.dumps(flaky)},
        shim=True,
        max_restarts=0,
    )
    run = tmp_path / "runs" / "flaky"
    print("\n" + describe(summary))
    rows = summary["replicas"]
    logs = {k: (run / "logs" / f"replica-{k}.log").read_text() for k in range(3)}
    for k in (0, 2):
        assert rows[k]["ok"] and rows[k]["rounds_committed"] == 6, rows[k]
        report = [line for line in logs[k].splitlines() if "failed," in line][-1]
        failed = int(report.split(" failed")[0].rsplit(" ", 1)[-1])
        assert failed >= 10, report  # many single failures, all survived
        print(f"[figure] rank {k}: {report.split('; exit')[0]}")
    assert rows[0]["weights_sha256"] == rows[2]["weights_sha256"]
    dead = rows[1]
    assert summary["status"] == "failed" and dead["exit_code"] == 1
    # a clear error: the summary names the exception that ended it, not just the exit code
    assert "store unreachable" in dead["error"], dead["error"]
    down = float(logs[1].split("store unreachable from now on (t=")[1].split(")")[0])
    ended = float(logs[1].split("; exit at t=")[1].split()[0])
    print(f"[figure] store down for good: the replica ended {ended - down:.1f}s later")
    assert ended - down < 60, ended - down


# ---------------------------------------------------------------------- two runs, one bucket


def test_two_runs_in_one_bucket_never_see_each_other(tmp_path: Path) -> None:
    """Two runs at once in one store, one id a prefix of the other: each sees only its own
    objects (every object carries its run id), and neither run folder can be launched over."""
    base = tmp_path / "bucket"
    out: dict[str, dict] = {}

    def go(run_id: str, seed: int) -> None:
        out[run_id] = launch_lm(
            base, run_id, replicas=2, sync_every=3, rounds=3, round_timeout_s=20.0, seed=seed
        )

    threads = [threading.Thread(target=go, args=a) for a in (("exp", 1), ("exp-2", 2))]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert sorted(p.name for p in base.iterdir()) == ["exp", "exp-2"]
    for run_id in ("exp", "exp-2"):
        s = out[run_id]
        assert s["status"] == "ok" and s["weights_identical"] and s["objects_rejected"] == 0
        run = base / run_id
        assert json.loads((run / "run.json").read_text())["run_id"] == run_id
        for path in run.glob("rounds/*/quorum.json"):
            assert json.loads(path.read_text())["run_id"] == run_id
        store = RunStore(f"file://{run}")
        for path in run.glob("rounds/*/contrib/[0-9]*"):
            key = str(path.relative_to(run))
            assert read_manifest(store, key)["run_id"] == run_id
        for path in run.glob("rounds/*/reduced/[0-9]*"):
            assert decode_tensor(path.read_bytes())[1]["run_id"] == run_id
    assert out["exp"]["weights_sha256"] != out["exp-2"]["weights_sha256"]

    before = {p: p.read_bytes() for p in (base / "exp").rglob("*") if p.is_file()}
    with pytest.raises(LaunchError, match="already holds a run.*already finished"):
        launch_lm(base, "exp", replicas=2, sync_every=3, rounds=3, round_timeout_s=20.0)
    assert {p: p.read_bytes() for p in (base / "exp").rglob("*") if p.is_file()} == before
