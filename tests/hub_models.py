"""Tiny models in Hugging Face format for the loopback Hub (tests/emulators/hf_hub.py).

``TINY_REPO`` is a 2-layer Qwen2 over the string-reversal task's characters
(``crf.composer.tiny``), with a chat template: a user message's content followed by ``>``
(the generation prompt), so a test can see the template was applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_REPO = "crf-test/tiny-qwen2"
#: characters the chat template adds to a prompt
GENERATION_PROMPT = ">"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}" + GENERATION_PROMPT + "{% endif %}"
)


def save_tiny_repo(folder: str | Path, *, seed: int = 0, letters: str = "abcd") -> Any:
    """Save the tiny model + tokenizer (+ chat template) to ``folder``; returns the model."""
    from crf.composer import char_tokenizer, save_tiny, tiny_qwen2
    from crf.composer.task import task_alphabet

    tokenizer = char_tokenizer(task_alphabet(letters) + GENERATION_PROMPT)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_qwen2(tokenizer, seed=seed, hidden_size=32, num_layers=2, num_heads=2)
    save_tiny(model, tokenizer, folder)
    return model
