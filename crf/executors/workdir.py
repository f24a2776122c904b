"""The user's code and packages: ``--workdir``, ``--pip``, ``--requirements``.

At launch the driver packs the user's folder into one deterministic tar.gz (``pack_workdir``)
and puts it in the run folder (``layout.workdir_key(<digest>)``, recorded in run.json as
``workdir_key``), as the crf source itself is shipped. Every replica - local too, so a run
behaves the same on every backend - runs in its own unpacked copy as its working directory,
with that copy on ``PYTHONPATH``: ``--entrypoint "python train.py"``, a ``module:function``
reward and a module-path job import from it. The user's folder is never written to.

Which files: in a git checkout, exactly what ``git ls-files --cached --others
--exclude-standard`` lists (git's own rules: nested .gitignore files, .git/info/exclude, the
user's global excludes - what ``git status`` would show); elsewhere the folder's .gitignore
files read with ``pathspec``'s GitIgnoreSpec (git's wildmatch semantics, each file applying
below its own folder). ``.git/`` is never packed. Past ``MAX_WORKDIR_BYTES`` (before
compression) the launch is refused with the biggest files named: a workdir is code and small
data, and each replica downloads it at start.

The executors learn what a run needs from its run.json (``run_needs``): the workdir's key, the
extra pip requirements and the optional extras its options use (peft for ``--lora-rank``,
math-verify for ``--reward math_answer``, the tracker's package for ``--report-to``), so the
launch protocol needs no argument for them and a restart or a resume ships the same code.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the most a workdir may hold (bytes before compression): each replica fetches it at start
MAX_WORKDIR_BYTES = 100 * 2**20
#: how many of the biggest files the refusal names
BIGGEST_SHOWN = 5


class WorkdirError(ValueError):
    """The workdir or a package requirement cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class PackedWorkdir:
    """A packed workdir: the tar.gz, its SHA-256, and what went in."""

    data: bytes
    sha256: str
    files: int
    size: int  # bytes before compression
    how: str  # "git ls-files" or ".gitignore (pathspec)"
    names: tuple[str, ...] = ()  # the files, relative POSIX paths


def _git_files(root: Path) -> list[str] | None:
    """The files git would track or add under ``root``; None when it is not a git checkout
    (or git is not installed)."""
    if shutil.which("git") is None:
        return None
    try:
        inside = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard", "--", "."],
            capture_output=True, timeout=120, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n for n in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if n]
    # a file deleted from the work tree but still in the index is listed: keep what exists
    return sorted({n for n in names if (root / n).is_file()})


def _ignore_files(root: Path) -> list[str]:
    """The files under ``root`` that its .gitignore files do not exclude (pathspec)."""
    import pathspec

    out: list[str] = []
    # (folder relative to root, its GitIgnoreSpec) for the folders above the one walked
    specs: list[tuple[str, Any]] = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root).as_posix()
        rel = "" if rel == "." else rel + "/"
        specs = [(base, s) for base, s in specs if rel.startswith(base)]
        ignore = Path(folder) / ".gitignore"
        if ignore.is_file():
            lines = ignore.read_text(encoding="utf-8", errors="replace").splitlines()
            specs.append((rel, pathspec.GitIgnoreSpec.from_lines(lines)))

        dirs[:] = sorted(d for d in dirs if d != ".git" and not _ignored(specs, rel + d + "/"))
        out.extend(rel + f for f in sorted(files) if not _ignored(specs, rel + f))
    return [n for n in out if (root / n).is_file()]


def _ignored(specs: list[tuple[str, Any]], path: str) -> bool:
    """Whether a .gitignore above ``path`` (relative to the workdir) excludes it; each file's
    patterns are matched against the path relative to its own folder, as git does, and the
    deepest file's match wins (a sub-folder's ``!keep.log`` re-includes what the top's
    ``*.log`` excluded)."""
    verdict = None
    for base, spec in specs:
        found = spec.check_file(path[len(base) :]).include
        if found is not None:
            verdict = found
    return bool(verdict)


def workdir_files(root: Path) -> tuple[list[str], str]:
    """The files a workdir ships (relative POSIX paths, sorted) and how they were chosen."""
    found = _git_files(root)
    if found is not None:
        return found, "git ls-files"
    return sorted(_ignore_files(root)), ".gitignore (pathspec)"


def _too_big(root: Path, sizes: dict[str, int], limit: int) -> WorkdirError:
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:BIGGEST_SHOWN]
    named = ", ".join(f"{name} ({size / 2**20:.1f} MB)" for name, size in biggest)
    return WorkdirError(
        f"--workdir {root} holds {total / 2**20:.1f} MB, more than the {limit / 2**20:.0f} MB "
        f"a workdir may ship; the biggest: {named} - add them to .gitignore, or put data in "
        "the store and read it by URL"
    )


@contextmanager
def reproducible_tar_gz(buf: io.BytesIO) -> Iterator[tarfile.TarFile]:
    """A tar.gz writer into ``buf`` whose bytes depend only on the members added: gzip's
    header carries the time it was written unless told otherwise, and a packed folder is
    stored under its digest (the same folder packed a second later must find its copy)."""
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        yield tar


