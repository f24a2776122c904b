"""moto as an S3 emulator: the one fix its threaded server needs to behave like S3 for crf.

moto 5.2 honours ``If-None-Match: *`` on PutObject and on CompleteMultipartUpload, but checks
and stores without a lock on its threaded server, where real S3 makes the check atomic: two
racing conditional writers could both win (seen in the benchmark at N = 8 / 256 MB, where a
reader of the first write then got a body that failed its checksum). Used by the S3 test
fixture (tests/cloud_servers.py) and by bench/exchange.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def serialize_conditional_puts(
    lock: threading.Lock, patch: Callable[[Any, str, Any], None] = setattr
) -> None:
    """Make moto's conditional writes atomic: each write that carries ``If-None-Match`` runs
    under ``lock``; plain puts are left alone. ``patch`` installs the wrappers (the test
    fixture passes a MonkeyPatch's ``setattr`` so it can undo them)."""
    from moto.s3.responses import S3Response

    for name in ("put_object", "_key_response_post"):  # PutObject, CompleteMultipartUpload
        original = getattr(S3Response, name)

        def guarded(self: Any, *a: Any, _original: Any = original, **kw: Any) -> Any:
            if self.headers.get("If-None-Match") is None:
                return _original(self, *a, **kw)
            with lock:
                return _original(self, *a, **kw)

        patch(S3Response, name, guarded)


class _RangeOfKey:
    """A stored object as moto's range handling sees it: its length, and slices read from
    its buffer (a seek and a read of just that range, under the key's lock)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.contentsize)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, sl: slice) -> bytes:
        a, b, _ = sl.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(a)
            return self.key._value_buffer.read(max(0, b - a))

    def whole(self) -> bytes:
        return self[0 : len(self)]


def serve_ranges_from_the_range(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make moto read only the requested bytes for a ranged GET.

    moto answers ``GET`` with a ``Range`` header by reading the WHOLE object out of its
    buffer (a temporary file for objects over 5 MB) and slicing the copy, so every ranged
    read of a 56 MB object costs it 56 MB (or more) of copying. Real S3 serves a range at
    the cost of the range. crf's owners read their shard of each peer's packed contribution
    with a ranged GET (N - 1 per replica and round), the baselines read whole objects, so
    as shipped the emulator charges crf alone for its own artefact. Used by bench/exchange.py
    (``--moto-stock`` measures moto as shipped)."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    ranged = threading.local()
    value = FakeKey.value

    def lazy_value(self: Any) -> Any:
        if getattr(ranged, "on", False):
            return _RangeOfKey(self)
        return value.fget(self)

    key_response = S3Response.key_response

    def ranged_key_response(self: Any, request: Any, full_url: str, headers: Any) -> Any:
        ranged.on = request.method == "GET" and bool(request.headers.get("range"))
        try:
            status, out_headers, body = key_response(self, request, full_url, headers)
        finally:
            ranged.on = False
        if isinstance(body, _RangeOfKey):  # a Range moto answers with the whole object
            body = body.whole()
        return status, out_headers, body

    patch(FakeKey, "value", property(lazy_value, value.fset))
    patch(S3Response, "key_response", ranged_key_response)
