"""What README.md and the pages under docs/ point a reader to is there: each link's
``#anchor`` is a heading of the page it links; each section a page names in quotes
(``docs/faults.md, "Limits (known, and what would lift them)"``, ``see "Held-out evaluation"``)
is a heading of that page; each ``--option`` the prose names is an option of a ``crf``
command, of a ``bench/`` script, or of another program the page shows; each ``--set KEY=``
a built-in job's knob (or ``trl.FIELD`` a field of TRL's config) and each ``-o KEY=`` a
backend's option; each run-folder key (``launches/<k>/cancel.json``) a key of crf/layout.py's
tree.

tests/test_packaging.py checks that each relative link's file exists, tests/test_docs_commands.py
runs the commands of the code blocks, and docs/cli.md is generated from the code
(tests/test_cli_reference.py); these are the references in between, read by people only.
Parsing only: nothing is run.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: options of other programs the pages show, with the program (not crf's, not a benchmark's)
OTHER_PROGRAMS: dict[str, str] = {
    "--index-url": "pip install torch --index-url ...",
    "--cached": "git ls-files --cached (what --workdir ships)",
    "--others": "git ls-files --others",
    "--exclude-standard": "git ls-files --exclude-standard",
    "--logdir": "tensorboard --logdir",
    "--project": "trackio show --project",
    "--lr": "a user's own script's argument (--entrypoint 'python my_train.py --lr 3e-4')",
    "--nproc-per-node": "python -m torch.distributed.run",
    "--standalone": "python -m torch.distributed.run",
    "--type": "hf repos create --type dataset",
    "--verify": "modal token new --verify",
    "--max-transfers": "docs/extending.md's worked example of adding an option",
    "--repilcas": "the misspelt option troubleshooting.md shows click's answer to",
}


def _prose(text: str) -> str:
    """The page without its fenced code blocks (their lines are commands and output)."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _headings(page: Path) -> tuple[str, ...]:
    return tuple(re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(page.read_text()), re.M))


@cache
def _anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _headings(page):
        slug = _slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(out)


def _plain(text: str) -> str:
    """Text as a reference quotes it: no markup, no section number (``16. ``), lower case."""
    return " ".join(re.sub(r"^\d+\.\s+|[`*]", "", text.strip()).lower().split())


def _has_section(page: Path, title: str) -> bool:
    """A heading of the page (its number left out: troubleshooting.md's ``## 16. ...``), or a
    bold lead-in of one of its items (``- **Time accounting**:``), begins with the title, or
    the title with the heading."""
    want = _plain(title)
    leads = re.findall(r"^\s*(?:[-*]|\d+\.)?\s*\*\*(.+?)\*\*", _prose(page.read_text()), re.M)
    return any(
        _plain(h).startswith(want) or want.startswith(_plain(h)) for h in [*_headings(page), *leads]
    )


def _page(name: str, where: Path) -> Path | None:
    for candidate in (where.parent / name, ROOT / name, ROOT / "docs" / name):
        if candidate.is_file():
            return candidate.resolve()
    return None


def test_every_link_anchor_is_a_heading_of_its_page() -> None:
    broken, seen = [], 0
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            linked = (page.parent / target).resolve() if target else page
            seen += 1
            if linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert seen >= 20, "the pages' links with anchors were not found"
    assert broken == []


#: ``(docs/design.md, "The trained model")``, ``[faults.md](faults.md), "Limits"``
_NAMED_SECTION = re.compile(
    r"(?:\]\(([\w./-]+\.md)(?:#[^)]*)?\)|`?((?:docs/)?[\w/-]+\.md)`?)\)?,\s+\"([^\"]+)\""
)
#: ``see "Held-out evaluation"``, ``"Time accounting" below``: a section of the same page
_SAME_PAGE_SECTION = re.compile(r"\bsee \"([^\"]{3,80})\"|\"([^\"]{3,80})\" (?:below|above)")


def test_every_section_a_page_names_is_there() -> None:
    missing, seen = [], 0
    for page in PAGES:
        text = " ".join(_prose(page.read_text()).split())
        for m in _NAMED_SECTION.finditer(text):
            name, title = m.group(1) or m.group(2), m.group(3)
            target = _page(name, page)
            seen += 1
            if target is None or not _has_section(target, title):
                missing.append(f'{page.relative_to(ROOT)}: {name}, "{title}"')
        for m in _SAME_PAGE_SECTION.finditer(text):
            title = m.group(1) or m.group(2)
            seen += 1
            if not _has_section(page, title):
                missing.append(f'{page.relative_to(ROOT)}: "{title}"')
    assert seen >= 30, "the pages' section references were not found"
    assert missing == []


@cache
def _crf_options() -> frozenset[str]:
    from crf.launcher.cli import app

    group = typer.main.get_command(app)
    names = {o for p in group.params for o in (*p.opts, *p.secondary_opts)}
    for command in group.commands.values():  # type: ignore[attr-defined]
        names |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    return frozenset({"--help"} | {n for n in names if n.startswith("--")})


@cache
def _bench_options() -> frozenset[str]:
    """Every ``--name`` the benchmark scripts' argument parsers declare."""
    found: set[str] = set()
    for script in (ROOT / "bench").glob("*.py"):
        found |= set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", script.read_text()))
    return frozenset(found)


