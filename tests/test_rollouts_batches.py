"""Rollouts in (crf/rollouts/batches.py, source.py, worker admission): batches read back
bit-exact, the trainer takes the oldest within the bound and returns the stale, admission
paces at the bound's edge, and the trainer falls back to local generation."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from crf import layout
from crf.rollouts import RolloutConfig
from crf.rollouts.batches import (
    RolloutBatch,
    RolloutQueue,
    decode_batch,
    drop_finished_queues,
    encode_batch,
)
from crf.rollouts.config import in_bound
from crf.rollouts.source import StoreRolloutSource
from crf.rollouts.worker import admits
from crf.store import CorruptObjectError, RunStore

ROWS = [{"prompt": f"p{i}=", "answer": str(i)} for i in range(10)]


def batch(worker: int = 0, seq: int = 0, version: int = 0, rank: int = 0, n: int = 4,
          digest: str = "d") -> RolloutBatch:  # fmt: skip
    rows = [(seq * 2 + i // 2) % len(ROWS) for i in range(n)]  # 2 generations per prompt
    return RolloutBatch(
        rank=rank,
        worker=worker,
        seq=seq,
        version=version,
        row_ids=rows,
        prompt_ids=[[5, 6, r] for r in rows],
        completion_ids=[[1, 2, 3][: 1 + i % 3] for i in range(n)],
        logprobs=[[-0.1 * (j + 1) / 3, -1e-30, -7.25][: 1 + i % 3] for j, i in enumerate(range(n))],
        sampling={"temperature": 1.0, "top_k": None},
        tokenizer_digest="tok",
        policy_digest=digest,
        created_at=time.time(),
    )


def test_a_batch_reads_back_bit_exact(store: RunStore) -> None:
    b = batch(worker=2, seq=7, version=3, n=6)
    b.logprobs[0][0] = -0.1 + 2**-40  # a value with all 52 mantissa bits in use
    q = RolloutQueue(store, 0)
    q.put(b)
    got = q.read(2, 7)
    assert got == b
    assert [x.hex() for x in got.logprobs[0]] == [x.hex() for x in b.logprobs[0]]


def test_a_bad_batch_is_refused() -> None:
    data = b"".join(encode_batch(batch()))
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_batch(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptObjectError):
        decode_batch(data[:-4])
    b = batch()
    b.logprobs[1] = b.logprobs[1] + [0.0]
    with pytest.raises(ValueError, match="log-probs"):
        encode_batch(b)


def test_the_trainer_takes_the_oldest_within_the_bound(store: RunStore) -> None:
    q = RolloutQueue(store, 0)
    q.put(batch(worker=0, seq=0, version=3))
    q.put(batch(worker=1, seq=0, version=1))  # 2 steps behind step 3: too stale
    q.put(batch(worker=0, seq=1, version=2))
    q.put(batch(worker=1, seq=1, version=2, n=6))  # made for other settings
    taken, returned, bad = q.oldest_within(step=3, max_staleness=1, rollouts=4)
    assert (taken.worker, taken.seq, taken.version) == (0, 1, 2)
    assert [(b.worker, b.seq) for b in returned] == [(1, 0)]
    assert [k for k, _ in bad] == [(1, 1)]
    assert q.queued() == [(0, 0)]  # the taken, returned and refused ones are gone
    # worker 1 finds its stale batch returned and generates those rows again first
    again = q.take_returned(1)
    assert [(b.seq, b.row_ids) for b in again] == [(0, batch(1, 0).row_ids)]
    assert q.take_returned(1) == [] and q.take_returned(0) == []
    # the bound's edge: exactly max_staleness behind is taken
    taken, returned, _ = q.oldest_within(step=4, max_staleness=1, rollouts=4)
    assert taken.version == 3 and not returned
    assert q.oldest_within(step=4, max_staleness=1, rollouts=4)[0] is None


@pytest.mark.parametrize(
    ("trainer_step", "queued", "version", "bound", "ok"),
    [
        (0, 0, 0, 0, True),  # staleness 0: one batch at a time, on the newest weights
        (0, 1, 0, 0, False),
        (5, 0, 4, 1, True),
        (5, 1, 4, 1, False),  # would be used at step 6 with version 4: 2 behind
        (5, 1, 5, 1, True),  # the bound's edge
        (5, 2, 5, 1, False),
        (3, 0, 5, 1, True),  # a version newer than the step a heartbeat showed
    ],
)
def test_admission_paces_at_the_bound(
    trainer_step: int, queued: int, version: int, bound: int, ok: bool
) -> None:
    assert admits(trainer_step, queued, version, bound) is ok


@pytest.mark.parametrize(
    ("trainer_step", "queued", "version", "ok"),
    [
        (13, 0, 13, True),  # H = 15, bound 2: version 13 serves step 13, 14 (same round)
        (13, 1, 13, True),
        (13, 2, 13, False),  # it would serve step 15, after the outer step at 15
        (15, 0, 14, False),  # the last local version never serves the new round
        (15, 0, 15, True),  # version 15 is the weights after the outer step
        (16, 1, 15, True),
    ],
)
def test_no_batch_crosses_an_outer_step(
    trainer_step: int, queued: int, version: int, ok: bool
) -> None:
    assert admits(trainer_step, queued, version, 2, sync_period=15) is ok
    assert in_bound(version, max(trainer_step, version) + queued, 2, 15) is ok


def test_no_batch_is_written_for_a_step_past_the_trainers_last() -> None:
    """A trainer of 10 steps trains steps 0-9: a batch that would serve step 10 or later
    would be generated for nobody."""
    assert admits(8, 1, 8, 2, total_steps=10)  # serves step 9, the last
    assert not admits(8, 2, 8, 2, total_steps=10)  # would serve step 10
    assert not admits(10, 0, 9, 2, total_steps=10)  # the trainer is done
    assert admits(8, 2, 8, 2)  # without a known end, the bound alone


def test_the_trainer_returns_a_batch_from_before_its_outer_step(store: RunStore) -> None:
    q = RolloutQueue(store, 0)
    q.put(batch(seq=0, version=14))  # 1 step behind step 15, but before the sync at 15
    q.put(batch(seq=1, version=15))
    taken, returned, _ = q.oldest_within(step=15, max_staleness=2, rollouts=4, sync_period=15)
    assert taken.version == 15 and [b.version for b in returned] == [14]
    assert RolloutConfig.from_spec(_Spec()).sync_period == 5


class _Spec:
    rollout_workers, max_staleness, sync_period = 1, 2, 5


class Digests:
    def __init__(self, **by_version: str) -> None:
        self.by_version = {int(k[1:]): v for k, v in by_version.items()}

    def expected_digest(self, version: int) -> str | None:
        return self.by_version.get(version)


def test_what_no_trainer_attempt_reads_goes_at_the_trainers_end(store: RunStore) -> None:
    """A trainer that trained every step deletes its queued batches and its cursor: a later
    attempt takes only batches of versions it publishes itself. The batches returned to a
    worker stay (the rows it still owes, generated first if the trainer trains again: a
    restart, a resume with more rounds). One that stopped short keeps its queue. A worker
    drops only its own batches; the driver, once the workers are stopped, only the queues of
    trainers that ended ok."""
    from types import SimpleNamespace

    from crf.rollouts.replica import TrainerRollouts

    q, other = RolloutQueue(store, 0), RolloutQueue(store, 1)
    for w, seq in ((0, 0), (0, 1), (2, 0)):
        q.put(batch(worker=w, seq=seq))
    q.give_back(batch(worker=2, seq=1))
    q.set_cursor(3)
    other.put(batch(worker=1, seq=0, rank=1))
    other.give_back(batch(worker=1, seq=1, rank=1))
    spec = SimpleNamespace(run_id="r", sync_every=2, sync_period=2, rollout_workers=3,
                           publish_every=1, max_staleness=1, rollout_wire="float32")  # fmt: skip
    cfg = RolloutConfig.from_spec(spec)

    def trainer(at: int) -> TrainerRollouts:
        ctx = SimpleNamespace(spec=spec, store=store, rank=0, world_size=2, step=at,
                              total_steps=4)  # fmt: skip
        return TrainerRollouts(ctx, ROWS, cfg)

    returned = f"{layout.rollout_dir(0)}/returned"
    trainer(3).close()  # stopped short
    assert q.queued() == [(0, 0), (0, 1), (2, 0)] and q.cursor() == 3
    assert q.drop(2) == 1  # its queued batch; the one returned to it stays
    assert q.queued() == [(0, 0), (0, 1)] and store.list(returned) == ["2-1"]
    trainer(4).close()
    assert q.queued() == [] and q.cursor() is None
    assert [b.seq for b in q.take_returned(2)] == [1]  # still owed, should it train again
    assert other.queued() == [(1, 0)]  # another trainer's queue is its own
    # once the workers are stopped, the driver clears the queue of a trainer that ended ok
    store.put_json(layout.result_key(1), {"rank": 1, "status": "failed"})
    assert drop_finished_queues(store) == [] and other.queued() == [(1, 0)]
    store.put_json(layout.result_key(1), {"rank": 1, "status": "ok"})
    assert drop_finished_queues(store) == [1] and other.queued() == []
    assert [b.seq for b in other.take_returned(1)] == [1]


def test_a_result_the_store_fails_to_give_keeps_only_its_own_queue(
    store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's clearing goes trainer by trainer: a store error on one trainer's result
    keeps that trainer's queue, and the others' queues are still cleared."""
    queues = [RolloutQueue(store, r) for r in range(3)]
    for r, q in enumerate(queues):
        q.put(batch(worker=r, seq=0, rank=r))
        store.put_json(layout.result_key(r), {"rank": r, "status": "ok"})
    get_json = store.get_json

    def failing(key: str) -> object:
        if key == layout.result_key(1):
            raise OSError("the store is unreachable")
        return get_json(key)

    monkeypatch.setattr(store, "get_json", failing)
    assert drop_finished_queues(store) == [0, 2]
    assert [q.queued() for q in queues] == [[], [(1, 0)], []]


