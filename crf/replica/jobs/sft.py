"""The ``sft`` job: TRL's ``SFTTrainer`` as one DiLoCo replica (supervised fine-tuning,
continued pretraining).

- Data: ``--dataset`` in one of TRL's SFT formats (crf/replica/sft_data.py): ``text``,
  ``prompt`` + ``completion`` (loss on the completion) or ``messages`` (chat template);
  ``--column`` maps a file's columns to them. Replica ``rank`` trains on rows
  ``rank::world_size``. Without ``--dataset``, the embedded task: the string reversal of
  ``crf.composer.task`` as prompt/completion pairs (``"abc="`` -> ``"cba"``).
- Model: ``--model`` (a Hub id or a folder) through ``load_pretrained`` (LoRA, precision,
  device as the composer job); without it a tiny Qwen2 with a character tokenizer over the
  data's characters, built from ``ctx.seed`` (identical on every replica).
- DiLoCo: the trainer's own optimizer is DiLoCo's inner optimizer (``DiLoCoCallback``);
  ``ctx.log_step(loss=..., mean_token_accuracy=...)`` once per optimizer step. The trainer's
  ``max_steps`` is ``ctx.total_steps``, so its learning-rate schedule is the whole run's; a
  restarted replica resumes at the round after the newest global state, its schedule
  advanced to that step and its data at the first row it had not trained on (the rows are
  ordered here, epoch by epoch from ``ctx.data_seed``, and the trainer reads them in order).
- Held-out loss: each round, on the round's global model, over the held-out rows
  (``--eval-split`` / ``--eval-dataset``, a fixed subsample of ``--eval-examples`` rows; the
  embedded task has its own). Replica ``r`` scores rows ``r::N`` only, so each pays 1/N of
  it, and logs ``eval/loss_sum`` (summed token NLL) and ``eval/tokens`` with the round's
  last step (the initial model's under ``eval_before/`` in round 0): summed over the
  replicas, their ratio is the held-out loss per token (crf/replica/evaluation.py, which
  the summary and the figure use). ``eval_loss`` is the replica's own share's mean.
- Held-out pass@1: with ``--reward`` (or the embedded task, whose reward is its own), the
  same rows are also answered greedily and scored by the rewards, as the composer job
  scores its held-out rows (pass@1 and each reward's mean, shared the same way): an SFT
  warm start shows the accuracy a GRPO run then starts from. ``--reward`` does not change
  the training loss, which is the data's.
- Local ranks: ``--procs-per-replica K`` runs SFTTrainer on each of K local ranks, each
  with 1/K of every batch (crf/replica/local_ranks.py), so the replica's batch is the one
  it is with K = 1.
- Export: the trained model (the adapter with LoRA) is the run's ``model/``
  (``ctx.save_model_at_end``), which ``crf export`` copies out and ``--model`` loads.

Knobs (:class:`Config`): the trainer settings, defaulting with ``--model`` to TRL's
``SFTConfig`` defaults; any other ``SFTConfig`` field through the ``trl`` table
(``--set trl.warmup_steps=10``, ``[job.trl]`` in a config file), checked before launch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Any

from crf.replica import local_ranks
from crf.replica.export import finish_trained
from crf.replica.trl_settings import TRAINER_OWNED
from crf.spec import coerce_text

#: trains across a replica's local ranks (--procs-per-replica): SFTTrainer runs on each with
#: its share of every batch (crf.replica.local_ranks.trainer_args)
LOCAL_RANKS = True

#: SFTConfig's own learning rate, the default for a --model trained in full
SFT_LEARNING_RATE = 2e-5
#: with LoRA: ten times the full fine-tuning rate, as TRL's LoRA guide advises for adapters
LORA_LEARNING_RATE = 2e-4
#: the embedded tiny model (random weights, a few thousand steps at most) learns at this
TINY_LEARNING_RATE = 3e-3
#: TrainingArguments' per-device batch size and SFTConfig's max_length (with --model)
TRL_BATCH_SIZE, TRL_MAX_LENGTH = 8, 1024
#: SFTConfig fields crf sets itself -> what to do instead: every job's trainer fields
#: (trl_settings.TRAINER_OWNED) and the sft job's own
RESERVED = TRAINER_OWNED | {
    "per_device_eval_batch_size": "use --set eval_batch_size",
    "dataset_text_field": "use --column text=COLUMN",
    "train_sampling_strategy": "crf orders the rows (a resume continues where it stopped)",
}


@dataclass
class Config:
    """Knobs of the sft job (``crf launch --job sft --set key=value``); 0 = the default for
    the model (TRL's ``SFTConfig`` defaults with ``--model``, see :meth:`settings`)."""

    # trainer (SFTConfig fields of the same name)
    learning_rate: float = 0.0  # 0: 2e-5 (SFTConfig); 2e-4 with LoRA; 3e-3 for the tiny model
    per_device_train_batch_size: int = 0  # 0: 8 (TrainingArguments); 16 for the tiny model
    gradient_accumulation_steps: int = 1
    max_length: int = 0  # tokens per sequence; 0: 1024 (SFTConfig); 32 for the tiny model
    packing: bool = False
    eval_batch_size: int = 8  # held-out rows per forward pass
    # held-out pass@1 (with --reward, or the embedded task): greedy answers of at most
    # max_new_tokens (0: the embedded task's max_len + 2; 256 with --model; else 64), a row
    # passing when its weighted total reward reaches pass_threshold
    max_new_tokens: int = 0
    pass_threshold: float = 1.0
    # embedded task (without --dataset): reverse strings of min_len..max_len `letters`
    letters: str = "abcd"
    min_len: int = 2
    max_len: int = 3
    num_examples: int = 2048
    # tiny Qwen2 (without --model)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    #: any other SFTConfig field (--set trl.NAME=VALUE, [job.trl])
    trl: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"sft option {msg}")

        need(math.isfinite(self.pass_threshold), "pass_threshold must be a finite number")
        for name in ("learning_rate", "per_device_train_batch_size", "max_length",
                     "max_new_tokens"):  # fmt: skip
            value = getattr(self, name)
            need(value >= 0, f"{name} must be >= 0 (0: the model's default; got {value})")
        for name in ("gradient_accumulation_steps", "eval_batch_size", "num_examples"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("hidden_size", "num_layers", "num_heads"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1 (got {getattr(self, name)})")
        need(
            self.hidden_size % self.num_heads == 0,
            f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})",
        )
        need(
            len(self.letters) >= 2 and not set(self.letters) & set("=|"),
            f"letters must be >= 2 characters, without '=' or '|' (got {self.letters!r})",
        )
        need(
            1 <= self.min_len <= self.max_len,
            f"min_len/max_len must satisfy 1 <= min_len <= max_len (got {self.min_len}, "
            f"{self.max_len})",
        )
        need(isinstance(self.trl, dict), f"trl must be a table of SFTConfig fields ({self.trl!r})")
        if self.trl:
            self.trl = check_trl(self.trl, own=[f.name for f in dataclasses.fields(self)])

    def settings(self, *, model: bool, lora: bool) -> dict[str, Any]:
        """The trainer settings this run uses: the knobs, their zeros resolved for the model
        (``model``: --model given; ``lora``: --lora-rank > 0)."""
        lr = SFT_LEARNING_RATE if model else TINY_LEARNING_RATE
        return {
            "learning_rate": self.learning_rate or (LORA_LEARNING_RATE if lora else lr),
            "per_device_train_batch_size": self.per_device_train_batch_size
            or (TRL_BATCH_SIZE if model else 16),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "max_length": self.max_length or (TRL_MAX_LENGTH if model else 32),
            "packing": self.packing,
        }

    def new_tokens(self, spec: Any) -> int:
        """The greedy answers' length for held-out pass@1 (see ``max_new_tokens``)."""
        if self.max_new_tokens:
            return self.max_new_tokens
        if getattr(spec, "model", None):
            return 256
        return 64 if getattr(spec, "dataset", None) else self.max_len + 2


