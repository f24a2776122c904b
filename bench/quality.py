"""Benchmark: does DiLoCo through the store learn as well as synchronous data parallel, and for
how many fewer bytes?

crf's claim is that N replicas exchanging pseudo-gradients every H inner steps through an
object store reach (nearly) the quality of synchronous data-parallel training while moving a
small fraction of its bytes. This script measures both halves of that claim on the ``lm`` job
(a tiny Llama on generated text, everything built in code) with the same model init, data
shards, per-replica batch, inner optimizer (AdamW, same lr) and total inner steps:

* ``diloco``  — N real replica processes started by ``crf.launcher.driver.launch({"job": "lm",
                "backend": "local"})`` over a file:// store: crf's ObjectStoreAllReduce /
                ObjectStoreManager / torchft DiLoCo path, exactly as a real run. Bytes are what
                the replicas report (``bytes_up + bytes_down`` of the exchange, per replica).
* ``ddp``     — N processes of ``torch.nn.parallel.DistributedDataParallel`` over gloo. Bytes
                are measured twice: the gradient payload every step (a DDP comm hook that counts
                the buckets it all-reduces), and the TCP payload the process really sent and
                received (``TCP_INFO`` of its sockets). The ratio column uses the
                bandwidth-optimal ring all-reduce of the measured payload,
                ``2·(N−1)/N·P`` sent + ``2·(N−1)/N·P`` received per step and replica — the
                least any synchronous all-reduce can move, so DiLoCo's advantage is not
                inflated by gloo's own overhead (printed beside it).
* ``single``  — one replica alone for the same steps: on shard 0, and on the whole corpus.

DiLoCo's outer optimizer is Nesterov SGD at crf's run default, lr 0.7 and momentum 0.5
(``OUTER_LR`` below; RunSpec's defaults, chosen from this benchmark: docs/performance.md); one
more row runs the DiLoCo paper's 0.7/0.9 (meant for hundreds of rounds) so the cost of that
choice stays visible, and ``--outer-grid`` adds rows at other outer settings.

Sparse rows (``--sparse``): the top-k wires (``topk2``/``topk4``/``topk8``: a share of each
chunk's values at 2/4/8 bits, with error feedback) at a few densities, in both outer forms
(``sparseloco``: the error feedback stands in for the outer momentum, plain averaged step;
``diloco``: Nesterov outer on the sparse mean). Each row is declared as a setting (an
:class:`Arm`) and runs only when its wire is registered (``codec_names()``).

Every method is scored by the lm job's own ``evaluate`` on the same held-out eval set, on the
final weights (for DiLoCo: the global weights after the last outer step, identical on every
replica). Printed: eval loss, loss relative to DDP, bytes per replica, bytes relative to DDP,
wall time, and PASS/FAIL for the dense targets (H=50: within 3% of DDP with >= 50x fewer
bytes; int8: within 4% with >= 200x fewer bytes); then a Pareto table of every DiLoCo row by
bytes (which rows no other beats on both bytes and loss) and the low-byte targets, met by
any row: >= 1000x fewer bytes than DDP within +1% of its eval loss, >= 3000x within +3%.
Usage::

    python bench/quality.py                 # full: N=4, 400 inner steps, sparse rows (30-45 min)
    python bench/quality.py --quick         # 100 steps, about 3 minutes (a smoke run)
    python bench/quality.py --out docs/q.md # also write a markdown table (+ .json beside it)
    python bench/quality.py --syncs 50 --wires float32 --sparse topk2@1/sparseloco --skip single
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import stat
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crf.spec import RunSpec  # noqa: E402  (no torch: the defaults of a run's options)

_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}

#: the dense targets: (H, wire) -> (max eval loss above DDP in %, min bytes ratio vs DDP)
TARGETS: dict[tuple[int, str], tuple[float, float]] = {
    (50, "float32"): (3.0, 50.0),
    (50, "int8"): (4.0, 200.0),
}
#: the low-byte targets, met by any DiLoCo row: (min bytes ratio vs DDP, max eval loss above
#: DDP in %) - the Pareto table says which rows reach them
FRONT_TARGETS: tuple[tuple[float, float], ...] = ((1000.0, 1.0), (3000.0, 3.0))
#: DiLoCo's outer Nesterov SGD for this benchmark: crf's run default (RunSpec.outer_lr /
#: outer_momentum, 0.7/0.5, chosen from this benchmark: docs/performance.md). The DiLoCo
#: paper's 0.7/0.9 (tuned for hundreds of rounds) is reported beside it (PAPER_OUTER).
OUTER_LR, OUTER_MOMENTUM = (_SPEC_DEFAULTS["outer_lr"], _SPEC_DEFAULTS["outer_momentum"])
PAPER_OUTER = (0.7, 0.9)
RING_FORMULA = "DDP bytes = 2·(N−1)/N·P sent + 2·(N−1)/N·P received per step (ring, bound)"


@dataclass(frozen=True)
class Setting:
    """One comparison: everything every method shares."""

    replicas: int = 4
    steps: int = 400  # inner steps per replica, a multiple of every H
    syncs: tuple[int, ...] = (10, 50)
    wires: tuple[str, ...] = ("float32", "int8")
    seed: int = 0
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
    lm: dict[str, Any] = field(default_factory=dict)  # lm job options (crf.replica.jobs.lm)
    #: DiLoCo runs write their global state every this many rounds; 0: only at the last
    #: round (what a DDP run saves too: the trained model), plus any a healing replica asks for
    checkpoint_every: int = 0

    def check(self) -> Setting:
        for h in self.syncs:
            if self.steps % h:
                raise SystemExit(f"--steps {self.steps} must be a multiple of every H ({h})")
        return self


@dataclass
class Row:
    """One method's result; bytes are per replica over the whole run."""

    method: str
    kind: str  # ddp | diloco | single
    eval_loss: float
    eval_loss_initial: float
    bytes_total: int  # sent + received (DDP: the ring bound of the measured payload)
    bytes_up: int
    bytes_down: int
    wall_s: float
    steps: int
    sync_every: int | None = None
    wire: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: the run options a sparse row sets (declared on RunSpec by the sparse wire): the fraction of
