"""FSDP2 inside a replica (``--local-parallel fsdp``): its K local ranks shard the model.

With DDP every local rank holds the whole model; with FSDP2 (``torch.distributed.fsdp.
fully_shard``) each holds 1/K of the parameters, gradients and inner-optimizer state, so a
model that does not fit one GPU trains on a machine of several. The exchange does not change:
local rank 0 still exchanges for the whole replica (store bytes stay 1·P up), on a *mirror*,
a full copy of the model in its host memory that torchft's DiLoCo wraps (with the outer
momentum and the global copy beside it: host memory, not GPU memory, holds P three times).

The mirror is brought up to date only where DiLoCo reads the weights - the inner step of a
sync, and with ``--fragment-sync-delay`` the step a fragment's exchange starts - by
gathering the full state dict onto rank 0 (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``, a collective of every local rank); after the outer step rank 0's mirror
goes back into the shards (``set_model_state_dict(broadcast_from_rank0=True)``). At a sync
the full inner-optimizer state is gathered too, for rank 0 to save with the round (restarts
and resume), and a resumed one goes back the same way. These are torch.distributed.checkpoint's
own state-dict functions: they handle DTensor placements, CPU offload and the broadcast.
Design: docs/design.md, "Replica runtime".
"""

from __future__ import annotations

import copy
from typing import Any

#: what a local rank does after an inner step: nothing, or gather the full weights onto
#: rank 0 because DiLoCo reads them now ("prepare": a fragment's exchange starts; "sync":
#: the outer step, after which the weights go back to every rank)
PREPARE, SYNC = "prepare", "sync"


def action_at(step: int, spec: Any) -> str | None:
    """What DiLoCo does after inner step ``step`` (counted from 1): every exchange round
    ends with a sync ``sync_period`` steps apart; with a fragment sync delay d, the round's
    exchange starts d steps before it. Every local rank computes this alike."""
    period = spec.sync_period
    delay = int(getattr(spec, "fragment_sync_delay", 0) or 0)
    if step % period == 0:
        return SYNC
    if delay and step % period == period - delay:
        return PREPARE
    return None


def mirror_of(model: Any) -> Any:
    """A full copy of ``model`` in host memory, taken before it is sharded: what local rank
    0's DiLoCo, checkpoints and saved model see."""
    return copy.deepcopy(model).to("cpu")


def shard(model: Any) -> Any:
    """``model`` under FSDP2 over the replica's process group, in place: each block a
    Hugging Face model names unsplittable (``_no_split_modules``, e.g. its decoder layers) is
    its own FSDP unit, so only one block's full parameters are gathered at a time; then the
    root (the embeddings, the head, whatever is left)."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    return model


def _resharded(model: Any) -> Any:
    """``model`` with every FSDP unit back in its sharded state: a forward pass without a
    backward (an evaluation under no_grad) leaves the root's parameters gathered, and a
    state dict of plain tensors mixed with DTensors cannot be loaded or gathered."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def gather_weights(sharded: Any, mirror: Any | None) -> None:
    """Every local rank: the full weights of ``sharded`` into rank 0's ``mirror`` (None on the
    others, which only take part in the gather)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(_resharded(sharded), options=_options(cpu_offload=True))
    if mirror is not None:
        mirror.load_state_dict(state)


def scatter_weights(sharded: Any, mirror: Any | None) -> None:
    """Every local rank: rank 0's ``mirror`` weights into each rank's shards of ``sharded``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = {k: v.detach().clone() for k, v in mirror.state_dict().items()} if mirror else {}
    set_model_state_dict(_resharded(sharded), state, options=_options(broadcast_from_rank0=True))


def gather_optimizer(sharded: Any, optimizer: Any) -> dict[str, Any]:
    """Every local rank: the full inner-optimizer state (rank 0 gets it; the others {})."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(sharded, optimizer, options=_options(cpu_offload=True))


def scatter_optimizer(sharded: Any, optimizer: Any, state: dict[str, Any] | None) -> None:
    """Every local rank: rank 0's full inner-optimizer ``state`` into each rank's shards.

    torch creates the state of an optimizer that has none by taking one step at lr 0, which
    runs the step hooks: DiLoCo's (and crf's) would count it as an inner step and sync one
    step early. The hooks are set aside for that step and put back as they were, in order."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    hooks = optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_post_hooks = type(hooks)()
    try:
        set_optimizer_state_dict(
            sharded, optimizer, state or {}, options=_options(broadcast_from_rank0=True)
        )
    finally:
        optimizer._optimizer_step_post_hooks = hooks
