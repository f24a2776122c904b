"""Every object a replica reads is checked for where it came from: a
reduced shard, a quorum decision, a global state and an inner state copied from an older
round of the same run, from another run (same layout, valid checksum) or from another
replica is rejected, reported (``rejected``, and so the metrics and the summary), and handled
like a missing part - never averaged or loaded. Replicas are threads over one store."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest
import torch

from crf import layout
from crf.exchange import global_state
from crf.exchange.manager import HealError, ObjectStoreManager
from crf.launcher.summary import rejected_objects
from crf.replica.context import ReplicaContext
from crf.spec import RunSpec
from crf.store import RunStore
from tests.conftest import run_threads

N = 2


def tensors(rank: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(6, generator=g) * scale, torch.randn(3, 2, generator=g) * scale]


def exchange_round(store: RunStore, run_id: str, r: int, scale: float = 1.0) -> list[Any]:
    """Round r of N replicas through managers (as DiLoCo drives them): per replica, whether
    it committed, what it rejected, its tensors before and after."""

    def replica(rank: int):
        mgr = ObjectStoreManager(
            store, N, rank, background=False, heal_timeout_s=5, run_id=run_id, round_timeout_s=20
        )
        mgr.set_step(r)
        ts = tensors(rank, scale * (r + 1))
        before = [t.clone() for t in ts]
        mgr.start_quorum()
        for t in ts:
            mgr.allreduce(t)
        committed = mgr.should_commit()
        mgr.close()
        return committed, list(mgr.rejected), before, ts

    out = run_threads(N, replica)
    assert not [o for o in out if isinstance(o, BaseException)], out
    return out


def other_run_store() -> RunStore:
    return RunStore(f"memory://provenance-other/{uuid.uuid4().hex}")


@pytest.mark.parametrize("source", ["older round", "other run"])
def test_a_reduced_shard_from_elsewhere_is_rejected_not_averaged(
    store: RunStore, source: str
) -> None:
    """rounds/1/reduced/1 is there before round 1 starts: a copy of this run's round 0
    shard, or round 1's shard of another run with the same layout (its checksum valid).
    Nobody averages it into the model: the round fails for everyone alike (as for a corrupt
    reduced shard), each replica keeps its weights and reports the object."""
    exchange_round(store, "t", 0)
    key = "rounds/1/reduced/1"
    if source == "older round":
        store.put(key, store.get("rounds/0/reduced/1"))
    else:
        other = other_run_store()
        exchange_round(other, "other", 1, scale=100.0)
        store.put(key, other.get(key))
    out = exchange_round(store, "t", 1)
    for committed, rejected, before, after in out:
        assert committed is False
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert rejected_objects(rejected) == [key], rejected
        assert any("not this run's round 1 shard 1" in str(m) for m in rejected), rejected
    assert store.exists("rounds/1/failed.json")


@pytest.mark.parametrize("source", ["older round", "other run"])
def test_a_quorum_from_elsewhere_is_rejected(store: RunStore, source: str) -> None:
    """rounds/1/quorum.json is a copy of round 0's decision, or another run's round 1
    decision: no replica follows it; the round fails for all and each reports it."""
    exchange_round(store, "t", 0)
    key = "rounds/1/quorum.json"
    if source == "older round":
        store.put(key, store.get("rounds/0/quorum.json"))
    else:
        other = other_run_store()
        exchange_round(other, "other", 1)
        store.put(key, other.get(key))
    out = exchange_round(store, "t", 1)
    for committed, rejected, before, after in out:
        assert committed is False
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert rejected_objects(rejected) == [key], rejected
    assert "bad quorum" in json.loads(store.get("rounds/1/failed.json"))["reason"]


def _global_payload(model: torch.nn.Module, r: int) -> global_state.FlatState:
    return global_state.flatten({"model": model.state_dict()})


def _manager(store: RunStore, run_id: str, model: torch.nn.Module) -> ObjectStoreManager:
    mgr = ObjectStoreManager(store, N, 1, background=False, heal_timeout_s=8, run_id=run_id)
    mgr.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    return mgr


@pytest.mark.parametrize("source", ["older round", "other run"])
def test_healing_skips_a_global_state_from_elsewhere(store: RunStore, source: str) -> None:
    """A replica heals after missing round 1: global/1 is a copy of global/0 (which would
    put round 0's weights under round 1's number) or another run's global/1. It is refused
    and reported, and the replica waits for a usable one as if global/1 were missing: it
    heals from global/2 once that is written."""
    models = {r: torch.nn.Linear(3, 2) for r in range(3)}
    writer = _manager(store, "t", torch.nn.Linear(3, 2))
    writer._write_global(0, _global_payload(models[0], 0))
    key = layout.global_part_key(1, 0, 1)
    if source == "older round":
        store.put(key, store.get(layout.global_part_key(0, 0, 1)))
    else:
        other = other_run_store()
        _manager(other, "other", models[1])._write_global(1, _global_payload(models[1], 1))
        store.put(key, other.get(key))
    store.put_json("rounds/1/quorum.json", {"round": 1, "run_id": "t"})  # the others did

    model = torch.nn.Linear(3, 2)
    healer = _manager(store, "t", model)
    healer.base_round = 0
    later = threading.Timer(0.5, lambda: writer._write_global(2, _global_payload(models[2], 2)))
    later.start()
    try:
        assert healer.heal(1) is True
    finally:
        later.join()
    assert healer.last_healed_from == 2 and healer.base_round == 2
    assert torch.equal(model.weight, models[2].weight)
    assert rejected_objects(healer.rejected) == [key], healer.rejected


def test_healing_with_only_a_refused_global_fails_clearly(store: RunStore) -> None:
    """The refused global state is the only one at or after the round needed: healing ends
    with HealError naming it, after the heal timeout, without loading anything."""
    writer = _manager(store, "t", torch.nn.Linear(3, 2))
    writer._write_global(0, _global_payload(torch.nn.Linear(3, 2), 0))
    store.put(layout.global_part_key(1, 0, 1), store.get(layout.global_part_key(0, 0, 1)))
    store.put_json("rounds/1/quorum.json", {"round": 1, "run_id": "t"})
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    healer = _manager(store, "t", model)
    healer.heal_timeout_s = 1.0
    healer.base_round = 0
    t0 = time.monotonic()
    with pytest.raises(HealError, match=r"global/1 refused"):
        healer.heal(1)
    assert time.monotonic() - t0 < 10
    assert torch.equal(model.weight, before) and healer.base_round == 0


# ---------------------------------------------------------------- resume (ReplicaContext)
H, ROUNDS = 3, 4
_LOCK = threading.Lock()


def new_run(run_id: str = "resume") -> tuple[RunStore, RunSpec]:
    store = RunStore(f"memory://provenance/{uuid.uuid4().hex}")
    spec = RunSpec(
        run_id=run_id,
        run_uri=store.uri,
        replicas=N,
        sync_every=H,
        rounds=ROUNDS,
        round_timeout_s=30,
    ).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    return store, spec


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with _LOCK:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(store: RunStore, spec: RunSpec, rank: int, stop_after_round: int | None = None):
    ctx = ReplicaContext(store, spec, rank, N, shard_grace_s=2.0)
    model, opt = build()
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:
            g = torch.Generator().manual_seed(ctx.data_seed * 997 + ctx.step)
            x = torch.randn(8, 4, generator=g)
            loss = ((model(x) - x[:, :2]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log_step(loss=loss.item())
            if stop_after_round is not None and ctx.step == (stop_after_round + 1) * H:
                return ctx
    ctx.finish({})
    return ctx


def stopped_run(run_id: str = "resume", after: int = 1) -> tuple[RunStore, RunSpec]:
    """A run of N replicas stopped right after committing round ``after`` (global/<after>,
    its N parts, and every replica's inner/<after> are there; older checkpoints may have
    been collected already). Training is deterministic: the same run stopped after round 0
    holds this run's round-0 objects, bit for bit."""
    store, spec = new_run(run_id)
    run_threads(N, lambda r: train(store, spec, r, stop_after_round=after))
    assert layout.global_parts(store, after) == [
        layout.global_part_key(after, s, N) for s in range(N)
    ]
    assert all(store.exists(layout.inner_key(k, after)) for k in range(N))
    return store, spec


