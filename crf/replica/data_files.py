"""A ``--dataset`` on this machine's disk: what the path is, and every row of it.

A local path is one of three things ``datasets`` reads: a ``.jsonl`` / ``.json`` /
``.parquet`` / ``.csv`` file (a JSON or CSV one also compressed, ``.jsonl.gz``:
crf/replica/data_suffixes.py), a folder of such files (one split per file name:
``train.jsonl``, ``test.jsonl``...), or a folder written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk`` (read with ``load_from_disk``; a ``DatasetDict``'s split is
``--dataset-split`` / ``--eval-split``). Anything else on disk is refused by name
(:func:`local_problem`) rather than handed to ``load_dataset``, which would take an unknown
suffix for a Hub id, or a folder of ``readme.txt`` for a text dataset; so is a file or folder
this user may not read (:func:`unreadable`), which would otherwise fail inside a reader or
look like an empty folder.

:func:`read_rows` reads a local split whole, on the launcher, so the row rules
(crf/replica/data.py ``value_problem``) hold on every row before any replica starts: JSON
lines are parsed here (in one pass; a malformed line or a non-UTF-8 byte is then named by
its line); Parquet, CSV and ``save_to_disk`` folders go through pyarrow, pandas and
``load_from_disk``, which type each column once. A compressed file is read decompressed, by
the same rules. It reads columns, never a model: a
100,000-row file takes well under a second.

A split larger than :data:`CHECKED_BYTES` is read only up to its first
:data:`CHECKED_ROWS` rows (:attr:`Rows.partial`): held whole as Python values, a file of
several GB would take several times its size in the launcher's memory (a compressed file
counts as :data:`COMPRESSED_RATIO` times its size). Each replica checks
its own rows by the same rules when it starts, so a bad row further on still stops the run
once, naming the row.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from crf.replica.data_suffixes import (
    BUILDERS,
    READ_FORMS,
    SUPPORTED,
    compression_of,
    decompress_errors,
    form_problem,
    open_data,
    pandas_compression,
    seen_in_folder,
    suffix_of,
)

#: files a ``save_to_disk`` folder holds: a Dataset's, a DatasetDict's
SAVED_DATASET = ("state.json", "dataset_info.json")
SAVED_DICT = "dataset_dict.json"
#: a split of more bytes than this is checked on its first CHECKED_ROWS rows only
CHECKED_BYTES = 256 * 2**20
CHECKED_ROWS = 100_000
#: a compressed file counts as this many times its size against CHECKED_BYTES (text rows
#: compress about 4 to 10 times)
COMPRESSED_RATIO = 8


class DataError(ValueError):
    """The dataset cannot be used; the message names the file or column and the fix."""


def looks_local(name: str) -> bool:
    """A name that can only be a path: it starts like one, or ends in a data suffix."""
    return (
        name.startswith(("./", "../", "/", "~", ".\\", "..\\"))
        or name in (".", "..")
        or (suffix_of(name) is not None and "://" not in name)
    )


def saved_kind(folder: str) -> str | None:
    """``"dataset"`` / ``"dict"`` for a ``save_to_disk`` folder, None for any other."""
    if not os.path.isdir(folder):
        return None
    if os.path.isfile(os.path.join(folder, SAVED_DICT)):
        return "dict"
    if all(os.path.isfile(os.path.join(folder, n)) for n in SAVED_DATASET):
        return "dataset"
    return None


def _data_files(folder: str, *, depth: int | None = 2, first_data: bool = False) -> list[str]:
    """The folder's files, relative, hidden ones left out: down to ``depth`` folders below it
    (``data/train-*.parquet``; None: all), or (``first_data``) until the first data file, at
    any depth, as ``load_dataset``'s ``**`` pattern finds it."""
    folder = os.path.normpath(folder)
    out = []
    for root, dirs, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        below = 0 if rel == "." else rel.count(os.sep) + 1
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if depth is not None and below >= depth:
            dirs[:] = []  # no deeper
        for f in sorted(files):
            if f.startswith("."):
                continue
            out.append(os.path.normpath(os.path.join(rel, f)))
            if first_data and seen_in_folder(f):
                return sorted(out)
    return sorted(out)


