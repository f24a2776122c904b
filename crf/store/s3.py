"""``s3://`` run stores through s3fs (install ``composer-replication[s3]``).

Guarantees (see docs/stores.md):

* ``put`` is one ``PutObject`` (or, above ``2 * MULTIPART_CHUNKSIZE``, a multipart upload that
  becomes visible only at ``CompleteMultipartUpload``): a reader sees the old object, or the
  whole new one, never a part.
* ``put_if_absent`` is S3's conditional write, ``If-None-Match: *`` (on ``PutObject``, or on
  ``CompleteMultipartUpload`` for large objects): S3 refuses the write with 412 when the key
  exists, atomically on the server. A retried request whose first attempt had in fact landed
  also gets 412, so each create carries a random ``x-amz-meta-crf-writer`` token and a 412 is
  answered by one ``HeadObject``: the token tells whether the object there is this call's.

Credentials and the endpoint come from boto's standard chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws``, an instance
or task role; ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for S3-compatible services).
Nothing here logs or prints them.
"""

from __future__ import annotations

import asyncio
import bisect
import io
import os
from typing import Any

import fsspec.asyn
import s3fs
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from crf.store import client_logs
from crf.store.conditional import (
    WRITER_META,
    created_by,
    require_create_mode,
    tokened_put,
    uncached_listings,
)
from crf.store.errors import StoreNotWritable
from crf.store.run_store import RunStore, register_scheme

#: objects of at least twice this size go up as a multipart upload (parts of this size)
MULTIPART_CHUNKSIZE = 50 * 2**20


require_create_mode(s3fs.S3FileSystem, "s3fs", s3fs.__version__)
client_logs.install()


class S3Unreachable(StoreNotWritable, ConnectionError):
    """The S3 endpoint could not be reached (a ConnectionError, so RunStore retries it)."""


def _endpoint(store: RunStore) -> str:
    return (
        getattr(store.fs, "endpoint_url", None)
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "the AWS default endpoint"
    )


def _client_error(e: BaseException) -> ClientError | None:
    """The botocore ClientError behind an s3fs-translated exception, if any."""
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, ClientError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _precondition_failed(e: BaseException) -> bool:
    ce = _client_error(e)
    if ce is None:
        return False
    err = ce.response.get("Error", {})
    status = ce.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return err.get("Code") == "PreconditionFailed" or status == 412


def _split(store: RunStore, path: str) -> tuple[str, str]:
    bucket, key, _ = store.fs.split_path(path)
    return bucket, key


def _created_by(store: RunStore, path: str, token: str) -> bool:
    """After a 412: is the object at ``path`` the one this call (token) created?"""
    bucket, key = _split(store, path)
    return created_by(
        lambda: store.fs.call_s3("head_object", Bucket=bucket, Key=key).get("Metadata"), token
    )


def _not_writable(store: RunStore, path: str, e: BaseException) -> BaseException:
    """Turn configuration errors into StoreNotWritable saying what to fix; others unchanged."""
    bucket, _ = _split(store, path)
    where = f"s3://{bucket} (endpoint: {_endpoint(store)})"
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return StoreNotWritable(
            f"no usable AWS credentials for {where}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones), or AWS_PROFILE "
            "with ~/.aws/credentials, or run where an instance/task role is attached"
        )
    if isinstance(e, EndpointConnectionError | ConnectTimeoutError):
        return S3Unreachable(
            f"cannot reach the S3 endpoint for {where}: check AWS_ENDPOINT_URL (or the "
            "endpoint_url storage option), the region and the network"
        )
    if isinstance(e, ValueError) and str(e).startswith("Invalid endpoint"):
        endpoint = _endpoint(store)
        return StoreNotWritable(
            f"the S3 endpoint {endpoint!r} is not a URL: give it with its scheme, e.g. "
            f"AWS_ENDPOINT_URL=http://{endpoint} (or https://)"
        )
    if isinstance(e, FileNotFoundError):  # PutObject only 404s for NoSuchBucket
        return StoreNotWritable(
            f"S3 bucket {bucket!r} does not exist at {_endpoint(store)}: create it (e.g. "
            f"`aws s3 mb s3://{bucket}`) or fix the bucket in the run URI"
        )
    if isinstance(e, PermissionError):
        return StoreNotWritable(
            f"access denied to {where}: the credentials in use may not read or write there "
            "(s3:GetObject, s3:PutObject, s3:ListBucket) or are invalid; check the IAM/bucket "
            "policy and which credentials boto picks up (env vars, AWS_PROFILE, role)"
        )
    return e


