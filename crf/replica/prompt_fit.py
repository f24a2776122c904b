"""A replica's prompts through its model's chat template and within its positions, at setup.

The launcher renders a local ``--model``'s prompts before launch (crf/launcher/
prompt_checks.py). A Hub model's tokenizer, and the rows of a Hub or URL dataset past its
first, are first seen here; and a prompt the template refuses (or one longer than the
model's positions) would fail inside a training step, where the first failure is taken for
a death and restarted. So the replica renders the same choice of its rows
(:func:`chosen_rows`) while it builds: a DataError there is a setup error, which ends the
run at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crf.replica.data_files import DataError

#: the longest prompts (by characters) whose tokens are counted
LONGEST = 16
#: roles chat templates render; a message of another role must show in the rendered text
KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def chosen_rows(prompts: Sequence[Any], first: int, longest: int = LONGEST) -> list[int]:
    """The rows worth rendering, in order: the first ``first``, the first of each distinct
    sequence of roles (what a template's role checks see) and the ``longest`` longest by
    characters (what a length check needs). Rendering every row of a large file would take
    long."""
    chosen = set(range(min(first, len(prompts))))
    seen: set[tuple[str, ...]] = set()
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            roles = tuple(str(m.get("role")) for m in prompt if isinstance(m, dict))
            if roles not in seen:
                seen.add(roles)
                chosen.add(i)
    if longest:
        by_length = sorted(range(len(prompts)), key=lambda i: -len(str(prompts[i] or "")))
        chosen.update(by_length[:longest])
    return sorted(chosen)


def dropped_role(messages: list[Any], text: str) -> str | None:
    """The role of a message the rendered ``text`` leaves out (None: none is): a role
    outside :data:`KNOWN_ROLES` whose content is not in the text. Templates that branch on
    the role (Qwen's) render no turn for one they do not know (ShareGPT's ``human``)."""
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role in KNOWN_ROLES or not isinstance(content, str) or not content.strip():
            continue
        if content.strip() not in text:
            return str(role)
    return None


def too_long(tokens: int, model_name: str, limit: int) -> str:
    """What to say of a prompt of ``tokens`` tokens that ``model_name``'s ``limit``
    positions do not hold (after where it is)."""
    return (
        f"is {tokens} tokens, more than --model {model_name} takes ({limit} positions, "
        "max_position_embeddings); shorten or drop such rows"
    )


def tokens_over(tokenizer: Any, text: str, limit: int | None) -> int | None:
    """``text``'s token count when it is more than ``limit`` positions (None: it fits, or
    there is no limit)."""
    if limit is None:
        return None
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return tokens if tokens > limit else None


def check_setup_prompts(
    tokenizer: Any, model: Any, prompts: list[Any], model_name: str, new_tokens: int = 0
) -> None:
    """DataError for a conversational prompt ``model_name``'s chat template refuses or
    renders without one of its turns, or (``model`` given) a prompt of more tokens than its
    ``max_position_embeddings``, or one that leaves fewer than ``new_tokens`` (the
    completions' ``max_completion_length``) of a learned position table
    (:func:`learned_positions`). ``prompts``: the replica's, as the trainer gets them (a
    conversation, or text when the tokenizer has no template)."""
    limit = _positions(model) if model is not None else None
    learned = learned_positions(model) if model is not None and new_tokens else None
    longest = 0
    for i in chosen_rows(prompts, first=8, longest=LONGEST if limit or learned else 0):
        prompt = prompts[i]
        text = prompt if isinstance(prompt, str) else _render(tokenizer, prompt, model_name)
        tokens = tokens_over(tokenizer, text, limit)
        if tokens is not None:
            raise DataError(f"a prompt ({_shown(prompt)}) {too_long(tokens, model_name, limit)}")
        if learned:
            longest = max(longest, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    if learned and longest + new_tokens > learned:
        raise DataError(past_learned(learned, model_name, longest, new_tokens,
                                     "max_completion_length"))  # fmt: skip


def longest_answer_prompt(tokenizer: Any, prompts: Sequence[Any]) -> tuple[int, int] | None:
    """(tokens, row) of the longest held-out prompt among the :func:`chosen_rows`, rendered as
    held-out evaluation renders it (crf/replica/evaluation.py ``as_text``: a text as it is,
    with the tokenizer's special tokens; a conversation through the chat template, with the
    generation prompt). None: no prompt (a row of plain text has none), or a template that
    refuses one (the conversation checks say so)."""
    from crf.replica.evaluation import as_text

    best: tuple[int, int] | None = None
    for i in chosen_rows(prompts, first=0):
        prompt = prompts[i]
        if not isinstance(prompt, str | list):
            continue
        try:
            text = as_text(tokenizer, prompt)
        except Exception:  # noqa: BLE001 - jinja's errors: checked with the conversations
            continue
        tokens = len(tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"])
        if best is None or tokens > best[0]:  # the first of the longest
            best = (tokens, i)
    return best


def check_answer_room(
    tokenizer: Any, model: Any, prompts: Sequence[Any], model_name: str, new_tokens: int
) -> None:
    """DataError when the sft job's held-out answers (greedy, of up to ``new_tokens``: its
    ``max_new_tokens``) after the longest held-out prompt need more positions than
    ``model``'s learned table: the evaluation before the first step would fail, on every
    replica."""
    learned = learned_positions(model)
    longest = longest_answer_prompt(tokenizer, prompts) if learned else None
    if learned and longest and longest[0] + new_tokens > learned:
        raise DataError(
            "held-out pass@1: "
            + past_learned(learned, model_name, longest[0], new_tokens, "max_new_tokens")
        )


def _render(tokenizer: Any, messages: list[Any], model_name: str) -> str:
    try:
        text = str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    except Exception as e:  # noqa: BLE001 - jinja's errors, the template's raise_exception
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"--model {model_name}'s chat template refuses a prompt ({_shown(messages)}): "
            f"{type(e).__name__}: {reason}; fix the rows' messages or the template"
        ) from None
    role = dropped_role(messages, text)
    if role is not None:
        raise DataError(
            f"--model {model_name}'s chat template leaves out the message of role {role!r} "
            f"of a prompt ({_shown(messages)}); use the roles it renders (system, user, "
            "assistant)"
        )
    return text


def _shown(prompt: Any) -> str:
    """A prompt's beginning, for a message that cannot name its row (a shard is shuffled)."""
    text = prompt if isinstance(prompt, str) else " | ".join(
        f"{m.get('role')}: {m.get('content')}" for m in prompt if isinstance(m, dict)
    )  # fmt: skip
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


