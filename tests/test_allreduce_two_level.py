"""The two-level reduction (``reduce_group_size`` G > 0): groups' sums of slices, leaders,
fallbacks for a member or leader that does not do its part, and the setting's checks.

Replicas are threads sharing one store, as in tests/test_allreduce.py.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch

from crf import layout
from crf.exchange.allreduce import (
    LayoutMismatchError,
    ObjectStoreAllReduce,
    RoundFailed,
    shard_bounds,
)
from crf.exchange.contribution import FACTS, facts_digest
from crf.exchange.groups import GroupPlan
from crf.spec import RunSpec, SpecError
from crf.store import RunStore, decode_tensor
from tests.conftest import run_threads

SHAPES = [(7,), (0,), (3, 5), (1,), (2, 2, 3)]


def make_tensors(rank: int, r: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * r + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def two_level_reference(ranks: list[int], size: int, r: int) -> torch.Tensor:
    """The stated order: per slice i, each group's parts summed in rank order (fp32), the
    groups' sums added in group order, divided by the count."""
    per = {p: flat(make_tensors(p, r)) for p in ranks}
    groups = [ranks[k : k + size] for k in range(0, len(ranks), size)]
    out = torch.empty_like(per[ranks[0]])
    for a, b in shard_bounds(out.numel(), size):
        sums = []
        for members in groups:
            acc = per[members[0]][a:b].clone()
            for p in members[1:]:
                acc += per[p][a:b]
            sums.append(acc)
        total = sums[0].clone()
        for s in sums[1:]:
            total += s
        out[a:b] = total / len(ranks)
    return out


def run_rounds(
    store: RunStore, n: int, size: int, rounds: int, patch: Any = None, **options: Any
) -> list[Any]:
    """n replicas average ``rounds`` rounds with groups of ``size``; ``patch(rank, ar)`` may
    change a replica's exchange first. Each returns its flat averages or its exception."""

    def replica(rank: int) -> list[torch.Tensor]:
        ar = ObjectStoreAllReduce(
            store,
            n,
            rank,
            run_id="t",
            reduce_group_size=size,
            round_timeout_s=20,
            **({"shard_grace_s": 0.3} | options),
        )
        if patch is not None:
            patch(rank, ar)
        out = []
        for r in range(rounds):
            ts = make_tensors(rank, r)
            res = ar.allreduce(ts, round=r)
            assert res.in_quorum and res.participants == list(range(n))
            out.append(flat(ts))
        ar.close()
        return out

    return run_threads(n, replica)


def test_plan_groups_leaders_and_the_uneven_last_group() -> None:
    plan = GroupPlan((0, 1, 2, 3, 4), 2, round=0)
    assert plan.groups == [(0, 1), (2, 3), (4,)] and plan.two_levels
    assert [plan.partial_owner(2, i) for i in range(2)] == [4, 4]  # the lone member sums both
    assert [plan.leader(i) for i in range(2)] == [0, 1]
    late = GroupPlan((0, 1, 2, 3, 4), 2, round=2)  # group 2 leads, but has no member 1
    assert [late.leader(i) for i in range(2)] == [4, 1]
    assert not GroupPlan((3, 5, 7), 4, round=1).two_levels  # G >= N: one group


@pytest.mark.parametrize("n,size", [(5, 2), (5, 3)])
def test_every_replica_gets_the_reference_bits(store: RunStore, n: int, size: int) -> None:
    """Over 3 rounds the leadership rotates through every group, the smaller last one
    included; every replica ends each round with exactly the stated summation's bits."""
    out = run_rounds(store, n, size, rounds=3)
    for r in range(3):
        want = two_level_reference(list(range(n)), size, r)
        for rank in range(n):
            assert not isinstance(out[rank], BaseException), out[rank]
            assert torch.equal(out[rank][r], want), (rank, r)
    # one group sum per (group, slice), carrying the ranks it holds
    members = [list(range(n))[k : k + size] for k in range(0, n, size)]
    for g, group in enumerate(members):
        for i in range(size):
            t, hdr = decode_tensor(store.get(layout.partial_key(2, g, i)))
            assert hdr["participants"] == group and hdr["group"] == g and t.dtype == torch.float32


