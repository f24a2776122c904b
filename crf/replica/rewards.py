"""Rewards of the composer job: ``--reward NAME[=WEIGHT]``, repeatable.

Each entry names one TRL reward function; several are handed to GRPO as ``reward_funcs`` with
their weights as ``GRPOConfig.reward_weights`` (TRL sums them, weighted, per completion; we do
not). Names:

- ``exact_match``: 1.0 when the stripped completion equals the stripped ``answer``;
- ``math_answer``: 1.0 when the completion's final answer is mathematically equal to
  ``answer``, checked by Hugging Face's ``math-verify`` (an optional extra: it parses LaTeX and
  plain numbers into SymPy and compares them, offline; the same checker the Open-R1 GRPO
  recipes use, so results compare with theirs);
- ``format:<regex>``: 1.0 when the completion matches the Python regex (``re.search``, DOTALL;
  anchor it with ``^...$`` for a whole-completion match);
- ``module:function``: the user's own TRL reward function (``def`` or ``async def``, as
  TRL's GRPOTrainer takes both), importable from the replica's working directory (the
  driver imports it before launch, to fail early).

A weight is written ``NAME=WEIGHT`` (the last ``=`` followed by a number), default 1.0.

Every reward is called as TRL calls it: ``prompts``, ``completions``, ``completion_ids``,
every other column of the dataset as a keyword list, ``trainer_state``, ``log_extra`` and
``log_metric``. Prompts and completions keep the form of the dataset's prompts: text for a
text prompt, messages for a conversation. A replica whose model has a chat template sends a
text prompt to the model as a one-message conversation (so the template is applied); its
rewards still see the text (:func:`in_dataset_form`), so a reward written for TRL with that
dataset works unchanged, and the check before launch calls it in that same form.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from crf.replica.time_limit import TooSlow, within

BUILTINS = ("exact_match", "math_answer")
#: built-ins that read the dataset's ``answer`` field
NEEDS_ANSWER = ("exact_match", "math_answer")
MATH_EXTRA = "install composer-replication[math] (math-verify) to use the math_answer reward"
#: the column a replica adds to each row whose text prompt it turned into a conversation for
#: the chat template: that text (never handed to a reward: :func:`in_dataset_form`)
PLAIN_PROMPT = "crf_plain_prompt"
#: the keyword arguments TRL gives every reward itself; a dataset column of one of these
#: names is not passed on (TRL would pass the keyword twice)
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                 "log_metric", "environments")  # fmt: skip
_WEIGHTED = re.compile(r"^(?P<name>.+)=(?P<weight>[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)$")


class RewardError(ValueError):
    """A ``--reward`` entry is invalid; the message names the entry and the fix."""


class RewardFailed(RuntimeError):
    """A reward function raised during a step; the cause's traceback is chained."""


class RewardTimedOut(RewardFailed):
    """A reward call did not return within the run's ``--reward-timeout``; raised with no
    exception chained (a TimeoutError in the chain would read as a network's, which a
    restart may outlive: crf.replica.failures.transient)."""


@dataclass(frozen=True)
class RewardSpec:
    """One parsed ``--reward`` entry."""

    name: str
    weight: float = 1.0

    @property
    def needs_answer(self) -> bool:
        return self.name in NEEDS_ANSWER


