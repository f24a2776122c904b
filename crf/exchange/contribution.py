"""A replica's contribution to one exchange round, packed into ONE object.

``rounds/<r>/contrib/<rank>.<base round>.<facts>`` is::

    manifest frame (padded to M bytes) | shard frame | shard frame | ...

with one shard frame for every shard the replica publishes, in shard order: every shard but
those it keeps because it owns them in a full quorum (``s % world_size == rank``). A shard
frame is a self-checking tensor object (:mod:`crf.store.codec`) whose json header is padded
to a fixed size, so its length depends only on the shard's size and the wire format. Every
replica with the same tensors therefore computes the same byte range for "shard s of replica
p's contribution" without reading anything first, and an owner fetches exactly its shard with
one ranged GET.

Why one object and not one per shard: an object store bills, rate-limits and (in an
emulator) serializes per request. One object per shard cost a replica N - 1 PUTs plus a
manifest PUT per round, and every peer a manifest GET; packed, a replica's upload is one
PUT and its arrival is visible in the listing (a PUT is atomic). The bytes moved are the
same.

Why the name carries the base round and a digest of the facts every replica must share
(run, layout, wire, fragment, shard count): that is all the quorum decision needs to know
of a contribution, so the replica that decides reads it from the one listing it makes
anyway instead of reading N - 1 manifests on the round's critical path. The manifest in
the object is read only to say how a replica whose digest differs disagrees (its layout).

The manifest frame is ``MAGIC(8) | json length u32 | XXH3-128(json)(16) | json | zero pad``.
Its padded size M is computed from the tensor layout, the run id and the shard count, so it
is the same for every replica that agrees on the tensors; a replica that does not is caught
by the layout check (its manifest is read in full then).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from crf import jsonsafe
from crf.exchange import codecs as wirefmt
from crf.layout import contrib_dir, contrib_key
from crf.store import CorruptObjectError, ObjectNotFound, RunStore
from crf.store.codec import FRAME_OVERHEAD

MANIFEST_MAGIC = b"CRFMANI1"
_MHEAD = struct.Struct("<8sI16s")
#: the first read of a manifest whose size is not known (a layout check, a test): most fit
MANIFEST_PROBE = 4096


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _xxh3(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128(data).digest()


_NAME = re.compile(r"^(\d+)\.(none|-?\d+)\.([0-9a-f]{12})$")


@dataclass(frozen=True)
class Arrival:
    """What the name of a contribution in the listing tells."""

    rank: int
    base_round: int | None
    facts: str
    name: str


def facts_digest(manifest: dict[str, Any]) -> str:
    """12 hex digits of what a contribution must share with every other one of its round.
    An optional fact counts only when the manifest has it, so a run that does not use it
    keeps the digests (and contribution names) it had before the fact existed."""
    facts = {k: manifest.get(k) for k in FACTS}
    facts |= {k: manifest[k] for k in OPTIONAL_FACTS if k in manifest}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


#: the manifest fields every participant of a round must share
FACTS = ("run_id", "layout_hash", "wire_dtype", "fragment", "num_shards")
#: facts written only when set: ``reduce_group_size`` (two-level reduction, G > 0)
OPTIONAL_FACTS = ("reduce_group_size",)


def contrib_name(rank: int, base_round: int | None, facts: str) -> str:
    return f"{rank}.{'none' if base_round is None else base_round}.{facts}"


def parse_contrib_name(name: str) -> Arrival | None:
    """The arrival a listed name stands for; None for anything else (a temp file)."""
    m = _NAME.fullmatch(name)  # fullmatch: "$" alone also matches before a final "\n"
    if m is None:
        return None
    base = None if m.group(2) == "none" else int(m.group(2))
    return Arrival(int(m.group(1)), base, m.group(3), name)


def find_contribution(store: RunStore, r: int, rank: int) -> str | None:
    """The key of replica ``rank``'s contribution to round ``r``, if there is one."""
    for name in store.list(contrib_dir(r)):
        arrival = parse_contrib_name(name)
        if arrival is not None and arrival.rank == rank:
            return contrib_key(r, name)
    return None