def test_a_lossy_wire_is_identical_everywhere(store: RunStore) -> None:
    out = run_rounds(store, 5, 2, rounds=1, wire_dtype="int8")
    want = two_level_reference(list(range(5)), 2, 0)
    for rank in range(5):
        assert torch.equal(out[rank][0], out[0][0])
    assert torch.allclose(out[0][0], want, atol=0.05)


class _Died(Exception):
    pass


def test_a_member_withholding_its_sum_is_covered_by_the_leader(store: RunStore) -> None:
    """Replica 3 (member 1 of group 1) never publishes its group's sum of slice 1 but stays
    in the round: after the grace period it is computed from the contributions, and every
    replica, 3 included, gets the full average."""

    def patch(rank: int, ar: ObjectStoreAllReduce) -> None:
        if rank == 3:
            own = ar._reduce_partial

            def withhold(*a: Any, first: bool = False, **k: Any) -> Any:
                return None if first else own(*a, first=first, **k)

            ar._reduce_partial = withhold  # type: ignore[method-assign]

    out = run_rounds(store, 5, 2, rounds=1, patch=patch)
    want = two_level_reference(list(range(5)), 2, 0)
    for rank in range(5):
        assert not isinstance(out[rank], BaseException), out[rank]
        assert torch.equal(out[rank][0], want)
    # computed after the grace period (by the leader or, as its own gather's fallback, by
    # replica 3 itself: whoever comes first), over the whole group
    _, hdr = decode_tensor(store.get(layout.partial_key(0, 1, 1)))
    assert hdr["participants"] == [2, 3]


@pytest.mark.parametrize("dead", [1, 4])
def test_a_dead_member_does_not_hang_the_round(store: RunStore, dead: int) -> None:
    """A participant dies after uploading, before its group sums: replica 1 is also slice
    1's leader in round 0 (the others compute its sum and the slice after the gather's
    grace period); replica 4 is the whole last group. The others finish with the full
    average: the dead one's contribution is in the store."""

    def patch(rank: int, ar: ObjectStoreAllReduce) -> None:
        if rank == dead:

            def die(*a: Any, **k: Any) -> None:
                raise _Died()

            ar._reduce_partial = die  # type: ignore[method-assign]

    out = run_rounds(store, 5, 2, rounds=1, patch=patch)
    assert isinstance(out[dead], _Died)
    want = two_level_reference(list(range(5)), 2, 0)
    for rank in set(range(5)) - {dead}:
        assert not isinstance(out[rank], BaseException), out[rank]
        assert torch.equal(out[rank][0], want)


def test_groups_are_cut_from_the_quorum_and_a_late_replica_catches_up(tmp_path: Any) -> None:
    """Replica 1 misses the quorum, which closes at its deadline with 0, 2, 3, 4: the groups
    are (0, 2) and (3, 4), cut from the participants, not the ranks; the late replica takes
    the published average (catch-up reads the reduced slices as in one level). File store
    only: the straggler's sleep is most of this test's time."""
    import time

    store = RunStore(f"file://{tmp_path}/run")

    def replica(rank: int) -> Any:
        if rank == 1:
            time.sleep(1.5)  # straggler
        ar = ObjectStoreAllReduce(
            store, 5, rank, run_id="t", min_replicas=4, round_timeout_s=0.5, reduce_group_size=2
        )
        ts = make_tensors(rank, 0)
        return ar.allreduce(ts, round=0), flat(ts)

    out = run_threads(5, replica)
    want = two_level_reference([0, 2, 3, 4], 2, 0)
    for rank in range(5):
        res, got = out[rank]
        assert res.participants == [0, 2, 3, 4] and res.in_quorum is (rank != 1)
        assert torch.equal(got, want)
    assert out[1][0].caught_up
    _, hdr = decode_tensor(store.get(layout.partial_key(0, 0, 1)))
    assert hdr["participants"] == [0, 2]


