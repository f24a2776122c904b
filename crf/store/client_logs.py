"""Keep the async store clients' own tracebacks off the console.

crf's commands configure no logging, so Python prints any WARNING or worse with its
traceback on stderr. Two kinds come from the clients behind ``s3://`` and ``gs://`` for an
error crf itself handles, retries or says in one line (``RunStore``'s explainers):

* gcsfs logs ``<request> out of retries on exception`` / ``non-retriable exception`` with
  the traceback, then raises the same error to its caller;
* asyncio logs ``Task exception was never retrieved`` for aiohttp's request-body task of a
  request whose connection was reset (the request itself failed, and was retried or
  explained); a store that goes away mid-run leaves dozens of these at the command's end.

:func:`install` drops those records (once per process); every other record is kept.
"""

from __future__ import annotations

import logging

_GCSFS_RAISED = ("out of retries on exception", "non-retriable exception")
_UNRETRIEVED = "Task exception was never retrieved"
_installed = False


def _connection_error(exc: BaseException | None) -> bool:
    """A connection's failure (aiohttp's client errors, OSError): never a bug of crf's."""
    if isinstance(exc, OSError):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - the s3 and gcs extras both bring it
        return False
    return isinstance(exc, aiohttp.ClientError)


class _DropRaised(logging.Filter):
    """gcsfs's log of an error it raises next."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in _GCSFS_RAISED)


class _DropUnretrievedConnectionErrors(logging.Filter):
    """asyncio's report of a request task that failed on a connection nobody awaits."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_UNRETRIEVED):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not _connection_error(exc)


def install() -> None:
    """Add the filters to the ``gcsfs`` and ``asyncio`` loggers (idempotent)."""
    global _installed
    if _installed:
        return
    logging.getLogger("gcsfs").addFilter(_DropRaised())
    logging.getLogger("asyncio").addFilter(_DropUnretrievedConnectionErrors())
    _installed = True
