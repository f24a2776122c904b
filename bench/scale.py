"""Benchmark: how an exchange round scales with the number of replicas N.

N replica processes (N = 2 ... 64 on one machine) average a small payload of P fp32 values with
ObjectStoreAllReduce through a file:// store and through S3 served by moto on 127.0.0.1. Per
round it reports what does not depend on the machine - the store requests and bytes of a
replica - next to what does - the round's time, the time to decide the quorum, and the CPU the
replicas burned:

* ``round s``     - from the barrier that starts the round to the slowest replica's result;
* ``req/replica`` - store requests of one replica in the round (mean over replicas), counted
                    at the RunStore (each call one request: a PUT, a GET or ranged GET, a
                    HEAD, a LIST, a DELETE), split into ``hits`` (the objects the protocol
                    reads and writes) and ``polls`` (listings past a replica's first, and
                    reads of objects not there yet);
* ``bytes/P``     - bytes up + down of one replica in units of P (the exchange's own count);
* ``all up s``    - from the round's start until the last replica's contribution is up;
* ``decide s``    - time to decide the quorum: from a replica's contribution upload to the
                    decision being visible to it (the exchange's ``quorum`` phase), median over
                    replicas; ``after last s`` - the same measured from the LAST replica's
                    upload, which is the protocol's own latency once everyone is there;
* ``cpu s``       - CPU seconds of all replica processes in the round; ``moto cpu s`` the S3
                    server's, per round (averaged over all rounds, the first included);
                    ``cpu/cores`` is their sum over the cores: the least time the round can
                    take on this machine, however fast the protocol.

Replicas are forked from this process after it imported torch (64 fresh torch imports would
take minutes and GBs on a small machine); moto runs in a process of its own. Each N has a time
limit (``--limit-s``): a configuration past it is killed and reported as such. Rounds after
the first are the steady state (the first also pays the store client's set-up): the table
shows their median.

Usage::

    python bench/scale.py                          # N = 2..64, file store, P = 256k values
    python bench/scale.py --stores file,s3         # and S3 through a local moto server
    python bench/scale.py --reduce-group-size 0,4,8  # and the two-level reduction, G = 4, 8
    python bench/scale.py --quick                  # N = 2,4, file store, 2 rounds: a smoke run
    python bench/scale.py --out docs/scale.md      # also a markdown table (+ .json beside it)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: RunStore calls that are one request each; get_json/put_json/wait_for go through them
_COUNTED = ("put", "put_if_absent", "get", "get_range", "list", "exists", "object_exists", "delete")


class RequestCounter:
    """Counts a RunStore's requests by kind, wrapping the instance's primitives (the
    exchange's behaviour is untouched: each wrapper calls the real method). A read that finds
    nothing (a GET answered 404, a HEAD saying "absent") is counted as a ``miss``."""

    def __init__(self, *stores: Any) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._inside = threading.local()
        for store in stores:
            self.wrap(store)

    def wrap(self, store: Any) -> Any:
        """Count ``store``'s requests too (take a ``child`` before wrapping its parent: a
        child copies the parent's attributes, wrappers included); returns it."""
        for name in _COUNTED:
            setattr(store, name, self._wrap(name, getattr(store, name)))
        return store

    def _wrap(self, name: str, method: Any) -> Any:
        from crf.store import ObjectNotFound

        def counted(*args: Any, **kwargs: Any) -> Any:
            # one request per outermost call (file://'s object_exists is its exists)
            if getattr(self._inside, "call", False):
                return method(*args, **kwargs)
            self._inside.call = True
            try:
                out = method(*args, **kwargs)
            except ObjectNotFound:
                self._add(name, miss=True)
                raise
            finally:
                self._inside.call = False
            self._add(name, miss=name in ("exists", "object_exists") and not out)
            return out

        return counted

    def _add(self, name: str, miss: bool) -> None:
        with self._lock:
            self.counts[name] += 1
            if miss:
                self.counts["miss"] += 1

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)


@dataclass
class RoundRecord:
    """One replica's view of one round."""

    rank: int
    round: int
    start: float  # wall clock (time.time: one clock for every process on this machine)
    end: float
    uploaded: float  # contribution uploaded (the quorum phase starts)
    decided: float  # quorum decision visible (the reduce phase starts)
    bytes_up: int
    bytes_down: int
    cpu_s: float
    digest: str  # of the averaged payload: every replica must end with the same bits
    requests: dict[str, int] = field(default_factory=dict)