def replica_batch(cfg: Config, spec: Any = None) -> int:
    """The rows of one micro-step, all local ranks together (checked before launch)."""
    lora = int(getattr(spec, "lora_rank", 0) or 0) > 0
    settings = cfg.settings(model=bool(getattr(spec, "model", None)), lora=lora)
    return int(settings["per_device_train_batch_size"])


#: the TRL config class of the ``trl`` table (what the dry-run plan names)
TRL_CONFIG = "SFTConfig"


def settings(cfg: Config, spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``--print-config`` and ``--dry-run`` show: the job's knobs with the trainer's
    zeros resolved for the run's model (:meth:`Config.settings`), and every SFTConfig field
    crf or the ``trl`` table sets to a value other than SFTConfig's default."""
    from trl import SFTConfig

    model = bool(getattr(spec, "model", None))
    lora = int(getattr(spec, "lora_rank", 0) or 0) > 0
    resolved = cfg.settings(model=model, lora=lora)
    knobs = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "trl"} | resolved
    fields = resolved | {"per_device_eval_batch_size": cfg.eval_batch_size} | cfg.trl
    defaults = {f.name: f.default for f in dataclasses.fields(SFTConfig) if f.init}
    trl = {k: fields[k] for k in sorted(fields) if defaults.get(k, object()) != fields[k]}
    return knobs, trl