#: each chunk's values kept, and the outer form - "sparseloco" (error feedback stands in for
#: the outer momentum, plain averaged step) or "diloco" (Nesterov outer on the sparse mean)
DENSITY_OPTION, OUTER_FORM_OPTION = "sparse_density", "sparse_outer"
OUTER_FORMS = ("sparseloco", "diloco")


@dataclass(frozen=True)
class Arm:
    """One DiLoCo row, declared by what sets it apart from the others: H, the wire and, for a
    sparse wire, its density and outer form; an outer lr/momentum of its own where it differs
    from the setting's. A row whose wire is not registered (``codec_names()``) is skipped."""

    sync_every: int
    wire: str = "float32"
    density: float | None = None  # sparse wires: fraction of each chunk's values sent
    outer_form: str | None = None  # sparse wires: one of OUTER_FORMS
    outer_lr: float | None = None  # None: the setting's
    outer_momentum: float | None = None
    tag: str = ""  # shown in the method's name, e.g. "crf default"

    def label(self) -> str:
        parts = [f"DiLoCo H={self.sync_every} {self.wire}"]
        if self.density is not None:
            parts.append(f"{100 * self.density:g}%")
        if self.outer_form:
            parts.append(self.outer_form)
        text = " ".join(parts)
        if self.outer_lr is not None:
            text += f", outer {self.outer_lr}/{self.outer_momentum}"
        return text + (f" ({self.tag})" if self.tag else "")

    def outer(self, setting: Setting) -> tuple[float, float]:
        lr = setting.outer_lr if self.outer_lr is None else self.outer_lr
        m = setting.outer_momentum if self.outer_momentum is None else self.outer_momentum
        return lr, m

    def options(self) -> dict[str, Any]:
        """The run options this row adds to the setting's."""
        out: dict[str, Any] = {"wire_dtype": self.wire}
        if self.density is not None:
            out[DENSITY_OPTION] = self.density
        if self.outer_form is not None:
            out[OUTER_FORM_OPTION] = self.outer_form
        return out

    def registered(self) -> bool:
        from crf.exchange.codecs import codec_names

        return self.wire in codec_names()


def sparse_arms(sync_every: int, text: str) -> list[Arm]:
    """The sparse rows of ``--sparse``: comma-separated ``WIRE@PERCENT[/FORM][:H]`` (both
    forms when FORM is left out; H: ``sync_every`` unless given), e.g.
    ``topk2@1,topk4@2/sparseloco:100``; "none" for none."""
    if text == "none":
        return []
    arms = []
    for cell in filter(None, (t.strip() for t in text.split(","))):
        item, _, h_text = cell.partition(":")
        h = int(h_text) if h_text.isdigit() else sync_every
        wire, _, rest = item.partition("@")
        pct, _, form = rest.partition("/")
        try:
            density = float(pct) / 100
        except ValueError:
            raise SystemExit(
                f"--sparse {item!r}: write WIRE@PERCENT[/FORM], e.g. topk2@1"
            ) from None
        if not 0 < density <= 1 or form not in ("", *OUTER_FORMS):
            raise SystemExit(
                f"--sparse {item!r}: PERCENT must be in (0, 100] and FORM one of {OUTER_FORMS}"
            )
        for f in (form,) if form else OUTER_FORMS:
            arms.append(Arm(h, wire, density=density, outer_form=f))
    return arms


#: the sparse rows the full benchmark runs (when their wire is registered): both forms at two
#: points, then along the bytes axis (sparse rows need rounds: H of 10 to 50); the table in
#: docs/performance.md
SPARSE_DEFAULT = (
    "topk2@2:10,topk2@1:10,topk2@0.5/sparseloco:10,topk4@2/diloco:10,topk2@1/diloco:20,"
    "topk2@2/diloco:50"
)


