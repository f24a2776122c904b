"""Errors the store raises, so callers can tell a missing object from a bad one."""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base class for every store failure."""


class ObjectNotFound(StoreError, KeyError):
    """The key does not exist (yet)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else "object not found"


class CorruptObjectError(StoreError):
    """An object failed its integrity check (truncated, bit-flipped or foreign)."""


class StoreTimeout(StoreError, TimeoutError):
    """wait_for() passed its deadline before every key appeared."""


class StoreNotWritable(StoreError):
    """The store URI cannot be written: wrong scheme, no permission, missing bucket."""


class StoreURIError(StoreError, ValueError):
    """A store URL that cannot be what the user meant: blank, a scheme missing a slash
    (``s3:/bucket``), or credentials written into it. Raised before anything is read, written
    or printed, so the message (which never repeats credentials) is the whole answer."""


def denies_access(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is an object store's answer that these
    credentials may not use it, or that its bucket is gone (the scheme's explained
    :class:`StoreNotWritable`), rather than that it cannot be reached for a while (also a
    ``ConnectionError``): the same answer comes to every attempt, on any machine."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, StoreNotWritable) and not isinstance(current, ConnectionError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
