"""The ``composer`` job: the composer trainer (GRPO + hint distillation + trace replay) on a
tiny model and an embedded task, as one DiLoCo replica.

Everything is built in code, nothing is downloaded: a character-level tokenizer, a tiny Qwen2
from a ``Qwen2Config`` and the string-reversal task of ``crf.composer.task`` (prompt
``"abc="``, answer ``"cba"``, partial-credit reward), whose hints (channel 2) and correct
traces (channel 3) are generated with the prompts.

- Every replica builds bit-identical initial weights from ``ctx.seed`` (DiLoCo needs that).
- The example pool is generated from ``ctx.seed`` (the same on every replica); replica
  ``rank`` trains on ``pool[rank::world_size]``, in an order and with sampling noise drawn
  from ``ctx.data_seed`` (the trainer's seed).
- The trainer's own optimizer is DiLoCo's inner optimizer: ``DiLoCoCallback`` enters
  ``ctx.diloco(model, optimizer)`` at ``on_train_begin`` and calls ``ctx.log_step(loss=...,
  reward=..., grpo_loss=..., distill_loss=..., replay_loss=...)`` once per optimizer step.
- It trains exactly ``ctx.total_steps`` optimizer steps (``max_steps``).
- With ``--model`` (a Hub id or a folder) the model and its tokenizer come from
  ``from_pretrained`` instead (crf/replica/model.py); the task stays the string reversal,
  its prompts given as a one-message conversation when the tokenizer has a chat template
  (TRL then applies the template). The tiny-model knobs (hidden_size...) are then unused.
- Device and precision (``--device``, ``--precision``) set the trainer's ``use_cpu`` /
  ``bf16`` / ``fp16``, for the tiny model too.
- ``--report-to`` is handed to TRL (``report_to``, ``run_name`` = ``<run id>-r<rank>``):
  transformers' own callbacks log every step (crf/replica/tracking.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

from crf.composer.names import DISTILL_WRAPPERS, REPLAY_LOSSES, TAID_SCHEDULES
from crf.replica import local_ranks
from crf.replica.evaluation import as_text
from crf.replica.export import finish_trained
from crf.rollouts.config import RolloutConfig
from crf.spec import coerce_text

#: trains across a replica's local ranks (--procs-per-replica): TRL's trainer runs on each,
#: with its share of the replica's rollouts (crf.replica.local_ranks.trainer_args)
LOCAL_RANKS = True


def replica_batch(cfg: Config, spec: Any = None) -> int:
    """The rollouts of one inner step, all local ranks together (checked before launch):
    prompts_per_step x the generations the trainer settings resolve to for ``spec``."""
    generations = cfg.trainer_fields(spec).get("num_generations")
    return cfg.prompts_per_step * (generations or _grpo_default("num_generations"))


#: the trainer knobs' types (their defaults are None: see Config)
_KNOB_TYPES: dict[str, Any] = {
    "learning_rate": 0.0,
    "num_generations": 0,
    "max_completion_length": 0,
    "temperature": 0.0,
    "grpo_beta": 0.0,
}


@dataclass
class Config:
    """Knobs of the composer job (``crf launch --job composer --set key=value``): the embedded
    task's, the trainer's (None: the toy's value, or TRL's default with ``--model``; see
    crf/replica/trl_settings.py), crf's composer-loss knobs, and ``trl``: any other field of
    TRL's ``GRPOConfig`` (``--set trl.top_p=0.9``, a ``[job.trl]`` table)."""

    # task (the embedded string reversal; unused with --dataset): reverse strings of
    # min_len..max_len characters over `letters`, and the tiny Qwen2 (unused with --model)
    letters: str = "abcd"
    min_len: int = 2
    max_len: int = 3
    num_examples: int = 2048  # the pool all replicas share out
    # held-out pass@1: a row passes when its weighted total reward reaches this
    pass_threshold: float = 1.0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    # trainer (GRPOConfig fields; None: the toy's value, or GRPOConfig's default with --model)
    learning_rate: float | None = None
    num_generations: int | None = None
    # tokens per rollout; 0 or unset: the default (toy: max_len + 2; GRPOConfig's with --model)
    max_completion_length: int | None = None
    temperature: float | None = None
    grpo_beta: float | None = None  # KL-to-reference weight of the GRPO term (TRL's `beta`)
    prompts_per_step: int = 8  # x num_generations completions per optimizer step
    # let SDPA use cuDNN's attention while generating on CUDA (off: it builds a plan on the
    # CPU for each new sequence length; crf/composer/generation.py)
    generation_cudnn_attention: bool = False
    # decode with a static KV cache whose decoding step transformers compiles on CUDA, the
    # cache in buckets of 256 tokens so one compilation serves the run's steps (TRL's generate
    # path only; crf/composer/generation.py). None ("auto"): on for --model where it can run
    # (CUDA, TRL's generate path, a model transformers compiles whole, a C compiler), off
    # for the toy
    generation_compile: bool | None = None
    # channel 2: distillation from the policy conditioned on the hint
    distill_alpha: float = 0.1
    distill_jsd_beta: float = 0.5
    distill_temperature: float = 1.0
    distill_clip: float = 0.0  # 0 = no clip
    distill_wrapper: str = "none"
    taid_t: float = -1.0  # < 0 = unset
    taid_schedule: str = ""  # "", "linear" or "adaptive"
    # channel 3: replay of correct traces against the policy's own wrong rollouts
    replay_beta: float = 1.0
    replay_loss: str = "simpo"
    # a rollout whose weighted total reward reaches this is not "rejected" (the default: an
    # exact answer of the built-in rewards, whose best is 1.0)
    replay_reward_threshold: float = 1.0
    dpo_beta: float = 0.1
    simpo_beta: float = 2.0
    simpo_gamma: float = 0.5
    # any other GRPOConfig field, by its name (checked against GRPOConfig before launch)
    trl: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Trainer knobs given as text (``--set``) take their type; 0 completion tokens
        also means "the default"."""
        for name, like in _KNOB_TYPES.items():
            setattr(self, name, coerce_text(getattr(self, name), like, f"job option {name}"))
        self.generation_compile = _on_off_auto(self.generation_compile, "generation_compile")
        if self.max_completion_length == 0:
            self.max_completion_length = None
        if not isinstance(self.trl, dict):
            raise ValueError(f"composer option trl must be a table of GRPOConfig fields "
                             f"(got {self.trl!r})")  # fmt: skip

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"composer option {msg}")

        need(
            len(self.letters) >= 2 and len(set(self.letters)) == len(self.letters),
            f"letters must be >= 2 distinct characters (got {self.letters!r})",
        )
        need(not set(self.letters) & set("=|"), "letters must not contain '=' or '|'")
        need(
            1 <= self.min_len <= self.max_len,
            f"min_len/max_len must satisfy 1 <= min_len <= max_len (got {self.min_len}, "
            f"{self.max_len})",
        )
        for name in (
            "num_examples",
            "hidden_size",
            "num_layers",
            "num_heads",
            "prompts_per_step",
        ):
            need(getattr(self, name) >= 1, f"{name} must be >= 1 (got {getattr(self, name)})")
        need(
            self.hidden_size % self.num_heads == 0,
            f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})",
        )
        self._validate_trainer(need)
        for name in ("pass_threshold", "replay_reward_threshold"):
            need(math.isfinite(getattr(self, name)), f"{name} must be a finite number")
        for name in ("distill_alpha", "replay_beta", "distill_clip"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0 (got {getattr(self, name)})")
        need(
            self.distill_wrapper in DISTILL_WRAPPERS,
            f"distill_wrapper {self.distill_wrapper!r} is unknown; choose one of "
            f"{', '.join(DISTILL_WRAPPERS)}",
        )
        need(
            self.replay_loss in REPLAY_LOSSES,
            f"replay_loss {self.replay_loss!r} is unknown; choose one of "
            f"{', '.join(REPLAY_LOSSES)}",
        )
        need(
            self.taid_schedule in ("", *TAID_SCHEDULES),
            f"taid_schedule {self.taid_schedule!r} is unknown; choose '' or one of "
            f"{', '.join(TAID_SCHEDULES)}",
        )
        need(
            0.0 <= self.distill_jsd_beta <= 1.0,
            f"distill_jsd_beta must be in [0, 1] (got {self.distill_jsd_beta})",
        )
        for name in ("distill_temperature", "dpo_beta", "simpo_beta"):
            need(getattr(self, name) > 0, f"{name} must be > 0 (got {getattr(self, name)})")
        need(self.simpo_gamma >= 0, f"simpo_gamma must be >= 0 (got {self.simpo_gamma})")
        need(self.taid_t < 0 or self.taid_t <= 1, f"taid_t must be in [0, 1] (got {self.taid_t})")
        if self.distill_wrapper == "taid":
            need(
                (self.taid_t >= 0) != bool(self.taid_schedule),
                "distill_wrapper=taid needs exactly one of taid_t (in [0, 1]) or taid_schedule",
            )
        else:
            need(
                self.taid_t < 0 and not self.taid_schedule,
                "taid_t/taid_schedule are only valid with distill_wrapper=taid",
            )

    def _validate_trainer(self, need: Any) -> None:
        """The trainer knobs that are set, in range; ``trl.<field>`` names against TRL's
        GRPOConfig and their text as its types (TRL is imported only when there are any)."""
        for name, low in (("num_generations", 2), ("max_completion_length", 1)):
            value = getattr(self, name)
            need(value is None or value >= low, f"{name} must be >= {low} (got {value})")
        for name in ("learning_rate", "temperature"):
            value = getattr(self, name)
            need(value is None or value > 0, f"{name} must be > 0 (got {value})")
        need(self.grpo_beta is None or self.grpo_beta >= 0,
             f"grpo_beta must be >= 0 (got {self.grpo_beta})")  # fmt: skip
        if self.trl:
            from crf.replica import trl_settings

            trl_settings.check_names(self.trl, dataclasses.asdict(self))
            self.trl = trl_settings.coerce(self.trl)

    # ------------------------------------------------------------------ derived
    def trainer_fields(self, spec: Any) -> dict[str, Any]:
        """The GRPOConfig fields this job sets from its trainer knobs and ``trl`` for run
        options ``spec`` (the toy's values, or TRL's defaults with --model)."""
        from crf.replica import trl_settings

        return trl_settings.resolve(
            dataclasses.asdict(self),
            self.trl,
            model=bool(getattr(spec, "model", None)),
            lora=int(getattr(spec, "lora_rank", 0) or 0) > 0,
            toy_completion=self.max_len + 2,
        )

    def composer_kwargs(self, spec: Any = None) -> dict[str, Any]:
        """The ComposerConfig fields this job sets from its composer-loss knobs (and its
        generation's: compiled decoding unset means off for the toy model, which it does
        not pay for, and the trainer's choice for ``--model``)."""
        compiled = self.generation_compile
        if compiled is None and not getattr(spec, "model", None):
            compiled = False
        kw: dict[str, Any] = dict(
            distill_alpha=self.distill_alpha,
            distill_jsd_beta=self.distill_jsd_beta,
            distill_temperature=self.distill_temperature,
            distill_clip=self.distill_clip or None,
            distill_wrapper=self.distill_wrapper,
            replay_beta=self.replay_beta,
            replay_loss=self.replay_loss,
            replay_reward_threshold=self.replay_reward_threshold,
            dpo_beta=self.dpo_beta,
            simpo_beta=self.simpo_beta,
            simpo_gamma=self.simpo_gamma,
            generation_cudnn_attention=self.generation_cudnn_attention,
            generation_compile=compiled,
        )
        if self.distill_wrapper == "taid":
            if self.taid_schedule:
                kw["taid_schedule"] = self.taid_schedule
            else:
                kw["taid_t"] = self.taid_t
        return kw


def _on_off_auto(value: Any, name: str) -> bool | None:
    """A knob that is true, false or unset ("auto": None), from a value or ``--set`` text;
    ValueError naming it otherwise."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("auto", "none", ""):
        return None
    try:
        if isinstance(value, str):
            return coerce_text(value, False, f"job option {name}")
    except ValueError:
        pass
    raise ValueError(f"job option {name}={value!r} is not true, false or auto")


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(history: list[dict[str, float]], sync_every: int) -> dict[str, Any]:
    """Per-round means of the step history, and first-vs-last-round job metrics."""
    sync_every = max(1, sync_every)
    rounds = [history[i : i + sync_every] for i in range(0, len(history), sync_every)]
    per_round = []
    for r, steps in enumerate(rounds):
        entry: dict[str, Any] = {"round": r}
        for key in ("loss", "reward", "grpo_loss", "distill_loss", "replay_loss"):
            entry[key] = _mean([s[key] for s in steps if key in s])
        per_round.append(entry)
    out: dict[str, Any] = {"steps": len(history), "rounds": per_round}
    if per_round:
        out["reward_first_round"] = per_round[0]["reward"]
        out["reward_last_round"] = per_round[-1]["reward"]
        for key in ("loss", "grpo_loss", "distill_loss", "replay_loss"):
            out[f"{key}_last_round"] = per_round[-1][key]
    return out


def greedy_exact_match(
    model: Any, tokenizer: Any, examples: list[dict[str, Any]], max_new: int
) -> float | None:
    """Fraction of prompts whose greedy completion is exactly the answer (None: no prompts,
    as with a user's --dataset)."""
    import torch

    if not examples:
        return None

    was_training = model.training
    model.eval()
    prompts = [as_text(tokenizer, e["prompt"]) for e in examples]
    # a chat template writes the special tokens itself
    plain = isinstance(examples[0]["prompt"], str)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=plain)
    enc = enc.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t == e["answer"] for t, e in zip(texts, examples, strict=True)) / len(examples)


