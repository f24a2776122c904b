"""The sparse wires (topk2/4/8): the codec keeps each chunk's largest values, exactly as many
as its size says, the same bits on every call; the average of sparse parts is published exact
in its smallest form; through ObjectStoreAllReduce the sum equals a dense fp32 reference bit
for bit on every replica; error feedback resends what was dropped and survives a restart."""

from __future__ import annotations

import math

import pytest
import torch

from crf import layout
from crf.exchange import codecs
from crf.exchange.allreduce import ObjectStoreAllReduce, shard_bounds
from crf.exchange.codecs import sparse
from crf.exchange.codecs.bits import pack_bits, unpack_bits
from crf.exchange.codecs.topk import TOPK_CHUNK, kept_per_chunk
from crf.exchange.config import SPARSELOCO_BETA, ExchangeConfig
from crf.store import RunStore
from crf.store.codec import decode_tensor
from tests.conftest import run_threads

WIRES = ("topk2", "topk4", "topk8")


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 12])
def test_bits_round_trip(bits: int) -> None:
    v = torch.randint(0, 1 << bits, (1001,), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_bits(pack_bits(v, bits), v.numel(), bits), v)


@pytest.mark.parametrize("wire", WIRES)
def test_keeps_each_chunks_largest_values(wire: str) -> None:
    segments = [TOPK_CHUNK + 500, 37, 3]  # two chunks, a small piece, a tiny one
    n = sum(segments)
    x = _x(n)
    y = codecs.decode(codecs.encode(x, wire, segments), wire, n, segments=segments)
    pos = 0
    for start, m in [(0, TOPK_CHUNK), (TOPK_CHUNK, 500), (TOPK_CHUNK + 500, 37), (n - 3, 3)]:
        pos = start
        k = kept_per_chunk(m, 0.02)
        chunk, got = x[pos : pos + m], y[pos : pos + m]
        top = set(chunk.abs().topk(k).indices.tolist())
        assert set(got.nonzero().flatten().tolist()) == top  # exactly the k largest
        assert torch.equal(got[list(top)].sign(), chunk[list(top)].sign())
        # kept magnitudes lie on a grid over [lo, hi] of the kept ones: within half a step
        a = chunk[list(top)].abs()
        levels = 1 << (int(wire[4:]) - 1)
        half = (a.max() - a.min()) / (levels - 1) / 2
        assert ((got[list(top)] - chunk[list(top)]).abs() <= half * (1 + 1e-5) + 1e-7).all()


def test_ties_go_to_the_lower_position_and_bits_are_the_same_every_time() -> None:
    x = torch.zeros(1000)
    x[[10, 20, 30, 40]] = torch.tensor([1.0, -1.0, 1.0, 2.0])
    density = 3 / 1000
    codec = codecs.get_codec(f"topk8@{density!r}")
    y = codec.decode(codec.encode(x), 1000)
    assert y.nonzero().flatten().tolist() == [10, 20, 40]
    big = _x(3 * TOPK_CHUNK + 11, seed=3)
    assert torch.equal(codecs.encode(big, "topk2"), codecs.encode(big.clone(), "topk2"))


@pytest.mark.parametrize("density", [0.005, 0.02, 0.1])
@pytest.mark.parametrize("wire", WIRES)
def test_size_is_fixed_by_the_shard_and_shrinks_with_density(wire: str, density: float) -> None:
    name = codecs.wire_name(wire, density)
    assert name == f"{wire}@{density!r}"
    n = 3 * TOPK_CHUNK
    w = codecs.encode(_x(n), name)
    assert w.numel() == codecs.wire_nbytes(name, n) and codecs.wire_numel_ok(w, name, n)
    bits = int(wire[4:])
    k = kept_per_chunk(TOPK_CHUNK, density)
    # 8 bytes of scales a chunk; offsets two in three bytes; codes bits each
    assert w.numel() == 3 * 8 + math.ceil(3 * k / 2) * 3 + math.ceil(3 * k * bits / 8)
    # upload ~ density * (bits + 12 index bits) / 32 of fp32, plus 8 bytes of scales a chunk
    # (k is density * 4096 rounded up)
    per_chunk = TOPK_CHUNK * density * (bits + 12) / 8 + 8
    assert 4 * n / w.numel() == pytest.approx(4 * TOPK_CHUNK / per_chunk, rel=0.05)


