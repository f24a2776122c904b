"""The versions a process runs with, so a replica's can be compared with its driver's.

A cloud replica installs crf's dependencies in its container at start (crf.executors.bootstrap
pins them to the driver's versions), but an image may already hold others, and torch is kept
as the image has it (a CUDA build matched to the machine). So each replica records in its
result (``versions``, ``cuda_available``) what it actually ran with, and the summary warns
when a library whose behaviour the run depends on - torchft's exchange, TRL's trainer,
transformers' models - differs from the driver's.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import metadata

#: import name -> the distributions that may provide it (the first one installed counts)
WATCHED: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "torchft": ("torchft-nightly", "torchft"),
    "trl": ("trl",),
    "transformers": ("transformers",),
}
#: a difference in these is a warning in the summary (torch differs by design: the image's)
MUST_MATCH = ("torchft", "trl", "transformers")


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@cache
def installed_versions() -> dict[str, str | None]:
    """``{"torch": "2.9.0+cu128", "torchft": ..., "trl": ..., "transformers": ...}`` of this
    process's environment (None: not installed)."""
    out: dict[str, str | None] = {}
    for name, dists in WATCHED.items():
        found = (distribution_version(d) for d in dists)
        out[name] = next((v for v in found if v), None)
    return out


def cuda_available() -> bool | None:
    """``torch.cuda.is_available()``, None when torch cannot be imported."""
    try:
        import torch
    except ImportError:
        return None
    return bool(torch.cuda.is_available())


def mismatches(
    replica: Mapping[str, object] | None, driver: Mapping[str, str | None] | None = None
) -> dict[str, tuple[object, str | None]]:
    """``{library: (replica's version, driver's)}`` for each of MUST_MATCH that differs;
    empty when the replica recorded no versions (a user's own entrypoint, an older crf)."""
    if not isinstance(replica, Mapping):
        return {}
    mine = installed_versions() if driver is None else driver
    return {
        name: (replica.get(name), mine.get(name))
        for name in MUST_MATCH
        if name in replica and replica.get(name) != mine.get(name)
    }
