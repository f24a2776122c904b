"""Benchmark: how much of the exchange Streaming DiLoCo hides behind the inner steps.

N replica processes train a synthetic model of P MB under ``ReplicaContext.diloco`` (the real
torchft DiLoCo, the real manager and exchange) through a file:// store made slow with
:func:`crf.store.throttle.throttle` (latency per request, bandwidth per replica and direction).
An inner step takes a fixed time in all (``--step-ms``), as on a GPU where forward, backward
and the optimizer step are device work: a sleep for the step less the SGD step's own time (it
leaves the CPU to the exchange), then a real SGD step over the P MB of weights.
``--step-mode sleep+sgd`` is the other loop: a full sleep and then the SGD step, so a step
takes longer than ``--step-ms`` by the CPU's SGD time.

Each configuration runs vanilla DiLoCo (fragments=1) or Streaming DiLoCo (fragments=F,
fragment_sync_delay=d) and the table shows, per sync and averaged over replicas:

* ``transfer s/sync`` - the background exchange's own time (start to averaged result);
* ``blocked s/sync``  - the time training waited for it (``sync_s``: starting the exchange,
  waiting in ``wait()``/``should_commit()``, checkpoint snapshots);
* ``blocked/transfer`` - 1.0 means no overlap at all, 0 means fully hidden;
* ``window s``        - the compute a fragment's exchange can hide behind: ``delay`` inner
  steps. Blocked time is about ``max(0, transfer - window)`` plus a fixed cost per sync
  (starting the exchange, the outer step), so pick ``d`` with ``d x step >= transfer``;
* ``ckpt fg s/sync`` - the training thread's part of the global checkpoints (part of
  ``blocked``): waiting for the previous write (back-pressure) and copying the state;
  ``ckpt bg s/sync`` - the background writer's encode + upload, per sync;
* ``train wall s`` - the slowest replica's training time (compute + blocked), ``ideal`` =
  steps x step time, and ``floor`` = the same loop's time without crf (sleep + SGD step,
  timed in each replica before it starts: the CPU's own cost under the machine's load).

Checkpoints are on (the lowest participant writes ``global/<r>`` every ``checkpoint_every``
rounds, the last round's always); a config ``f:d:k`` sets ``checkpoint_every`` to k.

Usage::

    python bench/overlap.py                           # N in {2,4}, P=16 MB, 50 ms + 40 MB/s
    python bench/overlap.py --replicas 2 --mb 64 --latency-ms 50 --mbps 100
    python bench/overlap.py --configs 1:0,2:1,2:12,4:6  # fragments:delay pairs (d < H/F)
    python bench/overlap.py --replicas 2 --configs 2:12:1,2:12:100  # checkpoint every 1 / 100
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


def _worker(uri: str, rank: int, n: int, args: dict[str, Any], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from crf.replica.context import ReplicaContext
    from crf.spec import RunSpec
    from crf.store import RunStore
    from crf.store.throttle import throttle

    numel = args["mb"] * MB // 4 // args["tensors"]
    torch.manual_seed(0)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(numel) * 0.01) for _ in range(args["tensors"])]
    )
    grads = [torch.full((numel,), 1e-3 * (rank + 1)) for _ in range(args["tensors"])]
    bare_step, sgd_s = _bare_step_s(model, grads, args["step_s"], args["padded"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = throttle(RunStore(uri), args["latency_s"], args["mbps"])
    spec = RunSpec.from_json(store.get("run.json"))
    ctx = ReplicaContext(store, spec, rank, n, shard_grace_s=30.0)
    in_step = in_log = 0.0
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:
            t0 = time.monotonic()
            _inner_step(model.parameters(), grads, opt, args["step_s"], sgd_s)
            t1 = time.monotonic()
            ctx.log_step(loss=0.0)
            in_step += t1 - t0
            in_log += time.monotonic() - t1
    ctx.finish({})
    res = ctx.result("ok", None, {})
    syncs = max(1, len(ctx.manager.exchange.history))
    out.put(
        {
            "rank": rank,
            "syncs": syncs,
            "transfer": res["transfer_s"] / syncs,
            "blocked": res["sync_s"] / syncs,
            "ckpt": res["ckpt_s"] / syncs,
            "ckpt_fg": ctx.manager.stats.ckpt_foreground_s / syncs,
            "floor": bare_step * ctx.total_steps,
            "wall": res["wall_s"],
            "train_wall": res["compute_s"] + res["sync_s"],
            "step_ms": 1000 * in_step / ctx.total_steps,
            "log_ms": 1000 * in_log / ctx.total_steps,
            "sha": res["weights_sha256"],
            "committed": res["syncs_committed"],
        }
    )


def _inner_step(
    params: Any, grads: list[Any], opt: Any, step_s: float, sgd_s: float | None
) -> None:
    """One "GPU" step. Padded (``sgd_s`` given: the SGD step's own time, measured without
    crf): a sleep for the rest of ``step_s``, then the SGD step, whose optimizer hooks
    (torchft's DiLoCo syncs from one) are not absorbed by the sleep. Else a sleep of
    ``step_s`` and then the SGD step."""
    time.sleep(step_s if sgd_s is None else max(0.0, step_s - sgd_s))
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()


def _bare_step_s(
    model: Any, grads: list[Any], step_s: float, padded: bool, steps: int = 8
) -> tuple[float, float | None]:
    """One inner step's time without crf (the same step over a copy of the weights),
    averaged over ``steps``: the floor a run's wall time is compared with; and, padded, the
    SGD step's own time that the step's sleep leaves room for."""
    import torch

    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    sgd_s: float | None = None
    if padded:
        t0 = time.monotonic()
        for _ in range(steps):
            _inner_step(params, grads, opt, 0.0, 0.0)
        sgd_s = (time.monotonic() - t0) / steps
    t0 = time.monotonic()
    for _ in range(steps):
        _inner_step(params, grads, opt, step_s, sgd_s)
    return (time.monotonic() - t0) / steps, sgd_s


def run_config(
    n: int, fragments: int, delay: int, every: int, args: argparse.Namespace
) -> dict[str, Any]:
    from crf.spec import RunSpec
    from crf.store import RunStore

    uri = f"file://{tempfile.mkdtemp(prefix='crf-overlap-')}/run"
    spec = RunSpec(
        run_id="overlap",
        run_uri=uri,
        replicas=n,
        sync_every=args.sync_every,
        rounds=args.rounds,
        fragments=fragments,
        fragment_sync_delay=delay,
        round_timeout_s=600,
        checkpoint_every=every,
        save_inner_state=args.save_inner,
    ).validate()
    RunStore(uri).put_if_absent("run.json", spec.to_json().encode())
    wargs = {
        "latency_s": args.latency_ms / 1000,
        "mbps": args.mbps,
        "mb": args.mb,
        "tensors": args.tensors,
        "step_s": args.step_ms / 1000,
        "padded": args.step_mode == "padded",
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(uri, r, n, wargs, out)) for r in range(n)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(60)
    rows.sort(key=lambda r: r["rank"])
    return {
        "syncs": rows[0]["syncs"],
        "transfer": statistics.mean(r["transfer"] for r in rows),
        "blocked": statistics.mean(r["blocked"] for r in rows),
        "blocked_max": max(r["blocked"] for r in rows),
        "ckpt": statistics.mean(r["ckpt"] for r in rows),
        "ckpt_fg": statistics.mean(r["ckpt_fg"] for r in rows),
        "floor": max(r["floor"] for r in rows),
        "train_wall": max(r["train_wall"] for r in rows),
        "step_ms": max(r["step_ms"] for r in rows),
        "log_ms": max(r["log_ms"] for r in rows),
        "identical": len({r["sha"] for r in rows}) == 1,
        "committed": min(r["committed"] for r in rows) == rows[0]["syncs"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,4", help="comma list of N")
    ap.add_argument("--mb", type=int, default=16, help="model size P in MB (fp32)")
    ap.add_argument("--tensors", type=int, default=16, help="parameter tensors in the model")
    ap.add_argument(
        "--configs",
        default="1:0,2:1,2:12,4:6,2:12:100",
        help="fragments:delay[:checkpoint_every] (delay < H/F; checkpoint_every 1 by default)",
    )
    ap.add_argument("--sync-every", type=int, default=32, help="H, inner steps per outer round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=150.0, help="time of an inner step")
    ap.add_argument(
        "--step-mode",
        choices=("padded", "sleep+sgd"),
        default="padded",
        help="padded: the SGD step runs inside --step-ms (a GPU step); sleep+sgd: after it",
    )
    ap.add_argument("--latency-ms", type=float, default=50.0, help="per store request")
    ap.add_argument("--mbps", type=float, default=40.0, help="MB/s per replica and direction")
    ap.add_argument("--save-inner", action="store_true", help="save inner state each sync")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console(width=240)
    table = Table(
        title=(
            f"Streaming DiLoCo overlap: P={args.mb} MB, H={args.sync_every}, "
            f"{args.rounds} rounds, step {args.step_ms:.0f} ms ({args.step_mode}), "
            f"store +{args.latency_ms:.0f} ms/request, {args.mbps:.0f} MB/s per replica"
        )
    )
    for col in (
        "N",
        "fragments",
        "delay",
        "syncs",
        "transfer s/sync",
        "blocked s/sync",
        "blocked max",
        "blocked/transfer",
        "window s",
        "ckpt every",
        "ckpt fg s/sync",
        "ckpt bg s/sync",
        "step ms",
        "log_step ms",
        "train wall s",
        "ideal s",
        "wall/ideal",
        "floor s",
        "wall/floor",
        "identical",
    ):
        table.add_column(col, justify="right")
    ideal = args.rounds * args.sync_every * args.step_ms / 1000
    for n in (int(x) for x in args.replicas.split(",")):
        for pair in args.configs.split(","):
            f, d, k, *_ = (*(int(x) for x in pair.split(":")), 1)
            console.log(f"N={n} fragments={f} delay={d} checkpoint_every={k}")
            m = run_config(n, f, d, k, args)
            table.add_row(
                str(n),
                str(f),
                str(d),
                str(m["syncs"]),
                f"{m['transfer']:.3f}",
                f"{m['blocked']:.3f}",
                f"{m['blocked_max']:.3f}",
                f"{m['blocked'] / m['transfer']:.2f}" if m["transfer"] else "-",
                f"{d * args.step_ms / 1000:.2f}",
                str(k),
                f"{m['ckpt_fg']:.3f}",
                f"{m['ckpt']:.3f}",
                f"{m['step_ms']:.1f}",
                f"{m['log_ms']:.1f}",
                f"{m['train_wall']:.2f}",
                f"{ideal:.2f}",
                f"{m['train_wall'] / ideal:.3f}",
                f"{m['floor']:.2f}",
                f"{m['train_wall'] / m['floor']:.3f}",
                "yes" if m["identical"] and m["committed"] else "NO",
            )
        table.add_section()
    console.print(table)


if __name__ == "__main__":
    main()
