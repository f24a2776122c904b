"""ObjectStoreManager: the part of ``torchft.Manager`` that ``torchft.local_sgd.DiLoCo`` uses,
implemented over :class:`ObjectStoreAllReduce` instead of a lighthouse and process groups.

DiLoCo calls ``start_quorum()``, then ``allreduce(tensor)`` once per parameter, then
``wait()`` on every work and ``should_commit()``. We queue the tensors and run ONE batched
exchange on the first ``wait()`` (or at ``should_commit()``), averaging in place.

``should_commit()`` never raises: a replica outside the quorum, or whose exchange failed,
gets ``False`` (DiLoCo then discards the round's inner steps) and heals from ``global/<r>``
before its next round, so it rejoins with the same weights and outer momentum as everyone.
The lowest-rank participant writes ``global/<r>`` after the outer step (``after_outer_step``).
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.futures import Future

from crf.replica.allreduce import (
    AllReduceError,
    AllReduceResult,
    LayoutMismatchError,
    ObjectStoreAllReduce,
    RoundFailed,
)
from crf.store import CorruptObjectError, ObjectNotFound, StoreError, decode_blob, encode_blob
from crf.store.run_store import wait_until

log = logging.getLogger(__name__)

GLOBAL_STATE = "global/{r}/state.pt"


class HealError(RuntimeError):
    """A replica that missed a committed round could not load a global state to catch up."""


class _QueuedWork:
    """What ``allreduce`` returns: waiting on it runs the batched exchange once."""

    def __init__(self, manager: ObjectStoreManager, tensor: torch.Tensor) -> None:
        self._manager = manager
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        self._manager.flush()
        return True

    def get_future(self) -> Future:
        self._manager.flush()
        fut: Future = Future()
        fut.set_result(self._tensor)
        return fut


class ObjectStoreManager:
    """Duck-typed ``torchft.Manager`` for DiLoCo over an object store."""

    _use_async_quorum = False

    def __init__(
        self,
        exchange: ObjectStoreAllReduce,
        *,
        heal_timeout_s: float | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.exchange = exchange
        self.store = exchange.store
        self.rank = exchange.rank
        self.heal_timeout_s = (
            heal_timeout_s
            if heal_timeout_s is not None
            else exchange.round_timeout_s + 2 * exchange.shard_grace_s
        )
        self.on_phase = on_phase
        self._step = 0
        self.base_round = -1  # the global round these weights start from (-1: initial)
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self._queue: list[torch.Tensor] = []
        self._flushed = False
        self._commit = False
        self.last_result: AllReduceResult | None = None
        self.last_error: str | None = None
        self.fatal_error: Exception | None = None
        self.last_sync_s = 0.0
        self.last_healed_from: int | None = None
        self.rounds_committed = 0
        self.last_committed = False
        self.rounds_missed: list[int] = []
        self.bytes_up = 0  # exchange traffic only (pseudo-gradients, quorum, reduced shards)
        self.bytes_down = 0
        self.ckpt_bytes_up = 0  # global checkpoints written / read for healing
        self.ckpt_bytes_down = 0
        self.rejected: list[str] = []
        self._sync_t0 = 0.0
        self._pending_global: int | None = None

    # -------------------------------------------------------------- torchft surface
    def register_state_dict_fn(
        self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any]
    ) -> None:
        self._state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self) -> None:
        """Checkpoints are taken between steps by the same thread: nothing to lock."""

    def disallow_state_dict_read(self) -> None:
        """See allow_state_dict_read."""

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        self._queue = []
        self._flushed = False
        self._commit = False
        self.last_result = None
        self.last_error = None
        self._sync_t0 = time.monotonic()

    def current_step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        """Used when resuming: the next round to exchange."""
        self._step = step

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _QueuedWork:
        if self._flushed:
            raise RuntimeError("allreduce() after the round's exchange ran: call start_quorum()")
        self._queue.append(tensor)
        return _QueuedWork(self, tensor)

    def should_commit(self, timeout: Any = None) -> bool:
        """True if this replica took part in the round; otherwise heal and return False."""
        self.flush()
        r = self._step
        self.last_committed = self._commit
        if self._commit:
            self.rounds_committed += 1
            self._step = r + 1
            self.base_round = r
            parts = self.last_result.participants if self.last_result else [self.rank]
            if self.exchange.world_size > 1 and self.rank == min(parts):
                self._pending_global = r  # written after the outer step (after_outer_step)
            self.last_sync_s = time.monotonic() - self._sync_t0
            return True
        self.rounds_missed.append(r)
        self._phase("healing")
        try:
            self.heal(r)
        except HealError as e:  # fatal: continuing would fork the weights
            self.fatal_error = e
            self.last_error = f"{self.last_error or ''}; {e}".strip("; ")
        except (StoreError, OSError, CorruptObjectError) as e:
            self.fatal_error = HealError(f"healing after round {r} failed: {e}")
            self.last_error = str(self.fatal_error)
        self._step = max(self._step, r + 1)
        self.last_sync_s = time.monotonic() - self._sync_t0
        return False

    # -------------------------------------------------------------- exchange
    def flush(self) -> None:
        """Run the round's batched exchange once; errors become should_commit() == False."""
        if self._flushed:
            return
        self._flushed = True
        self._phase("syncing")
        try:
            res = self.exchange.allreduce(self._queue, round=self._step, base_round=self.base_round)
            self.last_result = res
            self._commit = res.in_quorum
            if not res.in_quorum:
                self.last_error = f"not in the quorum of round {self._step}: {res.participants}"
            self._account(res)
        except LayoutMismatchError as e:
            self.fatal_error = e
            self.last_error = str(e)
            self._commit = False
        except (AllReduceError, StoreError, OSError, CorruptObjectError) as e:
            log.warning("round %d: exchange failed: %s", self._step, e)
            self.last_error = f"{type(e).__name__}: {e}"
            self._commit = False
            partial = self.exchange.history[-1] if self.exchange.history else None
            if isinstance(e, RoundFailed):
                self.rejected.append(str(e))
            if partial is not None and partial.round == self._step:
                self._account(partial)
        finally:
            self._queue = []

    def _account(self, res: AllReduceResult) -> None:
        self.bytes_up += res.bytes_up
        self.bytes_down += res.bytes_down
        self.rejected.extend(res.rejected)

    def _phase(self, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(phase)

    # -------------------------------------------------------------- global state
    def state_dict(self) -> dict[str, Any]:
        return {key: save() for key, (_, save) in self._state_fns.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, (load, _) in self._state_fns.items():
            if key in state:
                load(state[key])

    def after_outer_step(self) -> None:
        """Write ``global/<r>`` if this replica is the round's lowest participant; GC."""
        r, self._pending_global = self._pending_global, None
        if r is None:
            return
        buf = io.BytesIO()
        torch.save({"round": r, "state": self.state_dict()}, buf)
        blob = encode_blob(buf.getvalue(), {"round": r, "run_id": self.exchange.run_id})
        self.store.put(GLOBAL_STATE.format(r=r), blob)
        self.ckpt_bytes_up += len(blob)
        self.exchange.collect_garbage(r)
        self._gc_globals(r)

    def _gc_globals(self, r: int) -> None:
        for name in self.store.list("global"):
            if name.isdigit() and int(name) <= r - self.exchange.keep_rounds:
                self.store.delete(f"global/{name}")

    def latest_global(self) -> int | None:
        rounds = [int(n) for n in self.store.list("global") if n.isdigit()]
        return max(rounds) if rounds else None

    def load_global(self, r: int) -> None:
        key = GLOBAL_STATE.format(r=r)
        data = self.store.get(key)
        self.ckpt_bytes_down += len(data)
        payload, meta = decode_blob(data, where=f"{self.store.uri}/{key}")
        if meta.get("run_id") != self.exchange.run_id:
            raise CorruptObjectError(f"{key} belongs to run {meta.get('run_id')!r}")
        ckpt = torch.load(io.BytesIO(payload), weights_only=True)
        self.load_state_dict(ckpt["state"])
        self.last_healed_from = r
        self.base_round = r
        self._step = r + 1

    def heal(self, r: int) -> bool:
        """Catch up after missing round ``r``: load the newest global state if others moved on
        (they committed round r, or this replica found its weights based on an older round
        than theirs). If nobody committed anything newer, the restored weights already are the
        newest global state and nothing is loaded. Never loads a global state older than what
        the others have: that would silently fork the weights, so it raises
        :class:`HealError` instead (the replica exits and a restart resumes it)."""
        if self.exchange.world_size == 1:
            return False

        def failed() -> bool:
            return self.store.exists(f"rounds/{r}/failed.json")

        def newest() -> int:
            latest = self.latest_global()
            return -1 if latest is None else latest

        res = self.last_result
        if res is not None and res.stale_behind is not None:
            target = res.stale_behind
        elif self.store.exists(f"rounds/{r}/quorum.json") and not failed():
            target = r
        else:
            # nobody committed round r (so far). If a quorum forms later without us, our
            # manifest's base_round marks us stale in the next round and we heal then.
            return False
        if target <= self.base_round:
            return False
        ok = wait_until(
            lambda: newest() >= target or (target == r and failed()),
            self.heal_timeout_s,
            poll_s=0.05,
            max_poll_s=0.5,
        )
        if not ok:
            raise HealError(
                f"the other replicas are at global round {target} but no global/<{target} or "
                f"later> appeared within {self.heal_timeout_s:.0f}s (did its writer die?); "
                "restart this replica to resume from the newest global state"
            )
        if newest() < target:  # round r failed after all
            return False
        for _ in range(3):  # the newest may be garbage-collected between list and get
            try:
                self.load_global(newest())
                log.info("healed from global/%d", self.last_healed_from)
                return True
            except ObjectNotFound:
                continue
        raise HealError(f"could not read a global state at or after round {target}")