@dataclass
class ReplicaSetup:
    """What one replica trains: tokenizer, model (seeded by ``ctx.seed``), its data shard
    (ordered by ``ctx.data_seed``), the embedded task's held-out prompts (exact match), the
    run's held-out rows (every replica the same list; it scores its share) and where it
    trains."""

    tokenizer: Any
    model: Any
    shard: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    placement: Any = None
    eval_rows: list[dict[str, Any]] | None = None
    #: text prompts were sent as conversations (the model's chat template): the rewards
    #: take them back as text (:meth:`rewards_for`)
    plain_as_chat: bool = False

    def rewards_for(self, rewards: dict[str, Any]) -> dict[str, Any]:
        """A job's rewards (``job_rewards``) as they are called on these rows: with prompts
        and completions in the form of the dataset's prompts, as TRL would call them."""
        if not self.plain_as_chat:
            return rewards
        from crf.replica.rewards import in_dataset_forms

        return in_dataset_forms(rewards)


def _tiny(ctx: Any, cfg: Config) -> tuple[Any, Any]:
    from crf.composer import char_tokenizer, tiny_qwen2
    from crf.composer.task import task_alphabet

    tokenizer = char_tokenizer(task_alphabet(cfg.letters))
    model = tiny_qwen2(
        tokenizer,
        seed=int(ctx.seed),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        max_position_embeddings=4 * (cfg.max_len + 2) + 8,
    )
    return model, tokenizer


