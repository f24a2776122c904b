"""A global checkpoint is a safetensors file users can open: the nested
state (model weights, an optimizer's state with int keys, tuples, plain values) comes back
exactly, ``safetensors.torch.load_file`` opens the file a file:// run wrote, and a flipped bit
or a foreign file is a CorruptObjectError."""

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
    path = tmp_path / layout.global_key(0)
    assert path.name == "state.safetensors"
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
