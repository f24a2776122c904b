"""A global checkpoint is safetensors files users can open, one part per participant: the
nested state (model weights, an optimizer's state with int keys, tuples, plain values) comes
back exactly from its parts, ``safetensors.torch.load_file`` opens each part a file:// run
wrote, a flipped bit or a foreign file is a CorruptObjectError, a round with a part missing
is not used (the one before it is), and an older run's single file is still read."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from crf import layout
from crf.exchange import global_state
from crf.exchange.manager import ObjectStoreManager
from crf.store import CorruptObjectError, RunStore


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    model(torch.randn(2, 3)).sum().backward()
    outer.step()
    return {
        "model": model.state_dict(),
        "outer": outer.state_dict(),
        "extra": {"step": 3, "loss": math.nan, "name": "x", "none": None, "pair": (1, 2.5)},
        "bf16": torch.ones(2, dtype=torch.bfloat16),
    }


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)  # int keys stay ints, order kept
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b and type(a) is type(b)


def test_nested_state_round_trips_and_is_a_safetensors_file() -> None:
    state = _state()
    data = global_state.encode(global_state.flatten(state), {"run_id": "t", "round": 4})
    back, header = global_state.decode(data, where="x")
    _same(state, back)
    assert header == {"run_id": "t", "round": 4}
    meta = global_state.metadata(data)
    assert meta["run_id"] == '"t"' and meta["round"] == "4" and len(meta["digest"]) == 32


def test_a_global_state_written_with_sha256_is_still_read() -> None:
    """Global states from before XXH3-128 became crf's one checksum still resume."""
    from safetensors.torch import save

    flat = global_state.flatten({"w": torch.arange(4.0)})
    meta = {"run_id": '"t"', "round": "1", "format": global_state.FORMAT, "tree": flat.tree}
    meta["digest"] = global_state.digest(meta, flat.tensors, sha256=True)
    assert len(meta["digest"]) == 64
    state, header = global_state.decode(save(flat.tensors, metadata=meta), where="x")
    assert torch.equal(state["w"], torch.arange(4.0)) and header == {"run_id": "t", "round": 1}
    meta["round"] = "2"  # covered by the digest
    with pytest.raises(CorruptObjectError, match="checksum"):
        global_state.decode(save(flat.tensors, metadata=meta), where="x")


def test_a_run_writes_a_global_state_load_file_opens(tmp_path) -> None:
    """The manager's writer puts global/<r> in a file:// run; the library reads it as it is,
    under readable names (the weights under model/...)."""
    store = RunStore(tmp_path.as_uri())
    model = torch.nn.Linear(3, 2)
    mgr = ObjectStoreManager(store, 1, 0, background=False, run_id="t")
    mgr.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    mgr._write_global(0, global_state.flatten(mgr.state_dict()))
    path = tmp_path / layout.global_part_key(0, 0, 1)
    assert path.name == "part-0-of-1.safetensors"
    tensors = load_file(path)
    assert set(tensors) == {"model/weight", "model/bias"}
    assert torch.equal(tensors["model/weight"], model.weight.detach())
    assert torch.equal(mgr.checkpoints.read_global(0)["model"]["bias"], model.bias.detach())
    mgr.close()


@pytest.mark.parametrize("where", ["tensor data", "metadata", "cut off", "not safetensors"])
def test_a_damaged_global_state_is_corrupt(where: str) -> None:
    data = bytearray(global_state.encode(global_state.flatten(_state()), {"round": 1}))
    if where == "tensor data":
        data[-3] ^= 0x01
    elif where == "metadata":  # the optimizer's lr 0.7 -> 0.3, still valid JSON
        i = data.index(b"0.7")
        data[i : i + 3] = b"0.3"
    elif where == "cut off":
        data = data[:-10]
    else:
        data = bytearray(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CorruptObjectError):
        global_state.decode(bytes(data), where="global/1")


def test_what_cannot_be_saved_is_named() -> None:
    with pytest.raises(TypeError, match="outer/dtype"):
        global_state.flatten({"outer": {"dtype": torch.float32}})


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_parts_cut_the_state_once_and_join_back_exactly(parts: int) -> None:
    """Every tensor lands in exactly one part, the parts are about even in bytes, and the
    parts decoded and joined are the state, bit for bit."""
    state = _state()
    everything = set(global_state.flatten(state).tensors)
    names = [global_state.part_names(state, s, parts) for s in range(parts)]
    assert set().union(*names) == everything
    assert sum(len(n) for n in names) == len(everything)
    files = []
    for s in range(parts):
        flat = global_state.flatten(state, keep=names[s])
        assert set(flat.tensors) == names[s]
        data = global_state.encode(flat, {"round": 4, "part": s, "parts": parts})
        files.append(global_state.decode_part(data, where=f"part {s}"))
    back, header = global_state.join(files, where="global/4")
    _same(state, back)
    assert header == {"round": 4, "parts": parts}
    if parts > 1:  # a part left out: the state is not whole
        with pytest.raises(CorruptObjectError, match="in none of its parts"):
            global_state.join(files[1:], where="global/4")


def test_parts_are_even_in_bytes() -> None:
    """Many tensors of equal size: each of 4 parts holds a quarter of the bytes."""
    state = {"model": {f"w{i}": torch.zeros(256) for i in range(16)}}
    for s in range(4):
        names = global_state.part_names(state, s, 4)
        assert len(names) == 4, names


