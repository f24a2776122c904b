"""The composer job's dataset: ``--dataset`` (a Hub id; a .jsonl/.json/.parquet/.csv file by
path or fsspec URL, the text ones also compressed: crf/replica/data_suffixes.py; a local
folder of such files, or a ``save_to_disk`` folder: crf/replica/data_files.py),
``--dataset-config`` (:func:`check_config`), ``--column FIELD=COLUMN`` and each replica's
shard.

Rows are loaded with the ``datasets`` library (``load_dataset("json"|"parquet"|"csv",
data_files=...)`` for files and URLs, ``load_dataset(id, config, split=...)`` for the Hub or a
folder, ``load_from_disk`` for a saved one); the file's columns are renamed to the job's
fields ``prompt`` / ``answer`` / ``hint`` / ``trace``, and every column is kept under its own
name as well, as TRL hands every column of the dataset to the reward functions
(:func:`kept_columns`). ``prompt`` is required (and ``answer`` when a built-in reward reads
it); ``hint`` and ``trace`` are optional: a row without them (column absent, or an empty/null
value) takes no part in channel 2 / 3 (the trainer skips it). Replica ``rank`` takes rows
``rank::world_size`` (``Dataset.shard(contiguous=False)``), shuffled by its data seed, as the
embedded task does.

One set of row rules (:func:`check_values`) holds twice: the launcher applies it to every row
of a local file or folder before any replica starts (crf/launcher/data_checks.py), and each
replica to its own rows at setup (:func:`load_shard`), so a Hub or URL dataset, which the
launcher does not read whole, fails with the same one line naming the row. Values are read
decoded by the dataset's features (:func:`decoded`), never through ``to_list()``.

Held-out rows (``--eval-split`` / ``--eval-dataset``, :func:`eval_source`) go through the same
loading, ``--column`` mapping and rules; every replica draws the same ``--eval-examples`` of
them with the run's seed (:func:`load_eval`) and scores its share (crf/replica/evaluation.py).
A file (or a saved Dataset) has one split, so ``--eval-split`` needs a Hub id or a local
folder (``datasets`` reads a folder of ``train.jsonl`` / ``test.jsonl`` as those two splits; a
saved DatasetDict has its own); a held-out file is ``--eval-dataset``.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from crf.replica.data_files import (
    BUILDERS,
    DataError,
    Rows,
    check_local,
    config_option,
    load_saved,
    no_bars,
    part_error,
    read_rows,
    row_name,
    saved_kind,
    suffix_of,
)
from crf.replica.data_suffixes import READ_FORMS, form_problem

FIELDS = ("prompt", "answer", "hint", "trace")
#: columns TRL's GRPOTrainer reads as a vision model's inputs; crf trains text models (a
#: tokenizer is the processing class), so they are not handed to the trainer
MEDIA_COLUMNS = ("image", "images")
#: the answer reader without --reward: the job's own reward (exact match on the answer)
DEFAULT_READER = "(default)"
__all__ = ["BUILDERS", "FIELDS", "DataError", "NotStreamed", "row_name"]


def builder_of(dataset: str) -> str | None:
    """The ``datasets`` builder for a file or URL (by its suffix), None for a Hub id or a
    folder: a local folder named like a file (Spark's and pandas' ``train.parquet/`` of
    ``part-*.parquet`` files, ``rows.jsonl/``) is read as a folder, as the launcher reads it."""
    suffix = suffix_of(dataset)
    if suffix is not None and "://" not in dataset and os.path.isdir(os.path.expanduser(dataset)):
        return None
    if suffix is not None:
        return BUILDERS[suffix]
    if "://" in dataset:
        raise DataError(
            form_problem(dataset, "--dataset")
            or f"--dataset {dataset}: a URL must name one of crf's {READ_FORMS}"
        )
    return None


def is_local_file(dataset: str) -> bool:
    return builder_of(dataset) is not None and "://" not in dataset


def is_local_folder(dataset: str) -> bool:
    """A local folder of data files (``train.jsonl``, ``test.jsonl``...), which ``datasets``
    reads like a Hub dataset, one split per file name, so ``--eval-split`` can name one; or
    a ``save_to_disk`` folder (a DatasetDict's splits)."""
    return "://" not in dataset and os.path.isdir(os.path.expanduser(dataset))


def is_local(dataset: str) -> bool:
    """A file or folder on this machine's disk (read whole before launch)."""
    return is_local_file(dataset) or is_local_folder(dataset)


def one_split(dataset: str) -> bool:
    """A dataset that is one split: a file, or a saved Dataset (not DatasetDict)."""
    return bool(builder_of(dataset)) or saved_kind(os.path.expanduser(dataset)) == "dataset"


def check_config(dataset: str, config: str | None, flag: str = "--dataset") -> None:
    """DataError for a ``--dataset-config`` that ``--dataset`` has no use for (or an
    ``--eval-dataset-config`` that ``--eval-dataset`` has none for: ``flag``): a file (by
    path or URL) or a ``save_to_disk`` folder has no configs, and ``datasets`` would read it
    whole whatever the name, so the user would believe a subset was chosen. A Hub dataset or
    a folder of files has configs (an unknown one is refused as its reader finds it)."""
    if config is None:
        return
    if builder_of(dataset) is not None:
        what = "one file"
    elif saved_kind(os.path.expanduser(dataset)):
        what = "a save_to_disk folder"
    else:
        return
    option, where = config_option(flag), "--dataset" if flag == "--eval-split" else flag
    raise DataError(
        f"{option} {config}: {where} {dataset} is {what}, which has no configs; drop "
        f"{option}, or give the Hub dataset (or folder) whose config it names"
    )


def no_column(columns: Mapping[str, str]) -> None:
    """DataError for a ``--column FIELD=`` that names no column (an unset shell variable)."""
    for key, value in columns.items():
        if not str(value).strip():
            raise DataError(
                f"--column {key}={value} names no column: give the file's column after '=' "
                f"(--column {key}=COLUMN)"
            )


def check_columns(columns: Mapping[str, str]) -> None:
    """DataError for a --column whose key is no job field, or that names no column."""
    no_column(columns)
    for key, value in columns.items():
        if key not in FIELDS:
            raise DataError(
                f"--column {key}={value}: {key!r} is no field of the job; "
                f"use one of {', '.join(FIELDS)} (KEY is the job's field, VALUE the column); "
                "a reward function gets every column under its own name without one"
            )


def _load(
    dataset: str, config: str | None, split: str, streaming: bool = False, flag: str = "--dataset"
) -> Any:
    from datasets import load_dataset

    check_local(dataset, flag)
    check_config(dataset, config, flag)
    with no_bars():  # a replica's log is for the run, not download bars
        if saved_kind(os.path.expanduser(dataset)):
            ds = load_saved(os.path.expanduser(dataset), split, flag)
            return ds.to_iterable_dataset() if streaming else ds
        builder = builder_of(dataset)
        if builder is None:  # a Hub id, or a folder of files
            try:
                return load_dataset(dataset, config, split=split, streaming=streaming)
            except Exception as e:  # a config or split it has not: one line
                known = part_error(dataset, config, split, flag, e)
                if known is None:
                    raise
                raise known from None
        files = {split: dataset}
        return load_dataset(builder, data_files=files, split=split, streaming=streaming)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """The launcher's reads of a URL: ``datasets`` logs a bad file's error before raising it,
    which would print beside crf's own one line; a replica keeps those lines in its log."""
    from datasets.utils import logging as datasets_logging

    before = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(before)


def read_error(dataset: str, flag: str, e: BaseException) -> DataError:
    """A reader's exception as one line: an empty file says so (``datasets`` raises a bare
    StopIteration for one), any other error its first line."""
    if is_local_file(dataset) and os.path.isfile(dataset) and os.path.getsize(dataset) == 0:
        how = ", one per line" if suffix_of(dataset) in (".jsonl", ".csv") else ""
        return DataError(f"{flag} {dataset} is empty (0 bytes): it needs rows{how}")
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, StopIteration):
        reason = "no rows could be read from it (is it empty?)"
    return DataError(f"{flag} {dataset} cannot be read: {reason}")