def local_problem(name: str, flag: str = "--dataset") -> str | None:
    """Why local path ``name`` cannot be a dataset (None: it can, or it is no local path but
    a URL or Hub id): an existing file of another suffix, a path that names nothing, a
    folder without data files crf reads."""
    if "://" in name:
        return None
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        if suffix_of(path) is None:
            return form_problem(name, flag) or (
                f"{flag} {name} is a local file, but crf reads only {READ_FORMS}, by their "
                "suffix, or a folder of them, or a save_to_disk folder: give it its format's "
                "suffix, or convert it, e.g. to .jsonl"
            )
        return unreadable(path, flag, name)
    if os.path.isdir(path):
        return _folder_problem(path, flag, name)
    if os.path.islink(path):  # a link whose target is not there, or that leads to itself
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return (
                    f"{flag} {name} is a link that loops (it leads back to itself through "
                    "links): point it at the data file or folder, or pass that path"
                )
        return (
            f"{flag} {name} is a link to {os.readlink(path)}, which does not exist (a "
            "dangling link): point it at the data file or folder, or pass that path"
        )
    if any(c in name for c in "*?["):
        return (
            f"{flag} {name}: no such file or folder, and crf does not expand patterns "
            "(* ? [): pass the folder that holds the files (a folder is read whole, one split "
            "per file name), or one file"
        )
    if looks_local(name):
        return f"{flag} {name}: no such file or folder"
    return None


def _folder_problem(path: str, flag: str, name: str) -> str | None:
    """:func:`local_problem` of a folder."""
    problem = unreadable(path, flag, name)
    if problem:
        return problem
    if saved_kind(path) is not None:
        return None
    if os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(path)
    ):
        return (
            f"{flag} {name} is a model folder (config.json and weights), not data: give "
            "the rows' file or folder here (a model goes to --model)"
        )
    saved = sorted(d.name for d in os.scandir(path) if d.is_dir() and saved_kind(d.path))
    if saved:  # its state.json files would be read as rows
        return (
            f"{flag} {name} holds the save_to_disk folder {saved[0]}: give that folder "
            f"({flag} {os.path.join(name, saved[0])})"
        )
    files = _data_files(path, depth=None, first_data=True)
    if any(seen_in_folder(f) for f in files):
        return None
    packed = next((p for f in files if (p := form_problem(f"{name}: {f}", flag))), None)
    if packed:  # train.parquet.gz, train.jsonl.zst: said as for a file
        return packed
    cased = [f for f in files if suffix_of(f)]
    if cased:  # TRAIN.JSONL: datasets finds only lower-case suffixes in a folder
        return (
            f"{flag} {name} holds {', '.join(cased[:3])}, but datasets reads a folder's "
            "files by lower-case suffixes only: rename them (e.g. train.jsonl)"
        )
    links = sorted(e.name for e in os.scandir(path) if e.is_symlink() and e.is_dir())
    if links:  # os.walk and datasets' patterns alike do not follow a link to a folder
        return (
            f"{flag} {name} holds {links[0]}, a link to a folder, which datasets does not "
            f"follow: give that folder ({flag} {os.path.realpath(os.path.join(path, links[0]))}"
            "), or copy its files here"
        )
    held = ", ".join(files[:5]) + (", ..." if len(files) > 5 else "")
    return (
        f"{flag} {name} is a folder with no {SUPPORTED} files (it holds "
        f"{held or 'nothing'}): put the rows in train.jsonl (or .parquet, .csv) "
        "there, or give a save_to_disk folder"
    )


def unreadable(path: str, flag: str, shown: str) -> str | None:
    """Why this user cannot read file or folder ``path`` (None: it can): a folder it may
    not list would otherwise look empty, a file would fail in the reader."""
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb"):
                pass
    except OSError as e:
        how = "u+rx" if os.path.isdir(path) else "u+r"
        return (
            f"{flag} {shown} cannot be read ({e.strerror or type(e).__name__}): make it "
            f"readable by the user running crf (chmod {how}), or copy it somewhere readable"
        )
    return None


def check_local(name: str, flag: str = "--dataset") -> None:
    """DataError for a local path that cannot be a dataset (:func:`local_problem`)."""
    problem = local_problem(name, flag)
    if problem:
        raise DataError(problem)


def load_saved(folder: str, split: str, flag: str = "--dataset") -> Any:
    """The ``datasets.Dataset`` of a ``save_to_disk`` folder: a DatasetDict's ``split``
    (DataError naming the splits it has), a Dataset's rows whatever the split's name (one
    saved Dataset is one split, like a file)."""
    from datasets import load_from_disk

    ds = load_from_disk(folder)
    if hasattr(ds, "keys"):  # a DatasetDict
        if split not in ds:
            raise DataError(
                f"{flag} {folder} has no split {split!r}; its splits are "
                f"{', '.join(ds.keys())} (choose one with --dataset-split / --eval-split)"
            )
        return ds[split]
    return ds


