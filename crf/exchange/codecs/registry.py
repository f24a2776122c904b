"""The registry of wire codecs: name -> codec, with the built-in ones registered by module
path and imported on first use, so listing or checking names needs no torch (``crf.spec``
validates a run's ``wire_dtype`` before anything heavy is loaded)."""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crf.exchange.codecs.base import Codec

#: the built-in codecs: name -> "module:attribute" of the codec instance. A codec shipped
#: with crf is its module plus one line here (docs/extending.md, "Add a wire codec")
_BUILTIN = {
    "float32": "crf.exchange.codecs.floats:FLOAT32",
    "bfloat16": "crf.exchange.codecs.floats:BFLOAT16",
    "float16": "crf.exchange.codecs.floats:FLOAT16",
    "int8": "crf.exchange.codecs.int8:INT8",
    "topk2": "crf.exchange.codecs.topk:TOPK2",
    "topk4": "crf.exchange.codecs.topk:TOPK4",
    "topk8": "crf.exchange.codecs.topk:TOPK8",
}

#: name -> the codec, or where to import it from until its first use
_REGISTRY: dict[str, Codec | str] = dict(_BUILTIN)
_LOCK = threading.Lock()
#: "name@param" -> that codec's variant, built on first use
_VARIANTS: dict[str, Codec] = {}


def register_codec(name: str, codec: Codec | str, *, replace: bool = False) -> None:
    """Make ``codec`` the wire format called ``name``: a Codec instance, or the
    ``"module:attribute"`` path of one (imported on first use, so registering costs no
    import). A name already taken is refused unless ``replace``. Register it in every
    process that runs an exchange (a replica is a fresh process: put the line where its
    imports run it, as ``_BUILTIN`` does for the built-in codecs)."""
    if not isinstance(name, str) or not name or "@" in name:
        raise ValueError(f"a codec's name must be a non-empty string without '@', got {name!r}")
    if isinstance(codec, str) and ":" not in codec:
        raise ValueError(f"codec path must be 'module:attribute', got {codec!r}")
    with _LOCK:
        if name in _REGISTRY and not replace:
            raise ValueError(f"wire codec {name!r} is registered already")
        _REGISTRY[name] = codec
        _forget_variants(name)


def _forget_variants(name: str) -> None:
    """Drop the variants built from the codec called ``name`` (the caller holds the lock)."""
    for key in [k for k in _VARIANTS if k.partition("@")[0] == name]:
        del _VARIANTS[key]


def unregister_codec(name: str) -> None:
    """Forget the codec called ``name`` (a no-op when there is none)."""
    with _LOCK:
        _REGISTRY.pop(name, None)
        _forget_variants(name)


def codec_names() -> tuple[str, ...]:
    """The registered wire formats, in registration order (the built-in ones first)."""
    return tuple(_REGISTRY)


def get_codec(name: str) -> Codec:
    """The codec called ``name``, imported on its first use; ValueError if none is.
    ``name@param`` is the codec's variant with that parameter (``topk4@0.05``: top-k at a
    density of 5%; :meth:`~crf.exchange.codecs.base.Codec.variant`)."""
    base, at, param = name.partition("@") if isinstance(name, str) else (name, "", "")
    if at:
        codec = _VARIANTS.get(name)
        if codec is None:
            codec = get_codec(base).variant(param)
            with _LOCK:
                codec = _VARIANTS.setdefault(name, codec)
        return codec
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"wire format must be one of {codec_names()}, got {name!r}")
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    codec = getattr(importlib.import_module(module), attr)
    if codec.name != name:
        raise ValueError(f"{entry} is the codec {codec.name!r}, registered as {name!r}")
    with _LOCK:
        if _REGISTRY.get(name) == entry:  # not replaced meanwhile
            _REGISTRY[name] = codec
    return codec
