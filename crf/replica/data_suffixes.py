"""How crf tells a data file's format: by its name's suffix, as ``datasets`` does.

A file is ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` (any case: ``load_dataset``
is told the builder for a file). A JSON lines, JSON or CSV file may also be compressed
(``rows.jsonl.gz``, ``.bz2``, ``.xz``): ``datasets`` decompresses such a file itself, and
the launcher's row checks read it through the same decompression (:func:`open_data`). A
Parquet file compresses its own columns; ``datasets`` reads no compressed ``.parquet.gz``,
so one is refused by name (:func:`form_problem`), as is a compression crf does not read.

In a folder, ``datasets`` finds a file only when its name has a lower-case data suffix
(``train.jsonl``, ``train.jsonl.GZ``; not ``train.JSONL``), and skips the others without a
word (:func:`seen_in_folder`).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
from typing import IO

#: the data files crf reads, by suffix, and the ``datasets`` builder of each
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
#: compressions a .jsonl/.json/.csv file may have (``datasets`` decompresses each), and how
#: to open each; pandas' name for each is the opener's module name
COMPRESSIONS = {".gz": gzip, ".bz2": bz2, ".xz": lzma}
_PANDAS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz"}
#: other compressions and archives, named in a refusal rather than taken for an unknown file
_OTHER_PACKINGS = (".zst", ".zstd", ".zip", ".lz4", ".7z", ".tar", ".tgz", ".br", ".lzma",
                   ".z", ".snappy")  # fmt: skip
SUPPORTED = ", ".join(BUILDERS)
#: what the refusals say crf reads
READ_FORMS = f"{SUPPORTED} files (.jsonl, .json and .csv also as .gz, .bz2 or .xz)"


def _bare(path: str) -> str:
    return path.split("?", 1)[0].lower()


def _unpacked(bare: str) -> tuple[str, str | None]:
    """(the name without its compression suffix, that suffix or None)."""
    return next(((bare[: -len(c)], c) for c in COMPRESSIONS if bare.endswith(c)), (bare, None))


def suffix_of(path: str) -> str | None:
    """The data suffix ``path`` ends with, before any compression suffix crf reads (a URL's
    query left out); None for any other name, and for a compressed Parquet file."""
    inner, packed = _unpacked(_bare(path))
    suffix = next((s for s in BUILDERS if inner.endswith(s)), None)
    return None if packed and suffix == ".parquet" else suffix


def compression_of(path: str) -> str | None:
    """``.gz`` / ``.bz2`` / ``.xz`` for a compressed data file, None for a plain one."""
    return _unpacked(_bare(path))[1] if suffix_of(path) else None


def pandas_compression(path: str) -> str | None:
    """The compression pandas is told for ``path`` (None: plain)."""
    packed = compression_of(path)
    return _PANDAS[packed] if packed else None


def open_data(path: str) -> IO[bytes]:
    """The file's bytes, decompressed as ``datasets`` decompresses them."""
    packed = compression_of(path)
    if packed is None:
        return open(path, "rb")
    opened: IO[bytes] = COMPRESSIONS[packed].open(path, "rb")
    return opened


def form_problem(name: str, flag: str) -> str | None:
    """Why a data file crf does not read is refused, when its name says what it is: a
    compressed Parquet file, or a compression other than .gz/.bz2/.xz. None otherwise."""
    bare = _bare(name)
    inner, packed = _unpacked(bare)
    if packed and inner.endswith(".parquet"):
        return (
            f"{flag} {name} is a compressed Parquet file, which datasets does not read: "
            "decompress it and pass the .parquet file (Parquet compresses its columns itself)"
        )
    stem, ext = os.path.splitext(bare)
    if ext in _OTHER_PACKINGS and any(stem.endswith(s) for s in BUILDERS):
        return (
            f"{flag} {name} is compressed as {ext}, which crf does not read: decompress it, "
            "or compress it as .gz, .bz2 or .xz"
        )
    return None


def seen_in_folder(name: str) -> bool:
    """Whether ``load_dataset(folder)`` finds this file of a folder: a data suffix in lower
    case among its name's suffixes (it skips ``train.JSONL``)."""
    parts = os.path.basename(name).split(".")[1:]
    return suffix_of(name) is not None and any(f".{p}" in BUILDERS for p in parts)
