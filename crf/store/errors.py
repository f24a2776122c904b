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
