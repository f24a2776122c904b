"""Checkpoints: the global states a run's replicas heal and resume from, the heal requests that
ask for one, and each replica's own inner state.

The manager (:class:`~crf.exchange.manager.ObjectStoreManager`) decides *when* (a round was
committed, a replica missed one, a replica restarts); this module knows *what* lies in the run
folder and how it is checked:

* ``global/<r>/part-<s>-of-<n>.safetensors``: the weights and outer-optimizer state after
  exchange round ``r``, in ``n`` parts, one per participant: the s-th, the owner of shard s,
  copies and writes part s (about 1/n of the state's bytes, whole tensors:
  :func:`~crf.exchange.global_state.part_names`), so no replica writes the whole state.
  Written every ``checkpoint_every`` outer rounds (after the last fragment's sync), at the
  last round and on request; safetensors files users can open (format:
  :mod:`crf.exchange.global_state`). A state is read only whole (every part; an older
  run's single ``state.safetensors`` too): a round with a part missing is not a state.
  Each part's metadata names the run, the round, the part and the model's layout under a
  digest; one that is corrupt or from elsewhere is refused, reported, and its round never
  considered again. Kept: the newest checkpoint a whole-run resume can start from and
  what is newer (:meth:`Checkpoints.keep_from`).
* ``heal/<rank>.json``: a replica that missed a committed round and finds no global state new
  enough asks for one; the participants that hold the newest state unwritten write their
  parts.
* ``replicas/<rank>/inner/<r>.pt``: a replica's inner-optimizer state (with fragments, also its
  local weights; its random-number generators) after round ``r``, which a restarted replica loads
  beside ``global/<r>``: a ``torch.save`` pickle in crf's checked blob container (only crf reads
  it).

The training thread's part of a checkpoint is one copy into reused host buffers; the
serialization, checksum and upload run off it when asked (:class:`CheckpointWriter`), from
those buffers without copying them again (:mod:`crf.exchange.snapshots`). What an inner state
holds: :mod:`crf.exchange.inner_state`. The keys all come
from :mod:`crf.layout`. Why it works this way: docs/design.md, "DiLoCo manager"; the keys:
docs/design.md, "The run folder".
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

import torch

from crf import layout
from crf.exchange import global_state
from crf.exchange.snapshots import HostBuffers, reserve_tree, snapshot_tree, torch_save_parts
from crf.faults import maybe_fault
from crf.store import CorruptObjectError, ObjectNotFound, StoreError
from crf.store.codec import decode_blob, encode_blob_parts
from crf.store.run_store import wait_until

if TYPE_CHECKING:
    from crf.exchange.allreduce import ObjectStoreAllReduce

log = logging.getLogger(__name__)


class HealError(RuntimeError):
    """A replica that missed a committed round could not load a global state to catch up."""


class CheckpointWriter:
    """Checkpoint writes, now or (``background``) in one writer thread, in order: the caller
    copies the state at once (the weights change with the next inner step); the encode and
    the upload run in the writer. A failed background write is handed to ``on_failure`` at the
    next :meth:`check` or :meth:`wait_for` (the manager raises it at the next sync) and raised
    by :meth:`drain`."""

    def __init__(self, background: bool, on_failure: Callable[[BaseException], None]) -> None:
        self.background = background
        self.seconds = 0.0  # background writes, start to finish, over the run
        self._on_failure = on_failure
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        #: a lane of its own for round records (:meth:`submit_record`), and the last one
        self._records: ThreadPoolExecutor | None = None
        self._last_record: Future | None = None

    def submit(self, write: Callable[[], None]) -> Future | None:
        """Run ``write`` now, or queue it (returns its future) with a background writer. It
        runs after the round records submitted before it have landed, and fails if one
        failed (an inner state never lands without its round's record)."""
        record = self._last_record
        if record is not None and (not record.done() or record.exception() is not None):
            write = _after(record, write)
        return self._queue(write, records=False)

    def submit_record(self, write: Callable[[], None]) -> Future | None:
        """Run a small write (a round's record) now, or queue it on a lane of its own, so
        it lands in milliseconds instead of behind the state writes queued before it (a
        global state is gigabytes); the writes submitted after it wait for it."""
        future = self._queue(write, records=True)
        self._last_record = future
        return future

    def records_landed(self) -> None:
        """Wait until the last round record submitted has landed (or failed: its error goes
        to ``on_failure`` at the next :meth:`check`). The next round's exchange publishes only
        after it, so a replica killed in that round has its record of the round before."""
        record = self._last_record
        if record is not None:
            futures_wait([record])

    def _queue(self, write: Callable[[], None], records: bool) -> Future | None:
        if not self.background:
            write()
            return None
        self.check()
        if records:
            if self._records is None:
                self._records = ThreadPoolExecutor(1, thread_name_prefix="crf-record")
            future = self._records.submit(write)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="crf-ckpt")
            future = self._pool.submit(self._timed, write)
        self._pending.append(future)
        return future

    def _timed(self, write: Callable[[], None]) -> None:
        t0 = time.monotonic()
        try:
            write()
        finally:
            self.seconds += time.monotonic() - t0

    def check(self) -> None:
        """Hand the errors of finished writes to ``on_failure``; forget the finished ones."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            e = f.exception()
            if e is not None:
                self._on_failure(e)

    def wait_for(self, write: Future | None) -> None:
        """Back-pressure: wait for ``write`` (a :meth:`submit`'s future: the writes before
        it are done too, they run in order), then hand failures to ``on_failure``."""
        if write is not None:
            futures_wait([write])
        self.check()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for pending writes; raise the first that failed."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result(timeout=timeout_s)

    def close(self) -> None:
        """Wait for pending writes (raising the first that failed), then stop the threads."""
        try:
            self.drain()
        finally:
            for pool in (self._pool, self._records):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._pool = self._records = None
            self._last_record = None


def _after(first: Future, write: Callable[[], None]) -> Callable[[], None]:
    """``write``, run once ``first`` is done; not at all if ``first`` failed (its error is
    raised: the write depended on it)."""

    def run() -> None:
        first.result()
        write()

    return run


def read_global_state(store: Any, r: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, header) of ``global/<r>`` in ``store`` (a :class:`~crf.store.RunStore`), its
    parts joined, each checked against its digest but not against a run: for tools and
    tests that read a run's checkpoint. ObjectNotFound when the state is not whole."""
    keys = layout.global_parts(store, r)
    if not keys:
        raise ObjectNotFound(f"{store.uri}/{layout.global_dir(r)} holds no whole state")
    files = [global_state.decode_part(store.get(k), where=f"{store.uri}/{k}") for k in keys]
    return global_state.join(files, where=f"{store.uri}/{layout.global_dir(r)}")


