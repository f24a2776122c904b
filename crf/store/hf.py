"""``hf://`` run stores on the Hugging Face Hub (install ``composer-replication[hf]``).

Two kinds of location, both through ``huggingface_hub``:

* repositories, ``hf://datasets/<ns>/<repo>[@<branch>]/<path>`` (models and spaces too): every
  write is a git commit. ``put`` is one commit (atomic: readers see the old file or the new
  one). ``put_if_absent`` is optimistic concurrency on the branch: read the branch head H,
  check the file is absent *at H*, then ``create_commit(..., parent_commit=H)``, which the Hub
  refuses (412) if the branch moved after H. So the commit lands only if no commit at all —
  in particular none creating the file — came between the check and the write: a real,
  linearizable create-if-absent. A 412 re-reads the head and tries again (bounded).
* buckets, ``hf://buckets/<ns>/<bucket>/<path>``: writes are Xet uploads registered by one
  ``/batch`` call (atomic per file), not commits. The bucket API has NO conditional write, so
  ``put_if_absent`` there is best effort: check absent, write, wait ``BUCKET_SETTLE_S``, read
  back; it returns True only if the object then holds this call's bytes. That is safe only
  when every contender's write becomes visible within ``BUCKET_SETTLE_S`` of its existence
  check; it is NOT a server-side guarantee. Use a repo (or S3/GCS) where that matters.

Rate limits: the Hub limits commits per repository per hour (128/h on a free account at the
time of writing) and API calls per 5-minute window. A 429 is retried after the server's
``Retry-After``/``RateLimit`` hint, else exponential backoff with full jitter, for at most
``RATE_LIMIT_MAX_WAIT_S`` in total; past that :class:`HfRateLimited` says so. Every ``put``,
``put_if_absent`` and ``delete`` on a repo is a commit: a repo suits small runs only.

Reads: ``HfFileSystem`` caches listings for the life of the instance, which would hide other
replicas' writes from ``list``/``exists``/``wait_for`` for ever. This module registers
:class:`RunStoreHfFileSystem` for ``hf`` in fsspec; it is ``HfFileSystem`` unchanged except
for instances created with ``crf_run_store=True`` (what RunStore asks for), which list, stat
and delete through the Hub API without caching and read a whole object with one GET.

Credentials: ``HF_TOKEN`` or the token saved by ``hf auth login`` (``HF_ENDPOINT`` for another
Hub). Nothing here logs or prints a token.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import fsspec
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfFileSystem, hf_hub_url
from huggingface_hub.errors import (
    BucketNotFoundError,
    EntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder
from huggingface_hub.utils import (
    build_hf_headers,
    hf_raise_for_status,
    http_backoff,
    parse_hf_uri,
    parse_ratelimit_headers,
)

from crf.executors import adaptors
from crf.store.errors import StoreError, StoreNotWritable
from crf.store.run_store import RunStore, register_scheme

try:  # the HTTP client huggingface_hub uses (httpx2 in 2.x)
    from httpx2 import TransportError as _TransportError
except ImportError:  # pragma: no cover - older clients
    from httpx import TransportError as _TransportError

log = logging.getLogger(__name__)
T = TypeVar("T")
#: what a Hub call raises when it is refused, fails or cannot connect (HfHubHTTPError, the HTTP
#: client's errors, OSError); the retry loops look at these and re-raise the rest untouched
HUB_ERRORS = adaptors.huggingface_hub.errors()


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


#: longest total wait on HTTP 429 for one store operation before giving up
RATE_LIMIT_MAX_WAIT_S = _env_float("CRF_HF_RATE_LIMIT_MAX_WAIT_S", 900.0)
#: longest time put_if_absent keeps retrying when the branch keeps moving under it
CONTENTION_MAX_WAIT_S = _env_float("CRF_HF_CONTENTION_MAX_WAIT_S", 300.0)
#: bucket put_if_absent: wait this long after writing before reading back (see module doc)
BUCKET_SETTLE_S = _env_float("CRF_HF_BUCKET_SETTLE_S", 3.0)
#: transient failures (5xx, network) retried per call before the error goes up
TRANSIENT_RETRIES = 5
#: backoff base and cap (seconds); tests shrink them
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
#: how a commit made by put_if_absent is recognised after an ambiguous failure
_NONCE_TAG = "crf-writer:"
_sleep: Callable[[float], None] = time.sleep  # tests replace it to run without waiting


class HfRateLimited(StoreError):
    """The Hub kept answering 429 for longer than RATE_LIMIT_MAX_WAIT_S."""


class HfUnreachable(StoreNotWritable, ConnectionError):
    """The Hub could not be reached (a ConnectionError, so RunStore retries it)."""


# --------------------------------------------------------------------------- errors, backoff
def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _server_wait_hint(e: BaseException) -> float | None:
    """Seconds the server asked us to wait (RateLimit or Retry-After header), if any."""
    headers = getattr(getattr(e, "response", None), "headers", None)
    if not headers:
        return None
    info = parse_ratelimit_headers(headers)
    if info is not None and info.remaining == 0:
        return float(info.reset_in_seconds)
    value = headers.get("retry-after") or headers.get("Retry-After")
    if value is not None and str(value).strip().isdigit():
        return float(value)
    return None


def _transient(e: BaseException) -> bool:
    status = _status(e)
    if status is not None:
        return status in (408, 500, 502, 503, 504)
    return isinstance(e, _TransportError | TimeoutError | ConnectionError)


class _Backoff:
    """Bounded retry budget: exponential backoff with full jitter, server hints honoured."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.rate_waited = 0.0
        self.attempt = 0

    def _delay(self) -> float:
        self.attempt += 1
        return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (self.attempt - 1)))

    def rate_limited(self, e: BaseException) -> None:
        """Sleep after a 429, or raise HfRateLimited once the budget is spent."""
        hint = _server_wait_hint(e)
        delay = hint + random.uniform(0, 1.0) if hint is not None else self._delay()
        if self.rate_waited + delay > RATE_LIMIT_MAX_WAIT_S:
            raise HfRateLimited(
                f"{self.what}: the Hugging Face Hub is rate limiting (HTTP 429) and asks to "
                f"wait {hint if hint is not None else delay:.0f}s more after "
                f"{self.rate_waited:.0f}s of waiting (limit CRF_HF_RATE_LIMIT_MAX_WAIT_S="
                f"{RATE_LIMIT_MAX_WAIT_S:.0f}). A repo allows a limited number of commits per "
                "hour and every write to a repo store is a commit (API calls are limited per "
                "5 minutes too): use an hf://buckets/ store, or S3/GCS, for runs with many "
                "rounds or replicas. Server said: "
                f"{str(e).splitlines()[0][:300]}"
            ) from None
        log.warning("%s: rate limited by the Hub, retrying in %.1fs", self.what, delay)
        self.rate_waited += delay
        _sleep(delay)

    def short(self) -> None:
        """A brief jittered pause (contention or a transient error)."""
        _sleep(random.uniform(0, min(BACKOFF_CAP_S, 0.1 * 2 ** min(self.attempt, 6))))
        self.attempt += 1


