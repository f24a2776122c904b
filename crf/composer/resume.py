"""Where a resumed composer trainer's data goes on: the prompts the uninterrupted trainer
would have drawn next, and the epochs it would have drawn them in.

TRL's ``RepeatSampler`` shuffles the whole shard once per epoch from a generator of its own,
seeded by the trainer's seed; a trainer that resumes at optimizer step ``s`` (a restarted or
resumed replica trains only its remaining steps) builds it afresh. :class:`ResumedSampler`
draws the same permutations and skips the indices of the ``s`` steps already trained (whole
epochs drawn and dropped, then the start of the current one), so the resumed trainer sees
the same prompts at the same steps. Its first epoch is then the rest of the uninterrupted
one, so its epochs end where the uninterrupted trainer's did: each new epoch's data-loader
iterator draws its seed from torch's generator, at the same steps in both.

A resume mid-epoch leaves one thing the uninterrupted trainer did not do: the iterator of
that first (partial) epoch, made after ``diloco()`` restored the random-number generators,
drew from them; the replica restores them again before its first step
(:meth:`crf.replica.context.ReplicaContext.restore_rng`, called by ``DiLoCoCallback``), as
transformers' own ``Trainer`` restores ``rng_state.pth`` after skipping batches.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler


class ResumedSampler(Sampler):
    """``sampler``'s stream of indices over its epochs, from the ``skip``-th on; later epochs
    as ``sampler`` draws them."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip
        if hasattr(sampler, "generator"):  # accelerate syncs a shuffling sampler's generator
            self.generator = sampler.generator

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0  # the first epoch only
        length = len(self.sampler)
        for _ in range(skip // length if length else 0):  # whole epochs: drawn, dropped
            collections.deque(iter(self.sampler), maxlen=0)
        return itertools.islice(iter(self.sampler), skip % length if length else 0, None)


def indices_per_step(trainer: Any) -> int:
    """The sampler's indices one optimizer step of ``trainer`` (a GRPOTrainer) takes: its
    gradient-accumulation batches, each of ``per_device_train_batch_size x
    steps_per_generation`` rows (a generation batch, repeated by the sampler), on each of its
    processes."""
    args = trainer.args
    batch = trainer._train_batch_size * args.steps_per_generation
    return batch * args.gradient_accumulation_steps * trainer.accelerator.num_processes


def mid_epoch(sampler: Any, skip: int) -> bool:
    """Whether skipping ``skip`` indices of ``sampler`` stops inside an epoch."""
    length = len(sampler)
    return bool(length) and skip % length != 0
