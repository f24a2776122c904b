"""A checkpoint's snapshot and its serialization: the training thread copies into host buffers
allocated once and reused; the writer serializes from them as parts (the buffers' own memory,
no joined copy) into objects of the same format as before, so objects written before still
load and the new ones load with the libraries (``safetensors.torch.load_file``, the old
reader)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from safetensors.torch import load_file, save

from crf import layout
from crf.exchange import global_state, inner_state
from crf.exchange.allreduce import ObjectStoreAllReduce
from crf.exchange.checkpoints import Checkpoints, CheckpointWriter
from crf.exchange.config import ExchangeConfig
from crf.exchange.snapshots import HostBuffers, reserve_tree, snapshot_tree, torch_save_parts
from crf.store import RunStore
from crf.store.codec import decode_blob, encode_blob
from tests.test_global_state import _same, _state


def _adam_state() -> dict:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return opt.state_dict()


def test_buffers_are_allocated_once_and_reused() -> None:
    """Two snapshots of a changing state: the second lands in the first one's memory (no new
    allocation), and each holds the values of its own moment."""
    buffers = HostBuffers()
    w = torch.arange(6.0).reshape(2, 3)
    first = global_state.flatten({"model": {"w": w}}, buffers)
    ptr = first.tensors["model/w"].data_ptr()
    assert torch.equal(first.tensors["model/w"], w)
    assert first.tensors["model/w"].data_ptr() != w.data_ptr()  # a copy, not the tensor
    w.add_(1)
    second = global_state.flatten({"model": {"w": w}}, buffers)
    assert second.tensors["model/w"].data_ptr() == ptr
    assert torch.equal(second.tensors["model/w"], w)
    assert buffers.nbytes == w.numel() * 4


def test_a_snapshot_does_not_change_when_training_goes_on() -> None:
    """An optimizer state copied into buffers: tensors and plain values (an lr scheduler edits
    param_groups in place) keep the values they had at the copy."""
    state = _adam_state()
    snap = snapshot_tree(state, HostBuffers())
    lr = state["param_groups"][0]["lr"]
    state["param_groups"][0]["lr"] = 9.0
    for s in state["state"].values():
        s["exp_avg"].add_(1)
    assert snap["param_groups"][0]["lr"] == lr
    assert not any(
        torch.equal(a["exp_avg"], b["exp_avg"])
        for a, b in zip(snap["state"].values(), state["state"].values(), strict=True)
    )


def test_global_parts_are_a_safetensors_file_of_the_buffers() -> None:
    """The parts are the header and the tensors' own memory; joined, safetensors loads them
    (every dtype a state holds) and crf's reader gets the nested state back exactly."""
    state = _state()
    state["ints"] = torch.arange(5, dtype=torch.int64)
    state["flags"] = torch.tensor([True, False])
    state["empty"] = torch.empty(0)
    flat = global_state.flatten(state, HostBuffers())
    parts = global_state.encode_parts(flat, {"run_id": "t", "round": 2})
    pointers = {t.data_ptr() for t in flat.tensors.values() if t.numel()}
    views = [p for p in parts[1:] if isinstance(p, memoryview)]
    assert len(views) == len(pointers)  # one part per tensor, none joined
    data = b"".join(parts)
    back, header = global_state.decode(data, where="x")
    _same(state, back)
    assert header == {"run_id": "t", "round": 2}
    from safetensors.torch import load

    loaded = load(data)
    assert set(loaded) == set(flat.tensors)
    assert all(torch.equal(loaded[k], v) for k, v in flat.tensors.items())


def test_a_global_state_the_old_encoder_wrote_is_still_read() -> None:
    """A file safetensors' own ``save`` built (how global states were written before) still
    decodes, and the new file holds the same tensors and metadata."""
    state = _state()
    flat = global_state.flatten(state)
    header = {"run_id": "t", "round": 3, "layout": "abc"}
    meta = {k: global_state.jsonsafe.dumps(v) for k, v in header.items()}
    meta["format"] = global_state.FORMAT
    meta[global_state.TREE] = flat.tree
    meta[global_state.DIGEST] = global_state.digest(meta, flat.tensors)
    old = save(flat.tensors, metadata=meta)
    back, got = global_state.decode(old, where="old")
    _same(state, back)
    assert got == header
    new = global_state.encode(flat, header)
    assert global_state.metadata(new) == global_state.metadata(old)