def test_once_every_trainer_ended_ok_the_bases_and_returned_batches_go(store: RunStore) -> None:
    """The round bases are every trainer's, the returned batches are rows owed to a trainer
    that trains again: both stay while any trainer has no ok result (a resume may follow),
    and go once all have one (a run that ended ok is never resumed)."""
    from crf.rollouts.policy import drop_finished_bases

    for r in range(2):
        store.put(layout.policy_base_key(r), b"base")
        RolloutQueue(store, r).return_rows(batch(worker=r, seq=3, rank=r))
    store.put_json(layout.result_key(0), {"rank": 0, "status": "ok"})
    store.put_json(layout.result_key(1), {"rank": 1, "status": "failed"})
    assert not drop_finished_bases(store, 2)
    assert store.list(f"{layout.POLICY}/base") == ["0", "1"]
    assert store.list(f"{layout.rollout_dir(1)}/returned") == ["1-3"]
    store.put_json(layout.result_key(1), {"rank": 1, "status": "ok"})
    assert drop_finished_bases(store, 2)
    assert store.list(f"{layout.POLICY}/base") == []
    assert [store.list(f"{layout.rollout_dir(r)}/returned") for r in range(2)] == [[], []]


def source(store: RunStore, wait_s: float = 0.0, **digests: str) -> StoreRolloutSource:
    cfg = RolloutConfig(workers=2, max_staleness=1, wait_s=wait_s)
    return StoreRolloutSource(store, 0, 1, cfg, ROWS, digests=Digests(**digests))