# ---------------------------------------------------------------------- measuring TCP bytes
def tcp_bytes() -> tuple[int, int]:
    """(payload bytes sent, payload bytes received) over every TCP socket of this process,
    read from the kernel's ``TCP_INFO``.

    Sent is ``tcpi_bytes_sent - tcpi_bytes_retrans`` (Linux 4.19+), counted when the kernel
    transmits; ``tcpi_bytes_acked`` (the fallback on older kernels) lags behind by whatever
    the peer has not acknowledged yet (delayed ACKs), which under-counted the last step."""
    sent = recv = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            info = b""  # not a TCP socket
        finally:
            s.close()
        if len(info) >= 216:  # struct tcp_info: u64 bytes_sent at 200, bytes_retrans at 208
            out, retrans = struct.unpack_from("QQ", info, 200)
            sent += out - retrans
            recv += struct.unpack_from("Q", info, 128)[0]
        elif len(info) >= 136:  # u64 bytes_acked at 120, bytes_received at 128
            acked, received = struct.unpack_from("QQ", info, 120)
            sent += acked
            recv += received
    return sent, recv


# ---------------------------------------------------------------------- DDP and one replica
def _data_seed(seed: int, rank: int) -> int:
    """The data seed crf.replica.context.ReplicaContext gives replica ``rank``."""
    return seed * 1_000_003 + rank + 1