def pack_workdir(
    path: str | os.PathLike[str],
    limit: int = MAX_WORKDIR_BYTES,
    exclude: Sequence[str | os.PathLike[str]] = (),
) -> PackedWorkdir:
    """The workdir as a reproducible tar.gz (same files, same bytes: same digest);
    WorkdirError if it is no folder, is empty or holds more than ``limit`` bytes. Files under
    an ``exclude`` folder stay out (the local run store, when it lies inside the workdir:
    ``--workdir .`` with the default ``./crf-runs`` must not ship earlier runs)."""
    root = Path(path).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise WorkdirError(f"--workdir {path} is a file: --workdir takes a folder (your code's)")
    if not root.is_dir():
        raise WorkdirError(f"--workdir {path}: no such folder")
    names, how = workdir_files(root)
    skip = [Path(p).expanduser().resolve() for p in exclude]
    names = [n for n in names if not any((root / n).is_relative_to(s) for s in skip)]
    if not names:
        raise WorkdirError(f"--workdir {path}: no file to ship (all ignored, or empty)")
    sizes = {n: (root / n).stat().st_size for n in names}
    if sum(sizes.values()) > limit:
        raise _too_big(root, sizes, limit)
    buf = io.BytesIO()
    with reproducible_tar_gz(buf) as tar:
        for name in names:
            file = root / name
            info = tarfile.TarInfo(name)
            info.size = sizes[name]
            info.mode = 0o755 if os.access(file, os.X_OK) else 0o644
            with open(file, "rb") as f:  # a symlink to a file ships the file's content
                tar.addfile(info, f)
    data = buf.getvalue()
    return PackedWorkdir(
        data, hashlib.sha256(data).hexdigest(), len(names), sum(sizes.values()), how,
        tuple(names),
    )  # fmt: skip


def unpack_workdir(data: bytes, dest: str | os.PathLike[str]) -> Path:
    """Unpack a packed workdir into ``dest`` (emptied first); tarfile's ``data`` filter
    refuses absolute paths, ``..`` and links out of it."""
    out = Path(dest)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    return out


# ------------------------------------------------------------------------------ packages
def check_requirement(entry: str) -> str:
    """One ``--pip`` entry as the normalised requirement the bootstrap installs;
    WorkdirError for what pip options, URLs or markers with spaces would need."""
    from packaging.requirements import InvalidRequirement, Requirement

    text = entry.strip() if isinstance(entry, str) else ""
    if not text or text.startswith("-"):
        raise WorkdirError(
            f"--pip {entry!r}: give a package requirement such as 'scipy' or 'scipy>=1.13' "
            "(pip options like -r, -e or --index-url are not supported)"
        )
    try:
        req = str(Requirement(text))
    except InvalidRequirement as e:
        raise WorkdirError(f"--pip {entry!r} is not a valid requirement: {e}") from None
    if any(c.isspace() for c in req):
        raise WorkdirError(
            f"--pip {entry!r}: a requirement with a URL or an environment marker is not "
            "supported; give NAME or NAME<op>VERSION"
        )
    return req


def read_requirements(path: str | os.PathLike[str]) -> list[str]:
    """The requirement lines of a requirements file (comments and blank lines dropped)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkdirError(f"--requirements {path}: cannot read it ({e})") from None
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def missing_here(requirements: list[str]) -> list[str]:
    """The requirements this Python does not satisfy (not installed, or another version)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    out = []
    for entry in requirements:
        req = Requirement(entry)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(entry)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{entry} (installed: {version})")
    return out


# ------------------------------------------------------------------------------ run needs
@dataclass(frozen=True)
class RunNeeds:
    """What a run's replicas need besides crf: its workdir and extra packages."""

    workdir_key: str | None = None
    #: pyproject extras its options use (lora, math, the --report-to tracker)
    extras: tuple[str, ...] = ()
    #: the user's ``--pip`` and ``--requirements`` entries
    pip: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, spec: Any) -> RunNeeds:
        """From a RunSpec (or anything with its fields)."""
        from crf.replica.rewards import parse_reward
        from crf.spec import TRACKERS

        extras = []
        if (getattr(spec, "lora_rank", 0) or 0) > 0:
            extras.append("lora")
        rewards = []
        for entry in getattr(spec, "reward", None) or []:
            try:
                rewards.append(parse_reward(entry).name)
            except ValueError:
                continue  # validated before launch; a run.json edited by hand installs less
        if "math_answer" in rewards:
            extras.append("math")
        tracker = getattr(spec, "report_to", "none")
        if tracker in TRACKERS and tracker != "none":  # pyproject has an extra per tracker
            extras.append(tracker)
        return cls(
            workdir_key=getattr(spec, "workdir_key", None),
            extras=tuple(extras),
            pip=tuple(getattr(spec, "pip", None) or ()),
        )


def run_needs(run_uri: str) -> RunNeeds:
    """A run's needs from its run.json; none when there is no run.json (an executor driven
    directly, without the driver)."""
    spec = run_spec(run_uri)
    return RunNeeds() if spec is None else RunNeeds.of(spec)


def run_spec(run_uri: str) -> Any:
    """The run's RunSpec from its run.json; None when there is none (an executor driven
    directly, without the driver)."""
    from crf import layout
    from crf.spec import RunSpec
    from crf.store import ObjectNotFound, RunStore

    try:
        raw = RunStore(run_uri).get(layout.RUN_SPEC)
    except ObjectNotFound:
        return None
    return RunSpec.from_json(bytes(raw))


def fetch_workdir(run_uri: str, key: str) -> bytes:
    """The packed workdir from the run folder."""
    from crf.store import RunStore

    return bytes(RunStore(run_uri).get(key))


__all__ = [
    "BIGGEST_SHOWN",
    "MAX_WORKDIR_BYTES",
    "PackedWorkdir",
    "RunNeeds",
    "WorkdirError",
    "check_requirement",
    "fetch_workdir",
    "missing_here",
    "pack_workdir",
    "read_requirements",
    "run_needs",
    "run_spec",
    "unpack_workdir",
    "workdir_files",
]
