"""RunStore: one run's folder in an object store, behind fsspec.

Everything replicas and the driver share goes through this class, so it holds the store's
guarantees (docs/stores.md) in one place:

* ``put`` publishes atomically: a reader sees the whole object or nothing (temp file + rename
  on a file system; a single PUT on object stores);
* ``put_if_absent`` is a real create-if-absent (``os.link`` of a fully written temp file on a
  file system, a lock in ``memory://``; S3 ``If-None-Match`` / GCS generation match slot in as
  further backends);
* ``wait_for`` polls with exponential backoff until keys exist or a deadline passes;
* transient I/O errors are retried a bounded number of times.

Keys are ``/``-separated paths relative to the run folder (``rounds/3/quorum.json``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar

import fsspec

from crf import jsonsafe
from crf.store.errors import (
    ObjectNotFound,
    StoreError,
    StoreNotWritable,
    StoreTimeout,
    StoreURIError,
)

T = TypeVar("T")
log = logging.getLogger(__name__)
#: what ``put`` takes: bytes, or a list of buffers written one after the other (no join on
#: file://; joined for other schemes)
Data = Any

_TMP_MARK = ".crf-tmp-"
_MEMORY_LOCK = threading.Lock()

#: A writer publishes ``data`` at ``path`` atomically; with ``exclusive`` it must be a real
#: create-if-absent and return False if the object exists. One per scheme: a cloud scheme slots
#: in with ``register_scheme`` (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, ...).
Writer = Callable[["RunStore", str, bytes, bool], bool]
_WRITERS: dict[str, Writer] = {}
_FS_OPTIONS: dict[str, Callable[[], dict[str, Any]]] = {}
#: A reader returns bytes [start, end) of the object at ``path`` in one request (the whole
#: object when start is None), raising FileNotFoundError if there is none. Optional per
#: scheme: fsspec's ``cat_file`` serves the others.
Reader = Callable[["RunStore", str, "int | None", "int | None"], Any]
_READERS: dict[str, Reader] = {}
#: schemes whose writer takes a list of buffers as they are (the others get them joined)
_TAKES_PARTS: set[str] = {"file"}
#: An explainer turns a scheme's client error that is the user's to fix (no or wrong
#: credentials, an unreachable endpoint, a missing bucket, no permission) into a StoreError
#: whose one-line message says what to fix, and returns any other error unchanged. RunStore
#: applies it to every operation (``_retry``), so reads, listings and deletes say it in one
#: line as writes do, instead of a client library's traceback.
Explainer = Callable[["RunStore", BaseException], BaseException]
_EXPLAINERS: dict[str, Explainer] = {}
#: Called once when a RunStore opens (not for ``child``): a scheme checks there what would
#: otherwise fail slowly on the first request (GCS: credentials that cannot be refreshed,
#: which gcsfs retries for ~35 s before giving up).
Opener = Callable[["RunStore"], None]
_OPENERS: dict[str, Opener] = {}


def register_scheme(
    scheme: str,
    writer: Writer,
    fs_options: Callable[[], dict[str, Any]] | None = None,
    reader: Reader | None = None,
    takes_parts: bool = False,
    explain: Explainer | None = None,
    on_open: Opener | None = None,
) -> None:
    """Make ``scheme://`` usable as a run store (``fs_options`` gives fsspec defaults;
    ``reader`` replaces fsspec's for reads of known extent: see ``RunStore.get``;
    ``takes_parts``: the writer is given a list of buffers unjoined; ``explain``: see
    :data:`Explainer`; ``on_open``: see :data:`Opener`)."""
    _WRITERS[scheme] = writer
    if explain is not None:
        _EXPLAINERS[scheme] = explain
    if on_open is not None:
        _OPENERS[scheme] = on_open
    if takes_parts:
        _TAKES_PARTS.add(scheme)
    if fs_options is not None:
        _FS_OPTIONS[scheme] = fs_options
    if reader is not None:
        _READERS[scheme] = reader


#: cloud schemes register themselves when their module is imported (lazily: their SDKs are
#: optional extras, and ``import crf`` must not need them).
_LAZY_SCHEMES = {
    "s3": "crf.store.s3",
    "gs": "crf.store.gcs",
    "gcs": "crf.store.gcs",
    "hf": "crf.store.hf",
}


def supported_schemes() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*_WRITERS, *_LAZY_SCHEMES]))


def _ensure_scheme(scheme: str) -> None:
    if scheme in _WRITERS or scheme not in _LAZY_SCHEMES:
        return
    from crf.executors.adaptors import MissingSDK, import_with_extra

    extra = {"gs": "gcs", "gcs": "gcs"}.get(scheme, scheme)
    try:
        import_with_extra(_LAZY_SCHEMES[scheme], extra)
    except MissingSDK as e:
        raise StoreNotWritable(
            f"{scheme}:// stores need an optional dependency ({e.name or e}): "
            f"pip install 'composer-replication[{extra}]'"
        ) from None


def _put_file(
    store: RunStore, path: str, data: Data, exclusive: bool, durable: bool = True
) -> bool:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{_TMP_MARK}{uuid.uuid4().hex}")
    with open(tmp, "wb", buffering=0) as f:
        for part in data if isinstance(data, list | tuple) else (data,):
            view = memoryview(part).cast("B")
            while view:  # an unbuffered write may be short
                view = view[f.write(view) :]
        if durable:
            os.fsync(f.fileno())
    try:
        if exclusive:
            try:
                os.link(tmp, path)  # atomic create-if-absent of a complete file
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _put_memory(store: RunStore, path: str, data: bytes, exclusive: bool) -> bool:
    with _MEMORY_LOCK:
        if exclusive and store.fs.exists(path):
            return False
        store.fs.pipe_file(path, bytes(data))
        return True


@functools.cache
def _garbled_in_transit() -> tuple[type[BaseException], ...]:
    """Client errors that say a response was damaged or cut short on the way: its checksum
    did not match, or the body ended early. The stored object is usually intact and a new
    request gets it whole (seen against moto under load: one read of a 32 MB reduced shard
    failed its CRC32 check). botocore raises these as its own exceptions, not OSErrors, so
    without this one bad response would fail the whole round."""
    from crf.executors.adaptors import MissingSDK, botocore

    try:
        exc = botocore.load("exceptions")
    except MissingSDK:  # no S3 extra installed: nothing of this kind can be raised
        return ()
    return (exc.FlexibleChecksumError, exc.IncompleteReadError, exc.ResponseStreamingError)


#: ``scheme:rest`` without ``//``: a URL missing a slash when the scheme is a protocol fsspec
#: knows (``s3:/bucket``, ``file:runs``); a bare path is anything else
_SCHEME_TYPO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)(.*)$", re.DOTALL)


def check_uri(uri: str, what: str = "store") -> str:
    """``uri`` unchanged, or StoreURIError saying what to fix: blank; a known protocol with
    one slash or none (``s3:/b``, ``hf:/x``, ``file:x``), which a bare-path reading would
    silently turn into a local folder named ``s3:``; or credentials written into the URL
    (``s3://KEY:SECRET@bucket``), which would then be printed in plans, errors and run.json.
    Every store URI goes through here (:func:`split_uri`), so every command and the SDK
    refuse the same things in the same words. The message never repeats credentials."""
    if not uri.strip():
        raise StoreURIError(
            f"the {what} is blank: give a folder or a URL (s3://BUCKET/PREFIX, gs://..., hf://...)"
        )
    scheme, sep, rest = uri.partition("://")
    if sep and scheme != "file" and "@" in rest.split("/", 1)[0]:
        raise StoreURIError(
            f"the {what} URL holds credentials (USER:SECRET@ before the bucket): remove them "
            f"and give them through the environment or a profile (docs/stores.md), e.g. "
            f"{scheme}://{rest.split('@', 1)[1].split('/', 1)[0]}/..."
        )
    typo = None if sep else _SCHEME_TYPO.match(uri)
    if typo and typo.group(1).lower() in _known_protocols():
        return _refuse_typo(uri, typo.group(1), typo.group(2), what)
    if sep and scheme != scheme.lower() and scheme.lower() in _known_protocols():
        raise StoreURIError(
            f"the {what} {uri!r} spells its scheme in capitals, which no client reads: did you "
            f"mean {scheme.lower()}://{rest}?"
        )
    if sep and scheme in _BUCKET_SCHEMES:
        _check_bucket(uri, scheme, rest.split("/", 1)[0], what)
    return uri


#: schemes whose URL starts with a bucket name (S3 and GCS naming rules: letters, digits,
#: ``.``, ``-`` and, on GCS, ``_``; older S3 buckets may hold capitals)
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs"})
_BUCKET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_bucket(uri: str, scheme: str, bucket: str, what: str) -> None:
    """StoreURIError for a bucket URL with no bucket (``s3://``, ``s3:///runs``), which
    would otherwise become a path such as ``s3:/RUN`` or another bucket, or one with
    characters no bucket name holds (a space), which GCS answers only after ~30 s of
    retries."""
    if not bucket:
        raise StoreURIError(f"the {what} {uri!r} names no bucket: write {scheme}://BUCKET/PREFIX")
    if not _BUCKET_NAME.match(bucket):
        bad = "".join(dict.fromkeys(c for c in bucket if not re.match(r"[A-Za-z0-9._-]", c)))
        shown = ", ".join(repr(c) for c in bad) or repr(bucket[0])
        raise StoreURIError(
            f"the {what} {uri!r}: {bucket!r} is not a bucket name (it holds {shown}); bucket "
            "names are lowercase letters, digits, '.', '-' and '_', starting with a letter or "
            "digit"
        )


def _refuse_typo(uri: str, scheme: str, rest: str, what: str) -> NoReturn:
    """StoreURIError for ``scheme:rest`` (no ``//``), with the URL it most likely means."""
    if scheme.lower() == "file" and not rest.startswith("/"):
        meant = f"a plain path ({rest or '.'}) or file:///ABSOLUTE/PATH"
    elif scheme.lower() == "file":
        meant = f"file://{rest}"
    else:
        meant = f"{scheme.lower()}://{rest.lstrip('/')}"
    raise StoreURIError(
        f"the {what} {uri!r} looks like a URL missing a slash: did you mean {meant}? (a local "
        f"folder with that name: write ./{uri})"
    )


@functools.cache
def _known_protocols() -> frozenset[str]:
    """The protocols fsspec knows (s3, gs, hf, file, memory, az, http, ...), and ours."""
    return frozenset({*fsspec.available_protocols(), *_LAZY_SCHEMES, *_WRITERS})


def split_uri(uri: str) -> tuple[str, str]:
    """Return (scheme, path) for a store URI; a bare path means ``file`` (:func:`check_uri`
    refuses what is not what the user meant)."""
    check_uri(uri)
    if "://" not in uri:
        return "file", os.path.abspath(os.path.expanduser(uri))
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return "file", os.path.abspath(os.path.expanduser(rest or "/"))
    return scheme, rest


def normalize_uri(uri: str) -> str:
    """Canonical form: ``file:///abs/path`` for local folders, scheme kept otherwise."""
    scheme, path = split_uri(uri)
    if scheme == "file":
        return "file://" + path
    return f"{scheme}://{path.rstrip('/')}"


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts if p]])


