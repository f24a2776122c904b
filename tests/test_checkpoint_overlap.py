"""Global checkpoints off the training thread (async_checkpoints): the encode and upload are
not training time, a new snapshot waits for the previous write (one held at most), and a
write that fails still fails the replica. Two replicas in threads over torchft's DiLoCo, with
a store whose global/ uploads are slow or broken on purpose."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from crf import layout
from crf.exchange.checkpoints import Checkpoints
from crf.store import RunStore
from tests.conftest import run_threads
from tests.test_diloco_manager import H, train_replica

SLOW_S = 1.0  # each global/ upload takes this long


def _store_with_global_puts(action: Callable[[str], None]) -> RunStore:
    """A memory store that calls ``action(path)`` before each global/ upload."""
    store = RunStore(f"memory://ckpt-overlap/{uuid.uuid4().hex}")
    store.retries = 0
    put = store._put

    def hooked(path: str, data: Any, *, exclusive: bool, **kw: Any) -> bool:
        if "/global/" in f"/{path}":
            action(path)
        return put(path, data, exclusive=exclusive, **kw)

    store._put = hooked  # type: ignore[method-assign]
    return store


def _train(store: RunStore, rounds: int, **kw: Any) -> list[Any]:
    out = run_threads(
        2,
        lambda r: train_replica(
            store, 2, r, outer_lr=0.7, momentum=0.9, nesterov=True, rounds=rounds, **kw
        ),
    )
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def test_global_upload_is_not_blocked_time() -> None:
    """Two rounds, each global/ upload taking SLOW_S: the writer (rank 0) is blocked less than
    one upload in all (the copy only), and both states land and read back as the weights."""
    puts: list[str] = []
    store = _store_with_global_puts(lambda path: (puts.append(path), time.sleep(SLOW_S)))
    # the second round's inner steps outlast the first upload: no back-pressure wait
    out = _train(store, 2, async_checkpoints=True, slow={H: SLOW_S * 1.5})
    model, mgr, commits = out[0]
    assert commits == [True, True]
    assert mgr.blocked_s < SLOW_S, mgr.blocked_s
    assert mgr.stats.ckpt_foreground_s < SLOW_S
    for _, each, _ in out:  # every replica writes a part
        each.drain()
    # both rounds' parts landed (each replica wrote its own; global/0 is collected once
    # global/1 is whole: a resume needs only the newest)
    for r in (0, 1):
        assert sum("part-0-of-2" in p and f"/global/{r}/" in f"/{p}" for p in puts) == 1, puts
    # global/0 goes once its collector sees global/1 whole, which depends on which part lands
    # last: the newest whole state is round 1 either way
    assert layout.global_rounds(store, complete=True)[-1] == 1
    assert set(layout.global_rounds(store, complete=True)) <= {0, 1}
    saved = mgr.checkpoints.read_global(1)["model"]
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert mgr.ckpt_s >= 2 * SLOW_S  # the uploads ran, in the background


def test_a_snapshot_waits_for_the_previous_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-pressure: rounds faster than the upload; each snapshot after the first is taken
    only once the previous global/ upload finished (never two held in memory)."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    writes = {"n": 0}

    def slow_put(path: str) -> None:
        time.sleep(SLOW_S / 2)
        if "part-0-of-" not in path:  # rank 0's part
            return
        with lock:
            writes["n"] += 1
            events.append(("written", writes["n"]))

    snapshot = Checkpoints.snapshot

    def counting_snapshot(self: Checkpoints, r: int, *args: Any) -> None:
        if self.rank == 0:
            with lock:
                events.append(("snapshot", writes["n"]))
        return snapshot(self, r, *args)

    monkeypatch.setattr(Checkpoints, "snapshot", counting_snapshot)
    store = _store_with_global_puts(slow_put)
    out = _train(store, 3, async_checkpoints=True)
    for _, each, _ in out:  # every replica writes a part
        each.drain()
    commits = out[0][2]
    assert commits == [True] * 3
    snapshots = [done for kind, done in events if kind == "snapshot"]
    assert snapshots == [0, 1, 2]  # snapshot k (from 0) came after k writes had landed
    assert layout.global_rounds(store, complete=True)[-1] == 2


def test_a_failed_background_write_fails_the_replica() -> None:
    """global/0's upload fails in the writer thread: the writer replica's next sync hands it
    over as its fatal error, naming the cause."""

    def broken(path: str) -> None:
        raise OSError(f"disk full writing {path}")

    store = _store_with_global_puts(broken)
    _, mgr, _ = _train(store, 2, async_checkpoints=True)[0]
    assert isinstance(mgr.fatal_error, OSError)
    assert "disk full" in str(mgr.fatal_error)
    assert layout.global_rounds(store) == []
