"""DiLoCo for a training loop crf does not own: one call per optimizer step.

A stack with its own trainer (verl, PRIME-RL, a Monarch learner, a torchrun script) cannot
hand its loop to ``ctx.diloco``; it keeps its loop and makes one object::

    hook = DiLoCoHook(model, optimizer)     # after the optimizer exists
    while not hook.done:
        loss = train_step()                  # forward, backward, optimizer.step()
        hook.step(loss=loss)
    hook.close({"my_metric": 1.0})

The hook reads the replica contract from the environment, as every ``--entrypoint`` script
does (``CRF_RUN_URI``, ``CRF_RANK``, ``CRF_WORLD_SIZE`` and the run's ``run.json``), and wraps
the model and its inner optimizer in torchft's DiLoCo over crf's store-backed manager: every
``--sync-every`` optimizer steps the replicas average pseudo-gradients through the store and
take the outer step (Nesterov SGD, ``--outer-lr``, ``--outer-momentum``), inside that
``optimizer.step()``.

Sharded models (FSDP2, or any model whose parameters are DTensors): when the process is one
of several ranks of a ``torch.distributed`` group inside the replica (torchrun, verl's FSDP
workers), each rank exchanges its own shard through its own exchange under the run's
``shards/<j>-of-<K>/`` prefix, with the same rank of every other replica: no rank gathers the
whole model, and the store carries 1·P per replica as with one process. Every rank of every
replica must therefore shard the same way (same K, same placement), which the exchange
checks per round (a shard of another layout is refused). Local rank 0 also speaks for the
replica to the driver: heartbeats, per-round metrics and the result.

A step the loop skipped still counts: fp16's gradient scaler does not call
``optimizer.step()`` when the gradients overflow, nor does verl's engine when their norm is
not finite, and then no step hook runs. :meth:`DiLoCoHook.step` notices that no optimizer
step ran since its last call and takes an empty one (every gradient None: torch's
optimizers change nothing) so that DiLoCo's hooks count it and sync on time, as the
trainer-based jobs do. ``hook.done`` and a loop of ``--rounds`` × ``--sync-every`` steps then
agree.

What the hook leaves to ``ctx.diloco`` (crf's own jobs): restarts and ``--resume`` from a
global state, Streaming DiLoCo (``--fragments`` > 1), and a saved model (``crf export``).
Why: each needs the whole model in one place, or a state the framework's own checkpointing
already owns.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch

from crf.exchange.allreduce import tensors_layout_hash
from crf.exchange.config import ExchangeConfig
from crf.exchange.manager import ObjectStoreManager, turn_off_bucketization
from crf.layout import shard_prefix
from crf.replica.context import ContractError, ReplicaContext, job_metrics_of, outer_lr
from crf.store.codec import raw_view

log = logging.getLogger(__name__)

__all__ = ["DiLoCoHook", "local_tensor", "shard_prefix"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _local_group() -> tuple[int, int]:
    """(rank, size) of this process in the replica's torch.distributed group: (0, 1) when
    there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_sha256(model: torch.nn.Module) -> str:
    """A digest of this rank's part of every parameter and buffer (names, shapes, bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        part = local_tensor(t).detach().cpu().contiguous()
        h.update(f"{name}:{part.dtype}:{tuple(part.shape)}".encode())
        h.update(raw_view(part))
    return h.hexdigest()


def _save_local_parts(manager: ObjectStoreManager) -> None:
    """Have ``manager`` save the local part of every DTensor in a global state (DiLoCo's
    global copy and outer momentum are sharded like the model): each rank's global state,
    under its own shard prefix, then holds its own shard only."""
    from torch.utils._pytree import tree_map

    register = manager.register_state_dict_fn

    def register_local(key: str, load: Any, save: Any) -> None:
        register(key, load, lambda: tree_map(_local_part, save()))

    manager.register_state_dict_fn = register_local  # type: ignore[method-assign]


def _local_part(x: Any) -> Any:
    return local_tensor(x) if isinstance(x, torch.Tensor) else x


def misuse(model: torch.nn.Module, optimizer: Any) -> Exception | None:
    """What is wrong with the hook's arguments, before anything starts (None: nothing).

    ``optimizer`` must be a ``torch.optim.Optimizer`` that holds every trainable parameter of
    ``model``: DiLoCo runs its sync in that optimizer's step hooks and takes the outer step
    over the model's parameters, so a parameter another optimizer trains (or none) would be
    averaged at a moment its own optimizer does not know of, and an optimizer of another
    model would leave this one untrained while the run reports it ok. A parameter on the
    meta device has no values to send."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return TypeError(
            f"DiLoCoHook needs a torch.optim.Optimizer, got {type(optimizer).__name__}: "
            "torchft's DiLoCo runs its sync in that optimizer's step hooks; pass the inner "
            "optimizer itself (e.g. turn off a framework's CPU-offload wrapper)"
        )
    named = list(model.named_parameters())
    meta = [name for name, p in named if p.is_meta]
    if meta:
        return ValueError(
            f"DiLoCoHook: {len(meta)} parameter(s) of the model are on the meta device "
            f"({_some(meta)}), with no values to exchange: materialize the model (load or "
            "initialize its weights) before making the hook"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [name for name, p in named if p.requires_grad]
    missing = [name for name, p in named if p.requires_grad and id(p) not in held]
    if missing:
        return ValueError(
            f"DiLoCoHook: {len(missing)} of the model's {len(trainable)} trainable "
            f"parameter(s) are not in the optimizer ({_some(missing)}): give the hook the "
            "optimizer that trains this model, holding all of its trainable parameters (one "
            "optimizer, with param groups if they need different settings; "
            "requires_grad_(False) on a parameter that is not to be trained)"
        )
    return None


def _ungrouped_launch(environ: Mapping[str, str] | None) -> Exception | None:
    """A process that a launcher started as one of several ranks (torchrun sets
    ``WORLD_SIZE``) with no ``torch.distributed`` group: each rank would take itself for the
    whole replica and exchange as it, several writers of one replica's objects."""
    import os

    import torch.distributed as dist

    size = (os.environ if environ is None else environ).get("WORLD_SIZE", "1")
    if not size.isdigit() or int(size) <= 1 or (dist.is_available() and dist.is_initialized()):
        return None
    return ContractError(
        f"DiLoCoHook: this process is one of {size} ranks (WORLD_SIZE={size}, as torchrun "
        "sets it) but torch.distributed is not initialized: call "
        "torch.distributed.init_process_group() before making the hook, or start one "
        "process per replica"
    )


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _record_setup_failure(error: BaseException, environ: Mapping[str, str] | None) -> None:
    """Record ``error`` as this replica's failure at setup (local rank 0, when the replica
    contract is there to read): an error in the script's own setup is raised again on every
    attempt, so the driver ends the run at once rather than restart the replica."""
    if _local_group()[0] != 0:
        return
    try:
        store, spec, rank, world = ReplicaContext.read_contract(environ)
        ReplicaContext(store, spec, rank, world).fail(error)
    except Exception as e:  # noqa: BLE001 - no contract or no store: the error goes up as it is
        log.debug("could not record the setup failure: %s", e)


class DiLoCoHook:
    """One process's part in a crf run, for a loop that calls :meth:`step` after each of
    its optimizer steps (see the module docstring). ``optimizer`` must be a
    ``torch.optim.Optimizer`` (AdamW, SGD, Muon...): torchft's DiLoCo registers hooks on its
    ``step``; a wrapper that is not one (e.g. PRIME-RL's ``CPUOffloadOptimizer``) is refused.
    Every rank of the replica makes one, with its own (sharded) model and its own inner
    optimizer, and calls :meth:`close` at the end (it is a collective across the replica's
    ranks)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        problem = misuse(model, optimizer) or _ungrouped_launch(environ)
        if problem is not None:
            _record_setup_failure(problem, environ)
            raise problem
        from torchft.local_sgd import DiLoCo

        store, spec, rank, world = ReplicaContext.read_contract(environ)
        if spec.fragments != 1:
            error = ContractError(
                f"run {spec.run_id} has --fragments {spec.fragments}: DiLoCoHook syncs the "
                "whole model each round; launch with --fragments 1"
            )
            _record_setup_failure(error, environ)
            raise error
        self.spec, self.rank, self.world_size = spec, rank, world
        self.local_rank, self.local_size = _local_group()
        self.model, self.optimizer = model, optimizer
        self.step_count = 0
        #: local rank 0: the replica's heartbeats, per-round metrics and result
        self.ctx = ReplicaContext(store, spec, rank, world) if self.local_rank == 0 else None
        prefix = shard_prefix(self.local_rank, self.local_size)
        config = ExchangeConfig.from_spec(
            spec,
            shard_grace_s=min(30.0, spec.round_timeout_s),
            # heartbeats (local rank 0's) tell who is alive on the run's own exchange only
            follow_liveness=self.local_size == 1,
        )
        self.manager = ObjectStoreManager(
            store.child(prefix) if prefix else store, world, rank, config
        )
        self.manager.final_round = spec.exchange_rounds - 1
        local = [local_tensor(p.detach()) for p in model.parameters()]
        self.manager.state_layout = tensors_layout_hash(local)
        _save_local_parts(self.manager)
        sparseloco = self.manager.exchange.config.sparseloco
        momentum = 0.0 if sparseloco else spec.outer_momentum
        outer = torch.optim.SGD(
            model.parameters(),
            lr=outer_lr(spec, sparseloco),
            momentum=momentum,
            nesterov=spec.nesterov and momentum > 0,
        )
        self._algo = DiLoCo(
            self.manager, [model], optimizer, outer, sync_every=spec.sync_every,
            use_bucketization=False, pin_memory=False,
        )  # fmt: skip
        turn_off_bucketization(self._algo)
        self.manager.set_fragment_sizes([len(list(model.parameters()))])
        self._algo.__enter__()  # its pre/post hooks on the optimizer: the sync runs in step()
        #: optimizer steps taken (counted after DiLoCo's hooks), and fp16's skipped ones
        self._taken = self._taken_before = 0
        self.skipped_steps = 0
        self._closed: dict[str, Any] | None = None  # what close() wrote, once it has
        self._counting = optimizer.register_step_post_hook(self._count_step)
        if any(t.is_cuda for t in local):  # page-locked before the first round, not by it
            self.manager.reserve_host_buffers([local])
        if self.ctx is not None:
            self.ctx.manager = self.manager
            self.ctx._set_phase("training")
            self.ctx._clock.restart()
            self._excepthook = sys.excepthook
            if self.local_size == 1:  # with more, its error may be another rank's echo
                sys.excepthook = self._record_uncaught

    @property
    def done(self) -> bool:
        """Whether the run's inner steps (``--rounds`` × ``--sync-every``) are all taken."""
        return self.step_count >= self.spec.total_steps

    def _count_step(self, *_: Any) -> None:
        self._taken += 1

    def _take_skipped_step(self) -> None:
        """No optimizer step ran since the last :meth:`step` call (the loop skipped it): an
        empty step (gradients None) runs the optimizer's hooks, DiLoCo's sync included, so
        the step counts as the loop counts it."""
        self.skipped_steps += 1
        say = log.warning if self.skipped_steps == 1 else log.info
        say("step %d: no optimizer step since the last hook.step() (the loop skipped it: "
            "fp16's gradient scaler on overflowing gradients, or a gradient norm that is not "
            "finite); it counts as an inner step", self.step_count + 1)  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.step()

    def step(self, loss: float | None = None, **metrics: float) -> None:
        """After each ``optimizer.step()`` (or ``scaler.step(optimizer)``): counts it and,
        after a sync (which ran inside that ``optimizer.step()``), writes the round's
        global state when one is due; local rank 0 also records the step's ``loss`` and
        ``metrics`` for the run's tables."""
        if self._closed is not None:
            raise ContractError("hook.step() after hook.close(): the replica has left the run")
        if self.done:
            self._raise(
                ContractError(
                    f"hook.step() after hook.done: the run's {self.spec.total_steps} inner "
                    f"steps (--rounds {self.spec.rounds} x --sync-every {self.spec.sync_every})"
                    " are all taken and its last round exchanged; end the loop when hook.done "
                    "is true (while not hook.done: ...), or launch with more --rounds"
                )
            )
        if self._taken == self._taken_before:
            self._take_skipped_step()
        self._taken_before = self._taken
        self.step_count += 1
        m = self.manager
        synced = self.step_count % self.spec.sync_period == 0
        if synced:
            m.after_outer_step()
            if m.fatal_error is not None:
                self._raise(m.fatal_error)
        if self.done:  # the last round is in: an optimizer step after it must not sync
            self._algo.__exit__(None, None, None)
        ctx = self.ctx
        if ctx is None:
            return
        ctx.step = self.step_count
        if synced:
            ctx._syncs.add(ctx._sync_entry(m, self.step_count // self.spec.sync_period - 1))
            ctx._syncs.fold(self.step_count, final=False)
        ctx.log_step(loss=None if loss is None else float(loss), **metrics)

    def _record_uncaught(self, kind: type[BaseException], error: BaseException, tb: Any) -> None:
        """``sys.excepthook`` while the hook is open: an error that escapes the script (a
        loop without ``with hook:``) is shown as Python shows it, then recorded as this
        replica's failure, so that its result says what failed, and the driver can tell
        the same error from a restart of this replica from a death."""
        self._excepthook(kind, error, tb)
        if self._closed is None and self.ctx is not None and self.ctx.failure is None:
            try:
                self.ctx.fail(error)
            except Exception as e:  # noqa: BLE001 - the process is ending on the user's error
                log.debug("could not record the failure: %s", e)

    def _raise(self, error: BaseException) -> None:
        """Record ``error`` as this replica's failure (local rank 0; a restart cannot fix a
        misused hook or replicas that build different models, crf/replica/failures.py) and
        raise it: a loop without ``with hook:`` would otherwise exit with no result, and the
        driver restart it into the same error."""
        if self.ctx is not None and self.ctx.failure is None:
            self.ctx.fail(error)
        raise error

    def close(self, job_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Leave the run (every rank): the optimizer's hooks go, pending global-state writes
        land, and local rank 0 writes the replica's result, with ``job_metrics`` and each
        local rank's ``shard_sha256`` (equal across replicas when they ended in sync).
        Returns the metrics written; a second call writes nothing and returns them again."""
        if self._closed is not None:
            return self._closed
        self._algo.__exit__(None, None, None)
        self._counting.remove()
        digest = shard_sha256(self.model)
        digests = [digest]
        if self.local_size > 1:
            import torch.distributed as dist

            digests = [None] * self.local_size
            dist.all_gather_object(digests, digest)
        out = {**job_metrics_of(job_metrics), "shard_sha256": digests,
               "local_ranks": self.local_size}  # fmt: skip
        if self.ctx is None:
            self.manager.close()
        else:
            if self.local_size == 1:  # the whole model here: its digest, as crf's own jobs
                self.ctx.model = self.model  # report it (the summary compares replicas)
            self.ctx.finish(out)  # closes the manager first
            if sys.excepthook == self._record_uncaught:
                sys.excepthook = self._excepthook
        self._closed = out
        return out

    def __enter__(self) -> DiLoCoHook:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        self._algo.__exit__(exc_type, exc, tb)
        self._counting.remove()
        if self.ctx is not None and self.ctx.failure is None:
            self.ctx.fail(exc)
        log.error("rank %d/%d of replica %d failed: %s", self.local_rank, self.local_size,
                  self.rank, exc)  # fmt: skip
        return False