#: the names transformers gives a table of learned absolute positions (GPT-2's ``wpe``,
#: OPT's and BART's ``embed_positions``, BERT-style ``position_embeddings``)
POSITION_TABLES = frozenset({"wpe", "embed_positions", "position_embeddings", "pos_emb"})


def learned_positions(model: Any) -> int | None:
    """The positions ``model`` takes when it looks them up in a learned table: a sequence
    past them fails (an index error on the CPU, a device-side assert on CUDA), where a
    rotary model generates on past its ``max_position_embeddings``, if worse. None: no such
    table (rotary, ALiBi, or a model built otherwise)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES:
            configured = _positions(model)  # OPT's table keeps 2 rows more than it uses
            rows = int(module.num_embeddings)
            return min(rows, configured) if configured else rows
    return None


def max_length_past(limit: int, model_name: str, length: int) -> str:
    """What to say when the sft job's ``max_length`` is longer than ``model_name``'s
    ``limit`` learned positions."""
    return (
        f"--model {model_name} has {limit} positions (a learned table: a longer sequence "
        f"fails, it does not run on) but the sft job's max_length is {length}: --set "
        f"max_length={limit} (or less)"
    )


def check_length_room(model: Any, model_name: str, length: int) -> None:
    """DataError when the sft job's ``max_length`` is longer than ``model``'s learned
    position table (a Hub model, first read at a replica's setup): a sequence that long
    would fail in a training step, on every replica, where the failure reads as a death and
    is restarted."""
    learned = learned_positions(model)
    if learned is not None and length > learned:
        raise DataError(max_length_past(learned, model_name, length))


def past_learned(limit: int, model_name: str, longest: int, new: int, new_name: str) -> str:
    """What to say when a prompt of ``longest`` tokens and ``new`` tokens more (the setting
    ``new_name``) do not fit ``model_name``'s ``limit`` learned positions."""
    room = limit - longest
    fix = f"--set {new_name}={room}" if room > 0 else "shorten such prompts"
    return (
        f"a prompt of {longest} tokens and {new_name} {new} need {longest + new} positions, "
        f"more than --model {model_name} has ({limit}, a learned table: a longer sequence "
        f"fails, it does not run on); lower it ({fix}) or shorten the longest prompts"
    )


def _positions(model: Any) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None
