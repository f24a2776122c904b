"""A replica entrypoint for fault tests: the real ``python -m crf.replica``, with faults that
only a test wants, switched on by environment variables the driver passes to every replica.

Run as ``python tests/replica_shim.py`` (``crf launch --entrypoint``). It then runs
``crf.replica.__main__.main()`` unchanged, after installing:

* ``CRF_TEST_FLAKY`` - store requests that fail or stall (``flaky_store.install_from_env``);
* ``CRF_TEST_SLOW`` - a straggler: JSON ``{"rank": R, "from_step": a, "to_step": b,
  "sleep_s": s}`` makes rank R sleep ``s`` after each inner step ``a..b`` (a list of such
  specs adds up; rank ``"*"`` is every rank: rounds that take a while);
* ``CRF_TEST_CORRUPT`` - bad objects: a JSON list of ``{"rank": R, "round": r, "kind": K}``;
  rank R publishes a bad frame for shard s = (R + 1) mod N in its contribution object
  ``rounds/<r>/contrib/<R>.*`` (named ``rounds/<r>/contrib/<R>#<s>``; a part R uploads: its
  own shard's part never leaves it), of kind K: ``truncate`` (the frame's header says it
  is longer than it is), ``bitflip``, ``shape`` (one value short, otherwise valid),
  ``foreign_run`` (another run's id) or ``old_round`` (the previous round's number) - all
  with valid checksums except the first two. The bad frame keeps its length, so the other
  frames of the object stay where readers look for them.

* ``CRF_TEST_JOB_SET`` - a replica set up unlike the others: JSON ``{"rank": R, "set":
  {option: value}}`` makes rank R build its job with these options over the run's (e.g. another
  ``hidden_size``: a model the others do not have).

``CRF_FAULT`` (SIGKILL at a named point) needs no shim: ``crf.faults`` reads it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from typing import Any

KINDS = ("truncate", "bitflip", "shape", "foreign_run", "old_round")


_FIXED = struct.Struct("<8sIQ32s")  # the tensor codec's frame header (crf.store.codec)


def corrupt(frame: bytes, kind: str) -> bytes:
    """A bad version of one encoded shard frame, of the same length."""
    from crf.store import decode_tensor
    from crf.store.codec import encode_tensor_parts

    magic, hlen, plen, digest = _FIXED.unpack_from(frame)
    if kind == "truncate":  # as if the writer was cut short: the header claims more
        return _FIXED.pack(magic, hlen, plen + 4, digest) + frame[_FIXED.size :]
    if kind == "bitflip":
        bad = bytearray(frame)
        bad[-1] ^= 0x01
        return bytes(bad)
    t, header = decode_tensor(frame)
    meta = {k: v for k, v in header.items() if k not in ("dtype", "shape")}
    if kind == "shape":  # the value dropped goes to the header's padding
        t, hlen = t[:-1].clone(), hlen + t.element_size()
    elif kind == "foreign_run":
        meta["run_id"] = "another-run"
    elif kind == "old_round":
        meta["round"] = int(meta["round"]) - 1
    else:
        raise ValueError(f"unknown corruption kind {kind!r}; one of {KINDS}")
    out = b"".join(bytes(p) for p in encode_tensor_parts(t, meta, header_bytes=hlen))
    assert len(out) == len(frame)
    return out


def corrupt_shard_frame(obj: bytes, index: int, kind: str) -> bytes:
    """``obj`` (a packed contribution) with its ``index``-th shard frame made bad."""
    from crf.exchange.contribution import manifest_length
    from crf.store.codec import MAGIC

    pos = obj.index(MAGIC, manifest_length(obj, "contribution"))  # the manifest's pad ends
    for _ in range(index):
        _, hlen, plen, _ = _FIXED.unpack_from(obj, pos)
        pos += _FIXED.size + hlen + plen
    _, hlen, plen, _ = _FIXED.unpack_from(obj, pos)
    end = pos + _FIXED.size + hlen + plen
    return obj[:pos] + corrupt(obj[pos:end], kind) + obj[end:]


def install_slow(rank: int) -> None:
    specs = json.loads(os.environ.get("CRF_TEST_SLOW") or "[]")
    specs = [specs] if isinstance(specs, dict) else specs
    mine = [s for s in specs if s["rank"] == "*" or int(s["rank"]) == rank]
    if not mine:
        return
    from crf.replica.context import ReplicaContext

    log_step = ReplicaContext.log_step

    def slow_log_step(self: ReplicaContext, *args: Any, **kwargs: Any) -> None:
        for spec in mine:
            if spec["from_step"] <= self.step <= spec["to_step"]:
                time.sleep(float(spec["sleep_s"]))
        log_step(self, *args, **kwargs)

    ReplicaContext.log_step = slow_log_step  # type: ignore[method-assign]


def install_corrupt(rank: int) -> None:
    specs = [s for s in json.loads(os.environ.get("CRF_TEST_CORRUPT") or "[]") if s["rank"] == rank]
    if not specs:
        return
    from crf.exchange.allreduce import ObjectStoreAllReduce

    world = int(os.environ["CRF_WORLD_SIZE"])
    shard = (rank + 1) % world
    # the object holds a frame for every shard but the ones the rank keeps (s % N == rank)
    index = [s for s in range(world) if s % world != rank].index(shard)
    targets = {f"rounds/{s['round']}/contrib/{rank}.": s["kind"] for s in specs}
    put = ObjectStoreAllReduce._put

    def bad_put(self: ObjectStoreAllReduce, res: Any, key: str, data: bytes, **kw: Any) -> bool:
        kind = next((k for prefix, k in targets.items() if key.startswith(prefix)), None)
        if kind is not None:
            if isinstance(data, list):  # buffers written one after another
                data = b"".join(bytes(d) for d in data)
            data = corrupt_shard_frame(data, index, kind)
            print(f"[replica_shim] published a bad {key}#{shard} ({kind})", flush=True)
        return put(self, res, key, data, **kw)

    ObjectStoreAllReduce._put = bad_put  # type: ignore[method-assign]


def install_job_set(rank: int) -> None:
    spec = json.loads(os.environ.get("CRF_TEST_JOB_SET") or "null")
    if not spec or int(spec["rank"]) != rank:
        return
    import crf.replica.jobs as jobs

    job_config = jobs.job_config

    def other_config(name: str, values: dict[str, Any] | None) -> Any:
        return job_config(name, {**(values or {}), **spec["set"]})

    jobs.job_config = other_config  # crf.replica.__main__ imports it when main() runs


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import flaky_store

    rank = int(os.environ.get("CRF_RANK", "-1"))
    flaky_store.install_from_env()
    install_slow(rank)
    install_corrupt(rank)
    install_job_set(rank)
    from crf.replica.__main__ import main as replica_main

    return replica_main()


if __name__ == "__main__":
    sys.exit(main())
