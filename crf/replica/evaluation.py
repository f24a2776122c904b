"""Held-out evaluation of the composer job: each round's global model, greedy, scored by the
run's own reward functions, its cost shared by the replicas.

- **What is measured.** Right after a round's sync every replica holds the round's global
  model. Each scores its share of the held-out rows (rows ``rank::world_size`` of the fixed
  subsample, :func:`crf.replica.data.load_eval`) with greedy decoding (``model.generate``,
  ``do_sample=False``, the job's ``max_completion_length``), calls every reward function of
  the run the way TRL's GRPO does (``fn(prompts=..., completions=..., completion_ids=...,
  **row columns)``; a completion is a conversation when the prompt is), and counts a row as
  passed when its weighted total reward reaches ``pass_threshold``: pass@1 with one greedy
  sample.
- **How the cost is shared.** A replica scores about 1/N of the rows and writes only sums
  and counts (:class:`Partial`) in its round record, under ``eval/...`` (and, for the model
  before training, under ``eval_before/...`` in its round-0 record). The driver adds up the
  partials of a round (:func:`held_out`): the global mean is the sum of sums over the sum of
  counts. Only committed records count (a replica outside the round's quorum did not hold
  the global model), and a replica that missed a round leaves a gap: the combined figure
  says how many rows it is over (``examples``, against the set's size ``of``), never a mean
  over rows nobody scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: record keys of the round's global model, and of the model before training (round 0)
AFTER, BEFORE = "eval", "eval_before"
#: a held-out loss share (the sft job): summed token NLL and the tokens it is over, under
#: ``<prefix>/loss_sum`` and ``<prefix>/tokens``; the run's loss per token is their ratio
LOSS_SUM, TOKENS = "loss_sum", "tokens"
#: prompts per ``generate`` call (bounds the memory of one batch on a real model)
BATCH = 32


@dataclass
class Partial:
    """One replica's sums over its share of the held-out rows (or several replicas' added)."""

    n: int = 0  # rows scored
    passed: int = 0  # rows whose weighted total reward reached the threshold
    of: int = 0  # rows in the whole held-out set (the same on every replica)
    sums: dict[str, float] = field(default_factory=dict)  # reward name -> sum over the rows

    def to_metrics(self, prefix: str = AFTER) -> dict[str, float]:
        """Flat numbers for a round record's ``metrics``."""
        out = {f"{prefix}/n": float(self.n), f"{prefix}/pass": float(self.passed)}
        out[f"{prefix}/of"] = float(self.of)
        out.update({f"{prefix}/sum/{k}": v for k, v in self.sums.items()})
        return out

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any], prefix: str = AFTER) -> Partial | None:
        """The partial a record's ``metrics`` carry under ``prefix``, None if none."""
        n = metrics.get(f"{prefix}/n")
        if not _number(n):
            return None
        lead = f"{prefix}/sum/"
        sums = {k[len(lead) :]: float(v) for k, v in metrics.items() if k.startswith(lead)}
        return cls(
            n=int(n),
            passed=int(metrics.get(f"{prefix}/pass") or 0),
            of=int(metrics.get(f"{prefix}/of") or 0),
            sums={k: v for k, v in sums.items() if math.isfinite(v)},
        )

    def add(self, other: Partial) -> Partial:
        sums = dict(self.sums)
        for k, v in other.sums.items():
            sums[k] = sums.get(k, 0.0) + v
        return Partial(self.n + other.n, self.passed + other.passed, max(self.of, other.of), sums)

    def means(self) -> dict[str, Any]:
        """``examples``, ``of``, ``pass@1`` and ``reward/<name>``: means over the rows
        scored (None with no rows)."""
        n = self.n
        out: dict[str, Any] = {"examples": n, "of": self.of}
        out["pass@1"] = self.passed / n if n else None
        out.update({f"reward/{k}": (v / n if n else None) for k, v in self.sums.items()})
        return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def share(rows: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """Replica ``rank``'s rows of the held-out set: ``rows[rank::world_size]``."""
    return list(rows[rank::world_size])


def reward_name(fn: Callable[..., Any]) -> str:
    """The name TRL logs a reward function under (``rewards/<name>/mean``)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows' columns but the prompt, as TRL hands them to a reward function (a row
    without a column gets None)."""
    keys = sorted({k for row in rows for k in row if k not in ("prompt", "completion")})
    return {k: [row.get(k) for row in rows] for k in keys}


def as_text(tokenizer: Any, prompt: Any) -> str:
    """A prompt as the model sees it: a conversation through the chat template."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def generate(model: Any, tokenizer: Any, prompts: list[Any], max_new: int) -> list[list[int]]:
    """Greedy completions' token ids (padding and what follows EOS cut) for ``prompts``,
    in batches of :data:`BATCH`, left-padded as decoder-only generation needs."""
    import torch

    if tokenizer.pad_token is None:  # as TRL's trainers do
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    plain = isinstance(prompts[0], str)  # a chat template writes the special tokens itself
    out: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(prompts), BATCH):
            texts = [as_text(tokenizer, p) for p in prompts[i : i + BATCH]]
            enc = tokenizer(
                texts,
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=plain,
            ).to(device)
            with torch.no_grad():
                ids = model.generate(
                    **enc,
                    max_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            for row in ids[:, enc["input_ids"].shape[1] :].tolist():
                out.append(_until_eos(row, tokenizer.eos_token_id, tokenizer.pad_token_id))
    finally:
        model.train(was_training)
    return out


def _until_eos(ids: list[int], eos: Any, pad: Any) -> list[int]:
    stop = {t for t in (eos, pad) if t is not None}
    for i, t in enumerate(ids):
        if t in stop:
            return ids[:i]
    return ids


def score(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    rewards: Mapping[str, Any],
    *,
    max_new: int,
    threshold: float,
    of: int,
) -> Partial:
    """Greedy completions of ``rows`` scored by ``rewards`` (a job's ``reward_funcs`` /
    ``reward_weights``, :func:`crf.replica.rewards.job_rewards`), as sums and counts."""
    if not rows:
        return Partial(of=of)
    ids = generate(model, tokenizer, [row["prompt"] for row in rows], max_new)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return score_completions(rows, ids, texts, rewards, threshold=threshold, of=of)


def score_completions(
    rows: Sequence[Mapping[str, Any]],
    ids: list[list[int]],
    texts: list[str],
    rewards: Mapping[str, Any],
    *,
    threshold: float,
    of: int,
) -> Partial:
    """The completions (token ids and text) of ``rows`` scored as :func:`score` does."""
    if not rows:
        return Partial(of=of)
    from crf.replica.rewards import call, outside_trainer

    funcs = rewards["reward_funcs"]
    funcs = list(funcs) if isinstance(funcs, list | tuple) else [funcs]
    weights = rewards.get("reward_weights") or [1.0] * len(funcs)
    prompts = [row["prompt"] for row in rows]
    chat = not isinstance(prompts[0], str)  # TRL's rule (a replica's text prompts: see
    # rewards.in_dataset_form, which gives them back as text)
    completions = [[{"role": "assistant", "content": t}] if chat else t for t in texts]
    total = [0.0] * len(rows)
    sums: dict[str, float] = {}
    columns = _columns(rows)
    for fn, w in zip(funcs, weights, strict=True):
        values = call(
            fn,
            prompts=prompts,
            completions=completions,
            completion_ids=ids,
            **(columns | outside_trainer()),
        )
        values = [float("nan") if v is None else float(v) for v in values]
        if len(values) != len(rows):
            raise ValueError(
                f"reward {reward_name(fn)} returned {len(values)} rewards for {len(rows)} "
                "held-out completions: a reward function returns one per completion"
            )
        sums[reward_name(fn)] = sum(v for v in values if math.isfinite(v))
        # a reward with no opinion (None/NaN) adds nothing, as TRL's nansum does
        total = [t + w * v if math.isfinite(v) else t for t, v in zip(total, values, strict=True)]
    passed = sum(t >= threshold for t in total)
    return Partial(n=len(rows), passed=passed, of=of, sums=sums)


def combine(records: Iterable[Mapping[str, Any]], prefix: str = AFTER) -> Partial | None:
    """The partials of one round's committed records (one per replica) added up, or None
    when none carries one."""
    out: Partial | None = None
    for m in records:
        if m.get("committed") is False:
            continue
        p = Partial.from_metrics(m.get("metrics") or {}, prefix)
        if p is not None:
            out = p if out is None else out.add(p)
    return out


def per_round(
    metrics: Mapping[int, Sequence[Mapping[str, Any]]], prefix: str = AFTER
) -> dict[int, Partial]:
    """Each round's combined partial (rounds nobody scored left out)."""
    by_round: dict[int, list[Mapping[str, Any]]] = {}
    for rows in metrics.values():
        for m in rows:
            if isinstance(m.get("round"), int):
                by_round.setdefault(m["round"], []).append(m)
    out = {}
    for r, records in sorted(by_round.items()):
        p = combine(records, prefix)
        if p is not None and p.n:
            out[r] = p
    return out


def loss_metrics(loss_sum: float, tokens: float, prefix: str = AFTER) -> dict[str, float]:
    """A replica's held-out loss share as round-record metrics."""
    return {f"{prefix}/{LOSS_SUM}": float(loss_sum), f"{prefix}/{TOKENS}": float(tokens)}


def loss_per_round(
    metrics: Mapping[int, Sequence[Mapping[str, Any]]], prefix: str = AFTER
) -> dict[int, float]:
    """Each round's held-out loss per token: the committed records' summed NLL over their
    summed tokens (rounds without a scored token left out)."""
    sums: dict[int, list[float]] = {}
    for rows in metrics.values():
        for m in rows:
            got = (m.get("metrics") or {}).get(f"{prefix}/{TOKENS}")
            if not isinstance(m.get("round"), int) or m.get("committed") is False:
                continue
            if not _number(got):
                continue
            total = sums.setdefault(m["round"], [0.0, 0.0])
            total[0] += float(m["metrics"].get(f"{prefix}/{LOSS_SUM}") or 0.0)
            total[1] += float(got)
    return {r: a / b for r, (a, b) in sorted(sums.items()) if b}


def held_out(metrics: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, Any] | None:
    """The summary's held-out section from the replicas' round records: per round the
    combined pass@1 and reward means (and over how many rows) and the held-out loss where
    the job scores one, before training (the round-0 records' ``eval_before`` shares) and
    after the last round scored. None when no replica scored anything."""
    rounds = per_round(metrics, AFTER)
    before = per_round(metrics, BEFORE)
    losses, loss_before = loss_per_round(metrics, AFTER), loss_per_round(metrics, BEFORE)
    if not rounds and not before and not losses:
        return None
    out: dict[str, Any] = {"per_round": {r: p.means() for r, p in rounds.items()}}
    if losses or loss_before:
        out["loss_per_round"] = losses
        out["loss_before"] = loss_before[min(loss_before)] if loss_before else None
        out["loss_after"] = losses[max(losses)] if losses else None
    first = before.get(min(before)) if before else None
    last = rounds[max(rounds)] if rounds else None
    out["before"] = first.means() if first else None
    out["after"] = last.means() if last else None
    out["last_round"] = max(rounds or losses) if rounds or losses else None
    out["pass@1_before"] = first.means()["pass@1"] if first else None
    out["pass@1_after"] = last.means()["pass@1"] if last else None
    return out


def replica_means(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A round record's ``metrics`` with its partials as this replica's own means over its
    share (``eval/pass@1``, ``eval/<reward>``, ``eval/examples``), for a tracker; the run's
    combined figure is in the summary."""
    out = {k: v for k, v in metrics.items() if not k.startswith((f"{AFTER}/", f"{BEFORE}/"))}
    for prefix in (AFTER, BEFORE):
        tokens = metrics.get(f"{prefix}/{TOKENS}")
        if _number(tokens) and tokens:
            out[f"{prefix}/loss"] = float(metrics.get(f"{prefix}/{LOSS_SUM}") or 0.0) / tokens
        p = Partial.from_metrics(metrics, prefix)
        if p is None or not p.n:
            continue
        for k, v in p.means().items():
            if k != "of" and v is not None:
                out[f"{prefix}/{k}"] = float(v)
    return out


@dataclass
class HeldOutEval:
    """One replica's part of the held-out evaluation, on the model it trains (the round's
    global model when called right after a sync). ``exact``: the embedded task, which also
    reports greedy exact match on all its held-out prompts (its figure's per-replica line):
    then one generation over all rows serves both, and the share is scored from it."""

    model: Any
    tokenizer: Any
    rows: list[dict[str, Any]]  # the whole held-out set (the same on every replica)
    rank: int
    world_size: int
    rewards: Mapping[str, Any]
    max_new: int
    threshold: float
    exact: bool = False
    before: Partial | None = None  # the initial model's partial, until a round record has it

    @classmethod
    def for_replica(
        cls, ctx: Any, setup: Any, rewards: Mapping[str, Any], max_new: int, threshold: float
    ) -> HeldOutEval:
        rows = list(setup.eval_rows or ())
        return cls(
            setup.model,
            setup.tokenizer,
            rows,
            int(ctx.rank),
            int(ctx.world_size),
            rewards,
            max_new,
            threshold,
            exact=bool(setup.held_out) and rows == setup.held_out,
        )

    @property
    def share(self) -> list[dict[str, Any]]:
        """This replica's rows: ``rows[rank::world_size]``."""
        return share(self.rows, self.rank, self.world_size)

    def _evaluate(self) -> tuple[Partial, float | None]:
        """This replica's partial, and (``exact``) the exact match over every row."""
        if not self.exact:
            partial = score(
                self.model,
                self.tokenizer,
                self.share,
                self.rewards,
                max_new=self.max_new,
                threshold=self.threshold,
                of=len(self.rows),
            )
            return partial, None
        prompts = [row["prompt"] for row in self.rows]
        ids = generate(self.model, self.tokenizer, prompts, self.max_new)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        hits = sum(t == row["answer"] for t, row in zip(texts, self.rows, strict=True))
        mine = slice(self.rank, None, self.world_size)
        partial = score_completions(
            self.share,
            ids[mine],
            texts[mine],
            self.rewards,
            threshold=self.threshold,
            of=len(self.rows),
        )
        return partial, hits / len(self.rows)

    def score_before(self, record: bool = True) -> float | None:
        """Score the initial model; with ``record`` its partial goes into the first round
        record this replica writes (round 0), under ``eval_before/``. Returns the exact
        match (``exact``; else None)."""
        if not self.rows:
            return None
        partial, exact = self._evaluate()
        if record:
            self.before = partial
        return exact

    def __call__(self) -> dict[str, float | None]:
        """The round's record metrics: this replica's partial under ``eval/`` (and the
        initial model's under ``eval_before/``, once), and ``exact_match`` (``exact``)."""
        if not self.rows:
            return {}
        partial, exact = self._evaluate()
        out: dict[str, float | None] = dict(partial.to_metrics(AFTER))
        if exact is not None:
            out["exact_match"] = exact
        if self.before is not None:
            out.update(self.before.to_metrics(BEFORE))
            self.before = None
        return out