def _tiny_for_data(ctx: Any, cfg: Config, eval_rows: list[dict[str, Any]]) -> tuple[Any, Any]:
    """The embedded model for a user's ``--dataset``: its character tokenizer reads every
    character of the run's rows (all of them, read on every replica, so the model is the
    same everywhere), and its positions hold the longest prompt with its hint and the
    completions. The embedded task's alphabet alone would read other text as unknown
    tokens, and its 28 positions would hold no longer prompt."""
    from crf.composer import char_tokenizer, tiny_qwen2
    from crf.composer.task import task_alphabet
    from crf.composer.tiny import characters
    from crf.replica.data import spec_shard

    rows = [*spec_shard(ctx.spec, 0, 1), *eval_rows]
    chars = set(task_alphabet(cfg.letters)).union(*(characters(r) for r in rows))
    longest = max(len(str(r.get("prompt") or "")) + len(str(r.get("hint") or "")) for r in rows)
    positions = longest + 1 + completion_tokens(cfg, ctx.spec) + 8  # 1: the hint's separator
    tokenizer = char_tokenizer("".join(sorted(chars)))
    model = tiny_qwen2(
        tokenizer, seed=int(ctx.seed), hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, max_position_embeddings=max(positions, 4 * (cfg.max_len + 2) + 8),
    )  # fmt: skip
    return model, tokenizer