def test_a_non_finite_value_is_seen_in_the_scales() -> None:
    x = _x(2 * TOPK_CHUNK)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[TOPK_CHUNK + 5] = bad
        assert not codecs.all_finite(codecs.encode(y, "topk4"), "topk4", y.numel())
    assert codecs.all_finite(codecs.encode(x, "topk4"), "topk4", x.numel())


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="density must be a number"):
        codecs.get_codec("topk4@lots")
    with pytest.raises(ValueError, match="takes no parameter"):
        codecs.get_codec("int8@0.1")
    with pytest.raises(ValueError, match="must be one of"):
        codecs.get_codec("topk3")


@pytest.mark.parametrize(
    "nonzero,form",
    [(0, sparse.POSITIONS), (100, sparse.POSITIONS), (2000, sparse.BITMAP), (9800, sparse.DENSE)],
)
def test_the_average_goes_exact_in_its_smallest_form(nonzero: int, form: int) -> None:
    n = 10_000
    x = torch.zeros(n)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:nonzero]
    x[idx] = _x(nonzero)
    w = codecs.encode_reduced(x, "topk4")
    got_form, k = w[:8].clone().view(torch.int32).tolist()
    assert (got_form, k) == (form, nonzero)
    assert w.numel() == min(sparse.form_sizes(n, nonzero).values())
    assert torch.equal(codecs.decode_reduced(w, "topk4", n), x)
    assert codecs.reduced_numel_ok(w, "topk4", n) and codecs.reduced_all_finite(w, "topk4", n)
    assert not codecs.reduced_numel_ok(w[:-1], "topk4", n)
    out = torch.full((n,), float("nan"))
    assert codecs.decode_reduced(w, "topk4", n, out=out) is out and torch.equal(out, x)


def _tensors(rank: int, round_: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    return [torch.randn(s, generator=g) for s in [(70, 90), (13,), (4100,)]]


def _decoded_parts(xs: list[torch.Tensor], wire: str, world: int) -> list[torch.Tensor]:
    """What one replica's top-k part decodes to, shard by shard, as the exchange cuts it."""
    flat = torch.cat([t.reshape(-1) for t in xs])
    bounds = shard_bounds(flat.numel(), world)
    segs = codecs.shard_segments([t.numel() for t in xs], bounds)
    out = torch.empty_like(flat)
    for s, (a, b) in enumerate(bounds):
        w = codecs.encode(flat[a:b], wire, segs[s])
        out[a:b] = codecs.decode(w, wire, b - a, segments=segs[s])
    return [out, flat]


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_sum_equals_the_dense_reference_on_every_replica(tmp_path, world: int) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    wire = "topk4"

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, world, rank, run_id="t", wire_dtype=wire)
        ts = _tensors(rank)
        res = ar.allreduce(ts)
        return torch.cat([t.reshape(-1) for t in ts]), res

    got = run_threads(world, replica)
    acc = _decoded_parts(_tensors(0), wire, world)[0].clone()
    for p in range(1, world):  # fp32, rank order, then the division
        acc += _decoded_parts(_tensors(p), wire, world)[0]
    acc /= world
    for flat, res in got:
        assert torch.equal(flat, acc) and res.in_quorum
        assert torch.equal(flat.view(torch.int32), got[0][0].view(torch.int32))  # same bits
    # each published average is in the smallest of its exact forms, here the parts
    bounds = shard_bounds(acc.numel(), world)
    segs = codecs.shard_segments([t.numel() for t in _tensors(0)], bounds)
    for s, (a, b) in enumerate(bounds):
        t, hdr = decode_tensor(store.get(layout.reduced_key(0, s)))
        assert hdr["wire"] == "topk4@0.02"
        k = int((acc[a:b] != 0).sum())
        as_parts = sparse.HEADER + world * codecs.wire_nbytes("topk4@0.02", b - a, segs[s])
        assert t.numel() == as_parts < min(sparse.form_sizes(b - a, k).values())
        assert sparse.header(t) == (sparse.PARTS, world)