def test_torch_save_parts_are_torch_saves_bytes_without_copying_the_tensors() -> None:
    """Joined, the parts are byte for byte what torch.save writes; the tensors' bytes are
    views of their own memory, so the writer never copies them."""
    snap = snapshot_tree(_adam_state(), HostBuffers())
    parts = torch_save_parts(snap)
    buf = io.BytesIO()
    torch.save(snap, buf)
    assert b"".join(parts) == buf.getvalue()
    big = [s["exp_avg_sq"] for s in snap["state"].values() if s["exp_avg_sq"].numel() >= 1024]
    assert big
    views = [p for p in parts if isinstance(p, memoryview)]
    for t in big:  # the tensor's bytes are one part, in the tensor's memory
        n = t.numel() * t.element_size()
        assert any(
            v.nbytes == n and torch.frombuffer(v, dtype=torch.uint8).data_ptr() == t.data_ptr()
            for v in views
        )
    back = torch.load(io.BytesIO(b"".join(parts)), weights_only=True)
    _same(snap, back)


def _checkpoints(tmp_path, background: bool = False) -> Checkpoints:
    store = RunStore(tmp_path.as_uri())
    config = ExchangeConfig(run_id="run")
    exchange = ObjectStoreAllReduce(store, 1, 0, config)
    errors: list[BaseException] = []
    ckpt = Checkpoints(exchange, CheckpointWriter(background, errors.append))
    ckpt.layout = "L"
    return ckpt


def test_inner_states_are_written_from_the_buffers_and_the_old_format_still_loads(
    tmp_path,
) -> None:
    """Inner states of three rounds through the background writer: each object holds its
    round's values (a snapshot is not overwritten before its write), decodes with the old
    reader (blob + torch.load), and one written the old way (torch.save into BytesIO,
    encode_blob) still loads."""
    ckpt = _checkpoints(tmp_path, background=True)
    opt_state = _adam_state()
    weights = {"w": torch.zeros(300)}
    expect = {}
    for r in range(3):
        for s in opt_state["state"].values():
            s["exp_avg"].add_(1.0)
        weights["w"].add_(1.0)
        expect[r] = (
            {k: v["exp_avg"].clone() for k, v in opt_state["state"].items()},
            weights["w"].clone(),
        )
        ckpt.hold_inner(r, inner_state.compose(opt_state, weights), step=r)
        ckpt.release_inner()
    ckpt.writer.drain()
    for r in range(3):
        saved = inner_state.split(ckpt.load_inner(r))
        avgs, w = expect[r]
        assert all(torch.equal(saved.optimizer["state"][k]["exp_avg"], v) for k, v in avgs.items())
        assert torch.equal(saved.local_params["w"], w)
        payload, meta = decode_blob(ckpt.store.get(layout.inner_key(0, r)))
        assert meta["round"] == r and meta["step"] == r
        torch.load(io.BytesIO(payload), weights_only=True)
    # an inner state as it was written before
    old = io.BytesIO()
    torch.save(opt_state, old)
    meta = {"round": 7, "run_id": "run", "rank": 0, "layout": "L", "step": 70}
    ckpt.store.put(layout.inner_key(0, 7), encode_blob(old.getvalue(), meta))
    saved = inner_state.split(ckpt.load_inner(7))
    assert saved.local_params is None and saved.error_feedback is None
    _same(opt_state, saved.optimizer)


def test_a_written_global_state_opens_with_load_file(tmp_path) -> None:
    """write_global on a file:// store: the file on disk is what safetensors' load_file
    opens, with the buffers' values."""
    ckpt = _checkpoints(tmp_path)
    w = torch.randn(10, 10)
    flat = global_state.flatten({"model": {"w": w}, "n": math.pi}, HostBuffers())
    ckpt.write_global(0, flat)
    on_disk = load_file(str(tmp_path / layout.global_part_key(0, 0, 1)))
    assert torch.equal(on_disk["model/w"], w)
    assert ckpt.bytes_up == (tmp_path / layout.global_part_key(0, 0, 1)).stat().st_size
    assert torch.equal(ckpt.read_global(0)["model"]["w"], w)


def test_an_inner_state_without_crc32s_loads_and_the_setting_is_restored() -> None:
    """The writer leaves out torch's CRC-32s (crf's XXH3 covers the payload): torch.load reads
    the bytes back exactly, and torch.save's process-wide setting is as it was after."""
    snap = snapshot_tree(_adam_state(), HostBuffers())
    before = torch.serialization.get_crc32_options()
    data = b"".join(torch_save_parts(snap, crc32=False))
    assert torch.serialization.get_crc32_options() == before
    _same(snap, torch.load(io.BytesIO(data), weights_only=True))