def build(ctx: Any, cfg: Config) -> ReplicaSetup:
    """Identical initial weights on every replica; a disjoint data shard per rank."""
    from crf.composer.task import make_examples
    from crf.replica.model import Placement, load_pretrained

    placement = Placement.for_spec(ctx.spec)
    model = tokenizer = None  # the embedded model for --dataset: sized to its rows, below
    if getattr(ctx.spec, "model", None):
        model, tokenizer = load_pretrained(ctx.spec, placement, seed=int(ctx.seed))
    elif not getattr(ctx.spec, "dataset", None):
        model, tokenizer = _tiny(ctx, cfg)
    shape = dict(letters=cfg.letters, min_len=cfg.min_len, max_len=cfg.max_len)
    if getattr(ctx.spec, "dataset", None):  # --dataset: the user's rows, no embedded held-out
        from crf.replica.data import spec_shard

        shard, held_out = spec_shard(ctx.spec, ctx.rank, ctx.world_size), []
        random.Random(int(ctx.data_seed)).shuffle(shard)
    else:
        pool = make_examples(cfg.num_examples, int(ctx.seed), **shape)
        shard = pool[ctx.rank :: ctx.world_size]
        if not shard:
            raise ValueError(
                f"num_examples={cfg.num_examples} leaves replica {ctx.rank} of "
                f"{ctx.world_size} without data: raise num_examples"
            )
        random.Random(int(ctx.data_seed)).shuffle(shard)
        # its held-out prompts: --eval-examples of them, as for a user's held-out data
        n_eval = int(getattr(ctx.spec, "eval_examples", 64) or 64)
        held_out = make_examples(n_eval, int(ctx.seed) + 7919, **shape)
    eval_rows = _eval_rows(ctx.spec) or held_out
    rows = (*shard, *held_out, *eval_rows)
    if model is None:
        model, tokenizer = _tiny_for_data(ctx, cfg, eval_rows)
    model.train()
    chat = bool(getattr(tokenizer, "chat_template", None))
    if not chat:
        _no_conversations(ctx.spec, rows)
    plain = chat and any(isinstance(row["prompt"], str) for row in rows)
    if plain:  # a conversation prompt (a user's dataset may hold one already) stays as it is
        from crf.replica.rewards import PLAIN_PROMPT

        for row in rows:  # the text kept for the rewards (rewards.in_dataset_form)
            if isinstance(row["prompt"], str):
                row[PLAIN_PROMPT] = row["prompt"]
                row["prompt"] = [{"role": "user", "content": row["prompt"]}]
            row.setdefault(PLAIN_PROMPT, None)
    if getattr(ctx.spec, "model", None):  # its template and positions, before any step
        from crf.replica.prompt_fit import check_setup_prompts

        new = completion_tokens(cfg, ctx.spec)
        check_setup_prompts(tokenizer, model, [r["prompt"] for r in rows], ctx.spec.model, new)
    return ReplicaSetup(tokenizer, model, shard, held_out, placement, eval_rows, plain)