def _parse(text: str) -> Any:
    """A ``--set trl.NAME=TEXT`` value for a field without a typed default: null, a bool,
    a number, a JSON table or list, else the text."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.strip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def check_trl(values: dict[str, Any], own: list[str]) -> dict[str, Any]:
    """``values`` (SFTConfig fields) as typed values; ValueError (one line) for a name that
    is no SFTConfig field (with "did you mean"), one crf sets, one that is a knob of the job
    (``own``), or a value SFTConfig refuses."""
    import tempfile

    from trl import SFTConfig

    fields = {f.name: f for f in dataclasses.fields(SFTConfig) if f.init}
    typed: dict[str, Any] = {}
    for name, value in values.items():
        if name in own:
            raise ValueError(
                f"trl.{name} is a knob of the sft job: set it as the job's own {name} "
                f"(--set {name}=..., or {name} = ... in [job]), not in its trl table"
            )
        if name in RESERVED:
            raise ValueError(f"trl.{name} is set by crf: {RESERVED[name]}")
        if name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean trl.{near[0]}?" if near else ""
            raise ValueError(f"trl.{name} is no SFTConfig field{hint}")
        default = fields[name].default
        if isinstance(value, str) and default is not None and not isinstance(default, str):
            typed[name] = coerce_text(value, default, f"job option trl.{name}")
        else:
            typed[name] = _parse(value) if isinstance(value, str) else value
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            SFTConfig(output_dir=tmp, use_cpu=True, bf16=False, report_to="none", **typed)
        except (ValueError, TypeError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"job option trl: SFTConfig refuses {typed}: {reason}") from None
    return typed


def check_run(
    cfg: Config, spec: Any, gpus: int | None, local: bool, bf16: bool | None = None
) -> None:
    """Before launch, with the run options: a ``trl`` setting that needs a package the
    replicas will not have (crf/replica/trl_settings.py ``check_packages``), which every
    replica's trainer would refuse at setup."""
    from crf.replica.trl_settings import check_packages

    check_packages(cfg.trl, spec, local)