def test_a_bad_group_sum_fails_the_round_for_everyone(store: RunStore) -> None:
    """A group sum that is not this round's (here: garbage already at its create-if-absent
    key) can be neither used nor replaced: every replica raises RoundFailed, none averages."""
    store.put(layout.partial_key(0, 1, 1), b"not a tensor object")
    out = run_rounds(store, 5, 2, rounds=1)
    for rank in range(5):
        assert isinstance(out[rank], RoundFailed), out[rank]
    assert store.exists(layout.failed_key(0))


def test_group_size_at_least_n_is_one_level_over_g_shards(store: RunStore) -> None:
    """G >= N: one group, whose sum of a slice is the whole sum: no partials, the slice's
    owner publishes the average as one level does (here over G = 4 shards)."""
    out = run_rounds(store, 3, 4, rounds=1)
    want = two_level_reference([0, 1, 2], 4, 0)
    for rank in range(3):
        assert torch.equal(out[rank][0], want)
    assert store.list(f"{layout.round_dir(0)}/partial") == []
    assert sorted(store.list(layout.reduced_dir(0)), key=int) == ["0", "1", "2", "3"]


def test_replicas_with_another_group_size_refuse_each_other(store: RunStore) -> None:
    def replica(rank: int) -> Any:
        ar = ObjectStoreAllReduce(
            store, 2, rank, run_id="t", round_timeout_s=10, reduce_group_size=2 * rank
        )
        return ar.allreduce([torch.ones(6)])

    for e in run_threads(2, replica):
        assert isinstance(e, LayoutMismatchError)
        assert "--reduce-group-size" in str(e) and "same reduce_group_size" in str(e)


def test_the_setting_is_checked_early() -> None:
    with pytest.raises(ValueError, match="sparse wire topk4.*use --reduce-group-size 0"):
        ObjectStoreAllReduce("memory://v", 4, 0, reduce_group_size=2, wire_dtype="topk4")
    with pytest.raises(ValueError, match="leave num_shards out"):
        ObjectStoreAllReduce("memory://v", 4, 0, reduce_group_size=2, num_shards=3)
    with pytest.raises(ValueError, match="reduce_group_size must be >= 0"):
        ObjectStoreAllReduce("memory://v", 4, 0, reduce_group_size=-1)
    with pytest.raises(SpecError, match="dense --wire-dtype"):
        RunSpec(run_id="r", run_uri="file:///r", reduce_group_size=4, wire_dtype="topk2").validate()
    RunSpec(run_id="r", run_uri="file:///r", reduce_group_size=4, wire_dtype="int8").validate()


def test_one_level_keeps_its_contribution_names() -> None:
    """G = 0 leaves the facts digest (in every contribution's name) as it was before the
    setting existed: the same formula over the same five facts."""
    manifest = {"run_id": "t", "layout_hash": "ab", "wire_dtype": "float32", "num_shards": 4}
    before = json.dumps({k: manifest.get(k) for k in FACTS}, sort_keys=True)
    assert facts_digest(manifest) == hashlib.sha256(before.encode()).hexdigest()[:12]
    assert facts_digest(manifest | {"reduce_group_size": 2}) != facts_digest(manifest)


def test_the_dry_run_plan_shows_the_reduction(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    base = ["launch", "--job", "lm", "--store", str(tmp_path), "--run-id", "p", "--dry-run"]
    shown = {
        ("-n", "10", "--reduce-group-size", "4"): "two levels: 3 groups (4, 4, 2), 4 slices",
        ("-n", "64", "--reduce-group-size", "8"): "two levels: 8 groups of 8, 8 slices",
        ("-n", "4", "--reduce-group-size", "8"): "one level over 8 shards",
        ("-n", "4", "--wire-dtype", "int8"): "int8 wire, one level",
    }
    for args, text in shown.items():
        out = CliRunner().invoke(app, [*base, *args], env={"COLUMNS": "250"})
        assert out.exit_code == 0, out.output
        assert text in out.output, out.output
