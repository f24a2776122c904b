"""Weights out (crf/rollouts/policy.py): publish and read are bit-exact on every wire, on a
file/memory store and on S3 (moto); acknowledgement-based deletion; bad objects refused."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from crf import layout
from crf.exchange import codecs as wirefmt
from crf.rollouts import RolloutConfig
from crf.rollouts.policy import (
    PolicyLayout,
    PolicyPublisher,
    PolicyReader,
    PolicyUnavailable,
    flat_weights,
    list_versions,
    read_acks,
    weights_digest,
)
from crf.store import CorruptObjectError, RunStore
from tests import cloud_servers

moto_s3 = cloud_servers.moto_s3
s3_env = cloud_servers.s3_env

RUN = "run-test"
WIRES = wirefmt.codec_names()  # every wire: float32, bfloat16, float16, int8, topk2/4/8


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def step(model: torch.nn.Module, seed: int) -> None:
    """An 'optimizer step': a small change of every weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def publisher(store: RunStore, rank: int = 0, **kw) -> PolicyPublisher:
    cfg = RolloutConfig(workers=1, **kw)
    return PolicyPublisher(store, rank, cfg, run_id=RUN, sync_every=4)


def reader(store: RunStore, wire: str, rank: int = 0, worker: int = 0) -> PolicyReader:
    return PolicyReader(store, rank, worker, run_id=RUN, wire=wire)


def check_exact(store: RunStore, wire: str) -> None:
    trainer, worker = tiny(0), tiny(1)
    pub = publisher(store, wire=wire)
    pub.start_round(0, trainer)
    base = flat_weights(trainer)
    pub.publish(0, trainer)
    step(trainer, 1)
    digest = pub.publish(1, trainer)

    rd = reader(store, wire)
    assert rd.load(worker) == 1
    # what the worker holds is bit for bit base + decode(delta), as the publisher computed it
    lay = PolicyLayout.of(trainer)
    segs = [s for s in (int(torch.Size(sh).numel()) for sh in lay.shapes) if s]
    delta = flat_weights(trainer) - base
    expected = base + wirefmt.decode(wirefmt.encode(delta, wire, segs), wire, lay.numel,
                                     segments=segs)  # fmt: skip
    got = flat_weights(worker)
    assert torch.equal(got, expected)
    assert weights_digest(got) == digest == rd.digest == pub.expected_digest(1)
    if wire == "float32":  # the exact wire: the trainer's weights up to one fp32 rounding
        torch.testing.assert_close(got, flat_weights(trainer), rtol=0, atol=1e-6)
    ack = layout.PolicyAck.from_dict(store.get_json(layout.policy_ack_key(0, 0)))
    assert (ack.worker, ack.step, ack.digest) == (0, 1, digest)


@pytest.mark.parametrize("wire", WIRES)
def test_publish_and_read_are_bit_exact(store: RunStore, wire: str) -> None:
    check_exact(store, wire)


@pytest.mark.parametrize("wire", ["float32", "int8"])
def test_publish_and_read_are_bit_exact_on_s3(s3_env: cloud_servers.MotoS3, wire: str) -> None:
    bucket = s3_env.new_bucket()
    store = RunStore(f"s3://{bucket}/run", storage_options={"skip_instance_cache": True})
    check_exact(store, wire)
    # listing caches are off: a version published after a listing is seen by the next one
    other = RunStore(f"s3://{bucket}/run", storage_options={"skip_instance_cache": True})
    assert list_versions(other, 0) == [0, 1]
    pub = publisher(store, wire=wire)
    pub.start_round(0, tiny(3))
    pub.publish(7, tiny(3))  # and deletes 0 (1 is held by worker 0's ack)
    assert list_versions(other, 0) == [1, 7]


def test_listing_caches_are_off(s3_env: cloud_servers.MotoS3) -> None:
    """The run store's S3 filesystem never caches a listing (workers would miss versions)."""
    store = RunStore(f"s3://{s3_env.new_bucket()}/run")
    assert store.fs.dircache.use_listings_cache is False


