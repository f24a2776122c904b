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
- ``module:function``: the user's own TRL reward function, importable from the replica's
  working directory (the driver imports it from its own cwd before launch, to fail early).

A weight is written ``NAME=WEIGHT`` (the last ``=`` followed by a number), default 1.0.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUILTINS = ("exact_match", "math_answer")
#: built-ins that read the dataset's ``answer`` field
NEEDS_ANSWER = ("exact_match", "math_answer")
MATH_EXTRA = "install composer-replication[math] (math-verify) to use the math_answer reward"
_WEIGHTED = re.compile(r"^(?P<name>.+)=(?P<weight>[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)$")


class RewardError(ValueError):
    """A ``--reward`` entry is invalid; the message names the entry and the fix."""


class RewardFailed(RuntimeError):
    """A reward function raised during a step; the cause's traceback is chained."""


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
    elif name not in BUILTINS:
        raise RewardError(
            f"--reward {name!r} is unknown; choose one of {', '.join(BUILTINS)}, "
            "format:<regex> or module:function"
        )
    return RewardSpec(name, weight)


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
    try:
        import math_verify
    except ImportError:
        raise RewardError(MATH_EXTRA) from None
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
    module, _, func = name.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise RewardError(
            f"--reward {name}: cannot import it from the working directory ({e})"
        ) from None
    except Exception as e:  # the module itself fails: a SyntaxError, an error at import
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise RewardError(
            f"--reward {name}: importing {module} raised {type(e).__name__}: "
            f"{getattr(e, 'msg', None) or e}{where}; fix the module"
        ) from None
    if not callable(fn):
        raise RewardError(f"--reward {name}: {func} is not a function")
    return fn


def _guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` raising RewardFailed naming the reward (the original traceback chained)."""

    def reward(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise RewardFailed(f"reward {name} raised {type(e).__name__}: {e}") from e

    reward.__name__ = name.replace(":", ".")
    return reward


def reward_function(spec: RewardSpec) -> Callable[..., Any]:
    if spec.name == "exact_match":
        fn = exact_match
    elif spec.name == "math_answer":
        _math_verify()
        fn = math_answer
    elif spec.name.startswith("format:"):
        fn = format_reward(spec.name.removeprefix("format:"))
    else:
        fn = import_reward(spec.name)
    return _guarded(spec.name, fn)


def build_rewards(entries: list[str]) -> tuple[list[Callable[..., Any]], list[float]]:
    """TRL's ``reward_funcs`` and ``reward_weights`` for the ``--reward`` entries."""
    specs = parse_rewards(entries)
    return [reward_function(s) for s in specs], [s.weight for s in specs]


def check_rewards(entries: list[str]) -> list[RewardSpec]:
    """Before launch: every entry parses, math-verify is there if asked, and each
    module:function imports from the driver's cwd. RewardError otherwise."""
    specs = parse_rewards(entries)
    for s in specs:
        reward_function(s)
    return specs


def job_rewards(entries: list[str], default: Callable[..., Any]) -> dict[str, Any]:
    """The trainer's ``reward_funcs`` and the config's ``reward_weights`` for a job: the
    ``--reward`` entries, or the job's ``default`` reward when there are none."""
    if not entries:
        return {"reward_funcs": default, "reward_weights": None}
    funcs, weights = build_rewards(entries)
    return {"reward_funcs": funcs, "reward_weights": weights}