def test_reserved_buffers_are_the_ones_the_first_snapshots_fill() -> None:
    """Buffers reserved before the first snapshot (a global state's part, an inner state)
    are allocated without copying anything, and the first snapshots land in them: no new
    allocation and the values of the moment they were taken."""
    state = _state()
    part_buffers, whole = HostBuffers(), HostBuffers()
    keep = global_state.part_names(state, 1, 2)
    reserved = global_state.reserve(state, part_buffers, keep)
    assert reserved == part_buffers.nbytes > 0
    assert global_state.reserve(state, part_buffers, keep) == 0  # once
    global_state.reserve(state, whole)
    assert part_buffers.nbytes < whole.nbytes  # the part's tensors only
    ptrs = {n: b.data_ptr() for n, b in part_buffers._buffers.items()}
    flat = global_state.flatten(state, part_buffers, keep)
    assert part_buffers.nbytes == reserved
    assert {n: t.data_ptr() for n, t in flat.tensors.items()} == ptrs
    assert set(flat.tensors) == keep

    opt_state, buffers = _adam_state(), HostBuffers()
    n = reserve_tree(opt_state, buffers)
    assert n == buffers.nbytes > 0
    snap = snapshot_tree(opt_state, buffers)
    assert buffers.nbytes == n
    _same(opt_state, snap)


def test_a_checkpoints_reserved_buffers_take_its_first_snapshots(tmp_path) -> None:
    """Checkpoints.reserve_global / reserve_inner allocate what the first global snapshot
    and the first inner snapshot then fill, and the written objects hold the values."""
    ckpt = _checkpoints(tmp_path)
    state = {"model": {"w": torch.randn(8, 8)}, "outer/0": {"step": 3}}
    assert ckpt.reserve_global(state) == 8 * 8 * 4
    ckpt.snapshot(0, state)
    assert ckpt._global_buffers.nbytes == 8 * 8 * 4
    assert torch.equal(ckpt.read_global(0)["model"]["w"], state["model"]["w"])
    opt = _adam_state()
    n = ckpt.reserve_inner(opt)
    assert n > 0
    ckpt.inner_write(0, opt, step=1)()
    assert ckpt._inner_buffers.nbytes == n
    _same(opt, ckpt.load_inner(0))


def test_a_round_record_lands_while_a_state_write_runs() -> None:
    """A round's record goes on a lane of its own: it lands while a large state write queued
    before it is still running, and a write queued after it waits for it; if the record
    failed, that write does not land (an inner state never lands without its record)."""
    import threading

    errors: list[BaseException] = []
    writer = CheckpointWriter(True, errors.append)
    release, done = threading.Event(), []
    writer.submit(lambda: (release.wait(30), done.append("state")))  # a global state
    record = writer.submit_record(lambda: done.append("record"))
    assert record is not None
    record.result(timeout=30)
    assert done == ["record"]  # not behind the state write
    release.set()

    def bad() -> None:
        raise OSError("the store said no")

    failed = writer.submit_record(bad)
    assert failed is not None
    failed.exception(timeout=30)  # done, failed: still waited on
    after = writer.submit(lambda: done.append("inner"))
    assert failed is not None and after is not None
    with pytest.raises(OSError):
        after.result(timeout=30)
    assert done == ["record", "state"]  # the inner write did not land without its record
    writer.check()
    assert errors and all(isinstance(e, OSError) for e in errors)
    writer._pending.clear()  # both failures were reported
    writer.close()


def test_the_next_rounds_exchange_waits_for_the_last_record() -> None:
    """``records_landed`` (what the manager's exchange thread calls before it publishes a
    round) returns once the last record submitted has landed: a replica killed in a round
    keeps its record of the round before."""
    import threading

    writer = CheckpointWriter(True, lambda e: None)
    release, done = threading.Event(), []
    writer.submit_record(lambda: (release.wait(30), done.append("record")))
    threading.Timer(0.2, release.set).start()
    writer.records_landed()
    assert done == ["record"]
    writer.records_landed()  # nothing pending: returns
    writer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reserved_buffers_of_device_tensors_are_page_locked_and_filled() -> None:
    """A GPU state's reserved buffers are page-locked host memory, and the first snapshot
    copies the device's values into exactly them."""
    state = {"w": torch.randn(64, 64, device="cuda"), "step": torch.tensor(3.0, device="cuda")}
    buffers = HostBuffers()
    assert reserve_tree(state, buffers) == (64 * 64 + 1) * 4
    ptrs = {n: b.data_ptr() for n, b in buffers._buffers.items()}
    assert all(b.is_pinned() for b in buffers._buffers.values())
    snap = snapshot_tree(state, buffers)
    assert {n: b.data_ptr() for n, b in buffers._buffers.items()} == ptrs
    assert torch.equal(snap["w"], state["w"].cpu()) and float(snap["step"]) == 3.0