def _rejection(key: str, error: CorruptObjectError, where: str | None = None) -> layout.Rejection:
    """The record of a refused object: its bare run-folder ``key`` and why. The error's text
    starts with where the object was read (the key, or the store URI and key), which the
    record already names."""
    reason = str(error)
    for prefix in (where, key):
        if prefix and reason.startswith(f"{prefix}: "):
            reason = reason[len(prefix) + 2 :]
            break
    return layout.Rejection(key=key, reason=reason)


class Checkpoints:
    """One replica's side of the run's checkpoints (see the module docstring). It reads the
    run id, ``keep_rounds`` and ``checkpoint_every`` from the exchange's config and asks the
    exchange whether a round was committed or failed; ``keepalive`` is called while it waits
    for a global state, ``on_reject`` with every object it refuses."""

    def __init__(
        self,
        exchange: ObjectStoreAllReduce,
        writer: CheckpointWriter,
        *,
        heal_timeout_s: float | None = None,
        keepalive: Callable[[], None] = lambda: None,
        on_reject: Callable[[layout.Rejection], None] = lambda rejection: None,
    ) -> None:
        config = exchange.config
        self.exchange = exchange
        self.store = exchange.store
        self.writer = writer
        #: global/<r> is written every this many rounds, at ``final_round`` and on request
        self.checkpoint_every = config.checkpoint_every
        #: exchange rounds per outer round: ``checkpoint_every`` counts outer rounds
        self.fragments = config.fragments
        self.final_round: int | None = None
        #: how long a healing replica waits for a global state new enough
        self.heal_timeout_s = (
            heal_timeout_s
            if heal_timeout_s is not None
            else config.round_timeout_s + 2 * config.shard_grace_s
        )
        #: a digest of the model's tensors: states carry it, and one of another layout is
        #: refused
        self.layout: str | None = None
        self.bytes_up = 0  # global states written
        self.bytes_down = 0  # global states read (healing, resuming)
        self.inner_bytes_up = 0  # this replica's inner states written
        #: the training thread's part of the checkpoints, global and inner: waiting for the
        #: previous write from the buffers (back-pressure) and copying into them
        self.foreground_s = 0.0
        #: the part of it spent waiting for the previous write (the writer is slower than
        #: the rounds: the disk or the store's bandwidth, not the copy)
        self.wait_s = 0.0
        self._keepalive = keepalive
        self._reject = on_reject
        #: global rounds whose state was refused (foreign, stale copy, corrupt): never
        #: loaded again, as if they were not there
        self._bad: set[int] = set()
        #: a round whose global state this replica writes a part of: (round, part, parts)
        self._owed: tuple[int, int, int] | None = None
        # this replica's part of the newest global state not written (period > 1): served
        # on request, as (round, part, parts, payload)
        self._cached: tuple[int, int, int, global_state.FlatState] | None = None
        #: the last global snapshot's write: the next snapshot waits for it (one held at most)
        self._writing: Future | None = None
        self._cache_lock = threading.Lock()
        #: where the global and the inner states are copied at a sync (snapshots.py)
        self._global_buffers = HostBuffers()
        self._inner_buffers = HostBuffers()
        #: the last inner state's write: the next snapshot into the buffers waits for it
        self._inner_writing: Future | None = None
        # inner states copied at a sync, held until the round's record is queued
        self._held: list[Callable[[], None]] = []

    @property
    def rank(self) -> int:
        return self.exchange.rank

    @property
    def period(self) -> int:
        """Exchange rounds from one periodic checkpoint to the next: ``checkpoint_every``
        outer rounds, each ``fragments`` exchange rounds (the last fragment's sync ends
        one)."""
        return self.checkpoint_every * self.fragments

    # ------------------------------------------------------------------ writing global/<r>
    def owe(self, r: int, part: int = 0, parts: int = 1) -> None:
        """This replica took part in round ``r`` as its ``part``-th participant of ``parts``
        (the owner of shard ``part``): it writes that part of ``global/<r>`` (when due)
        after the outer step (:meth:`snapshot`)."""
        self._owed = (r, part, parts)

    def take_owed(self) -> tuple[int, int, int] | None:
        owed, self._owed = self._owed, None
        return owed

    def forget_cached(self) -> None:
        """Another replica holds the newest global state now: nothing to serve."""
        with self._cache_lock:
            self._cached = None

    def snapshot(self, r: int, state: dict[str, Any], part: int = 0, parts: int = 1) -> None:
        """This replica's ``part`` of ``parts`` of round ``r``'s global ``state``
        (:func:`~crf.exchange.global_state.part_names`), copied now: written when due (in the
        background with a background writer), else kept in memory so a heal request can
        still be served from it; either way the first part's writer collects the store's
        old rounds."""
        due = self.due(r)
        t0 = time.monotonic()
        keep = global_state.part_names(state, part, parts) if parts > 1 else None
        with self._global_buffers.lock:  # a cached state may be being served (a heal)
            payload = global_state.flatten(state, self._global_buffers, keep)
            with self._cache_lock:
                self._cached = None if due else (r, part, parts, payload)
        self.foreground_s += time.monotonic() - t0
        if due:
            self._writing = self.writer.submit(lambda: self.write_global(r, payload, part, parts))
        elif part == 0:
            self.writer.submit(lambda: self.collect_garbage(r))

    def reserve_global(self, state: dict[str, Any], part: int = 0, parts: int = 1) -> int:
        """Allocate the host buffers this replica's ``part`` of ``parts`` of a global
        ``state`` is copied into at a snapshot, before the first one (the part it writes
        when every replica takes part); returns the bytes allocated."""
        keep = global_state.part_names(state, part, parts) if parts > 1 else None
        with self._global_buffers.lock:
            return global_state.reserve(state, self._global_buffers, keep)

    def reserve_inner(self, state: Any) -> int:
        """Allocate the host buffers an inner ``state`` is copied into, before the first
        snapshot of it; returns the bytes allocated."""
        return reserve_tree(state, self._inner_buffers)

    def wait_previous(self) -> None:
        """Back-pressure before a new snapshot: wait for the previous global write (and the
        writes queued before it); a failed one goes to the writer's ``on_failure``."""
        self._writing, previous = None, self._writing
        t0 = time.monotonic()
        self.writer.wait_for(previous)
        self.wait_s += time.monotonic() - t0
        self.foreground_s += time.monotonic() - t0

    def due(self, r: int) -> bool:
        """Whether exchange round r's global state is written (by its lowest participant):
        at the end of every ``checkpoint_every``-th outer round, at the last round, and when
        a replica asked for one."""
        if (r + 1) % self.period == 0:
            return True
        if self.final_round is not None and r >= self.final_round:
            return True
        try:
            return bool(self.heal_requests())
        except (StoreError, OSError) as e:  # the next round's exchange will say more
            log.warning("could not look for heal requests after round %d: %s", r, e)
            return False

    def write_global(
        self, r: int, payload: global_state.FlatState, part: int = 0, parts: int = 1
    ) -> None:
        """Write part ``part`` of ``parts`` of ``global/<r>`` (``payload`` as :meth:`snapshot`
        takes it apart: one safetensors object, its metadata naming the run, the round, the
        part and the model's layout under a digest); once the state is whole, remove the
        heal requests it serves. The first part's writer then collects old rounds."""
        meta = {
            "round": r,
            "run_id": self.exchange.config.run_id,
            "layout": self.layout,
            "part": part,
            "parts": parts,
        }
        data = global_state.encode_parts(payload, meta)
        self._bad.discard(r)  # replaced by this one
        self.store.put(layout.global_part_key(r, part, parts), data)
        self.bytes_up += sum(memoryview(p).nbytes for p in data)
        if self.period > 1 and layout.global_complete(self.store, r):
            for rank, target in self.heal_requests().items():
                if target <= r:  # served: the asker loads global/<r> or newer
                    with contextlib.suppress(ObjectNotFound):
                        self.store.delete(layout.heal_key(rank))
        if part == 0:
            self.collect_garbage(r)

    def keep_from(self, r: int) -> int | None:
        """The oldest checkpoint round kept after round ``r``: the newest one a whole-run
        resume can start from as if nothing had stopped - its global state whole and, if
        any replica saves inner states, every replica's of that round (the resume's own
        rule, ``crf.launcher.resume.resume_point``). Older ones are never read again. If
        there is none within ``keep_rounds`` checkpoint periods (a replica stopped saving:
        it is gone), the newest whole global state, which such a resume starts from. None:
        no whole global state yet. The window is at least two periods: with ``keep_rounds``
        1, the checkpoint before round ``r`` stays while r's inner states are on their way
        (they land after its global state), so a kill in between still resumes exactly."""
        whole = layout.global_rounds(self.store, complete=True)
        inner = [set(layout.inner_rounds(self.store, k)) for k in range(self.exchange.world_size)]
        horizon = r - max(2, self.exchange.config.keep_rounds) * self.period
        for g in reversed(whole):
            if g <= horizon:
                break
            if not any(inner) or all(g in rounds for rounds in inner):
                return g
        return whole[-1] if whole else None

    def collect_garbage(self, r: int) -> None:
        """The exchange's old rounds, then every global state older than the oldest one
        kept (:meth:`keep_from`): what a resume needs - the newest checkpoint it can start
        from, and the ones being written after it - and nothing more (docs/design.md, "What
        a checkpoint costs")."""
        self.exchange.collect_garbage(r)
        keep_from = self.keep_from(r)
        if keep_from is None:
            return
        for g in layout.global_rounds(self.store):
            if g < keep_from:
                self.store.delete(layout.global_dir(g))

    # ------------------------------------------------------------------ heal requests
    def heal_requests(self) -> dict[int, int]:
        """Pending requests: the asker's rank -> the global round it needs."""
        out = {}
        for rank in layout.heal_requests(self.store):
            try:
                out[rank] = int(self.store.get_json(layout.heal_key(rank))["target"])
            except (ObjectNotFound, ValueError, KeyError, TypeError):
                continue  # withdrawn since the listing, or not a request
        return out

    def serve_heal_requests(self) -> None:
        """Called while the exchange waits for late replicas: if one asked for a global state
        and this replica holds the newest one unwritten, write it now (the asker is not in
        this round: without it, the round would wait for it until the deadline)."""
        # the buffers stay locked until written: the next snapshot overwrites them
        with self._global_buffers.lock:
            with self._cache_lock:
                cached = self._cached
                if cached is None:
                    return
                try:
                    wanted = self.heal_requests()
                except (StoreError, OSError) as e:
                    log.debug("could not list heal requests: %s", e)
                    return
                if not any(t <= cached[0] for t in wanted.values()):
                    return
                self._cached = None
            r, part, parts, payload = cached
            try:
                self.write_global(r, payload, part, parts)
                log.info("wrote part %d of global/%d for a replica that is healing", part, r)
            except (StoreError, OSError) as e:
                log.warning("could not write global/%d for a healing replica: %s", cached[0], e)

    # ------------------------------------------------------------------ reading global/<r>
    def latest_global(self) -> int | None:
        """The newest whole global round in the store, but one whose state was refused."""
        rounds = layout.global_rounds(self.store, complete=True)
        rounds = [g for g in rounds if g not in self._bad]
        return max(rounds) if rounds else None

    def read_global(self, r: int) -> dict[str, Any]:
        """The state in ``global/<r>``: every part of it (or the one file an older run
        wrote); ObjectNotFound when a part is missing. Each part must be this run's part of
        round r, of this model's layout (its header says so, under its checksum), and the
        parts one state: one that is corrupt, from another run, copied from another round or
        of another layout raises CorruptObjectError, is reported (``on_reject``) and the round
        is never considered again (``latest_global`` skips it), so the caller falls back as
        for a missing one."""
        keys = layout.global_parts(self.store, r)
        if not keys:
            raise ObjectNotFound(f"{self.store.uri}/{layout.global_dir(r)} holds no whole state")
        files = []
        for key in keys:
            data = self.store.get(key)
            self.bytes_down += len(data)
            where = f"{self.store.uri}/{key}"
            try:
                files.append(self._check_part(r, key, data, where, len(keys)))
            except CorruptObjectError as e:
                self._refuse(r, key, e, where)
                raise
        where = f"{self.store.uri}/{layout.global_dir(r)}"
        try:
            state, _ = global_state.join(files, where=layout.global_dir(r))
            if not isinstance(state, dict):
                raise CorruptObjectError(f"{layout.global_dir(r)}: its state is not a dict")
        except CorruptObjectError as e:
            self._refuse(r, layout.global_dir(r), e, where)
            raise
        return state

    def _check_part(self, r: int, key: str, data: bytes, where: str, parts: int) -> Any:
        """One file of ``global/<r>``, checked: its digest, and that its header names this
        run, round r, this layout and (for a part) the part its key names."""
        part = global_state.decode_part(data, where=where)
        meta = part.header
        expect: dict[str, Any] = {"run_id": self.exchange.config.run_id, "round": r}
        if self.layout is not None:
            expect["layout"] = self.layout
        if key != layout.global_key(r):
            expect["parts"] = parts
            expect["part"] = next(
                s for s in range(parts) if layout.global_part_key(r, s, parts) == key
            )
        bad = {k: meta.get(k) for k, v in expect.items() if meta.get(k) != v}
        if bad:
            raise CorruptObjectError(f"{key}: not this run's global state of round {r} ({bad})")
        return part

    def _refuse(self, r: int, key: str, e: CorruptObjectError, where: str) -> None:
        log.warning("rejected %s", e)
        self._bad.add(r)
        self._reject(_rejection(key, e, where))

    def resume(self, load: Callable[[int], None], newest: int | None = None) -> int | None:
        """``load`` the newest usable global round (a corrupt or vanished one falls back to
        the one before it); returns that round, or None when there is none. ``newest``:
        start from that round instead (the newer ones are tried last)."""
        rounds = layout.global_rounds(self.store)
        if newest is not None:
            rounds = [r for r in rounds if r > newest] + [r for r in rounds if r <= newest]
        for r in reversed(rounds):
            try:
                load(r)
                return r
            except (ObjectNotFound, CorruptObjectError) as e:
                log.warning("cannot resume from global/%d (%s): trying an older one", r, e)
        return None

    # ------------------------------------------------------------------ healing
    def heal(
        self, r: int, base_round: int, stale_behind: int | None, load: Callable[[int], None]
    ) -> bool:
        """Catch up after missing round ``r``: ``load`` the newest global state if others moved
        on (they committed round r, or the exchange found this replica's weights, based on
        ``base_round``, older than theirs: ``stale_behind``). If nobody committed anything
        newer, the weights already are the newest global state and nothing is loaded. Never
        loads a global state older than what the others have: that would silently fork the
        weights, so it raises :class:`HealError` instead (the replica exits and a restart
        resumes it)."""
        if self.exchange.world_size == 1:
            return False
        if stale_behind is not None:
            target = stale_behind
        elif self.exchange.was_committed(r):
            target = r
        else:
            # nobody committed round r (so far). If a quorum forms later without us, our
            # contribution's base round (in its name) marks us stale in the next round and
            # we heal then.
            return False
        if target <= base_round:
            return False
        asked = self.period > 1 and self._newest() < target
        if asked:  # global/ is written only every few rounds: ask for one
            body = {"rank": self.rank, "target": target, "round": r, "at": time.time()}
            self.store.put_json(layout.heal_key(self.rank), body)
        try:
            return self._heal_from_global(r, target, load)
        finally:
            if asked:
                with contextlib.suppress(StoreError, OSError):
                    self.store.delete(layout.heal_key(self.rank))

    def _newest(self) -> int:
        latest = self.latest_global()
        return -1 if latest is None else latest

    def _heal_from_global(self, r: int, target: int, load: Callable[[int], None]) -> bool:
        """Wait for a usable global state at or after ``target`` and load it; False if round
        ``r`` failed after all (nothing to catch up with)."""

        def there() -> bool:
            self._keepalive()  # heartbeats go on while it waits
            return self._newest() >= target or (target == r and self.exchange.round_failed(r))

        deadline = time.monotonic() + self.heal_timeout_s
        while True:
            if not wait_until(
                there, max(0.0, deadline - time.monotonic()), poll_s=0.05, max_poll_s=0.5
            ):
                raise self._nothing_to_heal_from(target)
            newest = self._newest()
            if newest < target:  # round r failed after all
                return False
            try:
                load(newest)
                log.info("healed from global/%d", newest)
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

    def _nothing_to_heal_from(self, target: int) -> HealError:
        refused = sorted(g for g in self._bad if g >= target)
        return HealError(
            f"the other replicas are at global round {target} but no "
            f"{'usable ' if refused else ''}global/<{target} or later> appeared within "
            f"{self.heal_timeout_s:.0f}s (did its writer die?"
            + "".join(f"; global/{g} refused" for g in refused)
            + "); restart this replica to resume from the newest global state"
        )

    # ------------------------------------------------------------------ inner state
    def save_inner(self, r: int, state: Any, step: int) -> None:
        """Save this replica's inner ``state`` after round ``r`` (for restarts): copied now,
        written by the writer (:meth:`inner_write`)."""
        self.hold_inner(r, state, step)
        self.release_inner()

    def hold_inner(self, r: int, state: Any, step: int) -> None:
        """Copy this replica's inner ``state`` after round ``r`` now (the weights change
        with the next step), and hold its write until :meth:`release_inner`: the replica
        queues the round's record first, so a kill can never land a round's inner state
        without the record (a resume does not train that round again)."""
        self._held.append(self.inner_write(r, state, step))

    def release_inner(self) -> None:
        """Queue the held inner-state writes for the writer, in the order they were held."""
        held, self._held = self._held, []
        for write in held:
            self._inner_writing = self.writer.submit(write)

    def inner_write(self, r: int, state: Any, step: int) -> Callable[[], None]:
        """Copy this replica's inner ``state`` after round ``r`` into the inner buffers now
        (the training thread's only part: the previous write from them is waited for first),
        and return the write - serialization, checksum, upload - for the caller to submit to
        the writer when it is due (the replica queues its round record first). One object
        per round: a resume needs the state of exactly the newest global round, and
        global/<r> may be written after this replica already saved r + 1; those older than
        ``keep_rounds`` checkpoint periods are deleted."""
        if self._held:  # not written yet, and in the buffers this copy reuses
            self.release_inner()
        self._inner_writing, previous = None, self._inner_writing
        t0 = time.monotonic()
        self.writer.wait_for(previous)
        t1 = time.monotonic()
        snapshot = snapshot_tree(state, self._inner_buffers)
        self.wait_s += t1 - t0
        self.foreground_s += time.monotonic() - t0
        meta = {
            "round": r,
            "run_id": self.exchange.config.run_id,
            "rank": self.rank,
            "layout": self.layout,
            "step": step,
        }
        horizon = r - self.exchange.config.keep_rounds * self.period

        def write() -> None:
            maybe_fault("inner_write", self.rank, r, self.store)
            # the blob's XXH3 covers every byte: torch's own CRC-32 would be a second pass
            parts = encode_blob_parts(torch_save_parts(snapshot, crc32=False), meta)
            self.store.put(layout.inner_key(self.rank, r), parts)
            self.inner_bytes_up += sum(memoryview(p).nbytes for p in parts)
            # kept while their round's global state is (collect_garbage decides: an inner
            # state without it is never read); with no global state at all, the last
            # keep_rounds checkpoint periods
            kept = layout.global_rounds(self.store)
            for old in layout.inner_rounds(self.store, self.rank):
                if (old < kept[0]) if kept else (old <= horizon):
                    self.store.delete(layout.inner_key(self.rank, old))

        return write

    def load_inner(self, r: int) -> Any:
        """The inner state this replica saved after round ``r``. ObjectNotFound when there is
        none; CorruptObjectError (reported with ``on_reject``) when it is corrupt or not this
        replica's of round r in this run and model."""
        key = layout.inner_key(self.rank, r)
        try:
            payload, meta = decode_blob(self.store.get(key), where=key)
            expect = {
                "run_id": self.exchange.config.run_id,
                "round": r,
                "rank": self.rank,
                "layout": self.layout,
            }
            bad = {k: meta.get(k) for k, v in expect.items() if meta.get(k) != v}
            if bad:  # a copy from another run, round, replica or model: never loaded
                raise CorruptObjectError(
                    f"{key}: not this replica's inner state of round {r} ({bad})"
                )
            return torch.load(io.BytesIO(payload), weights_only=True)
        except CorruptObjectError as e:
            self._reject(_rejection(key, e))
            raise

    def close(self) -> None:
        """Wait for pending writes (raising the first that failed) and stop the writer."""
        self.writer.close()
