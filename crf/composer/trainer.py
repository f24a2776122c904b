"""``ComposerReplicationTrainer``: TRL's ``GRPOTrainer`` with two extra loss channels.

``loss = grpo + distill_alpha · distill + replay_beta · replay`` (see docs/composer.md).

It only uses TRL's extension points:

- ``_generate_and_score_completions`` (after TRL's own): attaches the channels' inputs to the
  generation batch as tensors with leading dim = batch (TRL does not forward dataset columns
  to the loss): the teacher prompts (prompt + hint) for channel 2, the tokenized correct
  traces and — for DPO — the frozen reference's sequence log-probs for channel 3.
- ``_compute_loss``: runs TRL's GRPO term while a forward hook on the backbone captures the
  last hidden state, turns the completion positions into logits with the model's own output
  embedding (no second forward pass of the policy), computes the channels and adds them with
  ``compose_loss``. A channel with weight 0 or without inputs in the batch is skipped
  entirely, so the update is then bit-identical to a stock ``GRPOTrainer``.

Nothing here draws from the global RNG after ``super().__init__()``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from torch import nn
from trl import GRPOTrainer
from trl.trainer.utils import pad, use_adapter

from crf.composer.config import ComposerConfig
from crf.composer.generation import (
    CompileFailed,
    compile_decoding,
    compile_failed,
    decoding_compiled,
    generation_attention,
    master_weights_kept,
    no_compiler_note,
    no_input_grads_hook,
    one_input_grads_hook,
    plain_decoding,
    root_error,
    static_cache_kept,
    static_cache_length,
)
from crf.composer.losses import (
    TAIDSchedule,
    compose_loss,
    distill_per_token,
    dpo_loss,
    masked_row_mean,
    sequence_logps,
    simpo_loss,
)
from crf.composer.resume import ResumedSampler, indices_per_step, mid_epoch
from crf.rollouts.config import RolloutConfig
from crf.rollouts.intake import RolloutIntake, RolloutSource, Taken

__all__ = ["ComposerReplicationTrainer", "capture_hidden", "loss_mask"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capture_hidden(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect ``module``'s output hidden state (``last_hidden_state`` or ``output[0]``) for
    every forward call made inside the block."""
    store: list[torch.Tensor] = []

    def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
        h = getattr(output, "last_hidden_state", None)
        store.append(h if h is not None else output[0])

    handle = module.register_forward_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The completion tokens every loss term is over: the completion mask times TRL's tool mask
    (0 on tool-result / environment tokens), exactly as TRL's own ``_compute_loss`` masks.

    Every sum or mean over completion tokens — the policy's and the frozen reference's alike —
    must use this one mask, or DPO compares log-probs over different token sets."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


@dataclass
class _Channel:
    """One loss channel (distillation or replay) on one micro-batch: its loss (None without
    rows), its weight in the step (its rows' share of the window's rows), and its row count."""

    rows: int = 0
    loss: torch.Tensor | None = None
    scale: float = 1.0
    taid_t: float | None = None  # the TAID t the distillation loss used


