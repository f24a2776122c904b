"""Benchmark on one GPU: GRPO on a Qwen2.5-0.5B-shaped model, the way a user's run trains it.

Nothing is downloaded: the model is a ``Qwen2Config`` of Qwen2.5-0.5B's shape (24 layers,
hidden 896, 14 heads / 2 KV heads, vocabulary 151,936, tied embeddings: 494M parameters) with
random weights, saved in bf16 with ``save_pretrained``, and its tokenizer is built in code
(one token per character, a ChatML chat template, filler tokens up to the model's vocabulary).
Random weights generate random text, so rewards are zero; what is measured is time and memory,
which depend on the shapes and not on the weights.

It measures, in this order (each phase's numbers are written as soon as it ends):

1. ``generate``: generated tokens/s of HF ``model.generate`` (bf16 weights, greedy, every
   sequence forced to its full length) at batch 16 and 64, 256 new tokens each;
   vLLM where it is installed (``crf[vllm]``), else marked not measured.
2. ``grpo``: crf's composer trainer (TRL's GRPOTrainer and crf's loss channels) in this
   process, with TRL's GRPO defaults but for the batch (``--prompts`` x 8 generations) and
   the completion length (``--completion``): seconds per optimizer step (after a warm-up),
   generated tokens/s inside the step, and peak GPU memory (``torch.cuda.max_memory_allocated``).
3. ``crf``: ``crf.launch`` of 2 local replicas sharing the GPU, H = 50, 2 rounds, a file store
   on local disk, a global checkpoint every round (``--checkpoint-every``; 494M fp32
   parameters: 2 GB up per replica per round, a 6 GB checkpoint): crf's share of wall time =
   sync (exchange + checkpoint, the time training waited) / (sync + compute), per replica,
   and the same wait against 50 steps of the ``grpo`` phase's size. The replicas' phases and
   steps are printed as they change; the run's logs and round records are kept under
   ``--out``/crf-run, and a run cut at ``--run-timeout`` still reports its committed rounds.

It writes ``gpu.json`` and ``gpu.md`` (the table) to ``--out``; ``--update-docs`` also puts the
table in docs/performance.md, section "GPU: one H100".

On an offline GPU machine with Python 3.12, torch, transformers, accelerate, peft and
safetensors, the rest comes from a folder of wheels that ``make gpu-wheels`` builds here
(``.whl/``, about 20 MB: trl, torchft-nightly, transformers 5.23, datasets and what they need
that such a machine lacks). There, in a copy of this repository::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
        PYTHONPATH=/tmp/site:$PWD python3 bench/gpu.py --out gpu-out --update-docs

On one H100 the phases took 16 s (the model), 47 s (generate), 50 s (grpo) and 147 s (crf):
about 4.5 minutes in all; the crf phase is cut at ``--run-timeout`` (300 s) whatever happens.
``--tiny`` runs the same phases on a 2-layer model in about a minute on a CPU (what
tests/test_bench_gpu.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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
def bench_generate(folder: str, device: str, new_tokens: int, batches: list[int]) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    rows = []
    for batch in batches:
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for p in problems(batch)
        ]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        with torch.no_grad():
            model.generate(**enc, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(**enc, **kw)
            _sync(device)
            dt = time.perf_counter() - t0
        made = (out.shape[1] - enc["input_ids"].shape[1]) * batch
        rows.append({"engine": "HF generate", "batch": batch, "tokens": made, "seconds": dt,
                     "tokens_per_s": made / dt})  # fmt: skip
    del model
    _free(device)
    return rows


def vllm_row() -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"engine": "vLLM", "note": "not measured: vllm is not installed here"}
    return {"engine": "vLLM", "note": "installed but not measured by this script yet"}


# ---------------------------------------------------------------------- phase 2: grpo
def bench_grpo(folder: str, device: str, prompts: int, completion: int, steps: int) -> dict:
    """Optimizer steps of crf's composer trainer with TRL's GRPO defaults (batch and
    completion length aside), in this process, without an exchange."""
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
    from crf.replica.rewards import exact_match

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.lengths: list[float] = []

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
            bf16=cuda and torch.cuda.is_bf16_supported(),
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
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
        for noisy in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(noisy)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        _sync(device)
        clock.marks.append(time.perf_counter())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    per_step = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    timed = per_step[1:] or per_step  # the first step compiles kernels and fills caches
    step_s = statistics.median(timed)
    length = statistics.median(clock.lengths) if clock.lengths else float(completion)
    del trainer, model
    _free(device)
    return {
        "steps": len(per_step),
        "step_s": step_s,
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
        compute, before = 0.0, 0.0
        for m in recs:
            compute += m.compute_s - before if m.compute_s >= before else m.compute_s
            before = m.compute_s
        result = _read(run, layout.result_key(rank), layout.ResultRecord) if run else None
        out.append({"rank": rank, "rounds": len(recs), "compute_s": compute,
                    "sync_per_round_s": [m.sync_s for m in recs],
                    "bytes_up_per_round": [m.bytes_up for m in recs],
                    "ckpt_s": result.ckpt_s if result else None})  # fmt: skip
    return out


def _keep_logs(store: str, out: str) -> None:
    """Copy the run's small files (logs, round records, results) to ``out``/crf-run, one
    folder deep (``metrics/0/1.json`` as ``metrics-0-1.json``): what a cut or failed run
    leaves to read once its temporary store is gone."""
    import glob
    import shutil

    dest = os.path.join(out, "crf-run")
    os.makedirs(dest, exist_ok=True)
    for pattern in ("logs/*.log", "metrics/*/*.json", "results/*.json", "result.json",
                    "replicas/*/state.json"):  # fmt: skip
        for path in glob.glob(os.path.join(store, "*", pattern)):
            rel = os.path.relpath(path, store).split(os.sep, 1)[1]
            shutil.copy(path, os.path.join(dest, rel.replace(os.sep, "-")))


def bench_crf(
    folder: str,
    prompts: int,
    completion: int,
    sync_every: int,
    rounds: int,
    timeout: float,
    out: str,
    checkpoint_every: int = 1,
) -> dict:
    """2 local replicas under crf (exchange and checkpoints through a file store). The
    replicas' phases and steps are printed as they change, and the run is cancelled after
    ``timeout`` seconds; what the rounds that committed by then measured is kept either way
    (the round records, and the logs under ``out``/crf-run)."""
    import crf

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
                        "job_config": {
                            "prompts_per_step": prompts,
                            "max_completion_length": completion,
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
        _keep_logs(store, out)
    for r in reps:
        r["sync_s"] = sync = sum(r["sync_per_round_s"])
        r["crf_share"] = sync / (sync + r["compute_s"]) if sync + r["compute_s"] else None
    done = min(r["rounds"] for r in reps)
    if not done:
        raise RuntimeError(error or "no round committed")
    ups = [b for r in reps for b in r["bytes_up_per_round"]]
    return {
        "replicas": reps,
        "sync_every": sync_every,
        "rounds": rounds,
        "rounds_committed": done,
        "rollouts_per_step": prompts * 8,
        "completion": completion,
        "step_s": sum(r["compute_s"] for r in reps) / (sync_every * sum(r["rounds"] for r in reps)),
        "weights_identical": result.weights_identical if result and result.ok else None,
        "checkpoint_every": checkpoint_every,
        "bytes_up_per_replica_round": statistics.median(ups),
        "wall_s": wall,
        "timeline": timeline.events,
        "error": error,
    }


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


def table(res: dict[str, Any]) -> str:
    """The markdown table of a result (what goes into docs/performance.md)."""
    env = res["environment"]
    lines = [
        f"Measured by `python3 bench/gpu.py` on {env.get('gpu') or 'a CPU'} "
        f"({env['cpus']} CPU cores; Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, trl {env['trl']}), on a random model of "
        f"Qwen2.5-0.5B's shape ({res.get('parameters', 0) / 1e6:.0f}M parameters"
        f"{', the --tiny shape' if res.get('tiny') else ''}).",
        "",
        "| measure | value |",
        "|---|---:|",
    ]
    for g in res.get("generate", []):
        if "tokens_per_s" in g:
            lines.append(
                f"| {g['engine']}, batch {g['batch']}, bf16, greedy: generated tokens/s | "
                f"{g['tokens_per_s']:,.0f} |"
            )
        else:
            lines.append(f"| {g['engine']}: generated tokens/s | {g['note']} |")
    grpo = res.get("grpo")
    if grpo:
        what = f"{grpo['rollouts_per_step']} rollouts of ≤ {res['completion']} tokens"
        lines += [
            f"| GRPO optimizer step ({what}), s | {grpo['step_s']:.2f} |",
            f"| generated tokens/s inside the GRPO step | {grpo['tokens_per_s_in_step']:,.0f} |",
            "| peak GPU memory of one replica (fp32 weights, AdamW, bf16 autocast), GiB | "
            + (f"{grpo['peak_memory_gib']:.1f} |" if grpo["peak_memory_gib"] else "— |"),
        ]
    run = res.get("crf")
    if run:
        shares = [r["crf_share"] for r in run["replicas"] if r["crf_share"] is not None]
        syncs = [r["sync_s"] for r in run["replicas"]]
        done = run.get("rounds_committed", run["rounds"])
        rounds = f"{done} of {run['rounds']} rounds" if done < run["rounds"] else (
            f"{run['rounds']} rounds")  # fmt: skip
        k = run.get("checkpoint_every", 1)
        ckpt = "a global checkpoint every round" if k == 1 else (
            f"a global checkpoint every {k} rounds and at the last")  # fmt: skip
        lines += [
            f"| crf's share of wall time (sync + checkpoint) at H = {run['sync_every']}, "
            f"2 replicas sharing the GPU, {rounds}, {ckpt}, {run['rollouts_per_step']} "
            f"rollouts of ≤ {run['completion']} tokens per step | "
            + ", ".join(f"{s:.1%}" for s in shares)
            + " |",
            "| time training waited for crf per replica and round, s | "
            + ", ".join(f"{s / max(1, done):.1f}" for s in syncs)
            + " |",
        ]
        ckpts = [r["ckpt_s"] for r in run["replicas"] if r.get("ckpt_s") is not None]
        if ckpts:
            told = ", ".join(f"{s:.1f}" for s in ckpts)
            what = "a replica's background checkpoint writes (global and inner state), s in all"
            lines.append(f"| {what} | {told} |")
        if run.get("step_s"):
            lines.append(f"| a replica's optimizer step in that run (the GPU shared by 2), s | "
                         f"{run['step_s']:.2f} |")  # fmt: skip
        start = next((e["t_s"] for e in run.get("timeline", []) if e["phase"] == "training"), None)
        if start is not None:
            lines.append(f"| launch to the first replica training (start-up, model load), s | "
                         f"{start:.0f} |")  # fmt: skip
        if grpo and done:
            per_round = statistics.mean(syncs) / done
            train = run["sync_every"] * grpo["step_s"]
            lines.append(
                f"| the same wait against H = {run['sync_every']} steps of the GRPO phase's size "
                f"({run['sync_every']} x {grpo['step_s']:.2f} s), derived | "
                f"{per_round / (per_round + train):.1%} |"
            )
        if run.get("weights_identical") is not None:
            lines.append(f"| replicas end bit-identical | {run['weights_identical']} |")
        if run.get("error"):
            lines.append(f"| crf run | {run['error']} |")
    for phase, err in res.get("errors", {}).items():
        lines.append(f"| {phase} | failed: {err} |")
    return "\n".join(lines) + "\n"


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="gpu-out", help="folder for gpu.json and gpu.md")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: a quick CPU check")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (x 8 generations)")
    p.add_argument("--completion", type=int, default=128, help="max completion tokens")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps of the grpo phase")
    p.add_argument("--run-prompts", type=int, default=1, help="prompts per step, crf phase")
    p.add_argument("--run-completion", type=int, default=8, help="max completion, crf phase")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds the crf phase may take")
    p.add_argument("--sync-every", type=int, default=50, help="H of the crf phase")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the crf phase")
    p.add_argument("--checkpoint-every", type=int, default=1, help="the crf phase's "
                   "--checkpoint-every (the last round is always checkpointed)")  # fmt: skip
    p.add_argument("--phases", default="generate,grpo,crf", help="which phases, in order")
    p.add_argument("--update-docs", action="store_true", help="write the table into "
                   "docs/performance.md")  # fmt: skip
    a = p.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = Shape.tiny() if a.tiny else Shape()
    os.makedirs(a.out, exist_ok=True)
    res: dict[str, Any] = {"environment": environment(), "tiny": a.tiny,
                           "completion": a.completion, "errors": {}}  # fmt: skip

    def save() -> None:
        with open(os.path.join(a.out, "gpu.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "gpu.md"), "w") as f:
            f.write(table(res))

    print(json.dumps(res["environment"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="crf-gpu-model-") as folder:
        t0 = time.perf_counter()
        res["parameters"] = build_model(folder, shape)
        print(f"model: {res['parameters'] / 1e6:.0f}M parameters, built and saved in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        phases = {
            "generate": lambda: [
                *bench_generate(folder, device, 256 if not a.tiny else 16, [16, 64]),
                vllm_row(),
            ],  # fmt: skip
            "grpo": lambda: bench_grpo(folder, device, a.prompts, a.completion, a.steps),
            "crf": lambda: bench_crf(
                folder,
                a.run_prompts,
                a.run_completion,
                a.sync_every,
                a.rounds,
                a.run_timeout,
                a.out,
                a.checkpoint_every,
            ),
        }
        for name in a.phases.split(","):
            t0 = time.perf_counter()
            print(f"phase {name} ...", flush=True)
            try:
                res[name] = phases[name]()
            except Exception as e:  # one failed phase must not lose the others' numbers
                res["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"phase {name}: {time.perf_counter() - t0:.0f} s "
                  f"{res['errors'].get(name, 'ok')}", flush=True)  # fmt: skip
            save()
    print(table(res), flush=True)
    if a.update_docs:
        update_docs(table(res), os.path.join(DOCS, "performance.md"))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
