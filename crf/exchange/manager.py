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
Every participant writes its part of ``global/<r>`` (the s-th participant, shard s's owner,
part s) after the outer step (``after_outer_step``): the part is copied at once (the weights
change with the next inner step) and, with ``async_checkpoints``, serialized and uploaded by
a background writer so training does not wait for it;
``drain()`` waits for pending writes (a replica calls it before reporting its result). What
lies in ``global/``, ``heal/`` and a replica's ``inner/``, and how it is checked, is
:mod:`crf.exchange.checkpoints`; the manager decides when.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from crf import layout
from crf.exchange.allreduce import (
    AllReduceError,
    AllReduceResult,
    LayoutMismatchError,
    NonFiniteError,
    ObjectStoreAllReduce,
    RoundFailed,
)
from crf.exchange.checkpoints import Checkpoints, CheckpointWriter, HealError
from crf.exchange.config import ExchangeConfig, ExchangeHooks
from crf.exchange.snapshots import settle_device
from crf.store import CorruptObjectError, RunStore, StoreError

log = logging.getLogger(__name__)

#: how often ``on_blocked`` is called while the training thread waits (exchange, heal)
_KEEPALIVE_S = 1.0
#: the variable torchft's DiLoCo reads to put a sync's tensors in buckets (turned off here)
USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"

__all__ = [
    "HealError",
    "ManagerStats",
    "ObjectStoreManager",
    "UNRECOVERABLE_ERRORS",
    "restart_cannot_help",
    "turn_off_bucketization",
]


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


class _Part:
    """An attribute kept in one of the manager's parts (``stats``, ``checkpoints``), read and
    set under the name the manager has always had (``manager.bytes_up``,
    ``manager.final_round``)."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part = part
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)


@dataclass
class ManagerStats:
    """What a manager counts over the run: the replica's metrics and result read it."""

    rounds_committed: int = 0
    rounds_missed: list[int] = field(default_factory=list)
    rounds_caught_up: list[int] = field(default_factory=list)  # left out, took the average
    bytes_up: int = 0  # exchange traffic only (pseudo-gradients, quorum, reduced shards)
    bytes_down: int = 0
    #: objects left out or refused (exchange parts, global and inner states, failed rounds)
    rejected: list[layout.Rejection] = field(default_factory=list)
    blocked_s: float = 0.0  # the training thread blocked in the manager
    transfer_s: float = 0.0  # background exchanges, start to finish
    last_transfer_s: float = 0.0
    last_sync_s: float = 0.0  # the last sync's blocked time
    #: the training thread's part of the global checkpoints (part of ``blocked_s``): waiting
    #: for the previous write (back-pressure) and copying the state; encode and upload are not
    ckpt_foreground_s: float = 0.0
    #: DiLoCo's work at the last sync outside the manager (pseudo-gradients, restoring the
    #: global weights, the outer step, its global copy), as the replica timed it; part of
    #: ``blocked_s``. None: not timed
    last_outer_s: float | None = None


@dataclass
class _Sync:
    """One sync, from ``start_quorum()`` to ``should_commit()``: the queued tensors and the
    background exchange over them (one at a time: DiLoCo waits for a sync before the next)."""

    blocked_before: float = 0.0  # ``blocked_s`` when it started
    queue: list[torch.Tensor] = field(default_factory=list)
    launched: bool = False
    flushed: bool = False
    thread: threading.Thread | None = None
    outcome: tuple[AllReduceResult | None, BaseException | None] | None = None
    commit: bool = False


