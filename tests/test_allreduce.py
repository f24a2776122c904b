"""ObjectStoreAllReduce: the sharded exchange, quorum, failure handling and validation.

Replicas are threads sharing one store (memory:// and file://); the multi-process path is
covered by the end-to-end tests.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from crf import layout
from crf.exchange import quorum as quorum_mod
from crf.exchange.allreduce import (
    LayoutMismatchError,
    ObjectStoreAllReduce,
    QuorumTimeout,
    RoundFailed,
    shard_bounds,
)
from crf.exchange.contribution import find_contribution
from crf.store import RunStore
from crf.store.codec import MAGIC
from tests.conftest import run_threads

SHAPES = [(7,), (0,), (3, 5), (1,), (2, 2, 3)]


def make_tensors(rank: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def reference_mean(ranks: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 accumulation in rank order, then cast back: what every replica must get."""
    per = [make_tensors(r, dtype) for r in ranks]
    out = []
    for i in range(len(SHAPES)):
        acc = per[0][i].float().clone()
        for p in per[1:]:
            acc += p[i].float()
        out.append((acc / len(ranks)).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_shards", [None, 4, 50])
def test_average_is_exact_and_identical(store: RunStore, dtype, num_shards) -> None:
    n = 3

    def replica(rank: int):
        ar = ObjectStoreAllReduce(
            store, n, rank, run_id="t", num_shards=num_shards, round_timeout_s=30
        )
        ts = make_tensors(rank, dtype)
        res = ar.allreduce(ts)
        return ts, res

    out = run_threads(n, replica)
    expect = reference_mean([0, 1, 2], dtype)
    for ts, res in out:
        assert res.in_quorum and res.participants == [0, 1, 2]
        for got, want in zip(ts, expect, strict=True):
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got, want)


def test_bytes_counted_and_sharded_traffic(store: RunStore) -> None:
    n = 4
    payload = 4 * 40_000  # fp32 bytes

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, n, rank, run_id="t")
        return ar.allreduce([torch.full((40_000,), float(rank))])

    results = run_threads(n, replica)
    for res in results:
        # P up (its own shard stays home, the reduced shard goes up instead) and
        # 2·P·(N-1)/N down, not (N-1)·P: headers add a little
        assert payload <= res.bytes_up <= payload + 4096
        assert res.bytes_down <= 2 * payload * (n - 1) / n + 16384


def test_world_size_one_passes_through_without_store(store: RunStore) -> None:
    ar = ObjectStoreAllReduce(store, 1, 0)
    t = torch.randn(5)
    before = t.clone()
    res = ar.allreduce([t])
    assert torch.equal(t, before) and res.in_quorum and res.bytes_up == 0
    assert store.list("") == []


@pytest.mark.parametrize(
    "world,rank,exc,msg",
    [
        (2, 2, ValueError, "rank must be < world_size"),
        (2, -1, ValueError, "rank must be >= 0"),
        (0, 0, ValueError, "world_size must be >= 1"),
        (2.0, 0, TypeError, "world_size must be an int"),
        (2, "1", TypeError, "rank must be an int"),
        (True, 0, TypeError, "world_size must be an int"),
    ],
)
def test_rank_world_validation(world, rank, exc, msg) -> None:
    with pytest.raises(exc, match=msg):
        ObjectStoreAllReduce("memory://v", world, rank)


def test_other_bad_arguments() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        ObjectStoreAllReduce("memory://v", 2, 0, min_replicas=3)
    with pytest.raises(ValueError, match="wire_dtype"):
        ObjectStoreAllReduce("memory://v", 2, 0, wire_dtype="int4")
    ar = ObjectStoreAllReduce("memory://v", 1, 0)
    with pytest.raises(TypeError, match="only floating"):
        ar.allreduce([torch.arange(3)])


def test_layout_mismatch_is_a_clear_error(store: RunStore) -> None:
    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 2, rank, run_id="t", round_timeout_s=10)
        shape = (3, 4) if rank == 0 else (4, 3)
        return ar.allreduce([torch.ones(2), torch.ones(shape)])

    out = run_threads(2, replica)
    for e in out:
        assert isinstance(e, LayoutMismatchError)
        assert "tensor 1 is float32(3, 4) here vs float32(4, 3)" in str(
            e
        ) or "tensor 1 is float32(4, 3) here vs float32(3, 4)" in str(e)

    def count(rank: int):
        ar = ObjectStoreAllReduce(store, 2, rank, run_id="t", round_timeout_s=10)
        return ar.allreduce([torch.ones(2)] * (1 + rank), round=1)

    for e in run_threads(2, count):
        assert (
            isinstance(e, LayoutMismatchError)
            and "1 tensors here vs 2" in str(e)
            or "2 tensors here vs 1" in str(e)
        )


