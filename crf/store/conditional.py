"""The retry loop shared by object stores with a server-side create-if-absent (S3, GCS).

A conditional create carries a random token (object metadata); a create retried after a lost
response keeps its token, so when the server answers "already exists" the writer can tell its
own object from someone else's. That is why exclusive writes retry transient failures here:
RunStore's generic retries would mint a new token.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from crf.store.errors import StoreNotWritable

#: object metadata key holding the random token of the call that created an object
WRITER_META = "crf-writer"
#: tries of one put_if_absent (same token) on transient errors before RunStore's own retries
CREATE_ATTEMPTS = 3


def tokened_put(
    attempt: Callable[[str | None], bool],
    translate: Callable[[BaseException], BaseException],
    unreachable: type[BaseException],
    exclusive: bool,
) -> bool:
    """Run ``attempt(token)`` (token None for a plain put), retrying transient errors of an
    exclusive create with the same token. ``translate`` maps a configuration error (no
    credentials, missing bucket) to a StoreNotWritable that says what to fix; those, and an
    ``unreachable`` endpoint after the last try, are raised at once."""
    token = os.urandom(16).hex() if exclusive else None
    attempts = CREATE_ATTEMPTS if exclusive else 1
    for n in range(attempts):
        try:
            return attempt(token)
        except StoreNotWritable:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised, translated when it is a config error
            translated = translate(e)
            definitive = translated is not e and not isinstance(translated, unreachable)
            if definitive or n + 1 == attempts:
                if translated is e:
                    raise
                raise translated from None
            time.sleep(0.2 * 2**n)
    raise AssertionError("unreachable")  # pragma: no cover


def require_create_mode(fs_class: type, package: str, version: str) -> None:
    """ImportError unless ``fs_class._pipe_file`` takes ``mode=`` (s3fs/gcsfs >= 2024.12):
    older releases pass it on to the server, which drops it, so creates would not be
    conditional."""
    if "mode" not in inspect.signature(fs_class._pipe_file).parameters:
        raise ImportError(
            f"{package} {version} cannot make conditional writes; {package}>=2024.12 is needed"
        )


def uncached_listings() -> dict[str, Any]:
    """Filesystem options of a shared run folder. Other replicas write behind this process's
    back: a cached listing would hide their objects from list()/exists()/wait_for() for ever,
    so never cache listings."""
    return {"use_listings_cache": False}


def created_by(read_metadata: Callable[[], Mapping[str, str] | None], token: str) -> bool:
    """After a "precondition failed": is the object there the one this call (``token``)
    created? ``read_metadata`` reads the object's metadata now."""
    try:
        metadata = read_metadata()
    except FileNotFoundError:
        return False  # deleted since: whoever created it, it was not us
    return (metadata or {}).get(WRITER_META) == token
