"""ReplicaContext: a replica that stops mid-run and starts again resumes from global/<r> plus
its own inner-optimizer state and data position, and ends bit-identical to an uninterrupted
run. Replicas are threads over one in-memory store."""

from __future__ import annotations

import json
import random
import threading
import uuid

import numpy as np
import pytest
import torch

from crf import layout
from crf.exchange.manager import ObjectStoreManager
from crf.replica.context import ReplicaContext
from crf.spec import RunSpec
from crf.store import CorruptObjectError, RunStore
from tests.conftest import run_threads

H, ROUNDS, N = 3, 4, 2
_LOCK = threading.Lock()


def new_store(n: int = N, **options) -> tuple[RunStore, RunSpec]:
    store = RunStore(f"memory://resume-test/{uuid.uuid4().hex}")
    spec = RunSpec(
        run_id="resume",
        run_uri=store.uri,
        replicas=n,
        sync_every=H,
        rounds=ROUNDS,
        round_timeout_s=30,
        **options,
    ).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    return store, spec


def train(
    store: RunStore,
    spec: RunSpec,
    rank: int,
    stop_after_round: int | None = None,
    draws: bool = False,
):
    """``draws``: each step also draws noise from the process's random-number generators
    (torch's, Python's, NumPy's), which every (re)start seeds as a job would (one replica
    only: threads share them)."""
    ctx = ReplicaContext(store, spec, rank, spec.replicas, shard_grace_s=2.0)
    with _LOCK:
        torch.manual_seed(ctx.seed)
        random.seed(ctx.seed)
        np.random.seed(ctx.seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with ctx.diloco(model, opt):
        start = ctx.step
        while ctx.step < ctx.total_steps:
            g = torch.Generator().manual_seed(ctx.data_seed * 997 + ctx.step)  # data position
            x = torch.randn(8, 4, generator=g)
            if draws:  # a sampling job: e.g. GRPO's completions
                x = x + torch.randn(8, 4) * random.random() * float(np.random.rand())
            loss = ((model(x) - x[:, :2]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log_step(loss=loss.item())
            if stop_after_round is not None and ctx.step == (stop_after_round + 1) * H:
                return ctx, model, start  # "killed" right after committing that round
    ctx.finish({})
    return ctx, model, start


#: a sparse wire's residual (error feedback) is saved with the inner state: without it the
#: resumed run would send other values and end with other weights
SPARSE = {"wire_dtype": "topk4", "sparse_density": 0.1}
SPARSE_FRAGMENTS = {"wire_dtype": "topk8", "sparse_outer": "diloco", "fragments": 3}


@pytest.mark.parametrize(
    ("n", "options"),
    [(N, {}), (N, SPARSE), (N, SPARSE_FRAGMENTS), (1, {}), (1, SPARSE_FRAGMENTS)],
    ids=["fp32", "topk", "frag", "one-replica", "one-replica-frag"],
)
def test_resume_is_bit_identical_to_uninterrupted(n: int, options: dict) -> None:
    """Also for a run of one replica: it exchanges nothing, but it checkpoints as any run
    does, so a killed run continues where it was instead of starting over."""
    ref_store, ref_spec = new_store(n, **options)
    ref = run_threads(n, lambda r: train(ref_store, ref_spec, r))
    ref_state = ref[0][1].state_dict()

    store, spec = new_store(n, **options)
    run_threads(n, lambda r: train(store, spec, r, stop_after_round=1))
    f = spec.fragments  # exchange rounds per outer round
    last = 2 * f - 1  # the exchange round the replicas were killed after
    assert store.list("global")[-1] == str(last)
    out = run_threads(n, lambda r: train(store, spec, r))  # restart everyone
    for ctx, model, start in out:
        assert ctx.resumed_from == last and ctx.resumed_inner and start == 2 * H
        assert ctx.manager.rounds_committed == (ROUNDS - 2) * f
        assert all(torch.equal(ref_state[k], v) for k, v in model.state_dict().items())
        res = json.loads(store.get(f"results/{ctx.rank}.json"))
        assert res["status"] == "ok" and res["resumed_from"] == last
    # no round was lost and none repeated: one metrics file per round per replica
    assert store.list("metrics/0") == [f"{r}.json" for r in range(ROUNDS)]


@pytest.mark.parametrize("options", [{}, SPARSE_FRAGMENTS], ids=["fp32", "frag"])
def test_a_replica_alone_resumes_from_its_newest_whole_round(options: dict) -> None:
    """A run of one replica killed after a round committed but before its background writer
    uploaded that round's inner state: the restart resumes from the round before (global
    state and inner state both there) and trains the round again, so the run still ends
    bit-identical to one nobody killed; going on from the newer global state would start
    a fresh inner optimizer."""
    ref_store, ref_spec = new_store(1, **options)
    ref_state = train(ref_store, ref_spec, 0)[1].state_dict()

    store, spec = new_store(1, **options)
    f = spec.fragments
    ctx, _, _ = train(store, spec, 0, stop_after_round=2)
    ctx.manager.close()  # its writes land; then the newest inner state is lost
    newest, whole = 3 * f - 1, 2 * f - 1
    store.delete(layout.inner_key(0, newest))
    assert layout.global_rounds(store)[-1] == newest
    ctx, model, start = train(store, spec, 0)
    assert ctx.resumed_from == whole and ctx.resumed_inner and start == 2 * H
    assert all(torch.equal(ref_state[k], v) for k, v in model.state_dict().items())
    assert json.loads(store.get("results/0.json"))["status"] == "ok"


def test_a_resumed_replica_draws_on_where_its_random_generators_were() -> None:
    """A job whose steps draw from the random-number generators, seeded again by every
    (re)start: the inner state saves the generators' states at the round's end and a resume
    restores them, so the run still ends bit-identical to one nobody stopped."""
    ref_store, ref_spec = new_store(1)
    ref_state = train(ref_store, ref_spec, 0, draws=True)[1].state_dict()

    store, spec = new_store(1)
    ctx, _, _ = train(store, spec, 0, stop_after_round=1, draws=True)
    ctx.manager.close()  # its writes land
    ctx, model, start = train(store, spec, 0, draws=True)
    assert ctx.resumed_from == 1 and ctx.resumed_inner and start == 2 * H
    assert all(torch.equal(ref_state[k], v) for k, v in model.state_dict().items())


def test_an_inner_state_without_random_generators_still_loads() -> None:
    """An older run's inner states (the optimizer's state alone, or the dict without
    ``rng``) load as they did: the generators stay as the job seeded them."""
    from crf.exchange import inner_state

    bare = {"state": {}, "param_groups": []}
    assert inner_state.split(bare).optimizer is bare and inner_state.split(bare).rng is None
    older = {"inner_optimizer": bare, "error_feedback": {"-": torch.zeros(2)}}
    assert inner_state.split(older).rng is None
    saved = inner_state.compose(bare, rng=inner_state.rng_states())
    assert inner_state.split(saved).optimizer is bare and saved["rng"] is not None


def test_keep_rounds_1_keeps_the_checkpoint_before_until_the_newest_is_whole() -> None:
    """global/<r> lands before the replicas' inner states of r, written after it in the
    background: until they land, the checkpoint before stays, even with keep_rounds=1 (a
    kill in between resumes from it, exactly); once they have, only the newest is kept."""
    store = RunStore(f"memory://resume-test/{uuid.uuid4().hex}")
    m = ObjectStoreManager(store, 1, 0, run_id="t", keep_rounds=1)
    for r in (0, 1):
        store.put(layout.global_part_key(r, 0, 1), b"state")
    store.put(layout.inner_key(0, 0), b"inner")
    assert m.checkpoints.keep_from(1) == 0
    store.put(layout.inner_key(0, 1), b"inner")
    assert m.checkpoints.keep_from(1) == 1
    m.close()


def test_heartbeat_metrics_and_result_written() -> None:
    store, spec = new_store()
    out = run_threads(N, lambda r: train(store, spec, r))
    for ctx, _, _ in out:
        state = json.loads(store.get(f"replicas/{ctx.rank}/state.json"))
        assert state["phase"] == "done" and state["step"] == ROUNDS * H
        m = json.loads(store.get(f"metrics/{ctx.rank}/2.json"))
        assert m["committed"] and m["participants"] == [0, 1] and m["loss"] is not None
        assert m["bytes_up"] > 0 and m["sync_s"] >= 0
        # the heartbeat carries the last round's mean loss (what the tables call "loss")
        last = json.loads(store.get(f"metrics/{ctx.rank}/{ROUNDS - 1}.json"))
        assert state["last_round"] == ROUNDS - 1 and state["round_loss"] == last["loss"]
        assert state["round_sync_s"] == last["sync_s"]
        res = json.loads(store.get(f"results/{ctx.rank}.json"))
        assert res["rounds_committed"] == ROUNDS and res["steps"] == ROUNDS * H
    hashes = {json.loads(store.get(f"results/{r}.json"))["weights_sha256"] for r in range(N)}
    assert len(hashes) == 1


@pytest.mark.parametrize("options", [{}, SPARSE_FRAGMENTS], ids=["fp32", "frag"])
def test_a_replica_resumed_after_its_last_round_keeps_the_loss_it_finished_with(
    options: dict,
) -> None:
    """Resumed once every round was trained (its driver died before the summary), a replica
    trains nothing; its result and heartbeat still carry the last round's loss (from its
    round record), not none."""
    store, spec = new_store(**options)
    run_threads(N, lambda r: train(store, spec, r))
    finished = [json.loads(store.get(f"results/{r}.json"))["final_loss"] for r in range(N)]
    assert None not in finished
    out = run_threads(N, lambda r: train(store, spec, r))
    for ctx, _, start in out:
        assert start == ROUNDS * H and ctx.resumed_from == ROUNDS * spec.fragments - 1
        res = json.loads(store.get(f"results/{ctx.rank}.json"))
        assert res["final_loss"] == finished[ctx.rank], res
        state = json.loads(store.get(f"replicas/{ctx.rank}/state.json"))
        assert state["last_round"] == ROUNDS - 1 and state["round_loss"] == finished[ctx.rank]


def test_resume_falls_back_when_the_newest_global_is_corrupt() -> None:
    """A bit-flipped newest global/<r> is rejected and the replica resumes from the one
    before it (the exchange then marks it stale and it heals to the newer round)."""
    store, spec = new_store()
    run_threads(N, lambda r: train(store, spec, r, stop_after_round=1))
    key = layout.global_part_key(1, 0, N)
    blob = bytearray(store.get(key))
    blob[-5] ^= 0xFF
    store.put(key, bytes(blob))
    ctx = ReplicaContext(store, spec, 0, N, shard_grace_s=2.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with ctx.diloco(model, opt):
        assert ctx.resumed_from == 0 and ctx.step == H


def test_resume_skips_a_newest_global_with_a_part_missing() -> None:
    """The newest global/<r> lost one of its parts (its writer was killed before it landed):
    the round is not a state, nothing is refused, and the replica resumes from the round
    before it."""
    store, spec = new_store()
    run_threads(N, lambda r: train(store, spec, r, stop_after_round=1))
    assert layout.global_parts(store, 1) == [layout.global_part_key(1, s, N) for s in range(N)]
    store.delete(layout.global_part_key(1, N - 1, N))
    ctx = ReplicaContext(store, spec, 0, N, shard_grace_s=2.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert ctx.resume_step() == H  # where the data pipeline starts: after round 0
    with ctx.diloco(model, opt):
        assert ctx.resumed_from == 0 and ctx.step == H
        assert ctx.manager.rejected == []


def test_inner_states_round_trip_and_old_ones_are_collected() -> None:
    """A replica's inner state after round r lands at its layout key (written in the
    background), reads back as saved, is refused (and reported) under another model's
    layout, and only the last keep_rounds rounds' states are kept."""
    store = RunStore(f"memory://resume-test/{uuid.uuid4().hex}")
    m = ObjectStoreManager(store, N, 1, run_id="t", keep_rounds=2, async_checkpoints=True)
    m.state_layout = "this-model"
    for r in range(5):
        m.checkpoints.save_inner(r, {"r": torch.tensor(r)}, step=r * H)
    m.drain()
    assert layout.inner_rounds(store, 1) == [3, 4]
    assert torch.equal(m.checkpoints.load_inner(4)["r"], torch.tensor(4))
    m.state_layout = "another-model"
    with pytest.raises(CorruptObjectError):
        m.checkpoints.load_inner(4)
    assert len(m.rejected) == 1 and layout.inner_key(1, 4) in str(m.rejected[0])
    m.close()
