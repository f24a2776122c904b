"""The exchange's requests to the store: reads and writes that count their bytes into the
round's result, and the thread pools they run in (transfers apart from control requests)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from crf.exchange import codecs as wirefmt
from crf.exchange.config import ExchangeConfig, ExchangeHooks
from crf.exchange.contribution import Arrival
from crf.exchange.phases import PhaseClock
from crf.exchange.round import AllReduceResult, _Early
from crf.store import ObjectNotFound, RunStore

#: above this many reduced shards still missing, a poll lists the round's ``reduced/`` once
#: and downloads only what is there, rather than asking for each missing shard (a request
#: per shard per poll: with N = 64 most of a replica's requests were such misses;
#: docs/performance.md, "Scaling to 64 replicas")
_LIST_ABOVE = 4


class ExchangeState:
    """The state one exchange's steps share: set up by
    :class:`~crf.exchange.allreduce.ObjectStoreAllReduce`, which combines the steps (the
    mixins of :mod:`crf.exchange.upload`, :mod:`crf.exchange.membership`, ...) into one
    object, so each step reads like its part of the protocol and tests can still replace
    one step of one replica."""

    store: RunStore
    world_size: int
    rank: int
    config: ExchangeConfig
    hooks: ExchangeHooks
    wire: str  # the coordinator's property
    _wire: str
    _decay: float
    _sparse: bool
    _two_level: bool
    _residual: dict[int | None, torch.Tensor]
    next_round: int
    #: contributions listed in a round (complete: each is one atomic PUT), by rank
    _present: dict[int, dict[int, Arrival]]
    _buffers: dict[tuple[str, int], torch.Tensor]
    _executor: ThreadPoolExecutor | None
    _control_executor: ThreadPoolExecutor | None
    _early: _Early | None
    alive_window_s: float
    _members: dict[int, frozenset[int] | None]
    _count_lock: threading.Lock
    history: list[AllReduceResult]
    _segments: dict[str, list[list[int]]]
    #: the running round's clock (None between rounds)
    _clock: PhaseClock | None


class Transfers(ExchangeState):
    """Store requests of a round, counted, and the pools they run in."""

    def _phase(self, phase: str) -> None:
        if self.hooks.on_phase is not None:
            self.hooks.on_phase(phase)

    def _timed(self, phase: str) -> AbstractContextManager[None]:
        """Count the block's time as ``phase`` of the running round (its own thread only)."""
        return nullcontext() if self._clock is None else self._clock.phase(phase)

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """An fp32 work buffer of ``numel`` values, kept for the next round of that size."""
        buf = self._buffers.get((name, numel))
        if buf is None:
            buf = self._buffers[(name, numel)] = torch.empty(numel, dtype=torch.float32)
        return buf

    def _put(self, res: AllReduceResult, key: str, data: Any, *, exclusive: bool = False) -> bool:
        """Publish bytes or a list of buffers (``encode_tensor_parts``), counting them."""
        n = sum(memoryview(d).nbytes for d in data) if isinstance(data, list) else len(data)
        with self._count_lock:
            res.bytes_up += n
        # a round's objects are transient and checksummed end to end: no fsync (file://).
        # A crash loses the round anyway; resumption reads global/ and inner/, kept durable.
        with self._timed("upload"):
            if exclusive:
                return self.store.put_if_absent(key, data, durable=False)
            self.store.put(key, data, durable=False)
        return True

    def _get(self, res: AllReduceResult, key: str, size_hint: int | None = None) -> bytes:
        data = self.store.get(key, size_hint=size_hint)
        with self._count_lock:
            res.bytes_down += len(data)
        return data

    def _get_range(self, res: AllReduceResult, key: str, start: int, end: int) -> bytes:
        data = self.store.get_range(key, start, end)
        with self._count_lock:
            res.bytes_down += len(data)
        return data

    def _get_if_there(
        self, res: AllReduceResult, key: str, size_hint: int | None = None
    ) -> bytes | None:
        try:
            return self._get(res, key, size_hint)
        except ObjectNotFound:
            return None

    def _fetch_there(
        self, res: AllReduceResult, folder: str, keys: dict[int, tuple[str, int]]
    ) -> dict[int, bytes]:
        """One pass over numbered objects not seen yet (``keys``: number -> key and size
        hint, all in ``folder``): those that are there, downloaded in parallel, in the
        order of ``keys``. With many missing, one listing of ``folder`` says which are there
        (:data:`_LIST_ABOVE`) instead of a GET each."""
        wanted = list(keys)
        if len(wanted) > _LIST_ABOVE:
            there = set(self.store.list(folder))
            wanted = [k for k in wanted if str(k) in there]
        fetches = [(k, self._pool().submit(self._get_if_there, res, *keys[k])) for k in wanted]
        return {k: data for k, f in fetches if (data := f.result()) is not None}

    def _control(self) -> ThreadPoolExecutor:
        """Threads for small control requests (the quorum, manifests, listings) that run
        next to each other: kept apart from the transfer threads so that a poll never
        queues behind a download."""
        if self._control_executor is None:
            self._control_executor = ThreadPoolExecutor(4, thread_name_prefix="crf-control")
        return self._control_executor

    def _pool(self) -> ThreadPoolExecutor:
        """Threads for a round's independent transfers (shard parts, reduced shards)."""
        if self._executor is None:
            # two levels: a member reads G - 1 parts, a leader M partials, whatever G is
            shards = self.world_size if self.config.reduce_group_size else self.config.num_shards
            workers = max(1, min(self.config.max_transfers, shards))
            self._executor = ThreadPoolExecutor(workers, thread_name_prefix="crf-transfer")
        return self._executor

    def _shard_segments(
        self, lhash: str, sizes: list[int], bounds: list[tuple[int, int]]
    ) -> list[list[int]]:
        """The tensors' pieces in each shard (kept by layout hash: the reduce and gather
        steps of a round, which know only the hash, cut int8 blocks along them too)."""
        segs = self._segments.get(lhash)
        if segs is None:
            if len(self._segments) >= 16:  # fragments of one model: a handful of layouts
                self._segments.clear()
            segs = self._segments[lhash] = wirefmt.shard_segments(sizes, bounds)
        return segs

    def _meta(self, r: int, s: int, lhash: str, total: int) -> dict[str, Any]:
        return {
            "run_id": self.config.run_id,
            "round": r,
            "rank": self.rank,
            "shard": s,
            "layout_hash": lhash,
            "numel_total": total,
            "wire": self.wire,
        }
