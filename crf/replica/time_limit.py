"""A time limit on a call into the user's code (a reward function, a module's import, a
dataset's first rows), for the check before launch and for the replicas alike.

A thread cannot be killed in Python, so a call past its time is interrupted where it can be
and abandoned where it cannot: on the main thread (where TRL calls a plain ``def`` reward,
and where a reward may use signals, as math-verify's timeouts do) a watchdog thread signals
the main thread, whose handler raises :class:`TooSlow` into the call; elsewhere the call runs
in a daemon thread, left to end by itself (a daemon never holds the process at its exit).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

#: the signal that ends a call past its time (the main thread's; SIGALRM is left to the
#: user's code: math-verify times its parsing with it)
_TOO_SLOW_SIGNAL = getattr(signal, "SIGUSR1", None)
#: seconds between two signals to a call that did not stop at the first
_RESIGNAL_S = 1.0


class TooSlow(BaseException):
    """A call did not return in time (:func:`within`). A BaseException, so that the user's
    own ``except Exception`` does not swallow it."""


def in_time(read: Callable[[], Any], seconds: float) -> Any:
    """``read()``'s value, or None when it takes longer than ``seconds`` (its thread, a
    daemon, is left to end by itself: a download cannot be interrupted). Its exception is
    raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = read()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="crf-in-time", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return None
    if "error" in box:
        raise box["error"]
    return box["value"]


def within(
    run: Callable[[], Any],
    seconds: float,
    *,
    stuck: Callable[[], None] | None = None,
    grace_s: float = 30.0,
) -> Any:
    """``run()``'s value; TooSlow when it has not returned within ``seconds``. On the main
    thread ``run`` runs there: a watchdog thread signals the main thread, whose handler
    raises TooSlow into ``run``, again each second; past ``grace_s`` more (a call that
    catches every exception, or one blocked in C code) it calls ``stuck`` once, if given,
    which ends the process. Elsewhere (no signals but on the main thread), ``run`` runs in a
    daemon thread (:func:`in_time`), left to end by itself."""
    if threading.current_thread() is not threading.main_thread() or _TOO_SLOW_SIGNAL is None:
        boxed = in_time(lambda: (run(),), seconds)
        if boxed is None:
            raise TooSlow
        return boxed[0]
    done, late = threading.Event(), threading.Event()
    main = threading.get_ident()

    def interrupt(signum: int, frame: Any) -> None:
        if late.is_set() and not done.is_set():
            raise TooSlow

    def watch() -> None:
        if done.wait(seconds):
            return
        late.set()
        waited = 0.0
        while not done.is_set():
            signal.pthread_kill(main, _TOO_SLOW_SIGNAL)
            done.wait(_RESIGNAL_S)
            waited += _RESIGNAL_S
            if stuck is not None and waited >= grace_s and not done.is_set():
                stuck()
                return

    previous = signal.signal(_TOO_SLOW_SIGNAL, interrupt)
    watchdog = threading.Thread(target=watch, name="crf-time-limit", daemon=True)
    watchdog.start()
    try:
        return run()
    finally:
        done.set()
        watchdog.join()
        signal.signal(_TOO_SLOW_SIGNAL, previous)
