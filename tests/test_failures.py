"""Restarts are for deaths: which failures a replica and the driver treat as bugs.

- a replica's own classification (crf/replica/failures.py): an error in setup or a reward's
  own is deterministic, a machine's or network's is not;
- the driver (``Supervisor``): a replica that failed before its first committed round with
  a deterministic error, or with the error another replica (or its own earlier attempt)
  failed with, ends the run; a death or a repeated outage restarts as the policy allows;
- the summary: committed rounds, not planned ones, and how each replica ended.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from crf import layout
from crf.executors.base import ReplicaHandle, ReplicaResult, ReplicaState, ReplicaStatus
from crf.launcher.plan import RestartPolicy
from crf.launcher.summary import _rounds_text, replica_row
from crf.launcher.supervise import Supervisor
from crf.replica.context import ContractError
from crf.replica.failures import deterministic, one_line, stops_run, transient
from crf.replica.rewards import RewardFailed
from crf.store import RunStore, StoreTimeout


def _raised_from(outer: type[BaseException], inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer("wrapped") from e
    except BaseException as e:  # noqa: BLE001 - the chained error itself
        return e


def _compiler(message: str) -> BaseException:
    """A generation's compile failure as ``generate`` raises it: dynamo's wrapper of the
    backend's (inductor's) error."""
    from torch._dynamo.exc import BackendCompilerFailed

    inner = RuntimeError(message)
    return BackendCompilerFailed(lambda *a: None, inner, None)


@pytest.mark.parametrize(
    ("error", "phase", "expected"),
    [
        (KeyError("completion"), "starting", True),  # building the trainer: the input
        (ValueError("chat_template is not set"), "starting", True),
        (FileNotFoundError("train.jsonl"), "starting", True),  # a file of the run's own
        (ConnectionError("reset"), "starting", False),  # the network
        (OSError("Read timed out"), "starting", False),
        (MemoryError(), "starting", False),
        (RuntimeError("CUDA out of memory"), "starting", False),
        (StoreTimeout("store down"), "starting", False),
        (KeyError("x"), "training", False),  # later on: only a repeat says it is a bug
        (ContractError("hook.step() after hook.done"), "training", True),  # a misused hook
        (_raised_from(RewardFailed, KeyError("answer")), "training", True),
        (_raised_from(RewardFailed, ConnectionError("api")), "training", False),
        (_compiler("Failed to find C compiler. Please specify via CC"), "training", True),
        (_compiler("CUDA out of memory"), "training", False),  # the GPU's memory, this time
    ],
)
def test_what_a_replica_counts_as_deterministic(
    error: BaseException, phase: str, expected: bool
) -> None:
    assert deterministic(error, phase=phase) is expected
    if not expected and phase == "starting":
        assert transient(error)


def test_a_rewards_own_error_stops_the_run_at_any_round() -> None:
    assert stops_run(_raised_from(RewardFailed, KeyError("label")))
    assert not stops_run(_raised_from(RewardFailed, ConnectionError("judge")))  # the network
    assert not stops_run(KeyError("x"))  # only a repeat says it is a bug


def test_one_line_keeps_the_first_line() -> None:
    assert one_line(ValueError("bad row\nmore detail")) == "ValueError: bad row"


class _Executor:
    """Replicas whose status the test sets; counts relaunches and cancels."""

    name = "local"
    native_restarts = False

    def __init__(self) -> None:
        self.states: dict[int, ReplicaState] = {}
        self.relaunched: list[int] = []
        self.cancelled: list[int] = []

    def status(self, h: ReplicaHandle) -> ReplicaStatus:
        state = self.states.get(h.rank, ReplicaState.RUNNING)
        code = 1 if state is ReplicaState.FAILED else None
        return ReplicaStatus(state=state, exit_code=code, message=f"exited with code {code}")

    def relaunch(self, h: ReplicaHandle) -> ReplicaHandle:
        self.relaunched.append(h.rank)
        self.states[h.rank] = ReplicaState.RUNNING
        return ReplicaHandle(h.backend, h.run_id, h.rank, "new", h.run_uri, h.world_size)

    def cancel_all(self, handles: list[ReplicaHandle]) -> None:
        for h in handles:
            if not self.status(h).terminal:
                self.cancelled.append(h.rank)
                self.states[h.rank] = ReplicaState.CANCELLED


def _supervisor(
    tmp_path: Path, n: int = 2, resume: Any = None
) -> tuple[Supervisor, _Executor, RunStore]:
    store = RunStore(f"file://{tmp_path}/run")
    executor = _Executor()
    handles = [ReplicaHandle("local", "r", k, str(k), store.uri, n) for k in range(n)]
    plan = SimpleNamespace(store=store, executor=executor, restart=RestartPolicy(3),
                           resume=resume, spec=SimpleNamespace(run_id="run-7"))  # fmt: skip
    return Supervisor(plan, handles, launch_no=0), executor, store  # type: ignore[arg-type]


def _fail(
    store: RunStore, executor: _Executor, rank: int, error: str | None, **result: Any
) -> None:
    executor.states[rank] = ReplicaState.FAILED
    if error is not None:
        record = {"rank": rank, "status": "failed", "error": error, "rounds_committed": 0}
        store.put_json(layout.result_key(rank), {**record, **result})


def test_an_error_at_setup_ends_the_run_at_once(tmp_path: Path) -> None:
    sup, executor, store = _supervisor(tmp_path)
    _fail(store, executor, 1, "KeyError: 'completion'", failed_in="setup", restartable=False)
    sup.check(1, None)
    assert executor.relaunched == [] and executor.cancelled == [0]
    assert sup.fatal is not None and "replica 1 failed at setup with KeyError" in sup.fatal
    assert "\n" not in sup.fatal


def test_a_continued_run_that_fails_at_setup_says_to_continue_it(tmp_path: Path) -> None:
    """A run continued with --resume has rounds to keep: launched anew it would lose them,
    so the reason says to continue it once the input is fixed."""
    sup, executor, store = _supervisor(tmp_path, resume=SimpleNamespace(from_round=3))
    _fail(store, executor, 0, "DataError: row 3: the prompt is null", failed_in="setup",
          restartable=False)  # fmt: skip
    sup.check(0, None)
    assert sup.fatal is not None and sup.fatal.endswith(
        "fix the input, then continue with crf launch --resume run-7"
    ), sup.fatal
    fresh, executor, store = _supervisor(tmp_path / "fresh")
    _fail(store, executor, 0, "DataError: row 3", failed_in="setup", restartable=False)
    fresh.check(0, None)
    assert fresh.fatal is not None and fresh.fatal.endswith("fix the input and launch again")


def test_the_same_error_on_a_second_replica_ends_the_run(tmp_path: Path) -> None:
    sup, executor, store = _supervisor(tmp_path, n=3)
    _fail(store, executor, 0, "ValueError: row 3 has no label", failed_in="training")
    sup.check(0, None)
    assert executor.relaunched == [0] and sup.fatal is None  # once: it may have been a fluke
    _fail(store, executor, 2, "ValueError: row 3 has no label", failed_in="training")
    sup.check(2, None)
    assert executor.relaunched == [0]  # not again
    assert sup.fatal is not None and "replica(s) 0 too" in sup.fatal
    assert sorted(executor.cancelled) == [0, 1]


def test_the_same_error_on_a_restart_ends_the_run(tmp_path: Path) -> None:
    sup, executor, store = _supervisor(tmp_path)
    for _ in range(2):
        _fail(store, executor, 1, "TypeError: bad operand", failed_in="training")
        sup.check(1, None)
    assert executor.relaunched == [1]
    assert sup.fatal is not None and "(again)" in sup.fatal


def test_deaths_and_repeated_outages_restart_as_before(tmp_path: Path) -> None:
    sup, executor, store = _supervisor(tmp_path)
    for _ in range(2):  # killed: no result at all
        _fail(store, executor, 0, None)
        sup.check(0, None)
    for _ in range(2):  # the store was down, twice, the same way
        _fail(store, executor, 1, "StoreTimeout: store down", transient=True)
        sup.check(1, None)
    assert executor.relaunched == [0, 0, 1, 1] and sup.fatal is None
    # after a committed round an error is no longer an input error: the policy decides
    _fail(store, executor, 0, "KeyError: 'x'", rounds_committed=2, failed_in="training")
    sup.check(0, None)
    assert sup.fatal is None and executor.relaunched[-1] == 0
    # another replica's alike error is no repeat (two deaths may read alike)
    _fail(store, executor, 1, "KeyError: 'x'", rounds_committed=2, failed_in="training")
    sup.check(1, None)
    assert sup.fatal is None and executor.relaunched[-1] == 1


def test_the_same_error_on_a_restart_after_committed_rounds_ends_the_run(
    tmp_path: Path,
) -> None:
    """A user's loop that raises at step k after a committed round: its restart resumes
    there and raises again; the second time ends the run rather than restart it
    --max-restarts times."""
    sup, executor, store = _supervisor(tmp_path)
    line = "RuntimeError: user bug at step 3"
    _fail(store, executor, 0, line, rounds_committed=1, failed_in="training")
    sup.check(0, None)
    assert sup.fatal is None and executor.relaunched == [0]
    _fail(store, executor, 0, line, rounds_committed=1, failed_in="training")
    sup.check(0, None)
    assert executor.relaunched == [0] and executor.cancelled == [1]
    assert sup.fatal is not None and sup.fatal.startswith(
        f"replica 0 failed after 1 committed round(s) (again) with {line}: a restart cannot"
    )


def test_a_rewards_error_after_committed_rounds_ends_the_run(tmp_path: Path) -> None:
    """A reward's own error is met by every replica sooner or later (the same code scores
    them all): the run stops at the first, naming it, and is continued once the reward is
    fixed; the others are not left to train on alone until they meet it too."""
    sup, executor, store = _supervisor(tmp_path, n=3)
    store.put("global/1/part-0.safetensors", b"x")  # rounds 0 and 1 committed
    line = "RewardFailed: reward rw:score raised KeyError: 'label' on the completion 'xy'"
    _fail(store, executor, 2, line, rounds_committed=2, failed_in="training",
          restartable=False, stops_run=True)  # fmt: skip
    sup.check(2, None)
    assert executor.relaunched == [] and sorted(executor.cancelled) == [0, 1]
    assert sup.fatal == (
        f"replica 2 failed after 2 committed round(s) with {line}: a restart cannot fix it, "
        "so the run stopped; fix the input, then continue with crf launch --resume run-7"
    )
    # a replica's NaN (no stops_run) is its own: the others go on without it, as after a death
    other, executor, store = _supervisor(tmp_path / "nan", n=3)
    _fail(store, executor, 1, "NonFiniteError: round 2: weights went non-finite",
          rounds_committed=2, failed_in="training", restartable=False)  # fmt: skip
    other.check(1, None)
    assert other.fatal is None and executor.cancelled == [] and executor.relaunched == []


class _Logged(_Executor):
    """Replicas that exit with ``code`` and leave ``log`` (no result: they never reach crf)."""

    def __init__(self, code: int, log: list[str]) -> None:
        super().__init__()
        self.code, self.log = code, log

    def status(self, h: ReplicaHandle) -> ReplicaStatus:
        status = super().status(h)
        if status.state is ReplicaState.FAILED:
            return ReplicaStatus(status.state, exit_code=self.code)
        return status

    def logs(self, h: ReplicaHandle) -> list[str]:
        return self.log


TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 2, in <module>',
             "ModuleNotFoundError: No module named 'mypkg'"]  # fmt: skip


@pytest.mark.parametrize(
    ("code", "log", "stops"),
    [
        (1, TRACEBACK, True),  # a user's script that raises: the same on every attempt
        (4, ["usage: train.py", "ValueError: bad --lr"], True),  # sys.exit(4) after it
        (137, TRACEBACK, False),  # killed (OOM: 128 + 9), whatever the log last said
        (-9, TRACEBACK, False),
        (1, ["Killed"], False),  # no exception line: nothing to compare
    ],
)
def test_an_entrypoint_that_writes_no_result_is_judged_by_its_exit_and_log(
    tmp_path: Path, code: int, log: list[str], stops: bool
) -> None:
    """A user's entrypoint that fails before it reaches crf writes no result; the same
    exception line in its log on a second replica (or attempt) before any committed round
    is an input error, not a death."""
    sup, _, store = _supervisor(tmp_path)
    executor = _Logged(code, log)
    sup.plan.executor = executor  # type: ignore[misc]
    for rank in (0, 1):
        executor.states[rank] = ReplicaState.FAILED
        sup.check(rank, None)
    if stops:
        assert executor.relaunched == [0] and sup.fatal is not None, sup.fatal
        assert f"replica 1 failed before its first round with {log[-1]}; replica(s) 0 too" in (
            sup.fatal
        )
    else:
        assert executor.relaunched == [0, 1] and sup.fatal is None
    store.put("global/0/part-0.safetensors", b"x")  # a committed round: deaths from here on
    after, executor, _ = _supervisor(tmp_path)
    after.plan.executor = logged = _Logged(1, TRACEBACK)  # type: ignore[misc]
    for rank in (0, 1):
        logged.states[rank] = ReplicaState.FAILED
        after.check(rank, None)
    assert logged.relaunched == [0, 1] and after.fatal is None


def _torchrun_log(rank_error: str | None) -> list[str]:
    """An attempt's log as torchrun leaves it when one of its ranks fails: the rank's own
    traceback (when it raised), the others' echo, then torchrun's report, whose table pushes
    the cause out of the tail."""
    cause = ["[rank1]: Traceback (most recent call last):", f"[rank1]: {rank_error}"]
    echo = ["[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:21930"]
    report = ["Traceback (most recent call last):", "    raise ChildFailedError(",
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
              "=" * 60, "Failures:", "[1]:", "  rank      : 0 (local_rank: 0)",
              "  exitcode  : -15 (pid: 24011)  (SIGTERM)", *[f"  line {i}" for i in range(9)],
              "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
              f"  exitcode  : {1 if rank_error else -9} (pid: 24012)", "=" * 60]  # fmt: skip
    return (cause if rank_error else []) + echo + report


def test_torchrun_s_first_failing_rank_is_the_error_and_a_repeat_ends_the_run(
    tmp_path: Path,
) -> None:
    """A rank that raised under torchrun: its exception line is the replica's error (not the
    report's table), and the same rank failing alike after its restart, past a committed
    round, ends the run; a rank killed (torchrun's report alone) restarts as a death."""
    from crf.launcher.summary import last_exception
    from crf.launcher.supervise import log_tail

    store = RunStore(f"file://{tmp_path}/run")
    store.put("global/0/part-0.safetensors", b"x")  # a committed round
    raised = _Logged(1, _torchrun_log("RuntimeError: rank 1 bug at step 2"))
    handle = ReplicaHandle("local", "r", 0, "0", store.uri, 2)
    assert last_exception(log_tail(raised, handle)) == "RuntimeError: rank 1 bug at step 2"
    sup, _, _ = _supervisor(tmp_path)
    sup.plan.executor = raised  # type: ignore[misc]
    for _ in range(2):
        raised.states[0] = ReplicaState.FAILED
        sup.check(0, None)
    assert raised.relaunched == [0] and sup.fatal is not None
    assert "(again) with RuntimeError: rank 1 bug at step 2" in sup.fatal
    killed, _, _ = _supervisor(tmp_path / "killed")
    killed.plan.store.put("global/0/part-0.safetensors", b"x")
    killed.plan.executor = dead = _Logged(1, _torchrun_log(None))  # type: ignore[misc]
    for _ in range(2):
        dead.states[0] = ReplicaState.FAILED
        killed.check(0, None)
    assert dead.relaunched == [0, 0] and killed.fatal is None


def _row(result: dict[str, Any] | None, state: ReplicaState, **kw: Any) -> dict[str, Any]:
    handle = ReplicaHandle("local", "r", 0, "1", "file:///x", 1)
    res = ReplicaResult(handle, state, 3 if state is ReplicaState.FAILED else 0, result)
    return replica_row(res, rounds=2, **kw)


def test_the_summary_shows_committed_rounds_and_a_setup_failure() -> None:
    failed = {"status": "failed", "error": "KeyError: 'completion'", "failed_in": "setup",
              "rounds_committed": 0, "rounds_missed": [], "restartable": False}  # fmt: skip
    row = _row(failed, ReplicaState.FAILED, metrics=[], restarts=2)
    assert row["failure"] == "setup error"
    assert _rounds_text(row, 2) == "0/2"  # restarted, never trained: not 2/2
    dead = _row(None, ReplicaState.FAILED)
    assert dead["failure"] == "death"
    resumed = _row({"status": "ok", "rounds_committed": 1}, ReplicaState.SUCCEEDED,
                   metrics=[{"round": 0, "committed": True}, {"round": 1, "committed": True}],
                   restarts=1)  # fmt: skip
    assert resumed["failure"] is None and _rounds_text(resumed, 2) == "2/2"


def test_the_summary_row_shows_the_sync_time_beside_the_transfer_time() -> None:
    """The summary's sync_s against transfer_s says whether the exchange hid behind training
    (docs/design.md, "Streaming DiLoCo and overlap"): both come from the replica's result."""
    from crf.results import ReplicaSummary

    row = _row({"status": "ok", "sync_s": 0.4, "transfer_s": 3.2}, ReplicaState.SUCCEEDED)
    assert (row["sync_s"], row["transfer_s"]) == (0.4, 3.2)
    typed = ReplicaSummary.from_dict(row)
    assert typed.transfer_s == 3.2 and typed.to_dict() == row


def test_a_replica_dead_before_its_first_record_missed_every_round() -> None:
    from crf.launcher.summary import build_summary
    from crf.spec import RunSpec

    spec = RunSpec(run_id="r", run_uri="file:///x", replicas=2, rounds=3)

    def result(rank: int, state: ReplicaState, data: dict[str, Any] | None) -> ReplicaResult:
        handle = ReplicaHandle("local", "r", rank, str(rank), "file:///x", 2)
        return ReplicaResult(handle, state, 0 if state is ReplicaState.SUCCEEDED else -9, data)

    results = [result(0, ReplicaState.SUCCEEDED, {"status": "ok", "rounds_committed": 3}),
               result(1, ReplicaState.FAILED, None)]  # fmt: skip
    records = {0: [{"round": r, "committed": True} for r in range(3)], 1: []}
    rows = build_summary(spec=spec, results=results, started_at=0.0, metrics=records)["replicas"]
    assert rows[0]["rounds_missed"] == [] and rows[1]["rounds_missed"] == [0, 1, 2]
    # no record from anyone (unreadable, or no round ran): each replica's own word, if any
    rows = build_summary(spec=spec, results=results, started_at=0.0, metrics={0: [], 1: []})
    assert [row["rounds_missed"] for row in rows["replicas"]] == [None, None]
