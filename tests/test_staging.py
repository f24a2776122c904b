"""A round's tensors in host memory (crf.exchange.staging) and the time a round spends in
each phase (crf.exchange.phases): CPU tensors are used as they are, device tensors go to
host buffers kept per layout and copied in chunks whose arrival the upload waits for in
order; every round reports its seconds per phase, and a replica's round record carries them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from crf import layout
from crf.exchange import staging
from crf.exchange.allreduce import ObjectStoreAllReduce
from crf.exchange.phases import PHASES, PhaseClock
from crf.exchange.staging import HostStaging, Staged
from crf.replica.rounds import merge_syncs
from crf.store import RunStore
from tests.conftest import DEVICES, run_threads


def test_cpu_tensors_are_used_in_place() -> None:
    """On the CPU the exchange reads and writes the caller's tensors: no copy at all."""
    ts = [torch.randn(10), torch.randn(3, 4)]
    staged = HostStaging().stage(ts)
    assert all(h is t for h, t in zip(staged.host, ts, strict=True))
    assert not staged.on_device and staged.events == []
    staged.wait_until(10**9)
    staged.copy_back()  # nothing to copy
    assert all(h is t for h, t in zip(staged.host, ts, strict=True))


class _Event:
    def __init__(self, log: list[int], start: int) -> None:
        self.log, self.start = log, start

    def synchronize(self) -> None:
        self.log.append(self.start)


def test_a_shard_waits_only_for_the_chunks_it_covers() -> None:
    """Chunks arrive in copy order; encoding values [0, end) waits for every chunk that
    starts before ``end`` and no other."""
    waited: list[int] = []
    staged = Staged([], [], events=[(s, _Event(waited, s)) for s in (0, 100, 200, 300)])
    staged.wait_until(0)
    assert waited == []
    staged.wait_until(100)
    assert waited == [0]
    staged.wait_until(150)
    assert waited == [0, 100]
    staged.wait_until(150)  # already here
    assert waited == [0, 100]
    staged.finish()
    assert waited == [0, 100, 200, 300]


@pytest.mark.parametrize("wire", ["float32", "int8"])
def test_every_round_reports_its_phases(tmp_path, wire: str) -> None:
    store = RunStore(f"file://{tmp_path}/run")

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 2, rank, run_id="t", wire_dtype=wire)
        return [ar.allreduce([torch.randn(5000)], round=r) for r in range(2)]

    for results in run_threads(2, replica, timeout=120):
        assert not isinstance(results, BaseException), results
        for res in results:
            assert set(res.phases) <= set(PHASES), res.phases
            assert {"encode", "upload", "wait", "download", "decode"} <= set(res.phases)
            assert all(v >= 0 for v in res.phases.values())
            assert sum(res.phases.values()) <= res.seconds + 1e-3
            assert res.to_dict()["phases"] == res.phases


def test_a_nested_phase_pauses_the_one_around_it() -> None:
    totals: dict[str, float] = {}
    clock = PhaseClock(totals)
    with clock.phase("decode"):
        with clock.phase("download"):
            pass
    clock.add("d2h", 0.5)
    clock.close()
    assert set(totals) == {"decode", "download", "d2h"} and totals["d2h"] == 0.5


def test_round_records_carry_the_phases() -> None:
    """Additive: a record written before phases were timed reads as {}; an outer round of
    several syncs (fragments) sums them."""
    assert layout.RoundMetrics.from_dict({"round": 1, "rank": 0}).phases_s == {}
    rec = layout.RoundMetrics.from_dict({"round": 1, "rank": 0, "phases_s": {"upload": 1.5}})
    assert rec.to_dict()["phases_s"] == {"upload": 1.5}
    entry = {
        "exchange_round": 0,
        "committed": True,
        "participants": [0, 1],
        "sync_s": 0.0,
        "transfer_s": 1.0,
        "bytes_up": 1,
        "bytes_down": 1,
        "error": None,
        "rejected": [],
        "healed_from": None,
    }
    merged = merge_syncs(
        0,
        [
            entry | {"phases_s": {"upload": 1.0, "wait": 0.25}},
            entry | {"phases_s": {"upload": 2.0}},
        ],
    )
    assert merged["phases_s"] == {"upload": 3.0, "wait": 0.25}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_go_through_pinned_buffers_kept_per_layout(monkeypatch) -> None:
    monkeypatch.setattr(staging, "CHUNK_BYTES", 4096)  # several chunks per tensor
    ts = [torch.randn(5000, device="cuda"), torch.randn(7, 9, device="cuda")]
    host = HostStaging()
    assert host.reserve(ts) > 0  # page-locked before the first round, which takes them
    reserved = [b.data_ptr() for b in host._host_buffers(ts)]
    staged = host.stage(ts)
    assert [h.data_ptr() for h in staged.host] == reserved
    assert staged.on_device and len(staged.events) > 2
    assert all(h.is_pinned() and h.device.type == "cpu" for h in staged.host)
    staged.wait_until(5000)
    assert torch.equal(staged.host[0], ts[0].cpu())
    staged.finish()
    assert torch.equal(staged.host[1], ts[1].cpu())
    for h in staged.host:
        h.mul_(2)
    staged.copy_back()
    assert torch.equal(ts[0].cpu(), staged.host[0])
    again = host.stage(ts)  # the next round: the same buffers
    assert [h.data_ptr() for h in again.host] == [h.data_ptr() for h in staged.host]
    again.finish()