def _no_conversations(spec: Any, rows: tuple[dict[str, Any], ...]) -> None:
    """DataError at setup (a restart cannot fix it) for a conversational prompt when the
    tokenizer has no chat template: TRL would raise at the first step, on every attempt.
    The launcher refuses a local model or the embedded one so (crf/launcher/data_checks.py);
    a Hub model's tokenizer is first read here."""
    from crf.replica.data import DataError

    if any(isinstance(row["prompt"], list) for row in rows):
        model = getattr(spec, "model", None)
        which = f"--model {model}" if model else "the composer job's embedded model"
        raise DataError(
            f"the prompts hold conversations (lists of messages) but {which} has no chat "
            "template: use a model with one, or give the prompts as text"
        )


def _eval_rows(spec: Any) -> list[dict[str, Any]]:
    """The run's held-out rows (--eval-split / --eval-dataset), [] without them."""
    from crf.replica.data import eval_source, load_eval, needs_answer

    if eval_source(spec) is None:
        return []
    return load_eval(spec, needs_answer=needs_answer(spec))


def held_out_eval(
    ctx: Any, setup: ReplicaSetup, rewards: dict[str, Any], max_new: int, cfg: Config, start: int
) -> tuple[Any, float | None]:
    """The replica's part of the held-out evaluation of each round's global model
    (crf/replica/evaluation.py), having scored the initial model (round 0's record carries
    it; not again on a replica that resumed past it), and the initial exact match."""
    from crf.replica.evaluation import HeldOutEval

    held = HeldOutEval.for_replica(ctx, setup, rewards, max_new, cfg.pass_threshold)
    exact_before = held.score_before(record=not start)
    if exact_before is None:
        exact_before = greedy_exact_match(setup.model, setup.tokenizer, setup.held_out, max_new)
    return held, exact_before


