"""bench/quality.py's byte accounting is measured, not assumed: the TCP_INFO reader sees the
bytes a socket really moved, and a small DDP run's comm hook counts every gradient byte the
ring all-reduce carries (the baseline DiLoCo's byte ratios are taken against)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import quality  # noqa: E402

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "seq_len": 32,
    "batch_size": 4,
    "corpus_sentences": 2000,
}


def test_tcp_bytes_sees_what_a_socket_moved() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with srv, socket.create_connection(srv.getsockname()) as c:
        a, _ = srv.accept()
        with a:
            before = quality.tcp_bytes()
            c.sendall(b"x" * 50_000)
            got = 0
            while got < 50_000:
                got += len(a.recv(65536))
            deadline = time.monotonic() + 5.0  # the ACK may trail the data (delayed ACK)
            after = quality.tcp_bytes()
            while after[0] - before[0] < 50_000 and time.monotonic() < deadline:
                time.sleep(0.01)
                after = quality.tcp_bytes()
    # both ends live in this process: 50 kB acked by one socket, 50 kB received by the other
    assert after[0] - before[0] == 50_000
    assert after[1] - before[1] == 50_000


@pytest.mark.slow
def test_ddp_bytes_are_counted_by_the_comm_hook() -> None:
    steps, n = 3, 2
    row = quality.run_ddp(quality.Setting(replicas=n, steps=steps, lm=TINY))
    params = row.extra["params"]
    # every parameter's fp32 gradient goes through the hook once per step
    assert row.extra["payload_bytes_per_step"] == 4 * params
    assert row.extra["allreduce_calls_per_step"] >= 1
    ring = 2 * (n - 1) / n * 4 * params * steps
    assert row.bytes_up == row.bytes_down == round(ring)
    assert row.bytes_total == 2 * round(ring)
    # gloo really moved at least the ring bound over TCP on every replica
    for sent, received in zip(
        row.extra["gloo_tcp_sent"], row.extra["gloo_tcp_received"], strict=True
    ):
        assert sent >= 0.99 * ring and received >= 0.99 * ring
    assert row.eval_loss < row.eval_loss_initial
