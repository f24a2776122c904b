"""bench/exchange.py measures what the issue's exchange targets are about, with real replica
processes over a file:// store and over S3 (moto): bytes per replica and the peak extra
memory of a round. Only sizes are asserted here; the times are the benchmark's business
(this machine is noisy)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import exchange  # noqa: E402

from tests import cloud_servers  # noqa: E402

moto_s3 = cloud_servers.moto_s3  # the S3 fixtures, visible to this module's tests
s3_env = cloud_servers.s3_env


def test_peak_memory_reset_sees_a_new_allocation() -> None:
    base = exchange._reset_peak()
    buf = bytearray(64 << 20)  # zero pages are only resident once touched
    buf[::4096] = b"x" * len(buf[::4096])
    grown = exchange._peak() - base
    del buf
    assert grown >= 60 << 20
    # after a reset the peak is today's RSS again, not the old high-water mark
    base = exchange._reset_peak()
    assert exchange._peak() - base < 16 << 20


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_crf_round_moves_and_holds_what_the_targets_allow(tmp_path: Path, n: int) -> None:
    mb = 32
    crf = exchange.measure("crf", f"file://{tmp_path}/crf", n, mb, 2, "float32")
    floor = exchange.measure("floor", f"file://{tmp_path}/floor", n, mb, 2, "float32")
    # per replica: P up, 2(N-1)/N P down (the naive design downloads (N-1) P)
    assert crf["up"] == pytest.approx(1.0, abs=0.01)
    assert crf["down"] == pytest.approx(2 * (n - 1) / n, abs=0.01)
    # peak extra memory of a round <= 2 P; the floor (one read of P) holds about P
    assert crf["mem"] <= 2.0 and crf["mem1"] <= 2.0, crf  # also the first round
    assert 0.9 <= floor["mem"] <= 1.2, floor


@pytest.mark.slow
def test_crf_round_over_s3_holds_what_the_targets_allow(s3_env: cloud_servers.MotoS3) -> None:
    """The same over S3 (moto on 127.0.0.1): replica processes read into one buffer and
    write without copies (crf.store.s3), so a round stays within 2·P of extra memory, the
    first round included."""
    uri = f"s3://{s3_env.new_bucket()}/bench"
    n, mb = 4, 16
    crf = exchange.measure("crf", uri, n, mb, 2, "float32")
    assert crf["up"] == pytest.approx(1.0, abs=0.01)
    assert crf["down"] == pytest.approx(2 * (n - 1) / n, abs=0.01)
    assert crf["mem"] <= 2.0 and crf["mem1"] <= 2.0, crf