def completion_tokens(cfg: Config, spec: Any) -> int:
    """The tokens a rollout may take: the job's max_completion_length (trl.* included), else
    the toy's max_len + 2, else GRPOConfig's default."""
    value = cfg.trainer_fields(spec).get("max_completion_length")
    if value is None:
        from crf.replica.trl_settings import grpo_defaults

        value = grpo_defaults()["max_completion_length"]
    return int(value)


def trainer_config(
    ctx: Any, cfg: Config, *, output_dir: str, steps: int, reward_weights: Any = None
) -> Any:
    """The ComposerConfig the job trains with (nothing is loaded or trained): the trainer
    settings of ``cfg`` for ``ctx.spec``, then what crf sets itself (trl_settings.OWNED)."""
    from crf.composer import ComposerConfig
    from crf.composer.task import HINT_TEMPLATE
    from crf.replica.model import Placement
    from crf.replica.trl_settings import checkpointing

    spec = ctx.spec
    fields = cfg.trainer_fields(spec)
    generations = fields.get("num_generations") or _grpo_default("num_generations")
    return ComposerConfig(
        output_dir=output_dir,
        max_steps=steps,
        seed=int(ctx.data_seed),
        **local_ranks.trainer_args(ctx, cfg.prompts_per_step * generations),  # this rank's
        distill_hint_template=HINT_TEMPLATE,
        **checkpointing(ComposerConfig, bool(getattr(spec, "gradient_checkpointing", False))),
        **Placement.for_spec(spec).trainer_args(),
        # --report-to: TRL's own callbacks log every step (crf/replica/tracking.py)
        **(ctx.tracker.trainer_args() if hasattr(ctx, "tracker") else {"report_to": []}),
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        reward_weights=reward_weights,
        # TRL loads the reference model (grpo_beta > 0 without LoRA) as crf loaded the policy
        trust_remote_code=bool(getattr(spec, "trust_remote_code", False)),
        **fields,
        **cfg.composer_kwargs(spec),
    )


#: the TRL config class of the ``trl`` table (what the dry-run plan names)
TRL_CONFIG = "GRPOConfig"


#: knobs of the embedded tiny model (unused with --model) and task (unused with --dataset)
TINY_KNOBS = ("hidden_size", "num_layers", "num_heads")
TASK_KNOBS = ("letters", "min_len", "max_len", "num_examples")


