"""The store clients' own tracebacks stay off the console, in a fresh process as a command
runs: crf configures no logging there, so Python's last-resort handler prints any error
record with its traceback on stderr. gcsfs logs the error it is about to raise (``out of
retries``) and asyncio reports the request-body task of a reset connection (``Task
exception was never retrieved``): a GCS store that stopped answering, or an S3 store that
went away mid-run, printed these tracebacks under crf's own one-line error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("gcsfs", reason="needs the gcs extra")
pytest.importorskip("s3fs", reason="needs the s3 extra")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


GCSFS_GIVES_UP = """
    import asyncio
    {imports}
    from gcsfs.retry import HttpError, retry_request

    async def unavailable():
        raise HttpError({{"code": 503, "message": "backend unavailable"}})

    try:
        asyncio.run(retry_request(retries=1)(unavailable)())
    except HttpError:
        print("raised to the caller")
"""

RESET_BODY_TASK = """
    import asyncio, gc, logging
    {imports}
    import aiohttp

    async def main():
        async def reset():
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

        async def bug():
            raise ValueError("a real bug")

        tasks = [asyncio.ensure_future(reset()), asyncio.ensure_future(bug())]
        await asyncio.sleep(0.05)
        del tasks
        gc.collect()

    asyncio.run(main())
    gc.collect()
    print("done")
"""


@pytest.mark.parametrize("store", ["crf.store.gcs", "crf.store.s3"])
def test_a_reset_connections_task_is_not_reported_but_a_bug_is(store: str) -> None:
    out = run(RESET_BODY_TASK.format(imports=f"import {store}"))
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert "ClientConnectionResetError" not in out.stderr, out.stderr
    assert "ValueError: a real bug" in out.stderr  # other errors still show


def test_gcsfs_does_not_print_the_error_it_raises() -> None:
    out = run(GCSFS_GIVES_UP.format(imports="import crf.store.gcs"))
    assert out.returncode == 0 and "raised to the caller" in out.stdout, out.stderr
    assert "Traceback" not in out.stderr and "out of retries" not in out.stderr, out.stderr


def test_without_crf_both_print_tracebacks() -> None:
    """The clients do print them (what the tests above prove crf removes)."""
    out = run(GCSFS_GIVES_UP.format(imports=""))
    assert "out of retries" in out.stderr and "Traceback" in out.stderr
    out = run(RESET_BODY_TASK.format(imports=""))
    assert "ClientConnectionResetError" in out.stderr
