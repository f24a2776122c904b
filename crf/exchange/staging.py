"""Where a round's tensors live while the exchange works on them: host memory.

The wire, the fp32 sums and the checks all run on the CPU (docs/design.md, "Exchange"), so
tensors on an accelerator are copied to the host once per round and the average is copied
back once. Tensors already on the CPU are used as they are: no copy at all.

Why buffers kept per layout, pinned on CUDA: a round copies P bytes each way. Copying to new,
pageable memory every round pays for the allocation and its page faults each time, and a
pageable copy is staged by the driver through a pinned bounce buffer of its own (a second
copy, at a fraction of the bus speed). A page-locked buffer allocated once per layout (a
Streaming DiLoCo fragment has its own) and reused every round is the one copy the bus
allows, and it can run asynchronously.

Why one block per layout, reserved before training: PyTorch's page-locked allocator makes
each tensor an allocation of its own, pinned when made (and rounded up to a power of two
below a size threshold): for a model's few hundred tensors, a few hundred slow allocations.
A layout's buffers are therefore views into one page-locked block, and the replica reserves
the blocks of its fragments when it starts (:meth:`HostStaging.reserve`), so the first
round copies as fast as the later ones; a reservation no round uses is let go at the first
round.

Why in chunks, on a stream of its own: the copy is cut into chunks of :data:`CHUNK_BYTES`,
each followed by a CUDA event, so the upload step encodes and checksums shard 0 while the
later chunks are still crossing the bus (:meth:`Staged.wait_until`). The copy stream first
waits for the stream the caller computed the tensors on, so it never reads them half
written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

#: a device-to-host copy is issued in pieces of about this many bytes, one event each
CHUNK_BYTES = 64 << 20
#: layouts whose buffers are kept (fragments of one model: a handful)
_KEEP_LAYOUTS = 8
#: where each tensor's view starts in a layout's block: a multiple of this many bytes
ALIGN_BYTES = 64

Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


def layout_key(tensors: list[torch.Tensor]) -> Layout:
    """What a round's host buffers depend on: each tensor's shape, dtype and device."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def host_block(layout: Layout, pin: bool) -> list[torch.Tensor | None]:
    """Host buffers for ``layout``: views into one allocation (page-locked if ``pin``), each
    starting at a multiple of :data:`ALIGN_BYTES`; None for a tensor already on the CPU."""
    offsets, total = [], 0
    for shape, dtype, device in layout:
        if device.type == "cpu":
            offsets.append(None)
            continue
        offsets.append(total)
        n = math.prod(shape) * dtype.itemsize
        total += -(-n // ALIGN_BYTES) * ALIGN_BYTES
    if not total:
        return [None] * len(layout)
    block = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    out: list[torch.Tensor | None] = []
    for (shape, dtype, _), at in zip(layout, offsets, strict=True):
        if at is None:
            out.append(None)
            continue
        n = math.prod(shape) * dtype.itemsize
        out.append(block[at : at + n].view(dtype).view(shape))
    return out


@dataclass
class Staged:
    """One round's tensors in host memory: ``host[i]`` is ``tensors[i]`` itself on the CPU,
    else its reused host buffer, filled asynchronously (:meth:`wait_until` says when)."""

    tensors: list[torch.Tensor]
    host: list[torch.Tensor]
    #: (start of a chunk in the concatenated vector, its event), in copy order
    events: list[tuple[int, Any]] = field(default_factory=list)
    #: the copy stream of each GPU the tensors are on (one, unless a model spans GPUs)
    streams: dict[Any, Any] = field(default_factory=dict)

    @property
    def on_device(self) -> bool:
        return any(h is not t for h, t in zip(self.host, self.tensors, strict=True))

    def wait_until(self, end: int) -> None:
        """Block until values [0, end) of the tensors (read as one vector) are on the host."""
        while self.events and self.events[0][0] < end:
            self._wait_first()

    def _wait_first(self) -> None:
        self.events.pop(0)[1].synchronize()

    def finish(self) -> None:
        """Wait for every device-to-host copy still running."""
        while self.events:
            self._wait_first()

    def copy_back(self) -> None:
        """Write the host values (the round's average) back into the device tensors, and
        wait for that copy: the caller reads the tensors as soon as the round returns."""
        self.finish()
        if not self.on_device:
            return
        for t, h in zip(self.tensors, self.host, strict=True):
            if h is t:
                continue
            stream = self.streams.get(t.device)
            if stream is not None:
                with torch.cuda.stream(stream):
                    t.copy_(h, non_blocking=True)
            else:
                t.copy_(h)
        for stream in self.streams.values():
            stream.synchronize()


class HostStaging:
    """Host buffers for the exchange's device tensors, allocated once per layout and reused
    every round (page-locked when CUDA is available)."""

    def __init__(self) -> None:
        self._buffers: dict[Layout, list[torch.Tensor | None]] = {}
        self._streams: dict[torch.device, Any] = {}
        #: layouts reserved and not staged yet
        self._unused: set[Layout] = set()

    @property
    def nbytes(self) -> int:
        """Host memory the kept buffers hold."""
        return sum(
            b.numel() * b.element_size()
            for bs in self._buffers.values()
            for b in bs
            if b is not None
        )

    def reserve(self, tensors: list[torch.Tensor]) -> int:
        """Allocate the buffers a round of ``tensors`` (the same shapes, dtypes and devices)
        will use, before any round: the page-locking is paid here, at start-up, and not by
        the first round's copy. Returns the bytes allocated (0: nothing to copy, or done)."""
        key = layout_key(tensors)
        if key in self._buffers or all(d.type == "cpu" for _, _, d in key):
            return 0
        before = self.nbytes
        self._allocate(key)
        self._unused.add(key)
        return self.nbytes - before

    def stage(self, tensors: list[torch.Tensor]) -> Staged:
        """Start copying ``tensors`` to the host; CPU tensors are taken as they are."""
        if all(t.device.type == "cpu" for t in tensors):
            return Staged(tensors, list(tensors))
        host = self._host_buffers(tensors)
        staged = Staged(tensors, host)
        pos = 0
        for t, h in zip(tensors, host, strict=True):
            n = t.numel()
            if h is not t:
                self._copy_to_host(staged, t, h, pos)
            pos += n
        return staged

    def _host_buffers(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        key = layout_key(tensors)
        bufs = self._buffers.get(key)
        if bufs is None:
            # a reservation for another layout that no round has used will not be: let it go
            for unused in self._unused:
                self._buffers.pop(unused, None)
            self._unused.clear()
            bufs = self._allocate(key)
        self._unused.discard(key)
        # a CPU tensor is used itself
        return [t if b is None else b for t, b in zip(tensors, bufs, strict=True)]

    def _allocate(self, key: Layout) -> list[torch.Tensor | None]:
        if len(self._buffers) >= _KEEP_LAYOUTS:
            self._buffers.clear()
            self._unused.clear()
        bufs = self._buffers[key] = host_block(key, pin=torch.cuda.is_available())
        return bufs

    def _copy_to_host(self, staged: Staged, t: torch.Tensor, h: torch.Tensor, pos: int) -> None:
        """Copy device tensor ``t`` into host buffer ``h`` (at ``pos`` in the vector)."""
        src = t.detach()
        if t.device.type != "cuda" or not h.is_pinned():
            h.copy_(src)  # another accelerator: one synchronous copy
            return
        src_flat = src.reshape(-1) if src.is_contiguous() else src.contiguous().reshape(-1)
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        src_flat.record_stream(stream)  # a contiguous copy is not freed under the stream
        staged.streams[t.device] = stream
        dst_flat = h.view(-1)
        step = max(1, CHUNK_BYTES // max(1, t.element_size()))
        with torch.cuda.stream(stream):
            for a in range(0, t.numel(), step):
                b = min(t.numel(), a + step)
                dst_flat[a:b].copy_(src_flat[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                staged.events.append((pos + a, event))
