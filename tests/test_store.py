"""The run store: atomic publish, create-if-absent, list, wait, integrity of tensor objects."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import sys

import pytest
import torch

from crf.store import (
    CorruptObjectError,
    ObjectNotFound,
    RunStore,
    StoreNotWritable,
    StoreTimeout,
    decode_blob,
    decode_tensor,
    encode_blob,
    encode_tensor,
)
from tests.conftest import run_threads


def test_put_get_list_delete(store: RunStore) -> None:
    store.put("a/b/c.json", b"1")
    store.put("a/b/d", b"22")
    store.put("a/x", b"3")
    assert store.get("a/b/c.json") == b"1"
    assert store.list("a") == ["b", "x"]
    assert store.list("a/b") == ["c.json", "d"]
    assert store.list("nope") == []
    store.put("a/b/d", b"replaced")
    assert store.get("a/b/d") == b"replaced"
    store.delete("a/b")
    assert store.list("a") == ["x"]
    with pytest.raises(ObjectNotFound, match="does not exist"):
        store.get("a/b/d")


def test_put_if_absent_single_winner_threads(store: RunStore) -> None:
    wins = run_threads(8, lambda r: store.put_if_absent("quorum.json", f"{r}".encode()))
    assert sum(1 for w in wins if w is True) == 1
    winner = wins.index(True)
    assert store.get("quorum.json") == str(winner).encode()


def _race(uri: str, r: int, q: mp.Queue) -> None:
    q.put((r, RunStore(uri).put_if_absent("decision", str(r).encode() * 100_000)))


def test_put_if_absent_single_winner_processes(tmp_path) -> None:
    uri = f"file://{tmp_path}/run"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(uri, r, q)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = dict(q.get(timeout=5) for _ in procs)
    winners = [r for r, won in results.items() if won]
    assert len(winners) == 1
    # the object is complete: never a half-written mix
    assert RunStore(uri).get("decision") == str(winners[0]).encode() * 100_000


def test_no_temp_files_visible(tmp_path) -> None:
    s = RunStore(str(tmp_path / "run"))
    s.put("k/obj", b"x" * 1000)
    s.put_if_absent("k/obj", b"y")
    assert os.listdir(tmp_path / "run" / "k") == ["obj"]
    assert s.get("k/obj") == b"x" * 1000


def test_wait_for(store: RunStore) -> None:
    import threading

    threading.Timer(0.2, lambda: store.put("late", b"1")).start()
    store.wait_for(["late"], timeout_s=5)
    with pytest.raises(StoreTimeout, match="never"):
        store.wait_for(["never"], timeout_s=0.2)


def test_unsupported_scheme_and_unwritable(tmp_path) -> None:
    with pytest.raises(StoreNotWritable, match="not supported"):
        RunStore("ftp://host/x")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.geteuid() == 0:
            # root ignores permission bits: use a path under a regular file instead
            (tmp_path / "afile").write_text("x")
            target = tmp_path / "afile" / "run"
        else:
            target = ro / "run"
        with pytest.raises(StoreNotWritable, match="cannot write"):
            RunStore(str(target)).check_writable()
    finally:
        os.chmod(ro, stat.S_IRWXU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("shape", [(0,), (7,), (3, 5), ()])
def test_tensor_codec_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 10).to(dtype)
    back, hdr = decode_tensor(encode_tensor(t, {"round": 3}))
    assert back.dtype == dtype and tuple(back.shape) == shape and hdr["round"] == 3
    assert torch.equal(back, t)


def test_tensor_codec_rejects_truncated_flipped_foreign() -> None:
    data = encode_tensor(torch.randn(100), {"round": 1})
    with pytest.raises(CorruptObjectError, match="truncated"):
        decode_tensor(data[:-10])
    with pytest.raises(CorruptObjectError, match="truncated"):
        decode_tensor(data[:10])
    flipped = bytearray(data)
    flipped[-7] ^= 0x10
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_tensor(bytes(flipped))
    with pytest.raises(CorruptObjectError, match="magic"):
        decode_tensor(b"X" * len(data))
    blob = encode_blob(b"payload", {"a": 1})
    assert decode_blob(blob) == (b"payload", {"a": 1})
    with pytest.raises(CorruptObjectError):
        decode_blob(blob[:-1] + b"Q")


def test_blobs_written_with_sha256_are_still_read() -> None:
    """Inner states from before XXH3-128 became crf's one integrity checksum still resume."""
    import hashlib

    from crf.store import codec

    hbytes, payload = b'{"a":1}', b"payload"
    digest = hashlib.sha256(hbytes + payload).digest()
    old = codec._FIXED.pack(codec.BLOB_MAGIC_SHA256, len(hbytes), len(payload), digest)
    assert decode_blob(old + hbytes + payload) == (payload, {"a": 1})
    assert encode_blob(payload, {"a": 1})[:8] == codec.BLOB_MAGIC
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_blob(old + hbytes + b"paylOad")


def test_memory_store_is_shared_in_process_only() -> None:
    a = RunStore("memory://shared-test/x")
    a.put("k", b"v")
    assert RunStore("memory://shared-test/x").get("k") == b"v"
    a.delete("")
    assert sys.modules["crf.store"]  # sanity


def test_get_range_reads_part_of_an_object(store: RunStore) -> None:
    """Bytes [start, end) in one read; shorter at the end of the object; empty ranges and
    missing objects behave as get() does; a bad range is refused."""
    store.put("a/b", bytes(range(100)))
    assert store.get_range("a/b", 10, 20) == bytes(range(10, 20))
    assert store.get_range("a/b", 95, 200) == bytes(range(95, 100))
    assert store.get_range("a/b", 7, 7) == b""
    with pytest.raises(ObjectNotFound):
        store.get_range("a/missing", 0, 10)
    with pytest.raises(ObjectNotFound):
        store.get_range("a", 0, 10)  # a folder
    with pytest.raises(ValueError, match="bad range"):
        store.get_range("a/b", 5, 2)