def parse_reward(entry: str) -> RewardSpec:
    """``NAME`` or ``NAME=WEIGHT`` as a RewardSpec, RewardError if malformed or unknown."""
    if not isinstance(entry, str) or not entry.strip():
        raise RewardError(f"--reward {entry!r} is empty: give NAME or NAME=WEIGHT")
    name, weight = entry.strip(), 1.0
    m = _WEIGHTED.match(name)
    if m:
        name, weight = m["name"], float(m["weight"])
    elif "=" in name and not name.startswith("format:"):
        raise RewardError(f"--reward {entry!r}: the weight after '=' must be a number")
    if not math.isfinite(weight):
        raise RewardError(f"--reward {entry!r}: the weight must be a finite number")
    if name.startswith("format:"):
        try:
            re.compile(name.removeprefix("format:"))
        except re.error as e:
            raise RewardError(f"--reward {entry!r}: bad regex ({e})") from None
    elif ":" in name:
        module, _, func = name.partition(":")
        if not module or not func.isidentifier():
            raise RewardError(f"--reward {entry!r}: write module:function (mypkg.rewards:score)")
        if "/" in module or "\\" in module or module.endswith(".py"):
            raise RewardError(_file_hint(name))
    elif name not in BUILTINS:
        raise RewardError(
            f"--reward {name!r} is unknown; choose one of {', '.join(BUILTINS)}, "
            "format:<regex> or module:function"
        )
    return RewardSpec(name, weight)


def _file_hint(name: str) -> str:
    """The fix for a ``--reward`` naming a file path: its module, shipped by --workdir."""
    module, _, func = name.partition(":")
    path = module.replace("\\", "/")
    folder, _, stem = path.rpartition("/")
    stem = stem.removesuffix(".py")
    return (
        f"--reward {name} names a file; name its module instead, and ship its folder with "
        f"--workdir: --workdir {folder or '.'} --reward {stem}:{func}"
    )


def parse_rewards(entries: list[str]) -> list[RewardSpec]:
    return [parse_reward(e) for e in entries]


def _text(completion: Any) -> str:
    """A completion as text: a string, or the last message of a conversation."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_match(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return [
        float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)
    ]


def _math_verify() -> Any:
    """math-verify, its warning that timeouts are off kept quiet: crf turns its signal-based
    timeouts off on purpose (a reward may run outside the main thread), and the warning
    would be a second line beside a launcher's one-line refusal."""
    try:
        import math_verify
    except ImportError:
        raise RewardError(MATH_EXTRA) from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def math_answer(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the gold answer."""
    mv = _math_verify()
    out = []
    for c, a in zip(completions, answer, strict=True):
        # no signal-based timeouts: a reward may run outside the main thread
        gold = mv.parse(str(a), parsing_timeout=None)
        pred = mv.parse(_text(c), parsing_timeout=None)
        out.append(float(bool(gold) and bool(pred) and mv.verify(gold, pred, timeout_seconds=None)))
    return out


def format_reward(pattern: str) -> Callable[..., list[float]]:
    """A reward of 1.0 for completions matching ``pattern`` (re.search, DOTALL)."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [float(compiled.search(_text(c)) is not None) for c in completions]

    reward.__name__ = "format"
    return reward


def import_reward(name: str) -> Callable[..., Any]:
    """``module:function`` imported with the working directory on sys.path."""
    from crf.replica import reward_code

    module, _, func = name.partition(":")
    reward_code.install()  # a local replica: the code its driver checked
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        fn = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as e:
        hint = ""
        if e.name == module.split(".")[0]:  # the user's module itself, not one it imports
            hint = (
                f"; is {module} in the folder --workdir ships (the replicas' working "
                "directory)? pass --workdir FOLDER"
            )
        raise RewardError(
            f"--reward {name}: cannot import it from the working directory ({e}){hint}"
        ) from None
    except (ImportError, AttributeError) as e:
        mine = _shadowed(module)
        if mine is not None:
            top = module.split(".")[0]
            raise RewardError(
                f"--reward {name}: {top} is also the name of a module Python imports before "
                f"yours ({_where(sys.modules[top])}), so your {mine} is never read; rename "
                f"it (e.g. my_{top}.py) and pass --reward my_{module}:{func}"
            ) from None
        raise RewardError(
            f"--reward {name}: cannot import it from the working directory ({e})"
        ) from None
    except SystemExit as e:  # sys.exit() at the module's top level
        raise RewardError(
            f"--reward {name}: importing {module} called sys.exit({e.code!r}); a module "
            "that holds rewards must import without exiting (move that code under "
            '`if __name__ == "__main__":`)'
        ) from None
    except Exception as e:  # the module itself fails: a SyntaxError, an error at import
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise RewardError(
            f"--reward {name}: importing {module} raised {type(e).__name__}: "
            f"{getattr(e, 'msg', None) or e}{where}; fix the module"
        ) from None
    if not callable(fn):
        raise RewardError(f"--reward {name}: {func} is not a function")
    if inspect.isclass(fn):  # calling it makes an instance, not the rewards
        inst = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", func).lower()  # LengthReward: length_reward
        inst = inst if inst != func else f"{func}_reward"
        raise RewardError(
            f"--reward {name}: {func} is a class; a reward is called for its values, so name "
            f"an instance of it ({inst} = {func}(...) in {module}, then --reward "
            f"{module}:{inst}) or a function"
        )
    return fn


def _shadowed(module: str) -> str | None:
    """The user's own file of ``module``'s top-level name (``math.py`` beside the rewards)
    where Python imported another module of that name instead (its own ``math``, or an
    installed package), else None."""
    top = module.split(".")[0]
    found = sys.modules.get(top)
    if found is None:
        return None
    theirs = getattr(found, "__file__", None)
    for entry in sys.path:
        folder = os.path.abspath(entry or ".")
        for mine in (os.path.join(folder, f"{top}.py"), os.path.join(folder, top, "__init__.py")):
            if os.path.isfile(mine) and (theirs is None or not os.path.samefile(mine, theirs)):
                return mine
    return None


def _where(module: Any) -> str:
    return getattr(module, "__file__", None) or "built into Python"


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine, by TRL's rule (``is_async_callable``): an
    ``async def`` function, a partial of one, or an object with an ``async def __call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the __call__ of an instance
    )


