"""Make what the sft-then-grpo example trains, offline: an arithmetic dataset and a base model.

- ``DIR/data/train.jsonl`` and ``DIR/data/test.jsonl``: problems ``"17+52="`` with the
  completion ``"69"`` (for the sft job) and the answer ``"69"`` (for the rewards): every sum
  of two numbers below ``--limit`` whose digits add up without a carry (so an answer's
  digits follow from the operands' digits one by one: a held-out sum is made of digit sums
  the training rows teach), a random tenth held out as the test split (a folder of split
  files is a dataset with splits: ``--dataset DIR/data --eval-split test``).
- ``DIR/base/``: a Qwen2 causal LM scaled down (``--hidden``, ``--layers``), random
  initialisation, with a tokenizer of one token per character, saved with
  ``save_pretrained``: what ``--model DIR/base`` loads, as it would load a Hub model.

Usage (from the repository root)::

    python examples/sft-then-grpo/make_data.py examples/sft-then-grpo/work
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems(limit: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, test) rows: every ``a+b`` with ``a, b < limit`` and no carry, a tenth held
    out."""
    rows = [
        {"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)}
        for a in range(limit)
        for b in range(limit)
        if not _carries(a, b)
    ]
    random.Random(seed).shuffle(rows)
    cut = len(rows) // 10
    return rows[cut:], rows[:cut]


def _carries(a: int, b: int) -> bool:
    while a or b:
        if a % 10 + b % 10 > 9:
            return True
        a, b = a // 10, b // 10
    return False


def base_model(folder: Path, hidden: int, layers: int, seed: int) -> int:
    """A random Qwen2 over the problems' characters saved in ``folder``; its parameters."""
    from crf.composer import char_tokenizer, save_tiny, tiny_qwen2

    tokenizer = char_tokenizer("0123456789+=")
    model = tiny_qwen2(
        tokenizer, seed=seed, hidden_size=hidden, num_layers=layers, num_heads=4,
        intermediate_size=4 * hidden, max_position_embeddings=64,
    )  # fmt: skip
    save_tiny(model, tokenizer, str(folder))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="where data/ and base/ go")
    p.add_argument("--limit", type=int, default=100, help="operands are below this")
    p.add_argument("--hidden", type=int, default=64, help="the model's hidden size")
    p.add_argument("--layers", type=int, default=2, help="the model's layers")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    train, test = problems(a.limit, a.seed)
    (a.dir / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(a.dir / "data" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    n = base_model(a.dir / "base", a.hidden, a.layers, a.seed)
    print(f"{a.dir}/data: {len(train)} train, {len(test)} test rows; "
          f"{a.dir}/base: Qwen2, {n / 1e6:.2f}M parameters, random weights")  # fmt: skip


if __name__ == "__main__":
    main()
