"""HeartbeatSender: heartbeats written off the training thread, the newest one winning."""

from __future__ import annotations

import threading
from typing import Any

from crf.replica.beacon import HeartbeatSender


def test_send_returns_at_once_and_the_newest_beat_lands() -> None:
    """While the store holds one write, send() does not wait; the beats queued meanwhile
    collapse into the newest, which is written next."""
    release = threading.Event()
    written: list[dict[str, Any]] = []

    def write(beat: dict[str, Any]) -> None:
        release.wait(10)
        written.append(beat)

    sender = HeartbeatSender(write)
    sender.send({"step": 0})
    for step in range(1, 50):  # all while the first write is held
        sender.send({"step": step})
    assert not sender.flush(timeout_s=0.05)  # the store is still holding the first
    release.set()
    assert sender.flush(timeout_s=10)
    sender.close()
    assert written[-1] == {"step": 49}
    assert len(written) <= 2


def test_a_failing_write_does_not_stop_the_sender() -> None:
    """The write callback's errors stay in the sender's thread; later beats are still
    written (the replica's callback logs and pauses; this one raises once)."""
    written: list[int] = []

    def write(beat: dict[str, Any]) -> None:
        if beat["step"] == 0:
            raise OSError("store down")
        written.append(beat["step"])

    sender = HeartbeatSender(write)
    sender.send({"step": 0})
    sender.flush(timeout_s=10)
    sender.send({"step": 1})
    sender.close()
    assert written == [1]
