"""The trainer's side of the rollout workers: take a worker's batch, check it, correct it.

``ComposerReplicationTrainer.use_rollout_source`` installs a :class:`RolloutIntake`. At each
generation (train mode only) the intake asks its :class:`RolloutSource` for a batch of the
generation's size. A batch it can use replaces the generation batch's rows *before* TRL's
``_generate_and_score_completions`` runs, so rewards, hints (distillation) and traces
(replay) are read from the rows the worker generated for; TRL's ``_generate_single_turn``
then returns the worker's completions instead of sampling, and everything downstream
(rewards, advantages, the reference model, the composer's channels) is TRL's own code. After
it, the decoupled-PPO correction (crf/rollouts/correction.py) sets the proximal log-probs as
TRL's ``old_per_token_logps`` and weighs the advantages per token.

A batch is refused (the source is told why, and the trainer generates the rows itself) when
it cannot be what the trainer would have sampled from the version it names: other rows than
the generation needs, another tokenizer or sampling settings, prompts that do not tokenize to
its prompt ids, a policy digest other than the one the trainer published for that version,
or a mismatch KL above ``max_mismatch``. Staleness is the source's to judge and record: it
knows the replica's global step (a resumed trainer's TRL step starts again at 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from trl.trainer.utils import pad

from crf.rollouts.config import (
    CORRECTION_MODES,
    UNCORRECTABLE_LOSSES,
    RolloutConfig,
    uncorrectable_loss,
)
from crf.rollouts.correction import Correction, correct, refusal
from crf.rollouts.generate import (
    RolloutTensors,
    per_token_logps,
    rollout_tensors,
    sampling_settings,
    tokenizer_digest,
)

__all__ = ["RolloutIntake", "RolloutSource", "Taken", "check_trainer"]

log = logging.getLogger(__name__)


class RolloutSource(Protocol):
    """Where a trainer's worker batches come from (the store's queue in a run; an in-memory
    list in tests). ``take`` returns the oldest batch within the staleness bound and its
    dataset rows (one dict per rollout), or None: the trainer then generates locally."""

    def take(self, step: int, rows: int) -> tuple[Any, list[dict]] | None: ...
    def used(self, batch: Any, stats: dict[str, float]) -> None: ...
    def refused(self, batch: Any, reason: str) -> None: ...
    def local(self, rows: int) -> None: ...
    def expected_digest(self, version: int) -> str | None: ...


@dataclass
class Taken:
    """A worker batch the trainer accepted: its rows, its tensors as TRL pads them, the
    proximal log-probs and the correction computed from them."""

    batch: Any
    rows: list[dict]
    tensors: RolloutTensors
    proximal: torch.Tensor
    correction: Correction


def check_trainer(trainer: Any, config: RolloutConfig) -> None:
    """Refuse, in one line, the trainer settings worker rollouts cannot serve."""
    if config.correction not in CORRECTION_MODES:
        raise ValueError(
            f"rollout correction {config.correction!r} is unknown: use one of "
            f"{', '.join(CORRECTION_MODES)}"
        )
    if config.correction != "off" and trainer.loss_type in UNCORRECTABLE_LOSSES:
        raise ValueError(uncorrectable_loss(trainer.loss_type))
    if trainer.tools or getattr(trainer, "environment_factories", None) is not None:
        raise ValueError("rollout workers generate text completions only: drop tools/environments")
    if trainer.accelerator.num_processes > 1:
        raise ValueError(
            "rollout workers serve one trainer process per replica: use --procs-per-replica 1"
        )
    if trainer.rollout_func is not None:
        raise ValueError("rollout workers replace TRL's rollout_func: use one or the other")


class RolloutIntake:
    """Takes, checks and corrects worker batches for one trainer (see module docstring)."""

    def __init__(self, trainer: Any, source: RolloutSource, config: RolloutConfig) -> None:
        check_trainer(trainer, config)
        self.trainer = trainer
        self.source = source
        self.config = config
        self._tokenizer_digest = tokenizer_digest(trainer.processing_class)
        self._sampling = sampling_settings(trainer)

    # ------------------------------------------------------------------ before TRL
    def take(self, inputs: list[dict]) -> Taken | None:
        """A checked, corrected worker batch for this generation, or None (generate locally;
        the source has been told)."""
        trainer = self.trainer
        n = len(inputs)
        step = int(trainer.state.global_step)
        got = self.source.take(step, n)
        if got is None:
            self._local(n)
            return None
        batch, rows = got
        reason = self._check(batch, rows, n)
        taken = None
        if reason is None:
            taken = self._correct(batch, rows)
            reason = refusal(taken.correction.stats, self.config.max_mismatch)
        if reason is not None:
            log.info("refused rollout batch %s-%s: %s", batch.worker, batch.seq, reason)
            self.source.refused(batch, reason)
            self._local(n, refused=True)
            return None
        return taken

    def _local(self, n: int, refused: bool = False) -> None:
        self.source.local(n)
        self._metric("rollouts/worker_share", 0.0)
        self._metric("rollouts/refused", float(refused))

    def _check(self, batch: Any, rows: list[dict], n: int) -> str | None:
        sizes = {
            len(rows),
            len(batch.row_ids),
            len(batch.prompt_ids),
            len(batch.completion_ids),
            len(batch.logprobs),
        }
        if sizes != {n}:
            return f"the batch holds {sorted(sizes)} rollouts where the generation needs {n}"
        for ids, lps in zip(batch.completion_ids, batch.logprobs, strict=True):
            if not ids:
                return "a completion has no tokens (TRL's generation yields at least one)"
            if len(ids) != len(lps):
                return "a completion's log-probs do not match its tokens"
        if batch.tokenizer_digest != self._tokenizer_digest:
            return "the worker's tokenizer differs from the trainer's"
        if dict(batch.sampling) != self._sampling:
            return f"sampling settings {batch.sampling} differ from the trainer's {self._sampling}"
        expected = self.source.expected_digest(batch.version)
        if expected is not None and expected != batch.policy_digest:
            return f"policy digest of version {batch.version} is not the one the trainer published"
        prompt_ids, _, _ = self.trainer._tokenize_prompts([r["prompt"] for r in rows])
        if [list(map(int, p)) for p in prompt_ids] != [list(p) for p in batch.prompt_ids]:
            return "the rows' prompts do not tokenize to the batch's prompt ids"
        return None

    def _correct(self, batch: Any, rows: list[dict]) -> Taken:
        trainer = self.trainer
        tensors = rollout_tensors(trainer, batch.prompt_ids, batch.completion_ids)
        proximal = per_token_logps(trainer, tensors)
        behaviour = pad(
            [torch.tensor(lp, dtype=torch.float32) for lp in batch.logprobs],
            padding_value=0.0,
            padding_side="right",
            pad_to_multiple_of=trainer.pad_to_multiple_of,
        ).to(proximal.device)
        cfg = self.config
        correction = correct(
            proximal,
            behaviour,
            tensors["mask"],
            mode=cfg.correction,
            clip_min=cfg.clip_min,
            clip_max=cfg.clip_max,
        )
        return Taken(batch, list(rows), tensors, proximal, correction)

    def completions(self, taken: Taken, prompt_ids: list[list[int]]) -> tuple[list, list]:
        """What TRL's ``_generate_single_turn`` returns for the taken batch: its completion
        ids and behaviour log-probs (TRL's ``sampling_per_token_logps``)."""
        if [list(map(int, p)) for p in prompt_ids] != [list(p) for p in taken.batch.prompt_ids]:
            raise RuntimeError("TRL tokenized the worker's rows to other prompt ids than checked")
        batch = taken.batch
        return [list(c) for c in batch.completion_ids], [list(lp) for lp in batch.logprobs]

    # ------------------------------------------------------------------ after TRL
    def apply(self, taken: Taken, output: dict[str, Any]) -> None:
        """Decoupled PPO on TRL's generation output: the clip anchored at the proximal
        log-probs, the advantages weighted per token by the correction."""
        t = taken.tensors
        for key in ("prompt_ids", "completion_ids", "completion_mask"):
            if not torch.equal(output[key], t[key]):
                raise RuntimeError(f"TRL padded the worker's batch differently ({key})")
        if self.config.correction != "off":
            output["old_per_token_logps"] = taken.proximal
            advantages = output["advantages"]
            output["advantages"] = advantages.unsqueeze(1) * taken.correction.weights.to(
                advantages.dtype
            )
            if taken.correction.sequence is not None:  # the replay channel's pairs
                output["rollout_sequence_weights"] = taken.correction.sequence.to(advantages.device)
            if "importance_sampling_ratio" in output:  # TRL's own vLLM correction: ours replaces it
                output["importance_sampling_ratio"] = torch.ones_like(
                    output["importance_sampling_ratio"]
                )
        stats = dict(taken.correction.stats)
        worker = f"rollouts/w{taken.batch.worker}"
        for key, value in stats.items():
            self._metric(f"{worker}/{key}", value)
        self._metric("rollouts/worker_share", 1.0)
        self._metric("rollouts/refused", 0.0)
        self.source.used(taken.batch, stats)

    def _metric(self, name: str, value: float) -> None:
        self.trainer._metrics["train"][name].append(value)