def test_a_later_trainer_publishes_against_the_stored_base(store: RunStore) -> None:
    """Round 0's base is the first writer's; a trainer whose weights differ still publishes
    deltas its workers rebuild exactly."""
    a, b = tiny(0), tiny(5)
    pa, pb = publisher(store, 0, wire="float32"), publisher(store, 1, wire="float32")
    pa.start_round(0, a)
    pb.start_round(0, b)  # lost the create-if-absent: reads a's base back
    digest = pb.publish(0, b)
    worker = tiny(9)
    reader(store, "float32", rank=1, worker=1).load(worker)
    assert weights_digest(flat_weights(worker)) == digest
    torch.testing.assert_close(flat_weights(worker), flat_weights(b), rtol=0, atol=1e-6)


def test_deletion_waits_for_acks_and_the_staleness_bound(store: RunStore) -> None:
    model = tiny(0)
    pub = publisher(store, wire="bfloat16", max_staleness=1)
    pub.start_round(0, model)
    pub.publish(0, model)
    pub.publish(1, model)
    rd = reader(store, "bfloat16", worker=3)
    rd.load(tiny(1), 1)  # worker 3 holds version 1
    for s in range(2, 6):
        step(model, s)
        pub.publish(s, model)
    # 0: deleted (old, unheld); 1: held; 2, 3: more than 1 step behind 5; 4: within the
    # bound; 5: the newest
    assert list_versions(store, 0) == [1, 4, 5]
    assert [a.step for a in read_acks(store, 0)] == [1]
    assert pub.expected_digest(2) is None and pub.expected_digest(4) is not None

    rd.load(tiny(1))  # the worker moves on to the newest: version 1 is no longer held
    assert rd.version == 5
    pub.collect(5)
    assert list_versions(store, 0) == [4, 5]  # 4 still within the bound
    pub.collect(7)
    assert list_versions(store, 0) == [5]  # the newest stays, whatever its age and acks
    rd.release()
    pub.close()
    assert list_versions(store, 0) == [] and read_acks(store, 0) == []


def test_a_restarted_trainer_drops_what_an_earlier_attempt_published_ahead(
    store: RunStore,
) -> None:
    model = tiny(0)
    first = publisher(store, wire="bfloat16", max_staleness=4)
    first.start_round(0, model)
    for s in range(0, 8):
        first.publish(s, model)
    assert list_versions(store, 0) == [3, 4, 5, 6, 7]
    again = publisher(store, wire="bfloat16", max_staleness=4)  # resumed at step 4
    assert again.drop_after(4) == [5, 6, 7]
    again.start_round(1, model)
    again.publish(4, model)
    assert list_versions(store, 0) == [3, 4]
    assert again.knows(4) and not again.knows(3)


def test_a_version_gone_meanwhile_is_unavailable(store: RunStore) -> None:
    model = tiny(0)
    pub = publisher(store, wire="float32")
    rd = reader(store, "float32")
    with pytest.raises(PolicyUnavailable):
        rd.load(tiny(1))  # nothing published yet
    pub.start_round(0, model)
    pub.publish(0, model)
    with pytest.raises(PolicyUnavailable):
        rd.load(tiny(1), 3)
    store.delete(layout.policy_base_key(0))
    with pytest.raises(PolicyUnavailable):
        rd.load(tiny(1), 0)


def test_bad_objects_are_refused(store: RunStore) -> None:
    model = tiny(0)
    pub = publisher(store, wire="bfloat16")
    pub.start_round(0, model)
    pub.publish(0, model)
    key = layout.policy_key(0, 0)
    good = store.get(key)
    flipped = bytearray(good)
    flipped[-3] ^= 0x40
    store.put(key, bytes(flipped))
    with pytest.raises(CorruptObjectError, match="checksum"):
        reader(store, "bfloat16").load(tiny(1), 0)
    store.put(key, good[:-8])
    with pytest.raises(CorruptObjectError, match="truncated"):
        reader(store, "bfloat16").load(tiny(1), 0)
    store.put(key, good)
    other_run = PolicyReader(store, 0, 0, run_id="another", wire="bfloat16")
    with pytest.raises(CorruptObjectError, match="not this run"):
        other_run.load(tiny(1), 0)
    with pytest.raises(CorruptObjectError, match="not this run"):
        reader(store, "int8").load(tiny(1), 0)  # another wire
    bigger = torch.nn.Sequential(torch.nn.Linear(7, 14), torch.nn.Tanh(), torch.nn.Linear(14, 3))
    with pytest.raises(CorruptObjectError):
        reader(store, "bfloat16").load(bigger, 0)  # another model


