"""docs/README.md is the index of the documentation: it links every page under docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_index_links_every_page() -> None:
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t).resolve() for t in re.findall(r"\]\(([^)#]+)", index.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert sorted(p.relative_to(ROOT).as_posix() for p in pages - linked) == []
