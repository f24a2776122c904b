"""A plain training loop on one device, not a crf job: a small MLP on ``LOOP_DEVICE``
(cpu or cuda) calls DiLoCoHook once per optimizer step, so the exchange averages tensors that
live on that device. Run as a replica by ``crf launch --entrypoint "python
tests/integrations_scripts/device_loop.py" --env LOOP_DEVICE=cuda``."""

from __future__ import annotations

import os

import torch

from crf.integrations.hook import DiLoCoHook, shard_sha256


def main() -> None:
    device = os.environ.get("LOOP_DEVICE", "cpu")
    torch.manual_seed(0)  # the same initial weights on every replica
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000 + int(os.environ["CRF_RANK"]))  # its own data
    hook = DiLoCoHook(model, opt)
    while not hook.done:
        x = torch.randn(16, 8, generator=data).to(device)
        loss = ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.step(loss=loss.item())
    devices = sorted({p.device.type for p in model.parameters()})
    hook.close({"final_loss": loss.item(), "sha256": shard_sha256(model), "devices": devices})


if __name__ == "__main__":
    main()
