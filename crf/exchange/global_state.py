"""The file format of a global checkpoint (``global/<r>/part-<s>-of-<n>.safetensors``, or
an older run's single ``state.safetensors``): safetensors files users can open with
``safetensors.torch.load_file``, not a custom pickle container. A state is cut into parts
of whole tensors (:func:`part_names`), one per participant of the round; each part carries
the whole tree, and :func:`join` puts the checked parts back together.

A global state is a nested dict (``{"model": model.state_dict(), "outer/0": optimizer state,
...}``). Its tensors are stored under their path in the tree, joined with ``/``
(``model/lm_head.weight``, ``outer/0/state/3/momentum_buffer``); everything else - ints,
floats, strings, None, lists, and the dict keys that are not strings (an optimizer state's
parameter numbers) - goes into the safetensors ``__metadata__`` as one JSON ``tree`` that
names each tensor where it sits, so the nested state comes back exactly as it was saved.

Safetensors itself carries no checksum, and a global state must still be refused when it is
corrupt, from another run or copied from another round (docs/faults.md). So the metadata
also holds the run id, the round, the model's layout hash and ``digest``: an XXH3-128 (crf's one
integrity checksum, as in every exchange object; files written with a SHA-256 are still read)
over the other metadata entries and every tensor (name, dtype, shape, bytes, name-sorted). A reader
recomputes it (:func:`decode`); a flipped bit anywhere in the file fails it, or fails the
safetensors parse, and both are a :class:`~crf.store.CorruptObjectError`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from crf import jsonsafe
from crf.store import CorruptObjectError
from crf.store.codec import checksum, raw_view

if TYPE_CHECKING:
    from crf.exchange.snapshots import HostBuffers

#: the metadata entry holding the checksum; every other entry is covered by it
DIGEST = "digest"
#: the metadata entry holding the state's tree (its non-tensor values)
TREE = "tree"
#: a format tag, so a reader knows it is a crf global state
FORMAT = "crf.global_state/1"


@dataclass
class FlatState:
    """A global state taken apart for writing: its tensors (copies on the CPU: the model
    goes on training while the write runs) and its tree as JSON."""

    tensors: dict[str, torch.Tensor]
    tree: str


def flatten(
    state: dict[str, Any],
    buffers: HostBuffers | None = None,
    keep: set[str] | None = None,
) -> FlatState:
    """Take ``state`` apart now (tensors copied to the CPU, no memory shared between them:
    tied weights are saved twice, as safetensors requires): into ``buffers``, reused from
    one snapshot to the next (the training thread's one copy), or into new tensors. With
    ``keep`` only the tensors of those names are copied (one part's: :func:`part_names`);
    the tree still names every tensor, so the parts put together rebuild the state."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _skeleton(state, (), tensors, buffers, keep)
    if buffers is not None:
        buffers.settle()
    return FlatState(tensors, json.dumps(tree, sort_keys=False, allow_nan=False))


def reserve(state: dict[str, Any], buffers: HostBuffers, keep: set[str] | None = None) -> int:
    """Allocate the buffers :func:`flatten` of ``state`` (with ``keep``) will copy into,
    copying nothing: before the first snapshot, so that it costs what the later ones do.
    Returns the bytes allocated."""
    before = buffers.nbytes
    _skeleton(state, (), {}, buffers, keep, fill=False)
    return buffers.nbytes - before


def _skeleton(
    obj: Any,
    path: tuple[str, ...],
    tensors: dict[str, torch.Tensor],
    buffers: HostBuffers | None = None,
    keep: set[str] | None = None,
    fill: bool = True,
) -> Any:
    """``obj`` as JSON with each tensor replaced by ``{"t": name}``. A dict is a list of
    [key, value] pairs (JSON keeps an int key apart from a str one), a list ``{"l": [...]}``,
    a tuple ``{"u": [...]}``, a plain value ``{"v": value}`` (a non-finite float
    ``{"f": "nan"}``)."""
    if isinstance(obj, torch.Tensor):
        name = "/".join(path)
        if name in tensors:
            raise ValueError(f"global state: two tensors would be stored as {name!r}")
        if keep is not None and name not in keep:
            return {"t": name}
        if buffers is not None:
            tensors[name] = buffers.copy(name, obj, fill=fill)
        else:
            tensors[name] = obj.detach().to("cpu", copy=True).contiguous()
        return {"t": name}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise TypeError(f"global state: key {k!r} at {'/'.join(path)} is not str/int")
            items.append([k, _skeleton(v, (*path, str(k)), tensors, buffers, keep, fill)])
        return {"d": items}
    if isinstance(obj, list | tuple):
        kind = "l" if isinstance(obj, list) else "u"
        items = [
            _skeleton(v, (*path, str(i)), tensors, buffers, keep, fill) for i, v in enumerate(obj)
        ]
        return {kind: items}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"f": repr(obj)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return {"v": obj}
    raise TypeError(
        f"global state: {type(obj).__name__} at {'/'.join(path)!r} cannot be saved "
        "(tensors, dicts, lists and plain values can)"
    )


def _sizes(obj: Any, path: tuple[str, ...], out: list[tuple[str, int]]) -> None:
    """(name, bytes) of every tensor in ``obj``, in the order :func:`flatten` names them."""
    if isinstance(obj, torch.Tensor):
        out.append(("/".join(path), obj.numel() * obj.element_size()))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _sizes(v, (*path, str(k)), out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _sizes(v, (*path, str(i)), out)


def part_names(state: dict[str, Any], part: int, parts: int) -> set[str]:
    """The tensors of ``state`` that part ``part`` of ``parts`` holds: the state's tensors,
    each parameter's together (its weights, its global copy, its outer momentum:
    :func:`_by_parameter`), cut into ``parts`` runs of about equal bytes (a tensor goes where
    its middle byte falls; whole tensors, so each part is a plain safetensors file). So part
    s holds the weights and outer-optimizer state of about the s-th n-th of the parameters,
    the ones whose shard its writer reduced. Every participant of a round holds the same
    state, so each computes the same cut from it alone."""
    sizes: list[tuple[str, int]] = []
    _sizes(state, (), sizes)
    total = sum(n for _, n in sizes)
    names, offset = set(), 0
    for name, n in _by_parameter(sizes):
        owner = min(parts - 1, int((offset + n / 2) * parts / total)) if total else 0
        if owner == part:
            names.add(name)
        offset += n
    return names


#: where torchft's DiLoCo keeps a fragment's global copy and outer optimizer in its state
_COPY, _OUTER = "/original_parameters/", "/outer_optimizer/state/"


def _by_parameter(sizes: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``sizes`` reordered so each parameter's tensors are together, in the order the
    parameters first appear: ``model/<p>``, ``<fragment>/original_parameters/<p>`` and
    ``<fragment>/outer_optimizer/state/<i>/...`` (i: p's place in the fragment, as
    torch.optim numbers it). Any other tensor stays a group of its own, where it is."""
    copies: dict[str, list[str]] = {}  # fragment -> its parameters' names, in order
    for name, _ in sizes:
        if _COPY in name:
            fragment, param = name.split(_COPY, 1)
            copies.setdefault(fragment, []).append(param)
    owner = {p: f for f, params in copies.items() for p in params}

    def group(name: str) -> str:
        if _COPY in name:
            return name.replace(_COPY, "/", 1)
        if _OUTER in name:
            fragment, rest = name.split(_OUTER, 1)
            index = rest.split("/", 1)[0]
            params = copies.get(fragment, [])
            if index.isdigit() and int(index) < len(params):
                return f"{fragment}/{params[int(index)]}"
        elif name.startswith("model/") and name[len("model/") :] in owner:
            param = name[len("model/") :]
            return f"{owner[param]}/{param}"
        return name

    first: dict[str, int] = {}
    keys = []
    for i, (name, _) in enumerate(sizes):
        g = group(name)
        first.setdefault(g, i)
        keys.append((first[g], i))
    return [sizes[i] for _, i in sorted(keys)]


def _rebuild(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if "t" in node:
        return tensors[node["t"]]
    if "d" in node:
        return {k: _rebuild(v, tensors) for k, v in node["d"]}
    if "l" in node:
        return [_rebuild(v, tensors) for v in node["l"]]
    if "u" in node:
        return tuple(_rebuild(v, tensors) for v in node["u"])
    if "f" in node:
        return float(node["f"])
    return node["v"]


def digest(meta: dict[str, str], tensors: dict[str, torch.Tensor], *, sha256: bool = False) -> str:
    """XXH3-128 (or, for files written before it, SHA-256) over the metadata (but
    ``digest``) and the tensors, name-sorted."""
    h = hashlib.sha256() if sha256 else checksum()
    covered = {k: v for k, v in meta.items() if k != DIGEST}
    h.update(jsonsafe.dumps(covered, sort_keys=True).encode())
    for name, t in sorted(tensors.items()):
        h.update(f"\0{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
        h.update(raw_view(t))
    return h.hexdigest()


def encode(flat: FlatState, header: dict[str, Any]) -> bytes:
    """The safetensors file of ``flat`` as one bytes object (:func:`encode_parts`, joined)."""
    return b"".join(encode_parts(flat, header))


#: safetensors' names of the dtypes a state may hold
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def encode_parts(flat: FlatState, header: dict[str, Any]) -> list[Any]:
    """The safetensors file of ``flat`` as parts: its header (``header`` - run id, round,
    layout - goes into the metadata as JSON values, beside the tree and the digest), then
    every tensor's own memory, unchanged (do not change the tensors until the parts are
    written). The digest reads the tensors in place. The file is what the format specifies
    (an 8-byte little-endian header length, the JSON header padded with spaces to a multiple
    of 8, the tensors back to back, widest dtype first, then by name, as ``safetensors``
    orders them so each is aligned), so ``safetensors.torch.load_file`` reads it."""
    meta = {k: jsonsafe.dumps(v) for k, v in header.items()}
    meta["format"] = FORMAT
    meta[TREE] = flat.tree
    meta[DIGEST] = digest(meta, flat.tensors)
    order = sorted(flat.tensors, key=lambda n: (-flat.tensors[n].element_size(), n))
    entries: dict[str, Any] = {"__metadata__": meta}
    views, offset = [], 0
    for name in order:
        t = flat.tensors[name]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"global state: {name} is {t.dtype}, which safetensors cannot hold")
        view = raw_view(t)
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        offset += view.nbytes
        if view.nbytes:
            views.append(view)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views]


def decode(data: bytes, *, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, header) of a file :func:`encode` wrote; CorruptObjectError when it does not
    parse or its digest does not match (a flipped bit, a cut-off file, not a global state)."""
    return join([decode_part(data, where=where)], where=where)


@dataclass
class Part:
    """One checked file of a global state: its tensors, header and tree (as JSON)."""

    tensors: dict[str, torch.Tensor]
    header: dict[str, Any]
    tree: str


def decode_part(data: bytes, *, where: str) -> Part:
    """One file :func:`encode_parts` wrote (a whole state or one part of it), checked against
    its digest; CorruptObjectError when it does not parse or the digest does not match."""
    from safetensors.torch import load

    try:
        tensors = load(data)
        meta = metadata(data)
    except Exception as e:  # safetensors raises its own error types (SafetensorError, ...)
        raise CorruptObjectError(f"{where}: not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT or DIGEST not in meta or TREE not in meta:
        raise CorruptObjectError(f"{where}: not a crf global state (no {FORMAT} metadata)")
    old = len(meta[DIGEST]) == 64  # a SHA-256 hex digest: written before XXH3-128
    if digest(meta, tensors, sha256=old) != meta[DIGEST]:
        raise CorruptObjectError(f"{where}: checksum mismatch (object is corrupted)")
    try:
        header = {k: json.loads(v) for k, v in meta.items() if k not in (DIGEST, TREE, "format")}
    except (ValueError, TypeError) as e:
        raise CorruptObjectError(f"{where}: unreadable metadata ({e})") from None
    return Part(tensors, header, meta[TREE])


def join(parts: list[Part], *, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, header) of a global state from its checked files (one, or every part): they
    must name the same tree, and hold every tensor it names exactly once; the header is the
    first part's, without ``part``."""
    tensors: dict[str, torch.Tensor] = {}
    for p in parts:
        if p.tree != parts[0].tree:
            raise CorruptObjectError(f"{where}: its parts are of different states")
        twice = tensors.keys() & p.tensors.keys()
        if twice:
            raise CorruptObjectError(f"{where}: {sorted(twice)[0]} is in two parts")
        tensors.update(p.tensors)
    try:
        state = _rebuild(json.loads(parts[0].tree), tensors)
    except KeyError as e:
        raise CorruptObjectError(f"{where}: tensor {e} is in none of its parts") from None
    except (ValueError, TypeError) as e:
        raise CorruptObjectError(f"{where}: unreadable metadata ({e})") from None
    header = {k: v for k, v in parts[0].header.items() if k != "part"}
    return state, header


def metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file in memory. The library reads it only from a
    file (``safe_open``), so the header is read as the format defines it: an 8-byte
    little-endian length, then that many bytes of JSON."""
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 + n:
        raise ValueError("header longer than the file")
    return dict(json.loads(data[8 : 8 + n]).get("__metadata__") or {})