@pytest.mark.parametrize("catch_up", [True, False])
def test_quorum_at_deadline_and_late_replica_excluded(store: RunStore, catch_up: bool) -> None:
    """Two of three arrive; the deadline closes the quorum with them; the third is out. With
    catch_up (the default) it takes the published average; without, its tensors stay."""
    import time

    def replica(rank: int):
        if rank == 2:
            time.sleep(1.5)  # straggler
        ar = ObjectStoreAllReduce(
            store, 3, rank, run_id="t", min_replicas=2, round_timeout_s=0.5, catch_up=catch_up
        )
        ts = make_tensors(rank)
        before = [t.clone() for t in ts]
        return ar.allreduce(ts), ts, before

    out = run_threads(3, replica)
    expect = reference_mean([0, 1], torch.float32)
    for rank in (0, 1):
        res, ts, _ = out[rank]
        assert res.in_quorum and res.participants == [0, 1]
        assert all(torch.equal(a, b) for a, b in zip(ts, expect, strict=True))
    res, ts, before = out[2]
    assert not res.in_quorum and res.participants == [0, 1] and res.caught_up is catch_up
    want = expect if catch_up else before
    assert all(torch.equal(a, b) for a, b in zip(ts, want, strict=True))
    quorum = json.loads(store.get("rounds/0/quorum.json"))
    assert quorum["reason"] == "deadline" and quorum["participants"] == [0, 1]


def test_quorum_timeout_below_min_replicas(store: RunStore) -> None:
    ar = ObjectStoreAllReduce(store, 3, 0, run_id="t", min_replicas=2, round_timeout_s=0.3)
    with pytest.raises(QuorumTimeout, match="only 1 of 3 replicas arrived"):
        ar.allreduce([torch.ones(3)])
    assert not store.exists("rounds/0/quorum.json")


class _Died(Exception):
    pass


def run_with_a_death(store: RunStore, dead: int, step: str) -> list[Any]:
    """Three replicas average once; replica ``dead`` dies (raises _Died) when it reaches the
    exchange's ``step`` method. Returns each one's (flat tensors, result) or exception."""

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", shard_grace_s=0.3, round_timeout_s=20)
        if rank == dead:

            def die(*a, **k):
                raise _Died()

            setattr(ar, step, die)
        ts = make_tensors(rank)
        res = ar.allreduce(ts)
        return torch.cat([t.reshape(-1) for t in ts]), res

    return run_threads(3, replica)


def shardwise_mean(users: dict[int, list[int]], num_shards: int) -> torch.Tensor:
    """Expected flat average when shard s is averaged over ranks users.get(s, all 3)."""
    per = [torch.cat([t.reshape(-1) for t in make_tensors(r)]) for r in range(3)]
    out = torch.empty_like(per[0])
    for s, (a, b) in enumerate(shard_bounds(out.numel(), num_shards)):
        ranks = users.get(s, [0, 1, 2])
        acc = per[ranks[0]][a:b].clone()
        for r in ranks[1:]:
            acc += per[r][a:b]
        out[a:b] = acc / len(ranks)
    return out


def test_dead_shard_owner_is_covered(store: RunStore) -> None:
    """Replica 1 uploads, is in the quorum, then dies before reducing its shard: the others
    compute shard 1 without it (its own part of shard 1 never left it) and stay identical."""
    out = run_with_a_death(store, 1, "_reduce_shard")
    assert isinstance(out[1], _Died)
    expect = shardwise_mean({1: [0, 2]}, 3)
    for rank in (0, 2):
        assert torch.equal(out[rank][0], expect)
    assert store.exists("rounds/0/reduced/1")
    assert any(
        "owner 1 did not reduce it" in str(m) for m in out[0][1].rejected + out[2][1].rejected
    )


def flip_in_shard_frame(data: Any, frame: int) -> bytes:
    """A contribution object with one payload byte of its ``frame``-th shard frame flipped
    (frames start with the tensor codec's magic; the payload ends where the next begins)."""
    b = bytearray(b"".join(data) if isinstance(data, list) else data)
    starts = [i for i in range(len(b)) if b[i : i + 8] == MAGIC]
    end = starts[frame + 1] if frame + 1 < len(starts) else len(b)
    b[end - 3] ^= 0xFF
    return bytes(b)


def test_corrupt_contribution_is_never_averaged(store: RunStore) -> None:
    """A bit flip in one uploaded shard: that contribution is left out of that shard's
    average, the rejection is reported, and every replica still ends identical."""
    real_put = store.put

    def flipping_put(key: str, data: bytes, **kw: Any) -> None:
        if key.startswith("rounds/0/contrib/2."):  # replica 2's: frames of shards 0 and 1
            data = flip_in_shard_frame(data, 0)
        real_put(key, data, **kw)

    store.put = flipping_put  # type: ignore[method-assign]

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", round_timeout_s=20, shard_grace_s=0.5)
        ts = make_tensors(rank)
        res = ar.allreduce(ts)
        return torch.cat([t.reshape(-1) for t in ts]), res

    out = run_threads(3, replica)
    expect = shardwise_mean({0: [0, 1]}, 3)
    for flat, _ in out:
        assert torch.equal(flat, expect)
    rejected = out[0][1].rejected  # shard 0 is owned by replica 0
    assert any(
        "rounds/0/contrib/2#0" in str(m) and "checksum mismatch" in str(m) for m in rejected
    ), rejected


