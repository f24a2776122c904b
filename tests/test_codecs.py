"""Wire codecs behind one interface: every registered codec round-trips within its error,
decode-and-add gives the bits of decode-then-add, a codec's size is its payload's, and a new
codec is one class plus its registration (usable by name in an exchange, nothing else
edited)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from crf.exchange import codecs
from crf.exchange.allreduce import ObjectStoreAllReduce
from crf.exchange.codecs import Codec
from crf.exchange.config import ExchangeConfig
from crf.spec import RunSpec
from crf.store import RunStore
from tests.conftest import run_threads

ROOT = Path(__file__).resolve().parent.parent

#: a shard of three tensors' pieces: a large one, a small bias (own int8 scale), a partial
#: block; and one over more than an int8 chunk, so chunked paths run
SHARDS = [
    (337, [300, 10, 27]),
    (codecs.INT8_CHUNK + codecs.INT8_BLOCK * 3 + 17, None),
]


def _shard(n: int, segments: Sequence[int] | None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 5
    if segments:  # the second piece 1000x smaller than the first
        x[segments[0] : segments[0] + segments[1]] *= 1e-3
    return x


def _max_error(name: str, x: torch.Tensor, segments: Sequence[int] | None) -> torch.Tensor:
    """The error each built-in codec states, per value: none for float32, half an ulp for
    the 2-byte floats (round to nearest), half a step of its block's scale for int8."""
    if name == "float32":
        return torch.zeros_like(x)
    if name == "bfloat16":
        return x.abs() * 2.0**-8
    if name == "float16":
        return x.abs() * 2.0**-11 + 2.0**-25  # subnormals below 2**-14: absolute steps
    if codecs.get_codec(name).sparse:  # a dropped value's error is at most its chunk's
        return _chunk_absmax(x, segments) * (1 + 1e-4)  # top values (tests/test_topk.py)
    if name != "int8":
        pytest.fail(f"codec {name!r}: state its error in tests/test_codecs.py::_max_error")
    pieces, _ = codecs.int8_blocks(x.numel(), segments)
    bound = torch.empty_like(x)
    for a, b, _ in pieces:
        for s in range(a, b, codecs.INT8_BLOCK):
            e = min(s + codecs.INT8_BLOCK, b)
            bound[s:e] = x[s:e].abs().max() / 127 / 2
    return bound * (1 + 1e-4)  # and the fp32 rounding of codes times scale


def _chunk_absmax(x: torch.Tensor, segments: Sequence[int] | None) -> torch.Tensor:
    """Per value, the largest magnitude of its top-k chunk."""
    from crf.exchange.codecs.topk import TOPK_CHUNK

    bound, pos = torch.empty_like(x), 0
    for m in segments or [x.numel()]:
        for s in range(pos, pos + m, TOPK_CHUNK):
            e = min(s + TOPK_CHUNK, pos + m)
            bound[s:e] = x[s:e].abs().max()
        pos += m
    return bound


BUILTIN = ("float32", "bfloat16", "float16", "int8")
#: every codec registered when the tests are collected (a new built-in one included)
REGISTERED = codecs.codec_names()


def test_the_builtin_codecs_are_registered_in_order() -> None:
    assert codecs.codec_names()[:4] == BUILTIN
    for name in BUILTIN:
        assert isinstance(codecs.get_codec(name), Codec) and codecs.get_codec(name).name == name
    assert codecs.get_codec("float32").exact and not codecs.get_codec("int8").exact


