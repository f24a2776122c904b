"""ReplicaContext: what a training script inside a replica uses to join the run.

It reads the replica contract (``CRF_RUN_URI``, ``CRF_RANK``, ``CRF_WORLD_SIZE``) and the run
spec from ``run.json``, wraps the job's model and inner optimizer in torchft's DiLoCo over the
object store (``diloco()``), and writes what the driver watches: the heartbeat
(``replicas/<rank>/state.json``), per-round metrics (``metrics/<rank>/<r>.json``) and the final
result (``results/<rank>.json``). Both ``python -m crf.replica`` and a user's own entrypoint
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
import hashlib
import io
import logging
import os
import socket
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from crf.exchange import wire as wirefmt
from crf.exchange.allreduce import (
    NonFiniteError,
    describe_nonfinite,
    tensors_layout_hash,
)
from crf.exchange.config import ExchangeConfig
from crf.exchange.manager import (
    ObjectStoreManager,
    restart_cannot_help,
    turn_off_bucketization,
)
from crf.exchange.wire import compression as wire_compression
from crf.executors.process import process_started_at
from crf.faults import maybe_fault, maybe_poison
from crf.layout import heartbeat_key
from crf.spec import RunSpec
from crf.store import CorruptObjectError, ObjectNotFound, RunStore, decode_blob, encode_blob
from crf.store.codec import raw_view

log = logging.getLogger(__name__)

ENV_RUN_URI = "CRF_RUN_URI"
ENV_RANK = "CRF_RANK"
ENV_WORLD_SIZE = "CRF_WORLD_SIZE"
ENV_RUN_ID = "CRF_RUN_ID"
HEARTBEAT_EVERY_S = 1.0


class ContractError(RuntimeError):
    """The replica's environment does not follow the contract (missing/invalid CRF_* vars)."""


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
    """The model's parameters (in ``named_parameters`` order, tied ones once) in ``fragments``
    contiguous groups of about equal size. One fragment is the model itself."""
    if fragments == 1:
        return [model]
    named = list(model.named_parameters())
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


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of every tensor in the state dict (names, dtypes, shapes, bytes), name-sorted."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(raw_view(t))
    return h.hexdigest()


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
                f"{ENV_WORLD_SIZE}={world_size} but run.json says replicas={spec.replicas}"
            )
        if not 0 <= rank < world_size:
            raise ContractError(f"{ENV_RANK}={rank} must be in [0, {world_size})")
        self.store = store
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.seed = spec.seed
        # kept in [0, 2**32) (numpy's seed range, which transformers' set_seed needs) for
        # every valid seed; the same value as before for the seeds that fitted already
        self.data_seed = (spec.seed * 1_000_003 + rank + 1) % 2**32
        self.total_steps = spec.total_steps
        self.shard_grace_s = (
            shard_grace_s if shard_grace_s is not None else min(30.0, spec.round_timeout_s)
        )
        self.manager: ObjectStoreManager | None = None
        self._inner: torch.optim.Optimizer | None = None
        self.resumed_from: int | None = None  # global round this replica resumed from
        self.resumed_inner = False
        self.model: torch.nn.Module | None = None
        self.layout: str | None = None  # digest of the model's tensors (diloco())
        self.step = 0  # inner optimizer steps taken
        self.phase = "starting"
        self.last_loss: float | None = None
        self._round_sums: dict[str, float] = {}
        self._round_counts: dict[str, int] = {}
        self._round_loss: list[float] = []
        self._round_losses: dict[int, float] = {}
        self._synced_rounds: list[dict[str, Any]] = []
        self._sync_entries: list[dict[str, Any]] = []  # per sync, until its round is over
        self._outer_commits: dict[int, list[bool]] = {}
        self.fragments: list[torch.nn.Module] = []
        self._blocked_mark = 0.0
        self._transfer_mark = 0.0
        self._n_rejected = 0  # how many of manager.rejected are already in per-round metrics
        self._last_beat = 0.0
        # with the pid in the heartbeat: tells this process from a later one given its pid
        self._started_at = process_started_at()
        self._beat_paused_until = 0.0
        self._t_start = time.time()
        self._compute_s = 0.0
        self._sync_s = 0.0
        self._t_mark = time.monotonic()
        self._finished = False
        self._beat(force=True)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ReplicaContext:
        env = os.environ if environ is None else environ
        missing = [v for v in (ENV_RUN_URI, ENV_RANK, ENV_WORLD_SIZE) if not env.get(v)]
        if missing:
            raise ContractError(
                f"missing environment variable(s) {', '.join(missing)}: a replica is started "
                "by `crf launch` (or an executor), which sets them"
            )
        try:
            rank, world = int(env[ENV_RANK]), int(env[ENV_WORLD_SIZE])
        except ValueError:
            raise ContractError(
                f"{ENV_RANK} and {ENV_WORLD_SIZE} must be integers "
                f"(got {env[ENV_RANK]!r}, {env[ENV_WORLD_SIZE]!r})"
            ) from None
        store = RunStore(env[ENV_RUN_URI])
        spec = RunSpec.from_json(store.get("run.json"))
        return cls(store, spec, rank, world)

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
        from torchft.local_sgd import DiLoCo

        spec = self.spec
        config = ExchangeConfig.from_spec(
            spec,
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
        manager.final_round = spec.exchange_rounds - 1
        # global and inner states carry the model's layout; one of another model is refused
        self.layout = manager.state_layout = tensors_layout_hash(list(model.parameters()))
        manager.on_blocked = self._beat  # heartbeats go on while it waits (once a second)
        fragments = split_model(model, spec.fragments)
        self.fragments = fragments
        if len(fragments) == 1:
            manager.register_state_dict_fn(
                "model", lambda sd: model.load_state_dict(sd), lambda: model.state_dict()
            )
        else:
            # the parameters are in the fragments' global copies; "model" keeps the rest
            # (buffers), and a loaded state puts every fragment's global copy in the model
            params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
            manager.register_state_dict_fn(
                "model",
                lambda sd: model.load_state_dict(sd, strict=False),
                lambda: {k: v for k, v in model.state_dict().items() if k not in params},
            )
            manager.on_loaded = self._load_fragments
        momentum = spec.outer_momentum
        outers = [
            torch.optim.SGD(
                f.parameters(),
                lr=spec.outer_lr,
                momentum=momentum,
                nesterov=spec.nesterov and momentum > 0,
            )
            for f in fragments
        ]
        self.manager, self.model = manager, model
        self._blocked_mark = self._transfer_mark = 0.0
        self._set_phase("training")
        self._t_mark = time.monotonic()
        algo = DiLoCo(
            manager,
            fragments,
            inner_optimizer,
            outers[0] if len(outers) == 1 else outers,
            sync_every=spec.sync_every,
            use_bucketization=False,
            pin_memory=False,
            fragment_sync_delay=spec.fragment_sync_delay,
        )
        turn_off_bucketization(algo)  # one exchange per sync already (see its docstring)
        # DiLoCo allreduces each parameter of the fragment it syncs: knowing how many, the
        # manager starts the exchange the moment the last one is queued
        manager.set_fragment_sizes([len(list(f.named_parameters())) for f in fragments])
        ok = False
        with algo:
            self._inner = inner_optimizer
            self._resume(manager, inner_optimizer)
            # registered after DiLoCo's hooks, so it runs after a sync's outer step
            hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
            try:
                yield algo
                ok = True
            finally:
                hook.remove()
                if ok:
                    if len(fragments) > 1:
                        self._load_fragments(manager.state_dict())
                    manager.close()
                else:
                    try:
                        manager.close()
                    except Exception as e:  # the job's own error is the one to report
                        log.warning("pending checkpoint writes failed: %s", e)

    def _load_fragments(self, state: dict[str, Any]) -> None:
        """Put every fragment's global copy (``original_parameters`` in DiLoCo's state) into
        the model: after healing or resuming, and when training ends."""
        with torch.no_grad():
            for i, frag in enumerate(self.fragments):
                glob = state[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
                for name, p in frag.named_parameters():
                    p.data.copy_(glob[name])

    def resume_step(self) -> int:
        """The inner step this replica will start from (0 unless a global state exists):
        lets a job that builds its data pipeline before ``diloco()`` skip what it used."""
        rounds = [int(n) for n in self.store.list("global") if n.isdigit()]
        return (max(rounds) + 1) * self.spec.sync_period if rounds else 0

    def _resume(self, manager: ObjectStoreManager, inner: torch.optim.Optimizer) -> None:
        """A (re)started replica joins at the newest committed round: global weights and outer
        momentum from ``global/<r>``, its own inner-optimizer state if it saved one for that
        round, and its step counter (= data position) at the start of round r + 1. (Rounds
        here are exchange rounds: one per fragment sync, ``sync_every / fragments`` steps.)"""
        rounds = sorted((int(n) for n in self.store.list("global") if n.isdigit()), reverse=True)
        latest = None
        for r in rounds:  # newest first; a corrupt or vanished one falls back to the previous
            try:
                manager.load_global(r)
                latest = r
                break
            except (ObjectNotFound, CorruptObjectError) as e:
                log.warning("cannot resume from global/%d (%s): trying an older one", r, e)
        if latest is None:
            return
        self.resumed_from = latest
        self.step = (latest + 1) * self.spec.sync_period
        try:
            key = f"replicas/{self.rank}/inner/{latest}.pt"
            payload, meta = decode_blob(self.store.get(key), where=key)
            expect = {
                "run_id": self.spec.run_id,
                "round": latest,
                "rank": self.rank,
                "layout": self.layout,
            }
            bad = {k: meta.get(k) for k, v in expect.items() if meta.get(k) != v}
            if bad:  # a copy from another run, round, replica or model: never loaded
                raise CorruptObjectError(
                    f"{key}: not this replica's inner state of round {latest} ({bad})"
                )
            saved = torch.load(io.BytesIO(payload), weights_only=True)
            if self.spec.fragments > 1:  # also this replica's own (local) weights
                inner.load_state_dict(saved["inner_optimizer"])
                with torch.no_grad():
                    for name, p in self.model.named_parameters():
                        p.copy_(saved["local_params"][name])
            else:
                inner.load_state_dict(saved)
            self.resumed_inner = True
        except CorruptObjectError as e:  # refused: reported, then as if it were missing
            manager.rejected.append(str(e))
            log.warning("no usable inner-optimizer state to resume (%s): starting it fresh", e)
        except (ObjectNotFound, KeyError) as e:
            log.warning("no usable inner-optimizer state to resume (%s): starting it fresh", e)
        log.info("resumed from global/%d at step %d", latest, self.step)
        self._beat(force=True)

    def _save_inner(self, r: int) -> None:
        """Save this replica's inner-optimizer state after a committed round (for restarts).
        With fragments, also its weights: only the fragment just synced is global, the others
        hold this replica's local progress, which global/<r> does not have. Serialized now,
        written in the background (``ObjectStoreManager.persist``)."""
        if self._inner is None or not self.spec.saves_inner_state(r):
            return
        k = self.spec.checkpoint_every
        buf = io.BytesIO()
        if self.spec.fragments > 1 and self.model is not None:
            local = {n: p.detach() for n, p in self.model.named_parameters()}
            torch.save({"inner_optimizer": self._inner.state_dict(), "local_params": local}, buf)
        else:
            torch.save(self._inner.state_dict(), buf)
        meta = {
            "round": r,
            "run_id": self.spec.run_id,
            "rank": self.rank,
            "layout": self.layout,
            "step": self.step,
        }
        payload = buf.getvalue()

        def write() -> None:
            # one object per round: a resume needs the state of exactly the newest global
            # round, and global/<r> may be written after this replica already saved r + 1
            self.store.put(f"replicas/{self.rank}/inner/{r}.pt", encode_blob(payload, meta))
            for name in self.store.list(f"replicas/{self.rank}/inner"):
                stem = name.removesuffix(".pt")
                if stem.isdigit() and int(stem) <= r - self.spec.keep_rounds * k:
                    self.store.delete(f"replicas/{self.rank}/inner/{name}")

        if self.manager is not None:
            self.manager.persist(write)
        else:
            write()

    def _after_inner_step(self, *_: Any) -> None:
        self.step += 1
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
        res = m.last_result
        e = self.step // period - 1  # the exchange round that just synced
        # a replica that healed into a later round skips the inner steps it no longer needs
        self.step = max(self.step, m.current_step() * period)
        if m.fatal_error is None:  # before its state is saved anywhere
            self._check_weights_finite(e // self.spec.fragments)
        if m.last_committed:  # queued before global/<r>: the writer's own inner state lands first
            with m.blocking():
                self._save_inner(m.current_step() - 1)
        m.after_outer_step()
        if m.fatal_error is not None:
            raise m.fatal_error
        # time: blocked in the manager (starting the exchange, waiting for it, healing,
        # snapshotting checkpoints) vs the rest; the background transfer counts apart
        now = time.monotonic()
        sync_s, self._blocked_mark = m.blocked_s - self._blocked_mark, m.blocked_s
        transfer_s, self._transfer_mark = m.transfer_s - self._transfer_mark, m.transfer_s
        self._sync_s += sync_s
        self._compute_s += max(0.0, now - self._t_mark - sync_s)
        self._t_mark = now
        # objects this round left out or refused (m.rejected accumulates over the run)
        rejected, self._n_rejected = list(m.rejected[self._n_rejected :]), len(m.rejected)
        F = self.spec.fragments
        self._sync_entries.append(
            {
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
                "rejected": rejected,
                "healed_from": m.last_healed_from,
            }
        )
        self._outer_commits.setdefault(e // F, []).append(m.last_committed)
        self._fold_syncs(final=False)
        self._set_phase("training")

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

    def _fold_syncs(self, *, final: bool) -> None:
        """Turn the syncs of each finished outer round (``sync_every`` steps: one sync per
        fragment) into that round's metrics record."""
        F, done, keep = self.spec.fragments, {}, []
        for entry in self._sync_entries:
            r = entry["round"]
            if final or self.step >= (r + 1) * self.spec.sync_every:
                done.setdefault(r, []).append(entry)
            else:
                keep.append(entry)
        self._sync_entries = keep
        for r, entries in sorted(done.items()):
            if F == 1:
                (info,) = entries
                self._synced_rounds.append(info)
                continue
            parts = set(entries[0]["participants"])
            for x in entries[1:]:
                parts &= set(x["participants"])
            errors = [x["error"] for x in entries if x["error"]]
            healed = [x["healed_from"] for x in entries if x["healed_from"] is not None]
            self._synced_rounds.append(
                {
                    "round": r,
                    "exchange_round": entries[-1]["exchange_round"],
                    "committed": all(x["committed"] for x in entries),
                    "participants": sorted(parts),
                    "sync_s": sum(x["sync_s"] for x in entries),
                    "transfer_s": sum(x["transfer_s"] for x in entries),
                    "bytes_up": sum(x["bytes_up"] for x in entries),
                    "bytes_down": sum(x["bytes_down"] for x in entries),
                    "error": "; ".join(errors) or None,
                    "rejected": [j for x in entries for j in x["rejected"]],
                    "healed_from": healed[-1] if healed else None,
                    "fragments": entries,
                }
            )

    # ------------------------------------------------------------------ metrics
    def log_step(self, loss: float | None = None, **metrics: float) -> None:
        """Record one inner step's loss and metrics (call after each optimizer step)."""
        if loss is not None:
            loss = float(loss)
            self.last_loss = loss
            self._round_loss.append(loss)
        for k, v in metrics.items():
            if v is None:
                continue
            self._round_sums[k] = self._round_sums.get(k, 0.0) + float(v)
            self._round_counts[k] = self._round_counts.get(k, 0) + 1
        if self._synced_rounds:
            self._flush_round_metrics()
        self._beat()

    def _flush_round_metrics(self) -> None:
        for info in self._synced_rounds:
            r = info["round"]
            loss = sum(self._round_loss) / len(self._round_loss) if self._round_loss else None
            if loss is not None:
                self._round_losses[r] = loss
            body = {
                "round": r,
                "rank": self.rank,
                "loss": loss,
                "metrics": {
                    k: self._round_sums[k] / self._round_counts[k] for k in self._round_sums
                },
                "compute_s": self._compute_s,
                "step": self.step,
                "updated_at": time.time(),
                **info,
            }
            self.store.put_json(f"metrics/{self.rank}/{r}.json", body)
            self._round_loss, self._round_sums, self._round_counts = [], {}, {}
        self._synced_rounds = []

    def _set_phase(self, phase: str) -> None:
        phase = {
            "uploading": "syncing",
            "quorum": "syncing",
            "reducing": "syncing",
            "gathering": "syncing",
        }.get(phase, phase)
        if phase != self.phase:
            self.phase = phase
            self._beat(force=True)

    def _beat(self, *, force: bool = False) -> None:
        now = time.time()
        if now < self._beat_paused_until or (
            not force and now - self._last_beat < HEARTBEAT_EVERY_S
        ):
            return
        self._last_beat = now
        m = self.manager
        state = {
            "rank": self.rank,
            "phase": self.phase,
            "step": self.step,
            "round": (m.current_step() // self.spec.fragments if m else 0),
            "exchange_round": (m.current_step() if m else 0),
            "transfer": m.transfer_phase if m else None,
            "loss": self.last_loss,
            "updated_at": now,
            "pid": os.getpid(),
            "pid_started_at": self._started_at,
            "host": socket.gethostname(),
            "rounds_committed": m.rounds_committed if m else 0,
        }
        try:
            self.store.put_json(heartbeat_key(self.rank), state)
        except Exception as e:  # a heartbeat must never kill training, nor slow every step
            log.warning("heartbeat failed (pausing heartbeats for 30 s): %s", e)
            self._beat_paused_until = time.time() + 30.0

    # ------------------------------------------------------------------ results
    def result(self, status: str, error: str | None, job_metrics: dict[str, Any]) -> dict[str, Any]:
        m = self.manager
        F = self.spec.fragments
        last_round = max(self._round_losses) if self._round_losses else None
        if F == 1 or m is None:
            committed = m.rounds_committed if m else 0
            missed = list(m.rounds_missed) if m else []
        else:  # an outer round counts as committed when every one of its syncs was
            committed = sum(all(v) for v in self._outer_commits.values())
            missed = sorted(r for r, v in self._outer_commits.items() if not all(v))
        return {
            "rank": self.rank,
            "status": status,
            "error": error,
            "rounds_committed": committed,
            "rounds_missed": missed,
            "fragments": F,
            "fragment_sync_delay": self.spec.fragment_sync_delay,
            "syncs_committed": m.rounds_committed if m else 0,
            "syncs_missed": list(m.rounds_missed) if m else [],
            # late for the quorum, took the published average (no checkpoint load)
            "syncs_caught_up": list(m.rounds_caught_up) if m else [],
            "final_loss": self._round_losses.get(last_round)
            if last_round is not None
            else self.last_loss,
            "weights_sha256": weights_sha256(self.model) if self.model is not None else None,
            "bytes_up": m.bytes_up if m else 0,
            "bytes_down": m.bytes_down if m else 0,
            "ckpt_bytes_up": m.ckpt_bytes_up if m else 0,
            "ckpt_bytes_down": m.ckpt_bytes_down if m else 0,
            "bytes_per_round": (
                round((m.bytes_up + m.bytes_down) * F / max(1, len(m.exchange.history))) if m else 0
            ),
            "wire": self.spec.wire_dtype,
            "compression": wire_compression(self.spec.wire_dtype),
            "sync_s": round(self._sync_s, 4),
            "compute_s": round(self._compute_s, 4),
            # the exchanges' own time, in the background: sync_s is only what training waited
            "transfer_s": round(m.transfer_s, 4) if m else 0.0,
            "ckpt_s": round(m.ckpt_s, 4) if m else 0.0,
            "steps": self.step,
            "wall_s": round(time.time() - self._t_start, 3),
            "rejected": list(m.rejected) if m else [],
            "resumed_from": self.resumed_from,
            "job_metrics": job_metrics,
        }

    def finish(self, job_metrics: dict[str, Any] | None = None) -> None:
        """Write this replica's result (``results/<rank>.json``) and the final heartbeat."""
        if self.manager is not None:
            self.manager.close()  # pending checkpoint writes land before the result
        self._fold_syncs(final=True)
        if self._synced_rounds or self._round_loss:
            self._flush_round_metrics()
        self.store.put_json(f"results/{self.rank}.json", self.result("ok", None, job_metrics or {}))
        self._finished = True
        self.phase = "done"
        self._beat(force=True)

    def fail(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        self.phase = "failed"
        try:
            body = self.result("failed", text, {})
            body["traceback"] = "".join(traceback.format_exception(error))[-4000:]
            if restart_cannot_help(error):  # the driver leaves it down, whatever the exit code
                body["restartable"] = False
            self.store.put_json(f"results/{self.rank}.json", body)
            self._beat(force=True)
        except Exception as e:  # the store itself may be the problem
            log.error("could not record failure: %s", e)

    def __enter__(self) -> ReplicaContext:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None:
            self.fail(exc)
        elif not self._finished:
            self.finish({})
        return False