def _with_backoff(what: str, fn: Callable[[], T]) -> T:
    """Run an idempotent Hub call with 429 and transient-error retries."""
    backoff = _Backoff(what)
    transient = 0
    while True:
        try:
            return fn()
        except HUB_ERRORS as e:
            if _status(e) == 429:
                backoff.rate_limited(e)
            elif _transient(e) and transient < TRANSIENT_RETRIES:
                transient += 1
                backoff.short()
            else:
                raise


def _explain(uri: str, e: BaseException, endpoint: str) -> BaseException:
    """Configuration errors -> StoreNotWritable saying what to fix; anything else unchanged."""
    if isinstance(e, OfflineModeIsEnabled):
        return StoreNotWritable(f"cannot write to {uri}: HF_HUB_OFFLINE is set; unset it")
    if isinstance(e, BucketNotFoundError):
        return StoreNotWritable(
            f"Hugging Face bucket of {uri} not found (or not visible to this token): create "
            "it (`hf buckets create <ns>/<name>`) and check HF_TOKEN"
        )
    if isinstance(e, RepositoryNotFoundError):
        return StoreNotWritable(
            f"Hugging Face repo of {uri} not found (or not visible to this token): create it "
            "(e.g. `hf repos create <ns>/<name> --type dataset`) and check HF_TOKEN"
        )
    if isinstance(e, RevisionNotFoundError):
        return StoreNotWritable(
            f"the branch in {uri} does not exist: create it (`hf repos branch create ...`) "
            "or drop the @revision from the URI"
        )
    status = _status(e)
    if status == 401:
        return StoreNotWritable(
            f"not authenticated to the Hugging Face Hub ({endpoint}) for {uri}: set HF_TOKEN "
            "to a token with write access, or run `hf auth login`"
        )
    if status == 403:
        return StoreNotWritable(
            f"the Hugging Face token in use may not write to {uri}: use a token with write "
            "access to that namespace (fine-grained tokens need repo write permission)"
        )
    if status is None and isinstance(e, _TransportError | ConnectionError):
        return HfUnreachable(
            f"cannot reach the Hugging Face Hub at {endpoint} for {uri}: check the network "
            f"and HF_ENDPOINT ({type(e).__name__})"
        )
    return e