class NotStreamed(DataError):
    """A Hub dataset's first rows could not be streamed for a reason its options do not
    name (the streaming reader's or the network's): a replica, which downloads the split
    whole, may still read it, so the launch is not refused for it."""


class FirstRows(NamedTuple):
    """What the checks before launch read of a split (:func:`first_rows`)."""

    rows: list[dict[str, Any]]  # its first rows, as the file has them
    names: list[str]  # its column names
    count: int  # the rows read: every row of a local split (or its first, when partial)
    every: Rows | None  # a local split's every row; None for a URL's


def first_rows(
    dataset: str, config: str | None, split: str, n: int, flag: str = "--dataset"
) -> FirstRows:
    """The first ``n`` rows of a file, URL or local folder's ``split``, read as the checks
    before launch read them: a local split whole (crf/replica/data_files.py; of one over its
    CHECKED_BYTES, the first CHECKED_ROWS rows), so the row rules see every row; of a URL,
    only the ``n`` rows, streamed. DataError (one line, :func:`read_error`) when it cannot
    be read."""
    check_config(dataset, config, flag)
    if is_local(dataset):
        every = read_rows(dataset, split, flag, config)
        return FirstRows(every.first(n), every.names, every.count, every)
    try:
        with quiet_datasets():
            ds = _load(dataset, config, split, streaming=True, flag=flag)
            rows = list(ds.take(n))
        names = list(ds.column_names or (rows[0].keys() if rows else []))
    except DataError:
        raise
    except Exception as e:  # FileNotFoundError, parse errors, fsspec/network errors
        if builder_of(dataset) is None:  # a Hub id: streamed here, downloaded by a replica
            raise NotStreamed(str(read_error(dataset, flag, e))) from None
        raise read_error(dataset, flag, e) from None
    return FirstRows(rows, names, len(rows), None)


