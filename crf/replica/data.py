"""The composer job's dataset: ``--dataset`` (a Hub id, or a .jsonl/.json/.parquet/.csv file
by path or fsspec URL), ``--column FIELD=COLUMN`` and each replica's shard.

Rows are loaded with the ``datasets`` library (``load_dataset("json"|"parquet"|"csv",
data_files=...)`` for files and URLs, ``load_dataset(id, config, split=...)`` for the Hub);
the file's columns are renamed to the job's fields ``prompt`` / ``answer`` / ``hint`` /
``trace``, and every column is kept under its own name as well, as TRL hands every column of
the dataset to the reward functions (:func:`kept_columns`). ``prompt`` is required (and
``answer`` when a built-in reward reads it); ``hint`` and ``trace`` are optional: a row without
them (column absent, or an empty/null value) takes no part in channel 2 / 3 (the trainer
skips it). Replica ``rank`` takes rows ``rank::world_size``
(``Dataset.shard(contiguous=False)``), shuffled by its data seed, as the embedded task does.

``check_dataset`` reads only the first ``replicas`` rows of a file from the driver (streaming),
so a missing column, an empty shard or an unreadable file fail before any replica starts.

Held-out rows (``--eval-split`` / ``--eval-dataset``, :func:`eval_source`) go through the same
loading and ``--column`` mapping; every replica draws the same ``--eval-examples`` of them with
the run's seed (:func:`load_eval`) and scores its share (crf/replica/evaluation.py). A file has
one split, so ``--eval-split`` needs a Hub id or a local folder (``datasets`` reads a folder of
``train.jsonl`` / ``test.jsonl`` as those two splits); a held-out file is ``--eval-dataset``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FIELDS = ("prompt", "answer", "hint", "trace")
#: columns TRL's GRPOTrainer reads as a vision model's inputs; crf trains text models (a
#: tokenizer is the processing class), so they are not handed to the trainer
MEDIA_COLUMNS = ("image", "images")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """The dataset cannot be used; the message names the file or column and the fix."""


def builder_of(dataset: str) -> str | None:
    """The ``datasets`` builder for a file or URL (by its suffix), None for a Hub id."""
    path = dataset.split("?", 1)[0].lower()
    for suffix, builder in BUILDERS.items():
        if path.endswith(suffix):
            return builder
    if "://" in dataset:
        raise DataError(f"--dataset {dataset}: a URL must name a {', '.join(BUILDERS)} file")
    return None


def is_local_file(dataset: str) -> bool:
    return builder_of(dataset) is not None and "://" not in dataset


def is_local_folder(dataset: str) -> bool:
    """A local folder of data files (``train.jsonl``, ``test.jsonl``...): ``datasets`` reads
    it like a Hub dataset, one split per file name, so ``--eval-split`` can name one."""
    import os

    return "://" not in dataset and os.path.isdir(dataset)


def check_columns(columns: Mapping[str, str]) -> None:
    """DataError for a --column whose key is no job field."""
    for key, value in columns.items():
        if key not in FIELDS:
            raise DataError(
                f"--column {key}={value}: {key!r} is no field of the job; "
                f"use one of {', '.join(FIELDS)} (KEY is the job's field, VALUE the column); "
                "a reward function gets every column under its own name without one"
            )


def _load(dataset: str, config: str | None, split: str, streaming: bool = False) -> Any:
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # a replica's log is for the run, not download bars
    builder = builder_of(dataset)
    if builder is None:
        return load_dataset(dataset, config, split=split, streaming=streaming)
    return load_dataset(builder, data_files={split: dataset}, split=split, streaming=streaming)


def read_error(dataset: str, flag: str, e: BaseException) -> DataError:
    """A reader's exception as one line: an empty file says so (``datasets`` raises a bare
    StopIteration for one), any other error its first line."""
    import os

    if is_local_file(dataset) and os.path.isfile(dataset) and os.path.getsize(dataset) == 0:
        return DataError(f"{flag} {dataset} is empty (0 bytes): it needs rows, one per line")
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, StopIteration):
        reason = "no rows could be read from it (is it empty?)"
    return DataError(f"{flag} {dataset} cannot be read: {reason}")


def required_fields(needs_answer: bool) -> tuple[str, ...]:
    return ("prompt", "answer") if needs_answer else ("prompt",)


def _renames(
    columns: Mapping[str, str],
    names: list[str],
    dataset: str,
    need: tuple[str, ...],
    flag: str = "--dataset",
):
    """file column -> field, for the fields whose column is there; DataError if a required
    one is missing."""
    out = {}
    for field in FIELDS:
        column = columns.get(field, field)
        if column in names:
            out[column] = field
        elif field in need:
            how = f"column {column!r} (for {field})" if column != field else f"column {field!r}"
            raise DataError(
                f"{flag} {dataset} has no {how}; its columns are {', '.join(names)} "
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
) -> list[dict[str, Any]]:
    """Replica ``rank``'s rows (rows ``rank::world_size``) as dicts of the job's fields."""
    ds = _load(dataset, config, split)
    renames = _renames(columns, list(ds.column_names), dataset, required_fields(needs_answer))
    keep = kept_columns(renames, list(ds.column_names))
    if len(ds) < world_size:
        raise DataError(_too_few(dataset, len(ds), world_size))
    rows = ds.shard(num_shards=world_size, index=rank, contiguous=False).to_list()
    return [job_row(row, keep) for row in rows]


def kept_columns(renames: Mapping[str, str], names: list[str]) -> list[tuple[str, str]]:
    """(column, key) of what a row keeps: each job field from its column (``renames``), and
    every column under its own name as well, since TRL hands a reward function every column
    of the dataset as a keyword list; not a column named like a field mapped from another
    one (the mapping wins), one named like an argument TRL gives rewards itself, nor an
    image column (:data:`MEDIA_COLUMNS`)."""
    from crf.replica.rewards import PLAIN_PROMPT, TRL_ARGUMENTS

    fields = set(renames.values())
    taken = fields | set(TRL_ARGUMENTS) | {PLAIN_PROMPT} | set(MEDIA_COLUMNS)
    return [*renames.items(), *((c, c) for c in names if c not in taken)]


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
    Reads at most ``max(replicas, sample)`` rows (streaming) and returns them as dicts of the
    job's fields (what the dry run inspects). A Hub id is checked by the replicas (nothing is
    returned for it)."""
    check_columns(columns)
    if builder_of(dataset) is None and not is_local_folder(dataset):
        return []
    try:
        ds = _load(dataset, config, split, streaming=True)
        first = list(ds.take(max(replicas, sample)))
        names = list(ds.column_names or (first[0].keys() if first else []))
    except DataError:
        raise
    except Exception as e:  # FileNotFoundError, parse errors, fsspec/network errors
        raise read_error(dataset, flag, e) from None
    if not first and flag != "--dataset":
        raise DataError(f"{flag} {dataset} has no rows")
    if len(first) < replicas:
        raise DataError(_too_few(dataset, len(first), replicas))
    renames = _renames(columns, names, dataset, required_fields(needs_answer), flag)
    return [{f: row.get(c) for c, f in renames.items()} for row in first]


