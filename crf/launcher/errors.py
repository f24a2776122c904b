"""Errors the launcher raises for input a user can fix.

The CLI prints these as one red line and exits 2, without a traceback: a traceback says
"crf is broken" when the truth is "--rounds must be >= 1".
"""

from __future__ import annotations


class LaunchError(ValueError):
    """Bad launch input (or a run that may not start); the message says what to fix."""


def os_error_line(e: OSError, what: str = "") -> str:
    """An OSError as one line a user can act on: what was tried, the path and the reason in
    words (``cannot write fig/x.png: No such file or directory``), not Python's
    ``[Errno 2] ...`` repr; ``what`` names the option or action (``--out``)."""
    reason = e.strerror or type(e).__name__
    path = e.filename if e.filename is not None else ""
    other = f" -> {e.filename2}" if getattr(e, "filename2", None) else ""
    where = f"{path}{other}: " if path != "" else ""
    return f"{what + ': ' if what else ''}{where}{reason}"
