"""Rollouts in: the rollout batch a worker writes for its trainer, and the queue they form.

A :class:`RolloutBatch` holds exactly one TRL generation batch of its trainer (prompts x
num_generations rollouts, each prompt's generations consecutive, as TRL's RepeatSampler yields
them): the dataset row ids into the trainer's shard (as ``build()`` makes it), prompt and completion
token ids, the behaviour log-prob of every completion token, the policy version that generated it
and that version's digest, the sampling settings, the tokenizer's digest, the worker, its sequence
number and when it was made.

On the wire a batch is a crf blob (crf/store/codec.py: checksum, sizes): a json header with
the scalar fields and the lengths, then the token ids as int32 and the log-probs as float64
(a Python float round-trips exactly), so a batch reads back bit-exact.

The queue (``rollouts/<rank>/``) is written by the rank's workers and read only by the rank's
trainer, which takes the oldest batch within the staleness bound and moves a batch that came
too late to ``rollouts/<rank>/returned/``; the worker that wrote it generates those rows
again first (no prompt is lost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from crf import layout
from crf.rollouts.config import in_bound
from crf.store import CorruptObjectError, ObjectNotFound, RunStore
from crf.store.codec import decode_blob, encode_blob_parts

KIND = "rollout_batch"


@dataclass
class RolloutBatch:
    """One generation batch of trainer ``rank``, made by worker ``worker`` (its ``seq``-th)
    with the policy after ``version`` inner steps."""

    rank: int
    worker: int
    seq: int
    version: int  # policy step
    row_ids: list[int]  # one per rollout (repeated)
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    sampling: dict = field(default_factory=dict)
    tokenizer_digest: str = ""
    policy_digest: str = ""
    created_at: float = 0.0

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def key(self) -> str:
        return layout.rollout_key(self.rank, self.worker, self.seq)

    def check(self) -> None:
        """Every per-rollout list has one entry per rollout, and every completion token one
        log-prob; ValueError says which is off."""
        n = len(self.row_ids)
        for name in ("prompt_ids", "completion_ids", "logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"rollout batch: {name} has {len(getattr(self, name))} "
                                 f"entries for {n} rollouts")  # fmt: skip
        for i, (c, lp) in enumerate(zip(self.completion_ids, self.logprobs, strict=True)):
            if len(c) != len(lp):
                raise ValueError(
                    f"rollout batch: rollout {i} has {len(c)} completion tokens and "
                    f"{len(lp)} log-probs"
                )


def _lengths(rows: list[list[Any]]) -> list[int]:
    return [len(r) for r in rows]


def encode_batch(batch: RolloutBatch) -> list[Any]:
    """The batch as the buffers of one checked blob."""
    import array

    batch.check()
    ids = array.array("i")
    for rows in (batch.prompt_ids, batch.completion_ids):
        for r in rows:
            ids.extend(int(t) for t in r)
    lps = array.array("d")
    for r in batch.logprobs:
        lps.extend(float(x) for x in r)
    if ids.itemsize != 4 or lps.itemsize != 8:  # pragma: no cover - every CPython platform
        raise RuntimeError("rollout batches need 4-byte ints and 8-byte floats")
    meta = {
        "kind": KIND,
        "rank": batch.rank,
        "worker": batch.worker,
        "seq": batch.seq,
        "version": batch.version,
        "row_ids": [int(i) for i in batch.row_ids],
        "prompt_lengths": _lengths(batch.prompt_ids),
        "completion_lengths": _lengths(batch.completion_ids),
        "sampling": batch.sampling,
        "tokenizer_digest": batch.tokenizer_digest,
        "policy_digest": batch.policy_digest,
        "created_at": batch.created_at,
        "byteorder": "little",
    }
    return encode_blob_parts([_little(ids), _little(lps)], meta)


def _little(a: Any) -> bytes:
    import sys

    if sys.byteorder != "little":  # pragma: no cover
        a = a.__copy__()
        a.byteswap()
    return a.tobytes()


def decode_batch(data: bytes, *, where: str = "rollout batch") -> RolloutBatch:
    """A batch read back; CorruptObjectError if its checksum, header or sizes are off."""
    import array
    import sys

    payload, meta = decode_blob(data, where=where)
    try:
        if meta.get("kind") != KIND:
            raise ValueError(f"not a rollout batch (kind {meta.get('kind')!r})")
        plen = [int(n) for n in meta["prompt_lengths"]]
        clen = [int(n) for n in meta["completion_lengths"]]
        n_ids, n_lps = sum(plen) + sum(clen), sum(clen)
        if len(payload) != 4 * n_ids + 8 * n_lps:
            raise ValueError(
                f"payload is {len(payload)} bytes, lengths say {4 * n_ids + 8 * n_lps}"
            )
        ids, lps = array.array("i"), array.array("d")
        ids.frombytes(payload[: 4 * n_ids])
        lps.frombytes(payload[4 * n_ids :])
        if sys.byteorder != "little":  # pragma: no cover
            ids.byteswap()
            lps.byteswap()
        flat_ids, flat_lps = ids.tolist(), lps.tolist()
        prompts, at = _cut(flat_ids, plen, 0)
        completions, _ = _cut(flat_ids, clen, at)
        logprobs, _ = _cut(flat_lps, clen, 0)
        batch = RolloutBatch(
            rank=int(meta["rank"]),
            worker=int(meta["worker"]),
            seq=int(meta["seq"]),
            version=int(meta["version"]),
            row_ids=[int(i) for i in meta["row_ids"]],
            prompt_ids=prompts,
            completion_ids=completions,
            logprobs=logprobs,
            sampling=dict(meta.get("sampling") or {}),
            tokenizer_digest=str(meta.get("tokenizer_digest", "")),
            policy_digest=str(meta.get("policy_digest", "")),
            created_at=float(meta.get("created_at", 0.0)),
        )
        batch.check()
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptObjectError(f"{where}: unreadable rollout batch ({e})") from None
    return batch


def _cut(flat: list[Any], lengths: list[int], at: int) -> tuple[list[list[Any]], int]:
    out = []
    for n in lengths:
        out.append(flat[at : at + n])
        at += n
    return out, at


def _parse(name: str) -> tuple[int, int] | None:
    """``<w>-<seq>`` -> (w, seq); None for anything else (``returned``, temp files)."""
    w, dash, seq = name.partition("-")
    return (int(w), int(seq)) if dash and w.isdigit() and seq.isdigit() else None


class RolloutQueue:
    """Trainer ``rank``'s queue of rollout batches in the store."""

    def __init__(self, store: RunStore, rank: int) -> None:
        self.store = store
        self.rank = rank

    # ------------------------------------------------------------------ workers
    def put(self, batch: RolloutBatch) -> None:
        if batch.rank != self.rank:
            raise ValueError(f"batch for trainer {batch.rank} put in trainer {self.rank}'s queue")
        self.store.put(batch.key, encode_batch(batch))

    def queued(self, worker: int | None = None) -> list[tuple[int, int]]:
        """(worker, seq) of the batches waiting for the trainer (of one worker, if given)."""
        names = self.store.list(layout.rollout_dir(self.rank))
        found = [p for p in map(_parse, names) if p is not None]
        return sorted(p for p in found if worker is None or p[0] == worker)

    def take_returned(self, worker: int) -> list[RolloutBatch]:
        """The batches the trainer gave back to ``worker`` (removed from the store): their
        rows are to be generated again."""
        folder = f"{layout.rollout_dir(self.rank)}/returned"
        out = []
        for name in self.store.list(folder):
            p = _parse(name)
            if p is None or p[0] != worker:
                continue
            key = layout.returned_key(self.rank, *p)
            try:
                out.append(decode_batch(self.store.get(key), where=key))
            except ObjectNotFound:
                continue
            except CorruptObjectError:
                pass  # its rows cannot be known: nothing to generate again
            self.store.delete(key)
        return sorted(out, key=lambda b: b.seq)

    def drop(self, worker: int) -> int:
        """Delete ``worker``'s queued batches (its trainer has finished: no attempt of it
        takes them); how many went. Those returned to it stay (:meth:`clear`)."""
        keys = [layout.rollout_key(self.rank, w, seq) for w, seq in self.queued(worker)]
        for key in keys:
            self.store.delete(key)
        return len(keys)

    def clear(self) -> None:
        """Delete the queued batches and the cursor: the trainer trained every step, and a
        later attempt of it uses only batches of versions it publishes itself
        (crf/rollouts/source.py), never these. The returned batches stay: they are the rows
        its workers still owe it, which they generate first if it trains again (a restart
        after a failure at its very end, or a resume of the run after another trainer
        failed); no trainer reads them. Once every trainer finished ok they go too
        (:meth:`drop_returned`)."""
        for w, seq in self.queued():
            self.store.delete(layout.rollout_key(self.rank, w, seq))
        self.store.delete(layout.rollout_cursor_key(self.rank))

    def drop_returned(self) -> None:
        """Delete the batches returned to the workers: no trainer trains again (every one
        finished ok, and a run that ended ok is never resumed)."""
        folder = f"{layout.rollout_dir(self.rank)}/returned"
        for name in self.store.list(folder):
            p = _parse(name)
            if p is not None:
                self.store.delete(layout.returned_key(self.rank, *p))

    def cursor(self) -> int | None:
        """The step the first queued batch will serve (None: the trainer has taken none)."""
        try:
            return int(self.store.get_json(layout.rollout_cursor_key(self.rank))["step"])
        except (ObjectNotFound, KeyError, TypeError, ValueError):
            return None

    # ------------------------------------------------------------------ trainer
    def set_cursor(self, step: int) -> None:
        """The first queued batch will serve ``step``. The trainer writes it as it starts
        looking for a step's batch, and ``step + 1`` as it claims one, before the batch
        leaves the queue: a worker that reads both never counts its next batch as less stale
        than it will be (for a moment it may count one step more)."""
        self.store.put_json(layout.rollout_cursor_key(self.rank), {"step": int(step)})

    def read(self, worker: int, seq: int) -> RolloutBatch:
        key = layout.rollout_key(self.rank, worker, seq)
        return decode_batch(self.store.get(key), where=f"{self.store.uri}/{key}")

    def remove(self, batch: RolloutBatch | tuple[int, int]) -> None:
        w, seq = (batch.worker, batch.seq) if isinstance(batch, RolloutBatch) else batch
        self.store.delete(layout.rollout_key(self.rank, w, seq))

    def give_back(self, batch: RolloutBatch) -> None:
        """Move a batch the trainer cannot use to ``returned/``: its worker makes it again."""
        self.return_rows(batch)
        self.remove(batch)

    def return_rows(self, batch: RolloutBatch) -> None:
        """Put ``batch`` (already out of the queue) in ``returned/``: its worker generates
        its rows again first."""
        self.store.put(layout.returned_key(self.rank, batch.worker, batch.seq),
                       encode_batch(batch))  # fmt: skip

    def oldest_within(
        self,
        step: int,
        max_staleness: int,
        rollouts: int,
        on_claim: Callable[[], None] | None = None,
        sync_period: int = 0,
    ) -> tuple[RolloutBatch | None, list[RolloutBatch], list[tuple[tuple[int, int], str]]]:
        """Claim the oldest queued batch (lowest version, then earliest made) that is at most
        ``max_staleness`` steps behind ``step``, sampled since the last outer step (every
        ``sync_period`` steps: crf.rollouts.config.in_bound), and holds ``rollouts``
        rollouts (calling ``on_claim`` before it leaves the queue); also returns the batches
        given back as too stale (or of another size) and the keys of unreadable ones
        (removed)."""
        batches, bad = [], []
        for w, seq in self.queued():
            try:
                batches.append(self.read(w, seq))
            except ObjectNotFound:
                continue
            except CorruptObjectError as e:
                bad.append(((w, seq), str(e)))
                self.remove((w, seq))
        batches.sort(key=lambda b: (b.version, b.created_at, b.worker, b.seq))
        returned: list[RolloutBatch] = []
        taken = None
        for b in batches:  # the unusable ones go, whichever is taken
            if len(b) != rollouts:  # made for other settings: generating it again won't help
                bad.append(((b.worker, b.seq), f"{len(b)} rollouts, the trainer needs {rollouts}"))
                self.remove(b)
            elif not in_bound(b.version, step, max_staleness, sync_period):
                self.give_back(b)
                returned.append(b)
            elif taken is None:
                if on_claim is not None:
                    on_claim()
                self.remove(b)
                taken = b
        return taken, returned, bad


def drop_finished_queues(store: RunStore) -> list[int]:
    """Clear the queue (:meth:`RolloutQueue.clear`) of every trainer whose result says ok,
    once its workers are stopped (a batch one of them wrote while its trainer cleared its
    queue); the ranks cleared. A trainer that did not finish ok keeps its queue whole: its
    workers make the returned rows again for a restart or a resume."""
    cleared = []
    for name in store.list(layout.ROLLOUTS):
        if not name.isdigit():
            continue
        try:  # each trainer apart: one result the store fails to give keeps only its queue
            result = store.get_json(layout.result_key(int(name)))
            if isinstance(result, dict) and result.get("status") == "ok":
                RolloutQueue(store, int(name)).clear()
                cleared.append(int(name))
        except Exception:  # noqa: BLE001 - absent, unreadable, a store error: space only
            continue
    return cleared