def check_launch(spec: Any) -> None:
    """Before launch (the driver): the dataset and held-out data are in an SFT format, with a
    row for every replica (crf/replica/sft_data.py); a local file becomes an absolute path.
    DataError says what to fix."""
    from crf.replica.data import DataError, check_eval_split, eval_source, is_local
    from crf.replica.rewards import check_rewards
    from crf.replica.sft_data import check_sft_columns, check_sft_dataset

    check_sft_columns(spec.columns)
    check_eval_split(spec)
    scored = check_rewards(spec.reward) if spec.reward else []
    if scored and spec.dataset and eval_source(spec) is None:
        raise DataError(
            "--reward with the sft job scores held-out answers (its training loss is the "
            "data's): give --eval-split or --eval-dataset, or leave --reward out"
        )
    for attr in ("dataset", "eval_dataset"):
        path = getattr(spec, attr, None)
        if path and is_local(path):
            if spec.backend != "local":
                raise DataError(
                    f"--{attr.replace('_', '-')} {path} is a local file the {spec.backend} "
                    "replicas cannot read: copy it to the store (or any URL) and pass that URL"
                )
            setattr(spec, attr, os.path.abspath(os.path.expanduser(path)))
    if spec.dataset:
        check_sft_dataset(
            spec.dataset, config=spec.dataset_config, split=spec.dataset_split,
            columns=spec.columns, replicas=spec.replicas,
        )  # fmt: skip
    held_out = eval_source(spec)
    if held_out is not None:
        flag = "--eval-dataset" if spec.eval_dataset else "--eval-split"
        check_sft_dataset(
            held_out[0], config=held_out[1], split=held_out[2], columns=spec.columns,
            replicas=0, what=flag,
            needs=("prompt", *(("answer",) if any(r.needs_answer for r in scored) else ()))
            if scored else (),
        )  # fmt: skip


# ---------------------------------------------------------------------- data and model
@dataclass
class ReplicaSetup:
    """What one replica trains: tokenizer, model, all its training rows (a ``Dataset`` in
    one SFT format), its share of the held-out rows (None: no held-out data) and where."""

    tokenizer: Any
    model: Any
    train: Any
    held_out: Any
    placement: Any
    settings: dict[str, Any]
    #: the whole held-out set as prompts and answers for pass@1 (empty: not scored)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)


#: the tiny model's chat template, for a conversational dataset without --model
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _tiny(ctx: Any, cfg: Config, datasets: list[Any], max_length: int) -> tuple[Any, Any]:
    """The tiny Qwen2 over the characters of every row (the same on every replica: all of
    them read every row), with a plain chat template for conversations."""
    from crf.composer import char_tokenizer, tiny_qwen2
    from crf.composer.tiny import characters

    chars = {c for ds in datasets for row in ds for c in characters(row)}
    chat = any("messages" in ds.column_names or _is_chat(ds) for ds in datasets)
    if chat:
        chars |= set(TINY_CHAT_TEMPLATE) | set("assistant: \n")
    tokenizer = char_tokenizer("".join(sorted(chars)))
    if chat:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    model = tiny_qwen2(
        tokenizer, seed=int(ctx.seed), hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, max_position_embeddings=max_length + 8,
    )  # fmt: skip
    return model, tokenizer


def _is_chat(ds: Any) -> bool:
    return "prompt" in ds.column_names and len(ds) > 0 and isinstance(ds[0]["prompt"], list)