def test_bad_reduced_shard_fails_the_round_for_everyone(store: RunStore) -> None:
    """The published average itself is corrupt: nobody can use it, the round is marked
    failed for all, and no replica applies anything."""
    real_put_if_absent = store.put_if_absent

    def flipping(key: str, data: bytes, **kw: Any) -> bool:
        if key == "rounds/0/reduced/1":
            b = bytearray(b"".join(data) if isinstance(data, list) else data)
            b[-1] ^= 0x01
            data = bytes(b)
        return real_put_if_absent(key, data, **kw)

    store.put_if_absent = flipping  # type: ignore[method-assign]

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", round_timeout_s=20)
        ts = make_tensors(rank)
        before = [t.clone() for t in ts]
        try:
            ar.allreduce(ts)
            return None, ts, before
        except RoundFailed as e:
            return e, ts, before

    out = run_threads(3, replica)
    for rank in (0, 2):  # replica 1 published it and uses its own good copy
        err, ts, before = out[rank]
        assert isinstance(err, RoundFailed) and "checksum" in str(err)
        assert all(torch.equal(a, b) for a, b in zip(ts, before, strict=True))
    assert store.exists("rounds/0/failed.json")


def test_garbage_collection_keeps_last_rounds(store: RunStore) -> None:
    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 2, rank, run_id="t", keep_rounds=2)
        for _ in range(5):
            ar.allreduce([torch.ones(4) * rank])
            if rank == 0:
                ar.collect_garbage(ar.next_round - 1)
        return ar

    run_threads(2, replica)
    # round 4 is current; rounds <= 2 are gone (a replica still reading round 3 is safe)
    assert store.list("rounds") == ["3", "4"]


def test_shard_bounds_cover_everything() -> None:
    for total in (0, 1, 7, 100):
        for k in (1, 3, 8):
            b = shard_bounds(total, k)
            assert len(b) == k and b[0][0] == 0 and b[-1][1] == total
            assert all(x[1] == y[0] for x, y in zip(b, b[1:], strict=False))


@pytest.mark.parametrize("wire,ratio", [("bfloat16", 2.0), ("float16", 2.0), ("int8", 4.0)])
def test_compressed_wire_bytes_and_determinism(store: RunStore, wire: str, ratio: float) -> None:
    n, numel = 3, 30_000

    def replica(rank: int, w: str, prefix: str):
        ar = ObjectStoreAllReduce(store.child(prefix), n, rank, run_id="t", wire_dtype=w)
        g = torch.Generator().manual_seed(rank)
        t = [torch.randn(numel, generator=g)]
        res = ar.allreduce(t)
        return t[0], res

    exact = run_threads(n, lambda r: replica(r, "float32", "fp32"))
    comp = run_threads(n, lambda r: replica(r, wire, wire))
    for (t, res), (t32, res32) in zip(comp, exact, strict=True):
        assert torch.equal(t, comp[0][0])  # deterministic: identical bits everywhere
        err = (t - t32).abs().max().item()
        assert err < (0.02 if wire == "int8" else 0.01), err
        got = (res32.bytes_up + res32.bytes_down) / (res.bytes_up + res.bytes_down)
        assert got == pytest.approx(ratio, rel=0.08), got


