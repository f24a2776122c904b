"""Which failures of a replica a restart can fix: deaths, not bugs.

A restart is the cure for a replica that was killed, preempted, ran out of memory or lost
its container or its network: the next attempt meets a different machine or moment. It is no
cure for an error in the run's own input: a column the trainer cannot find, a tokenizer
without a chat template, a reward that raises. Those are raised again, the same, on every
attempt (and on every replica), while each attempt costs a process start, a model load and,
on a cloud backend, a new container.

So an error raised while the replica builds its data, model and trainer (phase
``starting``, before its first inner step) is deterministic unless its type says the
machine or the network failed (:data:`TRANSIENT`); so is a reward function's own error
(not its network's) at any step, a failure to compile (``generation_compile=true`` in an
image without a C compiler fails the same way on every attempt;
``crf.composer.generation.compile_failed``), and what
``crf.exchange.manager.restart_cannot_help`` names (the replicas disagree on the model),
a ``ContractError`` (the replica's contract broken: its variables, or a
``DiLoCoHook`` the script misuses), and an object store's answer that the replica's
credentials may not use it or that its bucket is gone (``crf.store.errors.denies_access``: a
role without access to the bucket, a session token that expired), which every attempt and
every replica meets again, at any round, while a store out of reach is a network's failure.
The replica then exits with code 3 and records ``restartable: false``; the driver ends the
run with that error as its one-line reason (before the first committed round; a reward's or
a compiler's error at any round: ``stops_run`` in the result).
"""

from __future__ import annotations

from typing import Any

from crf.store.errors import denies_access

#: a replica's (or rollout worker's) exit code when it failed with an error a restart would
#: raise again: the driver does not start it again
EXIT_UNRECOVERABLE = 3

#: exception type names of a failing machine or network, whatever the phase (matched on the
#: class and its bases, so a client library's subclasses count without importing it)
TRANSIENT = frozenset({
    "ConnectionError", "TimeoutError", "MemoryError", "OutOfMemoryError", "StoreError",
    "HTTPError", "RequestException", "TransportError", "ProtocolError", "BrokenPipeError",
    "InterruptedError", "ChildProcessError", "DistBackendError", "DistNetworkError",
})  # fmt: skip
#: an OSError that is one of these is about the run's files, not the machine
_FILE_ERRORS = ("FileNotFoundError", "IsADirectoryError", "NotADirectoryError",
                "PermissionError", "FileExistsError")  # fmt: skip


def _names(error: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(error).__mro__}


def transient(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) says the machine, its memory or the
    network failed: a restart elsewhere or later may succeed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        names = _names(current)
        if names & TRANSIENT or "out of memory" in str(current).lower():
            return True
        if "OSError" in names and not names & set(_FILE_ERRORS):
            return True  # an I/O error of the machine, a download cut off
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def deterministic(error: BaseException, *, phase: str) -> bool:
    """Whether a restart would raise ``error`` again (see the module docstring): an error in
    setup (``phase`` ``starting``), of a reward function or of a compiler, not a transient
    one, or one the exchange says no restart can fix."""
    from crf.exchange.manager import restart_cannot_help

    if restart_cannot_help(error) or denies_access(error) or "ContractError" in _names(error):
        return True
    if transient(error):
        return False
    return phase == "starting" or stops_run(error)


def stops_run(error: BaseException) -> bool:
    """Whether ``error`` is one every replica meets, at whatever round: a reward function's
    own (the same code scores every replica's completions) or a compiler's, not a transient
    one. The driver ends the run on it rather than let the others train on until they meet
    it too (the run would end failed anyway); so is a store that denies the replicas access.
    """
    from crf.composer.generation import compile_failed, error_chain

    if denies_access(error):
        return True
    if transient(error):
        return False
    return compile_failed(error) or any("RewardFailed" in _names(e) for e in error_chain(error))


def failed_in(phase: str) -> str:
    """What the result records as where the replica failed: ``setup`` before training."""
    return "setup" if phase == "starting" else phase


def one_line(error: Any) -> str:
    """``Type: message`` on one line (a message's first line)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