def _writer(store: RunStore, model: torch.nn.Module, run_id: str = "t") -> ObjectStoreManager:
    mgr = ObjectStoreManager(store, 2, 0, background=False, run_id=run_id)
    mgr.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    return mgr


def _write_parts(mgr: ObjectStoreManager, r: int, parts: int) -> None:
    """Round r's global state as ``parts`` participants write it, each its own part."""
    state = mgr.state_dict()
    for s in range(parts):
        keep = global_state.part_names(state, s, parts)
        mgr._write_global(r, global_state.flatten(state, keep=keep), s, parts)


def test_each_part_opens_with_load_file_and_together_they_are_the_state(tmp_path) -> None:
    store = RunStore(tmp_path.as_uri())
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    mgr = _writer(store, model)
    _write_parts(mgr, 0, 2)
    assert layout.global_parts(store, 0) == [layout.global_part_key(0, s, 2) for s in range(2)]
    opened = [load_file(tmp_path / key) for key in layout.global_parts(store, 0)]
    assert all(opened) and not set(opened[0]) & set(opened[1])
    joined = {**opened[0], **opened[1]}
    assert joined.keys() == {f"model/{k}" for k in model.state_dict()}
    back = mgr.checkpoints.read_global(0)["model"]
    for k, v in model.state_dict().items():
        assert torch.equal(joined[f"model/{k}"], v) and torch.equal(back[k], v)
    mgr.close()


def test_a_round_with_a_part_missing_is_not_used_the_one_before_is(tmp_path) -> None:
    """Resume skips a round whose parts did not all land (a writer killed, or dead) and loads
    the round before it; heal does not count it as there."""
    store = RunStore(tmp_path.as_uri())
    model = torch.nn.Linear(3, 2)
    mgr = _writer(store, model)
    _write_parts(mgr, 0, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    _write_parts(mgr, 1, 2)
    store.delete(layout.global_part_key(1, 1, 2))
    assert layout.global_rounds(store) == [0, 1]
    assert layout.global_rounds(store, complete=True) == [0]
    assert not layout.global_complete(store, 1) and mgr.latest_global() == 0
    with torch.no_grad():
        model.weight.zero_()
    assert mgr.load_newest_global() == 0
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v)
    assert mgr.stats.rejected == []  # a part not there yet is not a bad object
    mgr.close()


def test_a_part_from_another_round_or_run_is_refused(tmp_path) -> None:
    """A part copied from another round, or another run's part, fails its header check: the
    round is refused and reported, and resume falls back to the round before it."""
    store = RunStore(tmp_path.as_uri())
    model = torch.nn.Linear(3, 2)
    mgr = _writer(store, model)
    _write_parts(mgr, 0, 2)
    _write_parts(mgr, 1, 2)
    store.put(layout.global_part_key(1, 1, 2), store.get(layout.global_part_key(0, 1, 2)))
    with pytest.raises(CorruptObjectError, match="not this run's global state of round 1"):
        mgr.checkpoints.read_global(1)
    assert mgr.latest_global() == 0
    other = RunStore((tmp_path / "other").as_uri())
    _write_parts(_writer(other, model, run_id="u"), 0, 2)
    store.put(layout.global_part_key(0, 0, 2), other.get(layout.global_part_key(0, 0, 2)))
    with pytest.raises(CorruptObjectError, match="run_id"):
        mgr.checkpoints.read_global(0)
    mgr.close()


def test_an_older_runs_single_file_is_still_read(tmp_path) -> None:
    """global/<r>/state.safetensors, as runs before parts wrote it, still resumes."""
    store = RunStore(tmp_path.as_uri())
    model = torch.nn.Linear(3, 2)
    mgr = _writer(store, model)
    meta = {"round": 0, "run_id": "t", "layout": None}
    store.put(
        layout.global_key(0), global_state.encode(global_state.flatten(mgr.state_dict()), meta)
    )
    assert layout.global_parts(store, 0) == [layout.global_key(0)]
    assert layout.global_rounds(store, complete=True) == [0]
    want = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert mgr.load_newest_global() == 0 and torch.equal(model.weight, want)
    mgr.close()


def test_a_part_holds_each_of_its_parameters_weights_copy_and_momentum() -> None:
    """torchft's DiLoCo state: the model, the fragment's global copy and its outer Nesterov
    momentum. Each parameter's three tensors land in the same part (the part whose shard's
    parameters they are), and the parts split the bytes about evenly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    outer.step()
    frag = "StreamingDiLoCoFragment_0"
    state = {
        "model": model.state_dict(),
        frag: {
            "outer_optimizer": outer.state_dict(),
            "original_parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
        },
    }
    names = [n for n, _ in model.named_parameters()]
    for parts in (2, 3):
        where = {}
        for s in range(parts):
            for name in global_state.part_names(state, s, parts):
                where[name] = s
        for i, n in enumerate(names):
            trio = {
                where[f"model/{n}"],
                where[f"{frag}/original_parameters/{n}"],
                where[f"{frag}/outer_optimizer/state/{i}/momentum_buffer"],
            }
            assert len(trio) == 1, (n, trio)
        assert where[f"model/{names[0]}"] == 0 and where[f"model/{names[-1]}"] == parts - 1
        sizes = [0] * parts
        flat = global_state.flatten(state)
        for name, t in flat.tensors.items():
            sizes[where[name]] += t.numel() * t.element_size()
        assert max(sizes) < 1.5 * sum(sizes) / parts, sizes
