"""``TORCHFT_USE_BUCKETIZATION`` in a replica's environment: torchft's DiLoCo
reads it and would put a sync's tensors in buckets, one allreduce per bucket; crf turns that
off with a log line (``crf.exchange.manager.turn_off_bucketization`` says why) and the run is
the same as without it, bit for bit.

Replicas are threads over one file:// store, each a real ReplicaContext + torchft DiLoCo.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torchft.local_sgd import _StreamingDiLoCoFragment

from crf.replica.context import ReplicaContext
from crf.spec import RunSpec
from crf.store import RunStore
from tests.conftest import run_threads

N, H, ROUNDS = 2, 4, 3
_LOCK = threading.Lock()


def build() -> torch.nn.Module:
    with _LOCK:  # replicas are threads: seeding the global RNG must not interleave
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(store: RunStore, spec: RunSpec, rank: int) -> dict[str, torch.Tensor]:
    ctx = ReplicaContext(store, spec, rank, N, shard_grace_s=2.0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:
            g = torch.Generator().manual_seed(ctx.data_seed * 997 + ctx.step)
            x = torch.randn(8, 4, generator=g)
            loss = ((model(x) - x[:, :2]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log_step(loss=loss.item())
    ctx.finish({})
    assert ctx.manager is not None and ctx.manager.rounds_committed == ctx.spec.exchange_rounds
    return {k: v.clone() for k, v in model.state_dict().items()}


def run(tmp_path: Path, name: str, fragments: int) -> list[Any]:
    store = RunStore(f"file://{tmp_path}/{name}")
    spec = RunSpec(
        run_id=name,
        run_uri=store.uri,
        replicas=N,
        sync_every=H,
        rounds=ROUNDS,
        round_timeout_s=30,
        fragments=fragments,
    ).validate()
    store.put_if_absent("run.json", spec.to_json().encode())
    return run_threads(N, lambda rank: train(store, spec, rank), timeout=120)


@pytest.mark.parametrize("fragments", [1, 2])
def test_bucketization_from_the_environment_is_turned_off_and_said(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fragments: int,
) -> None:
    """With the variable set and buckets of 64 bytes (16 values: several buckets per sync),
    every round commits and the weights are those of a run without it; the log says so."""
    plain = run(tmp_path, "plain", fragments)
    assert not any(isinstance(x, BaseException) for x in plain), plain
    monkeypatch.setenv("TORCHFT_USE_BUCKETIZATION", "True")  # the value torchft checks for
    # bytes, despite the name: the model's 58 values make 4 buckets of 16
    monkeypatch.setattr(_StreamingDiLoCoFragment, "bucket_cap_mb", 64)
    with caplog.at_level(logging.WARNING, logger="crf.exchange.manager"):
        bucketed = run(tmp_path, "bucketed", fragments)
    assert not any(isinstance(x, BaseException) for x in bucketed), bucketed
    for got, want in zip(bucketed, plain, strict=True):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(bucketed[0][k], bucketed[1][k]) for k in bucketed[0])
    said = [r.getMessage() for r in caplog.records if "TORCHFT_USE_BUCKETIZATION" in r.getMessage()]
    assert len(said) == N and "is ignored" in said[0], said  # once per replica