def test_int8_error_feedback_keeps_error_from_accumulating(store: RunStore) -> None:
    """Both replicas send the same values for many rounds: with error feedback the running
    mean of what arrives converges to the truth; without it the quantization bias stays."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, generator=g) * torch.logspace(-3, 0, 2000)
    rounds = 20

    def run(feedback: bool, prefix: str) -> float:
        def replica(rank: int) -> torch.Tensor:
            ar = ObjectStoreAllReduce(
                store.child(prefix), 2, rank, wire_dtype="int8", error_feedback=feedback
            )
            total = torch.zeros_like(x)
            for _ in range(rounds):
                a = x.clone()
                ar.allreduce([a])
                total += a
            return total / rounds

        mean = run_threads(2, replica)[0]
        return (mean - x).abs().mean().item()

    assert run(True, "ef") < 0.3 * run(False, "noef")


def test_stale_base_round_is_kept_out_of_the_quorum(store: RunStore) -> None:
    """A replica whose weights start from an older global round (it missed a commit) must
    not be averaged with the others: it is left out and told so (in_quorum False)."""

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", round_timeout_s=20, min_replicas=2)
        ts = make_tensors(rank)
        return ar.allreduce(ts, round=5, base_round=3 if rank == 1 else 4), ts

    out = run_threads(3, replica)
    expect = reference_mean([0, 2], torch.float32)
    for rank in (0, 2):
        res, ts = out[rank]
        assert res.participants == [0, 2]
        assert all(torch.equal(a, b) for a, b in zip(ts, expect, strict=True))
    assert out[1][0].in_quorum is False and out[1][0].stale_behind == 4
    assert json.loads(store.get("rounds/5/quorum.json"))["stale"] == [1]


def test_non_contiguous_tensors_and_rounds_of_other_sizes(store: RunStore) -> None:
    """The exact wire reads the tensors in place (no flat copy) and writes the average back
    into each; non-contiguous tensors, mixed dtypes (which take the flat path) and rounds of
    other sizes (Streaming DiLoCo's fragments, reusing the kept buffers) all come out exact."""
    n = 2

    def tensors(rank: int, k: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(10 * rank + k)
        a = torch.randn(4, 6, generator=g).t()  # non-contiguous
        b = torch.randn(5 + k, generator=g)
        c = torch.randn(3, generator=g)
        c = c.to(torch.bfloat16) if k == 2 else c
        return [a, b, c]

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, n, rank, run_id="t", num_shards=3, round_timeout_s=30)
        out = []
        for k in range(4):  # sizes 35, 36, 37 (with a bf16 tensor), 38
            ts = tensors(rank, k)
            ar.allreduce(ts, fragment=k % 2)
            out.append(ts)
        return out

    out = run_threads(n, replica)
    for k in range(4):
        per = [tensors(r, k) for r in range(n)]
        for i in range(3):
            want = ((per[0][i].float() + per[1][i].float()) / n).to(per[0][i].dtype)
            for rank in range(n):
                got = out[rank][k][i]
                assert not (i == 0 and got.is_contiguous())
                assert torch.equal(got, want), (k, i, rank)


@pytest.mark.parametrize("drop", [None, False])
def test_a_finished_replica_drops_its_contribution(tmp_path, drop) -> None:
    """On a local folder each replica deletes its contribution once it holds every reduced
    shard (the disk need not write it back); the quorum and reduced shards stay for the GC.
    ``drop_contributions=False`` keeps them, as object stores do by default."""
    store = RunStore(f"file://{tmp_path}/run")

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", drop_contributions=drop)
        ar.allreduce(make_tensors(rank))
        ar.close()  # waits for the background delete
        return ar

    run_threads(3, replica)
    left = [find_contribution(store, 0, rank) for rank in range(3)]
    assert left == [None] * 3 if drop is None else all(left)
    assert sorted(store.list("rounds/0/reduced")) == ["0", "1", "2"]
    assert store.exists("rounds/0/quorum.json")
    assert not ObjectStoreAllReduce(RunStore("memory://x/y"), 2, 0).config.drop_contributions


def test_a_late_owner_defers_to_the_average_published_without_it(tmp_path) -> None:
    """Replica 1 reaches its own shard only after the others covered it (grace) and dropped
    their contributions: it finds them gone, takes the published average and reports
    nothing as rejected; all three end identical."""
    store = RunStore(f"file://{tmp_path}/run")

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", shard_grace_s=0.3, round_timeout_s=20)
        if rank == 1:
            real = ar._reduce_shard

            def late(res, job, s, *, first=False):
                deadline = time.monotonic() + 20
                while (
                    any(find_contribution(store, 0, p) for p in (0, 2))
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.02)
                return real(res, job, s, first=first)

            ar._reduce_shard = late  # type: ignore[method-assign]
        ts = make_tensors(rank)
        res = ar.allreduce(ts)
        ar.close()
        return torch.cat([t.reshape(-1) for t in ts]), res

    out = run_threads(3, replica)
    expect = shardwise_mean({1: [0, 2]}, 3)
    for flat, _ in out:
        assert torch.equal(flat, expect)
    assert out[1][1].rejected == [] and 1 not in out[1][1].shards_computed


def test_int8_codec_round_trips_block_by_block() -> None:
    """The chunked int8 codec: per-block absmax scales, codes within ±127, the tail block
    padded, decode into a caller's buffer equal to a fresh decode, and an all-zero block
    keeps scale 1 (no division by zero)."""
    from crf.exchange import codecs as wire

    n = wire.INT8_CHUNK + wire.INT8_BLOCK * 3 + 17  # more than one chunk, a partial block
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 5
    x[: wire.INT8_BLOCK] = 0.0
    w = wire.encode(x, "int8")
    nblocks = (n + wire.INT8_BLOCK - 1) // wire.INT8_BLOCK
    assert w.dtype == torch.uint8 and w.numel() == nblocks * 4 + n
    scales = w[: nblocks * 4].clone().view(torch.float32)
    assert scales[0] == 1.0
    for i in (1, nblocks // 2, nblocks - 1):
        block = x[i * wire.INT8_BLOCK : (i + 1) * wire.INT8_BLOCK]
        assert scales[i] == block.abs().max() / 127.0
    y = wire.decode(w, "int8", n)
    assert torch.equal(y[: wire.INT8_BLOCK], torch.zeros(wire.INT8_BLOCK))
    # at most half a step of its block's scale away
    step = scales.repeat_interleave(wire.INT8_BLOCK)[:n]
    assert torch.all((y - x).abs() <= step / 2 + 1e-6)
    out = torch.full((n,), float("nan"))
    assert wire.decode(w, "int8", n, out=out) is out and torch.equal(out, y)
    with pytest.raises(ValueError, match="fp32 values"):
        wire.decode(w, "int8", n, out=torch.empty(n - 1))
    # adding a shard chunk by chunk gives the bits of adding its full decode
    acc = torch.randn(n, generator=torch.Generator().manual_seed(4))
    assert torch.equal(wire.decode_add(w, "int8", n, acc.clone()), acc + y)


@pytest.mark.parametrize("non_contiguous", [False, True])
def test_compressed_wire_over_many_tensors_matches_the_codec_shard_by_shard(
    store: RunStore, non_contiguous: bool
) -> None:
    """int8 shards that straddle tensors are encoded from the tensors' slices and decoded
    back into them (in place, or through a copy for a non-contiguous tensor): the same bits
    as the codec applied shard by shard to the concatenated values, with its blocks cut
    along the tensors' pieces (blocks never span two tensors, so these are not the bits of one
    long vector)."""
    from crf.exchange import codecs as wire

    n = 3

    def tensors(rank: int) -> list[torch.Tensor]:
        ts = [t * 50 for t in make_tensors(rank)]
        if non_contiguous:
            ts[2] = ts[2].t().contiguous().t()  # same values, strides of a transpose
        return ts

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, n, rank, run_id="t", wire_dtype="int8")
        ts = tensors(rank)
        ar.allreduce(ts)
        return torch.cat([t.reshape(-1) for t in ts])

    many = run_threads(n, replica)
    flat = [torch.cat([t.reshape(-1) for t in tensors(r)]) for r in range(n)]
    bounds = shard_bounds(flat[0].numel(), n)
    segs = wire.shard_segments([t.numel() for t in tensors(0)], bounds)
    expect = []
    for (a, b), seg in zip(bounds, segs, strict=True):
        acc = torch.zeros(b - a)
        for x in flat:  # rank order, fp32
            acc += wire.decode(wire.encode(x[a:b], "int8", seg), "int8", b - a, segments=seg)
        acc /= n
        expect.append(wire.decode(wire.encode(acc, "int8", seg), "int8", b - a, segments=seg))
    for got in many:
        assert torch.equal(got, torch.cat(expect))
    assert not torch.equal(many[0], flat[0])


def test_lowest_rank_decides_a_full_quorum(store: RunStore) -> None:
    """When everyone has arrived, only the lowest eligible rank writes quorum.json: the
    others read it instead of racing N conditional writes (each refusal costs more requests)."""
    n = 4
    attempts: dict[int, int] = {}

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, n, rank, run_id="t", round_timeout_s=30)
        put = ar._put

        def counting_put(res, key, data, *, exclusive=False):
            if key.endswith("quorum.json"):
                attempts[rank] = attempts.get(rank, 0) + 1
            return put(res, key, data, exclusive=exclusive)

        ar._put = counting_put  # type: ignore[method-assign]
        ts = make_tensors(rank)
        return ar.allreduce(ts), ts

    out = run_threads(n, replica)
    expect = reference_mean(list(range(n)), torch.float32)
    for res, ts in out:
        assert res.participants == list(range(n))
        assert all(torch.equal(a, b) for a, b in zip(ts, expect, strict=True))
    assert attempts == {0: 1}
    quorum = json.loads(store.get("rounds/0/quorum.json"))
    assert quorum["decided_by"] == 0 and quorum["reason"] == "all arrived"