def spec_shard(spec: Any, rank: int, world_size: int) -> list[dict[str, Any]]:
    """Replica ``rank``'s rows of ``spec.dataset`` (see load_shard), from the run options."""
    from crf.replica.rewards import parse_rewards

    specs = parse_rewards(list(spec.reward))
    return load_shard(
        spec.dataset,
        config=spec.dataset_config,
        split=spec.dataset_split,
        columns=dict(spec.columns),
        rank=rank,
        world_size=world_size,
        needs_answer=any(s.needs_answer for s in specs) or not specs,
    )


def eval_source(spec: Any) -> tuple[str, str | None, str] | None:
    """Where a run's held-out rows come from, as (dataset, config, split), or None:
    ``--eval-dataset`` (its split: ``--eval-split``, default ``train``), else ``--eval-split``
    of ``--dataset``. The same ``--column`` mapping applies to both."""
    other = getattr(spec, "eval_dataset", None)
    split = getattr(spec, "eval_split", None)
    if other:
        return other, None, split or "train"
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
        if is_local_file(dataset) or builder_of(dataset):
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


def load_eval(spec: Any, needs_answer: bool) -> list[dict[str, Any]]:
    """The run's held-out rows (:func:`eval_source`, the ``--column`` mapping), a fixed
    subsample of ``--eval-examples`` drawn with the run's seed: the same list on every
    replica. Empty when the run has no held-out data."""
    source = eval_source(spec)
    if source is None:
        return []
    dataset, config, split = source
    ds = _load(dataset, config, split)
    flag = "--eval-dataset" if spec.eval_dataset else "--dataset"
    renames = _renames(
        spec.columns, list(ds.column_names), dataset, required_fields(needs_answer), flag
    )
    keep = fixed_subsample(list(range(len(ds))), int(spec.eval_examples), int(spec.seed))
    columns = kept_columns(renames, list(ds.column_names))
    return [job_row(row, columns) for row in ds.select(keep).to_list()]


def fixed_subsample(rows: list[Any], n: int, seed: int) -> list[Any]:
    """``n`` of ``rows`` (all when there are fewer), chosen by ``seed`` and kept in their
    order: every replica that draws with the run's seed holds the same held-out set."""
    import random

    if n >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]
