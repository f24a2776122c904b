"""Bring your own model, dataset and reward to the composer trainer, as a crf replica.

    # one replica per process, DiLoCo across them (crf sets CRF_RUN_URI/CRF_RANK/...):
    crf launch -n 4 --entrypoint "python examples/composer_custom.py --model ./my-model"
    # standalone (CRF_RUN_URI unset): plain training in this process, no DiLoCo
    python examples/composer_custom.py --model ./my-model --max-steps 50

``--model`` is any causal LM folder or Hub id ``from_pretrained`` can load (``--tiny`` builds
a tiny Qwen2 with a character tokenizer in code instead, for a quick offline try). The
dataset has a ``prompt`` (what GRPO samples from), a ``hint`` (channel 2: the teacher is the
policy that also sees the hint), a ``trace`` (channel 3: a correct completion, replayed
against the policy's own rollouts) and any columns the reward function wants (``target``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

HINT_TEMPLATE = "hint {hint}; {prompt}"


def build_dataset(n: int, seed: int) -> list[dict[str, Any]]:
    """Your data: here, single-digit addition with the answer as hint and trace."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        answer = str(a + b)
        rows.append({"prompt": f"{a}+{b}=", "target": answer, "hint": answer, "trace": answer})
    return rows


def addition_reward(completions: list[str], target: list[str], **_: Any) -> list[float]:
    """Your verifiable reward: 1 for the exact sum, 0.5 for the right first digit, else 0."""
    out = []
    for completion, answer in zip(completions, target, strict=True):
        text = completion.strip()
        out.append(1.0 if text == answer else 0.5 if text[:1] == answer[:1] else 0.0)
    return out


def example_alphabet() -> str:
    """Every character the example's prompts, hints and template use (for --tiny)."""
    return "0123456789+=;" + "hint "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="causal LM folder or Hub id")
    p.add_argument("--tiny", action="store_true", help="train a tiny Qwen2 built in code")
    p.add_argument("--max-steps", type=int, default=50, help="standalone: optimizer steps")
    p.add_argument("--output-dir", default="composer-custom-out")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--examples", type=int, default=512)
    p.add_argument("--distill-alpha", type=float, default=0.1)
    p.add_argument("--replay-beta", type=float, default=1.0)
    p.add_argument("--replay-loss", default="simpo", choices=["dpo", "simpo"])
    p.add_argument("--distill-wrapper", default="none", choices=["none", "taid", "entropy_opd"])
    args = p.parse_args(argv)
    if not args.model and not args.tiny:
        p.error("give --model PATH_OR_ID, or --tiny to build a tiny model in code")
    return args


def train(args: argparse.Namespace, ctx: Any | None) -> dict[str, Any]:
    """Build the trainer and train; with ``ctx`` as one DiLoCo replica of a crf run."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from crf.composer import ComposerConfig, ComposerReplicationTrainer, DiLoCoCallback

    model_path = args.model
    if args.tiny:  # same seed on every replica -> identical initial weights
        import tempfile

        from crf.composer import char_tokenizer, save_tiny, tiny_qwen2

        tok = char_tokenizer(example_alphabet())
        seed = ctx.seed if ctx is not None else 0
        model_path = save_tiny(tiny_qwen2(tok, seed=seed), tok, tempfile.mkdtemp(prefix="tiny-"))

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Loaded weights are identical on every replica, as DiLoCo requires.
    model = AutoModelForCausalLM.from_pretrained(model_path)

    rows = build_dataset(args.examples, seed=0)
    if ctx is not None:  # each replica its own shard and order
        rows = rows[ctx.rank :: ctx.world_size]
        random.Random(ctx.data_seed).shuffle(rows)
    max_steps = ctx.total_steps if ctx is not None else args.max_steps

    config = ComposerConfig(
        output_dir=args.output_dir,
        max_steps=max_steps,
        seed=ctx.data_seed if ctx is not None else 0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=4,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        distill_alpha=args.distill_alpha,
        distill_wrapper=args.distill_wrapper,
        taid_schedule="adaptive" if args.distill_wrapper == "taid" else None,
        distill_hint_template=HINT_TEMPLATE,
        replay_beta=args.replay_beta,
        replay_loss=args.replay_loss,
        replay_reward_threshold=1.0,
    )
    callback = DiLoCoCallback(ctx)  # ctx=None: no DiLoCo, just the per-step history
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        callback.close()
    rewards = [h["reward"] for h in callback.history if "reward" in h]
    quarter = max(1, len(rewards) // 4)
    return {
        "steps": len(callback.history),
        "reward_first_quarter": sum(rewards[:quarter]) / quarter if rewards else None,
        "reward_last_quarter": sum(rewards[-quarter:]) / quarter if rewards else None,
        "final_loss": callback.history[-1]["loss"] if callback.history else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if os.environ.get("CRF_RUN_URI"):
        from crf.replica.context import ReplicaContext

        with ReplicaContext.from_env() as ctx:  # records a failure if training raises
            metrics = train(args, ctx)
            ctx.finish(metrics)
    else:
        metrics = train(args, None)
    print(json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
