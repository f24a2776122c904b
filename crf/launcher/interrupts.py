"""SIGTERM taken as Ctrl-C while the launcher works, on the main thread.

SIGTERM is how a CI job's cancel, ``kill``, ``docker stop`` or a batch scheduler ask a
process to stop; its default action ends the process at once, without running ``finally``
blocks. The driver's watch (crf/launcher/driver.py) and the checks before launch
(crf/launcher/plan.py, which unpack ``--workdir`` into a temporary folder) take it as
KeyboardInterrupt instead, so they clean up and say what happened.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the driver watches, SIGTERM does what Ctrl-C does: cancel the replicas, write
    the summary (status ``cancelled``), exit 130; ``crf launch --resume`` continues the run.
    Its default action would end the driver without a word and leave the replicas training
    with nobody watching. The checks before launch use it too, so that their temporary
    copy of ``--workdir`` is removed on the way out. Only the main thread can take a signal
    (the SDK may launch from another one: there SIGTERM keeps its default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