def test_the_source_gives_rows_and_counts(store: RunStore) -> None:
    src = source(store, v2="good")
    q = RolloutQueue(store, 0)
    q.put(batch(worker=1, seq=0, version=2, digest="good"))
    got = src.take(step=3, rows=4)
    assert got is not None
    b, rows = got
    assert rows == [ROWS[i] for i in b.row_ids]
    src.used(b, {"mismatch_kl": 0.01, "ratio_min": 0.9, "ratio_max": 1.2})
    src.local(4)
    assert src.take(step=4, rows=4) is None  # nothing queued, no worker alive: no wait
    src.local(4)
    counts = src.take_counts()
    assert counts["workers"] == 4 and counts["local"] == 8 and counts["w1"] == 4
    assert counts["staleness_mean"] == 1 and counts["staleness_max"] == 1
    assert counts["correction"]["w1"]["ratio_max"] == 1.2
    assert src.take_counts()["workers"] == 0  # a new round


def test_a_version_the_trainer_did_not_publish_is_refused(store: RunStore) -> None:
    """A batch of a version an earlier attempt of a restarted trainer published (or one
    since deleted) names weights this trainer never had."""
    src = source(store, v2="published")
    queue = RolloutQueue(store, 0)
    made = batch(worker=0, seq=0, version=3, digest="published")
    queue.put(made)
    assert src.take(step=3, rows=4) is None
    assert src.take_counts()["refused"] == 1
    # its rows are not lost for the pass: its worker is given them back to make again
    assert queue.queued() == []
    assert [b.row_ids for b in queue.take_returned(0)] == [made.row_ids]


