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
