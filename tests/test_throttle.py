"""crf.store.throttle: a RunStore made slow on purpose (bench/overlap.py) still behaves like
the store it wraps, and counts what went through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from crf.store import RunStore
from crf.store.codec import decode_tensor, encode_tensor_parts
from crf.store.throttle import Throttle, throttle


def test_throttled_store_passes_everything_through_and_counts(tmp_path: Path) -> None:
    import torch

    store = throttle(RunStore(f"file://{tmp_path}/run"), latency_s=0.0, mb_per_s=1000)
    t = torch.arange(10, dtype=torch.float32)
    store.put("a/x", encode_tensor_parts(t, {"k": 1}), durable=False)
    assert store.put_if_absent("a/y", b"12") and not store.put_if_absent("a/y", b"34")
    size = sum(memoryview(b).nbytes for b in encode_tensor_parts(t, {"k": 1}))
    counts = store.throttle  # type: ignore[attr-defined]
    assert counts.bytes == {"up": size + 4, "down": 0}  # both creates paid for the link
    back, meta = decode_tensor(store.get("a/x"))
    assert torch.equal(back, t) and meta["k"] == 1
    assert counts.bytes["down"] == size
    assert store.list("a") == ["x", "y"] and store.exists("a/y")
    store.delete("a/y")
    assert counts.requests == 7


def test_throttle_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        Throttle(latency_s=-1)
    with pytest.raises(ValueError):
        Throttle(mb_per_s=0)