def call(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(**kwargs)``, awaited when ``fn`` is async: in a thread of its own with its own
    event loop (as TRL runs async rewards on a loop in a daemon thread), so it works from
    code that is itself inside a running loop."""
    if not is_async(fn):
        return fn(**kwargs)
    coroutine = fn(**kwargs)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = e

    # a daemon thread: one that never returns does not hold the process at its exit
    thread = threading.Thread(target=run, name="crf-async-reward", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


#: the largest magnitude TRL's float32 rewards tensor holds; a larger number becomes inf
FLOAT32_MAX = 3.4028234663852886e38
#: how much of a prompt or completion a message quotes
_QUOTED_CHARS = 60
#: seconds a failed reward call's rows are tried one by one, to name the row that raises
ROW_SEARCH_S = 60.0
#: seconds past its --reward-timeout a reward call that was told to stop may take to stop
#: (one that catches every exception, or is blocked in C code, never does) before its
#: replica records the timeout and ends itself (:func:`_end_stuck`)
STUCK_GRACE_S = 30.0
#: what records a stuck call's error before its process ends (:func:`record_stuck_with`)
_record_stuck: list[Callable[[BaseException], None]] = []


def reward_value(value: Any) -> float | None:
    """``value`` as the number TRL's ``torch.tensor(..., dtype=float32)`` makes of it: a
    bool, an int, a float, or a numpy or torch scalar (a 0-d array or tensor); None for
    anything else (text, None, a list, an array of several values)."""
    if isinstance(value, bool | int | float):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and not isinstance(value, str):
        try:
            item = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
        if isinstance(item, bool | int | float):
            return float(item)
    return None


def out_of_range(number: float) -> bool:
    """Infinite, or past what float32 holds (TRL's tensor would make it infinite); NaN is
    not: TRL takes it for "no value", as None."""
    return not math.isnan(number) and abs(number) > FLOAT32_MAX


def listed(out: Any) -> Any:
    """``out`` as the list TRL makes of it (``[r for r in out]``): any iterable but text
    and mappings (TRL's tensor refuses their items); anything else as it is."""
    if inspect.iscoroutine(out) or isinstance(out, str | bytes | Mapping):
        return out
    try:
        return list(out)
    except TypeError:  # not iterable: a number, None...
        return out


def quoted(value: Any) -> str:
    """A prompt or completion as a message quotes it: its text (a conversation's last
    message), cut to :data:`_QUOTED_CHARS` characters."""
    text = _text(value) if value is not None else ""
    return repr(text if len(text) <= _QUOTED_CHARS else text[: _QUOTED_CHARS - 3] + "...")


def row_text(kwargs: Mapping[str, Any], i: int) -> str:
    """How a message names row ``i`` of a reward call: its completion and prompt."""
    prompts, completions = kwargs.get("prompts"), kwargs.get("completions")
    parts = []
    if isinstance(completions, list | tuple) and i < len(completions):
        parts.append(f"the completion {quoted(completions[i])}")
    if isinstance(prompts, list | tuple) and i < len(prompts):
        parts.append(f"of the prompt {quoted(prompts[i])}")
    return " ".join(parts) or f"row {i + 1}"


def one_row(kwargs: Mapping[str, Any], i: int, n: int) -> dict[str, Any]:
    """The keyword arguments of a reward call cut to its row ``i``: every list of ``n``
    values (prompts, completions, the columns) to a list of one."""
    return {k: [v[i]] if isinstance(v, list | tuple) and len(v) == n else v
            for k, v in kwargs.items()}  # fmt: skip


def rows_of(kwargs: Mapping[str, Any]) -> int:
    completions = kwargs.get("completions")
    return len(completions) if isinstance(completions, list | tuple) else 0


class _RowSearch:
    """The rows of a failed reward call to try one by one, and what trying them found: the
    first that raised, once another did not, within :data:`ROW_SEARCH_S`."""

    def __init__(self, kwargs: Mapping[str, Any]) -> None:
        self.n = rows_of(kwargs)
        self.deadline = time.monotonic() + ROW_SEARCH_S
        self.first: int | None = None
        self.passed = False

    def rows(self) -> Iterator[int]:
        for i in range(self.n if self.n > 1 else 0):
            if time.monotonic() > self.deadline or (self.first is not None and self.passed):
                return
            yield i

    def raised(self, i: int) -> None:
        self.first = i if self.first is None else self.first

    @property
    def row(self) -> int | None:
        return self.first if self.passed else None


def _row_in_time(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> int | None:
    """:func:`first_failing_row`, None when a row's call hangs past :data:`ROW_SEARCH_S`."""
    try:
        return within(lambda: first_failing_row(fn, kwargs), ROW_SEARCH_S)
    except TooSlow:
        return None


def first_failing_row(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> int | None:
    """The first row on which ``fn``, called on that row alone, raises, when another row
    does not (else the error is the whole call's: a wrong signature, a missing column):
    None then, and when the rows take longer than :data:`ROW_SEARCH_S` to try."""
    search = _RowSearch(kwargs)
    for i in search.rows():
        try:
            listed(call(fn, **one_row(kwargs, i, search.n)))
        except (Exception, SystemExit):  # the user's code: any error marks the row
            search.raised(i)
        else:
            search.passed = True
    return search.row


async def _first_failing_row_async(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> int | None:
    """:func:`first_failing_row` of an ``async def`` reward."""
    search = _RowSearch(kwargs)
    for i in search.rows():
        try:
            await fn(**one_row(kwargs, i, search.n))
        except (Exception, SystemExit):  # the user's code: any error marks the row
            search.raised(i)
        else:
            search.passed = True
    return search.row


def checked(name: str, out: Any, kwargs: Mapping[str, Any], n: int) -> list[Any]:
    """``out`` as the list TRL turns into its rewards tensor; RewardFailed naming the reward
    and the row for what it cannot train on: no list of one value per completion (``n``,
    counted before the call: a reward may empty the lists it is given), or a value that is
    no number (None and NaN are TRL's "no value"), or infinite."""
    values = listed(out)
    if not isinstance(values, list):
        if inspect.iscoroutine(out):  # a plain def's coroutine: TRL would not await it
            out.close()
        kind = "a coroutine" if inspect.iscoroutine(out) else f"a {type(out).__name__}"
        raise RewardFailed(
            f"reward {name} returned {kind}; a reward returns a list with one number per completion"
        )
    if n and len(values) != n:
        raise RewardFailed(
            f"reward {name} returned {len(values)} values for {n} completions; a reward "
            "returns one number (or None) per completion"
        )
    for i, value in enumerate(values):
        if value is None:
            continue
        number = reward_value(value)
        if number is None or out_of_range(number):
            shown = value if number is None else number
            raise RewardFailed(
                f"reward {name} returned {shown!r} for {row_text(kwargs, i)}; a reward "
                "returns a finite number (or a bool, or None for no value) per completion"
            )
    return values


def no_trainer_hint(e: BaseException, kwargs: Mapping[str, Any]) -> str:
    """What to add to the message of an error that ``None`` caused where the call had no
    ``trainer_state`` (outside a training step): a reward that reads
    ``trainer_state.global_step`` meets that in the held-out evaluation and the check."""
    if "trainer_state" not in kwargs or kwargs["trainer_state"] is not None:
        return ""
    if not isinstance(e, AttributeError | TypeError) or "NoneType" not in str(e):
        return ""
    return (
        " (trainer_state is None outside a training step: in the held-out evaluation and "
        "the check before launch)"
    )


def _failed(
    name: str, e: BaseException, kwargs: Mapping[str, Any], row: int | None
) -> RewardFailed:
    on = f" on {row_text(kwargs, row)}" if row is not None else ""
    if isinstance(e, SystemExit):
        return RewardFailed(
            f"reward {name} called sys.exit({e.code!r}){on}; a reward returns its values "
            "(raise an exception, or return None for a completion it cannot score)"
        )
    hint = no_trainer_hint(e, kwargs)
    return RewardFailed(f"reward {name} raised {type(e).__name__}: {e}{on}{hint}")


def timed_out(name: str, limit: float) -> RewardTimedOut:
    """The one line of a reward call past the run's ``--reward-timeout``."""
    return RewardTimedOut(
        f"reward {name} did not return within {limit:g}s (--reward-timeout {limit:g}); make "
        "it return sooner (give a call it waits on a timeout of its own) or launch with a "
        "larger --reward-timeout (0: no limit; a resume takes one too)"
    )


def record_stuck_with(record: Callable[[BaseException], None]) -> None:
    """Have ``record`` (a replica's ``fail``) write the error of a reward call that neither
    returned nor stopped in time, before the process ends (:func:`_end_stuck`)."""
    _record_stuck[:] = [record]


def _end_stuck(error: RewardTimedOut) -> None:
    """End this process: a reward call is past its time and did not stop when told to (a
    thread cannot be killed). Its error is logged and recorded as the replica's failure
    first, so the driver stops the run with that line and does not restart the replica."""
    from crf.replica.failures import EXIT_UNRECOVERABLE

    logging.getLogger("crf.replica").error(
        "replica failed, and a restart cannot fix it: %s: %s", type(error).__name__, error
    )
    for record in _record_stuck:
        try:
            record(error)
        except Exception as e:  # noqa: BLE001 - the process ends either way
            logging.getLogger("crf.replica").error("could not record the failure: %s", e)
    os._exit(EXIT_UNRECOVERABLE)


def _limited(run: Callable[[], Any], name: str, limit: float) -> Any:
    """``run()``, a plain reward's call; RewardTimedOut past ``limit`` seconds (0: none).
    On the main thread, where TRL calls it, the call is interrupted (crf.replica.time_limit);
    one that does not stop ends the process (:func:`_end_stuck`)."""
    if not limit:
        return run()
    try:
        return within(run, limit, stuck=lambda: _end_stuck(timed_out(name, limit)),
                      grace_s=STUCK_GRACE_S)  # fmt: skip
    except TooSlow:
        pass
    raise timed_out(name, limit)


async def _awaited(coroutine: Any, seconds: float) -> tuple[bool, Any]:
    """(True, its value) of ``coroutine`` awaited, or (False, None) when it is not done
    within ``seconds`` (0: no limit); it is then cancelled and left, not waited for (a
    coroutine may ignore its cancellation)."""
    if not seconds:
        return True, await coroutine
    task = asyncio.ensure_future(coroutine)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        return False, None
    return True, task.result()


async def _limited_async(coroutine: Any, name: str, limit: float) -> Any:
    """``coroutine``, an async reward's call; RewardTimedOut past ``limit`` seconds (0:
    none). A call that blocks TRL's event loop (sync code in an ``async def``) cannot be
    timed there: a timer thread ends the process once it is past its time
    (:func:`_end_stuck`)."""
    if not limit:
        return await coroutine
    timer = threading.Timer(limit + STUCK_GRACE_S, _end_stuck, (timed_out(name, limit),))
    timer.daemon = True
    timer.start()
    try:
        done, value = await _awaited(coroutine, limit)
    finally:
        timer.cancel()
    if not done:
        raise timed_out(name, limit)
    return value


def _guarded(name: str, fn: Callable[..., Any], limit: float = 0) -> Callable[..., Any]:
    """``fn`` raising RewardFailed naming the reward and, where one row alone raises, the
    row (the original traceback chained), also for ``sys.exit()`` and for values TRL cannot
    train on (:func:`checked`); an async ``fn`` stays async, so TRL awaits it with its other
    async rewards. A call past ``limit`` seconds (the run's ``--reward-timeout``; 0: none)
    raises RewardTimedOut. A network's error (crf.replica.failures.transient) is not tried
    row by row: each row would wait for it again."""
    from crf.replica.failures import transient

    if is_async(fn):

        async def reward(*args: Any, **kwargs: Any) -> Any:
            n = rows_of(kwargs)
            try:
                out = await _limited_async(fn(*args, **kwargs), name, limit)
            except RewardTimedOut:
                raise
            except (Exception, SystemExit) as e:
                row = None
                if not args and not transient(e):  # TRL passes keywords only
                    row = (await _awaited(_first_failing_row_async(fn, kwargs), ROW_SEARCH_S))[1]
                raise _failed(name, e, kwargs, row) from e
            return checked(name, out, kwargs, n)

    else:

        def reward(*args: Any, **kwargs: Any) -> Any:
            n = rows_of(kwargs)
            try:  # a generator's values come from the user's code too
                out = _limited(lambda: listed(fn(*args, **kwargs)), name, limit)
            except RewardTimedOut:
                raise
            except (Exception, SystemExit) as e:
                search = not args and not transient(e)  # TRL passes keywords only
                row = _row_in_time(fn, kwargs) if search else None
                raise _failed(name, e, kwargs, row) from e
            return checked(name, out, kwargs, n)

    reward.__name__ = name.replace(":", ".")
    return reward


def _log_extra(column: str, values: list[Any]) -> None:
    """TRL's ``log_extra`` where no trainer logs completions: nothing is logged."""


def _log_metric(name: str, value: float) -> None:
    """TRL's ``log_metric`` where no trainer logs metrics: nothing is logged."""


def outside_trainer() -> dict[str, Any]:
    """The keyword arguments TRL adds to every reward call, where a reward is called
    outside a training step (the check before launch, the held-out evaluation): no
    ``trainer_state``, and ``log_extra`` / ``log_metric`` that log nothing."""
    return {"trainer_state": None, "log_extra": _log_extra, "log_metric": _log_metric}


def is_conversational(prompt: Any) -> bool:
    """The rule by which TRL hands a reward conversational completions: the prompt is a
    list of messages (else text prompts get text completions)."""
    return isinstance(prompt, list)


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """TRL's reward arguments with each row that a replica turned from text into a
    conversation (its :data:`PLAIN_PROMPT` column) given back as text: the prompt as the
    dataset held it, the completion as the assistant's text."""
    plain = kwargs.pop(PLAIN_PROMPT, None)
    if not plain or all(p is None for p in plain):
        return kwargs
    prompts, completions = list(kwargs["prompts"]), list(kwargs["completions"])
    for i, text in enumerate(plain):
        if text is not None:
            prompts[i], completions[i] = text, _text(completions[i])
    return {**kwargs, "prompts": prompts, "completions": completions}


def in_dataset_form(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with prompts and completions in the form the dataset's prompts have
    (:func:`_plain`), async when ``fn`` is, under ``fn``'s name (what TRL logs it by)."""
    if is_async(fn):

        async def reward(**kwargs: Any) -> Any:
            return await fn(**_plain(kwargs))

    else:

        def reward(**kwargs: Any) -> Any:
            return fn(**_plain(kwargs))

    reward.__name__ = getattr(fn, "__name__", None) or type(fn).__name__
    return reward


def in_dataset_forms(rewards: dict[str, Any]) -> dict[str, Any]:
    """A job's ``reward_funcs`` / ``reward_weights`` (:func:`job_rewards`) with every
    function in the dataset's form (:func:`in_dataset_form`)."""
    funcs = rewards["reward_funcs"]
    if isinstance(funcs, list | tuple):
        return {**rewards, "reward_funcs": [in_dataset_form(f) for f in funcs]}
    return {**rewards, "reward_funcs": in_dataset_form(funcs)}


def reward_function(
    spec: RewardSpec, *, guarded: bool = True, timeout: float = 0
) -> Callable[..., Any]:
    """The function of a ``--reward`` entry; ``guarded`` (as the replicas call it): its
    errors, the values TRL cannot train on and a call past ``timeout`` seconds (0: no
    limit) raised as RewardFailed (:func:`_guarded`)."""
    if spec.name == "exact_match":
        fn = exact_match
    elif spec.name == "math_answer":
        _math_verify()
        fn = math_answer
    elif spec.name.startswith("format:"):
        fn = format_reward(spec.name.removeprefix("format:"))
    else:
        fn = import_reward(spec.name)
    return _guarded(spec.name, fn, timeout) if guarded else fn


def build_rewards(
    entries: list[str], timeout: float = 0
) -> tuple[list[Callable[..., Any]], list[float]]:
    """TRL's ``reward_funcs`` and ``reward_weights`` for the ``--reward`` entries, each call
    limited to ``timeout`` seconds (0: no limit)."""
    specs = parse_rewards(entries)
    return [reward_function(s, timeout=timeout) for s in specs], [s.weight for s in specs]


def reward_modules(entries: list[str] | None) -> list[str]:
    """The modules of the ``module:function`` entries (none for built-ins and regexes, nor
    for entries that do not parse: their checks say so)."""
    try:
        specs = parse_rewards(list(entries or []))
    except RewardError:
        return []
    names = [s.name.partition(":")[0] for s in specs
             if s.name not in BUILTINS and not s.name.startswith("format:")]  # fmt: skip
    return list(dict.fromkeys(names))


def check_rewards(entries: list[str]) -> list[RewardSpec]:
    """Before launch: every entry parses, math-verify is there if asked, and each
    module:function imports from the driver's cwd. RewardError otherwise."""
    specs = parse_rewards(entries)
    for s in specs:
        reward_function(s)
    return specs


def reward_timeout(spec: Any) -> float:
    """A run's ``--reward-timeout``: its spec's, else the default (a spec from before it)."""
    from crf.spec import REWARD_TIMEOUT_S

    return float(getattr(spec, "reward_timeout", REWARD_TIMEOUT_S))


def job_rewards(
    entries: list[str], default: Callable[..., Any], timeout: float = 0
) -> dict[str, Any]:
    """The trainer's ``reward_funcs`` and the config's ``reward_weights`` for a job: the
    ``--reward`` entries (each call limited to ``timeout`` seconds, the run's
    ``--reward-timeout``; 0: no limit), or the job's ``default`` reward when there are none."""
    if not entries:
        return {"reward_funcs": default, "reward_weights": None}
    funcs, weights = build_rewards(entries, timeout)
    return {"reward_funcs": funcs, "reward_weights": weights}