@pytest.mark.parametrize("source", ["older round", "other run"])
def test_resume_skips_a_global_state_from_elsewhere(source: str) -> None:
    """The newest global/1 is a copy of global/0, or another run's global/1 (same model):
    the resuming replica refuses and reports it and resumes from global/0, as when global/1
    is missing."""
    earlier, _ = stopped_run(after=0)  # this run's round-0 objects
    store, spec = stopped_run()
    source_store, source_round = (earlier, 0) if source == "older round" else (None, 1)
    if source_store is None:
        source_store, _ = stopped_run("other")
    for s in range(N):
        key = layout.global_part_key(1, s, N)
        store.put(key, source_store.get(layout.global_part_key(source_round, s, N)))
    # round 0's checkpoint, as the run had it before it was collected
    for key in layout.global_parts(earlier, 0) + [layout.inner_key(k, 0) for k in range(N)]:
        store.put(key, earlier.get(key))
    ctx = ReplicaContext(store, spec, 0, N, shard_grace_s=2.0)
    model, opt = build()
    refused = layout.global_part_key(1, 0, N)  # the first part read
    with ctx.diloco(model, opt):
        assert ctx.resumed_from == 0 and ctx.step == H
        assert rejected_objects(ctx.manager.rejected) == [refused], ctx.manager.rejected


@pytest.mark.parametrize("source", ["other replica", "older round", "other run"])
def test_resume_refuses_an_inner_state_from_elsewhere(source: str) -> None:
    """Replica 0's inner/1 is replica 1's, a copy of its own inner/0, or another run's
    inner/1: it is refused, replica 0 starts its inner optimizer afresh (as when its inner
    state is missing), and the rejection is in its metrics, its result and the summary's
    object list. Both replicas then finish the run together."""
    store, spec = stopped_run()
    key = "replicas/0/inner/1.pt"
    if source == "other replica":
        store.put(key, store.get("replicas/1/inner/1.pt"))
    elif source == "older round":  # this run's own inner/0, as a run stopped then holds it
        earlier, _ = stopped_run(after=0)
        store.put(key, earlier.get("replicas/0/inner/0.pt"))
    else:
        other, _ = stopped_run("other")
        store.put(key, other.get(key))
    out = run_threads(N, lambda r: train(store, spec, r))
    assert not [o for o in out if isinstance(o, BaseException)], out
    ctx0, ctx1 = out
    assert ctx0.resumed_from == 1 and not ctx0.resumed_inner
    assert ctx1.resumed_from == 1 and ctx1.resumed_inner
    result = store.get_json("results/0.json")
    assert result["status"] == "ok"
    assert rejected_objects(result["rejected"]) == [key], result["rejected"]
    metrics = store.get_json("metrics/0/2.json")  # the first round after the resume
    assert rejected_objects(metrics["rejected"]) == [key], metrics["rejected"]
    assert store.get_json("results/1.json")["rejected"] == []
