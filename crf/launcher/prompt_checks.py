"""Before launch: the composer job's prompts as a local ``--model`` will read them.

Three mistakes in a user's prompts surface only once a replica tokenizes them, and then on
every attempt: a chat template that refuses a conversation (an unknown role: templates call
``raise_exception``), one that renders no turn for a role it does not know (Qwen's, for
ShareGPT's ``human`` / ``gpt``: the model trains without those turns, silently), and a
prompt longer than the model's positions (TRL's GRPO does not
truncate prompts: the rollout's attention then asks for memory no machine has, which reads
as an out-of-memory death and is restarted). So the launcher renders prompts the way the
replica does (crf/replica/jobs/composer.py: a conversation through the tokenizer's chat
template with the generation prompt; a text prompt as one user message when the tokenizer has
a template, else as it is) and counts their tokens with the folder's tokenizer.

Rendering every row of a large file would take long, so the rows rendered are the sampled
first rows, the first row of each distinct sequence of roles (what a template's role checks
see), and the 16 longest prompts by characters (what the length check needs): crf/replica/
prompt_fit.py ``chosen_rows``, by which each replica of a ``--model`` run renders its own rows
at setup too. Only a local folder is read here: a Hub model's tokenizer would be a download,
so a Hub model's prompts are first rendered by the replicas.

The sft job's conversations (``messages``, or a prompt and a completion that are lists of
messages) meet the same template when each replica tokenizes its dataset, and a refused one
stops every replica at setup: :func:`check_conversations` renders the same choice of rows
before launch. Their length is no error (``SFTConfig.max_length`` truncates them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from crf.launcher.errors import LaunchError
from crf.launcher.model_shapes import learned_positions
from crf.replica.data import row_name
from crf.replica.model import local_tokenizer
from crf.replica.prompt_fit import chosen_rows, dropped_role, past_learned, tokens_over, too_long


def check_prompts(
    folder: str,
    splits: Iterable[Any],
    *,
    first: int = 8,
    trust_remote_code: bool = False,
    new_tokens: int = 0,
) -> list[str]:
    """LaunchError naming the row for a prompt the chat template refuses, one of more tokens
    than the model's ``max_position_embeddings``, or one that leaves fewer than
    ``new_tokens`` (``max_completion_length``) of a learned position table (GPT-2's: a longer
    sequence fails). ``splits``: the launcher's :class:`~crf.launcher.data_checks.Split`
    objects; ``first``: the first rows rendered whatever they hold (the sampled ones).
    Returns a warning when the longest prompt and ``new_tokens`` run past the positions of
    a model without such a table (a rotary model generates on, if worse: no error)."""
    splits = [s for s in splits if _prompts(s)]
    if not splits:
        return []
    tokenizer = local_tokenizer(folder, trust_remote_code=trust_remote_code)
    if tokenizer is None:
        return []
    limit = config_positions(folder)
    learned = learned_positions(folder) if new_tokens else None
    longest: tuple[int, Any, int] | None = None  # (tokens, split, row)
    for split in splits:
        prompts = _prompts(split)
        for i in chosen_rows(prompts, first):
            text = _render(tokenizer, prompts[i], split, i, folder)
            tokens = tokens_over(tokenizer, text, limit)
            if tokens is not None:
                raise LaunchError(f"{_row(split, i)}: the prompt {too_long(tokens, folder, limit)}")
            if new_tokens and (limit or learned):
                n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                longest = max(longest or (n, split, i), (n, split, i), key=lambda t: t[0])
    return _past_positions(folder, longest, new_tokens, learned, limit)


def _past_positions(
    folder: str, longest: tuple[int, Any, int] | None, new: int, learned: int | None,
    limit: int | None, new_name: str = "max_completion_length", what: str = "",
) -> list[str]:  # fmt: skip
    """The refusal (a learned table) or warning (another model) for a longest prompt that,
    with ``new`` tokens more (the setting ``new_name``), needs more positions than the
    model has; ``what`` leads the line (``held-out pass@1: ``)."""
    if longest is None:
        return []
    tokens, split, i = longest
    if learned and tokens + new > learned:
        raise LaunchError(
            f"{_row(split, i)}: {what}{past_learned(learned, folder, tokens, new, new_name)}"
        )
    if limit and tokens + new > limit:
        return [
            f"{_row(split, i)}: {what}a prompt of {tokens} tokens and {new_name} {new} run "
            f"past --model {folder}'s {limit} positions (max_position_embeddings); it "
            "generates on past them, usually worse"
        ]
    return []


def _prompts(split: Any) -> list[Any]:
    every = getattr(split, "every", None)
    if every is not None and "prompt" in every:
        return list(every["prompt"])
    return [row.get("prompt") for row in getattr(split, "rows", [])]


def check_conversations(
    folder: str, splits: Iterable[Any], *, first: int = 8, trust_remote_code: bool = False
) -> None:
    """LaunchError naming the row for an sft conversation the chat template refuses (module
    docstring); ``splits`` and ``first`` as for :func:`check_prompts`. A folder without a
    template is left to the launcher's tokenizer check, which refuses it for conversations."""
    chats = [(s, _conversations(s)) for s in splits]
    chats = [(s, c) for s, c in chats if any(c)]
    if not chats:
        return
    tokenizer = local_tokenizer(folder, trust_remote_code=trust_remote_code)
    if tokenizer is None or not tokenizer.chat_template:
        return
    for split, conversations in chats:
        for i in chosen_rows(conversations, first, longest=0):
            if conversations[i]:
                try:
                    text = tokenizer.apply_chat_template(conversations[i], tokenize=False)
                except Exception as e:  # noqa: BLE001 - jinja's errors, raise_exception
                    raise _refused(split, i, folder, "conversation", e) from None
                _check_kept(conversations[i], str(text), split, i, folder)


