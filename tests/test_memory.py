"""crf.exchange.memory: the replica process caps glibc's malloc arenas (docs/performance.md,
"Memory: allocator arenas"). Each case runs in a fresh interpreter: the cap is process-wide
and glibc's arenas are only observable from inside (``malloc_stats`` prints one block per
arena to stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from crf.exchange.memory import limit_malloc_arenas

PROBE = textwrap.dedent(
    """
    import ctypes, sys, threading
    from crf.exchange.memory import limit_malloc_arenas
    print(limit_malloc_arenas(None if sys.argv[1] == "-" else int(sys.argv[1])), flush=True)
    held, barrier = [], threading.Barrier(6)
    def work():  # six threads allocate at once, as the exchange's transfer threads do
        barrier.wait()
        held.append(bytearray(1 << 20))
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctypes.CDLL("libc.so.6").malloc_stats()
    """
)

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="malloc arenas are glibc's",
)


def arenas(arg: str, **env: str) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX",)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, arg],
        capture_output=True,
        text=True,
        check=True,
        env={**base, **env},
        timeout=60,
    )
    return out.stdout.strip(), sum(line.startswith("Arena ") for line in out.stderr.splitlines())


@glibc
def test_a_replica_process_allocates_from_one_arena() -> None:
    """By default (what python -m crf.replica does) six allocating threads share one arena;
    without the cap glibc gives each its own."""
    assert arenas("-") == ("True", 1)
    said, n = arenas("0")
    assert said == "False" and n > 1


@glibc
def test_the_cap_is_configurable_and_the_environment_wins() -> None:
    assert arenas("-", CRF_MALLOC_ARENAS="2") == ("True", 2)
    assert arenas("-", CRF_MALLOC_ARENAS="0")[0] == "False"
    # glibc reads MALLOC_ARENA_MAX itself; crf leaves it alone then
    assert arenas("1", MALLOC_ARENA_MAX="3") == ("False", 3)


def test_a_bad_cap_is_refused_with_what_to_fix(monkeypatch) -> None:
    with pytest.raises(ValueError, match="arenas must be >= 0"):
        limit_malloc_arenas(-1)
    monkeypatch.setenv("CRF_MALLOC_ARENAS", "one")
    with pytest.raises(ValueError, match="CRF_MALLOC_ARENAS must be a whole number.*'one'"):
        limit_malloc_arenas()