def required_fields(needs_answer: bool) -> tuple[str, ...]:
    return ("prompt", "answer") if needs_answer else ("prompt",)


#: how many of a file's columns a message lists
SHOWN_COLUMNS = 12


def listed_columns(names: list[str]) -> str:
    """A file's columns as a message lists them: the first :data:`SHOWN_COLUMNS`, then how
    many there are in all (a file of hundreds of feature columns stays one readable line)."""
    if len(names) <= SHOWN_COLUMNS:
        return ", ".join(names)
    return f"{', '.join(names[:SHOWN_COLUMNS])}, ... ({len(names)} in all)"


def field_columns(
    columns: Mapping[str, str],
    names: list[str],
    dataset: str,
    need: tuple[str, ...],
    flag: str = "--dataset",
) -> list[tuple[str, str]]:
    """(file column, field) for the fields whose column is there; DataError if a required
    one is missing. Pairs, not a dict by column: one column may feed several fields (a
    solution that is the trace replayed and the answer ``math_answer`` reads)."""
    out = []
    for field in FIELDS:
        column = columns.get(field, field)
        if column in names:
            out.append((column, field))
        elif field in need:
            how = f"column {column!r} (for {field})" if column != field else f"column {field!r}"
            raise DataError(
                f"{flag} {dataset} has no {how}; its columns are {listed_columns(names)} "
                f"(map one with --column {field}=COLUMN)"
            )
    return out


def load_shard(
    dataset: str,
    *,
    config: str | None,
    split: str,
    columns: Mapping[str, str],
    rank: int,
    world_size: int,
    needs_answer: bool,
    reader: str | None = None,
) -> list[dict[str, Any]]:
    """Replica ``rank``'s rows (rows ``rank::world_size``) as dicts of the job's fields,
    each checked by the rules the launcher applies to a local file (:func:`check_values`:
    a Hub or URL dataset meets them here, as a DataError naming the row)."""
    ds = _load(dataset, config, split)
    renames = field_columns(columns, list(ds.column_names), dataset, required_fields(needs_answer))
    keep = kept_columns(renames, list(ds.column_names))
    if len(ds) < world_size:
        raise DataError(_too_few(dataset, len(ds), world_size))
    shard = ds.shard(num_shards=world_size, index=rank, contiguous=False)
    values = decoded(shard)  # column -> its values
    index = range(rank, len(ds), world_size)  # the shard's rows' numbers in the split
    fields = {f: values[c] for c, f in renames}
    check_values(fields, columns, f"--dataset {dataset}", reader=reader, index=index)
    return [job_row(row, keep) for row in as_rows(values, len(shard))]