def test_a_batch_refused_for_what_it_holds_is_not_given_back(store: RunStore) -> None:
    """Rows the trainer does not have would come back the same way: dropped, not returned."""
    src = source(store, v3="published")
    queue = RolloutQueue(store, 0)
    foreign = batch(worker=0, seq=0, version=3, digest="published")
    foreign.row_ids[1] = 99
    queue.put(foreign)
    assert src.take(step=3, rows=4) is None
    assert src.take_counts()["refused"] == 1
    assert queue.take_returned(0) == []


def take_while_a_worker_writes(src: StoreRolloutSource, store: RunStore) -> Any:
    """The trainer's take at step 1 while a worker writes a version-1 batch 0.5 s later."""
    writer = threading.Timer(0.5, lambda: RolloutQueue(store, 0).put(batch(version=1)))
    writer.start()
    try:
        return src.take(step=1, rows=4)
    finally:
        writer.cancel()


def test_the_source_waits_for_a_live_worker(store: RunStore) -> None:
    """With a worker alive the trainer waits (up to wait_s) for its batch."""
    state = layout.WorkerState(worker=0, serves=0, phase="generating", updated_at=time.time())
    store.put_json(layout.worker_state_key(0), state.to_dict())
    src = source(store, wait_s=60.0, v1="d")
    got = take_while_a_worker_writes(src, store)
    assert got is not None and got[0].version == 1


def test_a_dead_worker_is_not_waited_for(store: RunStore) -> None:
    """A worker whose heartbeat went silent (killed, preempted) costs no wait."""
    stale = time.time() - 3600
    for w, phase in ((0, "generating"), (1, "done")):
        state = layout.WorkerState(worker=w, phase=phase, updated_at=stale if w == 0 else 0)
        store.put_json(layout.worker_state_key(w), state.to_dict())
    src = source(store, wait_s=600.0, v0="d")  # a batch of version 0 could still come
    started = time.monotonic()
    assert src.take(step=0, rows=4) is None
    assert time.monotonic() - started < 600  # it did not wait out wait_s


def test_a_step_no_published_version_can_serve_is_not_waited_for(store: RunStore) -> None:
    """With --publish-every 3 and --max-staleness 1, versions 0 and 3 serve steps 0-1 and
    3-4: step 2 has no version within the bound, so no worker batch can come for it, and
    the trainer generates at once rather than wait --rollout-wait with its worker alive."""
    state = layout.WorkerState(worker=0, serves=0, phase="pacing", updated_at=time.time())
    store.put_json(layout.worker_state_key(0), state.to_dict())
    src = source(store, wait_s=600.0, v0="d")
    assert src._worker_alive() and src._may_come(1) and not src._may_come(2)
    started = time.monotonic()
    assert src.take(step=2, rows=4) is None
    assert time.monotonic() - started < 600  # it did not wait out wait_s
    assert RolloutQueue(store, 0).cursor() == 3  # its workers pace to the next step