def _rows(ctx: Any, cfg: Config) -> tuple[Any, Any, list[dict[str, Any]]]:
    """(all training rows, all held-out rows or None) as ``Dataset``s in one SFT format, and
    the held-out rows as prompts and answers (:func:`_scorable`)."""
    from datasets import Dataset

    from crf.replica.data import (
        answer_reader,
        check_values,
        decoded,
        eval_source,
        fixed_subsample,
    )
    from crf.replica.sft_data import FORMAT_FIELDS, load_sft_rows

    spec = ctx.spec
    n_eval = int(getattr(spec, "eval_examples", 64))
    if not getattr(spec, "dataset", None):
        from crf.composer.task import make_examples

        shape = dict(letters=cfg.letters, min_len=cfg.min_len, max_len=cfg.max_len)
        pairs = [
            make_examples(cfg.num_examples, int(ctx.seed), **shape),
            make_examples(n_eval, int(ctx.seed) + 7919, **shape),
        ]  # fmt: skip
        train, held = (
            Dataset.from_list([{"prompt": r["prompt"], "completion": r["answer"]} for r in rows])
            for rows in pairs
        )
        return train, held, [{"prompt": r["prompt"], "answer": r["answer"]} for r in pairs[1]]
    columns = dict(spec.columns)
    train, _ = load_sft_rows(
        spec.dataset, config=spec.dataset_config, split=spec.dataset_split, columns=columns
    )
    source = eval_source(spec)
    if source is None:
        return train, None, []
    scored = bool(getattr(spec, "reward", None))
    flag = "--eval-dataset" if getattr(spec, "eval_dataset", None) else "--eval-split"
    held, _ = load_sft_rows(
        source[0], config=source[1], split=source[2], columns=columns, keep=("answer",),
        others=scored, flag=flag,
    )  # fmt: skip
    keep = fixed_subsample(list(range(len(held))), n_eval, int(ctx.seed))
    held = held.select(keep)
    scorable = _scorable(held) if scored else []
    if scored and "answer" in held.column_names:  # as the launcher checks a local file's
        answers = decoded(held.select_columns(["answer"]))
        where = f"{flag} {source[0]}"
        check_values(answers, columns, where, reader=answer_reader(spec), index=keep)
    text = [c for c in held.column_names if c in FORMAT_FIELDS]  # what SFTTrainer reads
    return train, held.select_columns(text), scorable


def _scorable(held: Any) -> list[dict[str, Any]]:
    """Held-out rows as the rewards score them: the prompt (a conversation's turns before its
    last answer) and the row's other columns (``answer``, and any other under its own name,
    as TRL hands them to a reward)."""
    from crf.replica.data import as_rows, decoded
    from crf.replica.sft_data import FORMAT_FIELDS

    out = []
    for row in as_rows(decoded(held), len(held)):
        if "messages" in row:
            prompt = row["messages"][:-1]
        elif "prompt" in row:
            prompt = row["prompt"]
        else:
            continue  # plain text has no prompt to answer
        others = {k: v for k, v in row.items() if k not in FORMAT_FIELDS}
        out.append({"prompt": prompt, **others})
    return out


def build(ctx: Any, cfg: Config) -> ReplicaSetup:
    """Identical initial weights on every replica; this replica's rows and held-out share."""
    from crf.replica.model import Placement, load_pretrained

    spec = ctx.spec
    placement = Placement.for_spec(spec)
    given = bool(getattr(spec, "model", None))
    lora = int(getattr(spec, "lora_rank", 0) or 0) > 0
    settings = cfg.settings(model=given, lora=lora)
    train, held, scorable = _rows(ctx, cfg)
    if given:
        from crf.replica.prompt_fit import check_answer_room, check_length_room

        model, tokenizer = load_pretrained(spec, placement, seed=int(ctx.seed))
        check_length_room(model, spec.model, int(settings["max_length"]))  # within its table
        prompts = [row["prompt"] for row in scorable]  # held-out answers within its positions
        check_answer_room(tokenizer, model, prompts, spec.model, cfg.new_tokens(spec))
    else:
        data = [train] if held is None else [train, held]
        model, tokenizer = _tiny(ctx, cfg, data, settings["max_length"])
        model.to(placement.device)
    model.train()
    if len(train) < ctx.world_size:
        raise ValueError(
            f"{len(train)} training row(s) for {ctx.world_size} replicas: every replica needs "
            "at least one; add rows (or raise num_examples) or lower --replicas"
        )
    train = train.shard(num_shards=ctx.world_size, index=ctx.rank, contiguous=False)
    if held is not None:
        held = held.shard(num_shards=ctx.world_size, index=ctx.rank, contiguous=False)
        held = held if len(held) else None  # fewer held-out rows than replicas
    return ReplicaSetup(tokenizer, model, train, held, placement, settings, scorable)