def _worker(
    uri: str, n: int, rank: int, numel: int, rounds: int, group: int, barrier: Any, out: Any
) -> None:
    """One replica: ``rounds`` all-reduce rounds, each started by a barrier; puts its
    records (or an error) on ``out``. ``group`` > 0: the two-level reduction with groups of
    that many replicas (``reduce_group_size``)."""
    try:
        out.put((rank, _replica_rounds(uri, n, rank, numel, rounds, group, barrier)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put((rank, f"{type(e).__name__}: {e}"))


def _replica_rounds(
    uri: str, n: int, rank: int, numel: int, rounds: int, group: int, barrier: Any
) -> list[RoundRecord]:
    import torch

    torch.set_num_threads(1)
    from crf.exchange.config import ExchangeHooks
    from crf.store import RunStore

    store = RunStore(uri)
    # a replica talks to its store before its first exchange (run.json, heartbeats): the
    # client's one-time set-up is neither timed nor counted
    store.put(f"warmup/{rank}", b"{}", durable=False)
    store.get(f"warmup/{rank}", size_hint=2)
    phases: dict[str, float] = {}
    hooks = ExchangeHooks(on_phase=lambda p: phases.setdefault(p, time.time()))
    counter = RequestCounter()
    ar = Exchange(counter.wrap(store), n, rank, group, hooks)
    data = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    records: list[RoundRecord] = []
    before = counter.snapshot()
    for r in range(rounds):
        t = data.clone()
        barrier.wait()
        if records:  # the previous round's requests: up to this round's start (its
            now = counter.snapshot()  # background deletes included)
            records[-1].requests = dict(now - before)
            before = now
        phases.clear()
        cpu0, t0 = time.process_time(), time.time()
        up, down = ar.allreduce(t, r)
        end = time.time()
        records.append(
            RoundRecord(
                rank=rank,
                round=r,
                start=t0,
                end=end,
                uploaded=phases.get("quorum", t0),
                decided=phases.get("reducing", end),
                bytes_up=up,
                bytes_down=down,
                cpu_s=time.process_time() - cpu0,
                digest=hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16],
            )
        )
    ar.close()  # waits for the background deletes of the last round
    records[-1].requests = dict(counter.snapshot() - before)
    return records


class Exchange:
    """crf's exchange: one ObjectStoreAllReduce over all N replicas, one level (``group``
    0) or two levels with groups of ``group`` (``reduce_group_size``)."""

    def __init__(self, store: Any, n: int, rank: int, group: int, hooks: Any) -> None:
        from crf.exchange.allreduce import ObjectStoreAllReduce

        self.ar = ObjectStoreAllReduce(
            store, n, rank, hooks=hooks, reduce_group_size=group, **_EXCHANGE
        )

    def allreduce(self, t: Any, r: int) -> tuple[int, int]:
        res = self.ar.allreduce([t], round=r)
        return res.bytes_up, res.bytes_down

    def close(self) -> None:
        self.ar.close()


#: long enough that a replica slowed down by 64 others on 2 cores is never taken over
_EXCHANGE = {"run_id": "scale", "round_timeout_s": 900.0, "shard_grace_s": 600.0}


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def measure(
    uri: str, n: int, numel: int, rounds: int, limit_s: float, group: int = 0
) -> dict[str, Any]:
    """Run ``n`` forked replicas for ``rounds`` rounds; their records by rank, or why not
    (``error``: a replica failed, or the configuration passed ``limit_s``)."""
    import torch  # noqa: F401 - imported once, here: the forked replicas inherit it

    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(uri, n, r, numel, rounds, group, barrier, out), daemon=True
        )
        for r in range(n)
    ]
    deadline = time.monotonic() + limit_s
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < n:
            rank, body = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(body, str):
                return {"error": f"replica {rank}: {body}"}
            got[rank] = body
    except queue.Empty:
        return {"error": f"passed the {limit_s:.0f} s limit ({len(got)} of {n} finished)"}
    finally:
        _kill(procs)
    return {"records": [got[r] for r in range(n)]}


