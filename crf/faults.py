"""Fault injection for chaos tests: a replica SIGKILLs itself at a named point, or poisons
its numbers with a NaN.

Set ``CRF_FAULT`` in a replica's environment to one or more ``;``-separated specs
``rank=R,point=P,round=N`` (round optional: any round; ``local_rank=L`` names one of a
replica's local ranks, 0 when left out) where P is one of :data:`POINTS` (the
replica dies there) or :data:`POISON_POINTS` (a NaN is put there; the replica goes on).
Each fault fires once per run: before it fires the replica creates ``faults/<spec>`` in the
store with create-if-absent, so a restarted replica that passes the same point again lives on.
Unset (the default), this costs one dict lookup per point.
"""

from __future__ import annotations

import hashlib
import os
import signal
from typing import Any

from crf import layout

POINTS = (
    "inner_step",  # after an inner optimizer step
    "uploading",  # its contribution encoded, before the one PUT that publishes it
    "after_quorum",  # after the quorum is decided, before reducing
    "owning_shard",  # while owning a shard: inputs read, reduced shard not published
    "after_reduce",  # after publishing owned shards, before gathering
    "inner_write",  # in the checkpoint writer, before the upload of its inner state of a round
    "saving",  # writing the run's model/ at the end, after its first file, before the rest
)
POISON_POINTS = (
    "nan_contribution",  # a NaN in its uploaded contribution, after its own finiteness check
    "nan_weights",  # a NaN in its weights after an inner optimizer step (``step=``)
)


def _parse(text: str) -> list[dict[str, str]]:
    specs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kv = dict(item.split("=", 1) for item in part.split(",") if "=" in item)
        if kv.get("point") not in POINTS + POISON_POINTS or "rank" not in kv:
            raise ValueError(
                f"bad CRF_FAULT spec {part!r}: need rank=R,point=one of {POINTS + POISON_POINTS}"
            )
        specs.append(kv)
    return specs


def _fires(
    point: str, rank: int, round: int | None, store: Any, step: int | None, local_rank: int = 0
) -> bool:
    """Whether a spec names this point now and has not fired yet in this run (it is marked
    fired in the store before this returns True)."""
    text = os.environ.get(layout.ENV_FAULT)
    if not text:
        return False
    for kv in _parse(text):
        if kv["point"] != point or int(kv["rank"]) != rank:
            continue
        if int(kv.get("local_rank", 0)) != local_rank:
            continue
        if "round" in kv and round is not None and int(kv["round"]) != round:
            continue
        if "step" in kv and step is not None and int(kv["step"]) != step:
            continue
        tag = hashlib.sha1(repr(sorted(kv.items())).encode()).hexdigest()[:12]
        if store.put_if_absent(layout.fault_key(tag), repr(kv).encode()):
            return True
    return False


def maybe_fault(
    point: str,
    rank: int,
    round: int | None,
    store: Any,
    step: int | None = None,
    local_rank: int = 0,
) -> None:
    if _fires(point, rank, round, store, step, local_rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_poison(
    point: str, rank: int, round: int | None, store: Any, step: int | None = None
) -> bool:
    """True once when a :data:`POISON_POINTS` spec names this point: the caller puts a NaN."""
    return _fires(point, rank, round, store, step)
