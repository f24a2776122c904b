"""Snapshots: what a checkpoint costs the training thread, and how the writer turns one into
bytes without copying it again.

At a sync the weights are about to change (the next inner step), so a checkpoint must copy
them before training goes on; everything else - serialization, hashing, upload - can wait for
the background writer. That copy is the training thread's whole share, so it is made as cheap
as a copy can be: into host buffers allocated once and reused every round
(:class:`HostBuffers`; page-locked when the tensors are on a GPU, so the device-to-host copy
runs at the bus's speed), with ``copy_`` (no allocation, no page faults after the first
round). A new snapshot reuses the buffers only once the previous write from them is done
(:class:`~crf.exchange.checkpoints.Checkpoints` waits for it).

The writer then serializes straight from those buffers, as parts: a small header, then the
buffers' own memory (:func:`torch_save_parts` for an inner state's ``torch.save`` pickle;
:func:`crf.exchange.global_state.encode_parts` for a global state's safetensors file), which
the store writes one after the other and the checksum reads in place. No ``BytesIO``, no
``getvalue``, no concatenation: the bytes are read once to hash them and once to write them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch


class HostBuffers:
    """Host copies of a checkpoint's tensors, one per name, allocated on first use (again
    only if a tensor's shape or dtype changes) and overwritten by every later snapshot.
    ``lock`` is held while the buffers are copied into, and by a write that may run beside
    the training thread (a global state served to a healing replica)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()
        #: the GPUs copies came from: :meth:`settle` waits for each
        self._devices: set[torch.device] = set()

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, name: str, tensor: torch.Tensor, *, fill: bool = True) -> torch.Tensor:
        """``tensor``'s values in ``name``'s buffer (a GPU tensor's copy may still be in
        flight: :meth:`settle` waits for it). ``fill=False`` only allocates the buffer (a
        reservation before the first snapshot: :func:`reserve_tree`)."""
        src = tensor.detach()
        buf = self._buffers.get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            self._buffers[name] = buf
        if fill:
            if src.is_cuda:
                self._devices.add(src.device)
            with torch.no_grad():
                buf.copy_(src, non_blocking=buf.is_pinned())
        return buf

    def settle(self) -> None:
        """Wait for the device-to-host copies :meth:`copy` left in flight (on every GPU
        they came from)."""
        settle_device(self._devices)


def settle_device(devices: Iterable[torch.device] = ()) -> None:
    """Wait for the GPU's queued work (nothing on the CPU): host memory it copies into
    asynchronously then holds what the CPU reads, and nothing in flight lands over what the
    CPU writes there. The current GPU's, and that of each of ``devices`` (GPUs holding the
    tensors copied: a process whose model is on ``cuda:1`` without ``set_device(1)`` copies
    on a GPU that is not its current one)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        for device in set(devices) - {torch.device("cuda", torch.cuda.current_device())}:
            torch.cuda.synchronize(device)


def snapshot_tree(obj: Any, buffers: HostBuffers, path: str = "") -> Any:
    """``obj`` (dicts, lists, tuples, tensors, plain values: an optimizer's state dict) with
    every tensor replaced by its copy in ``buffers`` (named by its path in the tree) and every
    container rebuilt, so nothing in the result changes when training goes on (an lr
    scheduler edits ``param_groups`` in place)."""
    out = _snapshot(obj, buffers, path)
    buffers.settle()
    return out


def reserve_tree(obj: Any, buffers: HostBuffers) -> int:
    """Allocate the buffers :func:`snapshot_tree` of ``obj`` will copy into, copying nothing
    (page-locking is slow: paid once, before the first snapshot, not by it); returns the
    bytes allocated."""
    before = buffers.nbytes
    _snapshot(obj, buffers, "", fill=False)
    return buffers.nbytes - before


def _snapshot(obj: Any, buffers: HostBuffers, path: str, fill: bool = True) -> Any:
    if isinstance(obj, torch.Tensor):
        return buffers.copy(path, obj, fill=fill)
    if isinstance(obj, dict):
        return {k: _snapshot(v, buffers, f"{path}/{k!r}", fill) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_snapshot(v, buffers, f"{path}/{i}", fill) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _address(view: memoryview) -> int:
    """Where ``view``'s memory starts (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _Parts:
    """The file object ``torch.save`` writes into: what it writes from one of ``tensors``'
    memory (their storages) is kept as a view of that memory, the rest (zip headers, the
    pickle) copied, as it lives only for the call."""

    #: writes shorter than this are copied without looking where they come from
    SMALL = 4096

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.parts: list[Any] = []
        self._small = bytearray()
        storages = [t.untyped_storage() for t in tensors if t.device.type == "cpu"]
        self._spans = [(s.data_ptr(), s.nbytes(), s) for s in storages if s.nbytes()]

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        own = self._owner(view) if n >= self.SMALL else None
        if own is None:
            self._small += view
            return n
        if self._small:
            self.parts.append(bytes(self._small))
            self._small = bytearray()
        self.parts.append(own)
        return n

    def _owner(self, view: memoryview) -> memoryview | None:
        """The same bytes as a view of the tensor that holds them, if one does."""
        start, n = _address(view), view.nbytes
        for base, size, storage in self._spans:
            if base <= start and start + n <= base + size:
                raw = torch.empty(0, dtype=torch.uint8).set_(storage)
                return memoryview(raw.numpy())[start - base : start - base + n]
        return None

    def flush(self) -> None:
        pass

    def close(self) -> list[Any]:
        if self._small:
            self.parts.append(bytes(self._small))
            self._small = bytearray()
        return self.parts


_CRC_LOCK = threading.Lock()


def torch_save_parts(obj: Any, *, crc32: bool = True) -> list[Any]:
    """``torch.save(obj)``'s bytes as parts: its tensors' storages as views of their own
    memory (no copy: do not change them until the parts are written), the rest as bytes.
    Joined, they are exactly what ``torch.save`` writes to a file.

    ``crc32=False`` leaves out the zip records' CRC-32s, a second pass over every byte at
    about 1 GB/s (torch.load does not check them; crf's container checks the whole payload
    with XXH3). torch reads that choice from a process-wide setting, so it is switched off
    only for this call; a ``torch.save`` another thread runs at that moment writes no CRC-32s
    either, which ``torch.load`` reads all the same."""
    tensors: list[torch.Tensor] = []
    _collect(obj, tensors)
    out = _Parts(tensors)
    if crc32 or not hasattr(torch.serialization, "set_crc32_options"):
        torch.save(obj, out)
        return out.close()
    with _CRC_LOCK:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(obj, out)
        finally:
            torch.serialization.set_crc32_options(before)
    return out.close()


def _collect(obj: Any, tensors: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, tensors)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect(v, tensors)