def summarize(records: list[list[RoundRecord]], numel: int, cores: int) -> dict[str, Any]:
    """The table's numbers for one configuration: per round, then the median of the rounds
    after the first (all of them when there is only one)."""
    n, rounds = len(records), len(records[0])
    per_round = []
    for r in range(rounds):
        rows = [rec[r] for rec in records]
        start = min(x.start for x in rows)
        last_upload = max(x.uploaded for x in rows)
        reqs = [Counter(x.requests) for x in rows]
        total = [sum(v for k, v in c.items() if k != "miss") for c in reqs]
        polls = [c["miss"] + max(0, c["list"] - 1) for c in reqs]
        per_round.append(
            {
                "round_s": max(x.end for x in rows) - start,
                "req": statistics.mean(total),
                "req_max": max(total),
                "polls": statistics.mean(polls),
                "hits": statistics.mean(t - p for t, p in zip(total, polls, strict=True)),
                "lists": statistics.mean(c["list"] for c in reqs),
                "gets": statistics.mean(c["get"] + c["get_range"] for c in reqs),
                "puts": statistics.mean(c["put"] + c["put_if_absent"] for c in reqs),
                "heads": statistics.mean(c["exists"] + c["object_exists"] for c in reqs),
                "deletes": statistics.mean(c["delete"] for c in reqs),
                "misses": statistics.mean(c["miss"] for c in reqs),
                "req_round": sum(total),
                "bytes_p": statistics.mean(x.bytes_up + x.bytes_down for x in rows) / (4 * numel),
                "up_p": statistics.mean(x.bytes_up for x in rows) / (4 * numel),
                "decide_s": statistics.median(x.decided - x.uploaded for x in rows),
                "decide_max_s": max(x.decided - x.uploaded for x in rows),
                "after_last_s": statistics.median(x.decided - last_upload for x in rows),
                "upload_spread_s": last_upload - start,
                "cpu_s": sum(x.cpu_s for x in rows),
                "identical": len({x.digest for x in rows}) == 1,
            }
        )
    steady = per_round[1:] or per_round
    med = {k: statistics.median(x[k] for x in steady) for k in per_round[0] if k != "identical"}
    med["cpu_floor_s"] = med["cpu_s"] / cores
    identical = all(x["identical"] for x in per_round)
    return {"n": n, "median": med, "rounds": per_round, "identical": identical}


# --------------------------------------------------------------------- stores
def _moto_process(port_out: Any, stop: Any) -> None:
    """moto's S3 server in a process of its own (the replicas are forked from the parent,
    which must not hold the server's threads), patched as bench/exchange.py patches it:
    atomic conditional puts, no package scan per request, ranged GETs that read the range."""
    import logging

    from moto.server import ThreadedMotoServer

    from bench.exchange import (
        _moto_atomic_conditional_puts,
        _moto_reads_only_the_range,
        _moto_without_module_scan,
    )

    _moto_atomic_conditional_puts()
    _moto_without_module_scan()
    _moto_reads_only_the_range()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port_out.put(server.get_host_and_port())
    stop.wait()
    server.stop()


class MotoS3:
    """A moto server process and a fresh bucket per configuration."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        port_out, self.stop = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_moto_process, args=(port_out, self.stop), daemon=True)
        self.proc.start()
        host, port = port_out.get(timeout=120)
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://{host}:{port}",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )

    def new_uri(self) -> str:
        import boto3

        bucket = f"scale-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        return f"s3://{bucket}/run"

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far."""
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def close(self) -> None:
        self.stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# --------------------------------------------------------------------- output
COLUMNS = (
    "store", "N", "G", "round s", "req/replica", "hits", "polls", "LIST", "GET", "PUT", "HEAD",
    "DEL", "req/round (all)", "bytes/P", "all up s", "decide s", "after last s", "cpu s",
    "moto cpu s", "cpu/cores s", "same",
)  # fmt: skip


def _group(res: dict[str, Any]) -> str:
    """The G column: ``-`` for the one-level exchange, G for the two-level one."""
    return str(res["group"]) if res.get("group") else "-"


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for res in results:
        if "error" in res:
            cells = [res["store"], str(res["n"]), _group(res), res["error"]]
            rows.append(cells + [""] * (len(COLUMNS) - len(cells)))
            continue
        m = res["median"]
        rows.append(
            [
                res["store"],
                str(res["n"]),
                _group(res),
                f"{m['round_s']:.3f}",
                f"{m['req']:.1f}",
                f"{m['hits']:.1f}",
                f"{m['polls']:.1f}",
                f"{m['lists']:.1f}",
                f"{m['gets']:.1f}",
                f"{m['puts']:.1f}",
                f"{m['heads']:.1f}",
                f"{m['deletes']:.1f}",
                f"{m['req_round']:.0f}",
                f"{m['bytes_p']:.2f}",
                f"{m['upload_spread_s']:.3f}",
                f"{m['decide_s']:.3f}",
                f"{m['after_last_s']:.3f}",
                f"{m['cpu_s']:.2f}",
                f"{res['server_cpu_s']:.2f}" if res.get("server_cpu_s") else "-",
                f"{m['cpu_floor_s'] + res.get('server_cpu_s', 0.0) / (os.cpu_count() or 1):.2f}",
                "yes" if res["identical"] else "NO",
            ]
        )
    return rows