def test_an_average_published_as_its_parts_decodes_to_the_owners_bits() -> None:
    """The owner's sum (decode the first part, add the others in rank order, divide) and
    the decoding of the published parts are the same arithmetic: the same bits."""
    n, segments, wire = 2 * TOPK_CHUNK + 77, [TOPK_CHUNK + 70, TOPK_CHUNK + 7], "topk2"
    parts = [codecs.encode(_x(n, seed=p), wire, segments) for p in range(3)]
    acc = codecs.decode(parts[0], wire, n, segments=segments)
    for w in parts[1:]:
        codecs.decode_add(w, wire, n, acc, segments)
    acc.div_(3)
    w = codecs.encode_reduced(acc, wire, segments, parts)
    assert sparse.header(w) == (sparse.PARTS, 3)
    assert codecs.reduced_numel_ok(w, wire, n, segments)
    assert not codecs.reduced_numel_ok(w[:-1], wire, n, segments)
    assert torch.equal(codecs.decode_reduced(w, wire, n, segments=segments).view(torch.int32),
                       acc.view(torch.int32))  # fmt: skip
    # with many parts the exact sum is smaller: it is published instead
    many = parts * 40
    assert sparse.header(codecs.encode_reduced(acc, wire, segments, many))[0] != sparse.PARTS


