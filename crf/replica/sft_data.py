"""The ``sft`` job's dataset: which of TRL's SFT formats a file holds, checked before launch,
and each replica's rows.

``SFTTrainer`` reads three dataset formats by their column names, and the job takes them as
TRL users write them:

- ``prompt`` + ``completion``: the loss is on the completion only (TRL's default
  ``completion_only_loss``); both plain strings, or both lists of chat messages;
- ``messages``: a conversation (a list of ``{"role", "content"}``), through the tokenizer's
  chat template;
- ``text``: language modeling / continued pretraining, the loss on every token.

``--column FIELD=COLUMN`` maps a file's columns to these names (``--column text=body``). A
file with several formats is read as the first of them in the order above (TRL's own order:
its tokenizer checks for a prompt first); the other columns are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from crf.replica.data import (
    DataError,
    _load,
    _too_few,
    builder_of,
    check_local,
    column_of,
    decoded,
    first_rows,
    is_local_folder,
    is_messages,
    listed_columns,
    messages_problem,
    mixed_problem,
    no_column,
    row_name,
    type_name,
)

__all__ = ["DataError", "is_messages"]

#: the sft job's fields (``--column FIELD=COLUMN``): the formats', and ``answer`` (held-out
#: rows scored by --reward)
SFT_FIELDS = ("text", "prompt", "completion", "messages", "answer")
#: TRL's formats, in the order a row is matched to them: (name, the fields it needs)
FORMATS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("prompt-completion", ("prompt", "completion")),
    ("conversational", ("messages",)),
    ("language modeling", ("text",)),
)
#: the fields that hold the text SFTTrainer reads; held-out rewards get the prompt as
#: ``prompts``, and every other column of the row under its own name
FORMAT_FIELDS = ("text", "prompt", "completion", "messages")


def other_columns(renames: Mapping[str, str], names: list[str]) -> dict[str, str]:
    """{column: column} of the columns a held-out reward gets besides the format's and
    ``answer`` (``renames``): each under its own name, as TRL hands a reward every column of
    a dataset, by the composer job's rule (crf/replica/data.py ``kept_columns``)."""
    from crf.replica.data import kept_columns

    return {c: k for c, k in kept_columns(renames, names) if c not in renames}


def check_sft_columns(columns: Mapping[str, str]) -> None:
    """DataError for a ``--column`` whose key is no field of the sft job, that names no
    column, or that maps a prompt and its completion to one column."""
    no_column(columns)
    for key, value in columns.items():
        if key not in SFT_FIELDS:
            raise DataError(
                f"--column {key}={value}: {key!r} is no field of the sft job; use one of "
                f"{', '.join(SFT_FIELDS)} (KEY is the job's field, VALUE the column)"
            )
    prompt, completion = columns.get("prompt", "prompt"), columns.get("completion", "completion")
    if prompt == completion:  # the pair would be one column twice (``answer`` may share one)
        raise DataError(
            f"--column maps prompt and completion to one column {prompt!r}: each reads its "
            "own (--column prompt=COLUMN --column completion=OTHER)"
        )


def sft_format(
    names: list[str], columns: Mapping[str, str], dataset: str
) -> tuple[str, dict[str, str]]:
    """(format name, {file column: field}) for a file with columns ``names``; DataError (one
    line, naming the columns there are and the mapping flag) when it holds no SFT format."""
    for name, fields in FORMATS:
        wanted = [columns.get(f, f) for f in fields]
        if all(c in names for c in wanted):
            return name, dict(zip(wanted, fields, strict=True))
    mapped = "".join(f" (--column {k}={v})" for k, v in columns.items())
    raise DataError(
        f"--dataset {dataset}{mapped} has none of the sft formats: a 'text' column, 'prompt' "
        f"and 'completion' columns, or 'messages'; its columns are {listed_columns(names)} (map "
        "one with --column text=COLUMN, or prompt=... and completion=...)"
    )


def row_problem(row: Mapping[str, Any], form: str, columns: Mapping[str, str]) -> str | None:
    """Why a row (by the job's field names) does not fit its format (None: it does): text
    that is a string and not blank; a prompt and a completion both strings (the completion
    not blank) or both conversations; messages that are a conversation."""
    if form == "language modeling":
        text = row.get("text")
        if not isinstance(text, str):
            return f"{column_of(columns, 'text')} must be a string (got {type_name(text)})"
        if not text.strip():
            return (
                f"{column_of(columns, 'text')} is empty: there is nothing to learn from it; "
                "fill or drop such rows"
            )
    elif form == "conversational":
        value = row.get("messages")
        if not is_messages(value):
            got = messages_problem(value) if isinstance(value, list) else type_name(value)
            return (
                f"{column_of(columns, 'messages')} must be a list of {{'role', 'content'}} "
                f"messages (got {got})"
            )
    elif form == "prompt-completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        plain = isinstance(prompt, str) and isinstance(completion, str)
        if isinstance(prompt, list) and isinstance(completion, list):
            for field, value in (("prompt", prompt), ("completion", completion)):
                if not is_messages(value):
                    return (
                        f"{column_of(columns, field)} must be a list of {{'role', 'content'}} "
                        f"messages (got {messages_problem(value)})"
                    )
        elif not plain:
            return (
                "'prompt' and 'completion' must both be strings, or both lists of "
                f"{{'role', 'content'}} messages (got {type_name(prompt)} and "
                f"{type_name(completion)})"
            )
        if plain and not completion.strip():
            return (
                f"{column_of(columns, 'completion')} is empty: there is nothing to learn from "
                "it; fill or drop such rows"
            )
    return None


