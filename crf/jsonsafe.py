"""Strict JSON for everything crf writes (run.json, metrics, heartbeats, results, quorum, ...).

Python's ``json.dumps`` writes a NaN or infinite float as a bare ``NaN`` / ``Infinity``, which
is not JSON: a strict parser (JavaScript's ``JSON.parse``, ``jq``, Go, a dashboard) refuses the
whole file. A diverged run is exactly when its files get read, so every writer goes through
:func:`dumps`: it writes a non-finite float as the *string* ``"NaN"``, ``"Infinity"`` or
``"-Infinity"`` (the file stays valid JSON, and the value is still visible - ``null`` would
read as "no value" and hide that the loss blew up) and refuses anything else json cannot
write strictly (``allow_nan=False``). :func:`number` reads such a field back as a float.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: how a non-finite float is written (and read back by :func:`number`)
NONFINITE_TOKENS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _token(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (also as a dict key) replaced by its token;
    containers are copied only where something changes."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _token(obj)
    if isinstance(obj, dict):
        return {
            (_token(k) if isinstance(k, float) and not math.isfinite(k) else k): finite_json(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that always produces valid JSON (see the module docstring)."""
    kwargs.pop("allow_nan", None)
    return json.dumps(finite_json(obj), allow_nan=False, **kwargs)


def number(value: Any) -> float | None:
    """A numeric field as written by :func:`dumps`: a float (NaN/inf from their tokens), or
    None when it holds no number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value in NONFINITE_TOKENS:
        return NONFINITE_TOKENS[value]
    return None


def is_nonfinite(value: Any) -> bool:
    """True for a NaN/infinite float or its written token."""
    x = number(value)
    return x is not None and not math.isfinite(x)
