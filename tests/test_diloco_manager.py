"""torchft's DiLoCo, unmodified, over ObjectStoreManager: checked against a hand-written
reference of the DiLoCo update, FedAvg equivalence, and healing of a replica left out."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torchft.local_sgd import DiLoCo

from crf import layout
from crf.exchange.manager import ObjectStoreManager
from crf.store import RunStore
from tests.conftest import run_threads

H, ROUNDS, INNER_LR = 3, 3, 0.1


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


_INIT_LOCK = threading.Lock()


def init_model() -> torch.nn.Linear:
    with _INIT_LOCK:  # replicas are threads here: seeding the global RNG must not interleave
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)


def inner_grad(params: dict[str, torch.Tensor], x, y) -> dict[str, torch.Tensor]:
    w = params["weight"].clone().requires_grad_(True)
    b = params["bias"].clone().requires_grad_(True)
    loss = ((x @ w.T + b - y) ** 2).mean()
    gw, gb = torch.autograd.grad(loss, [w, b])
    return {"weight": gw, "bias": gb}


def reference(n: int, outer_lr: float, momentum: float, nesterov: bool) -> dict[str, torch.Tensor]:
    """DiLoCo by hand: pseudo-gradient = θ_global − θ_local, averaged; outer SGD(+Nesterov)."""
    theta = {k: v.detach().clone() for k, v in init_model().state_dict().items()}
    buf: dict[str, torch.Tensor] = {}
    step = 0
    for _ in range(ROUNDS):
        locals_ = []
        for r in range(n):
            p = {k: v.clone() for k, v in theta.items()}
            for s in range(H):
                g = inner_grad(p, *batch(r, step + s))
                p = {k: p[k] - INNER_LR * g[k] for k in p}
            locals_.append(p)
        step += H
        for k in theta:
            acc = (theta[k] - locals_[0][k]).clone()
            for p in locals_[1:]:
                acc += theta[k] - p[k]
            delta = acc / n
            if momentum:
                buf[k] = delta.clone() if k not in buf else momentum * buf[k] + delta
                upd = delta + momentum * buf[k] if nesterov else buf[k]
            else:
                upd = delta
            theta[k] = theta[k] - outer_lr * upd
    return theta


def train_replica(
    store: RunStore,
    n: int,
    rank: int,
    *,
    outer_lr: float,
    momentum: float,
    nesterov: bool,
    min_replicas: int | None = None,
    round_timeout_s: float = 30,
    slow: dict | None = None,
    rounds: int = ROUNDS,
    checkpoint_every: int = 1,
    catch_up: bool = True,
    **manager_options: Any,
) -> tuple[torch.nn.Module, ObjectStoreManager, list[bool]]:
    model = init_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=momentum, nesterov=nesterov)
    mgr = ObjectStoreManager(
        store,
        n,
        rank,
        heal_timeout_s=20,
        run_id="t",
        min_replicas=min_replicas,
        round_timeout_s=round_timeout_s,
        shard_grace_s=1.0,
        catch_up=catch_up,
        checkpoint_every=checkpoint_every,
        **manager_options,
    )
    mgr.final_round = rounds - 1
    mgr.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    commits = []
    with DiLoCo(mgr, [model], inner, outer, sync_every=H, use_bucketization=False) as d:
        step = 0
        while step < rounds * H:
            if slow and step in slow:
                time.sleep(slow[step])
            x, y = batch(rank, step)
            loss = ((model(x) - y) ** 2).mean()
            inner.zero_grad()
            loss.backward()
            inner.step()
            step += 1
            if step % H == 0:
                commits.append(mgr.last_committed)
                mgr.after_outer_step()
                # a healed replica jumps to the round it healed into (as ReplicaContext does)
                step = max(step, mgr.current_step() * H)
        assert d is not None
    return model, mgr, commits


@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_handwritten_diloco_nesterov(store: RunStore, n: int) -> None:
    out = run_threads(
        n, lambda r: train_replica(store, n, r, outer_lr=0.7, momentum=0.9, nesterov=True)
    )
    want = reference(n, 0.7, 0.9, True)
    for model, mgr, commits in out:
        assert commits == [True] * ROUNDS and mgr.rounds_committed == ROUNDS
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)
    first = out[0][0].state_dict()
    for model, _, _ in out[1:]:  # bit-identical across replicas
        assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())


def test_fedavg_equivalence_at_outer_lr_1(store: RunStore) -> None:
    """Outer SGD lr=1 without momentum: the new global is the plain mean of local weights."""
    n = 2
    out = run_threads(
        n, lambda r: train_replica(store, n, r, outer_lr=1.0, momentum=0.0, nesterov=False)
    )
    theta = {k: v.clone() for k, v in init_model().state_dict().items()}
    step = 0
    for _ in range(ROUNDS):  # FedAvg by hand
        locals_ = []
        for r in range(n):
            p = {k: v.clone() for k, v in theta.items()}
            for s in range(H):
                g = inner_grad(p, *batch(r, step + s))
                p = {k: p[k] - INNER_LR * g[k] for k in p}
            locals_.append(p)
        step += H
        theta = {k: sum(p[k] for p in locals_) / n for k in theta}
    for model, _, _ in out:
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, theta[k], rtol=1e-5, atol=1e-6)


def _late_for_round_0(
    store: RunStore, sleep_s: float = 2.0, timeout_s: float = 0.6, **kw: Any
) -> list:
    """Three replicas; replica 2 sleeps through round 0's deadline, the others commit it."""
    return run_threads(
        3,
        lambda r: train_replica(
            store,
            3,
            r,
            outer_lr=0.7,
            momentum=0.9,
            nesterov=True,
            min_replicas=2,
            round_timeout_s=timeout_s,
            slow={H - 1: sleep_s} if r == 2 else None,
            **kw,
        ),
    )


