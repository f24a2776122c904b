"""The packed contribution object: its manifest frame, its names and the byte ranges every
replica computes for a peer's shard frames without reading anything first."""

from __future__ import annotations

import json

import pytest
import torch

from crf.exchange import contribution as c
from crf.exchange.allreduce import ObjectStoreAllReduce, layout_of, shard_bounds
from crf.exchange.codecs import shard_segments
from crf.store import CorruptObjectError, RunStore, decode_tensor
from tests.conftest import run_threads


def test_manifest_round_trips_and_detects_damage() -> None:
    manifest = {"rank": 3, "layout": [[[2, 3], "float32"]], "base_round": None}
    size = c.manifest_size(manifest["layout"], "run", num_shards=4, world_size=4)
    frame = c.encode_manifest(manifest, size)
    assert len(frame) == size and size % 64 == 0
    assert c.decode_manifest(frame, "x") == manifest
    bad = bytearray(frame)
    bad[40] ^= 0x01
    with pytest.raises(CorruptObjectError, match="checksum mismatch"):
        c.decode_manifest(bytes(bad), "x")
    with pytest.raises(CorruptObjectError, match="not a crf contribution"):
        c.decode_manifest(b"CRFTNSR2" + frame[8:], "x")
    with pytest.raises(CorruptObjectError, match="truncated"):
        c.decode_manifest(frame[: c.manifest_length(frame, "x") - 1], "x")
    with pytest.raises(ValueError, match="reserved"):
        c.encode_manifest({"layout": "x" * size}, size)


def test_manifest_size_fits_every_replica_of_a_layout() -> None:
    """M depends only on what replicas agree on; the widest values that differ between them
    (rank, base round, kept shards) still fit."""
    layout = [[[1000, 64], "bfloat16"]] * 7
    for world, shards in ((2, 2), (8, 8), (3, 50), (64, 64)):
        size = c.manifest_size(layout, "my-run-\u00e9", shards, world)
        worst = {
            "rank": world - 1,
            "run_id": "my-run-\u00e9",
            "round": 2**62,
            "layout_hash": "f" * 16,
            "layout": layout,
            "base_round": 2**62,
            "numel": 2**62,
            "num_shards": shards,
            "wire_dtype": "bfloat16",
            "held_back": [s for s in range(shards) if s % world == 0],
            "fragment": 2**30,
        }
        assert len(c.encode_manifest(worst, size)) == size


def test_names_carry_rank_base_round_and_facts() -> None:
    facts = c.facts_digest({"run_id": "r", "layout_hash": "ab", "wire_dtype": "int8"})
    assert len(facts) == 12
    for base in (None, -1, 0, 12):
        name = c.contrib_name(3, base, facts)
        assert c.parse_contrib_name(name) == c.Arrival(3, base, facts, name)
    for junk in (".crf-tmp-123", "3", "3.none", "3.x.abcdefabcdef", "3.1.ABCDEFABCDEF"):
        assert c.parse_contrib_name(junk) is None
    other = c.facts_digest({"run_id": "r", "layout_hash": "ab", "wire_dtype": "float32"})
    assert other != facts


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("world,num_shards", [(2, None), (3, None), (3, 7)])
def test_every_computed_range_holds_its_shard_frame(tmp_path, wire, world, num_shards) -> None:
    """The objects replicas really publish (read back after a round that keeps them): the
    manifest decodes at the start, and at the range ``Packing`` computes for each shard a
    replica publishes there is exactly that shard's frame, checksum intact."""
    store = RunStore(f"file://{tmp_path}/run")
    shapes = [(5, 3), (0,), (11,), (2, 2, 2)]

    def replica(rank: int):
        ar = ObjectStoreAllReduce(
            store,
            world,
            rank,
            run_id="t",
            wire_dtype=wire,
            num_shards=num_shards,
            drop_contributions=False,
        )
        ts = [torch.randn(s) for s in shapes]
        ar.allreduce(ts)
        return ts

    out = run_threads(world, replica)
    assert not [o for o in out if isinstance(o, BaseException)], out
    layout = layout_of([torch.empty(s) for s in shapes])
    total = sum(torch.empty(s).numel() for s in shapes)
    shards = num_shards or world
    bounds = shard_bounds(total, shards)
    packing = c.Packing(
        bounds,
        wire,
        world,
        c.manifest_size(layout, "t", shards, world),
        c.shard_header_size("t"),
        # int8 blocks restart at every tensor: the frames' sizes depend on the pieces
        shard_segments([torch.empty(s).numel() for s in shapes], bounds),
    )
    quorum = json.loads(store.get("rounds/0/quorum.json"))
    assert sorted(quorum["participants"]) == list(range(world))
    for rank in range(world):
        key = c.find_contribution(store, 0, rank)
        assert key is not None
        assert key == c.contrib_key(0, quorum["contributions"][str(rank)]["name"])
        manifest = c.read_manifest(store, key)
        assert manifest["rank"] == rank and manifest["held_back"] == packing.kept(rank)
        data = store.get(key)
        ranges = packing.ranges(rank)
        assert sorted(ranges) == [s for s in range(shards) if s not in packing.kept(rank)]
        assert max(b for _, b in ranges.values()) == len(data)  # nothing else in the object
        for s, (a, b) in ranges.items():
            _, header = decode_tensor(store.get_range(key, a, b))
            assert (header["rank"], header["shard"], header["wire"]) == (rank, s, wire)
