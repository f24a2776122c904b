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

from crf.replica.allreduce import ObjectStoreAllReduce
from crf.replica.faults import maybe_fault
from crf.replica.manager import ObjectStoreManager
from crf.replica.wire import compression as wire_compression
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
        self.data_seed = spec.seed * 1_000_003 + rank + 1
        self.total_steps = spec.total_steps
        self.shard_grace_s = (
            shard_grace_s if shard_grace_s is not None else min(30.0, spec.round_timeout_s)
        )
        self.manager: ObjectStoreManager | None = None
        self._inner: torch.optim.Optimizer | None = None
        self.resumed_from: int | None = None  # global round this replica resumed from
        self.resumed_inner = False
        self.model: torch.nn.Module | None = None
        self.step = 0  # inner optimizer steps taken
        self.phase = "starting"
        self.last_loss: float | None = None
        self._round_sums: dict[str, float] = {}
        self._round_counts: dict[str, int] = {}
        self._round_loss: list[float] = []
        self._round_losses: dict[int, float] = {}
        self._synced_rounds: list[dict[str, Any]] = []
        self._n_rejected = 0  # how many of manager.rejected are already in per-round metrics
        self._last_beat = 0.0
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
        replicas average pseudo-gradients through the store and take the outer step."""
        from torchft.local_sgd import DiLoCo

        spec = self.spec
        exchange = ObjectStoreAllReduce(
            self.store,
            self.world_size,
            self.rank,
            run_id=spec.run_id,
            min_replicas=spec.min_replicas,
            round_timeout_s=spec.round_timeout_s,
            shard_grace_s=self.shard_grace_s,
            num_shards=spec.num_shards,
            keep_rounds=spec.keep_rounds,
            wire_dtype=spec.wire_dtype,
            error_feedback=spec.error_feedback,
            on_phase=self._set_phase,
        )
        manager = ObjectStoreManager(exchange, on_phase=self._set_phase)
        manager.register_state_dict_fn(
            "model", lambda sd: model.load_state_dict(sd), lambda: model.state_dict()
        )
        momentum = spec.outer_momentum
        outer = torch.optim.SGD(
            model.parameters(),
            lr=spec.outer_lr,
            momentum=momentum,
            nesterov=spec.nesterov and momentum > 0,
        )
        self.manager, self.model = manager, model
        self._set_phase("training")
        self._t_mark = time.monotonic()
        with DiLoCo(
            manager,
            [model],
            inner_optimizer,
            outer,
            sync_every=spec.sync_every,
            use_bucketization=False,
            pin_memory=False,
        ) as algo:
            self._inner = inner_optimizer
            self._resume(manager, inner_optimizer)
            # registered after DiLoCo's hooks, so it runs after a sync's outer step
            hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
            try:
                yield algo
            finally:
                hook.remove()

    def resume_step(self) -> int:
        """The inner step this replica will start from (0 unless a global state exists):
        lets a job that builds its data pipeline before ``diloco()`` skip what it used."""
        rounds = [int(n) for n in self.store.list("global") if n.isdigit()]
        return (max(rounds) + 1) * self.spec.sync_every if rounds else 0

    def _resume(self, manager: ObjectStoreManager, inner: torch.optim.Optimizer) -> None:
        """A (re)started replica joins at the newest committed round: global weights and outer
        momentum from ``global/<r>``, its own inner-optimizer state if it saved one for that
        round, and its step counter (= data position) at the start of round r + 1."""
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
        self.step = (latest + 1) * self.spec.sync_every
        try:
            key = f"replicas/{self.rank}/inner/{latest}.pt"
            payload, meta = decode_blob(self.store.get(key), where=key)
            if meta.get("round") == latest and meta.get("run_id") == self.spec.run_id:
                inner.load_state_dict(torch.load(io.BytesIO(payload), weights_only=True))
                self.resumed_inner = True
        except (ObjectNotFound, CorruptObjectError) as e:
            log.warning("no usable inner-optimizer state to resume (%s): starting it fresh", e)
        log.info("resumed from global/%d at step %d", latest, self.step)
        self._beat(force=True)

    def _save_inner(self, r: int) -> None:
        """Save this replica's inner-optimizer state after a committed round (for restarts)."""
        if not self.spec.save_inner_state or self._inner is None:
            return
        buf = io.BytesIO()
        torch.save(self._inner.state_dict(), buf)
        meta = {"round": r, "run_id": self.spec.run_id, "step": self.step}
        # one object per round: a resume needs the state of exactly the newest global round,
        # and global/<r> may be written after this replica already saved round r + 1
        self.store.put(f"replicas/{self.rank}/inner/{r}.pt", encode_blob(buf.getvalue(), meta))
        for name in self.store.list(f"replicas/{self.rank}/inner"):
            stem = name.removesuffix(".pt")
            if stem.isdigit() and int(stem) <= r - self.spec.keep_rounds:
                self.store.delete(f"replicas/{self.rank}/inner/{name}")

    def _after_inner_step(self, *_: Any) -> None:
        self.step += 1
        maybe_fault("inner_step", self.rank, None, self.store, step=self.step)
        if self.step % self.spec.sync_every != 0 or self.manager is None:
            return
        m = self.manager
        m.after_outer_step()
        if m.fatal_error is not None:
            raise m.fatal_error
        now = time.monotonic()
        sync_s = m.last_sync_s
        self._sync_s += sync_s
        self._compute_s += max(0.0, now - self._t_mark - sync_s)
        self._t_mark = now
        res = m.last_result
        r = self.step // self.spec.sync_every - 1
        # a replica that healed into a later round skips the inner steps it no longer needs
        self.step = max(self.step, m.current_step() * self.spec.sync_every)
        if m.last_committed:
            self._save_inner(m.current_step() - 1)
        # objects this round left out or refused (m.rejected accumulates over the run)
        rejected, self._n_rejected = list(m.rejected[self._n_rejected :]), len(m.rejected)
        self._synced_rounds.append(
            {
                "round": r,
                "exchange_round": res.round if res else None,
                "committed": m.last_committed,
                "participants": res.participants if res else [],
                "sync_s": sync_s,
                "bytes_up": res.bytes_up if res else 0,
                "bytes_down": res.bytes_down if res else 0,
                "error": m.last_error,
                "rejected": rejected,
                "healed_from": m.last_healed_from,
            }
        )
        self._set_phase("training")

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
            "round": (m.current_step() if m else 0),
            "loss": self.last_loss,
            "updated_at": now,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rounds_committed": m.rounds_committed if m else 0,
        }
        try:
            self.store.put_json(f"replicas/{self.rank}/state.json", state)
        except Exception as e:  # a heartbeat must never kill training, nor slow every step
            log.warning("heartbeat failed (pausing heartbeats for 30 s): %s", e)
            self._beat_paused_until = time.time() + 30.0

    # ------------------------------------------------------------------ results
    def result(self, status: str, error: str | None, job_metrics: dict[str, Any]) -> dict[str, Any]:
        m = self.manager
        last_round = max(self._round_losses) if self._round_losses else None
        return {
            "rank": self.rank,
            "status": status,
            "error": error,
            "rounds_committed": m.rounds_committed if m else 0,
            "rounds_missed": list(m.rounds_missed) if m else [],
            "final_loss": self._round_losses.get(last_round)
            if last_round is not None
            else self.last_loss,
            "weights_sha256": weights_sha256(self.model) if self.model is not None else None,
            "bytes_up": m.bytes_up if m else 0,
            "bytes_down": m.bytes_down if m else 0,
            "ckpt_bytes_up": m.ckpt_bytes_up if m else 0,
            "ckpt_bytes_down": m.ckpt_bytes_down if m else 0,
            "bytes_per_round": (
                round((m.bytes_up + m.bytes_down) / max(1, len(m.exchange.history))) if m else 0
            ),
            "wire": self.spec.wire_dtype,
            "compression": wire_compression(self.spec.wire_dtype),
            "sync_s": round(self._sync_s, 4),
            "compute_s": round(self._compute_s, 4),
            "steps": self.step,
            "wall_s": round(time.time() - self._t_start, 3),
            "rejected": list(m.rejected) if m else [],
            "resumed_from": self.resumed_from,
            "job_metrics": job_metrics,
        }

    def finish(self, job_metrics: dict[str, Any] | None = None) -> None:
        """Write this replica's result (``results/<rank>.json``) and the final heartbeat."""
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
