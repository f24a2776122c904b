"""The composer job's embedded task: reverse a short string, with a verifiable reward.

A prompt is ``"<s>="`` for a random string ``s`` over a small alphabet; the correct completion
is ``reversed(s)`` followed by end-of-sequence. Everything is generated in code:

- ``hint`` (channel 2): the answer itself, put in front of the prompt by the template
  ``"{hint}|{prompt}"``, so the hint-conditioned teacher only has to copy;
- ``trace`` (channel 3): the correct completion, the "chosen" side of the replay pair.

``reverse_reward`` scores a completion in [0, 1]: the fraction of answer positions that are
right, times a length factor (exact answer = 1.0). Partial credit gives GRPO a gradient long
before the first exact answer.
"""

from __future__ import annotations

import random
from typing import Any

PROMPT_END = "="
HINT_SEP = "|"
HINT_TEMPLATE = "{hint}" + HINT_SEP + "{prompt}"


def task_alphabet(letters: str) -> str:
    """Every character the tokenizer needs for this task."""
    return letters + PROMPT_END + HINT_SEP


def make_examples(
    n: int, seed: int, *, letters: str = "abcd", min_len: int = 2, max_len: int = 3
) -> list[dict[str, Any]]:
    """``n`` examples (prompt, answer, hint, trace), deterministic for a seed."""
    if not letters or min_len < 1 or max_len < min_len:
        raise ValueError(
            f"bad task shape: letters={letters!r}, min_len={min_len}, max_len={max_len}"
        )
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice(letters) for _ in range(rng.randint(min_len, max_len)))
        answer = s[::-1]
        rows.append({"prompt": s + PROMPT_END, "answer": answer, "hint": answer, "trace": answer})
    return rows


def score(completion: str, answer: Any) -> float:
    """Fraction of correct positions, scaled down for a wrong length; 1.0 iff exact. An
    answer that is a number is compared as it prints (a dataset's ``24`` is the text
    "24"), as the other built-in rewards compare it."""
    answer = str(answer)
    hits = sum(1 for a, b in zip(completion, answer, strict=False) if a == b)
    length_factor = min(len(completion), len(answer)) / max(len(completion), len(answer), 1)
    return (hits / max(len(answer), 1)) * length_factor


def completion_text(completion: Any) -> str:
    """A completion's text: TRL hands a conversational completion over as its messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return completion


def reverse_reward(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """TRL reward function: one score per completion, plain or conversational (``score``)."""
    return [score(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]
