"""Benchmark: one all-reduce round through the store, against baselines measured in the same run.

For N replica processes and a payload of P MB (fp32) it times, per round and per replica:

* ``crf``   — ObjectStoreAllReduce (sharded reduce-scatter / all-gather through the store);
* ``floor`` — one plain write of P and one read of P per replica through the same store
              (the least any store-based exchange can move); like crf's round objects it is
              written with ``durable=False`` (no fsync on file://);
* ``naive`` — every replica uploads P and downloads every other replica's upload ((N−1)·P);
* ``gloo``  — ``torch.distributed`` all_reduce with the gloo backend among the same processes
              (needs open ports between replicas: what crf avoids).

It prints a table with seconds per round (median), bytes up / down per replica in units of P,
ratios against the floor and the naive design, and the peak extra memory of a replica in units
of P: ``mem/P`` the worst round after the first, ``1st mem/P`` the first round, which also pays
one-time costs of the store client (an S3 client loads its service model and opens its
connection pool on first use). Under the table, crf's round is broken down by phase
(``AllReduceResult.phases``: device copies, encode, upload, wait, download, decode). Usage::

    python bench/exchange.py                       # quick: N in {2,4}, P in {16,64} MB, file://
    python bench/exchange.py --full                # N in {2,4,8}, P in {16,64,256} MB
    python bench/exchange.py --stores file,s3      # s3 through a local moto server
    python bench/exchange.py --wire int8           # crf with a compressed wire format
    python bench/exchange.py --full --repeat 3     # each cell 3 times, interleaved: medians
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset the process's peak RSS (``VmHWM``) to its current RSS and return that, in bytes.

    Linux only (``/proc/self/clear_refs`` <- 5); elsewhere the lifetime peak
    (``ru_maxrss``) is the baseline and the measure over-counts."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _worker(
    kind: str,
    uri: str,
    n: int,
    rank: int,
    numel: int,
    rounds: int,
    wire: str,
    port: int,
    barrier: Any,
    out: Any,
) -> None:
    import torch

    torch.set_num_threads(1)
    from crf.exchange.allreduce import ObjectStoreAllReduce
    from crf.exchange.memory import limit_malloc_arenas

    # every kind runs in a process set up as a replica's is (python -m crf.replica caps
    # glibc's malloc arenas before its transfer threads start); --malloc-arenas 0: glibc's
    limit_malloc_arenas()
    from crf.store import RunStore

    data = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    times, up, down, extras = [], 0, 0, []
    phases: dict[str, list[float]] = {}  # crf: the round's seconds per phase, by phase
    store = RunStore(uri)
    # a replica talks to its store through the same client before its first exchange (it
    # reads run.json, writes heartbeats, lists global/ to resume): do the same here, so that
    # the client's one-time set-up (an S3 client loads its service model, builds its
    # request pipeline and opens connections) is not timed or counted as a round's memory
    store.put(f"warmup/{rank}", b"{}", durable=False)
    store.get(f"warmup/{rank}", size_hint=2)
    store.list("warmup")
    if kind == "gloo":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n
        )
    ar = (
        ObjectStoreAllReduce(store, n, rank, run_id="bench", wire_dtype=wire, keep_rounds=2)
        if kind == "crf"
        else None
    )
    payload = data.numpy().tobytes()
    for r in range(rounds):
        t = data.clone()
        barrier.wait()
        # extra memory of this round: peak RSS during the call above the RSS with the input
        # already in place (the replica's own weights/pseudo-gradient are not "extra")
        base = _reset_peak()
        t0 = time.perf_counter()
        if kind == "crf":
            res = ar.allreduce([t], round=r)
            up, down = up + res.bytes_up, down + res.bytes_down
            for k, v in res.phases.items():
                phases.setdefault(k, []).append(v)
            if rank == 0:
                ar.collect_garbage(r)
        elif kind == "floor":
            store.put(f"floor/{r}/{rank}", payload, durable=False)
            got = store.get(f"floor/{r}/{rank}", size_hint=len(payload))
            up, down = up + len(payload), down + len(got)
        elif kind == "naive":
            store.put(f"naive/{r}/{rank}", payload, durable=False)
            store.wait_for([f"naive/{r}/{p}" for p in range(n)], timeout_s=600)
            acc = t.clone()
            for p in range(n):
                if p != rank:
                    blob = store.get(f"naive/{r}/{p}", size_hint=len(payload))
                    down += len(blob)
                    acc += torch.frombuffer(bytearray(blob), dtype=torch.float32)
            acc /= n
            up += len(payload)
        elif kind == "gloo":
            import torch.distributed as dist

            dist.all_reduce(t)
            t /= n
        times.append(time.perf_counter() - t0)
        extras.append(_peak() - base)
        barrier.wait()
        if kind in ("floor", "naive") and rank == 0:
            store.delete(f"{kind}/{r}")
    if kind == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()
    # the first round also pays one-time costs (an S3 client loads its service model and
    # opens its connection pool on first use): reported apart from the rounds after it
    steady = max(extras[1:]) if len(extras) > 1 else extras[0]
    per_phase = {k: statistics.median(v) for k, v in phases.items()}
    out.put(
        (rank, statistics.median(times), up / rounds, down / rounds, steady, extras[0], per_phase)
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kind: str, uri: str, n: int, mb: int, rounds: int, wire: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    numel = mb * MB // 4
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(kind, uri, n, r, numel, rounds, wire, port, barrier, out))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    rows = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    payload = numel * 4
    return {
        "s": max(r[1] for r in rows),  # a round ends when the slowest replica has the result
        "up": max(r[2] for r in rows) / payload,
        "down": max(r[3] for r in rows) / payload,
        "mem": max(r[4] for r in rows) / payload,
        "mem1": max(r[5] for r in rows) / payload,
        # crf: each phase's median seconds per round, the most any replica spent in it
        **{f"phase:{k}": max(r[6].get(k, 0.0) for r in rows) for k in rows[0][6]},
    }


def _moto_without_module_scan() -> None:
    """moto finds the backend for every request under one server-wide lock, and on the way
    lists its own package folder (``moto.backends.list_of_moto_modules``: a listdir and
    about 200 stat calls, ~5 ms here). That makes every request, whatever its size, wait
    for every other one: an emulator artefact that real S3 does not have, and one that
    weighs on a protocol in proportion to its request count. The folder does not change
    while the server runs, so it is listed once. ``--moto-stock`` measures moto as shipped."""
    from moto import backends

    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules  # type: ignore[assignment]


_MOTO_PUTS_SERIALIZED: list[bool] = []


def _moto_atomic_conditional_puts() -> None:
    """moto's conditional puts made atomic as on S3 (tests.emulators.moto_s3, which the S3
    tests use too): once, for all the servers a run starts one after another."""
    import threading

    from tests.emulators.moto_s3 import serialize_conditional_puts

    if not _MOTO_PUTS_SERIALIZED:
        serialize_conditional_puts(threading.Lock())
        _MOTO_PUTS_SERIALIZED.append(True)


_MOTO_RANGES_PATCHED: list[bool] = []


def _moto_reads_only_the_range() -> None:
    """moto reads the whole object for a ranged GET (tests.emulators.moto_s3): once."""
    from tests.emulators.moto_s3 import serve_ranges_from_the_range

    if not _MOTO_RANGES_PATCHED:
        serve_ranges_from_the_range()
        _MOTO_RANGES_PATCHED.append(True)


def _s3_uri(stock: bool = False) -> tuple[str, Any]:
    from moto.server import ThreadedMotoServer

    _moto_atomic_conditional_puts()
    if not stock:
        _moto_without_module_scan()
        _moto_reads_only_the_range()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return f"s3://bench/{uuid.uuid4().hex}", server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="N in {2,4,8}, P in {16,64,256} MB")
    ap.add_argument("--replicas", default=None, help="comma list of N (default 2,4)")
    ap.add_argument("--mb", default=None, help="comma list of P in MB (default 16,64)")
    ap.add_argument("--stores", default="file", help="comma list: file,s3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wire", default="float32", help="crf wire format")
    ap.add_argument("--kinds", default="crf,floor,naive,gloo")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every kind this many times, interleaved (crf, floor, naive, gloo, crf, "
        "...); seconds are the median over repeats and each ratio the median of the repeats' "
        "ratios, so a slow spell of the machine hits every kind alike",
    )
    ap.add_argument(
        "--moto-stock",
        action="store_true",
        help="serve S3 with moto as shipped (it lists its package folder on every request, "
        "under a server-wide lock, and reads the whole object for a ranged GET: see "
        "_moto_without_module_scan and tests.emulators.moto_s3)",
    )
    ap.add_argument(
        "--malloc-arenas",
        type=int,
        default=None,
        help="glibc malloc arenas per replica process (default: what a replica uses, "
        "crf.exchange.memory.DEFAULT_ARENAS; 0: glibc's default, up to 8 per core)",
    )
    args = ap.parse_args()
    if args.malloc_arenas is not None:  # read by each worker (spawned: inherits the env)
        os.environ["CRF_MALLOC_ARENAS"] = str(args.malloc_arenas)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    ns = [int(x) for x in (args.replicas or ("2,4,8" if args.full else "2,4")).split(",")]
    mbs = [int(x) for x in (args.mb or ("16,64,256" if args.full else "16,64")).split(",")]
    kinds = args.kinds.split(",")

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    table = Table(title=f"all-reduce round, crf wire={args.wire} (ratios measured in this run)")
    for col in (
        "store",
        "N",
        "P MB",
        "kind",
        "s/round",
        "up/P",
        "down/P",
        "mem/P",
        "1st mem/P",
        "vs floor",
        "vs naive",
        "vs gloo",
    ):
        table.add_column(col, justify="right")
    servers = []
    breakdown: list[str] = []  # crf's seconds per phase, per cell
    for store_kind in args.stores.split(","):
        for n in ns:
            for mb in mbs:
                runs: list[dict[str, dict[str, float]]] = []
                for i in range(args.repeat):
                    runs.append({})
                    for kind in kinds:
                        if store_kind == "s3":
                            uri, server = _s3_uri(args.moto_stock)
                            servers.append(server)
                        else:
                            uri = f"file://{tempfile.mkdtemp(prefix='crf-bench-')}"
                        rep = f" (repeat {i + 1}/{args.repeat})" if args.repeat > 1 else ""
                        console.log(f"{store_kind} N={n} P={mb}MB {kind}{rep}")
                        runs[-1][kind] = measure(
                            kind, uri, n, mb, args.rounds, args.wire if kind == "crf" else "float32"
                        )
                res = {
                    kind: {
                        k: statistics.median(run[kind][k] for run in runs) for k in runs[0][kind]
                    }
                    for kind in kinds
                }
                for kind, m in res.items():
                    shown = [f"{k[6:]} {v:.3f}" for k, v in m.items() if k.startswith("phase:")]
                    if shown:
                        breakdown.append(f"{store_kind} N={n} P={mb}MB {kind}: " + ", ".join(shown))

                    def ratio(base: str, kind: str = kind, runs: list = runs) -> str:
                        if base not in runs[0]:
                            return "-"
                        return (
                            f"{statistics.median(r[kind]['s'] / r[base]['s'] for r in runs):.2f}x"
                        )

                    table.add_row(
                        store_kind,
                        str(n),
                        str(mb),
                        kind,
                        f"{m['s']:.3f}",
                        f"{m['up']:.2f}",
                        f"{m['down']:.2f}",
                        f"{m['mem']:.2f}",
                        f"{m['mem1']:.2f}",
                        ratio("floor"),
                        ratio("naive"),
                        ratio("gloo"),
                    )
                table.add_section()
    console.print(table)
    if breakdown:
        console.print("seconds per round by phase (median; the slowest replica's):")
        for line in breakdown:
            console.print("  " + line)
    for s in servers:
        s.stop()


if __name__ == "__main__":
    main()
