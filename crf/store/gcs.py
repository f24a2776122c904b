"""``gs://`` / ``gcs://`` run stores through gcsfs (install ``composer-replication[gcs]``).

Guarantees (see docs/stores.md):

* ``put`` is one upload request (simple upload; above ``UPLOAD_CHUNKSIZE`` a resumable upload,
  which GCS finalizes as one new generation): readers see the old generation or the new one.
* ``put_if_absent`` uploads with the precondition ``ifGenerationMatch=0`` ("only if no live
  object has this name"): GCS checks it atomically and answers 412, which gcsfs raises as
  FileExistsError. A retried upload whose first attempt had landed also gets 412, so each
  create carries a random ``crf-writer`` custom-metadata token and a 412 is answered by one
  metadata read: the token tells whether the object there is this call's.

Credentials: gcsfs's default chain (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth
application-default login``, the metadata server on GCP); ``STORAGE_EMULATOR_HOST`` selects an
emulator. Pass ``token=``/``project=`` as storage options to override. Nothing is logged.
"""

from __future__ import annotations

import os

import aiohttp
import gcsfs
from gcsfs.retry import HttpError
from google.auth.exceptions import RefreshError

from crf.store import client_logs
from crf.store.conditional import (
    WRITER_META,
    created_by,
    require_create_mode,
    tokened_put,
    uncached_listings,
)
from crf.store.errors import StoreNotWritable
from crf.store.reach import refusal
from crf.store.run_store import RunStore, register_scheme

#: objects of at least this size go up as a resumable upload in chunks of this size
UPLOAD_CHUNKSIZE = 50 * 2**20


require_create_mode(gcsfs.GCSFileSystem, "gcsfs", gcsfs.__version__)
client_logs.install()


class GCSUnreachable(StoreNotWritable, ConnectionError):
    """The GCS endpoint could not be reached (a ConnectionError, so RunStore retries it)."""


def _endpoint(store: RunStore) -> str:
    ep = getattr(store.fs, "_endpoint", None) or os.environ.get("STORAGE_EMULATOR_HOST")
    return ep or "storage.googleapis.com"


def _created_by(store: RunStore, path: str, token: str) -> bool:
    """After a 412: is the object at ``path`` the one this call (token) created?"""
    store.fs.invalidate_cache(path)
    return created_by(lambda: store.fs.info(path).get("metadata"), token)


def _not_writable(store: RunStore, path: str, e: BaseException) -> BaseException:
    """Turn configuration errors into StoreNotWritable saying what to fix; others unchanged."""
    bucket = path.split("/", 1)[0]
    where = f"gs://{bucket} (endpoint: {_endpoint(store)})"
    if isinstance(e, FileNotFoundError):  # an upload only 404s when the bucket is missing
        return StoreNotWritable(
            f"GCS bucket {bucket!r} not found at {_endpoint(store)}: create it (e.g. "
            f"`gcloud storage buckets create gs://{bucket}`), or fix the bucket in the run URI "
            "(or STORAGE_EMULATOR_HOST / endpoint_url if that is not a GCS endpoint)"
        )
    if (isinstance(e, HttpError) and e.code == 401) or isinstance(e, RefreshError):
        return StoreNotWritable(
            f"not authenticated to {where}: set GOOGLE_APPLICATION_CREDENTIALS to a service "
            "account key file, run `gcloud auth application-default login`, or run on GCP "
            "with a service account attached"
        )
    if isinstance(e, OSError) and str(e).startswith("Forbidden"):
        return StoreNotWritable(
            f"access denied to {where}: the credentials in use lack storage.objects.get, "
            ".list or .create there; check the bucket's IAM and which credentials gcsfs "
            "picks up"
        )
    if isinstance(e, ConnectionError | aiohttp.ClientConnectionError):
        return GCSUnreachable(
            f"cannot reach the GCS endpoint for {where}: check the network, "
            "STORAGE_EMULATOR_HOST or the endpoint_url storage option"
        )
    return e


def _on_open(store: RunStore) -> None:
    """What would otherwise fail slowly on the first request. A store opened to answer fast
    (``retries`` ≤ 1: the look-ups of ``crf runs``, ``status``, a launch's checks) first
    asks whether the endpoint answers at all (crf/store/reach.py): gcsfs retries a refused
    connection for ~17 s in each request. A replica's store (more retries) rides out an
    endpoint that is down for a while instead."""
    _check_credentials(store)  # first: wrong credentials are named as such, network or not
    if store.retries <= 1:
        why = refusal(_endpoint(store))
        if why is not None:
            raise _not_writable(store, store.root.lstrip("/"), ConnectionError(why))


def _check_credentials(store: RunStore) -> None:
    """Refresh the credentials once, now: gcsfs refreshes them inside each request and
    retries a failed refresh (wrong key, revoked grant) six times with backoff, ~35 s before
    a 401 surfaces. A valid token is kept and reused by the first request, so this costs
    nothing when the credentials are good (anonymous access has none to refresh)."""
    credentials = getattr(store.fs, "credentials", None)
    if credentials is not None and getattr(credentials, "credentials", None) is not None:
        credentials.maybe_refresh()


def _explain(store: RunStore, e: BaseException) -> BaseException:
    """Any operation's error, explained as the writer's are (see :func:`_not_writable`);
    a missing object is not a configuration error here."""
    if isinstance(e, FileNotFoundError):
        return e
    return _not_writable(store, store.root.lstrip("/"), e)


def _attempt(store: RunStore, path: str, data: bytes, token: str | None) -> bool:
    fs = store.fs
    if token is None:
        fs.pipe_file(path, data, chunksize=UPLOAD_CHUNKSIZE)
        return True
    try:
        fs.pipe_file(
            path,
            data,
            chunksize=UPLOAD_CHUNKSIZE,
            mode="create",  # gcsfs: ifGenerationMatch=0 on the upload -> 412 if it exists
            metadata={WRITER_META: token},
        )
        return True
    except FileExistsError:
        return _created_by(store, path, token)


def _put_gcs(store: RunStore, path: str, data: bytes, exclusive: bool) -> bool:
    return tokened_put(
        lambda token: _attempt(store, path, data, token),
        lambda e: _not_writable(store, path, e),
        GCSUnreachable,
        exclusive,
    )


# the module is imported for gs:// and gcs://: register both names gcsfs answers to
for _scheme in ("gs", "gcs"):
    register_scheme(_scheme, _put_gcs, uncached_listings, explain=_explain, on_open=_on_open)