def manifest_size(
    layout: Sequence[Any], run_id: str, num_shards: int, world_size: int, extra: int = 0
) -> int:
    """M: room for the manifest json, in steps of 64 bytes. A function of what replicas
    must agree on (the layout, run id, shard count and world size), so it is the same for
    all of them; what differs between replicas (rank, base round, the shards it keeps) and
    the keys and other scalars (about 260 bytes at most) fit in the margin; ``extra``: room
    for optional facts."""
    kept = (num_shards // world_size + 1) * (len(str(num_shards)) + 2)
    need = _MHEAD.size + len(json.dumps(list(layout))) + len(json.dumps(run_id)) + kept
    return _round_up(need + 320 + extra, 64)


def shard_header_size(run_id: str) -> int:
    """Room for a shard frame's json header: the run id and the keys and values of round,
    rank, shard, layout hash, sizes, wire, dtype and shape (under 250 bytes)."""
    return _round_up(len(json.dumps(run_id)) + 256, 32)


def encode_manifest(manifest: dict[str, Any], size: int) -> bytes:
    body = jsonsafe.dumps(manifest, sort_keys=True).encode()
    need = _MHEAD.size + len(body)
    if need > size:  # manifest_size leaves ample room: this is a bug, not bad input
        raise ValueError(f"manifest needs {need} bytes, {size} reserved")
    return (_MHEAD.pack(MANIFEST_MAGIC, len(body), _xxh3(body)) + body).ljust(size, b"\0")


def manifest_length(data: bytes, where: str) -> int:
    """How many leading bytes of the object the manifest needs (to know whether a first
    read got all of it)."""
    if len(data) < _MHEAD.size:
        raise CorruptObjectError(f"{where}: truncated ({len(data)} bytes, manifest header)")
    magic, n, _ = _MHEAD.unpack_from(data)
    if magic != MANIFEST_MAGIC:
        raise CorruptObjectError(f"{where}: not a crf contribution (bad magic {magic!r})")
    return _MHEAD.size + n


def decode_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The manifest at the start of ``data`` (which holds at least manifest_length bytes)."""
    end = manifest_length(data, where)
    if len(data) < end:
        raise CorruptObjectError(f"{where}: truncated manifest ({len(data)} of {end} bytes)")
    _, _, digest = _MHEAD.unpack_from(data)
    body = bytes(memoryview(data)[_MHEAD.size : end])
    if _xxh3(body) != digest:
        raise CorruptObjectError(f"{where}: manifest checksum mismatch (object is corrupted)")
    try:
        out = json.loads(body)
    except ValueError as e:
        raise CorruptObjectError(f"{where}: unreadable manifest ({e})") from None
    if not isinstance(out, dict):
        raise CorruptObjectError(f"{where}: manifest is not an object")
    return out


def read_manifest(
    store: RunStore,
    key: str,
    get_range: Callable[[str, int, int], bytes] | None = None,
    probe: int = MANIFEST_PROBE,
) -> dict[str, Any]:
    """The manifest of the contribution at ``key``: one ranged read of ``probe`` bytes, a
    second one if the manifest is longer. ``get_range`` replaces ``store.get_range`` (the
    exchange counts its bytes). Raises ObjectNotFound or CorruptObjectError."""
    where = f"{store.uri}/{key}"
    fetch = get_range or store.get_range
    data = fetch(key, 0, probe)
    if not data:
        raise ObjectNotFound(f"{where} is empty")
    need = manifest_length(data, where)
    if need > len(data):
        data = fetch(key, 0, need)
    return decode_manifest(data, where)


class Packing:
    """Byte ranges of the shard frames in any replica's contribution object of one round."""

    def __init__(
        self,
        bounds: Sequence[tuple[int, int]],
        wire: str,
        world_size: int,
        manifest_bytes: int,
        header_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        hold_back: bool = True,
    ) -> None:
        self.bounds = list(bounds)
        #: whether a replica keeps the shards it owns in a full quorum out of its object (the
        #: one-level exchange); the two-level one uploads every slice: any group's sum of
        #: any slice can then be recomputed from the store alone
        self.hold_back = hold_back
        #: per shard, the lengths of the tensors' pieces (int8 blocks restart at each)
        self.segments = list(segments) if segments is not None else [None] * len(self.bounds)
        self.wire = wire
        self.world_size = world_size
        self.manifest_bytes = manifest_bytes
        self.header_bytes = header_bytes
        self._ranges: dict[int, dict[int, tuple[int, int]]] = {}

    @cached_property
    def frame_sizes(self) -> list[int]:
        return [
            FRAME_OVERHEAD
            + self.header_bytes
            + wirefmt.wire_nbytes(self.wire, b - a, self.segments[s])
            for s, (a, b) in enumerate(self.bounds)
        ]

    def kept(self, rank: int) -> list[int]:
        """Shards replica ``rank`` keeps out of its object (it owns them in a full quorum)."""
        return [s for s in range(len(self.bounds)) if self.keeps(rank, s)]

    def keeps(self, rank: int, s: int) -> bool:
        """Whether replica ``rank`` keeps shard ``s`` out of its object."""
        return self.hold_back and s % self.world_size == rank

    def ranges(self, rank: int) -> dict[int, tuple[int, int]]:
        """[start, end) of each shard frame in replica ``rank``'s object."""
        out = self._ranges.get(rank)
        if out is None:
            out, pos = {}, self.manifest_bytes
            for s, size in enumerate(self.frame_sizes):
                if not self.keeps(rank, s):
                    out[s] = (pos, pos + size)
                    pos += size
            self._ranges[rank] = out
        return out
