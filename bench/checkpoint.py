"""Benchmark: what a checkpoint every round costs the training thread, and how fast its
writer writes, each against the plain operation on the same bytes measured in the same run.

N replica processes train a model of P MB of fp32 weights under ``ReplicaContext.diloco``
(the real torchft DiLoCo, manager, exchange and checkpoint writer) with AdamW as the inner
optimizer, through a file:// store, with ``checkpoint_every`` 1: every round the lowest
replica snapshots the global state (weights, the global copy and the outer momentum: 3 P)
and every replica its inner state (AdamW's two moments: 2 P). An inner step is a sleep of
``--step-ms`` (device work, on a GPU) and then the AdamW step on the CPU.

Per replica it prints:

* ``blocked s/round`` - the training thread's part of the checkpoints (``foreground_s``:
  waiting for the previous write from the reused buffers, and copying into them), against
  ``copy s/round``: a plain ``copy_`` of the same number of bytes between two warm host
  buffers (the floor of any snapshot), and ``clone``: the same copy into new memory (what a
  snapshot that allocates pays). Target: blocked / copy <= 1.5.
* ``writer MB/s`` - the checkpoint writer's bytes (global and inner objects) over its busy
  time (serialization, checksum, write with fsync), against ``plain MB/s``: the same bytes
  written from memory to a file in the same folder, with fsync. Target: writer / plain >=
  0.7.

Usage::

    python bench/checkpoint.py                       # P = 340 MB, N = 2, 3 rounds
    python bench/checkpoint.py --mb 64 --rounds 2    # a quick look
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 1 << 20


def _worker(uri: str, folder: str, rank: int, n: int, args: dict[str, Any], out: Any) -> None:
    import torch

    from crf.replica.context import ReplicaContext
    from crf.spec import RunSpec
    from crf.store import RunStore

    numel = args["mb"] * MB // 4 // args["tensors"]
    torch.manual_seed(0)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(numel) * 0.01) for _ in range(args["tensors"])]
    )
    grads = [torch.full((numel,), 1e-3 * (rank + 1)) for _ in range(args["tensors"])]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = RunStore(uri)
    spec = RunSpec.from_json(store.get("run.json"))
    ctx = ReplicaContext(store, spec, rank, n, shard_grace_s=30.0)
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:
            time.sleep(args["step_s"])
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            opt.step()
            ctx.log_step(loss=0.0)
    ctx.finish({})
    ck = ctx.manager.checkpoints
    rounds = spec.rounds
    snap_bytes = (ck._global_buffers.nbytes * (rank == 0)) + ck._inner_buffers.nbytes
    written = ck.bytes_up + ck.inner_bytes_up
    copy_s, clone_s = _plain_copy_s(snap_bytes)
    plain_mbps = _plain_write_mbps(folder, written // max(1, rounds), rank)
    out.put(
        {
            "rank": rank,
            "blocked": ck.foreground_s / rounds,
            "copy": copy_s,
            "clone": clone_s,
            "snap_mb": snap_bytes / MB,
            "writer_mbps": written / MB / max(ck.writer.seconds, 1e-9),
            "plain_mbps": plain_mbps,
            "written_mb": written / MB,
            "sha": ctx.result("ok", None, {})["weights_sha256"],
        }
    )


def _plain_copy_s(nbytes: int, repeat: int = 3) -> tuple[float, float]:
    """(seconds of a ``copy_`` of ``nbytes`` between two warm host buffers, seconds of the
    same copy into newly allocated memory), the best of ``repeat``."""
    import torch

    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm: its pages are mapped, as a reused buffer's are
    best, best_clone = float("inf"), float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh = src.clone()
        best_clone = min(best_clone, time.perf_counter() - t0)
        del fresh
    return best, best_clone


def _plain_write_mbps(folder: str, nbytes: int, rank: int) -> float:
    """MB/s of writing ``nbytes`` from memory to a new file in ``folder`` with fsync (what
    the store's put does around the bytes), in 64 MB writes."""
    data = memoryview(bytearray(os.urandom(MB)) * max(1, nbytes // MB))
    path = os.path.join(folder, f"plain-{rank}.bin")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        view = data
        while view:
            view = view[f.write(view[: 64 * MB]) :]
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return data.nbytes / MB / seconds


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from crf.spec import RunSpec
    from crf.store import RunStore

    folder = tempfile.mkdtemp(prefix="crf-ckpt-bench-", dir=args.dir)
    uri = f"file://{folder}/run"
    spec = RunSpec(
        run_id="ckpt-bench",
        run_uri=uri,
        replicas=args.replicas,
        sync_every=args.sync_every,
        rounds=args.rounds,
        round_timeout_s=600,
        checkpoint_every=1,
        keep_rounds=1,
    ).validate()
    RunStore(uri).put_if_absent("run.json", spec.to_json().encode())
    wargs = {"mb": args.mb, "tensors": args.tensors, "step_s": args.step_ms / 1000}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(uri, folder, r, args.replicas, wargs, out))
        for r in range(args.replicas)
    ]
    for p in procs:
        p.start()
    rows = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(60)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2, help="N")
    ap.add_argument("--mb", type=int, default=340, help="model size P in MB (fp32)")
    ap.add_argument("--tensors", type=int, default=16, help="parameter tensors in the model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=3, help="inner steps per round (H)")
    ap.add_argument("--step-ms", type=float, default=1000, help="an inner step's device time")
    ap.add_argument("--dir", default=None, help="folder for the store (default: the temp dir)")
    args = ap.parse_args()
    rows = run(args)
    print(
        f"P = {args.mb} MB fp32, N = {args.replicas}, H = {args.sync_every}, "
        f"{args.rounds} rounds, a global and an inner state every round (file store)"
    )
    print(
        f"{'rank':>4} {'snap MB':>8} {'blocked s/round':>16} {'copy s':>7} {'clone s':>8} "
        f"{'blocked/copy':>12} {'writer MB/s':>12} {'plain MB/s':>11} {'writer/plain':>12}"
    )
    for r in rows:
        print(
            f"{r['rank']:>4} {r['snap_mb']:>8.0f} {r['blocked']:>16.3f} {r['copy']:>7.3f} "
            f"{r['clone']:>8.3f} {r['blocked'] / r['copy']:>12.2f} {r['writer_mbps']:>12.0f} "
            f"{r['plain_mbps']:>11.0f} {r['writer_mbps'] / r['plain_mbps']:>12.2f}"
        )
    worst = max(r["blocked"] / r["copy"] for r in rows)
    slowest = min(r["writer_mbps"] / r["plain_mbps"] for r in rows)
    same = len({r["sha"] for r in rows}) == 1
    print(
        f"worst blocked/copy {worst:.2f} (target <= 1.5), "
        f"worst writer/plain {slowest:.2f} (target >= 0.7); "
        f"replicas end with the same weights: {same}"
    )
    print(f"mean blocked s/round {statistics.mean(r['blocked'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