def kept_columns(
    renames: Mapping[str, str] | list[tuple[str, str]], names: list[str]
) -> list[tuple[str, str]]:
    """(column, key) of what a row keeps: each job field from its column (``renames``:
    column -> field, or (column, field) pairs), and
    every column under its own name as well, since TRL hands a reward function every column
    of the dataset as a keyword list; not a column named like a field mapped from another
    one (the mapping wins), one named like an argument TRL gives rewards itself, nor an
    image column (:data:`MEDIA_COLUMNS`)."""
    from crf.replica.rewards import PLAIN_PROMPT, TRL_ARGUMENTS

    pairs = list(renames.items()) if isinstance(renames, Mapping) else list(renames)
    fields = {f for _, f in pairs}
    taken = fields | set(TRL_ARGUMENTS) | {PLAIN_PROMPT} | set(MEDIA_COLUMNS)
    return [*pairs, *((c, c) for c in names if c not in taken)]


def job_row(row: Mapping[str, Any], keep: list[tuple[str, str]]) -> dict[str, Any]:
    """A row with the keys of :func:`kept_columns`; a job field that is null or empty is
    left out (a row without a hint or trace takes no part in that channel), any other
    column is kept as it is (a reward gets it as TRL would)."""
    out = {}
    for column, key in keep:
        if column in row:
            value = row[column]
            if key in FIELDS and (value is None or value == ""):
                continue
            out[key] = value
    return out


def decoded(ds: Any) -> dict[str, list[Any]]:
    """A ``datasets.Dataset``'s columns as Python values, decoded by its features: never
    ``to_list()``, which gives a ``Json`` column (what ``datasets`` makes of a JSON column
    that mixes kinds: text and numbers) as JSON text, quotes and all."""
    if len(ds) == 0:
        return {name: [] for name in ds.column_names}
    batch = ds[:]
    return {name: list(batch[name]) for name in ds.column_names}


def as_rows(values: Mapping[str, list[Any]], count: int) -> list[dict[str, Any]]:
    """Rows of column lists (:func:`decoded`), every column of each."""
    rows: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, column in values.items():
        for row, value in zip(rows, column, strict=True):
            row[name] = value
    return rows


# ---------------------------------------------------------------------- the row rules
#: kinds of values a column holds, as a message names them, and the fix to one kind
_KINDS = {"text": ("text", "a string"), "number": ("numbers", "a number"),
          "list": ("lists", "a list"), "dict": ("objects", "an object"),
          "bool": ("booleans", "a boolean")}  # fmt: skip


def kind_of(value: Any) -> str | None:
    """The kind of a non-null value: text, number, list, dict or bool."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "text"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "list"
    return "dict" if isinstance(value, dict) else type(value).__name__


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def column_of(columns: Mapping[str, str], field: str) -> str:
    """How a message names a field's column: ``'question' (for prompt)``."""
    column = columns.get(field, field)
    return f"'{column}'" + (f" (for {field})" if column != field else "")


def is_messages(value: Any) -> bool:
    """A conversation in TRL's format: a non-empty list of {role, content} turns, each role
    a name and each content text (or a list of parts; null only beside ``tool_calls``)."""
    return isinstance(value, list) and bool(value) and messages_problem(value) is None


