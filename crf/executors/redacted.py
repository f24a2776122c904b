"""``python -m crf.executors.redacted CMD [ARG ...]``: run a replica's command with every secret
it was given hidden from its output, at the source.

Why here and not in ``crf logs``: a platform stores what a container prints (HF Jobs, Modal,
CloudWatch for SageMaker), and the process that later reads it back may know neither the
caller's ``env=`` values (they lived in the launching driver's memory) nor a SageMaker secret
that was deleted when the run ended. The container does know them - they are in its own
environment, and ``CRF_SECRET_NAMES`` says which variables they are - so it replaces them with
``***`` before a byte leaves it. Every cloud backend's bootstrap ends here, for the default
``python -m crf.replica`` and for an ``--entrypoint`` alike.

The command runs as a child with its stdout and stderr each piped through a filter that
passes on whole lines (a line ends at ``\\n`` or ``\\r``) with the secrets replaced; signals
the platform sends (SIGTERM on a stop) are forwarded to it, and its exit status becomes ours.
With no secret in the environment the command simply replaces this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import BinaryIO

from crf.executors.secrets import redact, secret_values

#: a line longer than this is passed on in pieces (only a secret cut in two could then show)
MAX_LINE_BYTES = 1 << 20
#: signals a platform may send to stop or poke a container, forwarded to the command
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: after the command exits, how long its output may still drain (a child it left behind may
#: hold the pipe open forever)
DRAIN_S = 10.0


def redact_bytes(data: bytes, values: Iterable[str]) -> bytes:
    """``data`` with the secret values replaced; bytes that are not UTF-8 pass through."""
    return redact(data.decode("utf-8", "surrogateescape"), values).encode(
        "utf-8", "surrogateescape"
    )


def pump(fd: int, out: BinaryIO, values: set[str]) -> None:
    """Copy ``fd`` to ``out`` until EOF, whole lines at a time, secrets replaced. If ``out``
    breaks, the rest is read and dropped, so the command never blocks on a full pipe."""
    pending = b""

    def emit(data: bytes) -> None:
        nonlocal out_ok
        if out_ok:
            try:
                out.write(redact_bytes(data, values))
                out.flush()
            except (OSError, ValueError):
                out_ok = False

    out_ok = True
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut == 0:
            if len(pending) < MAX_LINE_BYTES:
                continue
            cut = len(pending)
        ready, pending = pending[:cut], pending[cut:]
        emit(ready)
    if pending:
        emit(pending)


def run(argv: Sequence[str]) -> int:
    """Run ``argv`` with its output redacted; return its exit status (128+N for signal N)."""
    values = secret_values()
    if not values:
        os.execvp(argv[0], list(argv))
    try:
        child = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        print(f"crf: cannot run {argv[0]}: {e}", file=sys.stderr, flush=True)
        return 127
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: child.send_signal(s))
    assert child.stdout is not None and child.stderr is not None
    threads = [
        threading.Thread(target=pump, args=(pipe.fileno(), out, values), daemon=True)
        for pipe, out in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer))
    ]
    for t in threads:
        t.start()
    code = child.wait()
    for t in threads:
        t.join(DRAIN_S)
    if code < 0:  # killed by a signal: end the same way, so the platform sees what happened
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # not reached unless the signal is ignored (PID 1 in a container)
    return code


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m crf.executors.redacted CMD [ARG ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
