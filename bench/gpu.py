"""Benchmark on one GPU: GRPO on a Qwen2.5-0.5B-shaped model, the way a user's run trains it.

Nothing is downloaded: the model is a ``Qwen2Config`` of Qwen2.5-0.5B's shape (24 layers,
hidden 896, 14 heads / 2 KV heads, vocabulary 151,936, tied embeddings: 494M parameters) with
random weights, saved in bf16 with ``save_pretrained``, and its tokenizer is built in code
(one token per character, a ChatML chat template, filler tokens up to the model's vocabulary).
Random weights generate random text, so rewards are zero; what is measured is time and memory,
which depend on the shapes and not on the weights.

It measures, in this order (each phase's numbers are written as soon as it ends):

1. ``generate``: generated tokens/s at batch 16 and 64 (bf16 weights, greedy, every sequence
   made to its full length) of each generation engine transformers has without an extra
   install: plain ``model.generate``, with PyTorch's choice of attention kernels and with
   crf's (``nocudnn``: SDPA without cuDNN, what crf's trainer generates with on CUDA);
   ``generate`` with a static KV cache, whose decoding step transformers compiles with
   torch.compile (CUDA graphs) on a GPU; and continuous
   batching (``generate_batch``, a paged cache: what TRL's
   ``use_transformers_continuous_batching`` calls). Each is timed on its second call; the
   first (compilation, graph capture) is reported for the static cache. vLLM where it is
   installed (``crf[vllm]``), else marked not measured.
2. ``profile``: torch.profiler over 16 decoding steps of plain ``generate`` at each batch,
   with each choice of attention kernels: the wall time of a step against the GPU's kernel
   time and the CPU's time in ops, the kernel launches per step and the costliest ops on each
   side. A step whose kernels fill a small part of its wall time is paced by the CPU (Python,
   dispatch, launches, cuDNN's plan building), not by the GPU. It runs in a process of its
   own (``--profile-in-process`` to keep it in this one): a CUDA profile leaves CUPTI attached
   to its process, which would slow the kernel launches of every phase after it.
3. ``grpo``: crf's composer trainer (TRL's GRPOTrainer and crf's loss channels) in this
   process, with TRL's GRPO defaults but for the batch (``--prompts`` x 8 generations) and
   the completion length (``--completion``): seconds per optimizer step (after a warm-up),
   the part of the step spent generating the rollouts (TRL's ``_generate``, timed in each
   step), generated tokens/s inside the step and peak GPU memory, for each ``--grpo-generation``
   path: TRL's generate with crf's attention kernels (the default), the same with its
   decoding step compiled over a static KV cache (``generation_compile``: its first step,
   which compiles, is reported apart), with cuDNN's attention (the baseline), or continuous
   batching (in fp32, the only precision crf runs it in); the master weights are checked to
   be fp32 after each.
4. ``crf``: ``crf.launch`` of 2 local replicas sharing the GPU at GRPO-sized steps (the grpo
   phase's batch and length), H = 50 (or the largest that fits ``--budget-s``),
   ``--grpo-rounds`` round(s) (one fewer when they do not fit), a file store on local disk,
   a global checkpoint every round, the replicas generating as a run's default has them
   (``--crf-generation``: on CUDA, decoding compiled over a static KV cache, whose first
   generation compiles). crf's share of wall time is measured from the run's own
   round records: the time training waited (exchange and checkpoint) against its compute,
   per replica; the goal is 5%. Each round's phases (device-to-host, encode, upload, wait for
   a peer, download, decode, host-to-device, checkpoint snapshot) are read from the same
   records where crf writes them, and the device copies are set against their floor measured
   after the run: 2 plain copies at once of a replica's fp32 pseudo-gradient between the GPU
   and page-locked buffers allocated beforehand.
5. ``crf-stream``: the same GRPO-sized run with Streaming DiLoCo (``--stream-fragments``,
   2 by default: each fragment's exchange overlaps the longest stretch of training torchft
   allows, H / fragments - 1 steps), the setting that hides the exchange behind training;
   its table also shows each replica's exchange in the background against the time
   training waited for it. The goal is 5%.
6. ``crf-small``: the same as ``crf`` at small steps (``--run-prompts`` x 8 rollouts of
   ``--run-completion`` tokens), the worst case for crf's share; the goal is 10%.

The replicas' phases and steps are printed as they change; each run's logs and round records
are kept under ``--out``/crf-run-<grpo|small>, and a run cut at its timeout still reports its
committed rounds. ``--budget-s`` bounds the whole benchmark: the crf runs then take the largest
H that fits what the earlier phases left (each run's H is in the table).

It writes ``gpu.json`` and ``gpu.md`` (the table, with the commit it measured) to ``--out``;
``--update-docs`` also puts the table in docs/performance.md, section "GPU: one H100", and its
result in docs/gpu-bench.json: a later run of some phases only (``--phases crf,crf-small``)
keeps the other phases' rows from there, each with the commit that measured it.

On an offline GPU machine with Python 3.12, torch, transformers, accelerate and safetensors,
the rest comes from a folder of wheels that ``make gpu-wheels`` builds here (``.whl/``: trl,
torchft-nightly, transformers, peft, datasets and what they need that such a machine
lacks). ``make gpu-check`` (bench/gpu_check.sh) installs them into a private folder, runs the
device tests (``pytest -m gpu``) and then this benchmark with what is left of 8 minutes as
its budget: crf's share at GRPO-sized steps with Streaming DiLoCo first, at the largest H
that fits (a round of H = 50 such steps is 1 to 6.5 minutes on an H200 or H100 before 2
replicas share it), then vanilla DiLoCo at the same steps, the small-step run and the grpo
phase when time is left for them (each run's H is planned from the steps the docs' result
measured). On a machine that has the repository as its working
directory and returns a folder ``$OUT``, the one command is::

    bash bench/gpu_check.sh "$OUT"

It leaves in ``$OUT`` the tests' and the benchmark's logs, gpu.json, gpu.md, the updated
docs/performance.md and docs/gpu-bench.json (to copy back into docs/) and the crf runs' logs
(crf-runs.tgz). Given this benchmark's arguments, the same script runs them without the
tests, e.g. the phases the check leaves out::

    GPU_CHECK_S=570 bash bench/gpu_check.sh "$OUT" --phases crf,generate,grpo,crf-small

``--tiny`` runs the phases on a 2-layer model on a CPU (what tests/test_bench_gpu.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crf import layout  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
SECTION = "## GPU: one H100"
BEGIN, END = "<!-- bench/gpu.py table: begin -->", "<!-- bench/gpu.py table: end -->"

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The model's shape: Qwen2.5-0.5B's, or a tiny one for a CPU check."""

    hidden: int = 896
    intermediate: int = 4864
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    vocab: int = 151_936

    @classmethod
    def tiny(cls) -> Shape:
        return cls(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)