def train_worker(rank: int, world: int, mode: str, setting: Setting, out_dir: str) -> None:
    """One process of ``ddp`` (world > 1) or ``single`` (mode shard0 | all): the lm job's
    model, data and training step, without crf. Writes ``<out_dir>/<rank>.json``."""
    import torch

    torch.set_num_threads(1)  # as crf's local backend does for replicas sharing a machine
    from crf.replica.context import weights_sha256
    from crf.replica.jobs import job_config
    from crf.replica.jobs.lm import CorpusShard, build_model, evaluate

    cfg = job_config("lm", dict(setting.lm))
    n_shards = 1 if mode == "all" else setting.replicas
    data = CorpusShard(cfg, rank, n_shards, setting.seed)
    model = build_model(cfg, len(data.itos), setting.seed)
    model.train()
    eval0 = evaluate(model, data) if rank == 0 else float("nan")
    counter = {"payload": 0, "calls": 0}
    net = model
    pg = None
    if mode == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group(
            "gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world
        )
        pg = dist.group.WORLD
        net = DistributedDataParallel(model)

        # no annotations: DDP checks them at runtime against dist.GradBucket, and
        # ``from __future__ import annotations`` would make them strings
        def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            state["payload"] += buf.numel() * buf.element_size()
            state["calls"] += 1
            buf.div_(world)
            fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        net.register_comm_hook(counter, counting_allreduce)
        dist.barrier()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    tcp0 = tcp_bytes()
    t0 = time.monotonic()
    seed = _data_seed(setting.seed, rank)
    loss = torch.zeros(())
    for step in range(setting.steps):
        batch = data.batch(step, seed)
        loss = net(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    train_s = time.monotonic() - t0
    tcp1 = tcp_bytes()
    result = {
        "rank": rank,
        "train_s": train_s,
        "last_train_loss": float(loss.detach()),
        "payload_bytes": counter["payload"],
        "allreduce_calls": counter["calls"],
        "tcp_sent": tcp1[0] - tcp0[0],
        "tcp_received": tcp1[1] - tcp0[1],
        "params": sum(p.numel() for p in model.parameters()),
        "weights_sha256": weights_sha256(model),
        "eval_loss_initial": eval0,
        "eval_loss": evaluate(model, data) if rank == 0 else float("nan"),
    }
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    if pg is not None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _spawn(world: int, mode: str, setting: Setting) -> tuple[list[dict[str, Any]], float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="crf-quality-") as d:
        t0 = time.monotonic()
        mp.spawn(train_worker, args=(world, mode, setting, d), nprocs=world, join=True)
        wall = time.monotonic() - t0
        return [json.loads(Path(d, f"{r}.json").read_text()) for r in range(world)], wall


def run_ddp(setting: Setting) -> Row:
    n = setting.replicas
    res, wall = _spawn(n, "ddp", setting)
    if len({r["weights_sha256"] for r in res}) != 1:
        raise RuntimeError("DDP replicas ended with different weights")
    payload = res[0]["payload_bytes"]  # bytes handed to all-reduce, all steps
    ring_each_way = round(2 * (n - 1) / n * payload)
    return Row(
        method=f"DDP (gloo, N={n})",
        kind="ddp",
        eval_loss=res[0]["eval_loss"],
        eval_loss_initial=res[0]["eval_loss_initial"],
        bytes_total=2 * ring_each_way,
        bytes_up=ring_each_way,
        bytes_down=ring_each_way,
        wall_s=wall,
        steps=setting.steps,
        extra={
            "payload_bytes_per_step": payload / setting.steps,
            "allreduce_calls_per_step": res[0]["allreduce_calls"] / setting.steps,
            "params": res[0]["params"],
            "gloo_tcp_bytes": max(r["tcp_sent"] + r["tcp_received"] for r in res),
            "gloo_tcp_sent": [r["tcp_sent"] for r in res],
            "gloo_tcp_received": [r["tcp_received"] for r in res],
            "formula": RING_FORMULA,
        },
    )


def run_single(setting: Setting, mode: str) -> Row:
    res, wall = _spawn(1, mode, setting)
    what = f"shard 0 of {setting.replicas}" if mode == "shard0" else "whole corpus"
    return Row(
        method=f"one replica ({what})",
        kind="single",
        eval_loss=res[0]["eval_loss"],
        eval_loss_initial=res[0]["eval_loss_initial"],
        bytes_total=0,
        bytes_up=0,
        bytes_down=0,
        wall_s=wall,
        steps=setting.steps,
        extra={"params": res[0]["params"]},
    )


# ---------------------------------------------------------------------- DiLoCo through crf
def named(label: str, lr: float, momentum: float, form: str | None) -> str:
    """A row's name, with its outer step where that is not crf's default (and not named)."""
    if ", outer " in label or (lr, momentum) == (OUTER_LR, OUTER_MOMENTUM):
        return label
    if form == "sparseloco":  # no outer momentum: only the lr counts
        return label if lr == OUTER_LR else f"{label}, outer lr {lr}"
    return f"{label}, outer {lr}/{momentum}"


def _step_lr(lr: float, momentum: float, form: str | None) -> float:
    """The outer SGD's lr in a run with these options (crf.replica.context.outer_lr)."""
    from types import SimpleNamespace

    from crf.replica.context import outer_lr

    spec = SimpleNamespace(outer_lr=lr, outer_momentum=momentum)
    return outer_lr(spec, form == "sparseloco")  # type: ignore[arg-type]


def run_diloco(setting: Setting, arm: Arm, store: str) -> Row:
    """One crf run of ``setting.replicas`` real replica processes over a file:// store."""
    from crf.launcher.driver import launch
    from crf.store import RunStore

    sync_every, wire = arm.sync_every, arm.wire
    outer_lr, outer_momentum = arm.outer(setting)
    run_id = f"quality-h{sync_every}-{wire}-{time.time_ns()}"
    t0 = time.monotonic()
    summary = launch(
        {
            "job": "lm",
            "backend": "local",
            "replicas": setting.replicas,
            "sync_every": sync_every,
            "rounds": setting.steps // sync_every,
            "run_id": run_id,
            "job_config": dict(setting.lm),
            "seed": setting.seed,
            "outer_lr": outer_lr,
            "outer_momentum": outer_momentum,
            "checkpoint_every": setting.checkpoint_every or setting.steps // sync_every,
            **arm.options(),
        },
        store=store,
        progress=False,
        report=False,
        plot=False,
        env={"CRF_LOG_LEVEL": "WARNING"},
    )
    wall = time.monotonic() - t0
    if summary["status"] != "ok" or not summary["weights_identical"]:
        raise RuntimeError(
            f"DiLoCo run {run_id} did not finish cleanly: status={summary['status']} "
            f"weights_identical={summary['weights_identical']} error={summary.get('error')}"
        )
    rows = summary["replicas"]
    jm = rows[0]["job_metrics"]
    evals = {round(r["job_metrics"]["eval_loss_final"], 9) for r in rows}
    if len(evals) != 1:  # identical weights must score identically
        raise RuntimeError(f"replicas of {run_id} disagree on the eval loss: {evals}")
    per = [(r["bytes_up"] or 0) + (r["bytes_down"] or 0) for r in rows]
    worst = max(range(len(rows)), key=lambda i: per[i])
    run_store = RunStore(summary["run_uri"])
    results = [run_store.get_json(f"results/{r}.json") for r in range(len(rows))]
    ckpt = [(x.get("ckpt_bytes_up") or 0) + (x.get("ckpt_bytes_down") or 0) for x in results]
    with_ckpt = max(p + c for p, c in zip(per, ckpt, strict=True))
    return Row(
        method=named(arm.label(), outer_lr, outer_momentum, arm.outer_form),
        kind="diloco",
        eval_loss=jm["eval_loss_final"],
        eval_loss_initial=jm["eval_loss_initial"],
        bytes_total=per[worst],
        bytes_up=rows[worst]["bytes_up"],
        bytes_down=rows[worst]["bytes_down"],
        wall_s=wall,
        steps=setting.steps,
        sync_every=sync_every,
        wire=wire,
        extra={
            "run_id": run_id,
            "rounds": summary["rounds"],
            "bytes_per_round": rows[worst]["bytes_per_round"],
            "bytes_per_replica": per,
            "compression": rows[0]["compression"],
            "ckpt_bytes_up_rank0": results[0].get("ckpt_bytes_up"),
            "ckpt_bytes_per_replica": ckpt,
            "bytes_with_ckpt": with_ckpt,
            "checkpoint_every": setting.checkpoint_every or setting.steps // sync_every,
            "sync_s_max": max(r["sync_s"] or 0 for r in rows),
            "params": jm["params"],
            "outer_lr": outer_lr,
            "outer_momentum": outer_momentum,
            "density": arm.density,
            "outer_form": arm.outer_form,
            # the lr the outer SGD really took (SparseLoCo: outer_lr / (1 - momentum))
            "step_lr": round(_step_lr(outer_lr, outer_momentum, arm.outer_form), 6),
            "reference": arm.outer_lr is not None,  # an outer of its own: no dense target
        },
    )


# ---------------------------------------------------------------------- report
def verdicts(rows: list[Row]) -> list[dict[str, Any]]:
    ddp = next(r for r in rows if r.kind == "ddp")
    out = []
    for r in rows:
        target = TARGETS.get((r.sync_every or 0, r.wire or ""))
        if r.kind != "diloco" or target is None or r.extra.get("reference"):
            continue
        max_pct, min_ratio = target
        pct = 100.0 * (r.eval_loss - ddp.eval_loss) / ddp.eval_loss
        ratio = ddp.bytes_total / max(1, r.bytes_total)
        ok_loss, ok_bytes = pct <= max_pct, ratio >= min_ratio
        out.append(
            {
                "method": r.method,
                "loss_vs_ddp_pct": pct,
                "max_pct": max_pct,
                "bytes_ratio": ratio,
                "min_ratio": min_ratio,
                "pass": ok_loss and ok_bytes,
                "why": (
                    ""
                    if ok_loss and ok_bytes
                    else "; ".join(
                        w
                        for w, bad in (
                            (f"loss {pct:+.2f}% > +{max_pct}%", not ok_loss),
                            (f"bytes {ratio:.1f}x < {min_ratio}x", not ok_bytes),
                        )
                        if bad
                    )
                ),
            }
        )
    return out


def loss_pct(row: Row, ddp: Row) -> float:
    return 100.0 * (row.eval_loss - ddp.eval_loss) / ddp.eval_loss


def bytes_ratio(row: Row, ddp: Row) -> float:
    return ddp.bytes_total / max(1, row.bytes_total)


def pareto_front(rows: list[Row]) -> set[int]:
    """Indices of the DiLoCo rows and DDP that no other of them beats on both axes: fewer or
    as many bytes and a lower or equal eval loss, one of the two strictly."""
    pts = [(i, r.bytes_total, r.eval_loss) for i, r in enumerate(rows) if r.kind != "single"]
    return {
        i
        for i, b, e in pts
        if not any(b2 <= b and e2 <= e and (b2 < b or e2 < e) for _, b2, e2 in pts)
    }


def front_checks(rows: list[Row]) -> list[dict[str, Any]]:
    """FRONT_TARGETS, each met or not by the DiLoCo rows: the row with the most bytes saved
    among those within the loss bound and at or past the ratio; failing that, the closest
    miss (the lowest loss at or past the ratio)."""
    ddp = next(r for r in rows if r.kind == "ddp")
    diloco = [r for r in rows if r.kind == "diloco"]
    out = []
    for min_ratio, max_pct in FRONT_TARGETS:
        far = [r for r in diloco if bytes_ratio(r, ddp) >= min_ratio]
        ok = [r for r in far if loss_pct(r, ddp) <= max_pct]
        best = max(ok, key=lambda r: bytes_ratio(r, ddp)) if ok else None
        near = best or (min(far, key=lambda r: r.eval_loss) if far else None)
        out.append(
            {
                "min_ratio": min_ratio,
                "max_pct": max_pct,
                "pass": best is not None,
                "method": near.method if near else None,
                "bytes_ratio": bytes_ratio(near, ddp) if near else None,
                "loss_vs_ddp_pct": loss_pct(near, ddp) if near else None,
            }
        )
    return out


def front_line(v: dict[str, Any], md: bool = False) -> str:
    x = "×" if md else "x"
    head = f">= {v['min_ratio']:.0f}{x} fewer bytes within +{v['max_pct']:g}% of DDP"
    if v["method"] is None:
        return f"{head}: no row reaches {v['min_ratio']:.0f}{x}"
    got = f"{v['method']}: {v['bytes_ratio']:.0f}{x}, {v['loss_vs_ddp_pct']:+.2f}%"
    return f"{head}: {got}" if v["pass"] else f"{head}: closest {got}"


PARETO_HEADERS = [
    "wire",
    "H",
    "density",
    "outer",
    "bytes / replica",
    "DDP / this",
    "eval loss",
    "vs DDP",
    "front",
]


def pareto_rows(rows: list[Row]) -> list[list[str]]:
    """DDP and every DiLoCo row, most bytes first; "*" marks the Pareto front."""
    ddp = next(r for r in rows if r.kind == "ddp")
    front = pareto_front(rows)
    order = sorted(
        (i for i, r in enumerate(rows) if r.kind != "single"),
        key=lambda i: (-rows[i].bytes_total, rows[i].eval_loss),
    )
    out = []
    for i in order:
        r = rows[i]
        dens = r.extra.get("density")
        if r.kind == "ddp":
            wire, h, outer = "fp32 all-reduce", "1", "-"
        else:
            wire, h = r.wire or "", str(r.sync_every)
            lr, m = r.extra["outer_lr"], r.extra["outer_momentum"]
            form = r.extra.get("outer_form") or "diloco"
            # SparseLoCo's outer step is plain SGD: its error feedback is the momentum. Its
            # lr is the step it took (older rows, before crf scaled it, recorded only lr)
            step = r.extra.get("step_lr", lr)
            outer = f"{form} {step:g}/0 (EF)" if form == "sparseloco" else f"{form} {lr}/{m}"
        out.append(
            [
                wire,
                h,
                "-" if dens is None else f"{100 * dens:g}%",
                outer,
                fmt_bytes(r.bytes_total),
                f"{bytes_ratio(r, ddp):.1f}x",
                f"{r.eval_loss:.4f}",
                f"{loss_pct(r, ddp):+.2f}%",
                "*" if i in front else "",
            ]
        )
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"  # pragma: no cover


def table_rows(rows: list[Row]) -> list[list[str]]:
    ddp = next(r for r in rows if r.kind == "ddp")
    out = []
    for r in rows:
        pct = 100.0 * (r.eval_loss - ddp.eval_loss) / ddp.eval_loss
        ratio = "-" if r.bytes_total == 0 else f"{ddp.bytes_total / r.bytes_total:.1f}x"
        if r.kind == "ddp":
            ratio = "1.0x"
        with_ckpt = r.extra.get("bytes_with_ckpt")
        ckpt_ratio = f"{ddp.bytes_total / with_ckpt:.1f}x" if with_ckpt else "-"
        out.append(
            [
                r.method,
                f"{r.eval_loss_initial:.4f} -> {r.eval_loss:.4f}",
                f"{pct:+.2f}%",
                fmt_bytes(r.bytes_total) if r.bytes_total else "0",
                ratio,
                ckpt_ratio,
                f"{r.wall_s:.0f} s",
            ]
        )
    return out


HEADERS = [
    "method",
    "eval loss (init -> final)",
    "vs DDP",
    "bytes / replica",
    "DDP / this",
    "DDP / this, with checkpoints",
    "wall",
]


def notes(rows: list[Row]) -> list[str]:
    """How the bytes were counted, under the table."""
    ddp = next(r for r in rows if r.kind == "ddp")
    per_step, tcp = ddp.extra["payload_bytes_per_step"], ddp.extra["gloo_tcp_bytes"]
    out = [
        f"P = {per_step:,.0f} bytes of fp32 gradient per step ({ddp.extra['params']:,} "
        f"params), measured by a DDP comm hook. {RING_FORMULA}.",
        f"gloo really moved {fmt_bytes(tcp)} per replica over TCP (TCP_INFO of its sockets, "
        f"{tcp / ddp.bytes_total:.3f}x the ring bound); the ratios use the bound.",
        "DiLoCo bytes: crf's own count of the exchange objects a replica put and got "
        "(each replica's contribution - its pseudo-gradient shards and manifest, one object - "
        "the quorum, the reduced shards), sent + received, the "
        "busiest replica; without the global checkpoint the lowest rank writes for resume.",
    ]
    ckpt = [r.extra.get("ckpt_bytes_up_rank0") for r in rows if r.kind == "diloco"]
    if any(ckpt):
        every = {r.extra.get("checkpoint_every") for r in rows if r.kind == "diloco"}
        out[-1] += (
            f" 'with checkpoints' adds the global states a replica wrote or read (rank 0 "
            f"wrote at most {fmt_bytes(max(c or 0 for c in ckpt))}; checkpoint_every "
            f"{', '.join(str(e) for e in sorted(every))}: only the last round's, which DDP "
            "would save too, and none is counted for DDP)."
        )
    return out


def crf_tag(setting: Setting) -> str:
    return (
        " (crf's default)"
        if (setting.outer_lr, setting.outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
        else ""
    )


def print_report(setting: Setting, rows: list[Row], console: Any) -> list[dict[str, Any]]:
    from rich.table import Table

    table = Table(
        title=f"lm job, N={setting.replicas}, {setting.steps} inner steps per replica, "
        f"lm options {setting.lm or 'default'}, DiLoCo outer Nesterov SGD "
        f"lr {setting.outer_lr} momentum {setting.outer_momentum}{crf_tag(setting)} unless named"
    )
    for h in HEADERS:
        table.add_column(h, justify="left" if h == "method" else "right")
    for cells in table_rows(rows):
        table.add_row(*cells)
    console.print(table)
    for line in notes(rows):
        console.print(line, highlight=False)
    checks = verdicts(rows)
    for v in checks:
        mark = "[green]PASS[/green]" if v["pass"] else "[red]FAIL[/red]"
        console.print(
            f"{mark} {v['method']}: eval loss {v['loss_vs_ddp_pct']:+.2f}% vs DDP "
            f"(target <= +{v['max_pct']}%), {v['bytes_ratio']:.1f}x fewer bytes "
            f"(target >= {v['min_ratio']:.0f}x){'  -- ' + v['why'] if v['why'] else ''}"
        )
    pareto = Table(title="Pareto: exchange bytes vs eval loss (* = on the front)")
    for h in PARETO_HEADERS:
        pareto.add_column(h, justify="left" if h in ("wire", "outer") else "right")
    for cells in pareto_rows(rows):
        pareto.add_row(*cells)
    console.print(pareto)
    front = front_checks(rows)
    for v in front:
        mark = "[green]PASS[/green]" if v["pass"] else "[red]FAIL[/red]"
        console.print(f"{mark} {front_line(v)}", highlight=False)
    return checks + front


def markdown(setting: Setting, rows: list[Row], checks: list[dict[str, Any]]) -> str:
    lines = [
        f"N={setting.replicas} replicas, {setting.steps} inner steps per replica, seed "
        f"{setting.seed}, lm options {setting.lm or 'default'}; DiLoCo outer Nesterov SGD lr "
        f"{setting.outer_lr} momentum {setting.outer_momentum}{crf_tag(setting)} unless named.",
        "",
        "| " + " | ".join(h.replace("->", "→") for h in HEADERS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(HEADERS))) + "|",
    ]
    lines += [
        "| " + " | ".join(c.replace("->", "→") for c in cells) + " |" for cells in table_rows(rows)
    ]
    lines.append("")
    lines += notes(rows)
    lines.append("")
    for v in checks:
        if "why" not in v:  # a front target: listed under the Pareto table
            continue
        lines.append(
            f"- **{'PASS' if v['pass'] else 'FAIL'}** {v['method']}: eval loss "
            f"{v['loss_vs_ddp_pct']:+.2f}% vs DDP (target ≤ +{v['max_pct']}%), "
            f"{v['bytes_ratio']:.1f}× fewer bytes (target ≥ {v['min_ratio']:.0f}×)"
            + (f" — {v['why']}" if v["why"] else "")
        )
    lines += [
        "",
        "Pareto: exchange bytes vs eval loss, most bytes first (* = on the front: no other "
        "row has fewer or as many bytes and a lower or equal loss).",
        "",
        "| " + " | ".join(PARETO_HEADERS) + " |",
        "|" + "|".join("---" if i in (0, 3) else "---:" for i in range(len(PARETO_HEADERS))) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in pareto_rows(rows)]
    lines.append("")
    lines += [
        f"- **{'PASS' if v['pass'] else 'FAIL'}** {front_line(v, md=True)}"
        for v in front_checks(rows)
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="100 inner steps: a few minutes")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="inner steps per replica")
    p.add_argument("--syncs", default="10,50", help="H values for DiLoCo, comma separated")
    p.add_argument("--wires", default="float32,int8", help="DiLoCo wire formats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outer-lr", type=float, default=OUTER_LR)
    p.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM)
    p.add_argument(
        "--reference-outer",
        default=None,
        help="LR,MOMENTUM of an extra DiLoCo H=max fp32 row for reference (default: the "
        "DiLoCo paper's 0.7,0.9 in the full setting, none with --quick; 'none' to skip)",
    )
    p.add_argument(
        "--outer-grid",
        default="",
        help="more fp32 rows with an outer of their own: comma-separated H:LR/MOMENTUM",
    )
    p.add_argument(
        "--sparse",
        default=None,
        help=f"sparse rows, comma-separated WIRE@PERCENT[/FORM] (FORM: {', '.join(OUTER_FORMS)}"
        f"; both when left out); default {SPARSE_DEFAULT} in the full setting, none with "
        "--quick; rows whose wire is not registered are skipped",
    )
    p.add_argument(
        "--sparse-h", default=None, help="H of the sparse rows, comma separated (default: max H)"
    )
    p.add_argument("--set", action="append", default=[], help="lm job option key=value")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="DiLoCo global state every K rounds (default 0: only the last round's)",
    )
    p.add_argument("--store", default=None, help="store folder for DiLoCo runs (default: tmp)")
    p.add_argument("--out", default=None, help="write a markdown table here (+ .json beside it)")
    p.add_argument("--skip", default="", help="methods to skip: ddp,single,diloco")
    p.add_argument(
        "--from-json",
        default="",
        help="run nothing: report the rows of earlier --out JSON files (comma separated, same "
        "replicas, steps, seed and lm options) as one table",
    )
    return p.parse_args(argv)