#: objects at least this big go up as a PartsBody even when they are one buffer
STREAM_FROM = 1 << 20


class PartsBody(io.RawIOBase):
    """Buffers read one after another as one seekable file, without joining them.

    A PUT's body on S3. Given ``bytes``, the client hands them to asyncio's transport, which
    (Python 3.11) copies what the socket did not take at once into its own buffer: a second
    copy of the object; a list of buffers (a tensor frame's header and the tensor's own
    memory) would first be joined into a third. Read as a file, the body goes out in small
    chunks and neither copy is made (measured against moto: a 32 MB frame put as a list
    peaked at +64 MB, as this body at +0 MB, in the same time as one bytes object, which
    peaks at +32 MB). Slicing (s3fs cuts a multipart upload's parts so) gives a view.
    """

    def __init__(self, parts: list[Any], start: int = 0, end: int | None = None) -> None:
        super().__init__()
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._starts = [0]
        for p in self._parts:
            self._starts.append(self._starts[-1] + len(p))
        total = self._starts[-1]
        self._lo, self._hi = start, total if end is None else min(end, total)
        self._pos = self._lo

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, sl: slice) -> PartsBody:
        a, b, step = sl.indices(len(self))
        if step != 1:
            raise ValueError("PartsBody slices must be contiguous")
        return PartsBody(self._parts, self._lo + a, self._lo + max(a, b))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos - self._lo

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: len(self)}[whence]
        self._pos = self._lo + min(max(0, base + offset), len(self))
        return self.tell()

    def read(self, size: int = -1) -> Any:
        """Up to ``size`` bytes; within one buffer a view of it, not a copy (the HTTP client
        reads the body 256 KiB at a time and only writes what it gets to its socket)."""
        left = self._hi - self._pos
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        lo = self._pos - self._starts[i]
        if lo + n <= len(self._parts[i]):
            self._pos += n
            return self._parts[i][lo : lo + n]
        out = bytearray(n)
        return bytes(memoryview(out)[: self.readinto(out)])

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        want = min(len(out), self._hi - self._pos)
        done = 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while done < want:
            part, start = self._parts[i], self._starts[i]
            lo = self._pos - start
            k = min(len(part) - lo, want - done)
            out[done : done + k] = part[lo : lo + k]
            done += k
            self._pos += k
            i += 1
        return done


def _attempt(store: RunStore, path: str, data: Any, token: str | None) -> bool:
    fs = store.fs
    if isinstance(data, list | tuple):
        data = PartsBody(list(data))  # a fresh one per attempt: it starts at 0
    elif len(data) >= STREAM_FROM:
        data = PartsBody([data])
    if token is None:
        fs.pipe_file(path, data, chunksize=MULTIPART_CHUNKSIZE)
        return True
    try:
        fs.pipe_file(
            path,
            data,
            chunksize=MULTIPART_CHUNKSIZE,
            mode="create",  # s3fs: IfNoneMatch="*" on PutObject / CompleteMultipartUpload
            Metadata={WRITER_META: token},
        )
        return True
    except FileExistsError:
        return _created_by(store, path, token)
    except OSError as e:
        if _precondition_failed(e):  # a 412 s3fs did not translate to FileExistsError
            return _created_by(store, path, token)
        raise


#: a body is copied into its buffer this much at a time
READ_CHUNK = 1 << 20
#: a ranged read longer than this goes as ranged GETs of this size, in parallel
RANGE_PIECE = 16 << 20
#: ranged GETs of one read in flight at once
RANGE_STREAMS = 8


