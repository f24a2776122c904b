"""How crf tells a data file's format: by its name's suffix, as ``datasets`` does.

A file is ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` (any case: ``load_dataset``
is told the builder for a file). A JSON lines, JSON or CSV file may also be compressed
(``rows.jsonl.gz``, ``.bz2``, ``.xz``, ``.zst``): ``datasets`` decompresses such a file itself
(Zstandard through the ``zstandard`` package, one of crf's requirements), and
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
import io
import lzma
import os
import zlib
from typing import IO, Any

#: the data files crf reads, by suffix, and the ``datasets`` builder of each
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class _ZstdFrames(io.RawIOBase):
    """A Zstandard file's bytes, frame after frame, and a ``ZstdError`` where the file ends
    inside a frame (cut short), as gzip raises ``EOFError``: ``zstandard``'s own readers
    return what they decoded and stop without a word, so a truncated file would look like
    one with fewer rows. ``zstandard`` is imported here, when a .zst file is read: datasets
    and fsspec import it the same way, and a replica that reads none never pays."""

    def __init__(self, path: str) -> None:
        import zstandard

        super().__init__()
        self._zstd = zstandard
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._started = False  # whether the current frame has taken any bytes
        self._out = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            chunk = self._frame.unused_data if self._frame.eof else b""
            if self._frame.eof:  # the next frame, if the file holds more
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
                self._started = False
            chunk = chunk or self._file.read(1 << 16)
            if not chunk:
                if self._started:
                    raise self._zstd.ZstdError("the file ends inside a frame: it was cut short")
                return 0
            self._started = True
            self._out = memoryview(self._frame.decompress(chunk))
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]  # views: no copy of the rest
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _zstd_open(path: str, mode: str) -> IO[bytes]:
    """A Zstandard file's bytes (:class:`_ZstdFrames`), buffered (lines, reads of any size)."""
    return io.BufferedReader(_ZstdFrames(path))


#: compressions a .jsonl/.json/.csv file may have (``datasets`` decompresses each, by the
#: file's first bytes), how to open each, and pandas' name for each
COMPRESSIONS: dict[str, Any] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open,
                                ".zst": _zstd_open, ".zstd": _zstd_open}  # fmt: skip
_PANDAS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
#: other compressions and archives, named in a refusal rather than taken for an unknown file
_OTHER_PACKINGS = (".zip", ".lz4", ".7z", ".tar", ".tgz", ".br", ".lzma", ".z", ".snappy")
SUPPORTED = ", ".join(BUILDERS)
#: what the refusals say crf reads
READ_FORMS = f"{SUPPORTED} files (.jsonl, .json and .csv also as .gz, .bz2, .xz or .zst)"


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
    """``.gz`` / ``.bz2`` / ``.xz`` / ``.zst`` for a compressed data file, None for a plain
    one."""
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
    opened: IO[bytes] = COMPRESSIONS[packed](path, "rb")
    return opened


def decompress_errors() -> tuple[type[BaseException], ...]:
    """What reading a compressed file that does not decompress raises, in each compression
    crf reads (called only once such a read failed: ``zstandard`` is imported then)."""
    import zstandard

    return (OSError, EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError)


def form_problem(name: str, flag: str) -> str | None:
    """Why a data file crf does not read is refused, when its name says what it is: a
    compressed Parquet file, or a compression other than .gz/.bz2/.xz/.zst. None otherwise."""
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
            "or compress it as .gz, .bz2, .xz or .zst"
        )
    return None


def seen_in_folder(name: str) -> bool:
    """Whether ``load_dataset(folder)`` finds this file of a folder: a data suffix in lower
    case among its name's suffixes (it skips ``train.JSONL``)."""
    parts = os.path.basename(name).split(".")[1:]
    return suffix_of(name) is not None and any(f".{p}" in BUILDERS for p in parts)
