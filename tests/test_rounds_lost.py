"""``rounds_lost`` names the rounds a run reached that nobody committed, not the rounds a
cancelled or failed run never got to: "round(s) 2, 3, ..., 9 committed by nobody" under a run
cancelled in round 2 read as eight rounds of lost work."""

from __future__ import annotations

from crf.launcher.summary import run_problems


def _record(rnd: int, committed: bool) -> dict:
    return {"round": rnd, "committed": committed, "loss": 1.0}


def test_rounds_after_the_last_reached_are_not_lost() -> None:
    metrics = {0: [_record(0, True), _record(1, True)], 1: [_record(0, True)]}
    problems = run_problems([], [], metrics, rounds=10)
    assert problems["rounds_completed"] == 2
    assert problems["rounds_lost"] == []


def test_a_round_nobody_committed_is_lost_even_when_later_ones_were() -> None:
    metrics = {
        0: [_record(0, True), _record(1, False), _record(2, True), _record(3, False)],
        1: [_record(0, True), _record(1, False)],
    }
    problems = run_problems([], [], metrics, rounds=6)
    assert problems["rounds_completed"] == 2
    assert problems["rounds_lost"] == [1, 3]


def test_a_run_that_committed_nothing_lost_its_first_round() -> None:
    problems = run_problems([], [], {0: [], 1: []}, rounds=5)
    assert problems["rounds_lost"] == [0]
    assert run_problems([], [], {}, rounds=5)["rounds_lost"] is None


def test_a_cancel_after_every_replica_reported_ok_stopped_nothing() -> None:
    """Ctrl-C as the run ends: every replica had already reported its own ok result, so the
    run finished (a resume would train nothing); a cancel that stopped a replica, or one of
    a script that reports no result, is a cancelled run."""
    from crf.launcher.summary import run_status

    done = [{"ok": True, "reported_status": "ok"}, {"ok": True, "reported_status": "ok"}]
    assert run_status(done, {}, cancelled=True, error=None) == ("ok", None)
    stopped = [done[0], {"ok": False, "reported_status": None}]
    assert run_status(stopped, {}, cancelled=True, error=None)[0] == "cancelled"
    silent = [{"ok": True, "reported_status": None}] * 2  # exit 0, no result of its own
    assert run_status(silent, {}, cancelled=True, error=None)[0] == "cancelled"


def test_a_cancelled_run_s_replicas_missed_no_round_it_never_reached() -> None:
    """Cancelled in round 5 of 8: replica 0 committed rounds 0-5, replica 1 rounds 0-4 (it
    was still training round 5). Neither missed rounds 6 and 7, which the run never got
    to; replica 1 missed round 5, which replica 0 committed. Neither wrote a result: each
    one's loss is that of the last round it committed, as its records say."""
    from crf.executors.base import ReplicaHandle, ReplicaResult, ReplicaState
    from crf.launcher.summary import build_summary
    from crf.spec import RunSpec

    spec = RunSpec(run_id="c", run_uri="memory://c", replicas=2, rounds=8)
    metrics = {0: [_record(r, True) for r in range(6)], 1: [_record(r, True) for r in range(5)]}
    metrics[1][4]["loss"] = 0.5  # its last committed round's loss is its "loss"
    metrics[1].append({"round": 5, "committed": False, "loss": 9.0})  # not committed
    results = [
        ReplicaResult(
            handle=ReplicaHandle(
                backend="local",
                run_id="c",
                rank=rank,
                backend_id=str(rank),
                run_uri="memory://c",
                world_size=2,
            ),
            state=ReplicaState.CANCELLED,
            exit_code=None,
            result=None,
            error="cancelled",
        )  # fmt: skip
        for rank in (0, 1)
    ]
    summary = build_summary(spec=spec, results=results, started_at=0.0, cancelled=True,
                            metrics=metrics)  # fmt: skip
    assert [row["rounds_missed"] for row in summary["replicas"]] == [[], [5]]
    assert [row["final_loss"] for row in summary["replicas"]] == [1.0, 0.5]
    assert summary["bytes_up"] is None  # nobody reported it: unknown, not 0 bytes
    assert summary["rounds_lost"] == []


def test_a_replica_that_fails_right_after_a_round_still_records_it(tmp_path) -> None:
    """The round's last step synced (the round is committed), then the job failed before its
    ``log_step`` (the composer's held-out evaluation calls the rewards there): the round's
    record is still written, so the summary does not call it committed by nobody."""
    import json

    import pytest
    import torch

    from crf.replica.context import ReplicaContext
    from crf.spec import RunSpec
    from crf.store import RunStore

    store = RunStore(str(tmp_path / "run"))
    spec = RunSpec(run_id="run", run_uri=store.uri, replicas=1, sync_every=2, rounds=3)
    store.put("run.json", spec.to_json().encode())
    ctx = ReplicaContext(store, spec, 0, 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="the reward raised"), ctx, ctx.diloco(model, opt):
        while True:
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # the round's last step syncs here
            if ctx.step == 2:
                raise ValueError("the reward raised")
            ctx.log_step(loss=loss.item())
    record = json.loads((tmp_path / "run" / "metrics" / "0" / "0.json").read_text())
    assert record["committed"] is True and record["step"] == 2
    metrics = {0: [record]}
    assert run_problems([], [], metrics, rounds=3)["rounds_lost"] == []
