"""A plain training loop, not a crf job: torchrun's ranks shard a small model with FSDP2
(gloo) and call DiLoCoHook once per optimizer step. Run as a replica by
``crf launch --entrypoint "python -m torch.distributed.run --standalone --nproc-per-node 2
tests/integrations_scripts/fsdp_loop.py"``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from crf.integrations.hook import DiLoCoHook


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every replica and rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica, rank = int(os.environ["CRF_RANK"]), dist.get_rank()
    data = torch.Generator().manual_seed(1000 * replica + rank)  # each rank its own data
    hook = DiLoCoHook(model, opt)
    while not hook.done:
        x = torch.randn(16, 8, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.step(loss=loss.item())
    hook.close({"final_loss": loss.item()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
