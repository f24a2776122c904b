"""Each replica's seeds, derived from the run's: a small module of its own, so that the
replica's context and its local ranks both read them without importing each other."""

from __future__ import annotations


def data_seed_of(seed: int, rank: int) -> int:
    """Replica ``rank``'s data seed: kept in [0, 2**32) (numpy's seed range, which
    transformers' set_seed needs) for every valid seed."""
    return (seed * 1_000_003 + rank + 1) % 2**32