def messages_problem(value: Any) -> str | None:
    """What keeps a value from being a conversation (None: it is one). A null or numeric
    content would reach the chat template as the text "None" or "3", and a null role as no
    turn at all: the model would train on what the file never said."""
    if not isinstance(value, list):
        return type_name(value)
    if not value:
        return "an empty list"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"a list whose item {i} is {type_name(m)}, not a {{'role', 'content'}} message"
        for key in ("role", "content"):
            if key not in m:
                return f"a list of messages whose message {i} has no {key!r}"
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not role.strip():
            shown = "empty" if isinstance(role, str) else type_name(role)
            return f"a list of messages whose message {i} has a role that is {shown}, not a name"
        if content is None and m.get("tool_calls"):
            continue  # an assistant's tool call: its content may be null
        if not isinstance(content, str | list):
            return (
                f"a list of messages whose message {i} ({role}) has a content that is "
                f"{type_name(content)}, not text"
            )
    return None


def value_problem(
    field: str, value: Any, columns: Mapping[str, str], reader: str | None = None
) -> str | None:
    """Why ``value`` cannot be the composer job's ``field`` in a row (None: it can): a
    prompt is text that is not blank, or a conversation; an answer that ``--reward reader``
    reads is text or a number (not NaN, which is a missing value); a hint or trace is text,
    or null/empty for none."""
    if field == "prompt":
        if (isinstance(value, str) and value.strip()) or is_messages(value):
            return None
        shown = "empty" if isinstance(value, str) else type_name(value)
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            shown = messages_problem(value) or shown
        return (
            f"the prompt in column {column_of(columns, field)} is {shown}; every row needs a "
            "prompt text (or a list of {'role', 'content'} messages): fill or drop such rows"
        )
    if field == "answer" and reader is not None:
        nan = isinstance(value, float) and value != value  # a missing value (pandas' NaN)
        if isinstance(value, str | int | float) and not isinstance(value, bool) and not nan:
            return None
        by = f"--reward {reader}" if reader != DEFAULT_READER else "the default reward"
        shown = "NaN (a missing value)" if nan else type_name(value)
        return (
            f"the answer in column {column_of(columns, field)} is {shown}, which "
            f"{by} cannot read; it needs text or a number on every row (map another with "
            "--column answer=COLUMN)"
        )
    if field in ("hint", "trace") and value is not None and not isinstance(value, str):
        return (
            f"the {field} in column {column_of(columns, field)} is {type_name(value)}; a "
            f"{field} is text (or null)"
        )
    return None


#: a quick test a good value passes (value_problem says why a value that fails it is bad)
_FINE = {
    "prompt": lambda v: type(v) is str and bool(v.strip()),
    "answer": lambda v: type(v) is str or type(v) is int or (type(v) is float and v == v),
    "hint": lambda v: v is None or type(v) is str,
    "trace": lambda v: v is None or type(v) is str,
}


def _anything(value: Any) -> bool:
    return True


def mixed_problem(values: list[Any], column: str) -> tuple[int, str] | None:
    """(position, why) for the first value of a column whose kind differs from the rest
    (text among numbers, a number among texts...); None when one kind (nulls aside) fills
    it. ``datasets`` keeps such a column as JSON text, so no row would read as written.
    ``column``: how the message names the column (:func:`column_of`)."""
    if all(type(v) is str for v in values):  # the common case
        return None
    kinds = [kind_of(v) for v in values]
    counts = Counter(k for k in kinds if k is not None)
    if len(counts) < 2:
        return None
    usual = counts.most_common(1)[0][0]
    i = next(i for i, k in enumerate(kinds) if k is not None and k != usual)
    names, fix = _KINDS.get(usual, (usual, f"a {usual}"))
    return i, (
        f"{column} is {type_name(values[i])} while other rows hold {names}; make every value {fix}"
    )


