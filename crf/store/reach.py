"""A quick look at whether an object store's endpoint answers at all, before a client's
own retries: gcsfs retries a refused connection six times with backoff (~17 s) inside each
request, and a look-up command that makes a few requests would keep a user who mistyped an
emulator's address waiting a minute for the same one line.

Only a definite answer counts: the name does not resolve, the host refuses the connection,
or there is no route to it. A connection that is merely slow to open proves nothing and is
left to the client (and its retries), and so is any endpoint reached through a proxy."""

from __future__ import annotations

import errno
import os
import socket
from urllib.parse import urlsplit

#: seconds to wait for a TCP connection before leaving the question to the client
CONNECT_TIMEOUT_S = 3.0
#: OSError numbers that are a final "no" from the network (not a slow "maybe")
_NO_ROUTE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED}
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _host_port(endpoint: str) -> tuple[str, int] | None:
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    if not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: the client says so itself
        return None
    return parts.hostname, port or (80 if parts.scheme == "http" else 443)


def refusal(endpoint: str) -> str | None:
    """Why ``endpoint`` (a URL, or a host as ``storage.googleapis.com``) cannot be reached
    (``"connection refused"``, ``"host not found"``...), or None when it answered or the
    answer is not definite."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None
    where = _host_port(endpoint)
    if where is None:
        return None
    try:
        with socket.create_connection(where, timeout=CONNECT_TIMEOUT_S):
            return None
    except socket.gaierror:
        return "host not found"
    except TimeoutError:
        return None
    except OSError as e:
        if e.errno in _NO_ROUTE:
            return os.strerror(e.errno).lower()
        return None