def test_bytes_shrink_with_the_sparse_wire(tmp_path) -> None:
    """Per replica, a contribution is ~density * (bits + 12) / 32 of fp32; the average
    comes back exact, at most N x density of the values, so it is the larger part."""
    numel, world = 200_000, 2

    def run(wire: str) -> list:
        store = RunStore(f"file://{tmp_path}/{wire}")

        def replica(rank: int):
            ar = ObjectStoreAllReduce(store, world, rank, run_id="t", wire_dtype=wire)
            return ar.allreduce([_x(numel, seed=rank)])

        return run_threads(world, replica)

    dense, topk = run("float32"), run("topk2")
    part = codecs.wire_nbytes("topk2@0.02", numel // 2)
    for d, s in zip(dense, topk, strict=True):
        # up: the other half's part plus this replica's reduced half (exact: <= 4% nonzero)
        assert s.bytes_up < part + sparse.form_sizes(numel // 2, numel // 25)[sparse.BITMAP] + 4096
        assert d.bytes_up / s.bytes_up > 10 and d.bytes_down / s.bytes_down > 10
        assert 4 * (numel // 2) / part == pytest.approx(32 / (0.02 * 14), rel=0.2)


def test_error_feedback_resends_what_was_dropped(tmp_path) -> None:
    """Two rounds: what round 0 dropped (the residual) is added to round 1's pseudo-gradient,
    whole ("diloco") or decayed by beta ("sparseloco"), so round 1 sends values round 0 left
    out, and keeps what round 1 dropped in turn."""
    world, numel = 2, 3000
    for outer, beta in (("diloco", 1.0), ("sparseloco", SPARSELOCO_BETA)):
        store = RunStore(f"file://{tmp_path}/{outer}")

        def replica(rank: int, outer: str = outer, store: RunStore = store):
            ar = ObjectStoreAllReduce(
                store, world, rank, run_id="t", wire_dtype="topk8", sparse_outer=outer
            )
            x = _x(numel, seed=rank)
            ar.allreduce([x.clone()])
            residual = ar.error_feedback_state()["-"].clone()
            ar.allreduce([x.clone()])
            return x, residual, ar.error_feedback_state()["-"]

        for x, r0, r1 in run_threads(world, replica):
            sent0 = _decoded_parts([x], "topk8", world)[0]
            assert torch.equal(r0, x - sent0)  # round 0 kept what it dropped
            assert int((sent0 == 0).sum()) > 0.95 * numel
            y = x + r0 if beta == 1.0 else r0.mul(beta).add_(x)
            sent1 = _decoded_parts([y], "topk8", world)[0]
            assert torch.equal(r1, y - sent1)
            assert int(((sent1 != 0) & (sent0 == 0)).sum()) > 0  # dropped before, sent now


def test_a_restart_keeps_its_residual(tmp_path) -> None:
    """A new exchange given the saved error-feedback state sends exactly what the old one
    would have: the same bits in the store."""
    world, numel = 2, 3000

    def run(prefix: str, restart: bool) -> torch.Tensor:
        store = RunStore(f"file://{tmp_path}/{prefix}")

        def replica(rank: int) -> torch.Tensor:
            kw = dict(run_id="t", wire_dtype="topk4", sparse_outer="sparseloco")
            ar = ObjectStoreAllReduce(store, world, rank, **kw)
            ar.allreduce([_x(numel, seed=rank)])
            if restart:
                saved = {k: v.clone() for k, v in ar.error_feedback_state().items()}
                ar.close()
                ar = ObjectStoreAllReduce(store, world, rank, **kw)
                ar.next_round = 1
                ar.load_error_feedback_state(saved)
            t = [_x(numel, seed=10 + rank)]
            ar.allreduce(t)
            ar.close()
            return t[0]

        return run_threads(world, replica)[0]

    assert torch.equal(run("kept", restart=False), run("restarted", restart=True))


def test_error_feedback_is_always_on_for_a_sparse_wire() -> None:
    cfg = ExchangeConfig(wire_dtype="topk2").resolve(2, "file", "t")
    assert cfg.error_feedback and cfg.error_decay == SPARSELOCO_BETA
    assert ExchangeConfig(wire_dtype="topk2", sparse_outer="diloco").error_decay == 1.0
    assert ExchangeConfig(wire_dtype="int8", sparse_outer="sparseloco").error_decay == 1.0
    with pytest.raises(ValueError, match="sparse_outer"):
        ExchangeConfig(wire_dtype="topk2", sparse_outer="adam")
    with pytest.raises(ValueError, match="sparse_density must be in"):
        ExchangeConfig(wire_dtype="topk2", sparse_density=0)


@pytest.mark.parametrize("outer", ["sparseloco", "diloco"])
def test_sparseloco_takes_the_plain_averaged_outer_step(outer: str) -> None:
    """SparseLoCo's decaying error buffer stands in for the outer momentum: its outer SGD
    has none; DiLoCo with sparsity keeps the run's Nesterov momentum."""
    from tests.test_replica_resume import N, new_store, train

    store, spec = new_store(wire_dtype="topk4", sparse_density=0.1, sparse_outer=outer)
    momentum = 0.0 if outer == "sparseloco" else spec.outer_momentum
    assert momentum > 0 or outer == "sparseloco"
    ctx = run_threads(N, lambda r: train(store, spec, r))[0][0]
    outer_state = ctx.manager.state_dict()["StreamingDiLoCoFragment_0"]["outer_optimizer"]
    group = outer_state["param_groups"][0]
    assert group["momentum"] == momentum and group["nesterov"] == (momentum > 0)
    # the momentum SparseLoCo drops comes back as step size: 0.7 / (1 - 0.5) = 1.4
    lr = spec.outer_lr / (1 - spec.outer_momentum) if outer == "sparseloco" else spec.outer_lr
    assert group["lr"] == pytest.approx(lr)
    assert ctx.manager.exchange.config.error_decay == (
        SPARSELOCO_BETA if outer == "sparseloco" else 1.0
    )
