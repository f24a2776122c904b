"""Every command that docs/ shows is one the product accepts (README.md: tests/test_readme.py).

Collected from each shell code block (```bash, ```sh, ```shell, ```console or untagged) of every
page under docs/, plus each inline `python bench/...` span (the commands that reproduce a
measurement in docs/performance.md): a line whose program (after ``VAR=value`` prefixes) is
``crf``, ``python bench/...``, ``make`` or ``pip install``. How each kind is checked, cheaply and
without credentials, a GPU or a download:

- ``crf launch ...`` runs in-process with ``--dry-run`` added: the whole spec is validated
  (options, backend options, the backend's own checks of flavors and GPU names) and nothing is
  launched or written; missing credentials are warnings there, not errors.
- any other ``crf`` command runs with ``--help`` added: click parses every option first, so a
  flag the command does not have still fails. These need a run to exist; NEEDS_A_RUN says so.
- ``python bench/X.py ...`` is parsed by the script's own argparse parser, stopped right after
  parsing (the benchmarks take minutes to hours and some need a GPU).
- ``make TARGET`` must be a target of the Makefile (``make -n``: printed, not run).
- ``pip install ...`` must install from a clone or a git URL (``composer-replication`` is not on
  PyPI) and name only extras pyproject.toml declares.

A line with a placeholder (``<run-id>``) gets a stand-in run id; a line that cannot be checked
this way is listed in NOT_RUN with its reason.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the user guide pages tests/test_readme_commands.py runs block by block (in a fresh folder,
#: each command for real): not checked again here
RUN_AS_BLOCKS = {"running.md", "config-file.md", "backends.md", "your-model.md",
                 "troubleshooting.md"}  # fmt: skip
DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md")
              if p.parent.name != "docs" or p.name not in RUN_AS_BLOCKS)  # fmt: skip

#: commands (a substring of the line) that are not checked, and why
NOT_RUN: dict[str, str] = {
    "verl.trainer.main_ppo algorithm.": "verl's own trainer, not a crf command (not installed)",
    "uv run rl": "needs prime-rl installed (its `uv` project and a config of yours)",
    "./my-checkpoint": "needs a model folder of your own",
    "data/train.jsonl": "needs dataset files of your own (data/train.jsonl, data/test.jsonl)",
    "--model ./base": "needs a base model folder and a train.jsonl of your own",
    "--model ./warm-model": "needs the model `crf export` writes on the line before",
}

#: crf subcommands that read an existing run: checked by --help (their flags), not run
NEEDS_A_RUN = {"status", "logs", "cancel", "export", "attach", "runs", "resume"}

_SHELL = {"bash", "sh", "shell", "console", ""}
_INLINE_BENCH = re.compile(r"`(python3? bench/[^`]+)`")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the page's shell (or untagged) fenced code blocks."""
    blocks: list[str] = []
    lang: str | None = None  # the open block's language; None outside a block
    body: list[str] = []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, body = fence.group(1), []
        elif fence:
            if lang in _SHELL:
                blocks.append("\n".join(body))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _lines(block: str) -> list[str]:
    """The block's command lines: continuations joined, prompts and comments dropped."""
    out: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = " ".join((pending + line).split()) if pending else line
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _words(line: str) -> list[str]:
    """The line's words without ``VAR=value`` prefixes; none for prose (an untagged block)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: prose, unless it reads as a command
        first = [w for w in line.split() if not _ENV.match(w)][:1]
        assert first not in (["crf"], ["make"], ["pip"], ["python"]), f"cannot parse: {line}"
        return []
    while words and _ENV.match(words[0]):
        words.pop(0)
    return words


def _is_command(words: list[str]) -> bool:
    if not words:
        return False
    prog = words[0]
    if prog in ("crf", "make"):
        return True
    if prog in ("python", "python3") and len(words) > 1 and words[1].startswith("bench/"):
        return True
    return words[:2] == ["pip", "install"]


def collect() -> list[tuple[str, str]]:
    """(page, command line) for every command the pages under docs/ show."""
    found: list[tuple[str, str]] = []
    for page in DOCS:
        text = page.read_text()
        rel = str(page.relative_to(ROOT))
        for block in _shell_blocks(text):
            for line in _lines(block):
                if _is_command(_words(line)) or any(k in line for k in NOT_RUN):
                    found.append((rel, line))
        for span in _INLINE_BENCH.findall(text):
            found.append((rel, " ".join(span.split())))
    return list(dict.fromkeys(found))


COMMANDS = collect()


def test_the_docs_show_commands_of_every_kind() -> None:
    """The collector finds what the pages hold (a broken pattern would pass everything)."""
    progs = {_words(line)[0] if _words(line) else line for _page, line in COMMANDS}
    assert {"crf", "python", "pip"} <= progs, sorted(progs)
    launches = [line for _p, line in COMMANDS if line.startswith("crf launch")]
    assert len(launches) >= 15, launches


def _page_module(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/extending.md's `myjobs/tiny.py`, written from the page into an importable folder."""
    text = (ROOT / "docs" / "extending.md").read_text()
    after = text[text.index("`myjobs/tiny.py`") :]
    code = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    (tmp / "myjobs").mkdir()
    (tmp / "myjobs" / "__init__.py").write_text("")
    (tmp / "myjobs" / "tiny.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp))
    monkeypatch.setenv("PYTHONPATH", str(tmp))


#: what a command needs that its page provides, made before it runs
PREPARE = {"myjobs.tiny": _page_module}


def _crf(words: list[str]) -> None:
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    args = [("docs-example" if re.fullmatch(r"<[^>]+>", w) else w) for w in words[1:]]
    if args[0] == "launch":
        args += [] if "--dry-run" in args else ["--dry-run"]
    else:
        assert args[0] in NEEDS_A_RUN or args[0] == "--version", args
        args.append("--help")
    result = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, f"crf {shlex.join(args)}\n{result.output}"
    if args[0] == "launch":
        assert "nothing was launched" in result.output, result.output


class _Parsed(Exception):
    pass


def _bench(words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse the arguments with the benchmark's own parser, and stop there."""
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", words[1:])
    monkeypatch.syspath_prepend(str(ROOT))
    with pytest.raises(_Parsed):
        runpy.run_path(str(ROOT / words[1]), run_name="__main__")


def _make(words: list[str]) -> None:
    targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"make {target}: {done.stderr}"


def _pip(words: list[str]) -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])  # fmt: skip
    specs = [w for w in words[2:] if not w.startswith("-")]
    for spec in specs:
        if spec.startswith("torch"):
            continue
        assert spec.startswith(".") or "git+" in spec, (
            f"{spec}: composer-replication is not on PyPI; install from a clone "
            "(pip install -e '.[EXTRAS]') or the git URL"
        )
        named = re.search(r"\[([^\]]*)\]", spec)
        unknown = set(named.group(1).split(",")) - extras if named else set()
        assert not unknown, f"{spec}: no such extra {sorted(unknown)} (pyproject.toml)"


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_documented_command_is_accepted(
    page: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip = next((why for key, why in NOT_RUN.items() if key in line), None)
    if skip:
        pytest.skip(f"not run: {skip}")
    monkeypatch.chdir(ROOT)
    for key, prepare in PREPARE.items():
        if key in line:
            prepare(tmp_path, monkeypatch)
    words = _words(line)
    if words[0] == "crf":
        _crf(words)
    elif words[0] == "make":
        _make(words)
    elif words[0] == "pip":
        _pip(words)
    else:
        _bench(words, monkeypatch)
