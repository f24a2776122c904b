"""Who does what in a round of the two-level reduction (``reduce_group_size`` G > 0).

The round's participants (sorted, from its one ``quorum.json``) are cut into M = ceil(N / G)
groups of G consecutive ranks; only the last may be smaller. The vector is cut into G slices
(:func:`crf.exchange.allreduce.shard_bounds`). Member i of group g sums slice i over its
group (``rounds/<r>/partial/<i>/<g>``); slice i's leader adds the M partial sums in group
order and publishes the average (``rounds/<r>/reduced/<i>``). Everything here is a function
of the participants, G and the round, so every replica computes the same plan without
talking to the others (docs/performance.md, "Two-level reduction for large N").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class GroupPlan:
    """The groups, partial-sum owners and slice leaders of one round."""

    participants: tuple[int, ...]
    #: G: the group size and the number of slices
    size: int
    round: int

    @cached_property
    def groups(self) -> list[tuple[int, ...]]:
        """Consecutive runs of ``size`` participants; the last one may be smaller."""
        p, g = self.participants, self.size
        return [p[k : k + g] for k in range(0, len(p), g)]

    @property
    def two_levels(self) -> bool:
        """False when all participants fit one group (G >= N): a group's sum is then the
        whole sum, so the round is the one-level reduction over G shards."""
        return len(self.groups) > 1

    def group_of(self, rank: int) -> int:
        return self.participants.index(rank) // self.size

    def partial_owner(self, g: int, i: int) -> int:
        """Who sums slice i over group g: its member i; in a last group smaller than G,
        member i mod its size (so its members share the slices it lacks members for)."""
        members = self.groups[g]
        return members[i % len(members)]

    def leader(self, i: int) -> int:
        """Who adds up the groups' sums of slice i: member i of group ``round mod M`` (the
        extra work rotates with the rounds); if that is the smaller last group and it has
        no member i, member i of the next group (group 0, which is full)."""
        groups = self.groups
        g = self.round % len(groups)
        if i >= len(groups[g]):
            g = (g + 1) % len(groups)
        members = groups[g]
        return members[i % len(members)]


def describe(replicas: int, size: int) -> str:
    """How a full quorum of ``replicas`` is reduced with ``reduce_group_size`` = ``size``,
    in words (the dry-run plan)."""
    if not size:
        return "one level (each replica averages 1/N of the vector over all N)"
    if size >= replicas:
        return f"one level over {size} shards (--reduce-group-size >= replicas: one group)"
    groups = GroupPlan(tuple(range(replicas)), size, 0).groups
    sizes = [len(g) for g in groups]
    shape = f"of {size}" if len(set(sizes)) == 1 else f"({', '.join(map(str, sizes))})"
    return f"two levels: {len(groups)} groups {shape}, {size} slices, one leader per slice"