def settings(cfg: Config, spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``--print-config`` and ``--dry-run`` show: the job's own knobs that the run uses
    (the trainer's as they resolve for ``spec``; the tiny model's and the embedded task's
    left out where --model / --dataset replace them) and every GRPOConfig field whose value
    is not TRL's default (the batch crf derives included; per-run fields such as output_dir
    left out)."""
    from crf.replica.trl_settings import KNOBS, differs

    fields = cfg.trainer_fields(spec)
    generations = fields.get("num_generations") or _grpo_default("num_generations")
    unused = set(TINY_KNOBS) if getattr(spec, "model", None) else set()
    if getattr(spec, "dataset", None):
        unused |= set(TASK_KNOBS)
    knobs = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "trl" and k not in unused}
    if knobs["generation_compile"] is None:  # as the replicas take it (Config's comment)
        knobs["generation_compile"] = "auto" if getattr(spec, "model", None) else False
    for knob, name in KNOBS.items():
        knobs[knob] = fields.get(name, _grpo_default(name))
    batch = {"per_device_train_batch_size": cfg.prompts_per_step * generations}
    return knobs, differs(fields | batch)


def check_run(
    cfg: Config, spec: Any, gpus: int | None, local: bool, bf16: bool | None = None
) -> None:
    """Before launch: the ``trl`` settings against TRL's GRPOConfig, and vLLM where it can
    run (crf/replica/trl_settings.py); ``bf16``: whether the backend's GPU has bfloat16 of
    its own (None: unknown or local)."""
    from crf.replica.trl_settings import check_run as check

    check(cfg, spec, gpus, local, bf16)


def notes(cfg: Config, spec: Any, rows: list[dict[str, Any]]) -> list[str]:
    """The launch's warnings (printed by it and by its dry run): completions shorter than
    the longest answer or trace in the sampled rows of --dataset (crf/replica/
    trl_settings.py, completion_notes), and a staleness bound the rollout workers can never
    reach or one too short for --publish-every (:func:`staleness_notes`)."""
    from crf.replica.trl_settings import completion_notes

    model = getattr(spec, "model", None)
    remote = bool(getattr(spec, "trust_remote_code", False))
    said = completion_notes(completion_tokens(cfg, spec), rows, model, remote)
    return said + staleness_notes(spec)


def staleness_notes(spec: Any) -> list[str]:
    """A ``--max-staleness`` beyond what a round allows: no rollout crosses an outer step
    (crf.rollouts.config.in_bound), which comes every H / fragments inner steps, so a bound
    of that many steps or more allows nothing more than one step less; said so that the
    user does not count on the larger one. A bound within the round is checked against
    ``--publish-every`` (:func:`publish_notes`)."""
    period = getattr(spec, "sync_period", 0)
    bound = getattr(spec, "max_staleness", 0)
    if not getattr(spec, "rollout_workers", 0) or not period:
        return []
    if bound < period:
        return publish_notes(spec, period, bound)
    return [
        f"--max-staleness {bound}: no rollout crosses an outer step (every {period} inner "
        f"step(s) here), so none is more than {period - 1} step(s) stale whatever the bound; "
        f"set --max-staleness {period - 1} or less, or raise --sync-every"
    ]


def publish_notes(spec: Any, period: int, bound: int) -> list[str]:
    """A ``--publish-every`` the staleness bound cannot span: a version (published every
    P inner steps and after each outer step, every ``period``) serves only the ``bound`` + 1
    steps from its own, so the trainer generates the batches of the steps after those
    itself (docs/rollout-workers.md, "When workers pay off")."""
    every = int(getattr(spec, "publish_every", 1) or 1)
    interval = min(every, period)  # the steps between two published versions at most
    if bound + 1 >= interval:
        return []
    return [
        f"--publish-every {every} with --max-staleness {bound}: a published version serves "
        f"only the next {bound + 1} inner step(s), so the replicas generate the batches of "
        f"the other steps themselves; set --max-staleness {interval - 1}, or --publish-every "
        f"{bound + 1}"
    ]


def _grpo_default(name: str) -> Any:
    from crf.replica.trl_settings import grpo_defaults

    return grpo_defaults()[name]


def train_dataset(rows: list[dict[str, Any]]) -> Any:
    """The rows as TRL's train dataset, with every column any row has (a row without one
    gets None: ``Dataset.from_list`` would keep only the first row's keys, dropping a hint
    column whose first row has none), in the order they first appear. A column whose values
    mix kinds (an ``id`` of text and numbers, a ``meta`` of text and objects: the job's own
    fields are refused so before launch, the others only travel to the rewards) is held as
    ``datasets``' ``Json`` feature, as ``load_dataset`` holds it, so a reward gets each value
    as it is in the file."""
    import pyarrow as pa
    from datasets import Dataset, Features, Json

    keys = list(dict.fromkeys(k for row in rows for k in row))
    columns = {k: [row.get(k) for row in rows] for k in keys}
    try:
        return Dataset.from_dict(columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    features = {}
    for k, values in columns.items():
        try:
            features[k] = Dataset.from_dict({k: values}).features[k]
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            features[k] = Json()
    return Dataset.from_dict(columns, features=Features(features))


def new_trainer(
    ctx: Any,
    cfg: Config,
    setup: ReplicaSetup,
    rewards: dict[str, Any],
    tmp: str,
    steps: int,
    callbacks: list[Any],
) -> Any:
    """The composer trainer of replica ``ctx.rank`` (a rollout worker builds its trainer's
    with this too, to generate exactly as it does); ``tmp``: a folder for its files."""
    from transformers import PrinterCallback, ProgressCallback

    from crf.composer import ComposerReplicationTrainer, save_tiny

    model, tokenizer = setup.model, setup.tokenizer
    args = trainer_config(ctx, cfg, output_dir=f"{tmp}/out", steps=steps,
                          reward_weights=rewards["reward_weights"])  # fmt: skip
    embedded = not getattr(ctx.spec, "model", None)
    if args.beta > 0 and embedded:  # TRL reloads the reference from _name_or_path
        save_tiny(model, tokenizer, f"{tmp}/init-model")
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=rewards["reward_funcs"],
        args=args,
        train_dataset=train_dataset(setup.shard),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    if trainer.compiled_decoding and cfg.generation_compile is None:
        logging.getLogger(__name__).info(
            "generation: decoding step compiled over a static KV cache (generation_compile, "
            "the default on CUDA; the first generation compiles; --set "
            "generation_compile=false turns it off)"
        )
    return trainer


def run(ctx: Any, cfg: Config) -> dict[str, Any]:
    """Train ``ctx.total_steps`` inner steps of the composer trainer under DiLoCo."""
    import tempfile

    from crf.composer import DiLoCoCallback
    from crf.composer.task import reverse_reward
    from crf.replica.rewards import job_rewards, reward_timeout

    rewards = job_rewards(
        list(getattr(ctx.spec, "reward", [])), reverse_reward, reward_timeout(ctx.spec)
    )
    setup = build(ctx, cfg)
    rewards = setup.rewards_for(rewards)
    model, tokenizer = setup.model, setup.tokenizer
    max_new = completion_tokens(cfg, ctx.spec)

    # a restarted replica resumes at the round after the newest global state: train only the
    # remaining steps, on the prompts the uninterrupted one would draw next (resume_data_at)
    start = int(ctx.resume_step()) if hasattr(ctx, "resume_step") else 0
    steps = int(ctx.total_steps) - start
    rows = list(setup.shard) if RolloutConfig.from_spec(ctx.spec).enabled else None
    if steps <= 0:  # every step trained (it died writing the model): finish the export
        return finish_trained(ctx, model, tokenizer, start)
    held, exact_before = held_out_eval(ctx, setup, rewards, max_new, cfg, start)
    callback = DiLoCoCallback(ctx, round_eval=held if held.rows else None)
    with tempfile.TemporaryDirectory(prefix="crf-composer-") as tmp:
        trainer = new_trainer(ctx, cfg, setup, rewards, tmp, steps, [callback])
        callback.weights_replaced.append(trainer.weights_replaced)  # vLLM: push after syncs
        if start:  # the same prompts, and random draws, as the uninterrupted replica's
            callback.restore_rng_at_step = trainer.resume_data_at(start)
        if rows is not None:  # rollout workers: publish the policy, take their batches
            from crf.rollouts.replica import attach

            attach(ctx, trainer, callback, rows)
        try:
            trainer.train()
        finally:
            callback.close()

    metrics = summarize(callback.history, int(ctx.spec.sync_every))
    metrics["exact_match_before"] = exact_before
    metrics["exact_match_after"] = greedy_exact_match(model, tokenizer, setup.held_out, max_new)
    metrics.update(shard_size=len(setup.shard), eval_share=len(held.share))
    if hasattr(ctx, "save_model_at_end"):  # the run's model/, written by ctx.finish
        ctx.save_model_at_end(model, tokenizer)
    return metrics
