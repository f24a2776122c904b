"""Tiny composer trainers and an in-memory rollout source for the rollout-worker tests.

``MemorySource`` implements the trainer's ``RolloutSource`` protocol over a list (the store's
queue in a run) and records what the trainer told it; ``Batch`` carries the fields of a
worker's ``RolloutBatch``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback

from crf.composer import ComposerConfig, ComposerReplicationTrainer, char_tokenizer, tiny_qwen2
from crf.composer.task import HINT_TEMPLATE, make_examples, reverse_reward, task_alphabet
from crf.rollouts.generate import generate_rollouts, sampling_settings, tokenizer_digest

TOK = char_tokenizer(task_alphabet("abcd"))
ROWS = make_examples(64, 0)
#: one generation batch: 4 prompts x 4 generations, consecutive (as TRL's RepeatSampler)
GENERATIONS = 4
BATCH = 16


def repeated(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(r) for r in rows for _ in range(GENERATIONS)]


def make_trainer(
    steps: int = 1,
    *,
    model: Any = None,
    peft_config: Any = None,
    rows: list[dict[str, Any]] | None = None,
    rollout_func: Any = None,
    **kw: Any,
) -> ComposerReplicationTrainer:
    kw.setdefault("distill_hint_template", HINT_TEMPLATE)
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("per_device_train_batch_size", BATCH)
    kw.setdefault("bf16", False)
    args = ComposerConfig(
        output_dir=kw.pop("output_dir", "/tmp/crf-rollout-tests"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=steps,
        num_generations=GENERATIONS,
        max_completion_length=4,
        lr_scheduler_type="constant",
        seed=0,
        **kw,
    )
    trainer = ComposerReplicationTrainer(
        model=tiny_qwen2(TOK, seed=0) if model is None else model,
        reward_funcs=reverse_reward,
        args=args,
        train_dataset=Dataset.from_list(ROWS if rows is None else rows),
        processing_class=TOK,
        peft_config=peft_config,
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


@dataclass
class Batch:
    """The fields of a worker's rollout batch (crf/rollouts/batches.py's RolloutBatch)."""

    rank: int
    worker: int
    seq: int
    version: int
    row_ids: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    sampling: dict
    tokenizer_digest: str
    policy_digest: str
    created_at: float = field(default_factory=time.time)


def worker_batch(
    worker: ComposerReplicationTrainer,
    rows: list[dict[str, Any]],
    *,
    version: int = 0,
    worker_id: int = 0,
    seq: int = 0,
    policy_digest: str = "policy-0",
) -> Batch:
    """What a rollout worker holding ``worker``'s weights writes for ``rows`` (repeated)."""
    prompt_ids, completion_ids, logprobs = generate_rollouts(worker, rows)
    return Batch(
        rank=0,
        worker=worker_id,
        seq=seq,
        version=version,
        row_ids=list(range(len(rows))),
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        logprobs=logprobs,
        sampling=sampling_settings(worker),
        tokenizer_digest=tokenizer_digest(worker.processing_class),
        policy_digest=policy_digest,
    )


def replaying(batch: Batch, rows: list[dict[str, Any]]) -> Any:
    """A TRL ``rollout_func`` that answers each prompt with the batch's completions of it,
    in order: TRL's own on-policy path, fed the worker's completions."""

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list]:
        queues: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            queues.setdefault(str(row["prompt"]), []).append(i)
        picked = [queues[str(p)].pop(0) for p in prompts]
        return {
            "prompt_ids": [batch.prompt_ids[i] for i in picked],
            "completion_ids": [batch.completion_ids[i] for i in picked],
            "logprobs": [batch.logprobs[i] for i in picked],
        }

    return rollout_func


class MemorySource:
    """A trainer's rollout source over a list of (batch, rows); records every call."""

    def __init__(self, items: list[tuple[Any, list[dict]]], digests: dict[int, str] | None = None):
        self.items = list(items)
        self.digests = digests or {}
        self.taken: list[tuple[int, int]] = []
        self.used_stats: list[dict[str, float]] = []
        self.refusals: list[str] = []
        self.local_rows: list[int] = []

    def take(self, step: int, rows: int) -> tuple[Any, list[dict]] | None:
        self.taken.append((step, rows))
        return self.items.pop(0) if self.items else None

    def used(self, batch: Any, stats: dict[str, float]) -> None:
        self.used_stats.append(dict(stats))

    def refused(self, batch: Any, reason: str) -> None:
        self.refusals.append(reason)

    def local(self, rows: int) -> None:
        self.local_rows.append(rows)

    def expected_digest(self, version: int) -> str | None:
        return self.digests.get(version)


class Grads(TrainerCallback):
    """The gradients of the last optimizer step (before the optimizer uses them)."""

    grads: dict[str, torch.Tensor]

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }


class Snapshots(TrainerCallback):
    """The model's weights after every optimizer step."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def logged(trainer: ComposerReplicationTrainer, key: str) -> list[float]:
    """Every logged value of ``key`` in the trainer's history."""
    return [h[key] for h in trainer.state.log_history if key in h]