def test_a_layouts_buffers_are_views_of_one_block() -> None:
    """A layout's host buffers share one allocation, each view aligned and apart from the
    others; a tensor already on the CPU gets none (a round uses it in place)."""
    layout_ = (
        ((5, 3), torch.float32, torch.device("meta")),
        ((7,), torch.float32, torch.device("cpu")),
        ((11,), torch.bfloat16, torch.device("meta")),
        ((2, 2), torch.float64, torch.device("meta")),
    )
    bufs = staging.host_block(layout_, pin=False)
    assert bufs[1] is None
    views = [b for b in bufs if b is not None]
    assert [(tuple(b.shape), b.dtype) for b in views] == [
        ((5, 3), torch.float32),
        ((11,), torch.bfloat16),
        ((2, 2), torch.float64),
    ]
    base = views[0].untyped_storage().data_ptr()
    assert all(b.untyped_storage().data_ptr() == base for b in views)
    assert all((b.data_ptr() - base) % staging.ALIGN_BYTES == 0 for b in views)
    for i, b in enumerate(views):
        b.fill_(i + 1)
    assert [float(b.flatten()[0]) for b in views] == [1.0, 2.0, 3.0]  # none overlaps


def test_a_reservation_is_what_the_first_round_uses_and_a_wrong_one_goes() -> None:
    """``reserve`` allocates a layout's buffers before any round and the first round of that
    layout takes them (no second allocation); a reservation for a layout no round uses is
    let go at the first round of another."""
    ts = [torch.empty(5000, device="meta"), torch.empty(7, 9, device="meta")]
    host = HostStaging()
    n = host.reserve(ts)
    assert n == host.nbytes >= (5000 + 63) * 4
    assert host.reserve(ts) == 0  # once
    assert HostStaging().reserve([torch.zeros(3)]) == 0  # CPU tensors: nothing to copy
    reserved = [b.data_ptr() for b in host._host_buffers(ts)]
    assert host.nbytes == n  # used, not allocated again
    again = [b.data_ptr() for b in host._host_buffers(ts)]
    assert again == reserved

    wrong = HostStaging()
    wrong.reserve([torch.empty(100, device="meta")])
    wrong._host_buffers(ts)  # another layout: the unused reservation goes
    assert wrong.nbytes == n


@pytest.mark.parametrize("device", DEVICES)
def test_diloco_s_outer_work_counts_as_the_sync_s_not_as_training(
    tmp_path, monkeypatch, device: str
) -> None:
    """What torchft's DiLoCo does at a sync outside the manager (pseudo-gradients, restoring
    the global weights, the outer step, saving its global copy) is crf's time: the round
    record has it as the ``outer`` phase, inside ``sync_s``, and not in ``compute_s``. A
    slow save of the global copy (0.5 s at each sync) shows where it lands. The last
    round's global state holds the final weights, in the model and in DiLoCo's global copy
    (on a GPU that copy is page-locked and filled asynchronously: the state waits for it)."""
    import json
    import time

    from safetensors.torch import load_file
    from torchft.local_sgd import _StreamingDiLoCoFragment

    from crf.replica.context import ReplicaContext
    from crf.spec import RunSpec
    from tests.test_bucketization import build

    save = _StreamingDiLoCoFragment.save_parameters
    syncing: set[int] = set()

    def slow_save(self) -> None:
        if threading.get_ident() in syncing:  # at a sync, not when DiLoCo starts
            time.sleep(0.5)
        save(self)

    monkeypatch.setattr(_StreamingDiLoCoFragment, "save_parameters", slow_save)
    store = RunStore(f"file://{tmp_path}/run")
    spec = RunSpec(run_id="run", run_uri=store.uri, replicas=2, sync_every=2, rounds=2,
                   round_timeout_s=30).validate()  # fmt: skip
    store.put_if_absent("run.json", spec.to_json().encode())

    def train(rank: int) -> dict[str, torch.Tensor]:
        ctx = ReplicaContext(store, spec, rank, 2, shard_grace_s=2.0)
        model = build().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with ctx.diloco(model, opt):
            syncing.add(threading.get_ident())
            while ctx.step < ctx.total_steps:
                # a generator of its own: the global one is what the other replica's
                # build() seeds and draws its initial weights from
                g = torch.Generator().manual_seed(1000 * rank + ctx.step)
                loss = model(torch.randn(8, 4, generator=g).to(device)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ctx.log_step(loss=loss.item())
        ctx.finish({})
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    finals = run_threads(2, train, timeout=120)
    assert all(isinstance(f, dict) for f in finals), finals
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    saved: dict[str, torch.Tensor] = {}
    for part in (tmp_path / "run" / "global" / "1").glob("*.safetensors"):
        saved.update(load_file(str(part)))
    copies = {n.rsplit("/original_parameters/", 1)[1]: t for n, t in saved.items()
              if "/original_parameters/" in n}  # fmt: skip
    assert set(copies) == {n for n, _ in build().named_parameters()}
    for name, t in copies.items():
        assert torch.equal(t, finals[0][name]), name
        assert torch.equal(saved[f"model/{name}"], finals[0][name]), name
    for rank in range(2):
        records = [json.loads((tmp_path / f"run/metrics/{rank}/{r}.json").read_text())
                   for r in range(2)]  # fmt: skip
        for rec in records:
            assert 0.5 <= rec["phases_s"]["outer"] <= rec["sync_s"], rec
        if device == "cpu":  # 4 tiny steps: the sleeps would have made it at least 1 s
            assert records[-1]["compute_s"] < 1.0, records
