"""The ``lm`` job: a tiny causal language model trained on generated text (or ``--model``,
loaded by crf/replica/model.py, on the same text through its own tokenizer).

Everything is built in code (no downloads): a character vocabulary, a small Llama from a
``transformers`` config, and a corpus produced by a seeded toy grammar, so the loss has
structure to learn and falls quickly on a CPU. Every replica builds identical initial weights
from ``ctx.seed``; each trains on its own contiguous shard of the corpus, and the batch for
inner step ``i`` is a pure function of (rank, i), so a restarted replica never retrains data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

#: trains data-parallel across a replica's local ranks (--procs-per-replica): the forward and
#: backward run under ``ctx.data_parallel`` (DDP), each local rank on ``ctx.local_part`` of
#: the replica's batch
LOCAL_RANKS = True

_SUBJECTS = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "a small bird",
    "the robot",
    "our teacher",
    "the red fox",
    "a tired child",
    "the farmer",
]
_VERBS = ["sees", "likes", "chases", "finds", "paints", "helps", "follows", "hears"]
_OBJECTS = [
    "the ball",
    "a green apple",
    "the river",
    "two stones",
    "the moon",
    "a blue box",
    "the garden",
    "some bread",
    "the tall tree",
    "a paper boat",
]
_PLACES = ["at home", "in the park", "by the sea", "after lunch", "every day", "at night"]


def generate_corpus(n_sentences: int, seed: int) -> str:
    """Sentences from a small grammar: learnable structure, deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_PLACES)}"
        out.append(s + ".")
    return " ".join(out) + " "


def vocabulary() -> list[str]:
    chars = set(" .")
    for words in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES):
        for w in words:
            chars.update(w)
    return sorted(chars)


@dataclass
class Config:
    """Knobs of the lm job (``crf launch --job lm --set key=value``)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    corpus_sentences: int = 20000
    eval_batches: int = 4

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "seq_len",
            "batch_size",
            "corpus_sentences",
            "eval_batches",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"lm option {name} must be >= 1 (got {getattr(self, name)})")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"lm option hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads})"
            )
        if not self.lr > 0:
            raise ValueError(f"lm option lr must be > 0 (got {self.lr})")


def replica_batch(cfg: Config, spec: Any = None) -> int:
    """The rows of one inner step, all local ranks together (checked before launch)."""
    return cfg.batch_size


def char_tokenizer(itos: list[str]) -> Any:
    """The job's character vocabulary as a ``transformers`` fast tokenizer (token ``i`` is
    ``itos[i]``, as in training), saved beside the exported model so it can be used; a
    character outside the vocabulary reads as a space."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(itos)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=" ")


def build_model(cfg: Config, vocab_size: int, seed: int) -> Any:
    """A tiny Llama; the same seed gives bit-identical weights on every replica."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    mcfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 2,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(mcfg)


class CorpusShard:
    """Token ids of this rank's contiguous shard, plus a held-out eval set shared by all."""

    def __init__(
        self, cfg: Config, rank: int, world_size: int, seed: int, tokenizer: Any = None
    ) -> None:
        import torch

        self.cfg = cfg
        self.itos = vocabulary()
        self.tokenizer = tokenizer  # the model's own (``--model``), else None: characters
        stoi = {c: i for i, c in enumerate(self.itos)}

        def encode(text: str) -> list[int]:  # characters, or the model's own tokenizer
            if tokenizer is None:
                return [stoi[c] for c in text]
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        text = generate_corpus(cfg.corpus_sentences, seed)
        ids = torch.tensor(encode(text), dtype=torch.long)
        per = len(ids) // world_size
        self.ids = ids[rank * per : (rank + 1) * per]
        if len(self.ids) <= cfg.seq_len + 1:
            raise ValueError(
                f"corpus shard too small for seq_len={cfg.seq_len}: raise corpus_sentences"
            )
        eval_text = generate_corpus(max(200, cfg.eval_batches * cfg.batch_size), seed + 7919)
        self.eval_ids = torch.tensor(encode(eval_text), dtype=torch.long)

    def batch(self, step: int, data_seed: int) -> Any:
        """Batch for inner step ``step``: a pure function of (data_seed, step)."""
        import torch

        g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
        hi = len(self.ids) - self.cfg.seq_len - 1
        starts = torch.randint(0, hi, (self.cfg.batch_size,), generator=g)
        return torch.stack([self.ids[s : s + self.cfg.seq_len + 1] for s in starts.tolist()])

    def eval_batches(self) -> list[Any]:
        import torch

        n, L = self.cfg.batch_size, self.cfg.seq_len + 1
        rows = [self.eval_ids[i * L : (i + 1) * L] for i in range(len(self.eval_ids) // L)]
        rows = rows[: n * self.cfg.eval_batches]
        return [torch.stack(rows[i : i + n]) for i in range(0, len(rows), n)]


def evaluate(model: Any, data: CorpusShard, placement: Any = None) -> float:
    import contextlib

    import torch

    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad(), placement.autocast() if placement else contextlib.nullcontext():
        losses = [
            float(model(input_ids=b.to(device), labels=b.to(device)).loss)
            for b in data.eval_batches()
        ]
    model.train()
    return sum(losses) / len(losses)


def build(ctx: Any, cfg: Config, placement: Any) -> tuple[Any, CorpusShard]:
    """(model, data): the tiny Llama over characters, or ``--model`` (from_pretrained, its
    own tokenizer encoding the corpus), on the chosen device."""
    if getattr(ctx.spec, "model", None):
        from crf.replica.model import load_pretrained

        model, tokenizer = load_pretrained(ctx.spec, placement, seed=int(ctx.seed))
        return model, CorpusShard(cfg, ctx.rank, ctx.world_size, ctx.seed, tokenizer)
    data = CorpusShard(cfg, ctx.rank, ctx.world_size, ctx.seed)
    model = build_model(cfg, len(data.itos), ctx.seed).to(placement.device)
    model.train()
    return model, data


def run(ctx: Any, cfg: Config) -> dict[str, Any]:
    """Train ``ctx.total_steps`` inner steps under DiLoCo; report eval loss before/after.
    bf16/fp16 train under autocast (fp16 with a gradient scaler: a step it skips for
    overflow is retried on the same batch, so the step count stays exact)."""
    import torch

    from crf.replica.model import Placement

    placement = Placement.for_spec(ctx.spec)
    model, data = build(ctx, cfg, placement)
    eval0 = evaluate(model, data, placement)
    # DDP over the local ranks, or FSDP2 sharding the model in place (model itself with one)
    parallel = ctx.data_parallel(model)
    trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP's shards, if so
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler(placement.device, enabled=placement.dtype == "fp16")
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:  # ctx.step jumps ahead if this replica heals
            step = ctx.step
            batch = ctx.local_part(data.batch(step, ctx.data_seed)).to(placement.device)
            with placement.autocast():
                loss = parallel(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if ctx.step != step:  # the optimizer stepped (fp16 may skip one)
                # an outer round just ended: its global model's eval loss, for the figure
                at_end = ctx.step % ctx.spec.sync_every == 0
                extra = {"eval_loss": evaluate(model, data, placement)} if at_end else {}
                ctx.log_step(loss=loss.item(), **extra)
    eval1 = evaluate(model, data, placement)
    ctx.save_model_at_end(model, data.tokenizer or char_tokenizer(data.itos))
    return {
        "eval_loss_initial": eval0,
        "eval_loss_final": eval1,
        "eval_ppl_final": math.exp(min(eval1, 50.0)),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in trainable),
    }
