"""Process-wide allocator settings for a replica process (why its exchange peak stays near 2·P).

glibc's malloc gives a thread's first allocation an arena of its own (up to 8 per core) and
keeps memory freed in an arena there for that arena's next allocations. The exchange moves
shard-sized buffers (P/N bytes: a part joined for upload, a body read back) through pools of
transfer and control threads, so each thread's arena ends up holding shard-sized free blocks
that no other thread reuses. Measured over S3 (moto, 2 cores), the peak extra memory of a
round after the first was 1.25-2.53·P with glibc's default, 1.42-2.10·P with two arenas and
1.50-1.81·P with one, at the same round time (docs/performance.md, "Memory: allocator
arenas").

The limit is set at run time with ``mallopt`` (before the transfer threads start), so it
applies on every backend without touching the job's environment. ``MALLOC_ARENA_MAX`` set in
the environment wins: glibc reads it itself and this module then leaves it alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

#: ``M_ARENA_MAX`` from glibc's malloc.h
_M_ARENA_MAX = -8
#: what a replica uses unless told otherwise (``CRF_MALLOC_ARENAS``; 0 keeps glibc's default)
DEFAULT_ARENAS = 1


def limit_malloc_arenas(arenas: int | None = None) -> bool:
    """Cap glibc's malloc arenas for this process; True if the cap was set.

    ``arenas``: the cap (default: ``CRF_MALLOC_ARENAS`` or :data:`DEFAULT_ARENAS`); 0 leaves
    the allocator as it is. A no-op (False) off Linux/glibc, or when ``MALLOC_ARENA_MAX`` is
    set in the environment."""
    if arenas is None:
        raw = os.environ.get("CRF_MALLOC_ARENAS", str(DEFAULT_ARENAS))
        try:
            arenas = int(raw)
        except ValueError:
            raise ValueError(
                f"CRF_MALLOC_ARENAS must be a whole number of arenas (0: glibc's default), "
                f"got {raw!r}"
            ) from None
    if arenas < 0:
        raise ValueError(f"arenas must be >= 0, got {arenas}")
    if arenas == 0 or "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        # the interpreter's own symbols include libc's (find_library would run ldconfig)
        ok = bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return ok