def setting_of(a: argparse.Namespace) -> Setting:
    lm: dict[str, Any] = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        lm[k] = v
    from crf.replica.jobs import job_config

    lm = {k: getattr(job_config("lm", lm), k) for k in lm}  # typed + validated
    return Setting(
        replicas=a.replicas,
        steps=a.steps or (100 if a.quick else 400),
        syncs=tuple(int(h) for h in a.syncs.split(",") if h),
        wires=tuple(w for w in a.wires.split(",") if w),
        seed=a.seed,
        outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum,
        lm=lm,
        checkpoint_every=a.checkpoint_every,
    ).check()


def arms_of(a: argparse.Namespace, setting: Setting) -> list[Arm]:
    """Every DiLoCo row the arguments ask for, in the order they run."""
    crf_default = (OUTER_LR, OUTER_MOMENTUM)

    def tagged(arm: Arm) -> Arm:
        outer = arm.outer(setting)
        tag = "crf default" if outer == crf_default else ""
        return dataclasses.replace(arm, tag="DiLoCo paper" if outer == PAPER_OUTER else tag)

    arms = [Arm(h, w) for h in setting.syncs for w in setting.wires]
    ref_text = a.reference_outer or ("none" if a.quick else "")
    if ref_text != "none":
        lr_text, _, mom_text = ref_text.partition(",")
        lr, m = (float(lr_text), float(mom_text)) if ref_text else PAPER_OUTER
        arms.append(tagged(Arm(max(setting.syncs), outer_lr=lr, outer_momentum=m)))
    for cell in filter(None, a.outer_grid.split(",")):
        h, _, outer = cell.partition(":")
        lr_text, _, mom_text = outer.partition("/")
        arms.append(tagged(Arm(int(h), outer_lr=float(lr_text), outer_momentum=float(mom_text))))
    for h in (int(x) for x in a.sparse_h.split(",")) if a.sparse_h else (max(setting.syncs),):
        arms += sparse_arms(h, a.sparse or ("none" if a.quick else SPARSE_DEFAULT))
    Setting(steps=setting.steps, syncs=tuple(x.sync_every for x in arms)).check()
    return arms