def tokenizer_offline(vocab_size: int) -> Any:
    """One token per printable ASCII character, ChatML's special tokens, and filler tokens up
    to ``vocab_size`` (so every id a random model samples decodes to something)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in (*SPECIALS, *sorted(set(string.printable))):
        vocab.setdefault(tok, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"<|t{i}|>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token=SPECIALS[0],
        unk_token=SPECIALS[0],
        additional_special_tokens=list(SPECIALS[1:]),
        padding_side="left",
    )
    fast.chat_template = CHATML
    return fast


def build_model(folder: str, shape: Shape) -> int:
    """Save a random Qwen2 of ``shape`` (bf16) and its tokenizer in ``folder``; the number of
    parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer_offline(shape.vocab)
    cfg = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def problems(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Word problems with a number for an answer (GSM8K-like lengths, ~150 characters)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        prompt = (
            f"A shop sells {a} apples in the morning and {b} apples in the afternoon. Each "
            f"crate holds {c} apples. How many full crates do the apples fill? Answer with a "
            "number."
        )
        out.append({"prompt": prompt, "answer": str((a + b) // c)})
    return out


# ---------------------------------------------------------------------- phase 1: generate
#: the grpo phase's generation paths (bench_grpo)
GRPO_PATHS = {
    "generate": "TRL's generate, crf's attention kernels",
    "cudnn": "TRL's generate, SDPA with cuDNN",
    "continuous": "continuous batching, fp32",
    "compiled": "TRL's generate, static KV cache compiled (generation_compile)",
}

#: the generation engines measured, all in transformers (nothing extra to install)
ENGINES = {
    "generate": "HF generate",
    "nocudnn": "HF generate, SDPA without cuDNN (crf's generation on CUDA)",
    "static": "HF generate, static KV cache + torch.compile",
    "continuous": "continuous batching (generate_batch)",
}


def _prompts(tok: Any, batch: int) -> list[str]:
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for p in problems(batch)
    ]


def _load_bf16(folder: str, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, tok


def _generate_once(model: Any, tok: Any, engine: str, batch: int, new: int, device: str) -> int:
    """Generate ``new`` tokens for ``batch`` prompts with ``engine``; the tokens made."""
    import torch
    from transformers import GenerationConfig

    prompts = _prompts(tok, batch)
    if engine == "continuous":
        from transformers.generation import ContinuousBatchingConfig

        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)  # fmt: skip
        cb = ContinuousBatchingConfig(max_memory_percent=0.3 if device == "cuda" else None,
                                      num_blocks=None if device == "cuda" else 64)  # fmt: skip
        with torch.no_grad():
            # one manager (paged cache, captured CUDA graphs) for both calls at a batch: the
            # engine's own speed; TRL builds one per generation (the grpo phase measures that)
            out = model.generate_batch(ids, generation_config=cfg, continuous_batching_config=cb,
                                       progress_bar=False, persistent_manager=True)  # fmt: skip
        return sum(len(o.generated_tokens) for o in out.values())
    from crf.composer.generation import generation_attention

    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    kw: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if engine == "static":
        # transformers compiles the decoding step itself for a static cache on a GPU
        kw["cache_implementation"] = "static"
    # crf's choice of attention kernels for its generations (no cuDNN on CUDA), or PyTorch's
    attention = generation_attention(model, cudnn=engine != "nocudnn")
    with torch.no_grad(), attention:
        out = model.generate(**enc, **kw)
    return (out.shape[1] - enc["input_ids"].shape[1]) * batch


def bench_generate(
    folder: str,
    device: str,
    new_tokens: int,
    batches: list[int],
    engines: list[str],
    rows: list[dict] | None = None,
    done: Any = None,
    deadline: float | None = None,
) -> list[dict]:
    """Generated tokens/s of each engine at each batch (bf16 weights on a GPU, greedy). Each
    is timed on its second call at the same shapes; the first (``warmup_s``) compiles the
    decoding step (``static``) or sizes the paged cache and captures CUDA graphs
    (``continuous``, whose manager the second call reuses).

    Rows are appended to ``rows`` and ``done()`` is called after each, so that a benchmark
    cut at its time limit keeps the engines it measured; past ``deadline``
    (``time.perf_counter()``) an engine is a row saying it was skipped."""
    model, tok = _load_bf16(folder, device)
    rows = [] if rows is None else rows
    for engine in engines:
        for batch in batches:
            if deadline is not None and time.perf_counter() > deadline:
                why = "not measured: the benchmark's time budget was spent"
                rows.append({"engine": ENGINES[engine], "batch": batch, "note": why})
                continue
            try:
                t0 = time.perf_counter()
                _generate_once(model, tok, engine, batch, new_tokens, device)  # warm-up
                _sync(device)
                warm = time.perf_counter() - t0
                t0 = time.perf_counter()
                made = _generate_once(model, tok, engine, batch, new_tokens, device)
                _sync(device)
                dt = time.perf_counter() - t0
                if engine == "continuous":
                    model.destroy_cached_continuous_batching_manager()
            except Exception as e:  # an engine that fails here is a row, not a lost phase
                rows.append({"engine": ENGINES[engine], "batch": batch,
                             "note": f"failed: {type(e).__name__}: {str(e)[:160]}"})  # fmt: skip
            else:
                name = ENGINES[engine]
                if engine == "static" and device != "cuda":
                    name = "HF generate, static KV cache (transformers compiles on a GPU only)"
                rows.append({"engine": name, "key": engine, "batch": batch,
                             "tokens": made, "seconds": dt, "tokens_per_s": made / dt,
                             "step_ms": 1000 * dt / new_tokens, "warmup_s": warm})  # fmt: skip
                print(f"  {ENGINES[engine]}, batch {batch}: {made / dt:,.0f} tokens/s "
                      f"({1000 * dt / new_tokens:.1f} ms per step; warm-up {warm:.1f} s)",
                      flush=True)  # fmt: skip
            if done:
                done()
    del model
    _free(device)
    return rows


def bench_profile(
    folder: str,
    device: str,
    batches: list[int],
    steps: int = 16,
    engines: tuple[str, ...] = ("generate", "nocudnn"),
) -> list[dict]:
    """torch.profiler over ``steps`` decoding steps of plain ``generate`` at each batch, with
    PyTorch's choice of attention kernels and with crf's (``engines``): the wall time per step
    against the time the CPU spent in ops and the time the GPU ran kernels, the kernel
    launches per step, and the ops that cost most on each side. A step whose GPU time is a
    small part of its wall time is paced by the CPU (Python, dispatch, launches, plan
    building), not by the GPU."""
    from torch.profiler import ProfilerActivity, profile

    model, tok = _load_bf16(folder, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    out = []
    for engine, batch in [(e, b) for e in engines for b in batches]:
        _generate_once(model, tok, engine, batch, 4, device)  # warm-up
        _sync(device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            _generate_once(model, tok, engine, batch, steps, device)
            _sync(device)
            wall = time.perf_counter() - t0
        avg = prof.key_averages()
        cpu_us = sum(e.self_cpu_time_total for e in avg)
        gpu_us = sum(_device_us(e) for e in avg)
        launches = sum(e.count for e in avg if "LaunchKernel" in e.key)  # cuda/cu..., Ex/ExC
        syncs = sum(_self_us(e) for e in avg if "Synchronize" in e.key or "Memcpy" in e.key)
        ops = sum(e.count for e in avg if e.key.startswith("aten::"))

        def top(value: Any, avg: Any = avg) -> list[list]:
            ranked = sorted(avg, key=value, reverse=True)[:8]
            return [[e.key[:60], round(value(e) / 1000 / steps, 3), e.count // steps]
                    for e in ranked if value(e) > 0]  # fmt: skip

        row = {
            "engine": ENGINES[engine],
            "key": engine,
            "batch": batch,
            "steps": steps,
            "step_ms": 1000 * wall / steps,
            "cpu_ops_ms_per_step": cpu_us / 1000 / steps,
            "gpu_kernels_ms_per_step": gpu_us / 1000 / steps,
            "kernel_launches_per_step": launches / steps,
            "aten_calls_per_step": ops / steps,
            "sync_and_copy_ms_per_step": syncs / 1000 / steps,
            "top_cpu": top(_self_us),
            "top_gpu": top(_device_us),
        }
        out.append(row)
        print(f"  profile, {ENGINES[engine]}, batch {batch}: {row['step_ms']:.1f} ms per "
              f"step; GPU kernels "
              f"{row['gpu_kernels_ms_per_step']:.1f} ms, CPU in ops "
              f"{row['cpu_ops_ms_per_step']:.1f} ms ({row['sync_and_copy_ms_per_step']:.1f} "
              f"synchronizing/copying), {row['aten_calls_per_step']:.0f} aten calls and "
              f"{row['kernel_launches_per_step']:.0f} launches per step", flush=True)  # fmt: skip
        for side in ("top_cpu", "top_gpu"):
            for name, ms, count in row[side][:5]:
                print(f"    {side[4:]}: {ms:7.3f} ms/step  x{count:<4} {name}", flush=True)
    del model
    _free(device)
    return out


def profile_in_child(folder: str, batches: list[int], tiny: bool) -> list[dict]:
    """:func:`bench_profile` in a process of its own, on the model saved in ``folder``: a
    CUDA profile leaves CUPTI attached to the process that ran it (kineto tears it down only
    with ``TEARDOWN_CUPTI=1``, and not where CUDA graphs were captured), and its hooks would
    then slow every kernel launch of the phases measured after it in the same process."""
    with tempfile.TemporaryDirectory(prefix="crf-gpu-profile-") as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--model", folder, "--out", out,
               "--phases", "profile", "--profile-in-process",
               "--batches", ",".join(str(b) for b in batches)]  # fmt: skip
        if tiny:
            cmd.append("--tiny")
        proc = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(proc.stderr)
        try:
            with open(os.path.join(out, "gpu.json")) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {}
        if proc.returncode or "profile" not in res:
            last = [line for line in proc.stderr.splitlines() if line.strip()][-1:]
            why = (res.get("errors") or {}).get("profile") or (
                last[0][:200] if last else f"exit status {proc.returncode}"
            )
            raise RuntimeError(f"the profile's process failed: {why}")
        return res["profile"]


def model_parameters(folder: str) -> int:
    """Parameters of the model saved in ``folder``, counted without loading its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


def _self_us(e: Any) -> float:
    return float(getattr(e, "self_cpu_time_total", 0.0) or 0.0)


def _device_us(e: Any) -> float:
    """An op's own time on the GPU (torch 2.4+ names it device; older, cuda)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v:
            return float(v)
    return 0.0


def vllm_row() -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"engine": "vLLM", "note": "not measured: vllm is not installed here"}
    return {"engine": "vLLM", "note": "installed but not measured by this script yet"}


# ---------------------------------------------------------------------- phase 2: grpo
def bench_grpo(
    folder: str, device: str, prompts: int, completion: int, steps: int, generation: str
) -> dict:
    """Optimizer steps of crf's composer trainer with TRL's GRPO defaults (batch and
    completion length aside), in this process, without an exchange. ``generation``: one of
    :data:`GRPO_PATHS`: ``generate`` (TRL's default generate, with crf's attention kernels),
    ``cudnn`` (the same with PyTorch's choice, cuDNN's attention on a recent GPU: the
    baseline), ``compiled`` (``generation_compile``: a static KV cache, its decoding step
    compiled; the first step compiles and is reported as ``first_step_s``), or
    ``continuous`` (``use_transformers_continuous_batching``, which crf runs in fp32 only:
    its paged cache takes the weights' dtype). The master weights' dtypes are checked
    after."""
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        ProgressCallback,
        TrainerCallback,
    )

    from crf.composer import ComposerConfig, ComposerReplicationTrainer, DiLoCoCallback
    from crf.replica.model import native_bf16
    from crf.replica.rewards import exact_match

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.lengths: list[float] = []
            #: (the step it ran in, seconds) of each generation
            self.generation: list[tuple[int, float]] = []

        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gens = 8
    rows = [{**p, "prompt": [{"role": "user", "content": p["prompt"]}]} for p in problems(256)]
    cuda = device == "cuda"
    with tempfile.TemporaryDirectory(prefix="crf-gpu-") as tmp:
        args = ComposerConfig(
            output_dir=tmp,
            max_steps=steps,
            per_device_train_batch_size=prompts * gens,
            num_generations=gens,
            max_completion_length=completion,
            use_cpu=not cuda,
            bf16=cuda and native_bf16() and generation != "continuous",
            generation_cudnn_attention=generation == "cudnn",
            generation_compile=generation == "compiled",
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
            use_transformers_continuous_batching=generation == "continuous",
            # TRL's own default share (0.5) of free GPU memory for the paged cache; on a
            # CPU a fixed small cache
            transformers_continuous_batching_config=None if cuda else {"num_blocks": 64},
        )
        clock = Clock()
        trainer = ComposerReplicationTrainer(
            model=model,
            reward_funcs=[exact_match],
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[DiLoCoCallback(None), clock],
        )
        generating = trainer._generate  # TRL's rollouts of a step: what of it is generation

        def timed_generate(prompts: list) -> Any:
            _sync(device)
            t0 = time.perf_counter()
            try:
                return generating(prompts)
            finally:
                _sync(device)
                clock.generation.append((len(clock.marks), time.perf_counter() - t0))

        trainer._generate = timed_generate
        for noisy in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(noisy)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        _sync(device)
        clock.marks.append(time.perf_counter())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    per_step = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    timed = per_step[1:] or per_step  # the first step compiles kernels and fills caches
    step_s = statistics.median(timed)
    steps_run = range(1, len(per_step) + 1)
    gen_per_step = [sum(s for i, s in clock.generation if i == n) for n in steps_run]
    gen_timed = gen_per_step[1:] or gen_per_step
    generation_s = statistics.median(gen_timed) if gen_timed else None
    length = statistics.median(clock.lengths) if clock.lengths else float(completion)
    del trainer, model
    _free(device)
    return {
        "generation": generation,
        "master_dtypes": dtypes,
        "steps": len(per_step),
        "step_s": step_s,
        "first_step_s": per_step[0] if per_step else None,
        "generation_s": generation_s,
        "rollouts_per_step": prompts * gens,
        "completion_tokens_mean": length,
        "tokens_per_s_in_step": prompts * gens * length / step_s,
        "peak_memory_gib": peak,
        "learning_rate": args.learning_rate,
        "loss_type": args.loss_type,
    }


# ---------------------------------------------------------------------- phase 3: crf
class Timeline:
    """Polls the replicas' heartbeats (``replicas/<rank>/state.json``, about one a second) and
    prints each change of phase and every tenth step: a piped log of the run shows where its
    time went, also when the run is cut at its timeout."""

    def __init__(self, store: str, every_s: float = 2.0) -> None:
        import threading

        self.store, self.every_s, self.t0 = store, every_s, time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._last: dict[str, tuple] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def poll(self) -> None:
        run = _run_store(self.store)
        for rank in (0, 1) if run else ():
            beat = _read(run, layout.heartbeat_key(rank), layout.Heartbeat)
            if beat is None:
                continue
            key = (beat.phase, beat.step // 10)
            if self._last.get(rank) == key:
                continue
            self._last[rank] = key
            t = time.perf_counter() - self.t0
            self.events.append({"t_s": round(t, 1), "rank": rank, "phase": beat.phase,
                                "step": beat.step})  # fmt: skip
            print(f"  {t:6.1f} s  replica {rank}: {beat.phase}, step {beat.step}", flush=True)


def _run_store(store: str) -> Any:
    """The run folder in ``store`` (the bench starts one run there), once it exists."""
    from crf.store import RunStore

    for name in sorted(os.listdir(store)):
        if os.path.exists(os.path.join(store, name, layout.RUN_SPEC)):
            return RunStore(f"file://{os.path.join(store, name)}")
    return None


def _read(run: Any, key: str, record: type) -> Any:
    """The record at ``key``, or None while it is absent or being rewritten."""
    from crf.store import ObjectNotFound

    try:
        return record.from_dict(run.get_json(key))  # type: ignore[attr-defined]
    except (ObjectNotFound, OSError, ValueError):
        return None


#: a round's phases as crf's round records name them (``metrics/<rank>/<r>.json``), in the
#: order a round runs them; a record without a phase's field shows it as not recorded
ROUND_PHASES = (
    ("device-to-host", "d2h_s"),
    ("encode", "encode_s"),
    ("upload", "upload_s"),
    ("wait for a peer", "wait_s"),
    ("download", "download_s"),
    ("decode", "decode_s"),
    ("host-to-device", "h2d_s"),
    ("checkpoint snapshot", "snapshot_s"),
    ("DiLoCo's outer step (pseudo-gradients, global copy, outer optimizer)", "outer_s"),
)


def round_phases(record: Any) -> dict[str, float | None]:
    """Seconds of each of :data:`ROUND_PHASES` in one round record: from its ``phases_s``
    table (the exchange's phases by short name: ``d2h``, ``encode``...), or a field of the
    record by the long name (``snapshot_s``); None where the record has neither (a record
    of a crf that does not time that phase)."""
    extra = getattr(record, "extra", None) or {}
    table = getattr(record, "phases_s", None) or extra.get("phases_s") or {}
    out: dict[str, float | None] = {}
    for _, key in ROUND_PHASES:
        value = table.get(key.removesuffix("_s"), table.get(key))
        if value is None:
            value = getattr(record, key, None)
        if value is None:
            value = extra.get(key)
        out[key] = float(value) if isinstance(value, int | float) else None
    return out


def _per_replica(store: str, ranks: range) -> list[dict[str, Any]]:
    """Each replica's committed rounds, from its round records: the wait per round, and the
    compute time per round (a record's ``compute_s`` counts from its process's start, so
    it restarts from 0 after a restart), and its checkpoint writes from its result."""
    run = _run_store(store)
    out = []
    for rank in ranks:
        recs = [_read(run, layout.metrics_key(rank, r), layout.RoundMetrics)
                for r in (layout.metrics_rounds(run, rank) if run else [])]  # fmt: skip
        recs = [m for m in recs if m is not None and m.committed]
        compute, before, per_round = 0.0, 0.0, []
        for m in recs:
            per_round.append(m.compute_s - before if m.compute_s >= before else m.compute_s)
            compute += per_round[-1]
            before = m.compute_s
        result = _read(run, layout.result_key(rank), layout.ResultRecord) if run else None
        out.append({"rank": rank, "rounds": len(recs), "compute_s": compute,
                    "sync_per_round_s": [m.sync_s for m in recs],
                    "transfer_per_round_s": [m.transfer_s for m in recs],
                    "compute_per_round_s": per_round,
                    "bytes_up_per_round": [m.bytes_up for m in recs],
                    "phases_per_round": [round_phases(m) for m in recs],
                    "ckpt_s": result.ckpt_s if result else None})  # fmt: skip
    return out


def _keep_logs(store: str, out: str, name: str = "crf-run") -> None:
    """Copy the run's small files (logs, round records, results) to ``out``/crf-run, one
    folder deep (``metrics/0/1.json`` as ``metrics-0-1.json``): what a cut or failed run
    leaves to read once its temporary store is gone."""
    import glob
    import shutil

    dest = os.path.join(out, name)
    os.makedirs(dest, exist_ok=True)
    for pattern in ("logs/*.log", "metrics/*/*.json", "results/*.json", "result.json",
                    "replicas/*/state.json"):  # fmt: skip
        for path in glob.glob(os.path.join(store, "*", pattern)):
            rel = os.path.relpath(path, store).split(os.sep, 1)[1]
            shutil.copy(path, os.path.join(dest, rel.replace(os.sep, "-")))


#: crf's share of a replica's wall time (the time training waited for it, against its
#: compute), as a goal: at GRPO-sized steps (vanilla DiLoCo, and Streaming DiLoCo, whose
#: exchange overlaps training), and at small steps (the worst case)
GOALS = {"grpo": 0.05, "stream": 0.05, "small": 0.10}
#: the crf runs by label: the phase that runs each, and its steps' size
RUN_PHASES = {"grpo": "crf", "stream": "crf-stream", "small": "crf-small"}


class NoTimeLeft(Exception):
    """The budget left cannot hold a crf run that measures anything (a phase skipped)."""


#: the fewest steps per round worth a crf run under a budget: with fewer, start-up and the
#: round's fixed costs are all it would measure
MIN_SYNC_EVERY = 10


def fit_sync_every(
    budget_s: float, step_s: float, rounds: int, most: int = 50, overhead_s: float = 0.0
) -> int:
    """The largest H <= ``most`` whose ``rounds`` rounds of steps of ``step_s`` (a step of a
    replica, the GPU shared by 2) fit in ``budget_s`` with start-up, the rounds' waits and
    the run's close counted (:data:`RUN_OVERHEAD_S`, :data:`ROUND_WAIT_S`, and
    ``overhead_s`` more: the first generation's compilation). NoTimeLeft when that is under
    :data:`MIN_SYNC_EVERY` (and under ``most``)."""
    left = budget_s - RUN_OVERHEAD_S - overhead_s - rounds * ROUND_WAIT_S
    h = min(most, int(left / (rounds * max(step_s, 1e-3))))
    if h < min(most, MIN_SYNC_EVERY):
        raise NoTimeLeft(
            f"skipped: {budget_s:.0f} s of the budget left, a run of H = "
            f"{min(most, MIN_SYNC_EVERY)} needs about "
            f"{RUN_OVERHEAD_S + overhead_s + rounds * (ROUND_WAIT_S + MIN_SYNC_EVERY * step_s):.0f}"
            " s"
        )
    return h


def crf_run_step(
    label: str, known: tuple[dict, ...], run_completion: int, compiled: bool = False
) -> float:
    """A replica's step in a crf run of ``label`` (``grpo``, ``stream``: GRPO-sized, or
    ``small``), the GPU shared by 2, for planning its H: from the first of the ``known``
    results (this run's, then the documented one) with the phase it comes from, else a
    guess; ``compiled``: the replicas decode with the compiled static cache (the GRPO step's
    ``compiled`` path, the generate phase's ``static`` engine)."""
    if label in ("grpo", "stream"):
        for res in known:
            base = (res.get("grpo") or {}).get("compiled" if compiled else "generate")
            if base:
                return 2 * base["step_s"]
        return 4.0 if compiled else 10.0
    decode = 0.01 if compiled else 0.07
    for res in known:
        key = "static" if compiled else "generate"
        rows = [g for g in res.get("generate") or [] if g.get("key") == key]
        rows = rows or ([] if compiled else res.get("profile") or [])  # plain generate's too
        if rows and rows[0].get("step_ms"):
            decode = rows[0]["step_ms"] / 1000
            break
    # the rollouts of a small step decode together; the GPU, shared by 2, is not the limit
    # at this size (a measured step: 0.57 s for 8 tokens at 70 ms a token)
    return 1.25 * run_completion * decode + 0.1


def crf_run_share(left: float, least_self: float, least_later: list[float]) -> float:
    """The seconds of ``left`` a crf run may take: all of them, but for what the shortest
    runs of the crf phases after it need (``least_later``, in their order), as many of them
    as fit beside the shortest run of this one (``least_self``); when none does, all of it
    (the earlier phases are the ones that matter more)."""
    keep = 0.0
    for least in least_later:
        if left - keep - least < least_self:
            break
        keep += least
    return left - keep


def streaming(sync_every: int, fragments: int) -> tuple[int, int]:
    """(H, delay) of a Streaming DiLoCo run of ``fragments`` fragments: H rounded down to a
    multiple of them, and the longest delay torchft allows (one step short of a fragment's
    period), so that a fragment's exchange has the most training to hide behind."""
    h = max(fragments, sync_every - sync_every % fragments)
    return h, h // fragments - 1


#: seconds a 2-replica run of the 494M model spends outside its rounds (start-up and model
#: load, the last checkpoint, the model's export) and waiting per round: measured on one H100
RUN_OVERHEAD_S, ROUND_WAIT_S = 60.0, 15.0
#: seconds the first generation of a replica compiles its decoding step (the 494M model's
#: first compiled GRPO step, 28 s on one H200, and 2 replicas compile at once)
COMPILE_S = 45.0
#: ``--crf-generation``: the crf runs' ``generation_compile`` (the default: unset, which
#: compiles on CUDA where it can run)
CRF_GENERATION = {"default": None, "plain": False, "compiled": True}
#: how the table names a crf run's generation (a run measured before the setting had a
#: default decoded with plain ``generate``)
CRF_DECODING = {
    "default": ", decoding compiled over a static KV cache (the default on CUDA)",
    "plain": ", plain generate",  # also the default on a CPU
    "compiled": ", decoding compiled over a static KV cache",
}


def bench_crf(
    folder: str,
    prompts: int,
    completion: int,
    sync_every: int,
    rounds: int,
    timeout: float,
    out: str,
    checkpoint_every: int = 1,
    label: str = "grpo",
    generation: str = "default",
    fragments: int = 1,
) -> dict:
    """2 local replicas under crf (exchange and checkpoints through a file store). The
    replicas' phases and steps are printed as they change, and the run is cancelled after
    ``timeout`` seconds; what the rounds that committed by then measured is kept either way
    (the round records, and the logs under ``out``/crf-run). ``generation``: a key of
    :data:`CRF_GENERATION`. ``fragments`` > 1: Streaming DiLoCo, each fragment's exchange
    overlapping the longest stretch of training torchft allows (:func:`streaming`)."""
    import torch

    import crf

    compiled = CRF_GENERATION[generation]
    knobs = {} if compiled is None else {"generation_compile": compiled}
    # what the replicas decode with: the default compiles on CUDA only
    decoding = "plain" if generation == "default" and not torch.cuda.is_available() else generation
    delay = 0
    if fragments > 1:
        sync_every, delay = streaming(sync_every, fragments)
    stream = {"fragments": fragments, "fragment_sync_delay": delay} if fragments > 1 else {}

    with tempfile.TemporaryDirectory(prefix="crf-gpu-store-") as store:
        data = os.path.join(store, "train.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in problems(512))
        t0 = time.perf_counter()
        error = None
        try:
            with Timeline(store) as timeline:
                run = crf.launch(
                    {
                        "job": "composer",
                        "replicas": 2,
                        "sync_every": sync_every,
                        "rounds": rounds,
                        "model": folder,
                        "dataset": data,
                        "reward": ["exact_match"],
                        "round_timeout_s": 900.0,
                        "checkpoint_every": checkpoint_every,
                        **stream,
                        "job_config": {
                            "prompts_per_step": prompts,
                            "max_completion_length": completion,
                            **knobs,
                        },  # fmt: skip
                    },
                    store=store,
                    plot=False,
                    progress=True,
                    timeout_s=timeout,
                )
            result = run.result
            if result is None or not result.ok:
                error = f"the crf run did not end ok: {result and result.error}"
        except Exception as e:  # a cut run still has its committed rounds to report
            result, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        wall = time.perf_counter() - t0
        reps = _per_replica(store, range(2))
        _keep_logs(store, out, f"crf-run-{label}")
    for r in reps:
        r["sync_s"] = sync = sum(r["sync_per_round_s"])
        r["crf_share"] = sync / (sync + r["compute_s"]) if sync + r["compute_s"] else None
    done = min(r["rounds"] for r in reps)
    if not done:
        raise RuntimeError(error or "no round committed")
    ups = [b for r in reps for b in r["bytes_up_per_round"]]
    sync_all = sum(r["sync_s"] for r in reps)
    compute_all = sum(r["compute_s"] for r in reps)
    return {
        "label": label,
        "replicas": reps,
        "crf_share": sync_all / (sync_all + compute_all) if sync_all + compute_all else None,
        "goal": GOALS[label],
        "sync_every": sync_every,
        "rounds": rounds,
        "rounds_committed": done,
        "rollouts_per_step": prompts * 8,
        "completion": completion,
        "step_s": sum(r["compute_s"] for r in reps) / (sync_every * sum(r["rounds"] for r in reps)),
        "weights_identical": result.weights_identical if result and result.ok else None,
        "checkpoint_every": checkpoint_every,
        "generation": generation,
        "decoding": decoding,
        "fragments": fragments,
        "fragment_sync_delay": delay,
        "bytes_up_per_replica_round": statistics.median(ups),
        "wall_s": wall,
        "timeline": timeline.events,
        "error": error,
    }


def bench_copies(nbytes: int, device: str, at_once: int = 2, repeats: int = 3) -> dict:
    """The floor of a round's device copies: ``at_once`` plain copies of ``nbytes`` each (as
    the 2 replicas sharing the GPU copy their pseudo-gradients together), each on a stream of
    its own into a page-locked buffer allocated beforehand, device-to-host and back; the
    fastest of ``repeats``. On a CPU, plain copies between two buffers."""
    import torch

    n = max(1, nbytes // 4)
    cuda = device == "cuda"
    dev = [torch.ones(n, dtype=torch.float32, device=device) for _ in range(at_once)]
    host = [torch.empty(n, dtype=torch.float32, pin_memory=cuda) for _ in range(at_once)]
    streams = [torch.cuda.Stream() for _ in range(at_once)] if cuda else [None] * at_once

    def timed(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            for (dst, src), stream in zip(pairs, streams, strict=True):
                if stream is None:
                    dst.copy_(src)
                    continue
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            for stream in streams:
                if stream is not None:
                    stream.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    d2h = timed(list(zip(host, dev, strict=True)))
    h2d = timed(list(zip(dev, host, strict=True)))
    del dev, host
    _free(device)
    return {"bytes": 4 * n, "at_once": at_once, "pinned": cuda, "d2h_s": d2h, "h2d_s": h2d}


# ---------------------------------------------------------------------- report
def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def environment() -> dict[str, Any]:
    import torch
    import transformers
    import trl

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "cpus": os.cpu_count(),
    }


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def table(res: dict[str, Any]) -> str:
    """The markdown table of a result (what goes into docs/performance.md)."""
    env = res["environment"]
    lines = [
        f"Measured by `python3 bench/gpu.py` on {env.get('gpu') or 'a CPU'} "
        f"({env['cpus']} CPU cores; Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, trl {env['trl']}), on "
        + (
            f"the model given with --model ({res.get('parameters', 0) / 1e6:.0f}M parameters)"
            if res.get("model")
            else f"a random model of Qwen2.5-0.5B's shape ({res.get('parameters', 0) / 1e6:.0f}M"
            f" parameters{', the --tiny shape' if res.get('tiny') else ''})"
        )
        + f", crf at commit {res.get('commit') or 'unknown'}.",
    ]
    if res.get("merged"):
        told = ", ".join(f"{k} at {c}" for k, c in res["merged"].items())
        lines.append(f"Phases kept from an earlier run of it (and the commit measured): {told}.")
    lines += ["", "| measure | value |", "|---|---:|"]
    new = res.get("new_tokens")
    dtype = "bf16" if env.get("gpu") else "fp32"
    for g in res.get("generate", []):
        what = g["engine"] + (f", batch {g['batch']}" if "batch" in g else "")
        if "tokens_per_s" in g:
            first = g.get("key") in ("static", "continuous")
            warm = f"; first call {g['warmup_s']:.1f} s" if first else ""
            lines.append(
                f"| {what}, {new} new tokens, {dtype}, greedy: generated tokens/s (ms per step"
                f"{warm}) | {g['tokens_per_s']:,.0f} ({g['step_ms']:.1f}) |"
            )
        else:
            lines.append(f"| {what}: generated tokens/s | {g['note']} |")
    for p in res.get("profile", []):
        lines.append(
            f"| {p.get('engine', 'HF generate')}, batch {p['batch']}, one decoding step "
            "(torch.profiler): wall / GPU "
            f"kernels / CPU in ops / of which synchronizing and copying, ms; kernel launches | "
            f"{p['step_ms']:.1f} / {p['gpu_kernels_ms_per_step']:.1f} / "
            f"{p['cpu_ops_ms_per_step']:.1f} / {p['sync_and_copy_ms_per_step']:.1f}; "
            f"{p['kernel_launches_per_step']:.0f} |"
        )
        top = "; ".join(f"{n} {ms:.2f}" for n, ms, _ in p["top_cpu"][:3])
        lines.append(f"| its costliest ops on the CPU, ms per step | {top} |")
        if p["top_gpu"]:
            top = "; ".join(f"{n} {ms:.2f}" for n, ms, _ in p["top_gpu"][:3])
            lines.append(f"| its costliest kernels on the GPU, ms per step | {top} |")
    grpo = res.get("grpo") or {}
    for gen, g in grpo.items():
        what = f"{g['rollouts_per_step']} rollouts of ≤ {res['completion']} tokens"
        how = GRPO_PATHS.get(gen, gen)
        runs = g.get("step_s_runs") or [g["step_s"]]
        each = f" (runs: {', '.join(f'{r:.2f}' for r in runs)})" if len(runs) > 1 else ""
        if gen == "compiled" and g.get("first_step_s") is not None:
            each += f"; first step (compiles on a GPU): {g['first_step_s']:.1f}"
        lines.append(f"| GRPO optimizer step ({what}; {how}), s | {g['step_s']:.2f}{each} |")
        if g.get("generation_s") is not None:
            lines.append(
                f"| of it generating the rollouts / the rest (scoring, forward, backward, "
                f"optimizer) ({how}), s | {g['generation_s']:.2f} / "
                f"{max(0.0, g['step_s'] - g['generation_s']):.2f} |"
            )
        lines.append(
            f"| generated tokens/s inside the GRPO step ({how}) | "
            f"{g['tokens_per_s_in_step']:,.0f} |"
        )
        lines.append(f"| master weights after it ({how}) | {', '.join(g['master_dtypes'])} |")
    base = grpo.get("generate")
    if base:
        lines.append(
            "| peak GPU memory of one replica (fp32 weights, AdamW, bf16 autocast), GiB | "
            + (f"{base['peak_memory_gib']:.1f} |" if base["peak_memory_gib"] else "— |")
        )
    for key in RUN_PHASES.values():
        run = res.get(key)
        if run:
            lines += _run_rows(run, base)
    for phase, err in res.get("errors", {}).items():
        lines.append(f"| {phase} | failed: {err} |")
    for phase, why in res.get("skipped", {}).items():
        lines.append(f"| {phase} | {why} |")
    return "\n".join(lines) + "\n"


def _run_rows(run: dict[str, Any], grpo: dict[str, Any] | None) -> list[str]:
    """The table rows of one crf run: its measured share against its goal, the wait per
    round, the round's phases, the step, start-up."""
    shares = [r["crf_share"] for r in run["replicas"] if r["crf_share"] is not None]
    syncs = [r["sync_s"] for r in run["replicas"]]
    done = run.get("rounds_committed", run["rounds"])
    plural = "round" if run["rounds"] == 1 else "rounds"
    rounds = f"{done} of {run['rounds']} {plural}" if done < run["rounds"] else (
        f"{run['rounds']} {plural}")  # fmt: skip
    k = run.get("checkpoint_every", 1)
    ckpt = "a global checkpoint every round" if k == 1 else (
        f"a global checkpoint every {k} rounds and at the last")  # fmt: skip
    size = run_size(run)
    goal = run.get("goal")
    met = ""
    if goal is not None and run.get("crf_share") is not None:
        met = f" (goal ≤ {goal:.0%}: {'met' if run['crf_share'] <= goal else 'not met'})"
    decoding = CRF_DECODING.get(run.get("decoding", run.get("generation", "plain")), "")
    if run.get("fragments", 1) > 1:
        size_told = (f"{size} ({run['fragments']} fragments, each exchange overlapping "
                     f"{run['fragment_sync_delay']} steps of training)")  # fmt: skip
    else:
        size_told = size
    lines = [
        f"| crf's share of wall time, measured (sync + checkpoint against compute), {size_told}, "
        f"H = {run['sync_every']}, 2 replicas sharing the GPU, {rounds}, {ckpt}, "
        f"{run['rollouts_per_step']} rollouts of ≤ {run['completion']} tokens per step"
        f"{decoding} | " + ", ".join(f"{s:.1%}" for s in shares) + met + " |",
        f"| time training waited for crf per replica and round ({size}), s | "
        + ", ".join(f"{s / max(1, done):.1f}" for s in syncs)
        + " |",
    ]
    later = _share_after_first(run)
    if later:
        lines.append(f"| crf's share of wall time after round 0 ({size}: its start-up costs "
                     f"apart), per replica | {', '.join(f'{x:.1%}' for x in later)} |")  # fmt: skip
    phases = [p for r in run["replicas"] for p in r.get("phases_per_round", [])]
    told = []
    for _, key in ROUND_PHASES:
        values = [p[key] for p in phases if p.get(key) is not None]
        told.append(f"{statistics.mean(values):.2f}" if values else "—")
    names = " / ".join(label for label, _ in ROUND_PHASES)
    lines.append(f"| a round's phases ({size}), s, mean of replicas and rounds: {names} | "
                 + (" / ".join(told) if set(told) != {"—"} else "not in crf's round records")
                 + " |")  # fmt: skip
    lines += _transfer_rows(run, size)
    lines += _by_round_rows(run, size)
    lines += _copy_rows(run, phases, size)
    ckpts = [r["ckpt_s"] for r in run["replicas"] if r.get("ckpt_s") is not None]
    if ckpts:
        told = ", ".join(f"{s:.1f}" for s in ckpts)
        what = "a replica's background checkpoint writes (global and inner state), s in all"
        lines.append(f"| {what} ({size}) | {told} |")
    if run.get("step_s"):
        lines.append(f"| a replica's optimizer step in that run ({size}, the GPU shared by 2), "
                     f"s | {run['step_s']:.2f} |")  # fmt: skip
    start = next((e["t_s"] for e in run.get("timeline", []) if e["phase"] == "training"), None)
    if start is not None:
        lines.append(f"| launch to the first replica training ({size}), s | {start:.0f} |")
    if grpo and done and run.get("label", "grpo") == "small":
        per_round = statistics.mean(syncs) / done
        train = run["sync_every"] * grpo["step_s"]
        lines.append(
            f"| the same wait against H = {run['sync_every']} steps of the GRPO phase's size "
            f"({run['sync_every']} x {grpo['step_s']:.2f} s), derived | "
            f"{per_round / (per_round + train):.1%} |"
        )
    if run.get("weights_identical") is not None:
        lines.append(f"| replicas end bit-identical ({size}) | {run['weights_identical']} |")
    if run.get("error"):
        lines.append(f"| crf run ({size}) | {run['error']} |")
    return lines


def run_size(run: dict[str, Any]) -> str:
    """How the table names a crf run: its steps' size, and Streaming DiLoCo's settings."""
    label = run.get("label", "grpo")
    if label == "small":
        return "small steps"
    return "GRPO-sized steps" + (", Streaming DiLoCo" if run.get("fragments", 1) > 1 else "")


def _transfer_rows(run: dict[str, Any], size: str) -> list[str]:
    """With Streaming DiLoCo: how long each replica's exchange took per round (upload to
    decode, in the background), against the time training waited for it; a wait far
    below the transfer is the overlap at work."""
    if run.get("fragments", 1) <= 1:
        return []
    done = max(1, run.get("rounds_committed", run["rounds"]))
    told = ", ".join(
        f"{sum(r.get('transfer_per_round_s', [])) / done:.1f} / {r['sync_s'] / done:.1f}"
        for r in run["replicas"]
    )
    return [f"| the exchange per replica and round ({size}), s: its transfer in the "
            f"background / the time training waited | {told} |"]  # fmt: skip


def _share_after_first(run: dict[str, Any]) -> list[float]:
    """Each replica's share of wall time over the rounds after round 0 (which also pays for
    page-locking host buffers and the first compilations); [] with fewer than 2 rounds."""
    out = []
    for r in run["replicas"]:
        sync = sum(r.get("sync_per_round_s", [])[1:])
        compute = sum(r.get("compute_per_round_s", [])[1:])
        if len(r.get("sync_per_round_s", [])) >= 2 and sync + compute > 0:
            out.append(sync / (sync + compute))
    return out


def _by_round_rows(run: dict[str, Any], size: str) -> list[str]:
    """With more than one round: the wait, the device-to-host copy and the checkpoint
    snapshot of each round (mean of the replicas), so a first round's one-time costs stand
    apart from what every round costs."""
    reps = run["replicas"]
    n = min((len(r.get("sync_per_round_s", [])) for r in reps), default=0)
    if n < 2:
        return []

    def mean(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        return f"{statistics.mean(known):.2f}" if known else "—"

    told = []
    for i in range(n):
        phases = [r["phases_per_round"][i] for r in reps if len(r.get("phases_per_round", [])) > i]
        told.append(
            f"round {i}: "
            + " / ".join([
                mean([r["sync_per_round_s"][i] for r in reps]),
                mean([p.get("d2h_s") for p in phases]),
                mean([p.get("snapshot_s") for p in phases]),
            ])
        )  # fmt: skip
    return [
        f"| by round ({size}), s, mean of replicas: the wait / device-to-host / checkpoint "
        f"snapshot | {'; '.join(told)} |"
    ]


def _copy_rows(run: dict[str, Any], phases: list[dict], size: str) -> list[str]:
    """The round's device copies against their floor measured after the run: how much of a
    plain copy of the same bytes (page-locked, as many at once as replicas) the training
    thread waited for, each way. Blocking on no more than one such copy is the target."""
    floor = run.get("copies")
    if not floor or not floor["pinned"]:  # a CPU run: the exchange takes its tensors as they are
        return []
    told = []
    for name, key in (("device-to-host", "d2h_s"), ("host-to-device", "h2d_s")):
        values = [p[key] for p in phases if p.get(key) is not None]
        if not values:
            continue
        mean, base = statistics.mean(values), floor[key]
        ratio = f" ({mean / base:.2f}x)" if base > 0 else ""
        told.append(f"{name} {mean:.3f} against {base:.3f}{ratio}")
    if not told:
        return []
    return [
        f"| a round's device copies ({size}), s, mean of replicas and rounds, against "
        f"{floor['at_once']} plain pinned copies of the same {floor['bytes'] / 1e9:.2f} GB at "
        f"once, measured after the run | {'; '.join(told)} |"
    ]


def update_docs(text: str, path: str) -> None:
    """Replace the table between the markers of docs/performance.md's GPU section."""
    with open(path) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers in its {SECTION!r} section")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}{END}{tail}")


#: the phases a result holds by name (what a partial run merges into the documented one)
PHASE_KEYS = ("generate", "profile", "grpo", *RUN_PHASES.values())
#: the result the docs' table was made from, beside the page (merged by later partial runs)
DOCS_RESULT = "gpu-bench.json"


def merge_documented(res: dict[str, Any], path: str) -> dict[str, Any]:
    """``res`` completed with the phases it has no numbers for (not run, skipped or failed:
    a failure keeps its row too) from the result at ``path`` (the one the docs' table
    shows), each marked with the commit that measured it:
    a run of only the crf phases keeps the generation rows of an earlier
    one. ``res`` alone where there is none."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return res
    out = dict(res)
    kept = {}
    for key in PHASE_KEYS:
        if key not in res and key in old:
            out[key] = old[key]
            kept[key] = (old.get("merged") or {}).get(key) or measured_by(old)
    # a skipped phase shown from the earlier run needs no note; a failure keeps its row
    out["skipped"] = {k: v for k, v in res.get("skipped", {}).items() if k not in kept}
    if kept:
        out["merged"] = kept
    return out


def measured_by(res: dict[str, Any]) -> str:
    """The commit and the GPU of a result, as a kept row names them: a table can hold rows
    of two machines."""
    gpu = (res.get("environment") or {}).get("gpu")
    return (res.get("commit") or "unknown") + (f" on {gpu}" if gpu else "")


def commit() -> str | None:
    """The checkout's commit (with ``+changes`` when its files differ), or None outside git;
    ``CRF_COMMIT`` when set (a copy of the tree whose ``.git`` is not the checkout's)."""
    import subprocess

    if os.environ.get("CRF_COMMIT"):
        return os.environ["CRF_COMMIT"]
    root = os.path.dirname(DOCS)
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="gpu-out", help="folder for gpu.json and gpu.md (written "
                   "again as each phase and engine ends)")  # fmt: skip
    p.add_argument("--logs", default=None, help="folder for the crf runs' logs and round "
                   "records (default: --out)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: a quick CPU check")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (x 8 generations), "
                   "grpo phase and the GRPO-sized crf run")  # fmt: skip
    p.add_argument("--completion", type=int, default=128, help="max completion tokens, likewise")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps of the grpo phase")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens each generate "
                   "call makes (default 128; --tiny: 8)")  # fmt: skip
    p.add_argument("--engines", default="generate,nocudnn,continuous,static",
                   help="generate phase's engines: " + ", ".join(
                       f"{k} ({v})" for k, v in ENGINES.items()))  # fmt: skip
    p.add_argument("--grpo-generation", default="generate,compiled,cudnn",
                   help="the grpo phase's generation paths: " + ", ".join(
                       f"{k} ({v})" for k, v in GRPO_PATHS.items()))  # fmt: skip
    p.add_argument("--grpo-repeats", type=int, default=1, help="runs of each grpo path, the "
                   "paths alternated (a path's step: the median of its runs)")  # fmt: skip
    p.add_argument("--run-prompts", type=int, default=1, help="prompts per step, small-step run")
    p.add_argument("--run-completion", type=int, default=8, help="max completion, small-step run")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds a crf run may take "
                   "(without --budget-s)")  # fmt: skip
    p.add_argument("--sync-every", type=int, default=50, help="H of the crf runs (the most "
                   "H under --budget-s)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="rounds of the small-step crf run")
    p.add_argument("--grpo-rounds", type=int, default=2, help="rounds of the GRPO-sized crf "
                   "run, one fewer where they do not fit --budget-s (a second round tells a "
                   "round's cost from the first's one-time costs)")  # fmt: skip
    p.add_argument("--batches", default="16,64", help="batches of the generate and profile "
                   "phases")  # fmt: skip
    p.add_argument(
        "--crf-generation",
        choices=sorted(CRF_GENERATION),
        default="default",
        help="the crf runs' generation: default (generation_compile unset: "
        "compiled on CUDA where it can run), plain (generate) or compiled",
    )
    p.add_argument("--stream-fragments", type=int, default=2, help="fragments of the "
                   "crf-stream run (Streaming DiLoCo at GRPO-sized steps; its H is rounded "
                   "down to a multiple of them)")  # fmt: skip
    p.add_argument("--checkpoint-every", type=int, default=1, help="the crf runs' "
                   "--checkpoint-every (the last round is always checkpointed)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=0, help="seconds the whole benchmark may "
                   "take (0: no limit): the crf runs take the largest H that fits what the "
                   "earlier phases left, each cut at its share")  # fmt: skip
    p.add_argument("--phases", default="generate,profile,grpo,crf,crf-stream,crf-small",
                   help="which phases, in order")  # fmt: skip
    p.add_argument("--update-docs", action="store_true", help="write the table into "
                   "docs/performance.md")  # fmt: skip
    p.add_argument("--model", default=None, help="a model folder (save_pretrained, with its "
                   "tokenizer) to measure instead of building the random one")  # fmt: skip
    p.add_argument("--profile-in-process", action="store_true", help="run the profile phase "
                   "in this process (default: a process of its own, so the profiler's hooks "
                   "stay out of the phases measured after it)")  # fmt: skip
    a = p.parse_args(argv)
    if a.model and not os.path.isfile(os.path.join(a.model, "config.json")):
        p.error(f"--model {a.model}: no model saved there (config.json)")

    import torch

    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = Shape.tiny() if a.tiny else Shape()
    new_tokens = a.new_tokens or (8 if a.tiny else 128)
    os.makedirs(a.out, exist_ok=True)
    res: dict[str, Any] = {"environment": environment(), "tiny": a.tiny, "commit": commit(),
                           "completion": a.completion, "new_tokens": new_tokens,
                           "errors": {}}  # fmt: skip

    def save() -> None:
        with open(os.path.join(a.out, "gpu.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "gpu.md"), "w") as f:
            f.write(table(res))

    documented: dict[str, Any] = {}
    if not (a.tiny or a.model):  # the docs' result measured this model: plan with its steps
        try:
            with open(os.path.join(DOCS, DOCS_RESULT)) as f:
                documented = json.load(f)
        except (OSError, ValueError):
            pass

    def plan_run(label: str, later: list[str]) -> tuple[int, float, int]:
        """(H, timeout, rounds) of a crf run: --sync-every, --run-timeout and its rounds, or
        under --budget-s the largest H that fits its share of the time left
        (:func:`crf_run_share`: what the ``later`` runs need, as many as fit), with one
        round fewer when its rounds do not fit (a second round is what tells a round's cost
        from the first round's one-time costs)."""
        rounds = {"grpo": a.grpo_rounds, "stream": a.grpo_rounds, "small": a.rounds}
        if not a.budget_s:
            return a.sync_every, a.run_timeout, rounds[label]
        # the replicas compile their decoding step on CUDA unless told not to
        compiled = device == "cuda" and a.crf_generation != "plain"
        extra = COMPILE_S if compiled else 0.0
        steps = {k: crf_run_step(k, (res, documented), a.run_completion, compiled)
                 for k in rounds}  # fmt: skip
        while True:
            least = {k: RUN_OVERHEAD_S + extra + rounds[k] * (ROUND_WAIT_S + min(a.sync_every,
                     MIN_SYNC_EVERY) * steps[k]) for k in steps}  # fmt: skip
            left = a.budget_s - (time.perf_counter() - t_start)
            share = crf_run_share(left, least[label], [least[k] for k in later])
            try:
                h = fit_sync_every(share, steps[label], rounds[label], a.sync_every, extra)
            except NoTimeLeft:
                if rounds[label] <= 1:
                    raise
                rounds[label] -= 1
                continue
            return h, max(30.0, share), rounds[label]

    def crf_run(label: str) -> dict:
        order = a.phases.split(",")
        runs = {phase: k for k, phase in RUN_PHASES.items()}
        later = [runs[p] for p in order[order.index(RUN_PHASES[label]) + 1 :] if p in runs]
        h, timeout, rounds = plan_run(label, later)
        prompts, completion = ((a.run_prompts, a.run_completion) if label == "small"
                               else (a.prompts, a.completion))  # fmt: skip
        fragments = a.stream_fragments if label == "stream" else 1
        print(f"  H = {h}, {rounds} round(s), cut at {timeout:.0f} s"
              + (f", {fragments} fragments" if fragments > 1 else ""), flush=True)  # fmt: skip
        run = bench_crf(folder, prompts, completion, h, rounds, timeout, a.logs or a.out,
                        a.checkpoint_every, label, a.crf_generation, fragments)  # fmt: skip
        # the floor of its device copies, a replica's fp32 pseudo-gradient each way
        run["copies"] = bench_copies(4 * res["parameters"], device)
        return run

    def generate_rows() -> list[dict]:
        rows = res["generate"] = []  # saved as each engine ends: a cut run keeps them
        deadline = t_start + a.budget_s if a.budget_s else None
        bench_generate(folder, device, new_tokens, batches, engines, rows, save, deadline)
        return [*rows, vllm_row()]

    def grpo_paths() -> dict[str, dict]:
        """Each path ``--grpo-repeats`` times, the paths alternated (A B A B: an order effect
        falls on both); a path's step is the median of its runs' (each run's own in
        ``step_s_runs``). Saved as each run ends; a failed path is an error row."""
        paths = res["grpo"] = {}
        gens = [g for g in a.grpo_generation.split(",") if g]
        failed: set[str] = set()
        for _ in range(max(1, a.grpo_repeats)):
            for gen in gens:
                if gen in failed:
                    continue
                if a.budget_s and time.perf_counter() - t_start > a.budget_s:
                    res.setdefault("skipped", {})[f"grpo ({GRPO_PATHS[gen]})"] = (
                        f"skipped: the budget ({a.budget_s:.0f} s) was spent"
                    )
                    continue
                try:
                    g = bench_grpo(folder, device, a.prompts, a.completion, a.steps, gen)
                except Exception as e:
                    res["errors"][f"grpo ({GRPO_PATHS[gen]})"] = (
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    )
                    failed.add(gen)
                    save()
                    continue
                for key in ("step_s", "generation_s"):  # the median of the path's runs
                    runs = paths.get(gen, {}).get(f"{key}_runs", []) + [g[key]]
                    g[f"{key}_runs"] = runs
                    measured = [r for r in runs if r is not None]
                    g[key] = statistics.median(measured) if measured else None
                g["tokens_per_s_in_step"] = (
                    g["rollouts_per_step"] * g["completion_tokens_mean"] / g["step_s"]
                )
                paths[gen] = g
                runs = g["step_s_runs"]
                print(f"  {GRPO_PATHS[gen]}: {runs[-1]:.2f} s per step (median of "
                      f"{len(runs)} run(s): {g['step_s']:.2f} s)", flush=True)  # fmt: skip
                save()
        return paths

    print(json.dumps(res["environment"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="crf-gpu-model-") as built:
        t0 = time.perf_counter()
        if a.model:
            folder = res["model"] = a.model
            res["parameters"] = model_parameters(folder)
        else:
            folder = built
            res["parameters"] = build_model(folder, shape)
        print(f"model: {res['parameters'] / 1e6:.0f}M parameters, "
              f"{'from ' + folder if a.model else 'built and saved'} in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        engines = [e for e in a.engines.split(",") if e]
        batches = [int(b) for b in a.batches.split(",") if b]
        phases = {
            "generate": generate_rows,
            "profile": lambda: (
                bench_profile(folder, device, batches)
                if a.profile_in_process
                else profile_in_child(folder, batches, a.tiny)
            ),
            "grpo": grpo_paths,
            **{phase: (lambda k=k: crf_run(k)) for k, phase in RUN_PHASES.items()},
        }
        for name in a.phases.split(","):
            t0 = time.perf_counter()
            print(f"phase {name} ...", flush=True)
            try:
                if a.budget_s and t0 - t_start > a.budget_s:
                    raise NoTimeLeft(f"skipped: the budget ({a.budget_s:.0f} s) was spent")
                res[name] = phases[name]()
            except NoTimeLeft as e:
                res.setdefault("skipped", {})[name] = str(e)
            except Exception as e:  # one failed phase must not lose the others' numbers
                res["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            how = res["errors"].get(name) or res.get("skipped", {}).get(name, "ok")
            print(f"phase {name}: {time.perf_counter() - t0:.0f} s {how}", flush=True)
            save()
    res["wall_s"] = time.perf_counter() - t_start
    save()
    print(table(res), flush=True)
    if a.update_docs:
        shown = merge_documented(res, os.path.join(DOCS, DOCS_RESULT))
        update_docs(table(shown), os.path.join(DOCS, "performance.md"))
        with open(os.path.join(DOCS, DOCS_RESULT), "w") as f:
            json.dump(shown, f, indent=1)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
