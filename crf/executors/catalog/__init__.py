"""Hardware and price catalogs of the cloud backends, as dated data.

Prices and hardware names change on the providers' side, not in crf's code, so each backend's
table lives in a JSON file next to this module (``<backend>.json``), shipped with the package.
Every file says when it was read (``as_of``) and from where (``source``); refreshing a price is
an edit of that file and its date, and ``crf launch --dry-run`` quotes the date it prices with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Catalog:
    """One backend's catalog: its tables (``data``) and where and when they were read."""

    backend: str
    as_of: str
    source: str
    data: dict[str, Any]

    def __getitem__(self, table: str) -> Any:
        return self.data[table]


@cache
def load(backend: str) -> Catalog:
    """The catalog shipped for ``backend`` (``modal``, ``hf_jobs``, ``sagemaker``)."""
    text = resources.files(__name__).joinpath(f"{backend}.json").read_text(encoding="utf-8")
    raw = json.loads(text)
    meta = {k: raw.pop(k) for k in ("backend", "as_of", "source")}
    raw.pop("notes", None)
    return Catalog(data=raw, **meta)


__all__ = ["Catalog", "load"]