def run_all(
    setting: Setting,
    arms: list[Arm],
    skip: set[str],
    store: str,
    console: Any,
    save: Callable[[list[Row]], None] = lambda rows: None,
) -> list[Row]:
    """Every method not in ``skip``; ``save`` gets the rows so far after each one (a long
    run killed half-way keeps what it measured)."""
    rows: list[Row] = []
    if "ddp" not in skip:
        console.print(f"[bold]DDP[/bold] gloo, N={setting.replicas}, {setting.steps} steps ...")
        rows.append(run_ddp(setting))
        save(rows)
    for arm in arms if "diloco" not in skip else []:
        if not arm.registered():
            console.print(f"[yellow]skipped[/yellow] {arm.label()}: wire {arm.wire} not registered")
            continue
        console.print(f"[bold]{arm.label()}[/bold] through crf ...")
        rows.append(run_diloco(setting, arm, store))
        save(rows)
    for mode in ("shard0", "all") if "single" not in skip else ():
        console.print(f"[bold]one replica[/bold] ({mode}) ...")
        rows.append(run_single(setting, mode))
        save(rows)
    return rows


def write_out(path: str, setting: Setting, rows: list[Row], checks: list[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(markdown(setting, rows, checks))
    write_json(path, setting, rows, checks)


def write_json(path: str, setting: Setting, rows: list[Row], checks: list[dict[str, Any]]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "setting": dataclasses.asdict(setting),
                "rows": [dataclasses.asdict(r) for r in rows],
                "checks": checks,
            },
            indent=1,
        )
    )