def _assert_identical(out: list) -> None:
    s0 = out[0][0].state_dict()
    for m, _, _ in out[1:]:
        assert all(torch.equal(s0[k], v) for k, v in m.state_dict().items())


def test_late_replica_takes_the_published_average(store: RunStore) -> None:
    """Replica 2 is late for round 0 (it wakes at 3 s, the deadline is 2 s): the others
    commit without it. Its base is theirs and they have not decided round 1 yet (they wait
    for it until 4 s), so it takes round 0's published average as its own (P down, no
    checkpoint load), commits the round too, is on time for round 1, and ends bit-identical."""
    out = _late_for_round_0(store, sleep_s=3.0, timeout_s=2.0)
    (_, g0, c0), (_, _, c1), (_, g2, c2) = out
    assert c0 == [True] * ROUNDS and c1 == [True] * ROUNDS and c2 == [True] * ROUNDS
    assert g2.rounds_caught_up == [0] and g2.rounds_missed == []
    assert g2.last_healed_from is None and g2.ckpt_bytes_down == 0
    assert 2 not in g0.exchange.history[0].participants
    assert g2.current_step() == ROUNDS
    _assert_identical(out)


@pytest.mark.parametrize("catch_up", [False, True])
def test_replica_outside_quorum_heals_and_rejoins(store: RunStore, catch_up: bool) -> None:
    """Replica 2 wakes when the others are rounds ahead (or it may not catch up): it gets
    should_commit() == False (no exception), heals from global/<r>, and ends identical."""
    out = _late_for_round_0(store, catch_up=catch_up)
    (_, _, c0), (_, _, c1), (_, g2, c2) = out
    assert c0 == [True] * ROUNDS and c1 == [True] * ROUNDS
    assert c2[0] is False and g2.rounds_missed[0] == 0 and g2.last_healed_from is not None
    # it never lags: it healed into a round the others committed and ends on the last one
    assert g2.current_step() == ROUNDS
    _assert_identical(out)


def test_checkpoint_every_writes_periodic_and_final_globals(store: RunStore) -> None:
    """checkpoint_every=2 over 5 rounds: global/1, global/3 and the last round's global/4 are
    written (and nothing else: older ones are collected once a newer one is whole, as nothing
    here saves an inner state); the weights are the same as with a checkpoint every round."""
    written: list[str] = []
    put = store._put

    def recording(path: str, data, **kw):
        if "/global/" in f"/{path}":
            written.append(path)
        return put(path, data, **kw)

    store._put = recording  # type: ignore[method-assign]
    out = run_threads(
        2,
        lambda r: train_replica(
            store, 2, r, outer_lr=0.7, momentum=0.9, nesterov=True, rounds=5, checkpoint_every=2
        ),
    )
    for _, mgr, commits in out:
        mgr.drain()
        assert commits == [True] * 5
    rounds = {int(p.split("global/")[1].split("/")[0]) for p in written}
    assert rounds == {1, 3, 4} and len(written) == 2 * 3, written  # 2 parts each
    assert layout.global_rounds(store, complete=True)[-1] == 4
    ref_store = RunStore(f"memory://ckpt-ref/{time.time_ns()}")
    ref = run_threads(
        2,
        lambda r: train_replica(
            ref_store, 2, r, outer_lr=0.7, momentum=0.9, nesterov=True, rounds=5
        ),
    )
    want = ref[0][0].state_dict()
    kept = layout.global_rounds(ref_store)  # the newest whole one, and one being written
    assert kept[-1] == 4 and len(kept) <= 2, kept
    for model, _, _ in out:
        assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    assert out[0][1].ckpt_bytes_up < ref[0][1].ckpt_bytes_up


def test_checkpoint_on_request_heals_a_replica(store: RunStore) -> None:
    """checkpoint_every larger than the run: only the last round's global is due. Replica 2
    wakes up after the others committed several rounds without it (no catch-up), asks for a
    global state under heal/, the lowest participant writes the newest one it holds while
    it waits in the next quorum, and replica 2 heals from it and ends identical."""
    out = _late_for_round_0(store, catch_up=False, rounds=8, checkpoint_every=100)
    (_, g0, c0), _, (_, g2, c2) = out
    for _, mgr, _ in out:
        mgr.drain()
    assert c2[0] is False and g2.last_healed_from is not None and g2.ckpt_bytes_down > 0
    # healed from a global written on request: not the last round's (that one is due anyway)
    assert g2.last_healed_from < 7
    assert store.list("heal") == []  # the request was served and removed
    assert "7" in store.list("global") and len(store.list("global")) < 8
    _assert_identical(out)


def test_exchange_failure_gives_false_not_exception(store: RunStore) -> None:
    """Fewer than min_replicas arrive: should_commit() is False and step() does not raise."""
    model, mgr, commits = train_replica(
        store, 2, 0, outer_lr=0.7, momentum=0.9, nesterov=True, min_replicas=2, round_timeout_s=0.2
    )
    assert commits == [False] * ROUNDS
    assert "QuorumTimeout" in (mgr.last_error or "")
    # weights were restored to the global copy every round: still the initial weights
    init = init_model().state_dict()
    assert all(torch.equal(init[k], v) for k, v in model.state_dict().items())