def test_a_delta_the_wire_cannot_carry_is_refused_before_upload(store: RunStore) -> None:
    model = tiny(0)
    pub = publisher(store, wire="float16")
    pub.start_round(0, model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = 1e6  # overflows float16
    with pytest.raises(ValueError, match="rollout-wire"):
        pub.publish(1, model)
    assert list_versions(store, 0) == []


def test_only_the_adapter_is_published_under_lora(store: RunStore) -> None:
    peft = pytest.importorskip("peft")
    from crf.composer import char_tokenizer, tiny_qwen2

    def lora(seed: int):
        base = tiny_qwen2(char_tokenizer("abc="), seed=0, hidden_size=16, num_layers=1,
                          num_heads=2)  # fmt: skip
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(base, config)

    trainer, worker = lora(1), lora(2)
    lay = PolicyLayout.of(trainer)
    assert lay.names and all("lora_" in n for n in lay.names)
    pub = publisher(store, wire="float32")
    pub.start_round(0, trainer)
    digest = pub.publish(0, trainer)
    reader(store, "float32").load(worker)
    assert weights_digest(flat_weights(worker)) == digest
    for (n, p), (_, q) in zip(trainer.named_parameters(), worker.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_run_ids_stay_apart() -> None:
    """Two runs in one bucket folder never read each other's versions (keys are per run)."""
    a = RunStore(f"memory://crf-test/{uuid.uuid4().hex}")
    pub = publisher(a, wire="float32")
    pub.start_round(0, tiny(0))
    pub.publish(0, tiny(0))
    with pytest.raises(CorruptObjectError):
        PolicyReader(a, 0, 0, run_id="other-run", wire="float32").load(tiny(1))


def _trained(store: RunStore, publish_every: int, steps: int, **ctx: Any) -> Any:
    """A trainer's rollout hooks (an outer step every 4 steps) driven through ``steps``
    inner steps of a tiny model; ``ctx``: more of the replica context (``total_steps``)."""
    from types import SimpleNamespace

    from crf.rollouts.replica import TrainerRollouts

    spec = SimpleNamespace(run_id="r", sync_every=4, sync_period=4, rollout_workers=1,
                           publish_every=publish_every, max_staleness=9,
                           rollout_wire="float32")  # fmt: skip
    context = SimpleNamespace(spec=spec, store=store, rank=0, world_size=1, step=0, **ctx)
    hooks = TrainerRollouts(context, [{"prompt": "p"}], RolloutConfig.from_spec(spec))
    model = tiny(0)
    hooks.begin(model, 0)
    for s in range(1, steps + 1):
        step(model, s)
        hooks.step_end(model, s)
    return hooks


def test_a_trainer_publishes_after_every_outer_step(store: RunStore) -> None:
    """With --publish-every 3 and an outer step every 4 steps, the weights after each outer
    step are published too: the rollouts of earlier versions are out of bounds then, and
    workers would otherwise have nothing to generate with until the next publish."""
    hooks = _trained(store, publish_every=3, steps=9)
    published = [v for v in range(10) if hooks.publisher.knows(v)]
    assert published == [0, 3, 4, 6, 8, 9]


def test_a_trainer_publishes_nothing_after_its_last_step(store: RunStore) -> None:
    """The weights after the last step (here also an outer step's) serve no generation: no
    version and no base of a round that never comes go to the store."""
    hooks = _trained(store, publish_every=1, steps=8, total_steps=8)
    assert [v for v in range(9) if hooks.publisher.knows(v)][-1] == 7
    assert sorted(store.list(f"{layout.POLICY}/base")) == ["0", "1"]