def _logit_scale(text_config: Any) -> float:
    """The multiplier TRL's fused LM head applies to the logits (see
    ``trl.trainer.utils.add_fused_lm_head``)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        ls = text_config.logits_scaling
        scale = ls if text_config.model_type == "hyperclovax" else 1 / ls
    return 1.0 if scale is None else float(scale)


class ComposerReplicationTrainer(GRPOTrainer):
    """GRPO + hint-conditioned self-distillation + trace replay (see module docstring).

    Takes the same arguments as ``trl.GRPOTrainer``; ``args`` must be a ``ComposerConfig``.
    Dataset columns used (names configurable): ``hint`` or ``teacher_prompt`` for channel 2,
    ``trace`` for channel 3. Rows without them simply don't take part in that channel.
    """

    def __init__(self, model: Any, reward_funcs: Any, args: ComposerConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ComposerConfig(output_dir=f"{str(name).split('/')[-1] or 'model'}-Composer")
        if not isinstance(args, ComposerConfig):
            raise TypeError(
                f"ComposerReplicationTrainer needs args=ComposerConfig(...) (a GRPOConfig subclass "
                f"with the composer's knobs), got {type(args).__name__}"
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # ---- nothing below may consume the global RNG (bit-exactness with GRPOTrainer) ----
        self._distill_on = args.distill_alpha > 0
        self._replay_on = args.replay_beta > 0
        self._last_local_rewards: torch.Tensor | None = None
        self._taid_manual_t: float | None = None
        self._taid_schedule: TAIDSchedule | None = None
        if args.distill_wrapper == "taid" and args.taid_schedule is not None:
            self._taid_schedule = TAIDSchedule(
                mode=args.taid_schedule,
                t_start=args.taid_t_start,
                t_end=args.taid_t_end,
                momentum=args.taid_momentum,
                step_size=args.taid_step_size,
            )
        # Per optimizer step: channel -> [sum of micro-batch mean x its rows, rows] (see
        # _flush_channel_window).
        self._channel_window: dict[str, list[float]] = {}
        self._replay_ref: nn.Module | None = None
        if self._replay_on and args.replay_loss == "dpo":
            self._replay_ref = self._build_replay_reference()
        self._intake: RolloutIntake | None = None
        self._worker_rollout: Taken | None = None
        one_input_grads_hook(self.model)
        #: the static caches compiled generations reuse, per batch size: (cache, length)
        #: (crf/composer/generation.py)
        self._static_cache: dict[int, Any] = {}
        #: whether generations decode with a compiled static cache (``generation_compile``,
        #: resolved for this device and model when unset)
        self._compile_decoding = decoding_compiled(args, self.model)
        #: the generation config's settings before compile_decoding (plain_decoding's)
        self._plain_decoding: tuple[Any, Any] | None = None
        if self._compile_decoding:
            self._plain_decoding = compile_decoding(self.generation_config)
        elif note := no_compiler_note(args, self.model):
            log.warning(note)
        #: optimizer steps already trained (a resumed replica): the data goes on after them
        self._resume_steps = 0
        self._mid_epoch = False

    # ------------------------------------------------------------------ resuming
    def resume_data_at(self, steps: int) -> bool:
        """Train on from optimizer step ``steps`` of the data (a restarted or resumed
        replica): the prompts the uninterrupted trainer would draw next, in its epochs
        (crf/composer/resume.py). Returns whether that falls inside an epoch: then the
        random-number generators are restored again before the first step (the first
        epoch's data loader drew from them; ``DiLoCoCallback.restore_rng_at_step``)."""
        self._resume_steps = int(steps)
        self._mid_epoch = mid_epoch(super()._get_train_sampler(), self._skipped())
        return self._mid_epoch

    def _skipped(self) -> int:
        return self._resume_steps * indices_per_step(self)

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        sampler = super()._get_train_sampler(dataset)
        return ResumedSampler(sampler, self._skipped()) if self._resume_steps else sampler

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        """transformers' epoch count, plus one when the data resumes inside an epoch (its
        rest is the first, partial epoch; ``max_steps`` still ends training)."""
        values = super().set_initial_training_values(args, dataloader)
        if self._mid_epoch:
            return (values[0] + 1, *values[1:])
        return values

    # ------------------------------------------------------------------ public helpers
    @property
    def compiled_decoding(self) -> bool:
        """Whether generations decode with a compiled static KV cache: ``generation_compile``
        as set, or resolved for this device and model when unset (crf/composer/generation.py,
        ``decoding_compiled``)."""
        return self._compile_decoding

    @property
    def taid_t(self) -> float | None:
        """The TAID interpolation value the next step uses (None if TAID has no t yet)."""
        if self._taid_manual_t is not None:
            return self._taid_manual_t
        if self.args.taid_t is not None:
            return float(self.args.taid_t)
        if self._taid_schedule is not None:
            return self._taid_schedule.t
        return None

    def set_taid_t(self, t: float) -> None:
        """Set TAID's t by hand (overrides taid_t and the schedule), e.g. from a callback."""
        if self.args.distill_wrapper != "taid":
            raise ValueError("set_taid_t needs distill_wrapper='taid'")
        if not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"TAID t must be in [0, 1] (got {t})")
        self._taid_manual_t = float(t)

    def use_rollout_source(
        self, source: RolloutSource, config: RolloutConfig | None = None
    ) -> None:
        """Train on rollout workers' batches from ``source`` when it has one in time, else
        generate locally; ``config`` gives the off-policy correction (decoupled PPO, see
        crf/rollouts/correction.py) and the mismatch bound. Settings the correction cannot
        serve (e.g. ``loss_type='vespo'``) raise ValueError here, before training. A trainer
        that never calls this trains exactly as without workers."""
        self._intake = RolloutIntake(self, source, config or RolloutConfig())

    # ------------------------------------------------------------------ model plumbing
    def _hf_model(self, model: nn.Module | None = None) -> nn.Module:
        m = self.accelerator.unwrap_model(self.model if model is None else model)
        if is_peft_model(m):
            m = m.get_base_model()
        return m

    def _build_replay_reference(self) -> nn.Module | None:
        """The frozen DPO reference: TRL's reference model when GRPO has one (beta > 0), the
        PEFT base (adapters disabled) for a PEFT policy, else a frozen copy of the initial
        policy (``deepcopy`` draws no random numbers)."""
        if self.ref_model is not None:
            return None  # use self.ref_model
        unwrapped = self.accelerator.unwrap_model(self.model)
        if is_peft_model(unwrapped):
            return None  # adapters disabled at use
        ref = copy.deepcopy(unwrapped)
        # TRL patched `forward` on the instance with a closure bound to the *policy*; the copy
        # must use its own class forward.
        if "forward" in ref.__dict__:
            del ref.forward
        ref.requires_grad_(False)
        ref.eval()
        return ref

    @contextlib.contextmanager
    def _reference(self) -> Iterator[tuple[nn.Module, nn.Module]]:
        """Yield (module to call, HF model whose backbone/head to use) for the reference."""
        if self._replay_ref is not None:
            yield self._replay_ref, self._replay_ref
        elif self.ref_model is not None:
            yield self.ref_model, self._hf_model(self.ref_model)
        else:
            model = self.accelerator.unwrap_model(self.model)
            with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                yield self.model, self._hf_model(self.model)

    def _logits_from_hidden(self, hf: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``hidden`` through the model's output embedding, with the same
        logit scale / soft-capping as TRL's fused head (not divided by any temperature)."""
        head = hf.get_output_embeddings()
        text_config = hf.config.get_text_config()
        with torch.autocast(hidden.device.type, enabled=False):
            if type(head) is nn.Linear:
                bias = None if head.bias is None else head.bias.float()
                logits = F.linear(hidden.float(), head.weight.float(), bias)
            else:
                logits = head(hidden).float()
        scale = _logit_scale(text_config)
        if scale != 1.0:
            logits = logits * scale
        softcap = getattr(text_config, "final_logit_softcapping", None)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits

    def _completion_logits(
        self,
        model: nn.Module,
        hf: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        n_last: int,
    ) -> torch.Tensor:
        """Logits predicting the last ``n_last`` tokens of ``input_ids`` (one forward)."""
        with capture_hidden(hf.base_model) as store, self.accelerator.autocast():
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                logits_to_keep=1,
            )
        hidden = store[0] if len(store) == 1 else torch.cat(store, 0)
        return self._logits_from_hidden(hf, hidden[:, -n_last - 1 : -1])

    # ------------------------------------------------------------------ generation side
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        if self._replay_on:
            n = len(prompts)
            start = self.accelerator.process_index * n
            local = rewards_per_func[start : start + n]
            weights = self.reward_weights.to(local.device).unsqueeze(0)
            self._last_local_rewards = (local * weights).nansum(dim=1)
        return rewards_per_func

    def weights_replaced(self) -> None:
        """The weights changed outside this trainer's optimizer (a DiLoCo outer step, a
        heal): with ``use_vllm``, TRL's vLLM copy is stale, so the next generation pushes the
        weights first (TRL pushes when ``_last_loaded_step`` differs from the global step)."""
        if getattr(self, "use_vllm", False):
            self._last_loaded_step = -1

    def _generate_single_turn(self, prompt_ids, images, multimodal, num_generations, *a, **kw):
        """TRL's generation under the trainer's autocast (a rollout worker's too), on CUDA
        without cuDNN's attention; on its continuous-batching path, without the in-place
        cast of the model to bf16/fp16; with ``generation_compile``, into a static cache
        sized in buckets and without the input-embeddings hook (all:
        crf/composer/generation.py). For a worker's batch taken by the rollout intake: the
        worker's completions and behaviour log-probs, no sampling. A compilation that fails
        where ``generation_compile`` is unset turns it off, and the generation is made again
        with plain ``generate``."""
        if self._worker_rollout is not None:
            taken, self._worker_rollout = self._worker_rollout, None
            return self._intake.completions(taken, prompt_ids)
        guard = (
            master_weights_kept(self.model, self.args)
            if self.use_transformers_continuous_batching
            else contextlib.nullcontext()
        )
        attention = generation_attention(self.model, self.args.generation_cudnn_attention)
        compiled = (
            self._compiled_decoding(prompt_ids)
            if self._compile_decoding
            else self._unprepared_autocast()
        )
        try:
            with guard, attention, compiled:
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal, num_generations, *a, **kw
                )
        except Exception as e:
            if not self._compile_decoding or not compile_failed(e):
                raise
            if self.args.generation_compile is not None:  # asked for: said in one line
                raise CompileFailed(
                    f"generation_compile=true, and compiling the decoding step failed "
                    f"({root_error(e)}): install a C compiler (gcc) in the image, or leave "
                    "generation_compile unset (then such a failure falls back to plain "
                    "generate)"
                ) from e
            self._stop_compiling(e)
        return self._generate_single_turn(prompt_ids, images, multimodal, num_generations,
                                          *a, **kw)  # fmt: skip

    def _stop_compiling(self, error: BaseException) -> None:
        """Turn compiled decoding off for the rest of the run (it was on by default, and
        compiling failed here): the generation config as TRL made it, the kept static
        caches freed, and one warning naming what failed in the compiler."""
        self._compile_decoding = False
        if self._plain_decoding is not None:
            plain_decoding(self.generation_config, self._plain_decoding)
        self._static_cache.clear()
        log.warning(
            "generation_compile: compiling the decoding step failed (%s), so this replica "
            "generates with plain generate from now on; set generation_compile=false to skip "
            "the attempt",
            root_error(error),
        )

    def _unprepared_autocast(self) -> contextlib.AbstractContextManager:
        """The trainer's autocast where the model's forward does not carry it: accelerate
        wraps a prepared model's forward in it (the training replica's), a rollout worker's
        model is never prepared and would generate in fp32, unlike the trainer it samples
        for. (The compiled path enters it itself.)"""
        if hasattr(self.model, "_original_forward"):  # accelerate's wrapper is on
            return contextlib.nullcontext()
        return self.accelerator.autocast()

    def _compiled_decoding(self, prompt_ids: list[list[int]]) -> contextlib.ExitStack:
        """What a ``generation_compile`` generation of ``prompt_ids`` runs inside: the
        trainer's autocast (also where the model is not wrapped in it, as in a rollout
        worker's generation), a kept static cache of the bucket the padded prompts and the
        completion fit, holding keys and values in the autocast dtype, and no
        input-embeddings hook (crf/composer/generation.py)."""
        multiple = self.pad_to_multiple_of or 1
        longest = -(-max((len(p) for p in prompt_ids), default=0) // multiple) * multiple
        length = static_cache_length(longest, self.max_completion_length)
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        stack = contextlib.ExitStack()
        stack.enter_context(self.accelerator.autocast())
        stack.enter_context(static_cache_kept(self.model, length, self._static_cache, dtype))
        stack.enter_context(no_input_grads_hook(self.model))
        return stack

    def _generate_and_score_completions(self, inputs):
        taken = None
        if self._intake is not None and self.model.training:
            taken = self._intake.take(inputs)
        if taken is None:
            output = super()._generate_and_score_completions(inputs)
        else:
            # The worker's rows replace the generation batch's before TRL scores them, so
            # rewards, hints and traces are those of the prompts the worker completed.
            inputs = taken.rows
            self._worker_rollout = taken
            try:
                output = super()._generate_and_score_completions(inputs)
            finally:
                self._worker_rollout = None
            self._intake.apply(taken, output)
        rewards, self._last_local_rewards = self._last_local_rewards, None
        if self._distill_on:
            self._attach_distill_inputs(inputs, output)
        if self._replay_on:
            self._attach_replay_inputs(inputs, output, rewards)
        return output

    def _teacher_prompt(self, example: dict[str, Any]) -> Any:
        args = self.args
        full = example.get(args.distill_teacher_prompt_column)
        if full is not None and len(full) > 0:
            return full
        hint = example.get(args.distill_hint_column)
        if hint is None or (isinstance(hint, str) and hint == ""):
            return None
        prompt = example.get("prompt")
        if isinstance(prompt, str):
            return args.distill_hint_template.format(hint=hint, prompt=prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1].get("content"), str):
            last = dict(prompt[-1])
            last["content"] = args.distill_hint_template.format(hint=hint, prompt=last["content"])
            return [*prompt[:-1], last]
        raise ValueError(
            f"cannot attach a hint to prompt {prompt!r}: use a string prompt, a conversation "
            f"whose last message has string content, or a '{args.distill_teacher_prompt_column}' "
            "column with the teacher's full prompt"
        )

    def _attach_distill_inputs(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> None:
        teacher_prompts = [self._teacher_prompt(x) for x in inputs]
        # A rollout with no loss token (e.g. truncated under mask_truncated_completions) has
        # nothing to distil: it takes no part, rather than counting as a row of value 0.
        has_tokens = (loss_mask(output).sum(1) > 0).tolist()
        rows = [p is not None and h for p, h in zip(teacher_prompts, has_tokens, strict=True)]
        num_rows = self._rows_per_process(sum(rows))  # every process, rows or none
        if not any(rows):
            return
        filled = [
            p if p is not None else x["prompt"]
            for p, x in zip(teacher_prompts, inputs, strict=True)
        ]
        ids_list, _, _ = self._tokenize_prompts(filled)
        device = self.accelerator.device
        ids = [torch.tensor(i) for i in ids_list]
        output["distill_prompt_ids"] = pad(
            ids, padding_value=self._tokenizer.pad_token_id, padding_side="left"
        ).to(device)
        output["distill_prompt_mask"] = pad(
            [torch.ones_like(i) for i in ids], padding_value=0, padding_side="left"
        ).to(device)
        output["distill_rows"] = torch.tensor(rows, dtype=torch.bool, device=device)
        output["distill_num_rows"] = torch.tensor(num_rows, device=device)

    def _trace_eos_id(self) -> int:
        eos = getattr(self._hf_model().generation_config, "eos_token_id", None)
        if isinstance(eos, list | tuple):
            eos = eos[0] if eos else None
        return self._tokenizer.eos_token_id if eos is None else int(eos)

    def _attach_replay_inputs(
        self, inputs: list[dict[str, Any]], output: dict[str, Any], rewards: torch.Tensor | None
    ) -> None:
        args = self.args
        traces = [x.get(args.replay_trace_column) for x in inputs]
        # A rollout with no loss token (e.g. truncated under mask_truncated_completions) is no
        # "rejected" answer: as a pair it would have log-prob 0 and only pull the trace up.
        has_tokens = (loss_mask(output).sum(1) > 0).tolist()
        rows = [
            isinstance(t, str) and t != "" and h for t, h in zip(traces, has_tokens, strict=True)
        ]
        if args.replay_reward_threshold is not None and rewards is not None:
            rows = [
                r and not bool(rw >= args.replay_reward_threshold)
                for r, rw in zip(rows, rewards.tolist(), strict=True)
            ]
        chosen = self._replay_chosen(traces, rows, output) if any(rows) else []
        num_rows = self._rows_per_process(sum(rows))  # every process, rows or none
        if not any(rows):
            return
        device = self.accelerator.device
        chosen_t = [torch.tensor(c) for c in chosen]
        chosen_ids = pad(chosen_t, padding_value=self._tokenizer.pad_token_id, padding_side="right")
        chosen_mask = pad(
            [torch.ones_like(c) for c in chosen_t], padding_value=0, padding_side="right"
        )
        output["replay_chosen_ids"] = chosen_ids.to(device)
        output["replay_chosen_mask"] = chosen_mask.to(device)
        output["replay_rows"] = torch.tensor(rows, dtype=torch.bool, device=device)
        output["replay_num_rows"] = torch.tensor(num_rows, device=device)
        if args.replay_loss == "dpo":
            ref_c, ref_r = self._reference_logps(output)
            output["replay_ref_chosen_logps"] = ref_c
            output["replay_ref_rejected_logps"] = ref_r

    def _replay_chosen(
        self, traces: list[Any], rows: list[bool], output: dict[str, Any]
    ) -> list[list[int]]:
        """The token ids of each row's trace (+ EOS); a rollout token-identical to its trace
        makes a degenerate pair (zero gradient for DPO and SimPO alike): its row is set
        False in ``rows`` rather than dilute the channel's mean."""
        eos = self._trace_eos_id()
        encoded = self._tokenizer(
            text=[t if r else "" for t, r in zip(traces, rows, strict=True)],
            add_special_tokens=False,
        )["input_ids"]
        chosen = [list(ids) + [eos] for ids in encoded]
        comp_ids, comp_mask = output["completion_ids"], output["completion_mask"]
        for i, r in enumerate(rows):
            if r and comp_ids[i][comp_mask[i].bool()].tolist() == chosen[i]:
                rows[i] = False
        return chosen

    def _rows_per_process(self, rows: int) -> float:
        """A channel's rows in the generation batch, per process: each process's loss is
        its rows' sum over this share, so DDP's mean of the processes' gradients is the
        channel's mean over all the batch's rows, as on one process (where it is ``rows``)."""
        n = self.accelerator.num_processes
        if n == 1:
            return float(rows)
        count = torch.tensor([float(rows)], device=self.accelerator.device)
        return float(self.accelerator.gather(count).sum()) / n

    @torch.no_grad()
    def _reference_logps(self, output: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen reference's summed log-probs (temperature 1) of chosen traces and rollouts.

        A rollout attends to all its tokens (completion mask) but is summed over the loss mask
        (tool-result tokens excluded), exactly like the policy's side in ``_compute_loss``."""
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        chosen_mask = output["replay_chosen_mask"]
        seqs = {
            "chosen": (output["replay_chosen_ids"], chosen_mask, chosen_mask),
            "rejected": (output["completion_ids"], output["completion_mask"], loss_mask(output)),
        }
        bs = max(1, self.args.per_device_train_batch_size)
        out: dict[str, torch.Tensor] = {}
        with self._reference() as (ref, ref_hf):
            for key, (ids, mask, summed) in seqs.items():
                parts = []
                for s in range(0, ids.size(0), bs):
                    sl = slice(s, s + bs)
                    logits = self._completion_logits(
                        ref,
                        ref_hf,
                        torch.cat([prompt_ids[sl], ids[sl]], 1),
                        torch.cat([prompt_mask[sl], mask[sl]], 1),
                        ids.size(1),
                    )
                    parts.append(sequence_logps(logits, ids[sl], summed[sl]))
                out[key] = torch.cat(parts)
        return out["chosen"], out["rejected"]

    # ------------------------------------------------------------------ loss side
    def _compute_loss(self, model, inputs):
        """TRL's GRPO loss, composed with the distillation and replay channels when this
        micro-batch carries rows for them (each channel scaled to its share of the step's
        rows, see :func:`compose_loss`)."""
        args = self.args
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1
        use_distill = self._distill_on and "distill_prompt_ids" in inputs
        use_replay = self._replay_on and "replay_chosen_ids" in inputs
        if not (use_distill or use_replay):
            loss = super()._compute_loss(model, inputs)  # exactly TRL's path
            self._metrics[mode]["grpo_loss"].append(float(loss.detach()) * accum)
            return loss

        hf = self._hf_model(model)
        with capture_hidden(hf.base_model) as store:
            grpo = super()._compute_loss(model, inputs)
        hidden = store[0] if len(store) == 1 else torch.cat(store, 0)
        n_comp = inputs["completion_ids"].size(1)
        student_logits = self._logits_from_hidden(hf, hidden[:, -n_comp - 1 : -1])
        mask = loss_mask(inputs)
        spg = args.steps_per_generation if mode == "train" else 1

        distill = _Channel()
        if use_distill:
            distill = self._distill_channel(model, hf, inputs, (student_logits, mask), accum, spg)
        replay = _Channel()
        if use_replay:
            replay = self._replay_channel(model, hf, inputs, (student_logits, mask), accum, spg)
        composed = compose_loss(
            grpo,
            distill=distill.loss,
            replay=replay.loss,
            alpha=args.distill_alpha,
            beta=args.replay_beta,
            distill_scale=distill.scale,
            replay_scale=replay.scale,
            grpo_scale=accum,
        )
        self._log_loss(mode, composed, distill, replay)
        return composed.total

    def _distill_channel(self, model, hf, inputs, student, accum: int, spg: int) -> _Channel:
        """The distillation loss on this micro-batch's distill rows: the same model, shown
        the hinted prompt, is the teacher of the completion it generated without the hint.
        ``student`` is the micro-batch's (completion logits, loss mask)."""
        args = self.args
        student_logits, mask = student
        rows = inputs["distill_rows"]
        out = _Channel(rows=int(rows.sum()))
        if out.rows == 0:
            return out
        idx = rows.nonzero(as_tuple=True)[0]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        with torch.no_grad():
            teacher_logits = self._completion_logits(
                model,
                hf,
                torch.cat([inputs["distill_prompt_ids"][idx], completion_ids[idx]], 1),
                torch.cat([inputs["distill_prompt_mask"][idx], completion_mask[idx]], 1),
                completion_ids.size(1),
            )
        if args.distill_wrapper == "taid":
            out.taid_t = self.taid_t  # None -> ValueError in taid_interpolate
        per_token = distill_per_token(
            student_logits[idx],
            teacher_logits,
            jsd_beta=args.distill_jsd_beta,
            temperature=args.distill_temperature,
            clip=args.distill_clip,
            wrapper=args.distill_wrapper,
            taid_t=out.taid_t,
            opd_entropy_threshold=args.resolved_opd_entropy_threshold,
            opd_forward_weight=args.resolved_opd_forward_weight,
        )
        out.loss = _rollout_mean(masked_row_mean(per_token, mask[idx]), inputs, idx)
        window = float(inputs["distill_num_rows"]) * accum / spg
        out.scale = out.rows / max(window, 1.0)
        return out

    def _replay_channel(self, model, hf, inputs, student, accum: int, spg: int) -> _Channel:
        """The preference loss (DPO or SimPO) on this micro-batch's replay rows: a correct
        teacher trace is "chosen", the policy's own rollout "rejected". ``student`` is the
        micro-batch's (completion logits, loss mask)."""
        args = self.args
        student_logits, mask = student
        rows = inputs["replay_rows"]
        out = _Channel(rows=int(rows.sum()))
        if out.rows == 0:
            return out
        idx = rows.nonzero(as_tuple=True)[0]
        chosen_ids = inputs["replay_chosen_ids"][idx]
        chosen_mask = inputs["replay_chosen_mask"][idx]
        chosen_logits = self._completion_logits(
            model,
            hf,
            torch.cat([inputs["prompt_ids"][idx], chosen_ids], 1),
            torch.cat([inputs["prompt_mask"][idx], chosen_mask], 1),
            chosen_ids.size(1),
        )
        average = args.replay_loss == "simpo"
        pol_c = sequence_logps(chosen_logits, chosen_ids, chosen_mask, average=average)
        pol_r = sequence_logps(
            student_logits[idx],
            inputs["completion_ids"][idx],
            mask[idx],
            average=average,
        )
        if args.replay_loss == "dpo":
            per_row = dpo_loss(
                pol_c,
                pol_r,
                inputs["replay_ref_chosen_logps"][idx],
                inputs["replay_ref_rejected_logps"][idx],
                beta=args.dpo_beta,
            )
        else:
            per_row = simpo_loss(pol_c, pol_r, beta=args.simpo_beta, gamma=args.simpo_gamma)
        out.loss = _rollout_mean(per_row, inputs, idx)
        window = float(inputs["replay_num_rows"]) * accum / spg
        out.scale = out.rows / max(window, 1.0)
        return out

    def _log_loss(self, mode: str, composed, distill: _Channel, replay: _Channel) -> None:
        if mode == "train":
            # A channel's value is a mean over this micro-batch's rows; the step's value is the
            # mean over all its rows (how the scales above weigh them), logged at the step end.
            self._metrics[mode]["grpo_loss"].append(composed.grpo_loss)
            for key, value, n in (
                ("distill_loss", composed.distill_loss, distill.rows),
                ("replay_loss", composed.replay_loss, replay.rows),
            ):
                if value is not None:
                    acc = self._channel_window.setdefault(key, [0.0, 0.0])
                    acc[0] += value * n
                    acc[1] += n
        else:
            for key, value in composed.metrics().items():
                self._metrics[mode][key].append(value)
        if distill.taid_t is not None and distill.loss is not None:
            self._metrics[mode]["taid_t"].append(distill.taid_t)

    def _flush_channel_window(self) -> None:
        """End of an optimizer step: log each channel's row-weighted mean over the step's
        micro-batches (an unweighted mean of micro-batch means overweights the micro-batches
        with few rows) and advance the TAID schedule with the same number."""
        means = {key: total / n for key, (total, n) in self._channel_window.items() if n > 0}
        self._channel_window = {}
        for key, mean in means.items():
            self._metrics["train"][key].append(mean)
        mean = means.get("distill_loss")
        if self._taid_schedule is not None and mean is not None and math.isfinite(mean):
            self._taid_schedule.step(mean, self.state.global_step + 1, self.state.max_steps)

    def training_step(self, model, inputs, num_items_in_batch):
        out = super().training_step(model, inputs, num_items_in_batch)
        # TRL counts micro-batches in self._step; an optimizer step ends every
        # current_gradient_accumulation_steps of them: log the step's channel means there and
        # advance the TAID schedule.
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._flush_channel_window()
        return out


def _rollout_mean(per_row: torch.Tensor, inputs: dict[str, Any], idx: torch.Tensor) -> torch.Tensor:
    """The mean of a channel's per-rollout losses. On a rollout worker's batch
    (``rollout_sequence_weights``, crf/rollouts/intake.py) the rollouts were sampled by an
    older policy: each weighs its importance ratio pi_prox(y)/pi_b(y) (truncated or masked as
    the correction's mode says), self-normalised, so the channel estimates its loss over the
    trainer's own policy, as GRPO's corrected advantages do. Without one, a plain mean."""
    weights = inputs.get("rollout_sequence_weights")
    if weights is None:
        return per_row.mean()
    w = weights[idx].to(per_row.dtype)
    return (per_row * w).sum() / w.sum().clamp_min(1e-8)