def test_lag_is_asked_where_it_can_matter(store: RunStore, monkeypatch) -> None:
    """Whether a replica lags the others costs a LIST of global/ (and of rounds/): rank 0,
    the usual decider of a full quorum, asks up front, a replica that only reads the
    decision never needs to. A straggler alone in a round the others left long ago (its
    folder gone, a newer global state there) asks at once and learns it is behind, long
    before the round's deadline."""
    n = 3
    asked: list[int] = []
    # "still waiting after 0.5 s" must not fire on a slow machine: only the rules above
    monkeypatch.setattr(quorum_mod, "LAG_CHECK_AFTER_S", 60.0)

    def replica(rank: int, r: int = 0, base: int = -1):
        ar = ObjectStoreAllReduce(store, n, rank, run_id="t", round_timeout_s=30)
        lag = ar._lag_behind

        def counting(round_: int):
            asked.append(rank)
            return lag(round_)

        ar._lag_behind = counting  # type: ignore[method-assign]
        return ar.allreduce(make_tensors(rank), round=r, base_round=base)

    # everyone arrives, in rank order: only rank 0 is ever alone, nobody waits for long
    def in_order(rank: int):
        if rank > 0:
            deadline = time.monotonic() + 10
            while find_contribution(store, 0, rank - 1) is None:
                assert time.monotonic() < deadline
                time.sleep(0.001)
        return replica(rank)

    out = run_threads(n, in_order)
    assert all(res.participants == [0, 1, 2] for res in out)
    assert asked == [0]

    # the straggler: round 7's folder is gone and global/9 exists
    store.put(layout.global_key(9), b"x")
    asked.clear()
    t0 = time.monotonic()
    res = replica(2, r=7, base=6)
    assert res.in_quorum is False and res.stale_behind == 9
    assert asked == [2] and time.monotonic() - t0 < 10


