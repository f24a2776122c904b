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
  waiting for the previous write from the reused buffers - ``of it wait``, the writer
  slower than a round - and copying into them), per round
  after the first (``first s``: the round that allocates the buffers), against ``copy s``: a
  plain ``copy_`` of the same number of bytes between two warm host buffers (the floor of
  any snapshot), timed on the training thread right after each round's snapshot, and
  ``clone s``: the same copy into new memory after the run (what a snapshot that allocates
  pays). Target: blocked / copy <= 1.5.
* ``writer MB/s`` - the checkpoint writer's own path (serialization, checksum, write with
  fsync) over this replica's last snapshot, after the run, one replica at a time, against
  ``plain MB/s``: the same bytes written from memory to files in the same folder, with
  fsync, right after. Target: writer / plain >= 0.7. ``in run MB/s`` is the writer's bytes
  over its busy time during the run, where it shares the disk and the cores with the
  exchange and the other replica.

Usage::

    python bench/checkpoint.py                       # P = 340 MB, N = 2, 4 rounds
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


def _worker(
    uri: str, folder: str, rank: int, n: int, args: dict[str, Any], out: Any, lock: Any
) -> None:
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
    blocked = [0.0]  # the checkpoints' foreground seconds after each round
    waited = [0.0]  # the part of it that waited for the previous write
    copies: list[float] = []  # a plain copy of the snapshot's bytes after each round
    chunks: dict[str, Any] = {}
    with ctx.diloco(model, opt):
        ck = ctx.manager.checkpoints
        while ctx.step < ctx.total_steps:
            time.sleep(args["step_s"])
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            opt.step()
            ctx.log_step(loss=0.0)
            if ctx.step % spec.sync_every == 0:
                blocked.append(ck.foreground_s)
                waited.append(ck.wait_s)
                # the plain copy of as many bytes, now: under the same load as the snapshot
                nbytes = ck._global_buffers.nbytes + ck._inner_buffers.nbytes
                copies.append(_plain_copy_s(nbytes, chunks))
        per_round = [b - a for a, b in zip(blocked, blocked[1:], strict=False)]
        waits = [b - a for a, b in zip(waited, waited[1:], strict=False)]
        writer_s = ck.writer.seconds
        written = ck.bytes_up + ck.inner_bytes_up
        ctx.manager.drain()
        with lock:  # one replica at a time: the writer's path against a plain write, alone
            alone = _writer_alone(ctx, folder, rank == 0)
    ctx.finish({})
    snap_bytes = ck._global_buffers.nbytes + ck._inner_buffers.nbytes
    copy_s = statistics.mean(copies[1:] or copies)
    clone_s = _clone_s(snap_bytes)
    out.put(
        {
            "rank": rank,
            "first": per_round[0],
            "blocked": statistics.mean(per_round[1:] or per_round),
            "waited": statistics.mean(waits[1:] or waits),
            "copy": copy_s,
            "clone": clone_s,
            "snap_mb": snap_bytes / MB,
            "run_mbps": written / MB / max(writer_s, 1e-9),
            **alone,
            "sha": ctx.result("ok", None, {})["weights_sha256"],
        }
    )


def _writer_alone(ctx: Any, folder: str, writes_global: bool) -> dict[str, float]:
    """The checkpoint writer's path - serialization, checksum, write with fsync - over this
    replica's last snapshot (the global state if it writes one, and its inner state), timed
    alone, and a plain write of the same sizes from memory to files in the same folder with
    fsync; the best of two each."""
    from crf.exchange import global_state

    ck = ctx.manager.checkpoints
    writes = []
    if writes_global:
        flat = global_state.flatten(ctx.manager.state_dict(), ck._global_buffers)
        meta = {"round": 10**6, "run_id": "bench", "layout": ck.layout}
        writes.append(lambda: ck.store.put("bench/global", global_state.encode_parts(flat, meta)))
    inner = ck.inner_write(10**6, ctx._inner.state_dict(), ctx.step)
    before = ck.inner_bytes_up
    writes.append(inner)
    writer_s = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for w in writes:
            w()
        writer_s = min(writer_s, time.perf_counter() - t0)
    inner_bytes = (ck.inner_bytes_up - before) // 2
    sizes = [inner_bytes]
    if writes_global:
        sizes.append(ck.store.fs.size(ck.store.path("bench/global")))
    plain_s = min(_plain_write_s(folder, sizes) for _ in range(2))
    return {
        "written_mb": sum(sizes) / MB,
        "writer_mbps": sum(sizes) / MB / writer_s,
        "plain_mbps": sum(sizes) / MB / plain_s,
    }


