"""Streaming DiLoCo over the store: the model in fragments, each sync its own exchange round,
the exchange running in the background while the inner steps go on.

Replicas are threads over one file:// store. Nothing here is timing-based: the overlap test
holds the store's upload on an event and checks the order of what happened."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from crf import layout
from crf.exchange.allreduce import ObjectStoreAllReduce
from crf.exchange.manager import ObjectStoreManager
from crf.replica.context import ReplicaContext, split_model
from crf.spec import RunSpec, SpecError
from crf.store import RunStore
from tests.conftest import run_threads

N, H, ROUNDS, F, DELAY = 2, 4, 3, 2, 1
_LOCK = threading.Lock()


def new_run(tmp_path: Path, **fields: Any) -> tuple[RunStore, RunSpec]:
    store = RunStore(f"file://{tmp_path}/run")
    fields = {"replicas": N, "sync_every": H, "rounds": ROUNDS, "round_timeout_s": 30, **fields}
    spec = RunSpec(run_id="stream", run_uri=store.uri, **fields).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    return store, spec


def build() -> torch.nn.Module:
    with _LOCK:  # replicas are threads: seeding the global RNG must not interleave
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        )


def train(store: RunStore, spec: RunSpec, rank: int, stop_at: int | None = None) -> Any:
    ctx = ReplicaContext(store, spec, rank, N, shard_grace_s=2.0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with ctx.diloco(model, opt):
        start = ctx.step
        while ctx.step < ctx.total_steps:
            g = torch.Generator().manual_seed(ctx.data_seed * 997 + ctx.step)
            x = torch.randn(8, 4, generator=g)
            loss = ((model(x) - x[:, :2]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log_step(loss=loss.item())
            if stop_at is not None and ctx.step == stop_at:
                return ctx, model, start
    ctx.finish({})
    return ctx, model, start


def test_split_model_contiguous_balanced_and_complete() -> None:
    model = build()
    frags = split_model(model, 3)
    got = [p for f in frags for p in f.parameters()]
    assert [id(p) for p in got] == [id(p) for p in model.parameters()]  # same objects, in order
    assert all(len(list(f.parameters())) >= 1 for f in frags)
    assert split_model(model, 1) == [model]
    with pytest.raises(ValueError, match="only 6 parameter tensors"):
        split_model(model, 7)


def test_spec_fields_validate_and_round_trip() -> None:
    spec = RunSpec(run_id="a", run_uri="file:///x", sync_every=8, fragments=4,
                   fragment_sync_delay=1).validate()  # fmt: skip
    back = RunSpec.from_json(spec.to_json())
    assert (back.fragments, back.fragment_sync_delay, back.sync_period) == (4, 1, 2)
    old = json.loads(spec.to_json())
    del old["fragments"], old["fragment_sync_delay"]  # a run.json from before these fields
    assert RunSpec.from_dict(old).validate().fragments == 1
    with pytest.raises(SpecError, match="divisible by --fragments"):
        RunSpec(run_id="a", run_uri="file:///x", sync_every=6, fragments=4).validate()
    with pytest.raises(SpecError, match="fragment-sync-delay"):
        RunSpec(run_id="a", run_uri="file:///x", sync_every=8, fragments=4,
                fragment_sync_delay=2).validate()  # fmt: skip


def test_streaming_run_ends_identical_with_one_round_per_fragment_sync(tmp_path: Path) -> None:
    store, spec = new_run(tmp_path, fragments=F, fragment_sync_delay=DELAY, keep_rounds=100)
    written: list[int] = []  # the rounds of the global parts written
    put = store._put

    def recording(path: str, data: Any, **kw: Any) -> bool:
        if "/global/" in f"/{path}":
            written.append(int(path.split("global/")[1].split("/")[0]))
        return put(path, data, **kw)

    store._put = recording  # type: ignore[method-assign]
    out = run_threads(N, lambda r: train(store, spec, r))
    for o in out:
        assert not isinstance(o, BaseException), o
    s0 = out[0][1].state_dict()
    for _, model, _ in out[1:]:
        assert all(torch.equal(s0[k], v) for k, v in model.state_dict().items())
    # one exchange round per fragment sync, each carrying its fragment
    assert store.list("rounds") == [str(r) for r in range(ROUNDS * F)]
    for r in range(ROUNDS * F):
        quorum = store.get_json(f"rounds/{r}/quorum.json")  # what the decider checked
        assert quorum["participants"] == [0, 1]
        assert quorum["facts"]["fragment"] == r % F
        assert len({c["facts"] for c in quorum["contributions"].values()}) == 1
    # --checkpoint-every counts outer rounds: a global state after each one's last fragment
    # (the older ones collected: a resume needs the newest whole one and its inner states)
    assert sorted(set(written)) == list(range(F - 1, ROUNDS * F, F)), written
    assert layout.global_rounds(store, complete=True)[-1] == ROUNDS * F - 1
    for r in range(N):  # and so do the inner states (kept while their global state is)
        kept = layout.inner_rounds(store, r)
        assert kept[-1] == ROUNDS * F - 1 and set(kept) <= set(range(F - 1, ROUNDS * F, F))
    for ctx, _, _ in out:
        res = store.get_json(f"results/{ctx.rank}.json")
        assert res["rounds_committed"] == ROUNDS and res["syncs_committed"] == ROUNDS * F
        assert res["fragments"] == F and res["transfer_s"] > 0 and res["steps"] == ROUNDS * H
        # one metrics record per outer round, with its fragment syncs inside
        m = store.get_json(f"metrics/{ctx.rank}/1.json")
        assert m["committed"] and [x["exchange_round"] for x in m["fragments"]] == [2, 3]
    assert len({store.get_json(f"results/{r}.json")["weights_sha256"] for r in range(N)}) == 1


def test_a_round_end_evaluation_sees_the_global_model_and_training_goes_on_unchanged(
    tmp_path: Path,
) -> None:
    """At each round's end ``global_weights`` puts every fragment's global copy in the
    model (its own weights then hold local training since the earlier fragments' syncs): the
    last round's global model is the model the run ends with, and the replica's own weights
    come back bit for bit, so the run ends as one that never looked (the reference)."""
    ref_store, ref_spec = new_run(tmp_path / "ref", fragments=F)
    reference = run_threads(N, lambda r: train(ref_store, ref_spec, r))[0][1].state_dict()
    store, spec = new_run(tmp_path / "looked", fragments=F)

    def looking(rank: int) -> Any:
        ctx = ReplicaContext(store, spec, rank, N, shard_grace_s=2.0)
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        seen: list[dict[str, torch.Tensor]] = []
        with ctx.diloco(model, opt):
            while ctx.step < ctx.total_steps:
                x = torch.randn(
                    8, 4, generator=torch.Generator().manual_seed(ctx.data_seed * 997 + ctx.step)
                )
                loss = ((model(x) - x[:, :2]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ctx.log_step(loss=loss.item())
                if ctx.step % H == 0:
                    own = {k: v.clone() for k, v in model.state_dict().items()}
                    with ctx.global_weights():
                        seen.append({k: v.clone() for k, v in model.state_dict().items()})
                    assert all(torch.equal(own[k], v) for k, v in model.state_dict().items())
        ctx.finish({})
        return model, seen

    for model, seen in run_threads(N, looking):
        final = model.state_dict()
        assert len(seen) == ROUNDS
        assert any(not torch.equal(seen[0][k], v) for k, v in final.items())  # it moved
        assert all(torch.equal(seen[-1][k], v) for k, v in final.items())
        assert all(torch.equal(reference[k], v) for k, v in final.items())


def test_streaming_resume_mid_round_matches_uninterrupted(tmp_path: Path) -> None:
    """Stopped after the first fragment's sync of outer round 1: the replicas resume from the
    end of outer round 0 (the checkpoint's period is an outer round), run round 1 again and
    end with the uninterrupted run's weights."""
    ref_store, ref_spec = new_run(tmp_path / "ref", fragments=F, fragment_sync_delay=DELAY)
    ref = run_threads(N, lambda r: train(ref_store, ref_spec, r))
    ref_state = ref[0][1].state_dict()
    store, spec = new_run(tmp_path / "cut", fragments=F, fragment_sync_delay=DELAY)
    stop = 3 * (H // F)  # after exchange round 2: fragment 0 of outer round 1
    run_threads(N, lambda r: train(store, spec, r, stop_at=stop))
    assert layout.global_rounds(store) == [F - 1]
    out = run_threads(N, lambda r: train(store, spec, r))
    for ctx, model, start in out:
        assert ctx.resumed_from == F - 1 and start == H and ctx.resumed_inner
        assert all(torch.equal(ref_state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("catch_up", [True, False])
def test_streaming_replica_outside_quorum_heals_and_ends_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, catch_up: bool
) -> None:
    """Replica 1 is late for one fragment sync: the other commits without it. It takes that
    sync's published average (the others wait up to 2 s for it in the next one), or - with
    the catch-up turned off - heals from global/<r> (all fragments back to their global
    copies); either way all end identical."""
    if not catch_up:
        monkeypatch.setattr(ObjectStoreAllReduce, "_catch_up", lambda self, *a, **k: False)
    store, spec = new_run(
        tmp_path, fragments=F, fragment_sync_delay=DELAY, min_replicas=1, round_timeout_s=2.0
    )

    def slow_train(rank: int) -> Any:
        if rank == 0:
            return train(store, spec, rank)
        # late for exchange round 1 only: its upload waits until rank 0 committed alone
        own = RunStore(store.uri)
        plug_late_upload(own, round_=1, until=lambda: layout.global_complete(own, 1))
        return train(own, spec, rank)

    out = run_threads(N, slow_train, timeout=120)
    for o in out:
        assert not isinstance(o, BaseException), o
    (c0, m0, _), (c1, m1, _) = out
    if catch_up:
        assert c1.manager.rounds_caught_up == [1] and c1.manager.rounds_missed == []
        assert c1.manager.last_healed_from is None
    else:
        assert 1 in c1.manager.rounds_missed and c1.manager.last_healed_from is not None
    s0 = m0.state_dict()
    assert all(torch.equal(s0[k], v) for k, v in m1.state_dict().items())


def plug_late_upload(store: RunStore, round_: int, until: Any) -> None:
    """Hold this store's first upload of a contribution to ``round_`` until ``until()``."""
    put = store._put
    done = threading.Event()

    def late_put(path: str, data: bytes, *, exclusive: bool, **kw: Any) -> bool:
        if not done.is_set() and f"/rounds/{round_}/contrib/" in path:
            done.set()
            for _ in range(600):
                if until():
                    break
                threading.Event().wait(0.05)
        return put(path, data, exclusive=exclusive, **kw)

    store._put = late_put  # type: ignore[method-assign]


def test_upload_starts_before_wait_and_blocked_excludes_transfer(tmp_path: Path) -> None:
    """The exchange runs in the background from the moment the last tensor is queued: the
    store receives this replica's upload while the training thread has not waited yet (it is
    held there on an event), and the time the training thread was blocked excludes it."""
    uri = f"file://{tmp_path}/run"
    gated = RunStore(uri)
    put = gated._put
    upload_seen, release = threading.Event(), threading.Event()

    def gated_put(path: str, data: bytes, *, exclusive: bool, **kw: Any) -> bool:
        if "/contrib/0." in path:
            upload_seen.set()
            assert release.wait(30), "the test never released the upload"
        return put(path, data, exclusive=exclusive, **kw)

    gated._put = gated_put  # type: ignore[method-assign]

    def manager(store: RunStore, rank: int) -> ObjectStoreManager:
        m = ObjectStoreManager(store, 2, rank, run_id="t", shard_grace_s=5.0)
        m.set_fragment_sizes([2])
        return m

    def peer() -> torch.Tensor:
        m = manager(RunStore(uri), 1)
        ts = [torch.full((3,), 3.0), torch.full((2,), 5.0)]
        m.start_quorum()
        works = [m.allreduce(t) for t in ts]
        for w in works:
            w.wait()
        assert m.should_commit()
        return ts

    th = run_async(peer)
    m0 = manager(gated, 0)
    ts = [torch.full((3,), 1.0), torch.full((2,), 1.0)]
    m0.start_quorum()
    works = [m0.allreduce(t) for t in ts]  # returns although the upload is held
    assert upload_seen.wait(30), "no upload reached the store before wait() was called"
    assert m0._thread is not None and m0._thread.is_alive()  # the transfer is in flight
    held_from = m0.transfer_phase
    blocked_before = m0.blocked_s
    threading.Event().wait(0.2)  # "inner steps" while the upload is held
    release.set()
    for w in works:
        w.wait()
    assert m0.should_commit()
    assert held_from == "uploading"
    assert torch.equal(ts[0], torch.full((3,), 2.0)) and torch.equal(ts[1], torch.full((2,), 3.0))
    assert all(torch.equal(a, b) for a, b in zip(th.result(), ts, strict=True))
    # the held time is transfer, not blocked time
    assert m0.transfer_s > m0.blocked_s - blocked_before
    assert m0.last_sync_s == pytest.approx(m0.blocked_s)


class _Async:
    def __init__(self, fn: Any) -> None:
        self._out: list[Any] = []
        self._t = threading.Thread(target=lambda: self._out.append(fn()), daemon=True)
        self._t.start()

    def result(self) -> Any:
        self._t.join(60)
        assert self._out, "peer failed"
        return self._out[0]


def run_async(fn: Any) -> _Async:
    return _Async(fn)


def test_launch_takes_streaming_fields_end_to_end(tmp_path: Path) -> None:
    """``driver.launch(..., fragments=2, fragment_sync_delay=1)``: real replica processes of
    the lm job run Streaming DiLoCo and end bit-identical, every round committed."""
    from tests.fault_helpers import launch_lm

    summary = launch_lm(
        tmp_path / "runs",
        "streaming",
        replicas=2,
        sync_every=4,
        rounds=2,
        round_timeout_s=60,
        fragments=2,
        fragment_sync_delay=1,
    )
    assert summary["status"] == "ok" and summary["weights_identical"] is True
    assert summary["rounds_completed"] == 2 and summary["rounds_lost"] == []
    run = RunStore(f"file://{tmp_path}/runs/streaming")
    assert RunSpec.from_json(run.get("run.json")).fragments == 2
    for rank in range(2):
        res = run.get_json(f"results/{rank}.json")
        assert res["syncs_committed"] == 4 and res["rounds_committed"] == 2