def check_answer_positions(
    folder: str, splits: Iterable[Any], new_tokens: int, *, trust_remote_code: bool = False
) -> list[str]:
    """The sft job's held-out pass@1 greedy answers (up to ``new_tokens``, its
    ``max_new_tokens``) after the longest held-out prompt, against the model's positions:
    LaunchError naming the row past a learned position table (the evaluation before the
    first step fails there, on every replica), a warning past a rotary model's
    ``max_position_embeddings``. ``splits``: the held-out ones."""
    from crf.replica.prompt_fit import longest_answer_prompt

    held = [(s, _held_out_prompts(s)) for s in splits]
    held = [(s, p) for s, p in held if any(x is not None for x in p)]
    learned = learned_positions(folder) if held else None
    limit = config_positions(folder)
    if not held or not (learned or limit):
        return []
    tokenizer = local_tokenizer(folder, trust_remote_code=trust_remote_code)
    if tokenizer is None:
        return []
    for split, prompts in held:
        found = longest_answer_prompt(tokenizer, prompts)
        longest = (found[0], split, found[1]) if found else None
        warned = _past_positions(folder, longest, new_tokens, learned, limit, "max_new_tokens",
                                 "held-out pass@1: ")  # fmt: skip
        if warned:
            return warned
    return []


def _held_out_prompts(split: Any) -> list[Any]:
    """An sft split's prompts as held-out pass@1 asks them (crf/replica/jobs/sft.py
    ``_scorable``): a conversation's turns before its last answer, else the prompt."""
    every = getattr(split, "every", None)
    rows = getattr(split, "rows", [])
    columns = every or {k: [r.get(k) for r in rows] for k in ("messages", "prompt")}
    if columns.get("messages") is not None:
        return [m[:-1] if isinstance(m, list) else None for m in columns["messages"]]
    return list(columns.get("prompt") or [])


def _conversations(split: Any) -> list[Any]:
    """An sft split's conversations, row by row (None for a row that holds none): its
    ``messages``, or its prompt and completion messages together."""
    if getattr(split, "form", None) is None:
        return []
    every = getattr(split, "every", None)
    rows = getattr(split, "rows", [])
    columns = every or {k: [r.get(k) for r in rows] for k in ("messages", "prompt", "completion")}
    if columns.get("messages") is not None:
        return [m if isinstance(m, list) else None for m in columns["messages"]]
    pairs = zip(columns.get("prompt") or [], columns.get("completion") or [], strict=False)
    return [p + c if isinstance(p, list) and isinstance(c, list) else None for p, c in pairs]


def _row(split: Any, i: int) -> str:
    """``--dataset NAME line 12`` / ``row 11 (the first is row 1)``: split row ``i``."""
    return f"{split.flag} {split.dataset} {row_name(i, getattr(split, 'lines', None))}"


def _refused(split: Any, i: int, folder: str, what: str, e: Exception) -> LaunchError:
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return LaunchError(
        f"{_row(split, i)}: --model {folder}'s chat template refuses "
        f"the {what} ({type(e).__name__}: {reason}); fix the row's messages or the template"
    )


def _render(tokenizer: Any, prompt: Any, split: Any, i: int, folder: str) -> str:
    """The prompt's text as the replica's rollout starts it."""
    if isinstance(prompt, str) and not tokenizer.chat_template:
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        text = str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    except Exception as e:  # noqa: BLE001 - jinja's errors, the template's raise_exception
        raise _refused(split, i, folder, "prompt", e) from None
    _check_kept(messages, text, split, i, folder)
    return text


def _check_kept(messages: list[Any], text: str, split: Any, i: int, folder: str) -> None:
    """LaunchError for a message the rendered text leaves out (crf/replica/prompt_fit.py
    ``dropped_role``): the model would train without that turn, silently."""
    role = dropped_role(messages, text)
    if role is not None:
        raise LaunchError(
            f"{_row(split, i)}: --model {folder}'s chat template "
            f"leaves out the message of role {role!r} (its content is not in the rendered "
            "text); use the roles it renders (system, user, assistant)"
        )


def config_positions(folder: str) -> int | None:
    """The model's ``max_position_embeddings`` (its text config's, for a multimodal one)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None
