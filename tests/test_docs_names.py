"""Every ``crf`` name a Python snippet in README.md or docs/ uses exists.

The snippets are what SDK users copy; a name they use that the package lacks (``crf.X``,
``from crf import X``, ``from crf.mod import X``, ``import crf.mod``) fails their first line.
Each snippet is parsed (not run: most of them launch training), and every such name is
imported or looked up for real.
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(?:python|py)\s*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def snippets() -> list[tuple[str, str]]:
    """(where, code) for every python-fenced block of README.md and docs/**/*.md."""
    out = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for i, m in enumerate(FENCE.finditer(path.read_text(encoding="utf-8"))):
            out.append((f"{path.relative_to(REPO)}#{i}", m.group(1)))
    return out


def crf_names(tree: ast.AST) -> set[tuple[str, str | None]]:
    """(module, attribute or None) for every crf name the code uses."""
    names: set[tuple[str, str | None]] = set()
    aliases = {"crf": "crf"}  # a name bound to a crf module -> that module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "crf" or a.name.startswith("crf."):
                    names.add((a.name, None))
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "crf" or node.module.startswith("crf."):
                for a in node.names:
                    if a.name != "*":
                        names.add((node.module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module is not None:
                names.add((module, node.attr))
    return names


def parse(code: str) -> ast.AST:
    """The snippet's syntax tree; a fragment (a class body's lines, indented) is read dedented,
    and one still not Python (elided lines) is read line by line, keeping lines that parse."""
    code = textwrap.dedent(code)
    try:
        return ast.parse(code)
    except SyntaxError:
        pass
    body: list[ast.stmt] = []
    for line in code.splitlines():
        try:
            body += ast.parse(line.strip()).body
        except SyntaxError:
            continue
    return ast.Module(body=body, type_ignores=[])


SNIPPETS = snippets()


def test_the_docs_have_python_snippets() -> None:
    assert len(SNIPPETS) >= 10
    used = set().union(*(crf_names(parse(code)) for _, code in SNIPPETS))
    assert ("crf", "LaunchError") in used  # what the troubleshooting page tells users to catch


INLINE = re.compile(r"`(crf(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def test_every_crf_name_in_the_prose_exists() -> None:
    """``crf.X`` in inline code (``Bad input raises `crf.LaunchError` ...``) names a module or
    an attribute that exists."""
    seen = 0
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for dotted in INLINE.findall(path.read_text(encoding="utf-8")):
            seen += 1
            parts = dotted.split(".")
            obj = importlib.import_module("crf")
            for i, part in enumerate(parts[1:], start=2):
                if hasattr(obj, part):
                    obj = getattr(obj, part)
                    continue
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    pytest.fail(f"{path.relative_to(REPO)}: `{dotted}` does not exist")
    assert seen


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_every_crf_name_in_a_snippet_exists(where: str, code: str) -> None:
    tree = parse(code)
    for module, attr in sorted(crf_names(tree), key=str):
        mod = importlib.import_module(module)
        if attr is None:
            continue
        if not hasattr(mod, attr):  # a submodule named as an attribute (crf.store)
            try:
                importlib.import_module(f"{module}.{attr}")
            except ImportError:
                pytest.fail(f"{where}: {module}.{attr} does not exist")


def test_launch_error_is_the_launchers() -> None:
    import crf
    from crf.launcher.errors import LaunchError

    assert crf.LaunchError is LaunchError
    assert "LaunchError" in dir(crf)
