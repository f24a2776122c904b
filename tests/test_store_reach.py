"""crf/store/reach.py: a definite "no" from the network is told at once; anything else is
left to the store client."""

from __future__ import annotations

import socket

import pytest

from crf.store.reach import refusal


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


def test_a_refused_connection_and_an_unknown_host_are_told() -> None:
    assert refusal(f"http://127.0.0.1:{_closed_port()}") == "connection refused"
    assert refusal("http://no-such-host.invalid:4443") == "host not found"


def test_an_endpoint_that_listens_is_not_refused() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert refusal(f"http://127.0.0.1:{port}") is None
        assert refusal(f"127.0.0.1:{port}") is None  # a host without a scheme


def test_through_a_proxy_or_unparsable_nothing_is_decided(monkeypatch) -> None:
    assert refusal("http://127.0.0.1:notaport") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    assert refusal(f"http://127.0.0.1:{_closed_port()}") is None