def row_order(rows: int, needed: int, seed: int) -> list[int]:
    """The first ``needed`` row indices a replica trains on: epoch after epoch, each a
    permutation of ``range(rows)`` drawn from ``seed`` and the epoch (so a restarted replica
    computes the same order and continues where it stopped)."""
    order: list[int] = []
    epoch = 0
    while len(order) < needed:
        perm = list(range(rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        order += perm
        epoch += 1
    return order[:needed]


# ---------------------------------------------------------------------- held-out loss
def eval_sums(trainer: Any, model: Any, placement: Any) -> dict[str, float]:
    """This replica's held-out share on ``model`` as it is: the summed token NLL
    (``eval/loss_sum``) over the tokens the training loss counts (``eval/tokens``: the
    completion's with prompt/completion data), and their ratio (``eval_loss``)."""
    import torch
    import torch.nn.functional as F

    from crf.replica.evaluation import loss_metrics

    if trainer.eval_dataset is None:
        return {}
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad(), placement.autocast():
        for batch in trainer.get_eval_dataloader():
            labels = batch["labels"].to(device)[:, 1:]
            inputs = {
                k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")
                if k in batch
            }  # fmt: skip
            logits = model(**inputs).logits[:, :-1].float()
            total += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )  # fmt: skip
            )
            tokens += int((labels != -100).sum())
    model.train(was_training)
    out = loss_metrics(total, tokens)
    if tokens:
        out["eval_loss"] = total / tokens
    return out


# ---------------------------------------------------------------------- training
def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(
    history: list[dict[str, float]], evals: list[dict[str, float]], sync_every: int
) -> dict[str, Any]:
    """Per-round means of the step history (loss, token accuracy), with each round's
    held-out sums (``evals``: one per round end, in order)."""
    every = max(1, sync_every)
    rounds = []
    for r, i in enumerate(range(0, len(history), every)):
        steps = history[i : i + every]
        entry: dict[str, Any] = {"round": r}
        for key in ("loss", "mean_token_accuracy"):
            entry[key] = _mean([s[key] for s in steps if key in s])
        entry.update(evals[r] if r < len(evals) else {})
        rounds.append(entry)
    out: dict[str, Any] = {"steps": len(history), "rounds": rounds}
    if rounds:
        out["loss_last_round"] = rounds[-1]["loss"]
    return out


def _schedule_offset(steps: int) -> Any:
    """A callback that moves the trainer's learning-rate schedule ``steps`` ahead before
    training (a resumed replica: its schedule is the whole run's, from where it stopped)."""
    from transformers import TrainerCallback

    class ScheduleOffset(TrainerCallback):
        def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
            if lr_scheduler is None:
                return
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                for _ in range(steps):
                    lr_scheduler.step()

    return ScheduleOffset()


def _as_before(shares: dict[str, float]) -> dict[str, float]:
    """The initial model's loss share under ``eval_before/`` (round 0's record)."""
    from crf.replica.evaluation import AFTER, BEFORE

    lead = f"{AFTER}/"
    return {f"{BEFORE}/{k[len(lead) :]}": v for k, v in shares.items() if k.startswith(lead)}


def _scorer(ctx: Any, cfg: Config, setup: ReplicaSetup) -> Any:
    """The held-out pass@1 of this replica's share (crf/replica/evaluation.py), or None when
    nothing is scored: the run's rewards (the embedded task's own without --dataset)."""
    from crf.composer.task import reverse_reward
    from crf.replica.evaluation import HeldOutEval
    from crf.replica.rewards import job_rewards, reward_timeout

    if not setup.eval_rows:
        return None
    rewards = job_rewards(
        list(getattr(ctx.spec, "reward", []) or []), reverse_reward, reward_timeout(ctx.spec)
    )
    return HeldOutEval(
        setup.model, setup.tokenizer, setup.eval_rows, int(ctx.rank), int(ctx.world_size),
        rewards, cfg.new_tokens(ctx.spec), cfg.pass_threshold,
    )  # fmt: skip