def _plain_copy_s(nbytes: int, chunks: dict[str, Any]) -> float:
    """Seconds of a ``copy_`` of ``nbytes`` between two warm host buffers (their pages
    mapped, as a reused buffer's are), 256 MB at a time (``chunks`` keeps the two)."""
    import torch

    if "src" not in chunks:
        chunks["src"] = torch.ones(64 * MB)
        chunks["dst"] = torch.ones(64 * MB)
    src, dst = chunks["src"], chunks["dst"]
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, 256 * MB) // 4
        dst[:n].copy_(src[:n])
        left -= 256 * MB
    return time.perf_counter() - t0


def _clone_s(nbytes: int) -> float:
    """Seconds of the same copy into newly allocated memory (how a snapshot that allocates
    pays: page faults on every new page)."""
    import torch

    src = torch.ones(max(1, nbytes // 4))
    t0 = time.perf_counter()
    fresh = src.clone()
    seconds = time.perf_counter() - t0
    del fresh
    return seconds


def _plain_write_s(folder: str, sizes: list[int]) -> float:
    """Seconds to write files of ``sizes`` bytes from memory to ``folder``, each with fsync
    (what the store's put does around the bytes), in 64 MB writes."""
    data = memoryview(bytearray(os.urandom(MB)) * max(1, max(sizes) // MB + 1))
    seconds = 0.0
    for i, n in enumerate(sizes):
        path = os.path.join(folder, f"plain-{os.getpid()}-{i}.bin")
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            view = data[:n]
            while view:
                view = view[f.write(view[: 64 * MB]) :]
            os.fsync(f.fileno())
        seconds += time.perf_counter() - t0
        os.unlink(path)
    return seconds


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
    lock = ctx.Lock()
    procs = [
        ctx.Process(target=_worker, args=(uri, folder, r, args.replicas, wargs, out, lock))
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
    ap.add_argument("--rounds", type=int, default=4)
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
        f"{'rank':>4} {'snap MB':>8} {'first s':>8} {'blocked s/round':>16} {'of it wait':>10} "
        f"{'copy s':>7} "
        f"{'clone s':>8} {'blocked/copy':>12} {'in run MB/s':>12} {'writer MB/s':>12} "
        f"{'plain MB/s':>11} {'writer/plain':>12}"
    )
    for r in rows:
        print(
            f"{r['rank']:>4} {r['snap_mb']:>8.0f} {r['first']:>8.3f} {r['blocked']:>16.3f} "
            f"{r['waited']:>10.3f} "
            f"{r['copy']:>7.3f} {r['clone']:>8.3f} {r['blocked'] / r['copy']:>12.2f} "
            f"{r['run_mbps']:>12.0f} {r['writer_mbps']:>12.0f} {r['plain_mbps']:>11.0f} "
            f"{r['writer_mbps'] / r['plain_mbps']:>12.2f}"
        )
    worst = max(r["blocked"] / r["copy"] for r in rows)
    copying = max((r["blocked"] - r["waited"]) / r["copy"] for r in rows)
    slowest = min(r["writer_mbps"] / r["plain_mbps"] for r in rows)
    same = len({r["sha"] for r in rows}) == 1
    print(
        f"worst blocked/copy {worst:.2f} (target <= 1.5; without the waits for the previous "
        f"write {copying:.2f}), "
        f"worst writer/plain {slowest:.2f} (target >= 0.7); "
        f"replicas end with the same weights: {same}"
    )
    print(f"mean blocked s/round {statistics.mean(r['blocked'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
