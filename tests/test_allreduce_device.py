"""The exchange with tensors on an accelerator: each replica's own part of a shard and the
parts it downloads must add up in host memory, and the average must land back in the
tensors, on their device.

On a GPU machine a replica's pseudo-gradients are CUDA tensors. A replica that owns a shard
adds its own part to the downloaded ones in rank order, so from rank 1 on, its own part
comes after a downloaded one; rank 0's comes first. The cases run on every device this
machine has (the CUDA ones are marked ``gpu`` and skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from crf.exchange.allreduce import ObjectStoreAllReduce
from crf.store import RunStore
from tests.conftest import DEVICES, run_threads

SHAPES = [(300,), (17, 9), (1,), (64, 64)]


def _tensors(rank: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["float32", "bfloat16", "int8", "topk4"])
@pytest.mark.parametrize("n", [2, 3])
def test_average_on_the_tensors_device(tmp_path, device: str, wire: str, n: int) -> None:
    store = RunStore(f"file://{tmp_path}/run")

    def replica(rank: int) -> list[torch.Tensor]:
        ar = ObjectStoreAllReduce(
            store, n, rank, run_id="t", num_shards=4, wire_dtype=wire, round_timeout_s=60
        )
        ts = _tensors(rank, device)
        res = ar.allreduce(ts)
        assert res.in_quorum and res.participants == list(range(n))
        return ts

    out = run_threads(n, replica, timeout=120)
    for got in out:
        assert not isinstance(got, BaseException), got
        assert all(t.device.type == device for t in got)
    first = [t.cpu() for t in out[0]]
    for got in out[1:]:  # one average, the same bits on every replica
        assert all(torch.equal(a, b.cpu()) for a, b in zip(first, got, strict=True))
    if wire == "float32":  # exact: fp32 sums in rank order
        want = [sum(_tensors(r, "cpu")[i] for r in range(n)) / n for i in range(len(SHAPES))]
        assert all(torch.equal(a, b) for a, b in zip(first, want, strict=True))
    else:  # lossy wires: close to the mean, and the same as on the CPU
        ref = run_threads(n, lambda r: _cpu_average(tmp_path, n, r, wire), timeout=120)
        assert all(torch.equal(a, b) for a, b in zip(first, ref[0], strict=True))


def _cpu_average(tmp_path, n: int, rank: int, wire: str) -> list[torch.Tensor]:
    store = RunStore(f"file://{tmp_path}/cpu-run")
    ar = ObjectStoreAllReduce(
        store, n, rank, run_id="c", num_shards=4, wire_dtype=wire, round_timeout_s=60
    )
    ts = _tensors(rank, "cpu")
    ar.allreduce(ts)
    return ts