def trainer_args(ctx: Any, setup: ReplicaSetup, cfg: Config, output_dir: str) -> Any:
    """The ``SFTConfig`` of this replica: crf's settings, then the ``trl`` table."""
    from trl import SFTConfig

    from crf.replica.trl_settings import checkpointing

    return SFTConfig(
        output_dir=output_dir,
        max_steps=int(ctx.total_steps),
        seed=int(ctx.data_seed),
        train_sampling_strategy="sequential",  # the rows are ordered already (row_order)
        per_device_eval_batch_size=cfg.eval_batch_size,
        **checkpointing(SFTConfig, bool(getattr(ctx.spec, "gradient_checkpointing", False))),
        **{k: v for k, v in setup.settings.items() if k != "per_device_train_batch_size"},
        # this local rank's share of each batch (all of it with one rank)
        **local_ranks.trainer_args(ctx, setup.settings["per_device_train_batch_size"]),
        **setup.placement.trainer_args(),
        **(ctx.tracker.trainer_args() if hasattr(ctx, "tracker") else {"report_to": []}),
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        **cfg.trl,
    )


def run(ctx: Any, cfg: Config) -> dict[str, Any]:
    """Train ``ctx.total_steps`` optimizer steps of SFTTrainer under DiLoCo."""
    import tempfile

    from transformers import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    from crf.composer import DiLoCoCallback

    setup = build(ctx, cfg)
    start = int(ctx.resume_step()) if hasattr(ctx, "resume_step") else 0
    total = int(ctx.total_steps)
    if start >= total:  # every step trained (it died writing the model): finish the export
        return finish_trained(ctx, setup.model, setup.tokenizer, start)
    per_step = setup.settings["per_device_train_batch_size"] * cfg.gradient_accumulation_steps
    order = row_order(len(setup.train), total * per_step, int(ctx.data_seed))
    train = setup.train.select(order[start * per_step :])
    with tempfile.TemporaryDirectory(prefix="crf-sft-") as tmp:
        trainer = SFTTrainer(
            model=setup.model,
            args=trainer_args(ctx, setup, cfg, f"{tmp}/out"),
            train_dataset=train,
            eval_dataset=setup.held_out,
            processing_class=setup.tokenizer,
        )
        for noisy in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(noisy)
        score = _scorer(ctx, cfg, setup)
        before = eval_sums(trainer, setup.model, setup.placement)
        if score is not None:
            score.score_before(record=not start)
        # the initial model's loss share goes into round 0's record (a resumed run has it)
        pending = {} if start else _as_before(before)
        evals: list[dict[str, float]] = []

        def round_eval() -> dict[str, float | None]:
            evals.append(eval_sums(trainer, setup.model, setup.placement))
            out: dict[str, float | None] = {**evals[-1], **pending}
            pending.clear()
            return {**out, **(score() if score is not None else {})}

        callback = DiLoCoCallback(ctx, metrics=("mean_token_accuracy",), round_eval=round_eval)
        trainer.add_callback(callback)
        if start:
            trainer.add_callback(_schedule_offset(start))
        try:
            trainer.train()
        finally:
            callback.close()
    metrics = summarize(callback.history, evals, int(ctx.spec.sync_every))
    if before.get("eval_loss") is not None:
        metrics["eval_loss_before"] = before["eval_loss"]
    metrics["shard_size"] = len(setup.train)
    metrics["trainer_settings"] = setup.settings
    if hasattr(ctx, "save_model_at_end"):  # the run's model/, written by ctx.finish
        ctx.save_model_at_end(setup.model, setup.tokenizer)
    return metrics