def test_a_decider_that_died_after_arriving_is_replaced(store: RunStore) -> None:
    """Replica 0 publishes its contribution, then dies before deciding the quorum it was due
    to write: after a short grace the others decide it themselves, cover the shard replica
    0 owned (its own part of it never left it) and finish identical."""
    out = run_with_a_death(store, 0, "_decide_quorum")
    assert isinstance(out[0], _Died)
    expect = shardwise_mean({0: [1, 2]}, 3)
    for rank in (1, 2):
        got, res = out[rank]
        assert res.participants == [0, 1, 2]
        assert torch.equal(got, expect)
    quorum = json.loads(store.get("rounds/0/quorum.json"))
    assert quorum["decided_by"] in (1, 2) and quorum["reason"] == "all arrived"


def test_owner_downloads_its_shard_while_the_quorum_is_open(store: RunStore) -> None:
    """An owner fetches the parts of its shard as each peer's manifest appears, before the
    quorum is decided (replica 2 arrives late here), and never downloads one twice."""
    fetched: list[tuple[int, int, bool]] = []

    def replica(rank: int):
        if rank == 2:
            time.sleep(0.8)
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", round_timeout_s=30, fetch_early=True)
        if rank == 0:
            fetch = ar._fetch_contrib

            def recording_fetch(res, job, p, s, wait_s, **kw):
                fetched.append((p, s, store.exists("rounds/0/quorum.json")))
                return fetch(res, job, p, s, wait_s, **kw)

            ar._fetch_contrib = recording_fetch  # type: ignore[method-assign]
        ts = make_tensors(rank)
        return ar.allreduce(ts), ts

    out = run_threads(3, replica)
    expect = reference_mean([0, 1, 2], torch.float32)
    for res, ts in out:
        assert res.participants == [0, 1, 2]
        assert all(torch.equal(a, b) for a, b in zip(ts, expect, strict=True))
    assert sorted((p, s) for p, s, _ in fetched) == [(1, 0), (2, 0)]  # once each
    assert (1, 0, False) in fetched  # replica 1's part came down before the quorum existed


def test_early_downloads_are_for_object_stores(tmp_path) -> None:
    """Owners download during the quorum on object stores; on a local folder the reads are
    cheap and would compete with the peers' writes, so there it is off unless asked for."""
    assert not ObjectStoreAllReduce(RunStore(f"file://{tmp_path}"), 2, 0).config.fetch_early
    asked = ObjectStoreAllReduce(RunStore(f"file://{tmp_path}"), 2, 0, fetch_early=True)
    assert asked.config.fetch_early