def test_every_option_the_docs_name_exists() -> None:
    known = _crf_options() | _bench_options() | set(OTHER_PROGRAMS)
    unknown = []
    for page in PAGES:
        if page.name == "cli.md":  # generated from the options themselves
            continue
        for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", page.read_text()):
            if option not in known:
                unknown.append(f"{page.relative_to(ROOT)}: {option}")
    assert sorted(set(unknown)) == []


def test_the_option_check_knows_each_kind() -> None:
    """A broken collector would pass every page: it must see crf's, the benchmarks' and the
    other programs' options, and none of the other programs' is crf's own."""
    crf, bench = _crf_options(), _bench_options()
    assert {"--replicas", "--no-progress", "--store", "--follow", "--merge"} <= crf
    assert {"--wires", "--kinds", "--syncs"} <= bench
    assert not set(OTHER_PROGRAMS) & crf, set(OTHER_PROGRAMS) & crf


#: run-folder names the pages show that are not keys of crf/layout.py's tree, and why
NOT_KEYS: dict[str, str] = {
    "rounds/<r>/contrib/<rank>#<shard>": "how messages name one shard's frame in a contribution",
    "global/<r>/state.safetensors": "the one-file global state of runs of earlier versions",
}


def _key_parts(key: str) -> list[str]:
    """A key's components, each placeholder (``<r>``) and number (``global/2``) as ``<>``."""
    return [re.sub(r"<[^>]*>|\d+", "<>", part) for part in key.strip("/").split("/")]


@cache
def _layout_keys() -> tuple[tuple[list[str], bool], ...]:
    """crf/layout.py's tree of the run folder: (components, is a folder) per key."""
    import crf.layout

    tree = crf.layout.__doc__.split("::", 1)[1]
    keys = re.findall(r"^    (\S+)\s{2,}", tree, re.M)
    return tuple((_key_parts(k), k.endswith("/")) for k in keys)


def _part_matches(named: str, declared: str) -> bool:
    pattern = "".join(
        ".*" if bit == "<>" else re.escape(bit) for bit in re.split(r"(<>)", declared)
    )
    return named == "<>" and "<>" in declared or re.fullmatch(pattern, named) is not None


def _is_layout_key(key: str) -> bool:
    """The key, or the folder it names, is in the tree; ``...`` stands for the rest of a key,
    and anything goes under a folder of the tree (``model/``: the Hugging Face files)."""
    named = _key_parts(key)
    if "..." in named:
        named = named[: named.index("...")]
    for declared, folder in _layout_keys():
        head = named[: len(declared)]
        if len(named) > len(declared) and not folder:
            continue
        if all(_part_matches(n, d) for n, d in zip(head, declared, strict=False)):
            return True
    return False


def test_every_run_folder_key_the_docs_name_is_in_the_layout() -> None:
    """crf/layout.py holds the run folder's contract; a key a page names (``results/<rank>.json``,
    ``launches/<k>/cancel.json``) is one of its keys, so a renamed key is renamed everywhere."""
    tops = {declared[0] for declared, _ in _layout_keys()}
    assert {"rounds", "global", "results", "launches", "policy", "code"} <= tops
    unknown, seen = [], 0
    for page in PAGES:
        for key in re.findall(r"`([a-z_.]+/[^`\s]*)`", page.read_text()):
            if _key_parts(key)[0] not in tops or key in NOT_KEYS:
                continue
            seen += 1
            if not _is_layout_key(key):
                unknown.append(f"{page.relative_to(ROOT)}: {key}")
    assert seen >= 50, "the pages' run-folder keys were not found"
    assert unknown == []


def _job_knobs() -> set[str]:
    """Every knob a built-in job takes with ``--set``, and ``trl.FIELD`` for each field of
    the TRL config a job's trl table takes (GRPOConfig for composer, SFTConfig for sft)."""
    import dataclasses

    from trl import GRPOConfig, SFTConfig

    from crf.replica.jobs import JOBS, job_config

    knobs = {f.name for job in JOBS for f in dataclasses.fields(job_config(job, {}))}
    trl = {f.name for config in (GRPOConfig, SFTConfig) for f in dataclasses.fields(config)}
    return knobs | {f"trl.{name}" for name in trl}


def test_every_set_and_backend_option_the_docs_name_exists() -> None:
    """``--set KEY=VALUE`` names a job's knob (or ``trl.FIELD`` a TRL config's field) and
    ``-o KEY=VALUE`` a backend's option, as the command line would take them."""
    from crf.executors.registry import BACKENDS, executor_class, option_names

    knobs = _job_knobs()
    backend_options = {o for b in BACKENDS for o in option_names(executor_class(b))}
    backend_options |= {f"rollout_{o}" for o in backend_options}  # the workers' own
    unknown, seen = [], 0
    for page in PAGES:
        text = page.read_text()
        for key in re.findall(r"--set ([a-z_][\w.]*)=", text):
            seen += 1
            if key not in knobs and key != "key" and key == key.lower():  # FIELD: a placeholder
                unknown.append(f"{page.relative_to(ROOT)}: --set {key}")
        for key in re.findall(r"(?<![\w-])-o ([a-z_]+)=", text):
            seen += 1
            if key not in backend_options:
                unknown.append(f"{page.relative_to(ROOT)}: -o {key}")
    assert seen >= 40, "the pages' --set and -o settings were not found"
    assert unknown == []
