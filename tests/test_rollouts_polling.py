"""The pauses between looks at the store while trainers and workers wait for each other
(crf/rollouts/polling.py): short against short steps, backing off on a long wait."""

from __future__ import annotations

from crf.rollouts.polling import MIN_POLL_S, Poll


def pauses(poll: Poll, t0: float, upto: float) -> list[float]:
    """The pauses of one wait from t0 that lasts ``upto`` seconds."""
    out, now = [], t0
    while now < t0 + upto:
        p = poll.pause(now)
        out.append(p)
        now += p
    return out


def test_a_wait_overshoots_by_at_most_a_quarter() -> None:
    poll = Poll(first=0.05, cap=1.0)
    poll.start(now=0.0)
    got = pauses(poll, 0.0, 20.0)
    elapsed = 0.0
    for p in got:
        assert p <= max(MIN_POLL_S, 0.25 * elapsed, 0.05) + 1e-12
        elapsed += p
    assert max(got) == 1.0  # a long wait (a dead worker) backs off to the cap
    assert len(got) < 50  # about one look a second once long, not a hundred


def test_the_pauses_follow_the_steps_seen() -> None:
    """Against 0.1 s steps a pause is at most 25 ms; against 8 s steps it grows to the cap."""
    fast = Poll(first=0.05, cap=1.0)
    for i in range(10):
        fast.event(now=0.1 * i)
    assert abs(fast.interval - 0.1) < 1e-9
    fast.start(now=1.0)
    assert all(p <= 0.025 + 1e-12 for p in pauses(fast, 1.0, 0.1))

    slow = Poll(first=0.05, cap=1.0)
    for i in range(4):
        slow.event(now=8.0 * i)
    slow.start(now=40.0)
    assert max(pauses(slow, 40.0, 8.0)) == 1.0


def test_events_counted_together_give_the_interval_of_one() -> None:
    poll = Poll()
    poll.event(now=0.0)
    poll.event(count=4, now=2.0)
    assert abs(poll.interval - 0.5) < 1e-9
    poll.event(count=0, now=100.0)  # nothing happened: nothing learned
    assert abs(poll.interval - 0.5) < 1e-9
