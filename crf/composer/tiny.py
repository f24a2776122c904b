"""Tiny models and tokenizers built in code (no downloads), for the composer job and tests.

``char_tokenizer`` is a character-level ``PreTrainedTokenizerFast`` over a ``tokenizers``
WordLevel model: every character of ``alphabet`` is one token, plus ``<pad>``, ``<eos>`` and
``<unk>``. ``tiny_qwen2`` builds a small Qwen2 causal LM from a ``Qwen2Config``; the same seed
gives bit-identical weights in every process.
"""

from __future__ import annotations

import os
from typing import Any

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def characters(value: Any) -> set[str]:
    """Every character of the text in ``value`` (a row, a list of messages, nested), and of
    its numbers as they print: what a character tokenizer needs to read a user's rows (an
    answer of 24 is compared, and generated, as the text "24")."""
    if isinstance(value, str):
        return set(value)
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int | float):
        return set(str(value))
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return set().union(*(characters(v) for v in value))
    return set()


def char_tokenizer(alphabet: str) -> Any:
    """A character-level fast tokenizer: one token per character, decode concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    if not chars:
        raise ValueError("char_tokenizer needs a non-empty alphabet")
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    return fast


def tiny_qwen2(
    tokenizer: Any,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 128,
) -> Any:
    """A small Qwen2 causal LM for ``tokenizer``; identical weights for an identical seed."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    saved_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(cfg)
    finally:
        # Building the model must not change the caller's RNG stream (trainers seed their own).
        torch.random.set_rng_state(saved_state)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return model


def save_tiny(model: Any, tokenizer: Any, path: str | os.PathLike[str]) -> str:
    """Save model + tokenizer to a folder loadable with ``from_pretrained`` (needed for a
    GRPO reference model, which TRL reloads from ``config._name_or_path``)."""
    path = os.fspath(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.config._name_or_path = path
    return path
