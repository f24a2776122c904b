"""Which of this machine's GPUs each local replica and rollout worker sees.

Every process a local run starts would otherwise see all of the machine's GPUs and train on
the first (``cuda`` is ``cuda:0``), so ``crf launch -n 4`` on an 8-GPU machine put four
replicas on GPU 0 and left seven idle, and the K local ranks of every replica
(``--procs-per-replica``) shared GPUs 0..K-1. The local backend gives each process its own
``CUDA_VISIBLE_DEVICES`` instead: replica r the K GPUs after those of replicas 0..r-1, then
rollout worker w one GPU each after all the replicas', in rank order. With more processes
than GPUs they take them in turn (small models share a GPU well; the GPU benchmark runs two
replicas on one).

The GPUs counted are those this process may use: ``CUDA_VISIBLE_DEVICES`` as the user set it
(its entries are handed out as written: indices or ``GPU-<uuid>``), else every GPU torch sees.
Nothing is set with one GPU or none, nor when a replica's K ranks need more GPUs than there
are (two ranks of one replica cannot share a GPU under NCCL).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CUDA_VISIBLE_DEVICES", "GpuSlots", "visible_gpus"]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may hand out: the entries of ``CUDA_VISIBLE_DEVICES`` up to the
    first that names none (CUDA stops there too: ``-1`` hides every GPU after it), else one
    index per GPU torch counts."""
    env = os.environ if environ is None else environ
    given = env.get(CUDA_VISIBLE_DEVICES)
    if given is not None:
        out: list[str] = []
        for entry in (e.strip() for e in given.split(",")):
            if not entry or entry.startswith("-"):
                break
            out.append(entry)
        return out
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class GpuSlots:
    """The GPUs of a local run: ``visible`` handed out in order, ``ranks_per_replica`` (K)
    to each of ``replicas`` replicas, then one to each rollout worker."""

    visible: tuple[str, ...]
    replicas: int
    ranks_per_replica: int = 1

    @property
    def assigns(self) -> bool:
        """Whether processes get GPUs of their own (more than one GPU, and enough for K)."""
        return len(self.visible) > 1 and self.ranks_per_replica <= len(self.visible)

    def replica(self, rank: int) -> list[str]:
        """Replica ``rank``'s GPUs: its K ranks take one each, local rank k the k-th."""
        k = self.ranks_per_replica
        return self._take(rank * k, k)

    def worker(self, worker: int) -> list[str]:
        """Rollout worker ``worker``'s GPU, after every replica's."""
        return self._take(self.replicas * self.ranks_per_replica + worker, 1)

    def _take(self, start: int, count: int) -> list[str]:
        n = len(self.visible)
        return [self.visible[(start + j) % n] for j in range(count)]

    def describe(self) -> str | None:
        """A line for the dry-run plan; None where nothing is assigned."""
        if not self.assigns:
            return None
        return (
            f"GPUs: each replica and rollout worker sees its own of this machine's "
            f"{len(self.visible)} (CUDA_VISIBLE_DEVICES; a replica one per local rank), in "
            "rank order; more processes than GPUs take them in turn"
        )