# --------------------------------------------------------------------------- repositories
def _commit(api: Any, u: Any, ops: Callable[[], list[Any]], message: str, **kw: Any) -> Any:
    return api.create_commit(
        repo_id=u.id,
        repo_type=u.type,
        revision=u.revision,
        operations=ops(),  # fresh operation objects: the client marks them as committed
        commit_message=message,
        **kw,
    )


def _commit_retrying(api: Any, u: Any, ops: Callable[[], list[Any]], message: str) -> None:
    """A commit that may land on any head: retries 412/409 (a concurrent commit), 429, 5xx."""
    backoff = _Backoff(f"hf commit to {u.id}")
    deadline = time.monotonic() + CONTENTION_MAX_WAIT_S
    transient = 0
    while True:
        try:
            _commit(api, u, ops, message)
            return
        except HUB_ERRORS as e:
            status = _status(e)
            if status == 429:
                backoff.rate_limited(e)
            elif status in (409, 412) and time.monotonic() < deadline:
                backoff.short()  # "A commit has happened since": replay on the new head
            elif _transient(e) and transient < TRANSIENT_RETRIES:
                transient += 1  # a replayed add/delete of the same content is harmless
                backoff.short()
            else:
                raise


def _is_our_commit(api: Any, u: Any, nonce: str) -> bool:
    """Did the commit that last touched the file carry our nonce? (ambiguous failures only)"""
    infos = _with_backoff(
        "hf paths-info",
        lambda: api.get_paths_info(
            u.id, [u.path_in_repo], expand=True, revision=u.revision, repo_type=u.type
        ),
    )
    for info in infos:
        last = getattr(info, "last_commit", None)
        title = (last or {}).get("title") if isinstance(last, dict) else getattr(last, "title", "")
        return bool(title) and nonce in title
    return False


def _create_in_repo(api: Any, u: Any, data: bytes) -> bool:
    """Create-if-absent through ``parent_commit``; see the module docstring."""
    nonce = os.urandom(8).hex()
    message = f"crf: create {u.path_in_repo} ({_NONCE_TAG}{nonce})"
    backoff = _Backoff(f"hf create {u.id}/{u.path_in_repo}")
    deadline = time.monotonic() + CONTENTION_MAX_WAIT_S
    ambiguous = False  # a commit attempt failed in a way that may hide a success
    transient = 0
    while True:
        try:
            head = api.repo_info(u.id, repo_type=u.type, revision=u.revision).sha
            if api.file_exists(u.id, u.path_in_repo, repo_type=u.type, revision=head):
                return ambiguous and _is_our_commit(api, u, nonce)
        except HUB_ERRORS as e:
            if _status(e) == 429:
                backoff.rate_limited(e)
                continue
            if _transient(e) and transient < TRANSIENT_RETRIES:
                transient += 1
                backoff.short()
                continue
            raise
        try:
            _commit(
                api,
                u,
                lambda: [CommitOperationAdd(path_in_repo=u.path_in_repo, path_or_fileobj=data)],
                message,
                parent_commit=head,
            )
            return True
        except HUB_ERRORS as e:
            status = _status(e)
            if status == 429:
                backoff.rate_limited(e)
            elif status in (409, 412):
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"hf create {u.id}/{u.path_in_repo}: the branch kept moving for "
                        f"{CONTENTION_MAX_WAIT_S:.0f}s (CRF_HF_CONTENTION_MAX_WAIT_S); too many "
                        "concurrent commits to this repo"
                    ) from None
                backoff.short()  # the branch moved after `head`: check again on the new head
            elif _transient(e) and transient < TRANSIENT_RETRIES:
                transient += 1
                ambiguous = True  # the commit may have landed without us hearing back
                backoff.short()
            else:
                raise


# --------------------------------------------------------------------------- buckets
_BUCKET_WARNED = threading.Event()


def _bucket_add(api: Any, u: Any, data: bytes) -> None:
    _with_backoff(
        f"hf bucket write {u.id}/{u.path_in_repo}",
        lambda: api.batch_bucket_files(u.id, add=[(data, u.path_in_repo)]),
    )


def _bucket_file_exists(api: Any, u: Any) -> bool:
    found = _with_backoff(
        "hf bucket paths-info", lambda: list(api.get_bucket_paths_info(u.id, [u.path_in_repo]))
    )
    return any(getattr(f, "path", None) == u.path_in_repo for f in found)