def test_the_registry_imports_without_torch() -> None:
    """crf.spec validates wire names before anything heavy is loaded: the registry's
    names come without importing torch or a codec module."""
    code = (
        "import sys, crf.spec, crf.exchange.codecs as c\n"
        "assert c.codec_names()[:4] == ('float32', 'bfloat16', 'float16', 'int8')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


@pytest.mark.parametrize("name", REGISTERED)
@pytest.mark.parametrize("n,segments", SHARDS)
def test_round_trip_within_the_codecs_error(name: str, n: int, segments) -> None:
    x = _shard(n, segments)
    w = codecs.encode(x, name, segments)
    y = codecs.decode(w, name, n, segments=segments)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if name == "float32":
        assert torch.equal(y, x)
    assert torch.all((y - x).abs() <= _max_error(name, x, segments))
    out = torch.full((n,), float("nan"))
    assert codecs.decode(w, name, n, out=out, segments=segments) is out and torch.equal(out, y)


@pytest.mark.parametrize("name", REGISTERED)
@pytest.mark.parametrize("n,segments", SHARDS)
def test_decode_add_is_decode_then_add_bit_for_bit(name: str, n: int, segments) -> None:
    w = codecs.encode(_shard(n, segments), name, segments)
    acc = _shard(n, None, seed=1)
    expect = acc + codecs.decode(w, name, n, segments=segments)
    got = codecs.decode_add(w, name, n, acc, segments)
    assert got is acc and torch.equal(got, expect)


@pytest.mark.parametrize("name", REGISTERED)
@pytest.mark.parametrize("n,segments", [*SHARDS, (0, None)])
def test_size_is_the_payloads(name: str, n: int, segments) -> None:
    w = codecs.encode(_shard(n, segments), name, segments)
    assert codecs.wire_nbytes(name, n, segments) == w.numel() * w.element_size()
    assert codecs.wire_numel_ok(w, name, n, segments)
    if n:
        assert not codecs.wire_numel_ok(w[:-1], name, n, segments)
        assert codecs.all_finite(w, name, n, segments)
    # compression: fp32 bytes per wire byte, on a large shard of one piece
    big = 1 << 20
    assert codecs.compression(name) == pytest.approx(4 * big / codecs.wire_nbytes(name, big))


def test_an_unknown_codec_is_refused_with_the_names() -> None:
    with pytest.raises(ValueError, match="int8"):
        codecs.get_codec("int4")
    with pytest.raises(ValueError, match="registered already"):
        codecs.register_codec("int8", codecs.get_codec("float16"))
    with pytest.raises(ValueError, match="module:attribute"):
        codecs.register_codec("nope", "crf.exchange.codecs.floats")


# ------------------------------------------------------------------------ a new codec


class Float64Codec(Codec):
    """A test codec written the way docs/extending.md, "Add a wire codec" says: only
    encode, decode and nbytes; decode-and-add, the size check, the finiteness check and
    the compression ratio come from the interface's defaults."""

    name = "float64"
    exact = True

    def encode(self, x: torch.Tensor, segments: Sequence[int] | None = None) -> torch.Tensor:
        return x.to(torch.float64)

    def decode(self, w, n, out=None, segments=None) -> torch.Tensor:
        return w.to(torch.float32) if out is None else out.copy_(w)

    def nbytes(self, n: int, segments: Sequence[int] | None = None) -> int:
        return 8 * n


@pytest.fixture
def float64() -> Iterator[str]:
    codecs.register_codec("float64", Float64Codec())
    yield "float64"
    codecs.unregister_codec("float64")


def test_a_registered_codec_has_the_interfaces_defaults(float64: str) -> None:
    n, segments = SHARDS[0]
    x = _shard(n, segments)
    w = codecs.encode(x, float64, segments)
    assert w.dtype == torch.float64 and torch.equal(codecs.decode(w, float64, n), x)
    acc = _shard(n, None, seed=1)
    assert torch.equal(codecs.decode_add(w, float64, n, acc.clone()), acc + x)
    assert codecs.wire_nbytes(float64, n) == w.numel() * w.element_size()
    assert codecs.wire_numel_ok(w, float64, n) and not codecs.wire_numel_ok(w[1:], float64, n)
    assert codecs.all_finite(w, float64, n)
    w[3] = float("inf")
    assert not codecs.all_finite(w, float64, n)
    assert codecs.compression(float64) == 0.5


def test_a_registered_codec_is_usable_by_name(store: RunStore, float64: str) -> None:
    """Registering a codec is all it takes: the run spec and the exchange's config accept
    its name (they ask the registry when they validate), and a 2-replica round over it
    gives the exact average, as the float32 wire does."""
    assert float64 in codecs.codec_names()
    RunSpec(run_id="r", run_uri=store.uri, wire_dtype=float64).validate()
    assert ExchangeConfig(wire_dtype=float64).wire_dtype == float64
    n = 2

    def replica(rank: int, wire: str) -> tuple[torch.Tensor, int]:
        ar = ObjectStoreAllReduce(store.child(wire), n, rank, run_id="t", wire_dtype=wire)
        g = torch.Generator().manual_seed(rank)
        t = [torch.randn(10_000, generator=g), torch.randn(3, 7, generator=g)]
        res = ar.allreduce(t)
        assert res.in_quorum and res.participants == [0, 1]
        return torch.cat([x.reshape(-1) for x in t]), res.bytes_up

    got = run_threads(n, lambda r: replica(r, float64))
    exact = run_threads(n, lambda r: replica(r, "float32"))
    for out, out32 in zip(got, exact, strict=True):
        assert not isinstance(out, BaseException), out
        assert torch.equal(out[0], out32[0])
        # 8 bytes a value went up, not 4 (plus the same headers)
        assert out[1] / out32[1] == pytest.approx(2.0, rel=0.05)
    codecs.unregister_codec(float64)
    with pytest.raises(ValueError, match="wire_dtype"):
        ExchangeConfig(wire_dtype=float64)
