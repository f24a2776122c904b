"""Errors the launcher raises for input a user can fix.

The CLI prints these as one red line and exits 2, without a traceback: a traceback says
"crf is broken" when the truth is "--rounds must be >= 1".
"""

from __future__ import annotations


class LaunchError(ValueError):
    """Bad launch input (or a run that may not start); the message says what to fix."""