def check_values(
    values: Mapping[str, list[Any]],
    columns: Mapping[str, str],
    where: str,
    *,
    reader: str | None = None,
    index: Any = None,
    lines: Sequence[int | str] | None = None,
    missing: Mapping[str, Mapping[int, str]] | None = None,
) -> None:
    """DataError naming the first row whose field breaks :func:`value_problem`, or a
    column that mixes kinds (:func:`mixed_problem`). ``values``: field -> the values of its
    column; ``index``: the rows' numbers in the split (a shard's), 0, 1, ... by default;
    ``lines``: each row's line in its file, when known (:func:`row_name`); ``missing``:
    field -> {row: the text of a CSV cell read as missing} (:func:`csv_missing`)."""
    for field, column in values.items():
        number = index if index is not None else range(len(column))
        ok = _FINE.get(field, _anything) if field != "answer" or reader else _anything
        for i, value in zip(number, column, strict=False):
            if ok(value):  # the common case, without building a message
                continue
            problem = value_problem(field, value, columns, reader)
            if problem:
                cell = (missing or {}).get(field, {}).get(i) if value is None else None
                said = problem + (csv_missing(cell) if cell is not None else "")
                raise DataError(f"{where} {row_name(i, lines)}: {said}")
        mixed = mixed_problem(column, column_of(columns, field))
        if mixed is not None:
            raise DataError(f"{where} {row_name(number[mixed[0]], lines)}: {mixed[1]}")


def csv_missing(cell: str) -> str:
    """What a message adds of a null read from a CSV cell whose text is ``cell``: pandas
    (``datasets``' CSV reader, in every replica too) reads an empty cell, and NA, None,
    null, NaN..., as a missing value."""
    said = f"the CSV cell reads {cell!r}" if cell.strip() else "the CSV cell is empty"
    return (
        f" ({said}: pandas, which reads CSV files, takes an empty cell, NA, N/A, None, null "
        "or NaN for a missing value; fill it, or to keep such text convert the file to JSON "
        'lines: pandas.read_csv(path, dtype=str, keep_default_na=False).to_json("train.jsonl'
        '", orient="records", lines=True))'
    )


def _too_few(dataset: str, rows: int, replicas: int) -> str:
    return (
        f"--dataset {dataset} has {rows} row(s) for {replicas} replicas: every replica needs "
        "at least one; add rows or lower --replicas"
    )


def check_dataset(
    dataset: str,
    *,
    config: str | None,
    split: str,
    columns: Mapping[str, str],
    replicas: int,
    needs_answer: bool,
    flag: str = "--dataset",
    sample: int = 0,
) -> list[dict[str, Any]]:
    """Before launch, for a file, URL or local folder: readable, has the columns, enough rows
    for every replica (``replicas``; 1 for held-out data, which a replica may have none of).
    Read by :func:`first_rows`: a local file or folder whole (the launcher's row checks then
    see every row), a URL's first ``max(replicas, sample)`` rows. Returns those first rows as
    dicts of the job's fields (what the dry run inspects). A Hub id's first rows are read by
    crf/launcher/data_checks.py, within a time bound (nothing is returned for it here)."""
    check_columns(columns)
    check_local(dataset, flag)
    if builder_of(dataset) is None and not is_local_folder(dataset):
        return []
    first, names, count, _ = first_rows(dataset, config, split, max(replicas, sample), flag)
    if not count and flag != "--dataset":
        raise DataError(f"{flag} {dataset} has no rows")
    if count < replicas:
        raise DataError(_too_few(dataset, count, replicas))
    renames = field_columns(columns, names, dataset, required_fields(needs_answer), flag)
    return [{f: row.get(c) for c, f in renames} for row in first]


def answer_reader(spec: Any) -> str | None:
    """The first ``--reward`` that reads the answer column (its name; without ``--reward``,
    :data:`DEFAULT_READER`, the job's own reward), None if none does."""
    from crf.replica.rewards import parse_rewards

    specs = parse_rewards(list(getattr(spec, "reward", None) or []))
    if not specs:  # the job's own reward (the embedded task's) compares answers
        return DEFAULT_READER
    return next((s.name for s in specs if s.needs_answer), None)


def needs_answer(spec: Any) -> bool:
    """Whether the run's rows need an answer column: a ``--reward`` reads it, or the job's
    own reward does (no ``--reward``)."""
    from crf.replica.rewards import parse_rewards

    specs = parse_rewards(list(getattr(spec, "reward", None) or []))
    return any(s.needs_answer for s in specs) or not specs