def _create_in_bucket(store: RunStore, api: Any, u: Any, path: str, data: bytes) -> bool:
    """Best-effort create-if-absent (the bucket API has no conditional write)."""
    if not _BUCKET_WARNED.is_set():
        _BUCKET_WARNED.set()
        log.warning(
            "hf://buckets/ has no conditional write: put_if_absent there is best effort "
            "(check, write, read back after %.1fs); use an hf:// repo or S3/GCS where exactly "
            "one creator per key must be guaranteed",
            BUCKET_SETTLE_S,
        )
    if _bucket_file_exists(api, u):
        return False
    _bucket_add(api, u, data)
    _sleep(BUCKET_SETTLE_S)
    try:
        return bytes(store.fs.cat_file(path)) == bytes(data)
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- the writer
def _parse(path: str) -> Any:
    try:
        u = parse_hf_uri("hf://" + path.lstrip("/"))
    except ValueError as e:
        raise StoreNotWritable(f"not a valid hf:// store path {path!r}: {e}") from None
    if not u.path_in_repo:
        raise StoreNotWritable(f"hf://{path} names a whole repo or bucket, not a path in it")
    return u


def _put_hf(store: RunStore, path: str, data: bytes, exclusive: bool) -> bool:
    u = _parse(path)
    api = store.fs._api
    data = bytes(data)
    try:
        if u.type == "bucket":
            if exclusive:
                return _create_in_bucket(store, api, u, path, data)
            _bucket_add(api, u, data)
            return True
        if exclusive:
            return _create_in_repo(api, u, data)
        _commit_retrying(
            api,
            u,
            lambda: [CommitOperationAdd(path_in_repo=u.path_in_repo, path_or_fileobj=data)],
            f"crf: put {u.path_in_repo}",
        )
        return True
    except (StoreNotWritable, HfRateLimited):
        raise
    except Exception as e:  # noqa: BLE001 - re-raised, translated when it is a config error
        translated = _explain(f"hf://{path}", e, getattr(store.fs, "endpoint", "the Hub"))
        if translated is e:
            raise
        raise translated from None