def load_rows(paths: list[str]) -> tuple[Setting, list[Row]]:
    """The rows of earlier runs' JSON files, as one run: the first file's DDP and setting,
    every method once (the first file that has it)."""
    setting: Setting | None = None
    rows: list[Row] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        s = data["setting"]
        here = Setting(**{**s, "syncs": tuple(s["syncs"]), "wires": tuple(s["wires"])})
        same = ("replicas", "steps", "seed", "lm")
        if setting and any(getattr(here, k) != getattr(setting, k) for k in same):
            raise SystemExit(f"{path}: not the setting of {paths[0]} ({', '.join(same)})")
        setting = setting or here
        seen = {r.method for r in rows} | {r.kind for r in rows if r.kind == "ddp"}
        for r in data["rows"]:
            row = Row(**r)
            x = row.extra
            if row.kind == "diloco" and "outer_lr" in x:  # runs with --outer-lr: say so
                row.method = named(
                    row.method, x["outer_lr"], x["outer_momentum"], x.get("outer_form")
                )
            if (row.kind if row.kind == "ddp" else row.method) not in seen:
                rows.append(row)
    if setting is None or not any(r.kind == "ddp" for r in rows):
        raise SystemExit("--from-json: no file with a DDP row given")
    return setting, rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # e.g. nohup into a file: keep the table readable
        console = Console(width=140)
    t0 = time.monotonic()
    if a.from_json:
        setting, rows = load_rows(a.from_json.split(","))
    else:
        setting = setting_of(a)
        arms = arms_of(a, setting)
        skip = set(a.skip.split(","))

        def save(rows: list[Row]) -> None:
            if a.out:
                write_json(a.out, setting, rows, [])

        with tempfile.TemporaryDirectory(prefix="crf-quality-runs-") as tmp:
            rows = run_all(setting, arms, skip, a.store or tmp, console, save)
    console.print(f"total {time.monotonic() - t0:.0f} s")
    if not any(r.kind == "ddp" for r in rows):
        console.print("no DDP row (--skip ddp): report it with --from-json and a run that has one")
        return 0
    checks = print_report(setting, rows, console)
    if a.out:
        write_out(a.out, setting, rows, checks)
        console.print(f"wrote {a.out} and {Path(a.out).with_suffix('.json')}")
    if a.quick:
        console.print(
            "--quick is a smoke run: H=50 gets only "
            f"{setting.steps // max(setting.syncs)} rounds, so its verdicts say little; "
            "the targets are for the full setting."
        )
        return 0
    return 0 if all(v["pass"] for v in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
