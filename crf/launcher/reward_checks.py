"""Before launch: each ``--reward`` called on the sampled rows of the run's data.

A reward function that raises, exits, hangs or returns what TRL cannot train on would fail
inside every replica's first training step, on every restart. So the launcher calls each
reward as TRL's trainer calls it (prompts, completions, the dataset's columns as keyword
lists), on the rows crf/launcher/data_checks.py sampled, with each row's answer standing in
for a completion, within :data:`REWARD_CALL_S`, and refuses the launch in one line; and it
warns of entries that are allowed but hardly meant (a reward twice, a weight of 0).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from crf.executors.secrets import redact, secret_values
from crf.launcher.data_checks import Split, shown_column, value_kind
from crf.launcher.errors import LaunchError
from crf.replica.data import listed_columns
from crf.replica.rewards import TRL_ARGUMENTS, listed, out_of_range, reward_value
from crf.replica.time_limit import TooSlow, within

#: seconds each reward function may take on the sampled rows before the launch is refused
REWARD_CALL_S = 60.0


def import_rewards(entries: list[str] | None) -> None:
    """Each ``--reward module:function`` imported within :data:`REWARD_CALL_S`: a module
    that blocks at import (a download, a lock, an ``input()``) would hang the launch, and
    then every replica's setup. What an import raises is left to the reward checks that
    follow (``check_rewards``), which import the same modules again, from ``sys.modules``."""
    from crf.replica.rewards import BUILTINS, RewardError, parse_rewards, reward_function

    try:
        specs = parse_rewards(list(entries or []))
    except RewardError:
        return  # said by the checks that follow
    for s in specs:
        if s.name in BUILTINS or s.name.startswith("format:"):
            continue
        try:
            within(lambda s=s: reward_function(s), REWARD_CALL_S)
        except TooSlow:
            module = s.name.partition(":")[0]
            raise LaunchError(
                f"--reward {s.name}: importing {module} did not finish within "
                f"{REWARD_CALL_S:g}s; a module that holds rewards must import quickly (load "
                "models or data on the reward's first call, not at import)"
            ) from None
        except RewardError:
            return


def check_rewards_shipped(spec: Any, executor: Any, shipped: Collection[str] = ()) -> None:
    """LaunchError for a ``module:function`` reward that the replicas of a backend that runs
    them elsewhere (one that installs their packages: a cloud backend) will not find: a
    module this machine imports from a folder of its own (the working directory, a
    PYTHONPATH entry, an editable install) that ``--workdir`` does not ship (``shipped``:
    the files it packs) and no ``--pip`` entry installs. Each replica would fail at setup.
    An installed package, crf's own modules and a run with its own ``--image`` pass."""
    if not getattr(executor, "installs_packages", False) or _own_image(executor):
        return
    from crf.replica.rewards import BUILTINS, parse_rewards

    for s in parse_rewards(list(spec.reward or [])):
        if s.name in BUILTINS or s.name.startswith("format:"):
            continue
        module = s.name.partition(":")[0]
        top = sys.modules.get(module.split(".")[0])
        path = getattr(top, "__file__", None)
        if path is None or _ships(module, shipped) or _installed(path, module, spec.pip):
            continue
        folder = Path(path).parent.parent if Path(path).name == "__init__.py" else Path(path).parent
        given = f"--workdir {spec.workdir} does not ship it" if spec.workdir else "no --workdir"
        shown = getattr(sys.modules.get(module), "__file__", None) or path
        raise LaunchError(
            f"--reward {s.name}: {module} is imported from {shown} on this machine, which the "
            f"{spec.backend} replicas cannot read ({given}); ship its folder with --workdir "
            f"{folder}, or install it in their image (--pip, --image)"
        )


def _ships(module: str, names: Collection[str]) -> bool:
    """Whether the packed workdir's files (its root is on the replicas' PYTHONPATH) hold
    ``module``."""
    path = module.replace(".", "/")
    return f"{path}.py" in names or f"{path}/__init__.py" in names


