"""The constraint files agree with pyproject.toml: constraints/lowest.txt holds the floors
pyproject declares, constraints/ci.txt (what make test installs) pins those floors and
satisfies every requirement of crf and its dev extra, and constraints/verl.txt (make
test-verl) holds verl 0.9.1 beside versions crf accepts. A range changed without
`make constraints` fails here, not in a CI install."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints"


def _pins(path: Path, until: str | None = None) -> dict[str, Version]:
    """name -> pinned version of a constraints file (``until``: stop at the comment line
    that starts with it)."""
    out = {}
    for line in path.read_text().splitlines():
        if until and line.startswith(until):
            break
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def _requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = [project["dependencies"], *(project["optional-dependencies"][e] for e in extras)]
    reqs = [Requirement(r) for group in lists for r in group]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def _violations(pins: dict[str, Version], reqs: list[Requirement]) -> list[str]:
    return [
        f"{r} but {pins[canonicalize_name(r.name)]}"
        for r in reqs
        if canonicalize_name(r.name) in pins
        and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]


def test_the_floors_are_pyprojects_lower_bounds() -> None:
    floors = _pins(CONSTRAINTS / "lowest.txt", until="# Not floors")
    assert {"trl", "transformers", "torchft-nightly", "huggingface-hub"} <= set(floors)
    lower = {
        canonicalize_name(r.name): Version(s.version)
        for r in _requirements("hf")
        for s in r.specifier
        if s.operator == ">="
    }
    assert {name: lower.get(name) for name in floors} == floors


def test_ci_set_pins_the_floors_and_satisfies_every_requirement() -> None:
    ci = _pins(CONSTRAINTS / "ci.txt")
    lowest = _pins(CONSTRAINTS / "lowest.txt")
    assert {name: ci.get(name) for name in lowest} == lowest
    assert _violations(ci, _requirements("dev")) == []


def test_verl_set_holds_verl_beside_what_crf_accepts() -> None:
    verl = _pins(CONSTRAINTS / "verl.txt")
    assert verl["verl"] == Version("0.9.1")
    assert verl["transformers"] < Version("5.11")  # verl 0.9.1's cap
    assert _violations(verl, _requirements()) == []