def spec_shard(spec: Any, rank: int, world_size: int) -> list[dict[str, Any]]:
    """Replica ``rank``'s rows of ``spec.dataset`` (see load_shard), from the run options."""
    reader = answer_reader(spec)
    return load_shard(
        spec.dataset,
        config=spec.dataset_config,
        split=spec.dataset_split,
        columns=dict(spec.columns),
        rank=rank,
        world_size=world_size,
        needs_answer=needs_answer(spec),
        reader=reader,
    )


def eval_source(spec: Any) -> tuple[str, str | None, str] | None:
    """Where a run's held-out rows come from, as (dataset, config, split), or None:
    ``--eval-dataset`` (its split: ``--eval-split``, default ``train``), else ``--eval-split``
    of ``--dataset``. The same ``--column`` mapping applies to both."""
    other = getattr(spec, "eval_dataset", None)
    split = getattr(spec, "eval_split", None)
    if other:
        return other, getattr(spec, "eval_dataset_config", None), split or "train"
    if split and getattr(spec, "dataset", None):
        return spec.dataset, spec.dataset_config, split
    return None


def check_eval_split(spec: Any) -> None:
    """Before launch, for every job with held-out data: ``--eval-split`` without
    ``--eval-dataset`` names another split of ``--dataset``, so there must be a dataset with
    more than one split, and the split must not be the one the run trains on; else the
    "held-out" rows would be training rows, or none (DataError says what to fix)."""
    split, other, dataset = spec.eval_split, spec.eval_dataset, spec.dataset
    if split and not other:
        if not dataset:
            raise DataError(
                f"--eval-split {split} names a split of --dataset, and there is none: give "
                "--dataset, or the held-out data as --eval-dataset"
            )
        if one_split(dataset):
            raise DataError(
                f"--eval-split {split}: --dataset {dataset} is one file, one split; pass the "
                "held-out file as --eval-dataset (or a folder with train/test files as --dataset)"
            )
        if split == spec.dataset_split:
            raise DataError(
                f"--eval-split {split} is the split the run trains on (--dataset-split); "
                "name a held-out one (e.g. test)"
            )


def check_eval(spec: Any, needs_answer: bool) -> None:
    """Before launch: the held-out options make sense together (:func:`check_eval_split`),
    and a file or folder they name is readable with the columns the rewards read
    (DataError says what to fix)."""
    check_eval_split(spec)
    other = spec.eval_dataset
    source = eval_source(spec)
    if source is None:
        return
    name, config, eval_split = source
    flag = "--eval-dataset" if other else "--dataset"
    check_dataset(
        name,
        config=config,
        split=eval_split,
        columns=spec.columns,
        replicas=1,
        needs_answer=needs_answer,
        flag=flag,
    )


def load_eval(spec: Any, needs_answer: bool, reader: str | None = None) -> list[dict[str, Any]]:
    """The run's held-out rows (:func:`eval_source`, the ``--column`` mapping), a fixed
    subsample of ``--eval-examples`` drawn with the run's seed: the same list on every
    replica. Empty when the run has no held-out data."""
    source = eval_source(spec)
    if source is None:
        return []
    dataset, config, split = source
    flag = "--eval-dataset" if spec.eval_dataset else "--dataset"
    ds = _load(dataset, config, split, flag=flag)
    renames = field_columns(
        spec.columns, list(ds.column_names), dataset, required_fields(needs_answer), flag
    )
    keep = fixed_subsample(list(range(len(ds))), int(spec.eval_examples), int(spec.seed))
    columns = kept_columns(renames, list(ds.column_names))
    ds = ds.select(keep)
    values = decoded(ds)  # column -> its values
    reader = reader if reader is not None else answer_reader(spec)
    fields = {f: values[c] for c, f in renames}
    check_values(fields, spec.columns, f"{flag} {dataset}", reader=reader, index=keep)
    return [job_row(row, columns) for row in as_rows(values, len(ds))]


def fixed_subsample(rows: list[Any], n: int, seed: int) -> list[Any]:
    """``n`` of ``rows`` (all when there are fewer), chosen by ``seed`` and kept in their
    order: every replica that draws with the run's seed holds the same held-out set."""
    import random

    if n >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]