def _installed(path: str, module: str, pip: list[str]) -> bool:
    """Whether the module file at ``path`` is part of an installation the replicas get too:
    crf itself (shipped with each run), the standard library or site-packages of an image,
    or a distribution a ``--pip`` entry names."""
    import importlib.metadata
    import sysconfig

    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    real = Path(path).resolve()
    crf_root = Path(__file__).resolve().parents[1]
    places = [crf_root, *(Path(p).resolve() for p in sysconfig.get_paths().values())]
    if any(real.is_relative_to(p) for p in places) or "site-packages" in real.parts:
        return True
    named = set()
    for entry in pip or ():
        try:
            named.add(canonicalize_name(Requirement(entry).name))
        except InvalidRequirement:
            continue
    dists = importlib.metadata.packages_distributions().get(module.split(".")[0], [])
    return any(canonicalize_name(d) in named for d in dists)


def _own_image(executor: Any) -> bool:
    """Whether the backend runs the replicas in an image of the user's (``--image``), which
    may hold their code: another image than the backend's default."""
    image = getattr(executor, "image", None)
    try:
        default = inspect.signature(type(executor)).parameters["image"].default
    except (KeyError, TypeError, ValueError):
        default = None
    return bool(image) and image != default


def embedded_splits(spec: Any) -> list[Split]:
    """The embedded task of the composer or sft job as the split its ``--reward`` entries
    are called on when the run has no ``--dataset`` (its first
    :data:`~crf.launcher.data_checks.SAMPLE_ROWS` held-out rows, as the replicas make them
    and score them as they set up): [] otherwise."""
    if spec.job not in ("composer", "sft") or getattr(spec, "dataset", None) or not spec.reward:
        return []
    from crf.composer.task import make_examples
    from crf.launcher.data_checks import SAMPLE_ROWS
    from crf.replica.jobs import job_config

    cfg = job_config(spec.job, dict(spec.job_config or {}))
    shape = dict(letters=cfg.letters, min_len=cfg.min_len, max_len=cfg.max_len)
    rows = make_examples(SAMPLE_ROWS, int(spec.seed) + 7919, **shape)
    if spec.job == "composer":
        return [Split("the composer job's", "embedded task", rows)]
    held = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]  # as sft scores them
    return [Split("the sft job's", "embedded task", held, form="prompt-completion")]


def check_rewards_on(spec: Any, splits: list[Split]) -> None:
    """Each ``--reward`` called as the trainer calls it, on the sampled rows of the splits
    it scores (composer: all; sft: the held-out ones), with each row's answer (or an empty
    text) as the completion: it must not raise and must return a finite number per row."""
    from crf.replica.data import job_row, row_name
    from crf.replica.rewards import RewardError, parse_rewards, reward_function

    if not spec.reward:
        return
    specs = parse_rewards(list(spec.reward))
    scored = [s for s in splits if spec.job == "composer" or s.flag != "--dataset"]
    for split in scored:
        at = [
            i for i, r in enumerate(split.rows) if r.get("prompt") is not None or r.get("messages")
        ]
        rows = [split.rows[i] for i in at]
        if split.form is None:  # composer: a row as the replicas give it (an empty hint: None)
            rows = [job_row(r, [(k, k) for k in r]) for r in rows]
        if not rows:
            continue
        names = [row_name(i, split.lines) for i in at]
        for s in specs:
            if s.needs_answer:
                check_answers(spec, split, s.name)
            try:
                fn = reward_function(s, guarded=False)  # this check words its own refusals
            except RewardError as e:
                raise LaunchError(str(e)) from None
            with secrets_hidden(_secret_values(spec)):
                call_reward(s.name, fn, rows, split, many=len(specs) > 1, names=names)


class _Redacting:
    """A text stream that writes to ``out`` with the secret ``values`` replaced."""

    def __init__(self, out: TextIO, values: set[str]) -> None:
        self.out, self.values = out, values

    def write(self, text: str) -> int:
        self.out.write(redact(text, self.values))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding...
        return getattr(self.out, name)


@contextlib.contextmanager
def secrets_hidden(values: set[str]) -> Iterator[None]:
    """Inside: what the user's code prints, and the refusal (LaunchError) it leads to, with
    the secret ``values`` replaced by ``***``; a reward may print or raise with a key."""
    if not values:
        yield
        return
    out, err = sys.stdout, sys.stderr
    try:
        with contextlib.redirect_stdout(_Redacting(out, values)):
            with contextlib.redirect_stderr(_Redacting(err, values)):
                yield
    except LaunchError as e:
        raise LaunchError(redact(str(e), values)) from None


