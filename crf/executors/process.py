"""Is the process behind a saved pid still the replica that was started, or someone else?

A local replica is found again (``crf status``, ``crf cancel``, the resume check) through a
pid saved in its handle or heartbeat. Pids are reused: once a replica has ended, the OS may
give its number to any later process, and trusting the bare number would call an ended run
"running" and SIGTERM a stranger. So a pid counts as the replica only when the process holding
it also started when the replica did (its start time, recorded at launch) and carries the
replica's run id and rank in its environment (set by the executor for every replica; read
through psutil, which knows how on each OS).
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

import psutil

from crf.layout import ENV_RANK, ENV_RUN_ID

#: off Linux the start time is psutil's wall-clock one: readings may differ by this much
START_TIME_TOLERANCE_S = 1.0
_PROC = Path("/proc")


class PidOwner(StrEnum):
    """Who holds a pid now."""

    GONE = "gone"  # no live process (never was, ended, or a zombie waiting to be reaped)
    REPLICA = "replica"  # the replica itself, as far as can be checked
    OTHER = "other"  # a live process that is provably not the replica


def process_started_at(pid: int | None = None) -> str | float | None:
    """When process ``pid`` (this process by default) started, as a value to save next to the
    pid so a later check can tell a reused pid apart; None when it cannot be read.

    On Linux: ``<boot id>/<start in clock ticks since boot>``, exact and immune to changes of
    the system clock (psutil's own pid-reuse check also uses the time since boot, for that
    reason; a wall-clock start moves whenever the clock is stepped). Elsewhere psutil's
    wall-clock ``create_time()``.
    """
    pid = os.getpid() if pid is None else pid
    if _PROC.joinpath("self").exists():
        try:
            boot = _PROC.joinpath("sys/kernel/random/boot_id").read_text().strip()
            # after the command name: state, ppid, ..., starttime is the 20th field
            ticks = _PROC.joinpath(str(pid), "stat").read_text().rsplit(")", 1)[1].split()[19]
            return f"{boot}/{int(ticks)}"
        except (OSError, IndexError, ValueError):
            return None
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def _same_start(now: str | float | None, saved: str | float) -> bool | None:
    """Whether two start values name one start; None when they cannot be compared."""
    if isinstance(saved, str) and isinstance(now, str):
        return now == saved
    if isinstance(saved, int | float) and isinstance(now, int | float):
        return abs(now - saved) <= START_TIME_TOLERANCE_S
    return None


def pid_owner(
    pid: int,
    *,
    run_id: str | None = None,
    rank: int | None = None,
    started_at: str | float | None = None,
) -> PidOwner:
    """Who holds ``pid``: gone, the replica (``run_id``/``rank``, started at ``started_at``),
    or another process.

    What is not known is not held against the process: a handle saved before start times
    were recorded has no ``started_at``, a wrapper may have dropped ``CRF_RANK``, another
    user's environment cannot be read (nor could that process be signalled), and a process
    still inside execve shows an empty one. Such a process counts as the replica, as before.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return PidOwner.GONE
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return PidOwner.GONE
        if started_at is not None and _same_start(process_started_at(pid), started_at) is False:
            return PidOwner.OTHER
        if run_id is None and rank is None:
            return PidOwner.REPLICA
        try:
            env = proc.environ()
        except psutil.AccessDenied:
            return PidOwner.REPLICA
        if not env:  # mid-execve (just launched) the kernel shows no environment yet
            return PidOwner.REPLICA
    except psutil.NoSuchProcess:
        return PidOwner.GONE
    except psutil.Error:  # e.g. AccessDenied on the status itself: assume it is the replica
        return PidOwner.REPLICA
    if run_id is not None and env.get(ENV_RUN_ID) != run_id:
        return PidOwner.OTHER
    if rank is not None and env.get(ENV_RANK, str(rank)) != str(rank):
        return PidOwner.OTHER
    return PidOwner.REPLICA


def is_replica_process(
    pid: int,
    *,
    run_id: str | None = None,
    rank: int | None = None,
    started_at: str | float | None = None,
) -> bool:
    """Whether ``pid`` is held by the live replica (see ``pid_owner``)."""
    return pid_owner(pid, run_id=run_id, rank=rank, started_at=started_at) is PidOwner.REPLICA
