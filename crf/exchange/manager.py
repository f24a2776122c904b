"""ObjectStoreManager: the part of ``torchft.Manager`` that ``torchft.local_sgd.DiLoCo`` uses,
implemented over :class:`ObjectStoreAllReduce` instead of a lighthouse and process groups.

DiLoCo calls ``start_quorum()``, then ``allreduce(tensor)`` once per parameter of the fragment
it syncs (``prepare_sync``), then - ``fragment_sync_delay`` inner steps later with Streaming
DiLoCo, at once otherwise - ``wait()`` on every work and ``should_commit()``
(``perform_sync``). We queue the tensors and run ONE batched exchange per sync, averaging in
place. The exchange starts in a background thread as soon as the fragment's last tensor is
queued (``set_fragment_sizes`` says how many that is; without it, when the next inner step
begins or at the first ``wait()``), so the upload and the others' reduction run while the
inner steps go on: only ``wait()``/``should_commit()`` block. ``blocked_s`` counts the time
the training thread spent blocked in this manager, ``transfer_s`` the time the background
exchange took - the difference is the overlap.

``should_commit()`` never raises: a replica outside the quorum, or whose exchange failed,
gets ``False`` (DiLoCo then discards the round's inner steps) and heals from ``global/<r>``
before its next round, so it rejoins with the same weights and outer momentum as everyone.
The lowest-rank participant writes ``global/<r>`` after the outer step (``after_outer_step``):
the state is serialized at once (the weights change with the next inner step) and, with
``async_checkpoints``, uploaded by a background writer so training does not wait for it;
``drain()`` waits for pending writes (a replica calls it before reporting its result).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future as _ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.futures import Future

from crf.exchange.allreduce import (
    AllReduceError,
    AllReduceResult,
    LayoutMismatchError,
    NonFiniteError,
    ObjectStoreAllReduce,
    RoundFailed,
)
from crf.exchange.config import ExchangeConfig, ExchangeHooks
from crf.store import (
    CorruptObjectError,
    ObjectNotFound,
    RunStore,
    StoreError,
    decode_blob,
    encode_blob,
)
from crf.store.run_store import wait_until

log = logging.getLogger(__name__)

GLOBAL_STATE = "global/{r}/state.pt"
#: how often ``on_blocked`` is called while the training thread waits (exchange, heal)
_KEEPALIVE_S = 1.0
#: the variable torchft's DiLoCo reads to put a sync's tensors in buckets (turned off here)
USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"


class HealError(RuntimeError):
    """A replica that missed a committed round could not load a global state to catch up."""


#: errors that say the run cannot work as it is set up (the replicas build different models,
#: use different wires or fragments; this replica's numbers went NaN/Inf, which a restart
#: from the same global state and data computes again): a restart would hit them again
UNRECOVERABLE_ERRORS: tuple[type[BaseException], ...] = (LayoutMismatchError, NonFiniteError)


def restart_cannot_help(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is one of
    :data:`UNRECOVERABLE_ERRORS`: the replica then exits so that it is not restarted
    (``python -m crf.replica`` exit code 3, ``"restartable": false`` in its result)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UNRECOVERABLE_ERRORS):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def turn_off_bucketization(algo: Any) -> bool:
    """Undo ``TORCHFT_USE_BUCKETIZATION`` on a torchft DiLoCo (its fragments read the variable
    when built, over the ``use_bucketization=False`` crf passes); returns whether it was on.

    Why off rather than supported: this manager already sends all of a sync's tensors in ONE
    exchange (one contribution object, cut into ``num_shards`` shards), which is what buckets
    are for with a process group; and torchft's buckets (``local_sgd``, nightly 2026.10.26)
    are only right when each bucket's future completes before the next bucket is packed (the
    copy-back callbacks read the loop's variables late), i.e. one blocking store round per
    bucket, and never average a tensor that does not fit the space left in a bucket - the
    replicas would drift apart silently. Per-tensor allreduce gathered into one exchange has
    neither problem.
    """
    fragments = [f for f in getattr(algo, "_fragments", []) if getattr(f, "use_bucketization", 0)]
    for fragment in fragments:
        fragment.use_bucketization = False
    if fragments:
        log.warning(
            "TORCHFT_USE_BUCKETIZATION=%s is ignored: crf already sends all of a sync's tensors "
            "in one exchange (torchft's buckets would need one blocking store round each)",
            os.environ.get(USE_BUCKETIZATION_ENV, ""),
        )
    return bool(fragments)


class _QueuedWork:
    """What ``allreduce`` returns: waiting on it waits for the round's batched exchange."""

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
        store: RunStore | str,
        world_size: int,
        rank: int,
        config: ExchangeConfig | None = None,
        *,
        heal_timeout_s: float | None = None,
        on_phase: Callable[[str], None] | None = None,
        background: bool = True,
        async_checkpoints: bool = False,
        **options: Any,
    ) -> None:
        """Builds its own exchange from ``config`` (or its fields as keywords in ``options``)
        with this manager's hooks: it serves heal requests while waiting and reports the
        transfer's phase, so nothing is set on the exchange after it is built."""
        if config is not None and options:
            raise TypeError("pass either config= or its fields as keywords, not both")
        config = config or ExchangeConfig(**options)
        checkpoint_every = config.checkpoint_every
        hooks = ExchangeHooks(
            on_phase=self._transfer_phase,
            on_wait=self._serve_heal_requests if checkpoint_every > 1 else None,
        )
        exchange = ObjectStoreAllReduce(store, world_size, rank, config, hooks)
        self.exchange = exchange
        self.store = exchange.store
        self.rank = exchange.rank
        self.heal_timeout_s = (
            heal_timeout_s
            if heal_timeout_s is not None
            else exchange.config.round_timeout_s + 2 * exchange.config.shard_grace_s
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
        #: a digest of the model's tensors (set by ReplicaContext): global states carry it
        #: and one of another layout is refused
        self.state_layout: str | None = None
        #: global rounds whose state was refused (foreign, stale copy, corrupt): never
        #: loaded again, as if they were not there
        self._bad_globals: set[int] = set()
        self._pending_global: int | None = None
        #: global/<r> is written every this many rounds, at ``final_round`` and on request
        self.checkpoint_every = checkpoint_every
        self.final_round: int | None = None
        # the newest global state not written (checkpoint_every > 1): served on request
        self._cached: tuple[int, bytes] | None = None
        self._cache_lock = threading.Lock()
        self.rounds_caught_up: list[int] = []  # left out, took the published average
        # background exchange (one at a time: DiLoCo waits for a sync before the next starts)
        self.background = background
        self._sizes: list[int] | None = None  # tensors per fragment (set_fragment_sizes)
        self._launched = False
        self._thread: threading.Thread | None = None
        self._outcome: tuple[AllReduceResult | None, BaseException | None] | None = None
        self.transfer_phase: str | None = None  # what the background exchange is doing
        #: called (in the exchange's thread) when a round's exchange starts: tests and
        #: benchmarks see that the transfer began before anyone waited for it
        self.on_transfer_start: Callable[[int], None] | None = None
        self.fragment_of: Callable[[int], int] = lambda r: 0  # exchange round -> fragment
        # time accounting (seconds, cumulative over the run)
        self.blocked_s = 0.0  # the training thread blocked in this manager
        self.transfer_s = 0.0  # background exchanges, start to finish
        self.last_transfer_s = 0.0
        self.ckpt_s = 0.0  # background checkpoint writes
        self._blocking_depth = 0
        self._blocked_at_quorum = 0.0
        self.last_round: int | None = None  # the exchange round of the last sync
        # checkpoint writes (global/<r>, a replica's inner state) off the training thread
        self.async_checkpoints = async_checkpoints
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[_ThreadFuture] = []
        #: called with the whole loaded state after load_global (e.g. to put every fragment's
        #: global copy back into the model)
        self.on_loaded: Callable[[dict[str, Any]], None] | None = None
        #: called about once a second while the training thread waits for an exchange or a
        #: global state to heal from: the replica's heartbeat goes on, so the others (which
        #: follow liveness) see a replica that is slow, not dead
        self.on_blocked: Callable[[], None] | None = None

    # -------------------------------------------------------------- torchft surface
    def register_state_dict_fn(
        self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any]
    ) -> None:
        self._state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self) -> None:
        """Checkpoints are taken between steps by the same thread: nothing to lock."""

    def disallow_state_dict_read(self) -> None:
        """DiLoCo calls this before every inner optimizer step: if a sync's tensors are queued
        but its exchange has not started (fragment sizes unknown), they are complete now."""
        if self._queue and not self._launched:
            with self.blocking():
                self._launch()

    def set_fragment_sizes(self, sizes: list[int]) -> None:
        """How many tensors DiLoCo allreduces for each fragment (fragment = round % len).
        With it the exchange starts the moment the fragment's last tensor is queued."""
        self._sizes = list(sizes) or None
        if self._sizes is not None:
            n = len(self._sizes)
            self.fragment_of = lambda r: r % n

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        if self._launched and not self._flushed:  # not waited for: finish it first
            self.flush()
        self._queue = []
        self._flushed = False
        self._launched = False
        self._outcome = None
        self._commit = False
        self.last_result = None
        self.last_error = None
        self._blocked_at_quorum = self.blocked_s

    def current_step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        """Used when resuming: the next round to exchange."""
        self._step = step

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _QueuedWork:
        if self._flushed or self._launched:
            raise RuntimeError("allreduce() after the round's exchange ran: call start_quorum()")
        self._queue.append(tensor)
        sizes = self._sizes
        if sizes is not None and len(self._queue) == sizes[self.fragment_of(self._step)]:
            with self.blocking():
                self._launch()
        return _QueuedWork(self, tensor)

    def should_commit(self, timeout: Any = None) -> bool:
        """True if this replica took part in the round; otherwise heal and return False (no
        heal after a fatal error, e.g. a layout mismatch: the replica raises it after the
        outer step, see ``fatal_error``)."""
        with self.blocking():
            committed = self._should_commit()
        # this sync's blocked time: starting the exchange, waiting for it, healing
        self.last_sync_s = self.blocked_s - self._blocked_at_quorum
        return committed

    def _should_commit(self) -> bool:
        self.flush()
        self._raise_if_write_failed()
        r = self._step
        self.last_round = r
        self.last_committed = self._commit
        if self._commit:
            self.rounds_committed += 1
            self._step = r + 1
            self.base_round = r
            parts = self.last_result.participants if self.last_result else [self.rank]
            if self.exchange.world_size > 1 and parts and self.rank == min(parts):
                self._pending_global = r  # written after the outer step (after_outer_step)
            else:
                with self._cache_lock:  # another replica holds the newest state now
                    self._cached = None
            return True
        self.rounds_missed.append(r)
        if self.fatal_error is not None:
            # the replica stops at this sync (e.g. the replicas disagree on the model): healing
            # could only wait for a global state nobody writes, and would hide the real error
            self._step = max(self._step, r + 1)
            return False
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
        return False

    # -------------------------------------------------------------- exchange
    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Count the time the training thread spends in here (nested calls once)."""
        self._blocking_depth += 1
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._blocking_depth -= 1
            if self._blocking_depth == 0:
                self.blocked_s += time.monotonic() - t0

    def _transfer_phase(self, phase: str) -> None:
        self.transfer_phase = phase

    def _launch(self) -> None:
        """Start the round's exchange over the queued tensors (in the background)."""
        self._launched = True
        tensors, r, base = list(self._queue), self._step, self.base_round
        if not self.background:
            self._run_exchange(tensors, r, base)
            return
        self._thread = threading.Thread(
            target=self._run_exchange, args=(tensors, r, base), name=f"crf-exchange-{r}"
        )
        self._thread.daemon = True
        self._thread.start()

    def _run_exchange(self, tensors: list[torch.Tensor], r: int, base: int) -> None:
        t0 = time.monotonic()
        try:
            if self.on_transfer_start is not None:
                self.on_transfer_start(r)
            res = self.exchange.allreduce(
                tensors, round=r, base_round=base, fragment=self.fragment_of(r)
            )
            self._outcome = (res, None)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread in flush()
            self._outcome = (None, e)
        finally:
            self.last_transfer_s = time.monotonic() - t0
            self.transfer_s += self.last_transfer_s
            self.transfer_phase = None

    def flush(self) -> None:
        """Wait for the round's batched exchange (starting it if it has not started yet);
        errors become should_commit() == False."""
        if self._flushed:
            return
        with self.blocking():
            self._flush()

    def _flush(self) -> None:
        self._flushed = True
        self._phase("syncing")
        try:
            if not self._launched:
                self._launch()
            if self._thread is not None:
                self._thread.join(_KEEPALIVE_S)
                while self._thread.is_alive():  # a long wait: the heartbeat goes on
                    self._keepalive()
                    self._thread.join(_KEEPALIVE_S)
                self._thread = None
            assert self._outcome is not None
            res, err = self._outcome
            if err is not None:
                raise err
            assert res is not None
            self.last_result = res
            self._commit = res.in_quorum or res.caught_up
            if res.caught_up:
                self.rounds_caught_up.append(self._step)
            elif not res.in_quorum:
                self.last_error = f"not in the quorum of round {self._step}: {res.participants}"
            self._account(res)
        except LayoutMismatchError as e:
            self.fatal_error = e
            self.last_error = str(e)
            self._commit = False
        except NonFiniteError as e:  # this replica's own numbers: fatal, never averaged
            log.error("%s", e)
            self.fatal_error = e
            self.last_error = f"{type(e).__name__}: {e}"
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

    def _keepalive(self) -> None:
        if self.on_blocked is not None:
            try:
                self.on_blocked()
            except Exception as e:  # a heartbeat never ends a wait early
                log.debug("keepalive failed: %s", e)

    # -------------------------------------------------------------- background writes
    def persist(self, write: Callable[[], None]) -> None:
        """Run a checkpoint write: in the background writer with ``async_checkpoints``
        (in order, one at a time), else now. A failed background write is raised as
        ``fatal_error`` at the next sync (and by ``drain``)."""
        if not self.async_checkpoints:
            write()
            return
        self._raise_if_write_failed()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crf-ckpt")
        self._writes.append(self._writer.submit(self._timed_write, write))

    def _timed_write(self, write: Callable[[], None]) -> None:
        t0 = time.monotonic()
        try:
            write()
        finally:
            self.ckpt_s += time.monotonic() - t0

    def _raise_if_write_failed(self) -> None:
        done = [f for f in self._writes if f.done()]
        self._writes = [f for f in self._writes if not f.done()]
        for f in done:
            e = f.exception()
            if e is not None and self.fatal_error is None:
                log.error("a checkpoint write failed: %s", e)
                self.fatal_error = e if isinstance(e, Exception) else RuntimeError(str(e))

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for pending background checkpoint writes; raise the first that failed."""
        pending, self._writes = self._writes, []
        for f in pending:
            f.result(timeout=timeout_s)

    def close(self) -> None:
        """Wait for a running exchange and pending writes, then stop the writer thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.exchange.close()
        try:
            self.drain()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    # -------------------------------------------------------------- global state
    def state_dict(self) -> dict[str, Any]:
        return {key: save() for key, (_, save) in self._state_fns.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, (load, _) in self._state_fns.items():
            if key in state:
                load(state[key])

    def after_outer_step(self) -> None:
        """The round's lowest participant writes ``global/<r>`` when one is due (every
        ``checkpoint_every`` rounds, at ``final_round``, or a replica asked for one to heal)
        and collects garbage. The state is serialized now (the weights change with the next
        inner step); the upload runs in the background with async_checkpoints. A state not
        written is kept in memory so a heal request can still be served from it."""
        r, self._pending_global = self._pending_global, None
        if r is None:
            return
        with self.blocking():
            due = self.global_due(r)
            buf = io.BytesIO()
            torch.save({"round": r, "state": self.state_dict()}, buf)
            payload = buf.getvalue()
            with self._cache_lock:
                self._cached = None if due else (r, payload)
            if due:
                self.persist(lambda: self._write_global(r, payload))
            else:
                self.persist(lambda: self._collect_garbage(r))

    def global_due(self, r: int) -> bool:
        """Whether round r's global state is written (by its lowest participant)."""
        k = self.checkpoint_every
        if k == 1 or (r + 1) % k == 0:
            return True
        if self.final_round is not None and r >= self.final_round:
            return True
        try:
            return bool(self._heal_requests())
        except (StoreError, OSError) as e:  # the next round's exchange will say more
            log.warning("could not look for heal requests after round %d: %s", r, e)
            return False

    def _heal_requests(self) -> dict[str, int]:
        """Pending requests: ``heal/<rank>.json`` -> the global round that replica needs."""
        out = {}
        for name in self.store.list("heal"):
            try:
                out[name] = int(self.store.get_json(f"heal/{name}")["target"])
            except (ObjectNotFound, ValueError, KeyError, TypeError):
                continue
        return out

    def _serve_heal_requests(self) -> None:
        """Called while the exchange waits for late replicas: if one asked for a global state
        and this replica holds the newest one unwritten, write it now (the asker is not in
        this round: without it, the round would wait for it until the deadline)."""
        with self._cache_lock:
            cached = self._cached
            if cached is None:
                return
            try:
                wanted = self._heal_requests()
            except (StoreError, OSError) as e:
                log.debug("could not list heal requests: %s", e)
                return
            if not any(t <= cached[0] for t in wanted.values()):
                return
            self._cached = None
        try:
            self._write_global(*cached)
            log.info("wrote global/%d for a replica that is healing", cached[0])
        except (StoreError, OSError) as e:
            log.warning("could not write global/%d for a healing replica: %s", cached[0], e)

    def _write_global(self, r: int, payload: bytes) -> None:
        meta = {"round": r, "run_id": self.exchange.config.run_id, "layout": self.state_layout}
        blob = encode_blob(payload, meta)
        self._bad_globals.discard(r)  # replaced by this one
        self.store.put(GLOBAL_STATE.format(r=r), blob)
        self.ckpt_bytes_up += len(blob)
        if self.checkpoint_every > 1:
            for name, target in self._heal_requests().items():
                if target <= r:  # served: the asker loads global/<r> or newer
                    with contextlib.suppress(ObjectNotFound):
                        self.store.delete(f"heal/{name}")
        self._collect_garbage(r)

    def _collect_garbage(self, r: int) -> None:
        self.exchange.collect_garbage(r)
        self._gc_globals(r)

    def _gc_globals(self, r: int) -> None:
        """Keep the globals of the last ``keep_rounds`` checkpoint periods (a corrupt newest
        one falls back to an older one on resume)."""
        horizon = r - self.exchange.config.keep_rounds * self.checkpoint_every
        names = [n for n in self.store.list("global") if n.isdigit()]
        newest = max((int(n) for n in names), default=None)
        for name in names:
            if int(name) <= horizon and int(name) != newest:
                self.store.delete(f"global/{name}")

    def latest_global(self) -> int | None:
        """The newest global round in the store, but one whose state was refused."""
        rounds = [
            int(n)
            for n in self.store.list("global")
            if n.isdigit() and int(n) not in self._bad_globals
        ]
        return max(rounds) if rounds else None

    def load_global(self, r: int) -> None:
        """Load ``global/<r>``. It must be this run's state of round r, of this model's
        layout (its header says so, under its checksum): one that is corrupt, from another
        run, copied from another round or of another layout raises CorruptObjectError, is
        reported in ``rejected`` and is never considered again (``latest_global`` skips it),
        so the caller falls back as for a missing one."""
        key = GLOBAL_STATE.format(r=r)
        data = self.store.get(key)
        self.ckpt_bytes_down += len(data)
        try:
            payload, meta = decode_blob(data, where=f"{self.store.uri}/{key}")
            expect = {"run_id": self.exchange.config.run_id, "round": r}
            if self.state_layout is not None:
                expect["layout"] = self.state_layout
            bad = {k: meta.get(k) for k, v in expect.items() if meta.get(k) != v}
            if bad:
                raise CorruptObjectError(f"{key}: not this run's global state of round {r} ({bad})")
            ckpt = torch.load(io.BytesIO(payload), weights_only=True)
            if not isinstance(ckpt, dict) or ckpt.get("round") != r:
                raise CorruptObjectError(f"{key}: its state is not of round {r}")
        except CorruptObjectError as e:
            log.warning("rejected %s", e)
            self._bad_globals.add(r)
            self.rejected.append(str(e))
            raise
        self.load_state_dict(ckpt["state"])
        if self.on_loaded is not None:
            self.on_loaded(ckpt["state"])
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
            return self.exchange.round_failed(r)

        def newest() -> int:
            latest = self.latest_global()
            return -1 if latest is None else latest

        res = self.last_result
        if res is not None and res.stale_behind is not None:
            target = res.stale_behind
        elif self.exchange.was_committed(r):
            target = r
        else:
            # nobody committed round r (so far). If a quorum forms later without us, our
            # contribution's base round (in its name) marks us stale in the next round and
            # we heal then.
            return False
        if target <= self.base_round:
            return False
        asked = self.checkpoint_every > 1 and newest() < target
        if asked:  # global/ is written only every few rounds: ask for one
            body = {"rank": self.rank, "target": target, "round": r, "at": time.time()}
            self.store.put_json(f"heal/{self.rank}.json", body)
        try:
            return self._heal_from_global(r, target, failed, newest)
        finally:
            if asked:
                with contextlib.suppress(StoreError, OSError):
                    self.store.delete(f"heal/{self.rank}.json")

    def _heal_from_global(
        self, r: int, target: int, failed: Callable[[], bool], newest: Callable[[], int]
    ) -> bool:
        def there() -> bool:
            self._keepalive()  # heartbeats go on while it waits
            return newest() >= target or (target == r and failed())

        deadline = time.monotonic() + self.heal_timeout_s
        while True:
            ok = wait_until(
                there,
                max(0.0, deadline - time.monotonic()),
                poll_s=0.05,
                max_poll_s=0.5,
            )
            if not ok:
                refused = sorted(g for g in self._bad_globals if g >= target)
                raise HealError(
                    f"the other replicas are at global round {target} but no "
                    f"{'usable ' if refused else ''}global/<{target} or later> appeared within "
                    f"{self.heal_timeout_s:.0f}s (did its writer die?"
                    + "".join(f"; global/{g} refused" for g in refused)
                    + "); restart this replica to resume from the newest global state"
                )
            if newest() < target:  # round r failed after all
                return False
            try:
                self.load_global(newest())
                log.info("healed from global/%d", self.last_healed_from)
                return True
            except ObjectNotFound:
                # listed before its object landed (a folder store), or collected since the
                # listing: look again
                pass
            except CorruptObjectError:
                pass  # refused and reported: wait for a usable one, as for a missing one
            if time.monotonic() >= deadline:
                raise HealError(
                    f"could not read a global state at or after round {target} within "
                    f"{self.heal_timeout_s:.0f}s"
                )
            time.sleep(0.05)