def _secret_values(spec: Any) -> set[str]:
    """The values of the run's ``--secret`` variables (and of the store credentials crf
    knows) in this environment, where the check calls the rewards: a reward reads them from
    there, and its error may quote one."""
    from crf.layout import ENV_SECRET_NAMES
    from crf.spec import secret_name

    names = ",".join(secret_name(str(e)) for e in getattr(spec, "secrets", None) or ())
    return secret_values({**os.environ, ENV_SECRET_NAMES: names})


def reward_warnings(entries: list[str], job: str = "composer") -> list[str]:
    """What the ``--reward`` entries allow but hardly mean: one given twice (called once
    per entry, logged under one name) and a weight of 0 (called and logged, adding nothing
    to the total: the reward GRPO trains on, or the sft job's held-out score)."""
    from crf.replica.rewards import parse_rewards

    specs = parse_rewards(entries)
    total = "the reward trained on" if job == "composer" else "the held-out score"
    out = []
    weights: dict[str, list[float]] = {}
    for s in specs:
        weights.setdefault(s.name, []).append(s.weight)
    for name, given in weights.items():
        if len(given) > 1:
            out.append(
                f"--reward {name} is given {len(given)} times (weights "
                f"{', '.join(f'{w:g}' for w in given)}): it is called once per entry and "
                f"logged under one name; give it once, as {name}={sum(given):g}"
            )
    zero = [s.name for s in specs if s.weight == 0]
    if zero and len(zero) == len(specs):
        learns = ", so GRPO has nothing to learn from" if job == "composer" else ""
        out.append(
            f"every --reward has weight 0: {total} is 0 for every completion{learns}; give "
            "a reward a weight other than 0"
        )
    elif zero:
        out.extend(
            f"--reward {name}=0 has weight 0: it is called and logged, but "
            f"adds nothing to {total}; give it a weight, or drop it"
            for name in dict.fromkeys(zero)
        )
    return out


def check_answers(spec: Any, split: Split, reward: str) -> None:
    """The answer column holds text or numbers (a built-in reward compares them as text);
    ``math_answer`` must find a number or expression in at least one sampled answer."""
    where = f"{split.flag} {split.dataset}"
    for i, row in enumerate(split.rows):
        value = row.get("answer")
        if value is None or isinstance(value, bool) or not isinstance(value, str | int | float):
            from crf.replica.data import row_name

            raise LaunchError(
                f"{where} {row_name(i, split.lines)}: the answer in column "
                f"{shown_column(spec, 'answer')} is {value_kind(value)}, which --reward {reward} "
                "cannot read; it needs text or a number on every row (map another with "
                "--column answer=COLUMN)"
            )
    if reward == "math_answer":
        from crf.replica.rewards import _math_verify

        mv = _math_verify()
        answers = [str(r["answer"]) for r in split.rows[:4]]
        if not any(mv.parse(a, parsing_timeout=None) for a in answers):
            raise LaunchError(
                f"{where}: math_answer finds no number or expression in the answers of column "
                f"{shown_column(spec, 'answer')} (e.g. {answers[0][:60]!r}); map the column that "
                "holds the final answer with --column answer=COLUMN, or use exact_match"
            )


def _completion(row: Mapping[str, Any]) -> Any:
    """The row's answer as a completion, in the form the replicas hand a reward: messages
    when the dataset's prompt is a conversation, else text (TRL's rule; a replica that
    sends a text prompt through the chat template gives the reward the text back)."""
    from crf.replica.rewards import is_conversational

    text = row.get("answer", row.get("completion", ""))
    text = "" if text is None or isinstance(text, list) else str(text)
    if is_conversational(_prompt(row)):
        return [{"role": "assistant", "content": text}]
    return text


def _prompt(row: Mapping[str, Any]) -> Any:
    if "messages" in row and isinstance(row["messages"], list):
        return row["messages"][:-1]
    return row.get("prompt")


