"""ReplicaContext: what a training script inside a replica uses to join the run.

It reads the replica contract (``CRF_RUN_URI``, ``CRF_RANK``, ``CRF_WORLD_SIZE``; the names
are in :mod:`crf.layout`) and the run spec from ``run.json``, wraps the job's model and inner
optimizer in torchft's DiLoCo over the object store (``diloco()``), and writes what the driver
watches, as :mod:`crf.layout` records: the heartbeat (:class:`~crf.layout.Heartbeat`),
per-round metrics (:class:`~crf.layout.RoundMetrics`) and the final result
(:class:`~crf.layout.ResultRecord`). Both ``python -m crf.replica`` and a user's own entrypoint
use it the same way::

    with ReplicaContext.from_env() as ctx:
        with ctx.diloco(model, optimizer):
            for step in range(ctx.total_steps):
                loss = train_step()
                ctx.log_step(loss=loss)
        ctx.finish({"my_metric": 1.0})
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from crf import layout
from crf.exchange import codecs as wirefmt
from crf.exchange import inner_state
from crf.exchange.allreduce import (
    NonFiniteError,
    describe_nonfinite,
    tensors_layout_hash,
)
from crf.exchange.codecs import compression as wire_compression
from crf.exchange.config import ExchangeConfig
from crf.exchange.manager import (
    ObjectStoreManager,
    turn_off_bucketization,
)
from crf.executors.process import process_started_at
from crf.faults import maybe_fault, maybe_poison
from crf.replica.beacon import HeartbeatSender, HeartbeatWriter
from crf.replica.local_ranks import LocalGroup, MirrorRefresh, idle_optimizer, send_start
from crf.replica.rounds import (
    StepMetrics,
    SyncBook,
    TimeAccount,
    heartbeat_fields,
    newest_round_record,
)
from crf.replica.seeds import data_seed_of
from crf.replica.tracking import new_tracker
from crf.resumed_options import with_changes
from crf.spec import RunSpec
from crf.store import CorruptObjectError, ObjectNotFound, RunStore
from crf.store.codec import raw_view
from crf.versions import cuda_available, installed_versions

log = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 1.0
#: the manager's fine-grained phases, as the heartbeat shows them
_SHOWN_PHASE = {
    "uploading": "syncing",
    "quorum": "syncing",
    "reducing": "syncing",
    "gathering": "syncing",
}


class ContractError(RuntimeError):
    """The replica's environment does not follow the contract (missing/invalid CRF_* vars)."""


@dataclass
class HeartbeatPace:
    """When the heartbeat was last written, and until when it is paused after a failed write
    (a heartbeat must never slow every step). ``pid_started_at`` goes with the pid in every
    heartbeat: it tells this process from a later one given the same pid."""

    last: float = 0.0
    paused_until: float = 0.0
    pid_started_at: str | float | None = field(default_factory=process_started_at)

    def due(self, now: float, force: bool) -> bool:
        if now < self.paused_until or (not force and now - self.last < HEARTBEAT_EVERY_S):
            return False
        self.last = now
        return True


class ModelFragment(torch.nn.Module):
    """A contiguous group of a model's parameters, as the nn.Module torchft's DiLoCo wants per
    fragment. It holds the model's own Parameter objects (no copy); ``names`` are their names
    in the model (a module cannot register a name with dots)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        self.names = [n for n, _ in named]
        for i, (_, p) in enumerate(named):
            self.register_parameter(f"p{i}", p)


def split_model(model: torch.nn.Module, fragments: int) -> list[torch.nn.Module]:
    """The model's exchanged parameters (those that train: ``requires_grad``; in
    ``named_parameters`` order, tied ones once) in ``fragments`` contiguous groups of about
    equal size. One fragment of a model that trains every parameter is the model itself; with
    frozen ones (LoRA: only the adapters train) the fragments hold only the trainable ones, so
    DiLoCo exchanges, and P counts, nothing else."""
    named = list(model.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if fragments == 1 and len(trainable) == len(named):
        return [model]
    if not trainable:
        raise ValueError("the model has no parameter that requires grad: nothing to train")
    named = trainable
    if len(named) < fragments:
        raise ValueError(
            f"fragments={fragments} but the model has only {len(named)} parameter tensors"
        )
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
    acc = 0
    for i, (name, p) in enumerate(named):
        groups[-1].append((name, p))
        acc += p.numel()
        left, to_open = len(named) - i - 1, fragments - len(groups)
        if to_open and (left == to_open or (acc >= total * len(groups) / fragments and left)):
            groups.append([])
    return [ModelFragment(g) for g in groups]


def outer_lr(spec: RunSpec, sparseloco: bool) -> float:
    """The outer SGD's learning rate: ``--outer-lr``, or for SparseLoCo's plain averaged step
    ``outer_lr / (1 - outer_momentum)``, the step Nesterov momentum settles at for a steady
    pseudo-gradient: the momentum SparseLoCo drops is given back as step size. Measured on
    bench/quality.py (topk2 at 2%, H = 10): +0.35% / -0.44% vs DDP on two seeds at 1.4
    (0.7 / (1 - 0.5)), +9.2% at 0.7 (docs/performance.md, "Quality")."""
    if not sparseloco:
        return spec.outer_lr
    return spec.outer_lr / (1.0 - min(spec.outer_momentum, 0.99))


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of every tensor in the state dict (names, dtypes, shapes, bytes), name-sorted."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(raw_view(t))
    return h.hexdigest()


def job_metrics_of(value: Any) -> dict[str, Any]:
    """What a job's ``run`` returned (or a loop gave ``DiLoCoHook.close``) as the result's
    ``job_metrics``: a mapping as it is, None as none, anything else kept under ``result``
    with a warning. The contract asks for a dict; a job that returns its final loss as a
    number has still trained, and the run keeps what it returned rather than fail (or
    restart) a replica whose rounds are all in."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    log.warning(
        "the job returned %s, not a dict of metrics: it is kept as job_metrics.result "
        "(return a dict, e.g. {'final_loss': loss})",
        type(value).__name__,
    )
    return {"result": value}