def test_a_restarted_worker_building_its_model_is_not_waited_for(store: RunStore) -> None:
    """A worker ``starting`` (building its model) is waited for on the trainer's first
    batches, which is what it is started for; once the trainer has trained on a worker's
    batch, one starting is a restarted worker: the trainer generates at once."""
    state = layout.WorkerState(worker=0, serves=0, phase="starting", updated_at=time.time())
    store.put_json(layout.worker_state_key(0), state.to_dict())
    src = source(store, wait_s=600.0, v1="d")
    got = take_while_a_worker_writes(src, store)  # the first batch: waited for
    assert got is not None
    src.used(got[0], {})
    store.put_json(layout.worker_state_key(0), {**state.to_dict(), "updated_at": time.time()})
    assert not src._worker_alive()  # fresh, but not worth a wait
    assert src.take(step=2, rows=4) is None  # so it generates this batch itself


def test_the_cursor_counts_a_taken_batch_before_its_step_is_known(store: RunStore) -> None:
    """The trainer takes batch 0 for step 0 and trains; its heartbeat still says step 0 and
    version 1 is not out yet. With two more version-0 batches queued at bound 2, a third
    would serve step 3 (3 steps stale): the cursor, written as the batch was taken, says
    so, where the heartbeat's step would have admitted it."""
    q = RolloutQueue(store, 0)
    assert q.cursor() is None  # before the first take: the worker reads the heartbeat
    for seq in range(3):
        q.put(batch(seq=seq, version=0))
    cfg = RolloutConfig(workers=1, max_staleness=2, wait_s=0.0)
    src = StoreRolloutSource(store, 0, 1, cfg, ROWS, digests=Digests(v0="d"))
    got = src.take(step=0, rows=4)
    assert got is not None and got[0].seq == 0
    assert q.cursor() == 1 and len(q.queued()) == 2
    assert admits(0, 2, 0, 2)  # the heartbeat's view
    assert not admits(q.cursor(), len(q.queued()), 0, 2)  # the cursor's


def test_the_cursor_is_written_before_the_batch_leaves_the_queue(store: RunStore) -> None:
    """A worker reading between the two must never see the batch gone and the old step."""
    seen: list[int | None] = []

    class Watching(RunStore):
        def delete(self, key: str) -> None:
            seen.append(RolloutQueue(store, 0).cursor())
            super().delete(key)

    watched = Watching(store.uri)
    RolloutQueue(watched, 0).put(batch(seq=0, version=4))
    cfg = RolloutConfig(workers=1, max_staleness=2, wait_s=0.0)
    src = StoreRolloutSource(watched, 0, 1, cfg, ROWS, digests=Digests(v4="d"))
    assert src.take(step=5, rows=4) is not None
    assert seen == [6]


def test_while_the_trainer_waits_the_cursor_names_its_step(store: RunStore) -> None:
    """At staleness 0 the trainer waits at step 5 for a batch of version 5: the worker,
    holding version 5 with nothing queued, must see that its batch would be on time."""
    state = layout.WorkerState(worker=0, serves=0, phase="generating", updated_at=time.time())
    store.put_json(layout.worker_state_key(0), state.to_dict())
    cfg = RolloutConfig(workers=1, max_staleness=0, wait_s=60.0)
    src = StoreRolloutSource(store, 0, 1, cfg, ROWS, digests=Digests(v5="d"))
    q = RolloutQueue(store, 0)

    def worker() -> None:
        deadline = time.monotonic() + 30
        while q.cursor() != 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        if admits(q.cursor(), len(q.queued()), 5, 0):
            q.put(batch(seq=0, version=5))

    t = threading.Thread(target=worker)
    t.start()
    got = src.take(step=5, rows=4)
    t.join()
    assert got is not None and got[0].version == 5
    assert q.cursor() == 6
