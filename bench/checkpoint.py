"""Benchmark: what a checkpoint every round costs the training thread, and how fast its
writer writes, each against the plain operation on the same bytes measured in the same run.

N replica processes train a model of P MB of fp32 weights under ``ReplicaContext.diloco``
(the real torchft DiLoCo, manager, exchange and checkpoint writer) with AdamW as the inner
optimizer, through a file:// store, with ``checkpoint_every`` 1: every round each replica
snapshots its part of the global state (the part whose shard it reduced, about 1/N of the
weights, the global copy and the outer momentum: 3 P / N) and its inner state (AdamW's two
moments: 2 P). An inner step is a sleep of ``--step-ms`` (device work, on a GPU) and then
the AdamW step on the CPU.

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

``--lm-run`` instead launches the built-in lm job of 85M parameters (340 MB: ``crf launch
--job lm -n 2 -H 3 -r 3 --set hidden_size=1024 --set num_layers=8 --set seq_len=16 --set
batch_size=2``) with ``--checkpoint-every 1`` and with ``--checkpoint-every 100``, the two
alternating, ``--repeats`` times each, and prints the sum over the replicas of ``sync_s`` in
result.json (the training threads' blocked time) for each, their ratio (target <= 1.2: the
median of each), the wall time and what the run folder holds at the end.

Usage::

    python bench/checkpoint.py                       # P = 340 MB, N = 2, 4 rounds
    python bench/checkpoint.py --mb 64 --rounds 2    # a quick look
    python bench/checkpoint.py --lm-run --repeats 2  # the lm run, every round vs never
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
            alone = _writer_alone(ctx, folder, rank, n)
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


def _writer_alone(ctx: Any, folder: str, rank: int, n: int) -> dict[str, float]:
    """The checkpoint writer's path - serialization, checksum, write with fsync - over this
    replica's last snapshot (its part of the global state, and its inner state), timed
    alone, and a plain write of the same sizes from memory to files in the same folder with
    fsync; the best of two each."""
    from crf import layout
    from crf.exchange import global_state

    ck = ctx.manager.checkpoints
    state = ctx.manager.state_dict()
    keep = global_state.part_names(state, rank, n)
    flat = global_state.flatten(state, ck._global_buffers, keep)
    meta = {"round": 10**6, "run_id": "bench", "layout": ck.layout, "part": rank, "parts": n}
    writes = [lambda: ck.store.put("bench/global", global_state.encode_parts(flat, meta))]
    inner = ck.inner_write(10**6, ctx._inner.state_dict(), ctx.step)
    before = ck.inner_bytes_up
    writes.append(inner)
    writer_s = float("inf")
    for _ in range(2):
        # the objects written before, deleted untimed: a write over one would also pay for
        # freeing the old file's blocks, which the plain write (to a new file) does not
        ck.store.delete("bench/global")
        ck.store.delete(layout.inner_key(ck.rank, 10**6))
        t0 = time.perf_counter()
        for w in writes:
            w()
        writer_s = min(writer_s, time.perf_counter() - t0)
    inner_bytes = (ck.inner_bytes_up - before) // 2
    sizes = [inner_bytes, ck.store.fs.size(ck.store.path("bench/global"))]
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


LM_RUN = [
    "--job", "lm", "-n", "2", "-H", "3", "-r", "3",
    "--set", "hidden_size=1024", "--set", "num_layers=8",
    "--set", "seq_len=16", "--set", "batch_size=2",
]  # fmt: skip


def _lm_once(base: str, every: int, i: int) -> dict[str, Any]:
    """One launch of the lm run with ``--checkpoint-every every``: its result.json's sum of
    sync_s over the replicas, compute_s, wall time and the run folder's size at the end."""
    import json
    import subprocess

    run_id = f"ckpt-every-{every}-{i}"
    cmd = [sys.executable, "-m", "crf.launcher.cli", "launch", *LM_RUN]
    cmd += ["--checkpoint-every", str(every), "--store", base, "--run-id", run_id]
    cmd += ["--no-progress"]
    env = dict(os.environ, CRF_LOG_LEVEL="WARNING")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the lm run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    folder = os.path.join(base, run_id)
    with open(os.path.join(folder, "result.json")) as f:
        rows = json.load(f)["replicas"]
    held = sum(
        os.path.getsize(os.path.join(d, name))
        for sub in ("global", "replicas")
        for d, _, names in os.walk(os.path.join(folder, sub))
        for name in names
    )
    return {
        "every": every,
        "sync": sum(float(r["sync_s"] or 0.0) for r in rows),
        "compute": sum(float(r["compute_s"] or 0.0) for r in rows),
        "wall": wall,
        "held_mb": held / MB,
    }


def lm_run(args: argparse.Namespace) -> None:
    """The lm run with a checkpoint every round against (nearly) never, alternating."""
    base = tempfile.mkdtemp(prefix="crf-ckpt-lm-", dir=args.dir)
    rows = []
    try:
        for i in range(args.repeats):
            for every in (1, 100) if i % 2 == 0 else (100, 1):
                rows.append(_lm_once(base, every, i))
                r = rows[-1]
                print(
                    f"--checkpoint-every {r['every']:>3}: sum of sync_s {r['sync']:6.2f} s, "
                    f"compute_s {r['compute']:6.2f} s, wall {r['wall']:6.1f} s, "
                    f"checkpoints held at the end {r['held_mb']:6.0f} MB",
                    flush=True,
                )
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    every = statistics.median(r["sync"] for r in rows if r["every"] == 1)
    never = statistics.median(r["sync"] for r in rows if r["every"] == 100)
    print(
        f"sum of sync_s, median: every round {every:.2f} s, every 100 {never:.2f} s: "
        f"ratio {every / never:.2f} (target <= 1.2)"
    )


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
    ap.add_argument(
        "--lm-run",
        action="store_true",
        help="launch the 85M-parameter lm run with --checkpoint-every 1 and 100 instead",
    )
    ap.add_argument("--repeats", type=int, default=1, help="--lm-run: launches of each")
    args = ap.parse_args()
    if args.lm_run:
        lm_run(args)
        return
    rows = run(args)
    print(
        f"P = {args.mb} MB fp32, N = {args.replicas}, H = {args.sync_every}, "
        f"{args.rounds} rounds, a global state's part and an inner state every round per "
        "replica (file store)"
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