class ReplicaContext:
    """One replica's view of the run (see module docstring)."""

    def __init__(
        self,
        store: RunStore,
        spec: RunSpec,
        rank: int,
        world_size: int,
        *,
        shard_grace_s: float | None = None,
    ) -> None:
        if world_size != spec.replicas:
            raise ContractError(
                f"{layout.ENV_WORLD_SIZE}={world_size} but run.json says replicas={spec.replicas}"
            )
        if not 0 <= rank < world_size:
            raise ContractError(f"{layout.ENV_RANK}={rank} must be in [0, {world_size})")
        self.store = store
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.data_seed = data_seed_of(spec.seed, rank)
        #: the replica's other local ranks (--procs-per-replica > 1), when this is local rank 0
        self.local: LocalGroup | None = None
        self.shard_grace_s = (
            shard_grace_s if shard_grace_s is not None else min(30.0, spec.round_timeout_s)
        )
        self.manager: ObjectStoreManager | None = None
        self._inner: torch.optim.Optimizer | None = None
        self.resumed_from: int | None = None  # global round this replica resumed from
        #: the inner state this replica resumed from, its generators alone (None: it started
        #: its inner optimizer fresh): they go back at :meth:`restore_rng`
        self._resumed: inner_state.InnerState | None = None
        self.model: torch.nn.Module | None = None
        self.layout: str | None = None  # digest of the model's tensors (diloco())
        self.step = 0  # inner optimizer steps taken
        self.phase = "starting"
        #: set by fail(): the phase it failed in, and whether the error would be raised again
        #: on a restart (crf/replica/failures.py)
        self.failure: tuple[str, bool] | None = None
        self.last_loss: float | None = None
        self.fragments: list[torch.nn.Module] = []
        self._steps = StepMetrics()  # the steps' loss and metrics of the round in progress
        self._syncs = SyncBook(spec.fragments, spec.sync_every)  # per sync, merged per round
        self._clock = TimeAccount()
        #: writes heartbeats off the training thread while it trains (``diloco``)
        self._sender: HeartbeatSender | None = None
        #: the model (and tokenizer) ``finish`` saves as the run's model/ (save_model_at_end)
        self._to_save: tuple[Any, Any] | None = None
        #: --report-to: where the steps and rounds are also logged (started on first use)
        self.tracker = new_tracker(spec.report_to, spec.run_id, rank, store)
        #: writes the heartbeats, and again while a long step writes none (beacon.py)
        self._beats = HeartbeatWriter(
            functools.partial(store.put_json, layout.heartbeat_key(rank)), HeartbeatPace()
        )
        self._beat(force=True)

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def total_steps(self) -> int:
        return self.spec.total_steps

    # ------------------------------------------------------------------ local ranks
    def data_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as the job should run forward and backward: under DDP over the
        replica's local ranks when it has more than one, else ``model`` itself; with
        ``--local-parallel fsdp``, ``model`` sharded in place by FSDP2 (build the optimizer
        after this call, over ``model.parameters()``). DiLoCo and ``save_model_at_end`` take
        the plain ``model``."""
        return self.local.wrap(model) if self.local else model

    def local_part(self, batch: Any) -> Any:
        """This local rank's rows of the replica's batch (all of them with one rank)."""
        return self.local.part(batch) if self.local else batch

    def _share_sync(self) -> None:
        """After a sync: the step (it jumps after a heal) and the new weights to the others."""
        if self.local and self.model is not None:
            self.local.share(self.step)
            self.local.share_weights(self.model)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReplicaContext:
        store, spec, rank, world = cls.read_contract(environ)
        return cls(store, spec, rank, world)

    @staticmethod
    def read_contract(
        environ: Mapping[str, str] | None = None,
    ) -> tuple[RunStore, RunSpec, int, int]:
        """(store, spec, rank, world size) of the env contract; ContractError if broken."""
        env = os.environ if environ is None else environ
        required = (layout.ENV_RUN_URI, layout.ENV_RANK, layout.ENV_WORLD_SIZE)
        missing = [v for v in required if not env.get(v)]
        if missing:
            raise ContractError(
                f"missing environment variable(s) {', '.join(missing)}: a replica is started "
                "by `crf launch` (or an executor), which sets them"
            )
        rank_text, world_text = env[layout.ENV_RANK], env[layout.ENV_WORLD_SIZE]
        try:
            rank, world = int(rank_text), int(world_text)
        except ValueError:
            raise ContractError(
                f"{layout.ENV_RANK} and {layout.ENV_WORLD_SIZE} must be integers "
                f"(got {rank_text!r}, {world_text!r})"
            ) from None
        store = RunStore(env[layout.ENV_RUN_URI])
        spec = with_changes(store, RunSpec.from_json(store.get(layout.RUN_SPEC)))
        return store, spec, rank, world

    # ------------------------------------------------------------------ DiLoCo
    @contextlib.contextmanager
    def diloco(
        self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer
    ) -> Iterator[Any]:
        """Wrap training in torchft's DiLoCo: every ``sync_every`` inner optimizer steps the
        replicas average pseudo-gradients through the store and take the outer step. With
        ``fragments > 1`` (Streaming DiLoCo) the model is split into that many contiguous
        groups of parameters, one synced every ``sync_every / fragments`` steps, each sync's
        exchange starting ``fragment_sync_delay`` steps before the replica waits for it; on
        leaving, every fragment is set back to its global copy, so all replicas end with the
        same weights."""
        local = self.local
        if local is not None and local.fsdp:  # DiLoCo runs on the full copy: local_fsdp.py
            model = local.mirror
            local.refresh = MirrorRefresh(local, self.spec, inner_optimizer, self._at)
        manager = self._new_manager(model)
        fragments = split_model(model, self.spec.fragments)
        self.fragments = fragments
        self._register_model_state(manager, model, fragments)
        self.manager, self.model = manager, model
        self._sender = HeartbeatSender(self._write_beat)
        self._set_phase("training")
        self._clock.restart()
        algo = self._new_diloco(manager, fragments, inner_optimizer)
        ok = False
        gathering = None  # FSDP: registered before DiLoCo's own hook (on entering it)
        if local is not None and local.refresh is not None:
            gathering = inner_optimizer.register_step_post_hook(local.refresh)
        # also before DiLoCo's: where a sync step's own work ends and DiLoCo's begins
        marking = inner_optimizer.register_step_post_hook(self._mark_step_end)
        # before DiLoCo's pre-hook: a step past the run's last is refused before it can sync
        past_end = inner_optimizer.register_step_pre_hook(self._refuse_step_past_end)
        with algo:
            self._inner = inner_optimizer
            self._resume(manager, inner_optimizer)
            self._reserve_host_buffers(fragments)
            if local:
                state = local.refresh.inner_state if local.refresh else None
                send_start(local, self.step, model, inner_optimizer, self.resumed_inner, state)
            # registered after DiLoCo's hooks, so it runs after a sync's outer step
            hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
            try:
                yield algo
                ok = True
            finally:
                hook.remove()
                marking.remove()
                past_end.remove()
                if gathering is not None:
                    gathering.remove()
                self._close_manager(manager, ok)
                self._sender, sender = None, self._sender
                sender.close()
        if local:  # the final weights (the global copies with fragments) to the others
            local.share_weights(model)

    def _refuse_step_past_end(self, *_: Any) -> None:
        """An inner optimizer step once ``ctx.step`` reached ``ctx.total_steps``: the job's
        loop runs past the run's end, and the step would sync a round the run never asked
        for (the replicas' rounds would no longer match). The same loop does it on every
        attempt: a ContractError, which no restart is for."""
        total = self.spec.total_steps
        if self.step >= total:
            raise ContractError(
                f"an inner optimizer step after ctx.step reached ctx.total_steps ({total}: "
                f"--rounds {self.spec.rounds} x --sync-every {self.spec.sync_every}); train "
                "while ctx.step < ctx.total_steps"
            )

    def _at(self) -> int:
        """The inner steps taken (what the FSDP gathering hook counts from)."""
        return self.step

    def _new_manager(self, model: torch.nn.Module) -> ObjectStoreManager:
        """The manager for this run's exchange, with this context's hooks."""
        config = ExchangeConfig.from_spec(
            self.spec,
            shard_grace_s=self.shard_grace_s,
            # this context's heartbeats tell the others who is alive: a dead replica costs
            # one round deadline, not one per round
            follow_liveness=True,
        )
        manager = ObjectStoreManager(
            self.store,
            self.world_size,
            self.rank,
            config,
            on_phase=self._set_phase,
            async_checkpoints=True,
        )
        manager.final_round = self.spec.exchange_rounds - 1
        # global and inner states carry the model's layout; one of another model is refused
        self.layout = manager.state_layout = tensors_layout_hash(list(model.parameters()))
        manager.on_blocked = self._beat  # heartbeats go on while it waits (once a second)
        return manager

    def _register_model_state(
        self,
        manager: ObjectStoreManager,
        model: torch.nn.Module,
        fragments: list[torch.nn.Module],
    ) -> None:
        """What of the model goes into (and comes back from) a global state."""
        if fragments[0] is model:
            manager.register_state_dict_fn(
                "model", lambda sd: model.load_state_dict(sd), lambda: model.state_dict()
            )
            return
        # the parameters are in the fragments' global copies; "model" keeps the rest
        # (buffers; frozen parameters never change: every replica loads them the same), and
        # a loaded state puts every fragment's global copy in the model
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        manager.register_state_dict_fn(
            "model",
            lambda sd: model.load_state_dict(sd, strict=False),
            lambda: {k: v for k, v in model.state_dict().items() if k not in params},
        )
        manager.on_loaded = self._load_fragments

    def _new_diloco(
        self,
        manager: ObjectStoreManager,
        fragments: list[torch.nn.Module],
        inner_optimizer: torch.optim.Optimizer,
    ) -> Any:
        """torchft's DiLoCo over ``fragments``, one outer SGD per fragment: Nesterov
        momentum, or none where a sparse wire's SparseLoCo error feedback stands in for it
        (the plain averaged step, ``--sparse-outer sparseloco``, at :func:`outer_lr`)."""
        from torchft.local_sgd import DiLoCo

        spec = self.spec
        sparseloco = manager.exchange.config.sparseloco
        momentum = 0.0 if sparseloco else spec.outer_momentum
        outers = [
            torch.optim.SGD(
                f.parameters(),
                lr=outer_lr(spec, sparseloco),
                momentum=momentum,
                nesterov=spec.nesterov and momentum > 0,
            )
            for f in fragments
        ]
        algo = DiLoCo(
            manager,
            fragments,
            inner_optimizer,
            outers[0] if len(outers) == 1 else outers,
            sync_every=spec.sync_every,
            use_bucketization=False,
            # its global copy page-locked when the model is on a GPU (torchft's default
            # there): its three copies of P each round at the bus's speed; the global state
            # waits for the device before reading it (ObjectStoreManager.state_dict)
            pin_memory=any(p.is_cuda for f in fragments for p in f.parameters()),
            fragment_sync_delay=spec.fragment_sync_delay,
        )
        turn_off_bucketization(algo)  # one exchange per sync already (see its docstring)
        # DiLoCo allreduces each parameter of the fragment it syncs: knowing how many, the
        # manager starts the exchange the moment the last one is queued
        manager.set_fragment_sizes([len(list(f.named_parameters())) for f in fragments])
        return algo

    def _close_manager(self, manager: ObjectStoreManager, ok: bool) -> None:
        """Leave the exchange: after a clean run every fragment goes back to its global copy
        and pending checkpoint writes must land; after a failed one they may fail quietly."""
        if ok:
            if self._split:
                self._load_fragments(manager.state_dict())
            manager.close()
            return
        try:
            manager.close()
        # anything a pending background write raised: the job's own error, already on its
        # way up, is the one to report
        except Exception as e:
            log.warning("pending checkpoint writes failed: %s", e)

    def _load_fragments(self, state: dict[str, Any]) -> None:
        """Put every fragment's global copy (``original_parameters`` in DiLoCo's state) into
        the model: after healing or resuming, and when training ends."""
        with torch.no_grad():
            for i, frag in enumerate(self.fragments):
                glob = state[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
                for name, p in frag.named_parameters():
                    p.data.copy_(glob[name])

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """The global model in the weights while the block runs (a held-out evaluation at a
        round's end), then this replica's own weights back, bit for bit. With Streaming
        DiLoCo (``fragments > 1``) a replica's weights at a round's end hold the last
        fragment's new global copy but the other fragments' local training since their
        syncs; the round's global model, and what the run ends with and exports, is every
        fragment's global copy. Without fragments the weights are the global model already."""
        if self.spec.fragments <= 1 or not self._split or self.manager is None:
            yield
            return
        with torch.no_grad():
            own = [[p.detach().to("cpu", copy=True) for p in f.parameters()]
                   for f in self.fragments]  # fmt: skip
        self._load_fragments(self.manager.state_dict())
        try:
            yield
        finally:
            with torch.no_grad():
                for frag, kept in zip(self.fragments, own, strict=True):
                    for p, t in zip(frag.parameters(), kept, strict=True):
                        p.data.copy_(t)

    @property
    def _split(self) -> bool:
        """Whether the exchanged parameters are fragments apart from the model (Streaming
        DiLoCo, or frozen parameters left out): then a replica's own weights and the global
        copies are kept apart."""
        return bool(self.fragments) and self.fragments[0] is not self.model

    def restore_final(self, model: torch.nn.Module) -> None:
        """For a job whose replica (re)starts with every inner step trained (``resume_step()
        == total_steps``: it died writing the run's model, or a resume found its training
        done): the run's final global weights into ``model``, the way ``diloco`` leaves them
        after the last round, and its last round's loss. Its result then reports the loss
        and ``weights_sha256`` an uninterrupted replica reports, and ``save_model_at_end``
        exports the same model. With local ranks, a collective, as ``diloco`` is."""
        with self.diloco(model, idle_optimizer(model)):
            pass

    def trained_metrics(self) -> dict[str, Any]:
        """The job's metrics this replica wrote when it finished training in an earlier
        attempt (:meth:`finish`), for a restart that trains nothing (``restore_final``): its
        result then says what the uninterrupted replica's said; {} when none landed."""
        try:
            saved = self.store.get_json(layout.trained_metrics_key(self.rank))
        except (ObjectNotFound, CorruptObjectError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def resume_step(self) -> int:
        """The inner step this replica will start from (0 unless a global state exists):
        lets a job that builds its data pipeline before ``diloco()`` skip what it used. With
        local ranks, a collective: each of them calls it once, and all start from here."""
        rounds = layout.global_rounds(self.store, complete=True)
        whole = self._whole_round(rounds)
        rounds = [r for r in rounds if whole is None or r <= whole] or rounds
        step = (rounds[-1] + 1) * self.spec.sync_period if rounds else 0
        if self.local:  # the other local ranks ask too (LocalFollower.resume_step)
            self.local.share(step)
        return step

    def _resume(self, manager: ObjectStoreManager, inner: torch.optim.Optimizer) -> None:
        """A (re)started replica joins at the newest committed round: global weights and outer
        momentum from ``global/<r>``, its own inner-optimizer state if it saved one for that
        round, and its step counter (= data position) at the start of round r + 1. (Rounds
        here are exchange rounds: one per fragment sync, ``sync_every / fragments`` steps.)"""
        latest = manager.load_newest_global(self._whole_round(layout.global_rounds(self.store)))
        if latest is None:
            return
        self.resumed_from = latest
        self.step = (latest + 1) * self.spec.sync_period
        self._recall_last_round((latest + 1) // self.spec.fragments - 1)
        if self.step >= self.total_steps:  # trained: no inner step will use an inner state
            log.info("resumed from global/%d with every inner step trained", latest)
            self._beat(force=True)
            return
        try:
            # refused (reported in manager.rejected) or missing: started fresh
            saved = inner_state.split(manager.checkpoints.load_inner(latest))
            if self._split:  # also this replica's own (local) weights
                if saved.local_params is None:
                    raise KeyError("local_params")
                params = dict(self.model.named_parameters())
                with torch.no_grad():
                    for name, value in saved.local_params.items():
                        params[name].copy_(value)
            if self.local and self.local.refresh:  # FSDP: the full state, sent to the shards
                self.local.refresh.inner_state = saved.optimizer
            else:
                inner.load_state_dict(saved.optimizer)
            if saved.error_feedback is not None:  # what the wire dropped, still to be resent
                manager.exchange.load_error_feedback_state(saved.error_feedback)
            # only its generators are kept: the rest is loaded (a second copy would hold memory)
            self._resumed = inner_state.InnerState(None, None, None, saved.rng)
            self.restore_rng()
        except (CorruptObjectError, ObjectNotFound, KeyError) as e:
            log.warning("no usable inner-optimizer state to resume (%s): starting it fresh", e)
        log.info("resumed from global/%d at step %d", latest, self.step)
        self._beat(force=True)

    @property
    def resumed_inner(self) -> bool:
        """Whether this replica resumed its inner optimizer from its saved inner state."""
        return self._resumed is not None

    def restore_rng(self) -> None:
        """Set the random-number generators to where they were when the inner state this
        replica resumed from was saved (the end of that round's last inner step), so it
        draws on as the uninterrupted replica did; nothing when it did not resume one, or
        the state has none (an older run's). ``diloco()`` calls it on resuming; a job that
        draws from the generators between entering ``diloco()`` and its next step (a
        trainer's data loader, started after it) calls it again just before that step."""
        if self._resumed is not None and self._resumed.rng is not None:
            inner_state.restore_rng(self._resumed.rng)

    def _whole_round(self, rounds: list[int]) -> int | None:
        """For a replica alone in its run: the newest of the global ``rounds`` whose inner
        state it saved too, when a newer one lacks it (it died before its background writer
        uploaded it) and still leaves steps to train. It resumes there and trains the round
        after again, bit for bit, rather than go on from the newer one with a fresh inner
        optimizer, as ``crf launch --resume`` does for a whole run. None otherwise: with
        other replicas the run has gone on without it, and it joins at the newest round."""
        if self.world_size != 1 or not rounds:
            return None
        if (rounds[-1] + 1) * self.spec.sync_period >= self.total_steps:
            return None  # every step trained: no inner state is needed to finish
        saved = set(layout.inner_rounds(self.store, self.rank))
        whole = [r for r in rounds if self.spec.saves_inner_state(r) and r in saved]
        return whole[-1] if whole and whole[-1] < rounds[-1] else None

    def _recall_last_round(self, last: int) -> None:
        """Start from the newest round record this replica wrote up to outer round ``last``
        (where it resumes): a replica that had already trained every round trains none now,
        and its result and heartbeat still show the loss it finished with."""
        record = newest_round_record(self.store, self.rank, last)
        if record is None:
            return
        if record.loss is not None:
            self._steps.round_losses[record.round] = record.loss
        self._steps.last_closed = heartbeat_fields(record)

    def _save_inner(self, r: int) -> None:
        """Save this replica's inner state after a committed round (for restarts; what it
        holds: :mod:`crf.exchange.inner_state`): copied now, written in the background once
        the round's record is queued (``Checkpoints.hold_inner``)."""
        if self._inner is None or self.manager is None or not self.spec.saves_inner_state(r):
            return
        self.manager.checkpoints.hold_inner(r, self._inner_state(), self.step)

    def _inner_state(self) -> dict[str, Any]:
        """What an inner-state checkpoint holds now (:mod:`crf.exchange.inner_state`)."""
        assert self._inner is not None and self.manager is not None
        refresh = self.local.refresh if self.local else None
        return inner_state.compose(
            refresh.inner_state if refresh else self._inner.state_dict(),
            inner_state.trainable_weights(self.model)
            if self._split and self.model is not None
            else None,
            self.manager.exchange.error_feedback_state(),
            # where the training thread's generators are at the round's end: a resume from
            # this round draws on from here (restore_rng)
            inner_state.rng_states(),
        )

    def _reserve_host_buffers(self, fragments: list[torch.nn.Module]) -> None:
        """On a GPU, before training: page-lock the host buffers the exchange and this
        replica's part of the global snapshots copy into, so the first round costs what
        the later ones do (the time counts as crf's; on the CPU nothing is copied)."""
        rounds = [list(f.parameters()) for f in fragments]
        if self.manager is None or not any(p.is_cuda for ps in rounds for p in ps):
            return
        t0 = time.monotonic()
        n = self.manager.reserve_host_buffers(rounds)
        log.info("host buffers: %.2f GB page-locked in %.1f s", n / 1e9, time.monotonic() - t0)

    def _reserve_inner_buffers(self) -> None:
        """After the first inner step (the optimizer made its state): the inner snapshots'
        buffers, page-locked now rather than by the first snapshot."""
        if self._inner is None or self.manager is None or not self.spec.save_inner_state:
            return
        t0 = time.monotonic()
        n = self.manager.reserve_inner_buffers(self._inner_state())
        log.info(
            "inner-state buffers: %.2f GB page-locked in %.1f s", n / 1e9, time.monotonic() - t0
        )

    def _queue_unsaved(self) -> None:
        """Queue the inner states serialized at the last sync for the writer: after the
        round's record, so a kill can never land a round's inner state without it (a resume
        starts from the newest round whose inner states all landed, and does not train that
        round again)."""
        if self.manager is not None:
            self.manager.checkpoints.release_inner()

    def _mark_step_end(self, *_: Any) -> None:
        """Before DiLoCo's hook, at a step that syncs: the step's own GPU work is waited for
        here (training's time), and the clock and the manager's blocked time are noted, so
        that what DiLoCo does outside the manager - the pseudo-gradients, restoring the
        global weights, the outer optimizer step, the copies of its global copy - counts as
        the sync's (:meth:`_charge_outer`), not as training."""
        m = self.manager
        if m is None or (self.step + 1) % self.spec.sync_period != 0:
            return
        if self.model is not None:
            device = next(self.model.parameters(), torch.empty(0)).device
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        self._clock.mark_outer(m.blocked_s)

    def _charge_outer(self, m: ObjectStoreManager) -> None:
        """DiLoCo's work since :meth:`_mark_step_end` outside the manager (the manager times
        its own) counts as blocked: the sync's, ``outer`` among its phases."""
        outer_s = self._clock.take_outer(m.blocked_s)
        if outer_s is not None:
            m.charge_outer(outer_s)

    def _after_inner_step(self, *_: Any) -> None:
        self.step += 1
        if self.manager is not None and self.manager.inner_buffers_due:
            self.manager.inner_buffers_due = False  # the optimizer made its state: now
            self._reserve_inner_buffers()
        maybe_fault("inner_step", self.rank, None, self.store, step=self.step)
        if self.model is not None and maybe_poison(
            "nan_weights", self.rank, None, self.store, step=self.step
        ):
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("nan")
        period = self.spec.sync_period
        if self.step % period != 0 or self.manager is None:
            return
        m = self.manager
        self._charge_outer(m)
        e = self.step // period - 1  # the exchange round that just synced
        # a replica that healed into a later round skips the inner steps it no longer needs
        self.step = max(self.step, m.current_step() * period)
        if m.fatal_error is None:  # before its state is saved anywhere
            self._check_weights_finite(e // self.spec.fragments)
        if m.last_committed:
            self._queue_unsaved()  # a job that did not call log_step since the last sync
            with m.blocking():
                self._save_inner(m.current_step() - 1)
        m.after_outer_step()
        if m.fatal_error is not None:
            raise m.fatal_error
        self._syncs.add(self._sync_entry(m, e))
        self._syncs.fold(self.step, final=False)
        self._set_phase("training")
        self._share_sync()

    def _sync_entry(self, m: ObjectStoreManager, e: int) -> dict[str, Any]:
        """What exchange round ``e`` (just synced) did, for its outer round's metrics."""
        res = m.last_result
        # time: blocked in the manager vs the rest; the background transfer counts apart
        sync_s, transfer_s = self._clock.charge(m.blocked_s, m.transfer_s)
        F = self.spec.fragments
        phases = dict(res.phases) if res else {}
        # the training thread's checkpoint snapshots since the last record (the copy into the
        # checkpoint's host buffers): the one part of a checkpoint that blocks training
        snapshot_s = self._syncs.new_snapshot_s(m.stats.ckpt_foreground_s)
        if snapshot_s > 0:
            phases["snapshot"] = round(snapshot_s, 6)
        outer_s, m.stats.last_outer_s = m.stats.last_outer_s, None
        if outer_s is not None:
            phases["outer"] = round(outer_s, 6)
        return {
            "round": e // F,
            "exchange_round": res.round if res else None,
            "fragment": e % F,
            "committed": m.last_committed,
            "participants": res.participants if res else [],
            "sync_s": sync_s,
            "transfer_s": transfer_s,
            "bytes_up": res.bytes_up if res else 0,
            "bytes_down": res.bytes_down if res else 0,
            "error": m.last_error,
            # objects this round left out or refused (m.rejected accumulates over the run)
            "rejected": self._syncs.new_rejections(m.rejected),
            "healed_from": m.last_healed_from,
            "phases_s": phases,
        }

    def _check_weights_finite(self, r: int) -> None:
        """After a sync's outer step (once per sync, one pass over the weights): weights that
        hold NaN/Inf end this replica with :class:`NonFiniteError`, before they are written
        to global/ or to its inner state, rather than train on garbage. A restart would not
        help: it resumes from the same global state and data and computes the same numbers
        (the replica exits with code 3, which the driver does not restart)."""
        if self.model is None:
            return
        for name, p in self.model.named_parameters():
            if not wirefmt.finite(p.detach()):
                raise NonFiniteError(
                    f"round {r} (step {self.step}): weights went non-finite after the outer "
                    f"step ({name}: {describe_nonfinite(p.detach())}); lower --outer-lr or "
                    "the job's learning rate"
                )

    # ------------------------------------------------------------------ metrics
    def log_step(self, loss: float | None = None, **metrics: float) -> None:
        """Record one inner step's loss and metrics (call after each optimizer step)."""
        if loss is not None:
            # the whole batch's loss: the mean of the local ranks' (equal) slices
            loss = self.local.mean(loss) if self.local else float(loss)
            self.last_loss = loss
        self._steps.add(loss, metrics)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %s", self.step, _numbers({"loss": loss, **metrics}))
        self.tracker.log_step(self.step, {"loss": loss, **metrics})
        if self._syncs.finished:
            self._flush_round_metrics()
        self._queue_unsaved()
        self._beat()

    def log_rollouts(self, counts: dict[str, Any]) -> None:
        """With rollout workers: the round's rollouts by source, for its record (call before
        the round's last ``log_step``)."""
        self._steps.rollouts = dict(counts)

    def _flush_round_metrics(self) -> None:
        """Write the record of every outer round whose syncs are all in."""
        for info in self._syncs.take_finished():
            r = info["round"]
            loss, metrics = self._steps.close_round(r)
            record = layout.RoundMetrics.from_dict(
                {
                    "round": r,
                    "rank": self.rank,
                    "loss": loss,
                    "metrics": metrics,
                    "compute_s": self._clock.compute_s,
                    "step": self.step,
                    "updated_at": time.time(),
                    **info,
                    "rollouts": self._steps.rollouts,
                }
            )
            self._steps.rollouts = {}
            # one put per round, by the checkpoint writer's record lane (off the training
            # thread, where a store round trip queued behind the exchange's uploads cost a
            # step; not behind the state writes, so it lands at once), before this sync's
            # inner state (_queue_unsaved), which waits for it: a round whose inner states
            # landed has its record too, or a kill would lose it for good (a resume does not
            # train that round again)
            key, data = layout.metrics_key(self.rank, r), record.to_dict()
            if self.manager is not None:
                self.manager.checkpoints.writer.submit_record(
                    lambda key=key, data=data: self.store.put_json(key, data)
                )
            else:
                self.store.put_json(key, data)
            self.tracker.log_round(record.to_dict())
            log.info("%s", round_line(record))
            self._steps.last_closed = heartbeat_fields(record)
            self._beat(force=True)  # a closed round is news for the live table

    def _set_phase(self, phase: str) -> None:
        phase = _SHOWN_PHASE.get(phase, phase)
        if phase != self.phase:
            self.phase = phase
            self._beat(force=True)

    def _beat(self, *, force: bool = False) -> None:
        now = time.time()
        if not self._beats.pace.due(now, force):
            return
        m = self.manager
        beat = layout.Heartbeat(
            rank=self.rank,
            phase=self.phase,
            step=self.step,
            round=m.current_step() // self.spec.fragments if m else 0,
            exchange_round=m.current_step() if m else 0,
            transfer=m.transfer_phase if m else None,
            loss=self.last_loss,
            updated_at=now,
            pid=os.getpid(),
            pid_started_at=self._beats.pace.pid_started_at,
            host=socket.gethostname(),
            rounds_committed=m.rounds_committed if m else 0,
            **self._steps.last_closed,
        )
        if self._sender is not None:  # training: the store's round trip is not its to wait
            self._sender.send(beat.to_dict())
        else:
            self._write_beat(beat.to_dict())

    def _write_beat(self, beat: dict[str, Any]) -> None:
        self._beats.write(beat)  # never raises: a failure pauses heartbeats

    # ------------------------------------------------------------------ results
    def _rounds_result(self) -> tuple[int, list[int]]:
        """(committed, missed) outer rounds."""
        m = self.manager
        if m is None:
            return 0, []
        if self.spec.fragments == 1:
            return m.rounds_committed, list(m.rounds_missed)
        return self._syncs.outer_rounds()  # committed when every one of its syncs was

    def result_record(
        self, status: str, error: str | None, job_metrics: dict[str, Any]
    ) -> layout.ResultRecord:
        """This replica's result so far, as ``results/<rank>.json`` holds it."""
        m = self.manager
        F = self.spec.fragments
        committed, missed = self._rounds_result()
        record = layout.ResultRecord(
            rank=self.rank,
            status=status,
            error=error,
            rounds_committed=committed,
            rounds_missed=missed,
            fragments=F,
            fragment_sync_delay=self.spec.fragment_sync_delay,
            final_loss=self._steps.final_loss(self.last_loss),
            weights_sha256=weights_sha256(self.model) if self.model is not None else None,
            model_dtype=self._given_dtype(),
            wire=self.spec.wire_dtype,
            compression=wire_compression(
                wirefmt.wire_name(self.spec.wire_dtype, self.spec.sparse_density)
            ),
            sync_s=round(self._clock.sync_s, 4),
            compute_s=round(self._clock.compute_s, 4),
            steps=self.step,
            wall_s=round(self._clock.wall_s(), 3),
            resumed_from=self.resumed_from,
            job_metrics=job_metrics,
            versions=installed_versions(),
            cuda_available=cuda_available(),
            local_ranks=self.local.size if self.local else 1,
        )
        if m is not None:
            self._add_exchange_facts(record, m)
        return record

    def _add_exchange_facts(self, record: layout.ResultRecord, m: ObjectStoreManager) -> None:
        record.syncs_committed = m.rounds_committed
        record.syncs_missed = list(m.rounds_missed)
        # late for the quorum, took the published average (no checkpoint load)
        record.syncs_caught_up = list(m.rounds_caught_up)
        record.bytes_up, record.bytes_down = m.bytes_up, m.bytes_down
        record.ckpt_bytes_up, record.ckpt_bytes_down = m.ckpt_bytes_up, m.ckpt_bytes_down
        syncs = max(1, len(m.exchange.history))
        record.bytes_per_round = round((m.bytes_up + m.bytes_down) * record.fragments / syncs)
        # the exchanges' own time, in the background: sync_s is only what training waited
        record.transfer_s = round(m.transfer_s, 4)
        record.ckpt_s = round(m.ckpt_s, 4)
        record.rejected = [layout.Rejection.from_dict(x) for x in m.rejected]

    def result(self, status: str, error: str | None, job_metrics: dict[str, Any]) -> dict[str, Any]:
        """:meth:`result_record` as the JSON object written."""
        return self.result_record(status, error, job_metrics).to_dict()

    def save_model_at_end(self, model: Any, tokenizer: Any | None = None) -> None:
        """Have :meth:`finish` write ``model`` (a ``transformers`` model, or a peft one: its
        adapter) and ``tokenizer`` to the run's ``model/`` in Hugging Face format, if this is
        the lowest-ranked replica that finished (:mod:`crf.replica.export`)."""
        if self.local and self.local.mirror is not None:  # FSDP: the full copy, not a shard
            model = self.local.mirror
        self._to_save = (model, tokenizer)

    def _given_dtype(self) -> str | None:
        """The dtype ``--model``'s checkpoint is stored in, when this replica saves a model
        (crf/replica/export.py ``stored_dtype``)."""
        name = getattr(self.spec, "model", None)
        if self._to_save is None or not name:
            return None
        from crf.replica.export import stored_dtype

        return stored_dtype(str(name))

    def _save_model(self) -> None:
        from crf.replica import export

        if self._to_save is None:
            return
        self._set_phase("saving")
        # a lower replica is waited for while the exchange would count it alive
        m = self.manager
        alive_s = m.exchange.alive_window_s if m is not None else self.spec.round_timeout_s
        if export.is_lowest_survivor(self.store, self.rank, alive_s):
            export.save_model(self.store, *self._to_save, on_file=self._saved_file)

    def _saved_file(self) -> None:
        """After each file of model/ lands: a heartbeat (the replicas above it wait while
        it is heard from), and the ``saving`` fault point."""
        self._beat()
        maybe_fault("saving", self.rank, None, self.store)

    def finish(self, job_metrics: dict[str, Any] | None = None) -> None:
        """Write the trained model (the lowest replica that finished, when the job asked:
        :meth:`save_model_at_end`), this replica's result (``results/<rank>.json``) and the
        final heartbeat. The model lands before the result: once the run is over, it is
        there."""
        if job_metrics:  # a restart that only finishes the export reports them too
            self.store.put_json(layout.trained_metrics_key(self.rank), job_metrics)
        self._syncs.fold(self.step, final=True)
        if self._syncs.finished or self._steps.losses:
            self._flush_round_metrics()
        if self.manager is not None:
            self._queue_unsaved()
            self.manager.close()  # pending checkpoint writes land before the result
        self.tracker.close()
        self._save_model()
        record = self.result_record("ok", None, job_metrics_of(job_metrics))
        self.store.put_json(layout.result_key(self.rank), record.to_dict())
        self.phase = "done"
        self._beat(force=True)
        self._beats.close()

    def fail(self, error: BaseException) -> None:
        from crf.executors.secrets import hide_secrets
        from crf.replica.failures import deterministic, failed_in, stops_run, transient

        text = hide_secrets(f"{type(error).__name__}: {error}")
        where, self.phase = self.phase, "failed"
        # an error in setup (or a reward's own) is raised again on every attempt: the
        # replica exits 3 and the driver ends the run (crf/replica/failures.py)
        self.failure = (where, deterministic(error, phase=where))
        try:
            self._record_closed_rounds()
        except Exception as e:  # noqa: BLE001 - the job's own error is on its way up
            log.error("could not record the last round: %s", e)
        self.tracker.close()  # what was logged up to the failure stays (it never raises)
        try:
            record = self.result_record("failed", text, {})
            record.traceback = hide_secrets("".join(traceback.format_exception(error)))[-4000:]
            record.failed_in = failed_in(where)
            record.transient = transient(error)
            record.stops_run = stops_run(error)
            # the driver leaves it down, whatever the exit code
            record.restartable = not self.failure[1]
            self.store.put_json(layout.result_key(self.rank), record.to_dict())
            self._beat(force=True)
        # the store itself may be the problem, or the state the job left behind: whatever
        # this raises must not hide the job's own error, which is on its way up
        except Exception as e:
            log.error("could not record failure: %s", e)
        self._beats.close()

    def _record_closed_rounds(self) -> None:
        """A round whose syncs are all in gets its record at the next ``log_step``; a job
        that fails before it (the composer's held-out evaluation calls the rewards at the
        round's end) would leave a committed round without one, and the summary would say
        nobody committed it. Written here with the steps logged so far, and landed."""
        if not self._syncs.finished:
            return
        self._flush_round_metrics()
        if self.manager is not None:
            self.manager.checkpoints.writer.records_landed()

    def __enter__(self) -> ReplicaContext:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None:
            self.fail(exc)
        elif self.phase != "done":
            self.finish({})
        return False


def _numbers(values: Mapping[str, Any]) -> str:
    """``loss 0.8123, reward 0.41``: the numeric values, 4 significant digits."""
    return ", ".join(
        f"{k} {v:.4g}" for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    )  # fmt: skip


def round_line(record: layout.RoundMetrics) -> str:
    """The replica log's line for one finished round: what it learned and what the exchange
    cost (the per-step numbers are at DEBUG)."""
    learned = _numbers({"loss": record.loss, **record.metrics}) or "no loss recorded"
    kept = "committed" if record.committed else "not committed"
    return (
        f"round {record.round}: {learned} | sync {record.sync_s:.2f}s, "
        f"up {record.bytes_up / 2**20:.1f} MB, down {record.bytes_down / 2**20:.1f} MB, "
        f"{kept} ({len(record.participants)} replicas)"
    )
