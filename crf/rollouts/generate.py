"""Generation with behaviour log-probs, exactly as the trainer's TRL would generate.

A rollout worker builds the same ``ComposerReplicationTrainer`` as the trainer it serves (it
never trains it) and generates through the trainer's own TRL methods: ``_tokenize_prompts``,
``_generate_single_turn`` and ``_get_per_token_logps_and_entropies``. The behaviour log-probs
are therefore computed by the very code, on the very padded tensors
(:func:`rollout_tensors`), that the trainer later uses for its proximal log-probs: on the same
weights, their ratio is 1 up to floating-point noise, and any larger mismatch means the
worker served other weights (the trainer refuses such a batch, crf/rollouts/correction.py).

The log-probs are recomputed by a forward pass rather than taken from the sampler, because
TRL's default ``model.generate`` path returns none, and a sampler's own numbers (vLLM's) may
differ from the trainer's by kernel and precision: the correction must compare like with like.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch
from trl.trainer.utils import pad

__all__ = [
    "RolloutTensors",
    "generate_rollouts",
    "per_token_logps",
    "rollout_tensors",
    "sampling_settings",
    "tokenizer_digest",
]


class RolloutTensors(dict):
    """``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask`` (and the loss
    ``mask``): a generation batch's tensors as TRL's ``_generate_and_score_completions`` pads
    and masks them."""


def rollout_tensors(
    trainer: Any, prompt_ids: list[list[int]], completion_ids: list[list[int]]
) -> RolloutTensors:
    """The padded tensors TRL builds from token-id lists (left-padded prompts, right-padded
    completions, ``pad_to_multiple_of``, and truncated completions zeroed when
    ``mask_truncated_completions`` is on), on the trainer's device."""
    device = trainer.accelerator.device
    pad_id = trainer._tokenizer.pad_token_id
    multiple = trainer.pad_to_multiple_of
    prompts = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
    completions = [torch.tensor(ids, dtype=torch.long) for ids in completion_ids]
    out = RolloutTensors(
        prompt_ids=pad(
            prompts, padding_value=pad_id, padding_side="left", pad_to_multiple_of=multiple
        ),
        prompt_mask=pad(
            [torch.ones_like(t) for t in prompts],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=multiple,
        ),
        completion_ids=pad(
            completions, padding_value=pad_id, padding_side="right", pad_to_multiple_of=multiple
        ),
        completion_mask=pad(
            [torch.ones_like(t) for t in completions],
            padding_value=0,
            padding_side="right",
            pad_to_multiple_of=multiple,
        ),
    )
    for key in list(out):
        out[key] = out[key].to(device)
    if trainer.mask_truncated_completions:
        ends = {*trainer.eos_token_ids, pad_id}
        truncated = torch.tensor(
            [bool(ids) and ids[-1] not in ends for ids in completion_ids], device=device
        )
        out["completion_mask"] = out["completion_mask"] * (~truncated).unsqueeze(1).int()
    out["mask"] = out["completion_mask"]
    return out


@contextlib.contextmanager
def _train_mode(model: Any) -> Iterator[None]:
    """Run the block with ``model`` in train mode (TRL generates and scores during training),
    then restore the mode it had."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def per_token_logps(trainer: Any, tensors: RolloutTensors) -> torch.Tensor:
    """Per-token log-probs (B, T) of ``tensors``' completions under the trainer's current
    model: TRL's ``_get_per_token_logps_and_entropies``, chunked by the per-device train batch
    size, exactly the call TRL makes for ``old_per_token_logps``."""
    from trl.models.utils import disable_gradient_checkpointing

    ids = torch.cat([tensors["prompt_ids"], tensors["completion_ids"]], dim=1)
    attention = torch.cat([tensors["prompt_mask"], tensors["completion_mask"]], dim=1)
    with disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            attention,
            tensors["completion_ids"].size(1),
            batch_size=trainer.args.per_device_train_batch_size,
        )
    return logps.float()


def generate_rollouts(
    trainer: Any, rows: list[dict]
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """rows: one generation batch, already repeated (num_generations consecutive copies of
    each prompt row). Returns (prompt_ids, completion_ids, behaviour logprobs per completion
    token) exactly as TRL would generate them for that batch in train mode.

    Text prompts and conversations (chat template applied by TRL) are supported; images,
    tools and environments are not (rollout workers serve the composer's text GRPO). A
    worker that loads new weights into ``trainer.model`` calls ``trainer.weights_replaced()``
    so that, with ``use_vllm``, TRL pushes them to vLLM before the next generation."""
    if not rows:
        raise ValueError("generate_rollouts needs at least one row")
    if trainer.tools or getattr(trainer, "environment_factories", None) is not None:
        raise ValueError(
            "rollout workers generate text completions only (no tools, no environments)"
        )
    prompts = [row["prompt"] for row in rows]
    with _train_mode(trainer.model):
        prompt_ids, images, multimodal = trainer._tokenize_prompts(prompts)
        if images is not None or multimodal:
            raise ValueError("rollout workers generate from text prompts only (no images)")
        prompt_ids = [list(map(int, ids)) for ids in prompt_ids]
        completion_ids, _ = trainer._generate_single_turn(
            prompt_ids, None, {}, trainer.num_generations
        )
        completion_ids = [list(map(int, ids)) for ids in completion_ids]
        logps = per_token_logps(trainer, rollout_tensors(trainer, prompt_ids, completion_ids))
    logprobs = [logps[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
    return prompt_ids, completion_ids, logprobs


def sampling_settings(trainer: Any) -> dict:
    """The settings that shape the behaviour distribution; a trainer uses a worker's batch
    only when they equal its own (other settings sample another distribution)."""
    return {
        "temperature": float(trainer.temperature),
        "top_p": float(trainer.top_p),
        "top_k": None if trainer.top_k is None else int(trainer.top_k),
        "min_p": None if trainer.min_p is None else float(trainer.min_p),
        "repetition_penalty": float(trainer.repetition_penalty),
        "max_new_tokens": int(trainer.max_completion_length),
        "num_generations": int(trainer.num_generations),
    }


def tokenizer_digest(tokenizer: Any) -> str:
    """A sha256 over what maps text to token ids: the fast tokenizer's full serialization (or
    the vocabulary of a slow one), the special tokens, the padding side and the chat template.
    A processor (multimodal) is digested through its tokenizer."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    backend = getattr(tok, "backend_tokenizer", None)
    parts: dict[str, Any] = {
        "backend": backend.to_str() if backend is not None else None,
        "vocab": None if backend is not None else sorted(tok.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
        "padding_side": getattr(tok, "padding_side", None),
        "chat_template": getattr(tok, "chat_template", None),
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