# --------------------------------------------------------------------------- filesystem
class RunStoreHfFileSystem(HfFileSystem):
    """``HfFileSystem``; with ``crf_run_store=True``, uncached listings and one-GET reads."""

    def __init__(self, *args: Any, crf_run_store: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._crf_fresh = bool(crf_run_store)

    # --- helpers
    def _crf_uri(self, path: str) -> Any:
        return parse_hf_uri("hf://" + self._strip_protocol(path).strip("/"))

    def _crf_children(self, u: Any, recursive: bool) -> list[tuple[str, str, int]]:
        """(path relative to u.path_in_repo, 'file'|'directory', size) under u."""
        prefix = u.path_in_repo.strip("/")
        out: list[tuple[str, str, int]] = []
        if u.type == "bucket":
            entries = _with_backoff(
                "hf bucket tree",
                lambda: list(
                    self._api.list_bucket_tree(u.id, prefix=prefix or None, recursive=recursive)
                ),
            )
        else:
            try:
                entries = _with_backoff(
                    "hf repo tree",
                    lambda: list(
                        self._api.list_repo_tree(
                            u.id,
                            prefix or None,
                            recursive=recursive,
                            revision=u.revision,
                            repo_type=u.type,
                        )
                    ),
                )
            except EntryNotFoundError:
                return []
        for e in entries:
            p = str(e.path).strip("/")
            if prefix:
                if not p.startswith(prefix + "/"):
                    continue  # the prefix itself (a file), or a sibling sharing its first letters
                p = p[len(prefix) + 1 :]
            is_dir = isinstance(e, RepoFolder) or getattr(e, "type", None) == "directory"
            if not recursive and "/" in p:  # a server that answered deeper: keep the child
                out.append((p.split("/", 1)[0], "directory", 0))
                continue
            out.append((p, "directory" if is_dir else "file", int(getattr(e, "size", 0) or 0)))
        return out

    # --- fsspec API
    def ls(self, path: str, detail: bool = True, refresh: bool = False, **kwargs: Any) -> list:
        if not self._crf_fresh:
            return super().ls(path, detail=detail, refresh=refresh, **kwargs)
        base = self._strip_protocol(path).rstrip("/")
        children = self._crf_children(self._crf_uri(path), recursive=False)
        if not children:
            if self.isfile(path):
                info = self.info(path)
                return [info] if detail else [info["name"]]
            raise FileNotFoundError(path)
        seen: dict[str, dict[str, Any]] = {}
        for name, kind, size in children:
            seen.setdefault(name, {"name": f"{base}/{name}", "type": kind, "size": size})
        out = [seen[k] for k in sorted(seen)]
        return out if detail else [o["name"] for o in out]

    def info(self, path: str, refresh: bool = False, **kwargs: Any) -> dict[str, Any]:
        if not self._crf_fresh:
            return super().info(path, refresh=refresh, **kwargs)
        u = self._crf_uri(path)
        name = self._strip_protocol(path).rstrip("/")
        p = u.path_in_repo.strip("/")
        if not p:
            return {"name": name, "type": "directory", "size": 0}
        if u.type == "bucket":
            files = _with_backoff(
                "hf bucket paths-info", lambda: list(self._api.get_bucket_paths_info(u.id, [p]))
            )
            for f in files:
                if f.path == p:
                    return {"name": name, "type": "file", "size": int(f.size or 0)}
        else:
            infos = _with_backoff(
                "hf paths-info",
                lambda: self._api.get_paths_info(u.id, [p], revision=u.revision, repo_type=u.type),
            )
            for i in infos:
                if isinstance(i, RepoFolder):
                    return {"name": name, "type": "directory", "size": 0}
                if isinstance(i, RepoFile) or getattr(i, "path", None) == p:
                    return {"name": name, "type": "file", "size": int(getattr(i, "size", 0) or 0)}
        if u.type == "bucket" and self._crf_children(u, recursive=False):
            return {"name": name, "type": "directory", "size": 0}  # folders are implicit
        raise FileNotFoundError(path)

    def exists(self, path: str, **kwargs: Any) -> bool:
        if not self._crf_fresh:
            return super().exists(path, **kwargs)
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def isfile(self, path: str) -> bool:
        if not self._crf_fresh:
            return super().isfile(path)
        try:
            return self.info(path)["type"] == "file"
        except FileNotFoundError:
            return False

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        ranged = start is not None or end is not None
        if not self._crf_fresh or (ranged and (start is None or start < 0 or end is None)):
            return super().cat_file(path, start=start, end=end, **kwargs)
        u = self._crf_uri(path)
        if not u.path_in_repo:
            raise IsADirectoryError(path)
        return self._crf_fetch(u, start, end) if ranged else self._crf_fetch(u)

    def _crf_fetch(self, u: Any, start: int | None = None, end: int | None = None) -> bytes:
        """The whole object, or bytes [start, end) of it, in ONE GET, so a concurrent
        replace can't tear the read."""
        if u.type == "bucket":
            url = f"{self.endpoint}/buckets/{u.id}/resolve/{quote(u.path_in_repo)}"
        else:
            url = hf_hub_url(
                u.id, u.path_in_repo, repo_type=u.type, revision=u.revision, endpoint=self.endpoint
            )
        headers = build_hf_headers(token=self.token)
        if start is not None and end is not None:
            if end <= start:
                return b""
            headers["Range"] = f"bytes={start}-{end - 1}"
        response = http_backoff("GET", url, headers=headers)
        if response.status_code == 404:
            raise FileNotFoundError(f"hf://{u.type}s/{u.id}/{u.path_in_repo}")
        if response.status_code == 416:  # the range starts past the end of the object
            return b""
        hf_raise_for_status(response)
        if start is not None and end is not None and response.status_code != 206:
            return response.content[start:end]  # a server that ignored the Range header
        return response.content

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None, **kw: Any):
        if not self._crf_fresh:
            return super().rm(path, recursive=recursive, maxdepth=maxdepth, **kw)
        u = self._crf_uri(path)
        p = u.path_in_repo.strip("/")
        if not p:
            raise StoreNotWritable(f"refusing to delete the whole repo/bucket hf://{path}")
        if self.isfile(path):
            files = [p]
        elif recursive:
            files = [f"{p}/{c}" for c, kind, _ in self._crf_children(u, True) if kind == "file"]
        else:
            files = []
        if not files:
            raise FileNotFoundError(path)
        if u.type == "bucket":
            _with_backoff(
                f"hf bucket delete {u.id}/{p}",
                lambda: self._api.batch_bucket_files(u.id, delete=files),
            )
        else:
            _commit_retrying(
                self._api,
                u,
                lambda: [CommitOperationDelete(path_in_repo=f) for f in files],
                f"crf: delete {p}",
            )


def _fs_options() -> dict[str, Any]:
    return {"crf_run_store": True}


fsspec.register_implementation("hf", RunStoreHfFileSystem, clobber=True)
register_scheme(
    "hf",
    _put_hf,
    _fs_options,
    explain=lambda store, e: _explain(store.uri, e, getattr(store.fs, "endpoint", "the Hub")),
)