# ---------------------------------------------------------------------- every row
@dataclass
class Rows:
    """Every row of a local split (``partial``: its first rows only, see the module
    docstring; ``count`` is then the rows read): column names, and each column's values."""

    names: list[str]
    columns: dict[str, list[Any]]
    count: int
    partial: bool = False
    #: a folder's data files of another format than the one read, which ``datasets`` skips
    unread: list[str] = field(default_factory=list)
    #: each row's line in the file (a JSON lines or CSV file: what a message names), None
    #: when rows are not lines (Parquet, a JSON list); a folder's rows: each one's name in
    #: its own file (``line 5 of part-2.jsonl``)
    lines: list[int] | list[str] | None = None
    #: a CSV file's cells that pandas read other than they are written: column -> {row:
    #: the cell's text} for numbers written with leading zeros (``0007``, read as 7) ...
    zeros: dict[str, dict[int, str]] = field(default_factory=dict)
    #: ... and for missing values (an empty cell, or ``NA``, ``None``, ``null``...)
    missing: dict[str, dict[int, str]] = field(default_factory=dict)

    def first(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` rows as dicts (a row's missing column left out, as in JSON)."""
        out = []
        for i in range(min(n, self.count)):
            out.append({c: v[i] for c, v in self.columns.items() if v[i] is not _ABSENT})
        return out

    def column(self, name: str) -> list[Any]:
        """A column's values, None where a row lacks it."""
        values = self.columns.get(name)
        if values is None:
            return [None] * self.count
        return [None if v is _ABSENT else v for v in values]


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()


@contextlib.contextmanager
def no_bars() -> Iterator[None]:
    """``datasets``' progress bars off while crf reads, and as they were after: the SDK runs
    in the user's own process, whose bars stay theirs."""
    from datasets.utils import logging as datasets_logging

    bars = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            datasets_logging.enable_progress_bar()


def split_files(folder: str, config: str | None, split: str, flag: str) -> list[str]:
    """The files of ``split`` in a folder of data files, as ``load_dataset(folder, config)``
    finds them (``datasets``' own resolution: its split patterns, or the configs of a
    README's YAML, as in a cloned Hub repo); DataError naming the splits there are."""
    from datasets import load_dataset_builder

    base = os.path.abspath(os.path.expanduser(folder))
    try:
        with no_bars():
            builder = load_dataset_builder(base, config)
    except Exception as e:  # noqa: BLE001 - datasets' EmptyDatasetError, a missing config
        raise _builder_error(folder, config, flag, e) from None
    files = builder.config.data_files or {}
    if builder.name not in BUILDERS.values():
        raise DataError(
            f"{flag} {folder} holds {builder.name} files, but crf reads only {SUPPORTED} "
            "files (or a save_to_disk folder)"
        )
    if split not in files:
        raise DataError(
            f"{flag} {folder} has no split {split!r}: its files make the split(s) "
            f"{', '.join(map(str, files))} (train.jsonl, test.jsonl...)"
        )
    for f in map(str, files[split]):
        if suffix_of(f):
            continue
        rel = os.path.relpath(f, base)
        # train.parquet.gz: datasets takes it, and fails on it
        problem = form_problem(f"{folder}: {rel}", flag)
        if problem:
            raise DataError(problem)
        # train.jsonl.bak: datasets takes any file whose name holds a data suffix, and
        # would train on a backup's rows, unchecked
        raise DataError(
            f"{flag} {folder} holds {rel}, which datasets reads as rows of the {split!r} "
            "split (its name holds a data suffix) though its name does not end in one: move "
            "it out, or rename it to end in its format's suffix"
        )
    return [str(f) for f in files[split]]


def _builder_error(folder: str, config: str | None, flag: str, e: Exception) -> DataError:
    """``load_dataset_builder``'s error for a folder as one line that says what to fix."""
    whole = " ".join(str(e).split())
    if "Couldn't infer the same data file format for all splits" in whole:
        return DataError(
            f"{flag} {folder} holds its splits in different formats ("
            f"{_formats_of(whole)}), and datasets reads a folder in one: convert one "
            "split's files (e.g. all to .jsonl)"
        )
    known = part_error(folder, config, None, flag, e)
    if known is not None:
        return known
    return DataError(f"{flag} {folder} cannot be read: {whole[:300] or type(e).__name__}")


def split_option(flag: str) -> str:
    """The option that names the split of the data ``flag`` names."""
    return "--dataset-split" if flag == "--dataset" else "--eval-split"


def config_option(flag: str) -> str:
    """The option that names the config of the data ``flag`` names (``--eval-split`` names
    a split of ``--dataset``)."""
    return "--eval-dataset-config" if flag == "--eval-dataset" else "--dataset-config"


def part_error(
    name: str, config: str | None, split: str | None, flag: str, e: BaseException
) -> DataError | None:
    """``datasets``' error for a config or split a dataset (a Hub id or a folder) does not
    have, as one line naming the option to change and what there is; None for any other
    error (a network error is no fault of the options)."""
    whole = " ".join(str(e).split())
    where = "--dataset" if flag == "--eval-split" else flag  # --eval-split: of --dataset
    option = config_option(flag)
    if "Config name is missing" in whole:  # a README's YAML names several
        names = whole.split("available configs:", 1)[-1].split("]", 1)[0] + "]"
        return DataError(
            f"{where} {name} has several configs {names.strip()}: choose one with {option}"
        )
    if config is not None and f"BuilderConfig '{config}' not found" in whole:
        names = whole.split("Available:", 1)[-1].strip(" []").replace("'", "")
        return DataError(
            f"{option} {config}: {where} {name} has no such config (its configs: "
            f"{names}); name one of them, or drop {option}"
        )
    # streamed: "Bad split: x. Available splits: [...]"; downloaded: "Unknown split "x".
    # Should be one of [...]."
    bad = re.search(r"(?:Bad split: .+?\. Available splits:|Unknown split .+?\. Should be "
                    r"one of) \[(.*?)\]", whole)  # fmt: skip
    if split is not None and bad:
        names = bad.group(1).replace("'", "")
        return DataError(
            f"{split_option(flag)} {split}: {where} {name} has no such split (its splits: "
            f"{names}); name one of them"
        )
    return None


def _formats_of(message: str) -> str:
    """``train: json, test: csv`` from datasets' message of a folder's mixed splits."""
    pairs = re.findall(r"NamedSplit\('([^']+)'\): \('(\w+)'", message)
    return ", ".join(f"{split}: {fmt}" for split, fmt in pairs) or "see the file names"


#: the last splits read (the launcher's checks read a split more than once): key -> Rows
_READ: dict[tuple[Any, ...], Rows] = {}


def read_rows(name: str, split: str, flag: str = "--dataset", config: str | None = None) -> Rows:
    """Every row of a local file, folder or ``save_to_disk`` folder (``split``: a folder's
    split). DataError (one line, naming the line or row) when it cannot be read. A file
    unchanged since its last read (size and time) is not read again."""
    check_local(name, flag)
    path = os.path.abspath(os.path.expanduser(name))
    inside = _data_files(path) if os.path.isdir(path) else []
    stats = [os.stat(os.path.join(path, f)) for f in inside] if inside else [os.stat(path)]
    key = (path, config, split, *inside, *((s.st_size, s.st_mtime_ns) for s in stats))
    if key not in _READ:
        rows = _read_rows(name, config, split, flag)
        while len(_READ) >= 4:
            _READ.pop(next(iter(_READ)))
        _READ[key] = rows
    return _READ[key]


def _read_rows(name: str, config: str | None, split: str, flag: str) -> Rows:
    path = os.path.expanduser(name)
    if saved_kind(path):
        return _read_saved(path, split, flag, name)
    if os.path.isdir(path):
        files = split_files(path, config, split, flag)
        mixed = split_formats(path, split, files, flag, name)
        if mixed:
            raise DataError(mixed)
        big = sum(_bytes(f) for f in files) > CHECKED_BYTES
        parts: list[Rows] = []
        for f in files:
            left = CHECKED_ROWS - sum(p.count for p in parts) if big else None
            if left is not None and left <= 0:
                parts.append(Rows([], {}, 0, partial=True))  # the files after it: unread
                break
            parts.append(_read_file(f, flag, f"{name}: {os.path.relpath(f, path)}", left))
        shown = [os.path.relpath(f, path) for f in files]
        unlike = _unlike_files(parts, shown, flag, name)
        if unlike:
            raise DataError(unlike)
        rows = _concat(parts, shown)
        rows.unread = other_formats(path, files)
        return rows
    big = _bytes(path) > CHECKED_BYTES
    return _read_file(path, flag, name, CHECKED_ROWS if big else None)


def _bytes(path: str) -> int:
    """The file's size as it weighs read: a compressed file's, times COMPRESSED_RATIO."""
    return os.path.getsize(path) * (COMPRESSED_RATIO if compression_of(path) else 1)


#: files of a Hub repo or saved dataset that describe the data and are no rows
_METADATA = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")


def other_formats(folder: str, read: list[str]) -> list[str]:
    """The folder's data files (relative) that ``datasets`` skips without a word: those of
    another format than ``read``'s (it reads a folder in one format, its most common:
    ``train.csv`` beside ``train.jsonl``), and those with an upper-case suffix
    (``more.JSONL``), which it does not find."""
    formats = {BUILDERS[s] for f in read if (s := suffix_of(f))}
    out = []
    for f in _data_files(folder):
        suffix = suffix_of(f)
        if not suffix or os.path.basename(f) in _METADATA:
            continue
        if BUILDERS[suffix] not in formats or not seen_in_folder(f):
            out.append(f)
    return out + linked_folders(folder)


def split_formats(folder: str, split: str, read: list[str], flag: str, name: str) -> str | None:
    """Why a folder whose ``split`` holds files of two formats is refused (None: it holds
    one): ``datasets`` puts ``part1.jsonl`` and ``part2.csv`` in one split, then reads its
    files of one format only (the most common; a tie, either) and drops the others' rows
    without a word. Files no split takes (``extra.csv`` beside ``train.jsonl``), and those
    ``datasets`` does not find (``more.JSONL``), are only named as not read
    (:func:`other_formats`); so are a README's configs' files, resolved by the README."""
    formats = {BUILDERS[s] for f in read if (s := suffix_of(f))}
    others = [f for f in other_formats(folder, read) if suffix_of(f) and seen_in_folder(f)]
    if not others or _yaml_configs(folder):
        return None
    from datasets.data_files import DataFilesDict, get_data_patterns

    base = os.path.abspath(folder)
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
    except Exception:  # noqa: BLE001 - datasets' own resolution failed: leave it to warn
        return None
    in_split = {os.path.relpath(str(f), base) for f in found.get(split, [])}
    dropped = [f for f in others if f in in_split]
    if not dropped:
        return None
    kept, lost = os.path.relpath(read[0], base), BUILDERS[suffix_of(dropped[0]) or ".jsonl"]
    return (
        f"{flag} {name} holds split {split!r} in two formats, {'/'.join(sorted(formats))} "
        f"({kept}) and {lost} ({', '.join(dropped[:3])}), and datasets reads a folder's split "
        f"in one format only, so it would skip the {lost} files' rows: convert them to one "
        "format (e.g. all to .jsonl)"
    )


def _yaml_configs(folder: str) -> bool:
    """Whether the folder's README (or .huggingface.yaml) names configs, which then say
    which files each split holds."""
    for card in ("README.md", ".huggingface.yaml"):
        path = os.path.join(folder, card)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                if re.search(r"^configs:", f.read(1 << 16), re.MULTILINE):
                    return True
    return False


def linked_folders(folder: str) -> list[str]:
    """The folder's links to folders that hold data files (``more/ -> /data/more``), as
    ``more/ (a link)``: ``datasets`` follows a linked file but not a linked folder, so their
    rows are skipped without a word. Looked for as deep as :func:`other_formats` looks."""
    folder = os.path.normpath(folder)
    out = []
    for root, dirs, _ in os.walk(folder):
        rel = os.path.relpath(root, folder)
        below = 0 if rel == "." else rel.count(os.sep) + 1
        for d in sorted(dirs):
            path = os.path.join(root, d)
            if not d.startswith(".") and os.path.islink(path) and _holds_data(path):
                out.append(os.path.normpath(os.path.join(rel, d)) + "/ (a link)")
        dirs[:] = [] if below >= 1 else [d for d in dirs if not d.startswith(".")]
    return sorted(out)


def _holds_data(path: str) -> bool:
    try:
        return any(suffix_of(f) for f in _data_files(path, first_data=True))
    except OSError:
        return False


def _kinds(values: list[Any]) -> set[str]:
    """The kinds of a column's values (text, number, bool, list, dict), nulls aside."""
    out = set()
    for v in values:
        if v is None or v is _ABSENT:
            continue
        if isinstance(v, bool):
            out.add("bool")
        elif isinstance(v, int | float):
            out.add("number")
        else:
            out.add({str: "text", list: "list", dict: "dict"}.get(type(v), type(v).__name__))
    return out


def _unlike_files(parts: list[Rows], files: list[str], flag: str, name: str) -> str | None:
    """Why a folder's files cannot be one split (None: they can): ``datasets`` reads them as
    one table, so each file has the first one's columns, each holding the same kind of value
    (a null column aside); the message names the file, the column and the fix."""
    first, head = parts[0], files[0]
    why = "datasets reads a folder's files as one table"
    for part, file in zip(parts[1:], files[1:], strict=False):
        if not part.count:
            continue
        for column in [*first.names, *part.names]:
            if (column in first.names) != (column in part.names):
                has, lacks = (head, file) if column in first.names else (file, head)
                return (
                    f"{flag} {name}: {file}'s columns differ from {head}'s: column "
                    f"{column!r} is in {has} but not in {lacks}; {why}, so every file needs "
                    "the same columns: add or drop it, or move the file out"
                )
            was, now = _kinds(first.columns[column]), _kinds(part.columns[column])
            if len(was) == 1 and len(now) == 1 and was != now:
                plural = {"number": "numbers", "bool": "booleans", "list": "lists",
                          "dict": "objects"}  # fmt: skip
                now_, was_ = (plural.get(k, k) for k in (now.pop(), was.pop()))
                return (
                    f"{flag} {name}: column {column!r} holds {now_} in {file} but "
                    f"{was_} in {head}; {why}, so a column holds one kind of value in "
                    "every file: make them the same (e.g. all text)"
                )
    return None


def row_name(number: int, lines: Sequence[int | str] | None = None) -> str:
    """How a message names the row ``number`` (counted from 0) of a split: its line in the
    file when known (a JSON lines or CSV file read whole before launch: "line 12", as an
    editor shows it, a CSV's header and any blank line counted), its name in its own file
    for a folder's rows (``lines`` holds the names: "line 5 of part-2.jsonl"), else its
    place counted from 1, as a user counts rows ("row 11 (the first is row 1)")."""
    if lines is not None and 0 <= number < len(lines):
        entry = lines[number]
        return entry if isinstance(entry, str) else f"line {entry}"
    return f"row {number + 1} (the first is row 1)"


def _concat(parts: list[Rows], shown: list[str]) -> Rows:
    """A folder's files' rows as one split, in order. Each row keeps its name in its own
    file (``line 5 of part-2.jsonl``, ``row 3 of part-2.parquet (the first is row 1)``),
    and a CSV's cells read other than written keep their rows, counted in the split."""
    names = list(dict.fromkeys(n for p in parts for n in p.names))
    columns = {n: [v for p in parts for v in p.columns.get(n, [_ABSENT] * p.count)] for n in names}
    partial = any(p.partial for p in parts)
    rows = Rows(names, columns, sum(p.count for p in parts), partial)
    rows.lines, start = [], 0
    for part, file in zip(parts, shown, strict=False):
        for i in range(part.count):
            name = row_name(i, part.lines)
            rows.lines.append(
                f"{name} of {file}" if name.startswith("line ") else
                name.replace(" (the first", f" of {file} (the first", 1)
            )  # fmt: skip
        for merged, own in ((rows.zeros, part.zeros), (rows.missing, part.missing)):
            for column, cells in own.items():
                merged.setdefault(column, {}).update({start + k: v for k, v in cells.items()})
        start += part.count
    return rows


def _read_file(path: str, flag: str, shown: str, limit: int | None = None) -> Rows:
    """The file's rows; ``limit``: its first rows only, at most that many. A compressed
    file that does not decompress is one line naming it."""
    problem = unreadable(path, flag, shown)  # a file of a folder: its own permissions
    if problem:
        raise DataError(problem)
    if os.path.getsize(path) == 0:
        how = ", one per line" if suffix_of(path) in (".jsonl", ".csv") else ""
        raise DataError(f"{flag} {shown} is empty (0 bytes): it needs rows{how}")
    packed = compression_of(path)
    if packed is None:
        other = _other_kind(path)
        if other:
            raise DataError(f"{flag} {shown} {other}")
        return _read_plain(path, flag, shown, limit)
    try:
        return _read_plain(path, flag, shown, limit)
    except decompress_errors() as e:  # gzip, bz2, xz, zstd: bad data
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"{flag} {shown} does not decompress as {packed} ({reason}): check the file, or "
            "pass it uncompressed"
        ) from None


#: the first bytes of files that are no text, and what each is
_MAGIC = ((b"PAR1", "a Parquet file", ".parquet"), (b"\x1f\x8b", "gzip-compressed", ".gz"),
          (b"\x28\xb5\x2f\xfd", "Zstandard-compressed", ".zst"), (b"BZh", "bz2-compressed",
          ".bz2"), (b"\xfd7zXZ\x00", "xz-compressed", ".xz"))  # fmt: skip


def _other_kind(path: str) -> str | None:
    """What a plain ``.jsonl`` / ``.json`` / ``.csv`` file is instead, by its first bytes, and
    the name to give it (None: text, as its suffix says)."""
    if suffix_of(path) == ".parquet":
        return None
    with open(path, "rb") as f:
        head = f.read(6)
    base, own = os.path.basename(path), suffix_of(path) or ""
    for magic, what, suffix in _MAGIC:
        if not head.startswith(magic) or (magic == b"BZh" and not head[3:4].isdigit()):
            continue  # bz2's magic is BZh and a block size digit
        if suffix == ".parquet":
            return f"is {what}, not {own}: rename it to {base[: -len(own)]}.parquet"
        return f"is {what}: rename it to {base}{suffix}"
    return None


def _read_plain(path: str, flag: str, shown: str, limit: int | None) -> Rows:
    suffix = suffix_of(path)
    if suffix in (".jsonl", ".json"):
        if limit is not None and _first_char(path) == "{":
            return _read_json_lines(path, flag, shown, limit)
        return _read_json(path, flag, shown)  # a JSON list is one document: read whole
    if suffix == ".parquet":
        return _read_parquet(path, flag, shown, limit)
    return _read_csv(path, flag, shown, limit)


def _first_char(path: str) -> str:
    """The first character of a text file that is not white space ("" if none is near)."""
    with open_data(path) as f:
        head = f.read(65536).lstrip()
    return head[:1].decode("latin-1")


def _read_json_lines(path: str, flag: str, shown: str, limit: int) -> Rows:
    """The first ``limit`` rows of a JSON lines file, read a line at a time (the rest of the
    file is not read); errors name the line."""
    rows, numbers = [], []
    with open_data(path) as f:
        for number, raw in enumerate(f, 1):
            if len(rows) >= limit:
                break
            row = _line_row(_utf8(raw, flag, shown, number), number, flag, shown)
            if row is not None:
                rows.append(row)
                numbers.append(number)
    out = _from_dicts(rows)
    out.partial, out.lines = True, numbers
    return out


def _utf8(data: bytes, flag: str, shown: str, first_line: int = 1) -> str:
    """``data`` (lines from ``first_line`` on) as text; DataError naming the line and
    column of a byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + first_line
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{flag} {shown}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x} at column "
            f"{column}); save the file as UTF-8"
        ) from None


def _from_dicts(rows: list[dict[str, Any]]) -> Rows:
    names = list(dict.fromkeys(k for r in rows for k in r))
    columns = {n: [r.get(n, _ABSENT) for r in rows] for n in names}
    return Rows(names, columns, len(rows))


def _read_json(path: str, flag: str, shown: str) -> Rows:
    """JSON lines (either suffix), or a ``.json`` list of rows, as ``datasets`` reads
    them; errors name the line."""
    with open_data(path) as f:
        text = _utf8(f.read(), flag, shown)
    if text.startswith("\ufeff"):  # what some Windows editors write; datasets refuses it
        raise DataError(
            f"{flag} {shown} starts with a byte-order mark (BOM): save it as UTF-8 without BOM"
        )
    head = text.lstrip()[:1]
    whole: Any = None
    if head == "[":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            raise _not_json(flag, shown, e.lineno, e) from None
    elif head == "{" and suffix_of(path) == ".json":
        try:  # one object over the whole file, or JSON lines ("Extra data" after line 1)
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            _one_object(whole, flag, shown)
            if len([line for line in text.split("\n") if line.strip()]) > 1:
                raise DataError(
                    f"{flag} {shown} holds one JSON object over several lines, which the "
                    "replicas' reader (datasets) cannot read: write each row on one line "
                    "(JSON lines), or the rows as a JSON list"
                )
            whole = [whole]
    if whole is not None:
        if not all(isinstance(r, dict) for r in whole):
            i = next(i for i, r in enumerate(whole) if not isinstance(r, dict))
            raise DataError(f"{flag} {shown}: item {i} of its list is no JSON object (a row)")
        return _from_dicts(whole)
    numbers, lines = _filled_lines(text)
    try:  # one parse for the whole file; a line that is not one object: find it below
        rows = json.loads("[" + ",".join(lines) + "]")
        if len(rows) == 1 and type(rows[0]) is dict:  # a .jsonl of one object: its columns?
            _one_object(rows[0], flag, shown)
        if len(rows) == len(lines) and all(type(r) is dict for r in rows):
            return _numbered(_from_dicts(rows), numbers)
    except json.JSONDecodeError:
        pass
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        row = _line_row(line, number, flag, shown)
        if row is not None:
            rows.append(row)
    return _numbered(_from_dicts(rows), numbers)


def _filled_lines(text: str) -> tuple[list[int], list[str]]:
    """(the numbers, from 1, of the text's lines that are not blank; those lines)."""
    pairs = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    return [n for n, _ in pairs], [line for _, line in pairs]


def _numbered(rows: Rows, numbers: list[int]) -> Rows:
    """``rows`` with each row's line, when there is one row per line."""
    if len(numbers) == rows.count:
        rows.lines = numbers
    return rows


def _one_object(whole: dict[str, Any], flag: str, shown: str) -> None:
    """DataError for a file of one JSON object that holds the rows in another layout: nested
    under a key (``{"data": [...]}``), or by column, as pandas' ``df.to_json(path)`` writes
    them without ``orient="records"`` (``{"prompt": {"0": ..., "1": ...}, ...}``) or as
    ``df.to_dict("list")`` gives them (``{"prompt": [...], ...}``)."""
    nested = [k for k, v in whole.items() if _rows_under(v)]
    if nested:
        raise DataError(
            f"{flag} {shown} holds one JSON object whose rows are nested under "
            f"{nested[0]!r}: write the rows themselves, one object per line (.jsonl) "
            "or as a JSON list"
        )
    values = list(whole.values())
    if values and all(isinstance(v, dict) and v and all(k.isdigit() for k in v) for v in values):
        raise DataError(
            f"{flag} {shown} holds one JSON object of columns ({{column: {{row: value}}}}), "
            'as pandas\' to_json writes it without orient="records", lines=True: save it with '
            'df.to_json(path, orient="records", lines=True), as a .jsonl'
        )
    lengths = {len(v) if isinstance(v, list) else -1 for v in values}
    flat = all(not isinstance(x, dict | list) for v in values if isinstance(v, list) for x in v)
    if len(values) > 1 and len(lengths) == 1 and min(lengths) > 1 and flat:
        raise DataError(
            f"{flag} {shown} holds one JSON object of columns ({{column: [values]}}), not "
            "rows: write one object per row, e.g. pandas.DataFrame(columns).to_json(path, "
            'orient="records", lines=True), as a .jsonl'
        )


def _not_json(flag: str, shown: str, line: int, e: json.JSONDecodeError) -> DataError:
    return DataError(f"{flag} {shown}: line {line} is not valid JSON ({e.msg} at column {e.colno})")


def _line_row(line: str, number: int, flag: str, shown: str) -> dict[str, Any] | None:
    """Line ``number`` of a JSON lines file as its row (None: a blank line); DataError
    naming the line when it is no JSON object."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise _not_json(flag, shown, number, e) from None
    if not isinstance(row, dict):
        raise DataError(
            f"{flag} {shown}: line {number} is a JSON {type(row).__name__}, not an "
            'object: every line must be one row ({"column": value, ...})'
        )
    return row


def _rows_under(value: Any) -> bool:
    """A list of rows (objects), not a conversation (a list of role/content messages)."""
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        return False
    return not all("role" in v and "content" in v for v in value)


def _arrow_rows(table: Any) -> Rows:
    columns = {n: table.column(n).to_pylist() for n in table.column_names}
    return Rows(list(table.column_names), columns, table.num_rows)


def _read_parquet(path: str, flag: str, shown: str, limit: int | None = None) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if limit is None:
            table = pq.read_table(path)
        else:  # the first row groups' batches, up to limit rows
            batches = pq.ParquetFile(path).iter_batches(batch_size=limit)
            table = pa.Table.from_batches([next(batches)])
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid and the like
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{flag} {shown} cannot be read as Parquet: {reason}") from None
    rows = _arrow_rows(table)
    rows.partial = limit is not None
    return rows


def _read_csv(path: str, flag: str, shown: str, limit: int | None = None) -> Rows:
    """As ``datasets``' csv builder reads it (pandas' defaults): each column typed once, an
    empty cell null. ``limit``: the first rows only."""
    import pandas as pd

    numbers: list[int] = []
    with open_data(path) as f:
        if limit is None:
            numbers = _filled_lines(_utf8(f.read(), flag, shown))[0]  # a bad byte: its line
        else:
            for number, raw in enumerate(f, 1):
                _utf8(raw, flag, shown, number)
                if number > limit:
                    break
    try:
        frame = pd.read_csv(path, nrows=limit, compression=pandas_compression(path))
    except Exception as e:  # noqa: BLE001 - pandas' ParserError names the line
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise DataError(f"{flag} {shown} cannot be read as CSV: {reason}") from None
    columns = {}
    for name in frame.columns:
        series = frame[name].astype(object)
        columns[str(name)] = series.where(series.notna(), None).tolist()
    rows = Rows([str(n) for n in frame.columns], columns, len(frame), limit is not None)
    _as_written(rows, frame, path, limit)
    return _numbered(rows, numbers[1:])  # the header, then a row per line (none quoted over two)


_LEADING_ZERO = re.compile(r"^\s*[+-]?0\d")


def _as_written(rows: Rows, frame: Any, path: str, limit: int | None) -> None:
    """Note in ``rows`` the CSV cells pandas read other than they are written (``datasets``
    reads a CSV with pandas' defaults, in the replicas too): a number column's cells written
    with leading zeros, and each missing value's text. Read again as text only when a
    column is numeric or holds a missing value."""
    import pandas as pd

    numeric = [n for n in frame.columns if frame[n].dtype.kind in "iuf"]
    nulls = [n for n in frame.columns if frame[n].isna().any()]
    if not numeric and not nulls:
        return
    text = pd.read_csv(path, nrows=limit, dtype=str, keep_default_na=False,
                       compression=pandas_compression(path))  # fmt: skip
    if list(text.columns) != list(frame.columns) or len(text) != len(frame):
        return  # read otherwise (a ragged file): say nothing rather than guess
    for name in numeric:
        cells = text[name].tolist()
        zeros = {i: c for i, c in enumerate(cells) if _LEADING_ZERO.match(c)}
        if zeros:
            rows.zeros[str(name)] = zeros
    for name in nulls:
        cells, gone = text[name].tolist(), frame[name].isna().tolist()
        rows.missing[str(name)] = {i: cells[i] for i, g in enumerate(gone) if g}


def _read_saved(path: str, split: str, flag: str, shown: str) -> Rows:
    ds = load_saved(path, split, flag)  # memory-mapped: only what is decoded is held
    partial = ds.data.nbytes > CHECKED_BYTES and len(ds) > CHECKED_ROWS
    if partial:
        ds = ds.select(range(CHECKED_ROWS))
    columns = ds[:] if len(ds) else {n: [] for n in ds.column_names}  # decoded values
    names = list(ds.column_names)
    return Rows(names, {n: list(columns[n]) for n in names}, len(ds), partial)