def markdown(title: str, results: list[dict[str, Any]]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "|".join("---" if c == "store" else "---:" for c in COLUMNS) + "|")
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(results)]
    return "\n".join(lines) + "\n"


def _configs(replicas: list[int], groups: list[int]) -> list[tuple[int, int]]:
    """(N, G) pairs to run, in order: G = 0 is the one-level exchange; a two-level G needs
    2 <= G < N (G >= N would be one level over G shards; N need not be a multiple of G)."""
    return [(n, g) for n in replicas for g in groups if g == 0 or 2 <= g < n]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration, in order; stops a store's N sweep at the first that fails."""
    from rich.console import Console

    console = Console(stderr=True)
    numel, cores = args.numel, os.cpu_count() or 1
    results = []
    for store in args.stores.split(","):
        moto = MotoS3() if store == "s3" else None
        try:
            for n, group in _configs(args.replicas, args.group):
                if moto is not None:
                    uri = moto.new_uri()
                else:
                    uri = f"file://{tempfile.mkdtemp(prefix='crf-scale-')}/run"
                how = f"two-level, groups of {group}" if group else "one level"
                console.log(f"{store} N={n} {how}, P={numel} values, {args.rounds} rounds")
                t0, server0 = time.monotonic(), moto.cpu_s() if moto else 0.0
                got = measure(uri, n, numel, args.rounds, args.limit_s, group)
                res: dict[str, Any] = {"store": store, "n": n, "group": group}
                res["wall_s"] = time.monotonic() - t0
                # moto's CPU per round, the first round (client set-up) included
                res["server_cpu_s"] = (moto.cpu_s() - server0) / args.rounds if moto else 0.0
                if "error" in got:
                    res["error"] = got["error"]
                    console.log(f"  {got['error']}: larger N not run")
                    results.append(res)
                    break
                res |= summarize(got["records"], numel, cores)
                results.append(res)
        finally:
            if moto is not None:
                moto.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default=None, help="comma list of N (default 2,4,...,64)")
    ap.add_argument("--stores", default="file", help="comma list: file,s3")
    ap.add_argument("--numel", type=int, default=None, help="P in fp32 values (default 256k)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per N (default 4)")
    ap.add_argument("--limit-s", type=float, default=600.0, help="time limit per N")
    ap.add_argument(
        "--reduce-group-size",
        dest="group",
        default="0",
        help="comma list of G: 0 = one level, G = the two-level reduction with groups of G "
        "replicas (--reduce-group-size; run where 2 <= G < N)",
    )
    ap.add_argument("--quick", action="store_true", help="N = 2,4, P = 64k, 2 rounds")
    ap.add_argument("--out", default=None, help="write a markdown table here (+ .json beside it)")
    args = ap.parse_args(argv)
    default_n = "2,4" if args.quick else "2,4,8,16,32,64"
    args.replicas = [int(x) for x in (args.replicas or default_n).split(",")]
    args.group = [int(x) for x in args.group.split(",")]
    args.numel = args.numel or (65536 if args.quick else 262144)
    args.rounds = args.rounds or (2 if args.quick else 4)
    if min(args.replicas) < 2 or args.rounds < 1 or args.numel < 1:
        ap.error("--replicas must be >= 2, --rounds and --numel >= 1")

    import torch  # once, here: the replicas are forked from this process

    torch.set_num_threads(1)
    from rich.console import Console
    from rich.table import Table

    results = run(args)
    title = (
        f"exchange round vs N: P = {args.numel} fp32 values ({args.numel * 4 / 2**20:.2f} MB), "
        f"median of rounds 2..{args.rounds}, {os.cpu_count()} cores (shared)"
    )
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "store" else "right")
    for cells in table_rows(results):
        table.add_row(*cells)
    Console(width=max(200, Console().width)).print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(title, results))
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        body = {"settings": settings, "results": results}
        out.with_suffix(".json").write_text(json.dumps(body, indent=1, default=asdict))
    return 0 if all("error" not in r and r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
