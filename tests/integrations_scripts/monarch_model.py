"""The Monarch learners' factory (``monarch_model:build``): a small model sharded with FSDP2
over the learners' gloo group, its inner optimizer and one training step, the same initial
weights on every replica and each rank with its own data."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], float]]:
    """Joins the learners' group (the torchelastic variables that
    ``monarch.spmd.setup_torch_elastic_env`` set on each learner's process) when there is
    more than one learner, then shards the model so that each exchanges its own shard."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every replica and rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if world > 1:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica, rank = int(os.environ["CRF_RANK"]), int(os.environ.get("RANK", "0"))
    data = torch.Generator().manual_seed(1000 * replica + rank)  # each rank its own data

    def train_step() -> float:
        x = torch.randn(16, 8, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return model, opt, train_step