@pytest.mark.parametrize("num_shards", [1, 2])
def test_int8_small_tensor_keeps_its_own_precision(store: RunStore, num_shards: int) -> None:
    """A bias of magnitude 0.01 between two weights of magnitude ~5. Its int8
    blocks are its own (with 2 shards it is also split across the shard boundary), so after
    the exchange its error is bounded by its own scale (0.01 / 127 per quantization step),
    not by its neighbours' (on blocks shared with them the error was 0.015, as large as the
    bias itself: 90 times this bound)."""
    n = 2
    sizes = (400, 10, 400)  # 2 shards: [0, 405) and [405, 810) cut the bias in halves

    def tensors(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(7 + rank)
        w1, b, w2 = (torch.randn(k, generator=g) for k in sizes)
        return [w1 * 5, b * 0.01, w2 * 5]

    def replica(rank: int):
        ar = ObjectStoreAllReduce(
            store, n, rank, run_id="t", wire_dtype="int8", num_shards=num_shards
        )
        ts = tensors(rank)
        ar.allreduce(ts)
        return ts

    out = run_threads(n, replica)
    exact = [(x + y) / 2 for x, y in zip(tensors(0), tensors(1), strict=True)]
    assert torch.equal(out[0][1], out[1][1])  # identical bits on every replica
    bias_scale = max(t[1].abs().max().item() for t in (tensors(0), tensors(1))) / 127
    err = (out[0][1] - exact[1]).abs().max().item()
    # two quantizations (the contributions, then the average), half a step each
    assert err <= 1.5 * bias_scale, (err, bias_scale)
    for i in (0, 2):  # the large tensors keep the precision of their own scale too
        scale = max(t[i].abs().max().item() for t in (tensors(0), tensors(1))) / 127
        assert (out[0][i] - exact[i]).abs().max().item() <= 1.5 * scale


def test_int8_blocks_follow_the_tensors_pieces() -> None:
    """The pieces of each shard (a tensor split by a shard boundary gives one to each, an
    empty tensor none) and the blocks cut along them: a block per started 256 values of
    each piece, none spanning two."""
    from crf.exchange import codecs as wire

    sizes = [300, 0, 10, 700]
    bounds = shard_bounds(sum(sizes), 3)  # [0, 337), [337, 674), [674, 1010)
    assert wire.shard_segments(sizes, bounds) == [[300, 10, 27], [337], [336]]
    pieces, nblocks = wire.int8_blocks(337, [300, 10, 27])
    assert pieces == [(0, 300, 0), (300, 310, 2), (310, 337, 3)] and nblocks == 4
    assert wire.wire_nbytes("int8", 337, [300, 10, 27]) == 4 * 4 + 337
    with pytest.raises(ValueError, match="cover 336 values"):
        wire.int8_blocks(337, [336])


def test_membership_follows_liveness(store: RunStore) -> None:
    """With ``follow_liveness`` a round waits for the previous round's members and for
    replicas whose fresh heartbeat says they are at most one round behind. Rank 2 of 3 stops
    after round 0 (its heartbeat, stuck in round 1, goes old): neither round 1, of which it
    was a member, nor round 2 waits for it; both are decided as soon as ranks 0 and 1 are
    in. Then it comes back (a fresh heartbeat one round behind) and round 3 waits for it: it
    takes part again."""
    deadline = 3.0
    took: dict[tuple[int, int], float] = {}

    def beat(at: int, age: float) -> None:
        body = {"phase": "training", "exchange_round": at, "updated_at": time.time() - age}
        store.put_json("replicas/2/state.json", body)

    def replica(rank: int):
        ar = ObjectStoreAllReduce(
            store,
            3,
            rank,
            run_id="t",
            min_replicas=2,
            round_timeout_s=deadline,
            follow_liveness=True,
        )
        out = {}
        if rank == 2:
            beat(1, 60.0)  # it will have died in round 1 long ago (round 0 reads no heartbeat)
        for r in range(4):
            if rank == 2 and r == 1:
                while not store.exists("rounds/2/quorum.json"):
                    time.sleep(0.01)
                beat(2, 0.0)  # back, one round behind; computing round 3 takes it a while
                time.sleep(1.0)
                continue
            if rank == 2 and r in (1, 2):
                continue
            if r == 3 and rank != 2:
                time.sleep(0.5)  # computing round 3
            t0 = time.monotonic()
            out[r] = ar.allreduce(make_tensors(rank), round=r).participants
            took[(rank, r)] = time.monotonic() - t0
        return out

    out = run_threads(3, replica)
    assert out[0] == out[1] == {0: [0, 1, 2], 1: [0, 1], 2: [0, 1], 3: [0, 1, 2]}, out
    assert out[2] == {0: [0, 1, 2], 3: [0, 1, 2]}, out
    quorum = {r: json.loads(store.get(f"rounds/{r}/quorum.json")) for r in range(4)}
    for r in (1, 2):
        assert quorum[r]["reason"] == "all live arrived" and quorum[r]["not_waited_for"] == [2]
        assert took[(0, r)] < deadline / 2 and took[(1, r)] < deadline / 2, took
    assert quorum[3]["reason"] == "all arrived"


def test_a_member_gone_quiet_is_not_waited_for_but_a_slow_one_is(store: RunStore) -> None:
    """With ``follow_liveness`` a member of the previous round that has no contribution and
    a heartbeat older than the freshness window is not waited for: rank 2 of 3 took part in
    round 0, then died (its heartbeat stopped long ago), and round 1 is decided as soon as
    ranks 0 and 1 are in. A member that is only slow keeps its heartbeat fresh: rank 1
    computes round 2 for a while, and round 2 waits for it and averages its part."""
    deadline = 4.0
    took: dict[tuple[int, int], float] = {}

    def beat(rank: int, at: int, age: float) -> None:
        body = {"phase": "training", "exchange_round": at, "updated_at": time.time() - age}
        store.put_json(f"replicas/{rank}/state.json", body)

    def replica(rank: int):
        ar = ObjectStoreAllReduce(
            store, 3, rank, run_id="t", min_replicas=2, round_timeout_s=deadline,
            follow_liveness=True,
        )  # fmt: skip
        out = {}
        if rank == 2:
            beat(2, 0, 60.0)  # what it will have left (round 0 reads no heartbeat)
        for r in range(3):
            if rank == 2 and r == 1:
                break  # died after round 0's quorum, its heartbeat long stopped (below)
            if rank == 1 and r == 2:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 1.5:  # slow, alive: its heartbeat goes on
                    beat(1, 1, 0.0)
                    time.sleep(0.1)
            t0 = time.monotonic()
            out[r] = ar.allreduce(make_tensors(rank), round=r).participants
            took[(rank, r)] = time.monotonic() - t0
        return out

    out = run_threads(3, replica)
    assert out[0] == out[1] == {0: [0, 1, 2], 1: [0, 1], 2: [0, 1]}, out
    quorum = {r: json.loads(store.get(f"rounds/{r}/quorum.json")) for r in range(3)}
    assert quorum[1]["reason"] == "all live arrived" and quorum[1]["not_waited_for"] == [2]
    assert took[(0, 1)] < deadline / 2 and took[(1, 1)] < deadline / 2, took
    assert took[(0, 2)] >= 1.0, took  # it waited for the slow member, who took part
    assert quorum[2]["participants"] == [0, 1] and quorum[2]["not_waited_for"] == [2]


def test_without_heartbeats_a_replica_left_out_is_waited_for_as_before(store: RunStore) -> None:
    """Without ``follow_liveness`` (the default: nothing writes heartbeats) every round waits
    for everyone until its deadline, whoever took part in the round before."""

    def replica(rank: int):
        ar = ObjectStoreAllReduce(store, 3, rank, run_id="t", min_replicas=2, round_timeout_s=1.0)
        parts = []
        for r in range(2):
            if rank == 2:
                break
            parts.append(ar.allreduce(make_tensors(rank), round=r).participants)
        return parts

    out = run_threads(3, replica)
    assert out[0] == out[1] == [[0, 1], [0, 1]]
    assert json.loads(store.get("rounds/1/quorum.json"))["reason"] == "deadline"


def test_a_member_in_a_long_step_is_waited_for_while_it_is_heard_from(store: RunStore) -> None:
    """A member whose last news is old (one long step: a generation, an evaluation) but
    whose heartbeat thread keeps ``alive_at`` fresh has not gone quiet: round 1 waits for
    it and averages its part, instead of closing without it."""
    deadline = 4.0

    def replica(rank: int):
        ar = ObjectStoreAllReduce(
            store, 2, rank, run_id="t", min_replicas=1, round_timeout_s=deadline,
            follow_liveness=True,
        )  # fmt: skip
        out = {}
        for r in range(2):
            if rank == 1 and r == 1:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 1.5:  # one long step: no news, alive
                    now = time.time()
                    body = {"phase": "training", "exchange_round": 0, "updated_at": now - 60,
                            "alive_at": now}  # fmt: skip
                    store.put_json("replicas/1/state.json", body)
                    time.sleep(0.1)
            out[r] = ar.allreduce(make_tensors(rank), round=r).participants
        return out

    out = run_threads(2, replica)
    assert out[0] == out[1] == {0: [0, 1], 1: [0, 1]}, out


def test_a_resumed_launch_waits_for_a_member_that_starts_late(store: RunStore) -> None:
    """Every replica of a resumed launch knows round 0's members only from the store, and
    their heartbeats are the stopped launch's, long stale. A replica that starts late (a
    slow import) is waited for - its heartbeat is older than the others' start, it may be
    starting too - and takes part, so the resumed run matches one left alone."""

    def stopped_launch(rank: int):
        ar = ObjectStoreAllReduce(store, 2, rank, run_id="t", min_replicas=1,
                                  round_timeout_s=4.0, follow_liveness=True)  # fmt: skip
        return ar.allreduce(make_tensors(rank), round=0).participants

    assert run_threads(2, stopped_launch) == [[0, 1], [0, 1]]
    for rank in range(2):  # what the killed launch left: heartbeats a minute old
        old = time.time() - 60
        body = {"phase": "training", "exchange_round": 0, "updated_at": old, "alive_at": old}
        store.put_json(f"replicas/{rank}/state.json", body)

    def resumed(rank: int):
        ar = ObjectStoreAllReduce(store, 2, rank, run_id="t", min_replicas=1,
                                  round_timeout_s=6.0, follow_liveness=True)  # fmt: skip
        if rank == 1:
            time.sleep(1.5)  # still importing when rank 0 arrives
        return ar.allreduce(make_tensors(rank), round=1).participants

    assert run_threads(2, resumed) == [[0, 1], [0, 1]]
