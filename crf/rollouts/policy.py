"""Weights out: a trainer publishes its policy, rollout workers read and acknowledge it.

Objects (keys in crf/layout.py):

- ``policy/base/<r>``: a reference point for round r's deltas, the published tensors as one
  exact fp32 vector. Written at round start, create-if-absent: every trainer holds the same
  global weights then, so the first writer's copy is everyone's. A trainer whose write lost
  reads the stored base back and computes its deltas against that copy, so a delta is always
  exact against the base its readers add it to, even if a trainer's weights differed.
- ``policy/<rank>/<step>``: the trainer's weights after ``step`` inner steps, as the delta
  (current - base) on the run's rollout wire (the exchange's codecs: float32, bfloat16,
  float16, int8, topk). Its header names the run, rank, step, round, wire, the tensors'
  layout and the digest of the weights a reader reconstructs (base + decoded delta), which
  the publisher computes the same way: a trainer can tell from a rollout batch's policy
  digest whether its worker generated with what it published.
- ``policy/<rank>/acks/<w>.json``: the version worker w has loaded and still holds.

Both objects are crf tensor objects (crf/store/codec.py: checksum, sizes), and the reader
checks the header, the wire size and finiteness as the exchange checks a part
(crf.exchange.codecs: ``wire_numel_ok``, ``all_finite``) and the reconstructed digest.

Deletion: the publisher deletes version v only when it is not the newest, no acknowledgement
names it, and the trainer's step - v > max_staleness (a worker may still be about to use a
batch of it). Bases older than the previous round go once no trainer publishes against them.

Under LoRA (a PEFT model) only the adapter's trainable tensors are published: the frozen base
model is built identically by the worker.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from crf import layout
from crf.exchange import codecs as wirefmt
from crf.rollouts.config import RolloutConfig
from crf.store import CorruptObjectError, ObjectNotFound, RunStore, decode_tensor
from crf.store.codec import checksum, encode_tensor_parts, raw_view

log = logging.getLogger(__name__)

KIND_BASE = "policy_base"
KIND_DELTA = "policy"


class PolicyUnavailable(Exception):
    """The version asked for (or its base) is gone or not there yet: read a newer one."""


def is_peft(model: Any) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "base_model")


def policy_tensors(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The tensors a policy version carries: every parameter (shared ones once), or only the
    trainable adapter tensors of a PEFT model."""
    named = list(model.named_parameters())
    if is_peft(model):
        named = [(n, p) for n, p in named if p.requires_grad]
    return named


