"""A replica entrypoint for fault tests: the real ``python -m crf.replica``, with faults that
only a test wants, switched on by environment variables the driver passes to every replica.

Run as ``python tests/replica_shim.py`` (``crf launch --entrypoint``). It then runs
``crf.replica.__main__.main()`` unchanged, after installing:

* ``CRF_TEST_FLAKY`` - store requests that fail or stall (``flaky_store.install_from_env``);
* ``CRF_TEST_SLOW`` - a straggler: JSON ``{"rank": R, "from_step": a, "to_step": b,
  "sleep_s": s}`` makes rank R sleep ``s`` after each inner step ``a..b``;
* ``CRF_TEST_CORRUPT`` - bad objects: a JSON list of ``{"rank": R, "round": r, "kind": K}``;
  rank R publishes a bad ``rounds/<r>/contrib/<R>/<s>`` of kind K, where s = (R + 1) mod N
  (a part R uploads: its own shard's part never leaves it): ``truncate``, ``bitflip``,
  ``shape`` (one value short, otherwise valid), ``foreign_run`` (another run's id) or
  ``old_round`` (the previous round's number) - all with valid checksums except the first two.

``CRF_FAULT`` (SIGKILL at a named point) needs no shim: ``crf.replica.faults`` reads it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

KINDS = ("truncate", "bitflip", "shape", "foreign_run", "old_round")


def corrupt(data: bytes, kind: str) -> bytes:
    """A bad version of an encoded contribution shard."""
    from crf.store import decode_tensor, encode_tensor

    if kind == "truncate":
        return data[: len(data) // 2]
    if kind == "bitflip":
        bad = bytearray(data)
        bad[-1] ^= 0x01
        return bytes(bad)
    t, header = decode_tensor(data)
    meta = {k: v for k, v in header.items() if k not in ("dtype", "shape")}
    if kind == "shape":
        return encode_tensor(t[:-1].clone(), meta)
    if kind == "foreign_run":
        return encode_tensor(t, {**meta, "run_id": "another-run"})
    if kind == "old_round":
        return encode_tensor(t, {**meta, "round": int(meta["round"]) - 1})
    raise ValueError(f"unknown corruption kind {kind!r}; one of {KINDS}")


def install_slow(rank: int) -> None:
    spec = json.loads(os.environ.get("CRF_TEST_SLOW") or "null")
    if not spec or int(spec["rank"]) != rank:
        return
    from crf.replica.context import ReplicaContext

    log_step = ReplicaContext.log_step

    def slow_log_step(self: ReplicaContext, *args: Any, **kwargs: Any) -> None:
        if spec["from_step"] <= self.step <= spec["to_step"]:
            time.sleep(float(spec["sleep_s"]))
        log_step(self, *args, **kwargs)

    ReplicaContext.log_step = slow_log_step  # type: ignore[method-assign]


def install_corrupt(rank: int) -> None:
    specs = [s for s in json.loads(os.environ.get("CRF_TEST_CORRUPT") or "[]") if s["rank"] == rank]
    if not specs:
        return
    from crf.replica.allreduce import ObjectStoreAllReduce

    shard = (rank + 1) % int(os.environ["CRF_WORLD_SIZE"])
    targets = {f"rounds/{s['round']}/contrib/{rank}/{shard}": s["kind"] for s in specs}
    put = ObjectStoreAllReduce._put

    def bad_put(self: ObjectStoreAllReduce, res: Any, key: str, data: bytes, **kw: Any) -> bool:
        if key in targets:
            if isinstance(data, list):  # encode_tensor_parts: buffers written one after another
                data = b"".join(data)
            data = corrupt(data, targets[key])
            print(f"[replica_shim] published a bad {key} ({targets[key]})", flush=True)
        return put(self, res, key, data, **kw)

    ObjectStoreAllReduce._put = bad_put  # type: ignore[method-assign]


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import flaky_store

    rank = int(os.environ.get("CRF_RANK", "-1"))
    flaky_store.install_from_env()
    install_slow(rank)
    install_corrupt(rank)
    from crf.replica.__main__ import main as replica_main

    return replica_main()


if __name__ == "__main__":
    sys.exit(main())