async def _read_into_buffer(
    store: RunStore, path: str, start: int | None, end: int | None
) -> bytearray:
    """One object (``start`` None: one plain GetObject) or bytes [start, end) of it, each
    body copied as it arrives into one buffer. s3fs's ``cat_file`` reads a body with
    aiohttp's ``read()``, which keeps every received chunk and then joins them: twice the
    object in memory for a moment. Here it is the object once (plus one chunk), which is
    what keeps a replica's exchange within 2·P of extra memory with several shards coming
    down at once.

    A range (``end`` None: to the object's end) is read as GETs of :data:`RANGE_PIECE`
    bytes, :data:`RANGE_STREAMS` at a time: one GET stream of a large object is far below
    what an instance can pull from S3, and an exchange of few replicas reads few, large
    parts. The first GET's answer gives the object's size (``Content-Range``); the other
    pieces follow in parallel, each on the same version (``If-Match`` its ETag: an object
    replaced meanwhile fails the read, which is then tried again whole). A range that
    starts past the end of the object reads as empty (the caller's checks then say the
    object is too short)."""
    fs = store.fs
    bucket, key = _split(store, path)

    async def get(lo: int | None, hi: int | None, **kw: Any) -> Any:
        if lo is not None:
            kw["Range"] = f"bytes={lo}-{'' if hi is None else hi - 1}"
        return await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)

    first_end = None if start is None else start + RANGE_PIECE
    if end is not None and first_end is not None:
        first_end = min(end, first_end)
    try:
        resp = await get(start, first_end)
    except OSError as e:
        ce = _client_error(e)
        if ce is not None and ce.response.get("Error", {}).get("Code") == "InvalidRange":
            return bytearray()
        raise
    first = int(resp["ContentLength"])
    lo = start or 0
    total = _object_size(resp, lo + first)
    stop = total if end is None else min(end, total)
    if start is None or stop <= lo + first:  # all of it in one answer
        stop = lo + first
    buf = bytearray(stop - lo)
    view = memoryview(buf)
    streams = asyncio.Semaphore(RANGE_STREAMS)
    same = {"IfMatch": resp["ETag"]} if resp.get("ETag") else {}

    async def piece(a: int, b: int) -> None:
        async with streams:
            await _body_into(await get(a, b, **same), view[a - lo : b - lo])

    rest = [(a, min(a + RANGE_PIECE, stop)) for a in range(lo + first, stop, RANGE_PIECE)]
    done = await asyncio.gather(
        _body_into(resp, view[:first]), *(piece(a, b) for a, b in rest), return_exceptions=True
    )
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome
    return buf


def _object_size(resp: dict[str, Any], default: int) -> int:
    """The whole object's size from a ranged answer's ``Content-Range`` (``bytes a-b/n``);
    ``default`` for an answer without one (the server sent the whole object)."""
    rng = resp.get("ContentRange") or ""
    _, _, size = rng.rpartition("/")
    return int(size) if size.isdigit() else default


async def _body_into(resp: dict[str, Any], view: memoryview) -> None:
    """Copy one GET's body into ``view`` (its Content-Length bytes) as it arrives."""
    body = resp["Body"]
    try:
        size = int(resp["ContentLength"])
        if size != len(view):
            raise IncompleteReadError(actual_bytes=size, expected_bytes=len(view))
        pos = 0
        while pos < size:
            got = await body.readinto(view[pos : pos + READ_CHUNK])
            if not got:
                raise IncompleteReadError(actual_bytes=pos, expected_bytes=size)
            pos += got
    finally:
        body.close()


def _read_s3(store: RunStore, path: str, start: int | None, end: int | None) -> bytearray:
    return fsspec.asyn.sync(store.fs.loop, _read_into_buffer, store, path, start, end)


def _put_s3(store: RunStore, path: str, data: Any, exclusive: bool) -> bool:
    return tokened_put(
        lambda token: _attempt(store, path, data, token),
        lambda e: _not_writable(store, path, e),
        S3Unreachable,
        exclusive,
    )


register_scheme(
    "s3",
    _put_s3,
    uncached_listings,
    _read_s3,
    takes_parts=True,
    explain=lambda store, e: _not_writable(store, store.root, e),
)