@dataclass(frozen=True)
class PolicyLayout:
    """Names, shapes and dtypes of the published tensors, and their digest."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> PolicyLayout:
        named = policy_tensors(model)
        return cls(
            tuple(n for n, _ in named),
            tuple(tuple(p.shape) for _, p in named),
            tuple(str(p.dtype).removeprefix("torch.") for _, p in named),
        )

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for n, s, d in zip(self.names, self.shapes, self.dtypes, strict=True):
            h.update(f"{n}:{d}:{s};".encode())
        return h.hexdigest()[:32]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """The published tensors as one fp32 vector (a copy, on the CPU)."""
    with torch.no_grad():
        parts = [p.detach().reshape(-1).float().cpu() for _, p in policy_tensors(model)]
    return torch.cat(parts) if parts else torch.empty(0)


def weights_digest(vector: torch.Tensor) -> str:
    """The digest of reconstructed fp32 weights (what a rollout batch's policy_digest is)."""
    h = checksum()
    h.update(raw_view(vector))
    return h.hexdigest()


def load_into(model: torch.nn.Module, vector: torch.Tensor) -> None:
    """Copy an fp32 vector of the published tensors into the model (cast to each dtype)."""
    with torch.no_grad():
        offset = 0
        for _, p in policy_tensors(model):
            n = p.numel()
            p.copy_(vector[offset : offset + n].view(p.shape).to(p.dtype))
            offset += n


def _segments(lay: PolicyLayout) -> list[int] | None:
    segs = [_numel(s) for s in lay.shapes if _numel(s)]
    return segs or None


class PolicyPublisher:
    """Trainer side: bases, versions, and deleting what no worker can still use."""

    def __init__(
        self,
        store: RunStore,
        rank: int,
        cfg: RolloutConfig,
        *,
        run_id: str,
        sync_every: int,
    ) -> None:
        self.store = store
        self.rank = rank
        self.cfg = cfg
        self.run_id = run_id
        self.sync_every = max(1, int(sync_every))
        self.layout: PolicyLayout | None = None
        self._base: torch.Tensor | None = None
        self._base_round: int | None = None
        #: version step -> digest of the weights a reader reconstructs from it
        self.digests: dict[int, str] = {}
        self.published: list[int] = []
        self.deleted = 0

    # ------------------------------------------------------------------ bases
    def start_round(self, r: int, model: torch.nn.Module) -> None:
        """Round r begins with these (global) weights: publish them as round r's base (the
        first trainer's copy stands; a later one reads it back and uses it)."""
        self.layout = PolicyLayout.of(model)
        mine = flat_weights(model)
        meta = {
            "kind": KIND_BASE,
            "run_id": self.run_id,
            "round": r,
            "layout_hash": self.layout.digest,
            "numel": self.layout.numel,
        }
        key = layout.policy_base_key(r)
        if self.store.put_if_absent(key, encode_tensor_parts(mine, meta)):
            self._base = mine
        else:
            self._base = read_base(self.store, r, self.run_id, self.layout)
        self._base_round = r
        self._collect_bases(r)

    # ------------------------------------------------------------------ versions
    def publish(self, step: int, model: torch.nn.Module) -> str:
        """Write ``policy/<rank>/<step>`` (the delta against the current base) and delete
        what may go; the digest of the weights a reader reconstructs."""
        if self._base is None or self.layout is None:
            raise RuntimeError("PolicyPublisher.publish before start_round")
        lay, wire = self.layout, self.cfg.wire
        delta = flat_weights(model).sub_(self._base)  # in place: one model-sized copy less
        segs = _segments(lay)
        payload = wirefmt.encode(delta, wire, segs)
        if not wirefmt.all_finite(payload, wire, lay.numel, segs):
            raise ValueError(
                f"step {step}: the policy delta holds NaN/Inf on the {wire} wire; "
                "use a wider --rollout-wire (bfloat16 or float32)"
            )
        if payload.data_ptr() == delta.data_ptr():  # the float32 wire sends delta itself
            rebuilt = self._base + delta
        else:
            del delta
            rebuilt = wirefmt.decode(payload, wire, lay.numel, segments=segs).add_(self._base)
        digest = weights_digest(rebuilt)
        del rebuilt
        meta = {
            "kind": KIND_DELTA,
            "run_id": self.run_id,
            "rank": self.rank,
            "step": step,
            "round": self._base_round,
            "wire": wire,
            "numel": lay.numel,
            "layout_hash": lay.digest,
            "digest": digest,
        }
        self.digests[step] = digest  # before the put: a worker can only see it after
        self.store.put(layout.policy_key(self.rank, step), encode_tensor_parts(payload, meta))
        self.published.append(step)
        self.collect(step)
        return digest

    def expected_digest(self, version: int) -> str | None:
        return self.digests.get(version)

    def knows(self, version: int) -> bool:
        """Whether this publisher published ``version`` (and has not deleted it)."""
        return version in self.digests

    def drop_after(self, step: int) -> list[int]:
        """Delete the versions after ``step``: a restarted trainer resumes at ``step``, and
        what an earlier attempt published beyond it is no policy it will have."""
        gone = [v for v in list_versions(self.store, self.rank) if v > step]
        for v in gone:
            self.store.delete(layout.policy_key(self.rank, v))
        return gone

    def collect(self, step: int) -> list[int]:
        """Delete every version that is not the newest, that no acknowledgement names, and
        that is more than max_staleness steps behind ``step``; the versions deleted."""
        versions = list_versions(self.store, self.rank)
        if not versions:
            return []
        held = {a.step for a in read_acks(self.store, self.rank)}
        newest = max(versions)
        gone = [
            v
            for v in versions
            if v != newest and v not in held and step - v > self.cfg.max_staleness
        ]
        for v in gone:
            self.store.delete(layout.policy_key(self.rank, v))
            self.digests.pop(v, None)
        self.deleted += len(gone)
        return gone

    def _collect_bases(self, r: int) -> None:
        """Bases older than the previous round: no trainer publishes against them any more
        (a reader that finds one gone reads a newer version)."""
        for name in self.store.list(f"{layout.POLICY}/base"):
            if name.isdigit() and int(name) < r - 1:
                self.store.delete(layout.policy_base_key(int(name)))

    def close(self) -> None:
        """The trainer is done: its versions and its workers' acknowledgements go."""
        for v in list_versions(self.store, self.rank):
            self.store.delete(layout.policy_key(self.rank, v))
        for name in self.store.list(f"{layout.policy_dir(self.rank)}/acks"):
            self.store.delete(f"{layout.policy_dir(self.rank)}/acks/{name}")


def drop_finished_bases(store: RunStore, trainers: int) -> bool:
    """Once all ``trainers`` have an ok result, delete the round bases (each trainer deletes
    its own versions at its end, but a base is every trainer's, so none of them can) and
    the batches returned to their workers (no trainer trains again: a run that ended ok is
    never resumed); whether they went."""
    from crf.rollouts.batches import RolloutQueue

    for rank in range(trainers):
        try:
            result = store.get_json(layout.result_key(rank))
        except (ObjectNotFound, ValueError, TypeError):
            return False
        if not isinstance(result, dict) or result.get("status") != "ok":
            return False
    for name in store.list(f"{layout.POLICY}/base"):
        if name.isdigit():
            store.delete(layout.policy_base_key(int(name)))
    for rank in range(trainers):
        RolloutQueue(store, rank).drop_returned()
    return True


def list_versions(store: RunStore, rank: int) -> list[int]:
    """The versions of trainer rank's policy in the store, oldest first."""
    return sorted(int(n) for n in store.list(layout.policy_dir(rank)) if n.isdigit())


def read_acks(store: RunStore, rank: int) -> list[layout.PolicyAck]:
    out = []
    folder = f"{layout.policy_dir(rank)}/acks"
    for name in store.list(folder):
        try:
            out.append(layout.PolicyAck.from_dict(store.get_json(f"{folder}/{name}")))
        except (ObjectNotFound, ValueError, TypeError):
            continue  # gone meanwhile, or unreadable: it protects nothing
    return out


def read_base(store: RunStore, r: int, run_id: str, lay: PolicyLayout) -> torch.Tensor:
    key = layout.policy_base_key(r)
    try:
        t, hdr = decode_tensor(store.get(key), where=f"{store.uri}/{key}")
    except ObjectNotFound:
        raise PolicyUnavailable(f"{key} is gone") from None
    expect = {
        "kind": KIND_BASE,
        "run_id": run_id,
        "round": r,
        "layout_hash": lay.digest,
        "numel": lay.numel,
    }
    bad = {k: hdr.get(k) for k, v in expect.items() if hdr.get(k) != v}
    if bad or t.dtype != torch.float32 or t.numel() != lay.numel:
        raise CorruptObjectError(f"{key}: not this run's round {r} base for this model ({bad})")
    if not wirefmt.finite(t):
        raise CorruptObjectError(f"{key}: holds NaN/Inf values")
    return t


class PolicyReader:
    """Worker side: load trainer rank's newest version into a model and acknowledge it."""

    def __init__(self, store: RunStore, rank: int, worker: int, *, run_id: str, wire: str):
        self.store = store
        self.rank = rank
        self.worker = worker
        self.run_id = run_id
        self.wire = wire
        self.version: int | None = None
        self.digest: str | None = None
        self._bases: dict[int, torch.Tensor] = {}

    def newest(self) -> int | None:
        versions = list_versions(self.store, self.rank)
        return versions[-1] if versions else None

    def read(self, step: int, lay: PolicyLayout) -> tuple[torch.Tensor, str]:
        """Version ``step`` reconstructed (fp32 vector) and its digest, checked; raises
        PolicyUnavailable if it (or its base) is gone, CorruptObjectError if it is bad."""
        key = layout.policy_key(self.rank, step)
        try:
            data = self.store.get(key)
        except ObjectNotFound:
            raise PolicyUnavailable(f"{key} is gone") from None
        payload, hdr = decode_tensor(data, where=f"{self.store.uri}/{key}")
        expect = {
            "kind": KIND_DELTA,
            "run_id": self.run_id,
            "rank": self.rank,
            "step": step,
            "wire": self.wire,
            "numel": lay.numel,
            "layout_hash": lay.digest,
        }
        bad = {k: hdr.get(k) for k, v in expect.items() if hdr.get(k) != v}
        segs = _segments(lay)
        if bad or not wirefmt.wire_numel_ok(payload, self.wire, lay.numel, segs):
            raise CorruptObjectError(f"{key}: not this run's policy {step} for this model {bad}")
        if not wirefmt.all_finite(payload, self.wire, lay.numel, segs):
            raise CorruptObjectError(f"{key}: holds NaN/Inf values")
        r = int(hdr["round"])
        base = self._bases.get(r)
        if base is None:
            base = read_base(self.store, r, self.run_id, lay)
            self._bases = {r: base}  # one round's base at a time
        rebuilt = base + wirefmt.decode(payload, self.wire, lay.numel, segments=segs)
        digest = weights_digest(rebuilt)
        if digest != hdr.get("digest"):
            raise CorruptObjectError(
                f"{key}: the weights rebuilt from it are not those its trainer published"
            )
        return rebuilt, digest

    def load(self, model: torch.nn.Module, step: int | None = None) -> int:
        """Load version ``step`` (default: the newest) into ``model``, acknowledge it; the
        version loaded. PolicyUnavailable when there is none yet or it went meanwhile."""
        step = self.newest() if step is None else step
        if step is None:
            raise PolicyUnavailable(f"trainer {self.rank} has published no policy yet")
        vector, digest = self.read(step, PolicyLayout.of(model))
        load_into(model, vector)
        self.version, self.digest = step, digest
        self.ack()
        return step

    def ack(self) -> None:
        if self.version is None:
            return
        record = layout.PolicyAck(
            worker=self.worker, step=self.version, digest=self.digest or "", loaded_at=time.time()
        )
        self.store.put_json(layout.policy_ack_key(self.rank, self.worker), record.to_dict())

    def release(self) -> None:
        """Hold nothing any more (the worker ends): its acknowledgement goes."""
        self.store.delete(layout.policy_ack_key(self.rank, self.worker))