class RunStore:
    """A folder in an object store with atomic, integrity-friendly primitives."""

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retries: int = 4,
        retry_backoff_s: float = 0.2,
    ) -> None:
        scheme, path = split_uri(uri)
        _ensure_scheme(scheme)
        if scheme not in _WRITERS:
            raise StoreNotWritable(
                f"store scheme {scheme!r} is not supported (in {uri!r}); "
                f"use one of: {', '.join(s + '://' for s in supported_schemes())}"
            )
        self.scheme = scheme
        self.uri = normalize_uri(uri)
        options = {**_FS_OPTIONS.get(scheme, dict)(), **(storage_options or {})}
        self.fs = fsspec.filesystem(scheme, **options)
        self.root = path.rstrip("/") if scheme != "memory" else "/" + path.strip("/")
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        opener = _OPENERS.get(scheme)
        if opener is not None:
            try:
                opener(self)
            except StoreError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised, explained when it is known
                self._raise_explained(e)

    def __repr__(self) -> str:
        return f"RunStore({self.uri!r})"

    # ---------------------------------------------------------------- paths
    def path(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.root}/{key}" if key else self.root

    def child(self, prefix: str) -> RunStore:
        """A RunStore rooted at a sub-folder (same filesystem object)."""
        sub = RunStore.__new__(RunStore)
        sub.__dict__.update(self.__dict__)
        sub.root = self.path(prefix)
        sub.uri = join_uri(self.uri, prefix)
        return sub

    # ---------------------------------------------------------------- retry
    def explain(self, e: BaseException) -> BaseException:
        """``e`` as a one-line StoreError if the scheme knows it for a mistake the user can
        fix (see :data:`Explainer`); ``e`` itself otherwise."""
        explainer = _EXPLAINERS.get(self.scheme)
        if explainer is None or isinstance(e, StoreError):
            return e
        return explainer(self, e)

    def _raise_explained(self, e: BaseException) -> NoReturn:
        explained = self.explain(e)
        if explained is e:
            raise e
        raise explained from None

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient errors (not 'not found') with backoff; an error that
        is the user's to fix is raised as the scheme explains it (:meth:`explain`)."""
        try:
            return self._retry_raw(what, fn)
        except (FileNotFoundError, FileExistsError, ObjectNotFound, IsADirectoryError):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised, explained when it is known
            self._raise_explained(e)

    def _retry_raw(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient errors (not 'not found') with backoff. A response
        damaged on the way (see :func:`_garbled_in_transit`) is transient too; if every try
        fails so, the error becomes a :class:`StoreError` that callers handle like any
        other store failure."""
        delay = self.retry_backoff_s
        transit = _garbled_in_transit() if self.scheme not in ("file", "memory") else ()
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (FileNotFoundError, FileExistsError, ObjectNotFound, IsADirectoryError):
                raise
            except (OSError, *transit) as e:
                if attempt == self.retries:
                    if isinstance(e, OSError):
                        raise
                    raise StoreError(
                        f"{what}: {type(e).__name__} on every one of {self.retries + 1} tries ({e})"
                    ) from e
                if not isinstance(e, OSError):
                    log.warning("%s: %s; trying again", what, e)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    # ---------------------------------------------------------------- writes
    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        """Publish ``data`` (bytes, or a list of buffers) at ``key`` atomically, replacing
        any previous object. ``durable=False``: the object may be lost if the machine crashes
        (no fsync on file://; object stores are always durable) - for transient objects that
        carry their own checksum, like an exchange round's shards."""
        kw = {} if durable else {"durable": False}
        self._retry(f"put {key}", lambda: self._put(self.path(key), data, exclusive=False, **kw))

    def put_if_absent(self, key: str, data: Data, *, durable: bool = True) -> bool:
        """Create ``key`` only if nothing is there. True if this call created it."""
        kw = {} if durable else {"durable": False}
        return self._retry(
            f"create {key}", lambda: self._put(self.path(key), data, exclusive=True, **kw)
        )

    def _put(self, path: str, data: Data, *, exclusive: bool, durable: bool = True) -> bool:
        if self.scheme == "file":
            return _put_file(self, path, data, exclusive, durable)
        if isinstance(data, list | tuple) and self.scheme not in _TAKES_PARTS:
            data = b"".join(data)
        return _WRITERS[self.scheme](self, path, data, exclusive)

    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, jsonsafe.dumps(obj, indent=1, sort_keys=True, default=str).encode())

    def put_json_if_absent(self, key: str, obj: Any) -> bool:
        return self.put_if_absent(key, jsonsafe.dumps(obj, indent=1, sort_keys=True).encode())

    def delete(self, key: str) -> None:
        """Remove a key or a whole prefix; missing is fine."""
        path = self.path(key)

        def _rm() -> None:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

        self._retry(f"delete {key}", _rm)

    # ---------------------------------------------------------------- reads
    def get(self, key: str, *, size_hint: int | None = None) -> bytes:
        """The object's bytes. ``size_hint``: about how big it is, if the caller knows (any
        value says "an object, not a folder, and read it whole"). Where the scheme has a
        reader of its own (S3: ``crf.store.s3``), such a read is that reader's one request:
        s3fs would ask for the object's size (a HEAD) first, to choose between one GET and
        concurrent ranged GETs, answer a missing object with a HEAD and a LIST, and hold the
        body twice while reading it."""
        reader = _READERS.get(self.scheme) if size_hint is not None else None
        # a hint of a sizeable object: read it as the range from 0 (a reader may then split
        # it into parallel ranged requests: S3's does); 0 (a JSON record): one plain read
        start = 0 if reader is not None and size_hint else None
        return self._retry(f"get {key}", lambda: self._read(key, reader, start, None))

    def _read(self, key: str, reader: Reader | None, start: int | None, end: int | None) -> bytes:
        """One read attempt of ``key`` (whole when start is None), a missing object or a
        folder answered as :class:`ObjectNotFound`."""
        path = self.path(key)
        try:
            if reader is not None:
                return reader(self, path, start, end)
            if start is None:
                return self.fs.cat_file(path)
            return self.fs.cat_file(path, start=start, end=end)
        except (FileNotFoundError, KeyError):
            raise ObjectNotFound(f"{self.uri}/{key.strip('/')} does not exist") from None
        except IsADirectoryError:
            raise ObjectNotFound(f"{self.uri}/{key.strip('/')} is a folder") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object ``key`` in one request (an HTTP ``Range`` read
        on object stores, a seek on a file system): shorter if the object ends first. The
        exchange packs a replica's contribution shards into one object and each reader
        fetches just its shard's range, so an upload is one PUT instead of one per shard."""
        if start < 0 or end < start:
            raise ValueError(f"get_range {key}: bad range [{start}, {end})")

        def _get() -> bytes:
            if end == start:
                if not self.fs.isfile(self.path(key)):
                    raise ObjectNotFound(f"{self.uri}/{key.strip('/')} does not exist")
                return b""
            return self._read(key, _READERS.get(self.scheme), start, end)

        return self._retry(f"get {key} [{start}:{end}]", _get)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get(key, size_hint=0))

    def exists(self, key: str) -> bool:
        return bool(self._retry(f"exists {key}", lambda: self.fs.exists(self.path(key))))

    def object_exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (an object, not a folder). On S3 that is one
        HEAD: fsspec's ``exists`` also lists the prefix when the HEAD misses, to find
        folders, which doubles the requests of every poll for an object not there yet."""
        if self.scheme != "s3":
            return self.exists(key)
        bucket, name, _ = self.fs.split_path(self.path(key))

        def _head() -> bool:
            try:
                self.fs.call_s3("head_object", Bucket=bucket, Key=name)
                return True
            except FileNotFoundError:
                return False

        return self._retry(f"exists {key}", _head)

    def usage(self, prefix: str = "") -> tuple[int, int]:
        """(objects, bytes) under ``prefix`` (the whole store when empty): what a delete of
        it removes."""
        path = self.path(prefix)

        def _du() -> tuple[int, int]:
            try:
                found = self.fs.find(path, detail=True)
            except FileNotFoundError:
                return 0, 0
            files = [i for i in found.values() if i.get("type") != "directory"]
            return len(files), sum(int(i.get("size") or 0) for i in files)

        return self._retry(f"size of {prefix or 'the run'}", _du)

    def list(self, prefix: str = "") -> list[str]:
        """Names of the immediate children of ``prefix`` (files and folders), sorted."""
        path = self.path(prefix)

        def _ls() -> list[str]:
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            names = []
            for e in entries:
                name = str(e).rstrip("/").rsplit("/", 1)[-1]
                if name and not name.startswith(_TMP_MARK) and str(e).rstrip("/") != path:
                    names.append(name)
            return sorted(set(names))

        return self._retry(f"list {prefix}", _ls)

    def wait_for(
        self,
        keys: Iterable[str],
        timeout_s: float,
        *,
        poll_s: float = 0.02,
        max_poll_s: float = 0.5,
    ) -> None:
        """Block until every key exists; StoreTimeout names the missing ones."""
        missing = list(keys)

        def _check() -> bool:
            nonlocal missing
            missing = [k for k in missing if not self.object_exists(k)]
            return not missing

        if not wait_until(_check, timeout_s, poll_s=poll_s, max_poll_s=max_poll_s):
            raise StoreTimeout(
                f"timed out after {timeout_s:.1f}s waiting for {len(missing)} object(s) in "
                f"{self.uri}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )

    # ---------------------------------------------------------------- checks
    def missing_bucket(self) -> str | None:
        """For a store in a bucket (s3://, gs://): a line saying the bucket does not exist,
        else None (it exists, it cannot be told, or the scheme has no buckets). Reading a
        missing bucket lists nothing, so without this a misspelt bucket in ``crf runs`` or
        ``crf status`` would read as a store with no runs."""
        if self.scheme not in _BUCKET_SCHEMES:
            return None
        bucket = self.root.strip("/").split("/", 1)[0]
        try:
            if self._retry("find the bucket", lambda: self.fs.exists(bucket)):
                return None
        except Exception:  # noqa: BLE001 - it cannot be told: say nothing more
            return None
        return (
            f"bucket {self.scheme}://{bucket} does not exist (or these credentials cannot see "
            "it): check the bucket's name in --store"
        )

    def check_writable(self) -> None:
        """Write and delete a probe object; StoreNotWritable says what to fix."""
        key = f".crf-probe-{uuid.uuid4().hex}"
        try:
            self.put(key, b"probe")
            if self.get(key) != b"probe":
                raise StoreNotWritable(f"store {self.uri} did not read back what was written")
            self.delete(key)
        except StoreNotWritable:
            raise
        except Exception as e:  # noqa: BLE001 - any client's error (permission, missing bucket,
            # read-only fs...) has one answer here: not writable, and why
            raise StoreNotWritable(
                f"cannot write to store {self.uri}: {type(e).__name__}: {e}. "
                "Check the path/bucket exists and that you may write there."
            ) from None


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    *,
    poll_s: float = 0.02,
    max_poll_s: float = 0.5,
) -> bool:
    """Poll ``predicate`` with exponential backoff; True as soon as it holds, False at deadline."""
    deadline = time.monotonic() + timeout_s
    delay = poll_s
    while True:
        if predicate():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(delay, max(0.0, deadline - now)))
        delay = min(delay * 1.6, max_poll_s)


register_scheme("file", _put_file)
register_scheme("memory", _put_memory)