def check_row(
    row: Mapping[str, Any],
    form: str,
    dataset: str,
    index: int,
    columns: Mapping[str, str] | None = None,
    flag: str = "--dataset",
    lines: Sequence[int | str] | None = None,
) -> None:
    """DataError for a row whose values do not fit its format (:func:`row_problem`):
    checked on every row of a local file before launch, and by each replica on its rows.
    ``index``: the row's number in the split, from 0 (named as crf/replica/data.py
    ``row_name`` names it, by its line in ``lines`` when known)."""
    problem = row_problem(row, form, columns or {})
    if problem:
        raise DataError(f"{flag} {dataset} {row_name(index, lines)}: {problem}")


def check_rows(
    values: Mapping[str, list[Any]], form: str, dataset: str, columns: Mapping[str, str],
    flag: str = "--dataset", lines: Sequence[int | str] | None = None,
) -> None:  # fmt: skip
    """:func:`check_row` on every row of columns ``values`` (field -> values)."""
    fields = [f for f in values if f in dict(FORMATS)[form]]
    for i, row in enumerate(zip(*(values[f] for f in fields), strict=True)):
        check_row(dict(zip(fields, row, strict=True)), form, dataset, i, columns, flag, lines)
    for field in fields:
        mixed = mixed_problem(values[field], column_of(columns, field))
        if mixed is not None:
            raise DataError(f"{flag} {dataset} {row_name(mixed[0], lines)}: {mixed[1]}")


def check_sft_dataset(
    dataset: str,
    *,
    config: str | None,
    split: str,
    columns: Mapping[str, str],
    replicas: int,
    what: str = "--dataset",
    needs: tuple[str, ...] = (),
) -> None:
    """Before launch, for a file, URL or local folder: readable, in one of the SFT formats,
    values of the right kind, the fields held-out scoring ``needs`` (``prompt``: not plain
    text; ``answer``) and (``replicas`` > 0) a row for every replica. Read by
    crf/replica/data.py ``first_rows``: a local file or folder whole, every row checked
    (:func:`check_rows`); of a URL, the first ``replicas`` rows (at least 4). A Hub id's
    first rows are read by crf/launcher/data_checks.py, within a time bound."""
    check_sft_columns(columns)
    check_local(dataset, what)
    if builder_of(dataset) is None and not is_local_folder(dataset):
        return
    first, names, count, every = first_rows(dataset, config, split, max(replicas, 4), what)
    if count < max(replicas, 1):
        if replicas:
            raise DataError(_too_few(dataset, count, replicas))
        raise DataError(f"{what} {dataset} has no rows")
    try:
        form, renames = sft_format(names, columns, dataset)
    except DataError as e:
        raise DataError(str(e).replace("--dataset", what, 1)) from None
    if every is not None:  # a local split, read whole: every row is checked
        values = {f: every.column(c) for c, f in renames.items()}
        check_rows(values, form, dataset, columns, what, every.lines)
    else:
        for i, row in enumerate(first):
            renamed = {renames[c]: v for c, v in row.items() if c in renames}
            check_row(renamed, form, dataset, i, columns, what)
    check_scorable(dataset, form, names, columns, needs, what)


def check_scorable(
    dataset: str,
    form: str,
    names: list[str],
    columns: Mapping[str, str],
    needs: tuple[str, ...],
    what: str,
) -> None:
    """DataError unless held-out rows in ``form`` with columns ``names`` hold what
    ``--reward`` scoring ``needs``: prompts (not plain text) and an answer column."""
    if "prompt" in needs and form == "language modeling":
        raise DataError(
            f"{what} {dataset} is plain text: --reward scores answers to prompts, so the "
            "held-out rows need prompt/completion or messages columns"
        )
    answer = columns.get("answer", "answer")
    if "answer" in needs and answer not in names:
        raise DataError(
            f"{what} {dataset} has no column {answer!r} for --reward to check answers "
            f"against; its columns are {listed_columns(names)} (map one with --column "
            "answer=COLUMN)"
        )


def load_sft_rows(
    dataset: str,
    *,
    config: str | None,
    split: str,
    columns: Mapping[str, str],
    keep: tuple[str, ...] = (),
    others: bool = False,
    flag: str = "--dataset",
) -> tuple[Any, str]:
    """(``datasets.Dataset`` holding only the format's fields, and those of ``keep`` the
    file has, format name) for all rows, each checked (:func:`check_rows`: a Hub or URL
    dataset's bad row stops the replica at setup, naming the row). ``others``: every other
    column too, under its own name (:func:`other_columns`), for the rewards that score
    held-out rows."""
    ds = _load(dataset, config, split, flag=flag)
    try:
        form, renames = sft_format(list(ds.column_names), columns, dataset)
    except DataError as e:
        raise DataError(str(e).replace("--dataset", flag, 1)) from None
    format_columns = {c: f for c, f in renames.items()}
    values = decoded(ds.select_columns(list(format_columns)))
    check_rows({format_columns[c]: v for c, v in values.items()}, form, dataset, columns, flag)
    copies: dict[str, str] = {}  # kept field -> the format's field that holds its column
    for field in keep:
        column = columns.get(field, field)
        if column in renames and renames[column] != field:
            # the column is the format's already (GSM8K's ``answer`` mapped to completion):
            # the kept field is a copy of it, so the format keeps its own name
            copies[field] = renames[column]
        elif column in ds.column_names:
            renames[column] = field
    if others:
        renames.update(other_columns(renames, list(ds.column_names)))
    ds = ds.select_columns(list(renames)).rename_columns(
        {c: f for c, f in renames.items() if c != f}
    )
    for field, source in copies.items():
        ds = ds.add_column(field, ds[source])
    return ds, form
