"""A Monarch learner actor that joins a crf run through :class:`~crf.integrations.hook.DiLoCoHook`.

A replica whose local ranks are a Monarch proc mesh: the replica's entrypoint spawns
``procs`` processes on its host (``this_host().spawn_procs(per_host={"procs": K})``), one
:class:`Learner` actor on each, and drives them with ``learner.step.call(...).get()``. Each
actor builds its model and optimizer from the caller's factory, and :class:`DiLoCoHook`
syncs them with the other replicas through the store, every ``--sync-every`` steps. The
actors inherit the replica contract (``CRF_*``) from the entrypoint's environment. With K > 1
the entrypoint calls ``monarch.spmd.setup_torch_elastic_env(procs)`` first, and the factory
joins the learners in one ``torch.distributed`` group (rank = mesh rank) and shards the
model, so that each learner exchanges its own shard.

``monarch`` (``pip install torchmonarch``) is imported only by :func:`learner_class`, so this
module imports without it.
"""

from __future__ import annotations

import importlib
from typing import Any


def learner_class() -> type:
    """The ``Learner`` actor class (needs ``torchmonarch``). ``Learner(factory)``: ``factory``
    is a ``"module:function"`` path returning ``(model, optimizer, train_step)``, where
    ``train_step()`` runs one forward/backward/``optimizer.step()`` and returns the loss."""
    try:
        from monarch.actor import Actor, endpoint
    except ImportError as e:
        raise ImportError(
            f"crf.integrations.monarch needs torchmonarch (pip install torchmonarch): {e}"
        ) from None

    class Learner(Actor):
        def __init__(self, factory: str) -> None:
            from crf.integrations.hook import DiLoCoHook

            module, _, name = factory.partition(":")
            self.model, self.optimizer, self.train_step = getattr(
                importlib.import_module(module), name
            )()
            self.hook = DiLoCoHook(self.model, self.optimizer)

        @endpoint
        def step(self) -> dict[str, Any]:
            """One inner step, then the hook (a sync every --sync-every steps)."""
            loss = float(self.train_step())
            self.hook.step(loss=loss)
            return {"loss": loss, "done": self.hook.done}

        @endpoint
        def close(self) -> dict[str, Any]:
            return self.hook.close()

    return Learner