def call_reward(
    name: str,
    fn: Callable[..., Any],
    rows: list[dict[str, Any]],
    split: Split,
    *,
    many: bool,
    names: list[str] | None = None,
) -> None:
    """LaunchError when reward ``name`` raises, exits, takes longer than
    :data:`REWARD_CALL_S` on ``rows`` or does not return one finite number per row, in any
    form TRL turns into its rewards tensor (:func:`reward_values`; None is TRL's "not
    applicable", allowed only beside other rewards). An error that one row alone raises
    names that row (its entry of ``names``: its line in the file)."""
    from crf.replica.rewards import call, first_failing_row, no_trainer_hint, outside_trainer
    from crf.replica.sft_data import FORMAT_FIELDS

    if split.form is None:  # composer: every column but those TRL keeps out
        extra = {k for r in rows for k in r if k not in ("prompt", "completion")}
    else:  # sft: a held-out row is scored with its other columns (sft._scorable)
        extra = {k for r in rows for k in r if k not in FORMAT_FIELDS}
    kwargs = {
        "prompts": [_prompt(r) for r in rows],
        "completions": [_completion(r) for r in rows],
        "completion_ids": [[] for _ in rows],
        **{k: [r.get(k) for r in rows] for k in sorted(extra)},
        **outside_trainer(),
    }
    where = f"on {len(rows)} row(s) of {split.flag} {split.dataset}"

    def failing() -> str:
        """Where the error is: the one row that raises alone, or the rows called."""
        try:
            row = within(lambda: first_failing_row(fn, kwargs), REWARD_CALL_S)
        except TooSlow:
            row = None
        if row is None or names is None:
            return where
        return f"on {names[row]} of {split.flag} {split.dataset} ({len(rows)} rows called)"

    try:  # a generator's values come from the user's code too
        out = within(lambda: listed(call(fn, **kwargs)), REWARD_CALL_S)
    except TooSlow:
        raise LaunchError(
            f"--reward {name} did not return within {REWARD_CALL_S:g}s {where}; make it "
            f"return faster for {len(rows)} rows (a slow reward also slows every training "
            "step, where it scores each batch of completions)"
        ) from None
    except SystemExit as e:  # sys.exit() in the user's code would end the launcher
        raise LaunchError(
            f"--reward {name} called sys.exit({e.code!r}) {failing()}; a reward returns its "
            "values: raise an exception (or return None for a completion it cannot score) "
            "instead"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's code: any error, in one line
        unfilled = _unfilled(fn, kwargs) if isinstance(e, TypeError) else []
        if unfilled:  # a parameter named after a column the data lacks
            given = [k for k in kwargs if k not in TRL_ARGUMENTS]
            raise LaunchError(
                f"--reward {name} takes a parameter {unfilled[0]!r}, which no column of "
                f"{split.flag} {split.dataset} fills (a reward gets each column under its own "
                f"name; here: {listed_columns(given) or 'none'}): name the parameter after a "
                "column, or give it a default"
            ) from None
        raise LaunchError(
            f"--reward {name} raised {type(e).__name__}: {e} {failing()}"
            f"{no_trainer_hint(e, kwargs)}; fix the function (it is called as TRL calls it: "
            "prompts, completions, and the dataset's columns as keyword lists)"
        ) from None
    check_reward_values(name, out, len(rows), where, many=many)


def _unfilled(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> list[str]:
    """The parameters of ``fn`` that a call with ``kwargs`` leaves without a value (no
    default, not given): columns it expects that the data lacks."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params
            if p.kind in named and p.default is p.empty and p.name not in kwargs]  # fmt: skip


def check_reward_values(name: str, out: Any, n: int, where: str, *, many: bool) -> None:
    """LaunchError unless ``out`` holds ``n`` rewards TRL can take (:func:`reward_value`)."""
    if inspect.iscoroutine(out):  # TRL awaits an `async def` reward only, not this
        out.close()
        raise LaunchError(
            f"--reward {name} returned a coroutine {where}: TRL awaits a reward only when it "
            "is declared `async def` (or has an `async def __call__`); declare it so"
        )
    if not isinstance(out, list) or len(out) != n:
        got = f"a {value_kind(out)}" if not isinstance(out, list) else f"{len(out)} values"
        raise LaunchError(
            f"--reward {name} returned {got} {where}; a reward returns a list (or an array) "
            "with one number per completion"
        )
    for i, value in enumerate(out):
        if value is None and many:
            continue
        number = reward_value(value)
        if number is None or math.isnan(number) or out_of_range(number):
            shown = value if number is None else number
            raise LaunchError(
                f"--reward {name} returned {shown!r} for the {_nth(i + 1)} row {where}; a "
                "reward returns a finite number (or a bool) per completion"
            )


def _nth(n: int) -> str:
    """1st, 2nd, 3rd, 4th... 11th, 12th, 13th, 21st."""
    end = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{end}"