class ObjectStoreManager:
    """Duck-typed ``torchft.Manager`` for DiLoCo over an object store. Its counters are in
    ``stats`` (:class:`ManagerStats`), its global and inner states in ``checkpoints``
    (:class:`~crf.exchange.checkpoints.Checkpoints`); both are also read under the names
    below."""

    _use_async_quorum = False

    rounds_committed = _Part("stats")
    rounds_missed = _Part("stats")
    rounds_caught_up = _Part("stats")
    bytes_up = _Part("stats")
    bytes_down = _Part("stats")
    rejected = _Part("stats")
    blocked_s = _Part("stats")
    transfer_s = _Part("stats")
    last_transfer_s = _Part("stats")
    last_sync_s = _Part("stats")
    #: a digest of the model's tensors (set by ReplicaContext): global and inner states carry
    #: it and one of another layout is refused
    state_layout = _Part("checkpoints", "layout")
    #: the last round: its global state is always written
    final_round = _Part("checkpoints")
    heal_timeout_s = _Part("checkpoints")
    checkpoint_every = _Part("checkpoints")
    ckpt_bytes_up = _Part("checkpoints", "bytes_up")  # global checkpoints written
    ckpt_bytes_down = _Part("checkpoints", "bytes_down")  # and read, to heal or resume

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
        transfer's phase, so nothing is set on the exchange after it is built. With
        ``async_checkpoints`` checkpoint writes run off the training thread; with
        ``background`` the exchange does."""
        if config is not None and options:
            raise TypeError("pass either config= or its fields as keywords, not both")
        config = config or ExchangeConfig(**options)
        hooks = ExchangeHooks(
            on_phase=self._transfer_phase,
            on_wait=self._serve_heal_requests if config.checkpoint_period > 1 else None,
        )
        self.exchange = ObjectStoreAllReduce(store, world_size, rank, config, hooks)
        self.stats = ManagerStats()
        self.checkpoints = Checkpoints(
            self.exchange,
            CheckpointWriter(async_checkpoints, self._write_failed),
            heal_timeout_s=heal_timeout_s,
            keepalive=self._keepalive,
            on_reject=lambda rejection: self.stats.rejected.append(rejection),
        )
        self.on_phase = on_phase
        self.background = background
        self._step = 0
        self.base_round = -1  # the global round these weights start from (-1: initial)
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self._sync = _Sync()
        self._sizes: list[int] | None = None  # tensors per fragment (set_fragment_sizes)
        self._blocking_depth = 0
        #: the GPUs of the tensors exchanged (reserve_host_buffers), whose copies into host
        #: memory state_dict and load_state_dict wait for
        self._devices: set[torch.device] = set()
        self.last_result: AllReduceResult | None = None
        self.last_error: str | None = None
        self.fatal_error: Exception | None = None
        self.last_healed_from: int | None = None
        self.last_committed = False
        self.last_round: int | None = None  # the exchange round of the last sync
        self.transfer_phase: str | None = None  # what the background exchange is doing
        #: called (in the exchange's thread) when a round's exchange starts: tests and
        #: benchmarks see that the transfer began before anyone waited for it
        self.on_transfer_start: Callable[[int], None] | None = None
        #: called with the whole loaded state after load_global (e.g. to put every fragment's
        #: global copy back into the model)
        self.on_loaded: Callable[[dict[str, Any]], None] | None = None
        #: called about once a second while the training thread waits for an exchange or a
        #: global state to heal from: the replica's heartbeat goes on, so the others (which
        #: follow liveness) see a replica that is slow, not dead
        self.on_blocked: Callable[[], None] | None = None
        #: host buffers reserved on a GPU; the inner snapshots' are due after the first
        #: inner step (:meth:`reserve_inner_buffers`)
        self.inner_buffers_due = False

    @property
    def store(self) -> RunStore:
        return self.exchange.store

    @property
    def rank(self) -> int:
        return self.exchange.rank

    @property
    def ckpt_s(self) -> float:
        """Time the background checkpoint writes took."""
        return self.checkpoints.writer.seconds

    @property
    def async_checkpoints(self) -> bool:
        return self.checkpoints.writer.background

    @property
    def _thread(self) -> threading.Thread | None:
        """The running sync's exchange thread, if any (tests look at it)."""
        return self._sync.thread

    def fragment_of(self, r: int) -> int:
        """The fragment exchange round ``r`` syncs (0 without fragment sizes)."""
        return r % len(self._sizes) if self._sizes else 0

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
        if self._sync.queue and not self._sync.launched:
            with self.blocking():
                self._launch()

    def set_fragment_sizes(self, sizes: list[int]) -> None:
        """How many tensors DiLoCo allreduces for each fragment (fragment = round % len).
        With it the exchange starts the moment the fragment's last tensor is queued."""
        self._sizes = list(sizes) or None

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        if self._sync.launched and not self._sync.flushed:  # not waited for: finish it first
            self.flush()
        self._sync = _Sync(blocked_before=self.stats.blocked_s)
        self.last_result = None
        self.last_error = None

    def current_step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        """Used when resuming: the next round to exchange."""
        self._step = step

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _QueuedWork:
        sync = self._sync
        if sync.flushed or sync.launched:
            raise RuntimeError("allreduce() after the round's exchange ran: call start_quorum()")
        sync.queue.append(tensor)
        sizes = self._sizes
        if sizes is not None and len(sync.queue) == sizes[self.fragment_of(self._step)]:
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
        self.stats.last_sync_s = self.stats.blocked_s - self._sync.blocked_before
        return committed

    def _should_commit(self) -> bool:
        self.flush()
        self.checkpoints.writer.check()
        r = self._step
        self.last_round = r
        self.last_committed = self._sync.commit
        if self._sync.commit:
            self.stats.rounds_committed += 1
            self._step = r + 1
            self.base_round = r
            parts = sorted(self.last_result.participants if self.last_result else [self.rank])
            if self.rank in parts:
                # its part (shard owner's) written after the outer step (after_outer_step);
                # a run of one replica writes the whole state, as its resume needs it too
                self.checkpoints.owe(r, parts.index(self.rank), len(parts))
            else:
                self.checkpoints.forget_cached()  # the participants hold the newest state
            return True
        self.stats.rounds_missed.append(r)
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
                self.stats.blocked_s += time.monotonic() - t0

    def _transfer_phase(self, phase: str) -> None:
        self.transfer_phase = phase

    def _launch(self) -> None:
        """Start the round's exchange over the queued tensors (in the background)."""
        sync = self._sync
        sync.launched = True
        args = (sync, list(sync.queue), self._step, self.base_round)
        if not self.background:
            self._run_exchange(*args)
            return
        sync.thread = threading.Thread(
            target=self._run_exchange, args=args, name=f"crf-exchange-{self._step}"
        )
        sync.thread.daemon = True
        sync.thread.start()

    def _run_exchange(self, sync: _Sync, tensors: list[torch.Tensor], r: int, base: int) -> None:
        t0 = time.monotonic()
        try:
            self.checkpoints.writer.records_landed()  # the last round's record before this one
            if self.on_transfer_start is not None:
                self.on_transfer_start(r)
            res = self.exchange.allreduce(
                tensors, round=r, base_round=base, fragment=self.fragment_of(r)
            )
            sync.outcome = (res, None)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread in flush()
            sync.outcome = (None, e)
        finally:
            self.stats.last_transfer_s = time.monotonic() - t0
            self.stats.transfer_s += self.stats.last_transfer_s
            self.transfer_phase = None

    def flush(self) -> None:
        """Wait for the round's batched exchange (starting it if it has not started yet);
        errors become should_commit() == False."""
        if self._sync.flushed:
            return
        with self.blocking():
            self._flush()

    def _flush(self) -> None:
        sync = self._sync
        sync.flushed = True
        self._phase("syncing")
        try:
            res = self._wait_for_exchange(sync)
            self.last_result = res
            sync.commit = res.in_quorum or res.caught_up
            if res.caught_up:
                self.stats.rounds_caught_up.append(self._step)
            elif not res.in_quorum:
                self.last_error = f"not in the quorum of round {self._step}: {res.participants}"
            self._account(res)
        except LayoutMismatchError as e:
            self.fatal_error = e
            self.last_error = str(e)
            sync.commit = False
        except NonFiniteError as e:  # this replica's own numbers: fatal, never averaged
            log.error("%s", e)
            self.fatal_error = e
            self.last_error = f"{type(e).__name__}: {e}"
            sync.commit = False
        except (AllReduceError, StoreError, OSError, CorruptObjectError) as e:
            log.warning("round %d: exchange failed: %s", self._step, e)
            self.last_error = f"{type(e).__name__}: {e}"
            sync.commit = False
            partial = self.exchange.history[-1] if self.exchange.history else None
            if isinstance(e, RoundFailed):
                self.stats.rejected.append(e.rejection)
            if partial is not None and partial.round == self._step:
                self._account(partial)
        finally:
            sync.queue = []

    def _wait_for_exchange(self, sync: _Sync) -> AllReduceResult:
        """The sync's exchange result (starting it first if needed); raises its error."""
        if not sync.launched:
            self._launch()
        if sync.thread is not None:
            sync.thread.join(_KEEPALIVE_S)
            while sync.thread.is_alive():  # a long wait: the heartbeat goes on
                self._keepalive()
                sync.thread.join(_KEEPALIVE_S)
            sync.thread = None
        assert sync.outcome is not None
        res, err = sync.outcome
        if err is not None:
            raise err
        assert res is not None
        return res

    def _account(self, res: AllReduceResult) -> None:
        self.stats.bytes_up += res.bytes_up
        self.stats.bytes_down += res.bytes_down
        self.stats.rejected.extend(res.rejected)

    def _phase(self, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(phase)

    def _keepalive(self) -> None:
        if self.on_blocked is not None:
            try:
                self.on_blocked()
            # the replica's callback (its heartbeat): whatever it raises, a heartbeat never
            # ends a wait early
            except Exception as e:
                log.debug("keepalive failed: %s", e)

    # -------------------------------------------------------------- checkpoint writes
    def persist(self, write: Callable[[], None]) -> None:
        """Run a checkpoint write: in the background writer with ``async_checkpoints``
        (in order, one at a time), else now. A failed background write is raised as
        ``fatal_error`` at the next sync (and by ``drain``)."""
        self.checkpoints.writer.submit(write)

    def _write_failed(self, e: BaseException) -> None:
        if self.fatal_error is None:
            log.error("a checkpoint write failed: %s", e)
            self.fatal_error = e if isinstance(e, Exception) else RuntimeError(str(e))

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for pending background checkpoint writes; raise the first that failed."""
        self.checkpoints.writer.drain(timeout_s)

    def close(self) -> None:
        """Wait for a running exchange and pending writes, then stop the writer thread."""
        if self._sync.thread is not None:
            self._sync.thread.join()
            self._sync.thread = None
        self.exchange.close()
        self.checkpoints.close()

    def charge_outer(self, seconds: float) -> None:
        """Count ``seconds`` of DiLoCo's own work at a sync, outside this manager (the
        replica times it: the pseudo-gradients, restoring the global weights, the outer
        step, the copies of its global copy), as blocked time: it is the sync's, not
        training's."""
        seconds = max(0.0, seconds)
        self.stats.blocked_s += seconds
        self.stats.last_outer_s = seconds

    def reserve_host_buffers(self, rounds: list[list[torch.Tensor]]) -> int:
        """Before the first round: allocate the host buffers the rounds copy through (each
        of ``rounds``: the tensors one round exchanges, a fragment's pseudo-gradients, of its
        parameters' shapes) and those this replica's part of a global snapshot is copied
        into (the part it writes when every replica takes part). Page-locking on a GPU is
        slow; paid here, it is not a cost of the first round. Returns the bytes allocated;
        the time counts as blocked (crf's, not training's)."""
        self._devices = {t.device for ts in rounds for t in ts if t.is_cuda}
        with self.blocking():
            n = sum(self.exchange.reserve(ts) for ts in rounds)
            world = self.exchange.world_size
            part, parts = (self.rank, world) if world > 1 else (0, 1)
            n += self.checkpoints.reserve_global(self.state_dict(), part, parts)
        self.inner_buffers_due = True  # once the inner optimizer has made its state
        return n

    def reserve_inner_buffers(self, state: Any) -> int:
        """Allocate the host buffers an inner ``state`` is copied into at a snapshot, before
        the first (blocked time); returns the bytes allocated."""
        with self.blocking():
            return self.checkpoints.reserve_inner(state)

    # -------------------------------------------------------------- global state
    def state_dict(self) -> dict[str, Any]:
        """The global state: each registered part's. On a GPU the device's queued work is
        waited for first: DiLoCo copies its global copy to page-locked host memory
        asynchronously after the outer step, and the state's host tensors are read by the
        CPU, which does not wait for the device by itself."""
        settle_device(self._devices)
        return {key: save() for key, (_, save) in self._state_fns.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load each registered part's state. On a GPU the device's queued work is waited
        for first: a copy DiLoCo left in flight into its page-locked global copy (the one it
        makes when it starts) must not land over what is loaded."""
        settle_device(self._devices)
        for key, (load, _) in self._state_fns.items():
            if key in state:
                load(state[key])

    def after_outer_step(self) -> None:
        """Each of the round's participants writes its part of ``global/<r>`` when one is due
        (every ``checkpoint_every`` rounds, at ``final_round``, or a replica asked for one to
        heal); the first part's writer collects garbage. The part is copied now, into host
        buffers reused from round to round (the weights change with the next inner step: one
        copy, the only part on the training thread); the serialization, checksum and upload
        run in the background with async_checkpoints, one at a time: a write still running
        at the next snapshot is waited for (blocked time). A part not written is kept in
        memory so a heal request can still be served from it."""
        owed = self.checkpoints.take_owed()
        if owed is None:
            return
        r, part, parts = owed
        t0 = time.monotonic()
        with self.blocking():
            # back-pressure: the previous write first (at most one snapshot held; its
            # failure is this replica's fatal error, raised by the caller)
            self.checkpoints.wait_previous()
            if self.fatal_error is None:
                self.checkpoints.snapshot(r, self.state_dict(), part, parts)
        self.stats.ckpt_foreground_s += time.monotonic() - t0

    def global_due(self, r: int) -> bool:
        """Whether round r's global state is written (by its participants, in parts)."""
        return self.checkpoints.due(r)

    def _serve_heal_requests(self) -> None:
        """The exchange's ``on_wait`` hook: write a global state a healing replica asked for."""
        self.checkpoints.serve_heal_requests()

    def _write_global(self, r: int, payload: Any, part: int = 0, parts: int = 1) -> None:
        """Write part ``part`` of ``parts`` of ``global/<r>`` now (``payload``: a state as
        :func:`crf.exchange.global_state.flatten` takes it apart; tests forge a writer)."""
        self.checkpoints.write_global(r, payload, part, parts)

    def latest_global(self) -> int | None:
        """The newest global round in the store, but one whose state was refused."""
        return self.checkpoints.latest_global()

    def load_global(self, r: int) -> None:
        """Load ``global/<r>`` (checked: see :meth:`Checkpoints.read_global
        <crf.exchange.checkpoints.Checkpoints.read_global>`, which raises CorruptObjectError
        for one from elsewhere) into the registered state; these weights are then round r's."""
        state = self.checkpoints.read_global(r)
        self.load_state_dict(state)
        if self.on_loaded is not None:
            self.on_loaded(state)
        self.last_healed_from = r
        self.base_round = r
        self._step = r + 1

    def load_newest_global(self, newest: int | None = None) -> int | None:
        """Resume: load the newest usable global state (a corrupt or vanished one falls back
        to the one before it), or round ``newest`` when given; returns its round, or None
        when there is none."""
        return self.checkpoints.resume(self.load_global, newest)

    def heal(self, r: int) -> bool:
        """Catch up after missing round ``r`` (see :meth:`Checkpoints.heal
        <crf.exchange.checkpoints.Checkpoints.heal>`): load the newest global state if the
        others moved on; raises HealError rather than load one older than theirs."""
        res = self.last_result
        stale_behind = res.stale_behind if res is not None else None
        return self.checkpoints.heal(r, self.base_round, stale_behind, self.load_global)
