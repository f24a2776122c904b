"""Benchmark: do rollout workers (asynchronous GRPO with bounded staleness) learn as well as
synchronous GRPO, and how much wall time do they save?

Every arm is a real local run of the ``composer`` job (the tiny model on the embedded
string-reversal task, everything built in code) through ``crf.launch``, with the same
replicas, rounds, H and seed set; the arms differ only in where the rollouts come from:

* ``sync``         — no rollout workers: each trainer generates its own rollouts (today's
                     run, the baseline);
* ``async-s0``     — one rollout worker per trainer, ``--max-staleness 0``: on-policy through
                     the workers (the trainer waits for each batch), which tells what the
                     transport costs from what the lag costs;
* ``async-s1``     — the same at ``--max-staleness 1``;
* ``async-s2``     — the same at ``--max-staleness 2``;
* ``async-s2-off`` — staleness 2 with the off-policy correction off
                     (``--rollout-correction off``): does the correction matter here?
* ``slow-s2``      — staleness 2 with workers 4x slower than they can generate (each batch
                     takes four times its generation time: ``CRF_ROLLOUT_SLOWDOWN=4``), for
                     the wall-time gain when workers are slower GPUs than the trainers.

Reported per arm, as mean ± σ over the seeds: the final held-out pass@1 (the summary's
``held_out.pass@1_after``: greedy, every replica's share of the held-out prompts), the area
under the reward curve (the mean over rounds of the replicas' mean training reward: higher
is faster learning), the wall time, the time per round once training runs (the gain
against sync is taken on it: starting processes and building models is the same for every
arm and not what workers change), the share of the trainers' rollouts the workers supplied,
their mean staleness and the mean mismatch KL of the batches trained on (how far per token
the sampling policy was from the training one). The verdict checks each asynchronous arm against the
synchronous seeds: pass@1 and reward AUC within max(0.05, 2σ of sync) and within 10% of
sync. If the correction-off arm does not fall behind on either measure, the benchmark
says it cannot tell the correction's worth on this task.

On a CPU machine the trainers and workers share its cores: the processes run with one
torch thread each (``CRF_TORCH_THREADS=1``), one trainer per worker, so the default of one
trainer and one worker fits two cores. Wall-time gains measured that way are a lower bound
for workers on their own GPUs.

Usage::

    python bench/async.py --rounds 8 --sync-every 30 --set learning_rate=5e-4
                                                # docs/rollout-workers.md's main table:
                                                # 3 seeds x 6 arms, about 12 min on 2 cores
    python bench/async.py --rounds 4 --sync-every 15   # its table at the task's own rate
    python bench/async.py --quick               # 1 seed, fewer steps: a smoke run
    python bench/async.py --out async.md        # also write the markdown table (+ .json)
    python bench/async.py --report async.json   # the table of a saved run again
    python bench/async.py --set learning_rate=1e-3   # a composer job knob for every arm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crf import layout  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """One setting: its rollout-worker options and the workers' slowdown."""

    name: str
    workers: bool = False
    staleness: int = 1
    correction: str = "token_truncate"
    slowdown: float = 1.0

    def options(self, replicas: int) -> dict[str, Any]:
        if not self.workers:
            return {}
        return {"rollout_workers": replicas, "max_staleness": self.staleness,
                "rollout_correction": self.correction}  # fmt: skip


ARMS = (
    Arm("sync"),
    Arm("async-s0", workers=True, staleness=0),
    Arm("async-s1", workers=True, staleness=1),
    Arm("async-s2", workers=True, staleness=2),
    Arm("async-s2-off", workers=True, staleness=2, correction="off"),
    Arm("slow-s2", workers=True, staleness=2, slowdown=4.0),
)


@dataclass
class Outcome:
    """One run of one arm at one seed."""

    arm: str
    seed: int
    status: str
    pass_at_1: float | None
    reward_auc: float | None
    wall_s: float
    worker_share: float | None = None
    staleness: float | None = None
    rewards: list[float] = field(default_factory=list)
    #: seconds per round once training runs (see :func:`round_time`)
    round_s: float | None = None
    #: the mean mismatch KL (nats per token) of the worker batches trained on
    mismatch_kl: float | None = None


def _run_folder(store: str) -> Any:
    from crf.store import RunStore

    for name in sorted(os.listdir(store)):
        if os.path.exists(os.path.join(store, name, layout.RUN_SPEC)):
            return RunStore(f"file://{os.path.join(store, name)}")
    raise RuntimeError(f"no run in {store}")


def _records(run: Any, replicas: int) -> dict[int, list[layout.RoundMetrics]]:
    """Each round's committed records, every replica's."""
    out: dict[int, list[layout.RoundMetrics]] = {}
    for rank in range(replicas):
        for r in layout.metrics_rounds(run, rank):
            rec = layout.RoundMetrics.from_dict(run.get_json(layout.metrics_key(rank, r)))
            if rec.committed:
                out.setdefault(r, []).append(rec)
    return dict(sorted(out.items()))


def reward_curve(records: dict[int, list[layout.RoundMetrics]]) -> list[float]:
    """Per round, the replicas' mean training reward (the job logs ``reward`` per round)."""
    curve = []
    for recs in records.values():
        values = [float(m.metrics["reward"]) for m in recs if "reward" in m.metrics]
        if values:
            curve.append(statistics.fmean(values))
    return curve


def round_time(records: dict[int, list[layout.RoundMetrics]]) -> float | None:
    """Seconds per round in steady state: from the first committed round's record to the
    last one's, per round between them (each replica's, averaged). It leaves out what every
    arm pays once and workers cannot change: starting the processes, building the models and
    the first round's filling of the workers' pipeline."""
    firsts: dict[int, float] = {}
    lasts: dict[int, tuple[int, float]] = {}
    first_round: dict[int, int] = {}
    for r, recs in records.items():
        for m in recs:
            if m.rank not in firsts:
                firsts[m.rank], first_round[m.rank] = m.updated_at, r
            lasts[m.rank] = (r, m.updated_at)
    spans = [(t - firsts[k]) / (r - first_round[k]) for k, (r, t) in lasts.items()
             if r > first_round[k]]  # fmt: skip
    return statistics.fmean(spans) if spans else None


def mismatch(records: dict[int, list[layout.RoundMetrics]]) -> float | None:
    """The mean over rounds and workers of the correction's mismatch KL: how far, per token,
    the policy that sampled a batch was from the one that trained on it."""
    values = [
        float(stats["mismatch_kl"])
        for recs in records.values()
        for m in recs
        for stats in (m.rollouts.get("correction") or {}).values()
        if isinstance(stats, dict) and stats.get("mismatch_kl") is not None
    ]
    return statistics.fmean(values) if values else None


def worker_use(records: dict[int, list[layout.RoundMetrics]]) -> tuple[float | None, float | None]:
    """The share of rollouts the workers supplied, and their mean staleness (inner steps)."""
    from_workers = local = 0.0
    stale: list[float] = []
    for recs in records.values():
        for m in recs:
            from_workers += float(m.rollouts.get("workers", 0) or 0)
            local += float(m.rollouts.get("local", 0) or 0)
            if m.rollouts.get("staleness_mean") is not None:
                stale.append(float(m.rollouts["staleness_mean"]))
    total = from_workers + local
    share = from_workers / total if total else None
    return share, (statistics.fmean(stale) if stale else None)


def run_arm(arm: Arm, seed: int, args: argparse.Namespace) -> Outcome:
    import crf

    env_before = dict(os.environ)
    os.environ["CRF_TORCH_THREADS"] = "1"
    if arm.slowdown != 1.0:
        os.environ[layout.ENV_ROLLOUT_SLOWDOWN] = f"{arm.slowdown:g}"
    try:
        with tempfile.TemporaryDirectory(prefix="crf-bench-async-") as store:
            t0 = time.perf_counter()
            run = crf.launch(
                job="composer",
                backend="local",
                replicas=args.replicas,
                rounds=args.rounds,
                sync_every=args.sync_every,
                seed=seed,
                eval_examples=args.eval_examples,
                job_config=dict(args.set),
                store=store,
                plot=False,
                report=False,
                **arm.options(args.replicas),
            )
            wall = time.perf_counter() - t0
            result = run.result
            folder = _run_folder(store)
            records = _records(folder, args.replicas)
            curve = reward_curve(records)
            share, staleness = worker_use(records)
            held = (result.held_out or {}) if result else {}
            return Outcome(
                arm=arm.name,
                seed=seed,
                status=result.status if result else "no result",
                pass_at_1=held.get("pass@1_after"),
                reward_auc=statistics.fmean(curve) if curve else None,
                wall_s=wall,
                worker_share=share,
                staleness=staleness,
                rewards=curve,
                round_s=round_time(records),
                mismatch_kl=mismatch(records),
            )
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def _stats(values: list[float | None]) -> tuple[float | None, float]:
    got = [v for v in values if v is not None]
    if not got:
        return None, 0.0
    return statistics.fmean(got), (statistics.stdev(got) if len(got) > 1 else 0.0)


def verdicts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Each asynchronous arm against the synchronous seeds, on pass@1 and reward AUC: within
    max(0.05, 2σ of sync) and within 10% of sync's mean."""
    by_arm: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_arm.setdefault(o.arm, []).append(o)
    sync = by_arm.get("sync", [])
    out = []
    for name, runs in by_arm.items():
        if name == "sync" or not sync:
            continue
        for metric in ("pass_at_1", "reward_auc"):
            base, sigma = _stats([getattr(o, metric) for o in sync])
            mean, _ = _stats([getattr(o, metric) for o in runs])
            if base is None or mean is None:
                out.append({"arm": name, "metric": metric, "ok": False, "why": "not measured"})
                continue
            gap = base - mean  # how far it fell behind (negative: ahead)
            bound = max(0.05, 2 * sigma)
            ok = gap <= bound and gap <= 0.10 * abs(base)
            out.append({"arm": name, "metric": metric, "ok": ok, "sync": base, "mean": mean,
                        "gap": gap, "bound": min(bound, 0.10 * abs(base))})  # fmt: skip
    return out


def correction_note(outcomes: list[Outcome]) -> str:
    """Whether turning the correction off made the run fall behind, on either measure: by
    more than max(0.05, 2σ of the corrected arm's seeds)."""
    behind, measured = [], False
    for metric, label in (("pass_at_1", "pass@1"), ("reward_auc", "reward AUC")):
        on = _stats([getattr(o, metric) for o in outcomes if o.arm == "async-s2"])
        off = _stats([getattr(o, metric) for o in outcomes if o.arm == "async-s2-off"])
        if on[0] is None or off[0] is None:
            continue
        measured = True
        if off[0] < on[0] - max(0.05, 2 * on[1]):
            behind.append(f"{label} {off[0]:.3f} vs {on[0]:.3f} with it")
    if not measured:
        return "correction: not measured"
    if behind:
        return "correction off falls behind: " + ", ".join(behind)
    return (
        "correction off does not fall behind: at this staleness and on this task the "
        "benchmark cannot tell the correction's worth"
    )


def table(outcomes: list[Outcome]) -> list[list[str]]:
    def fmt(values: list[float | None], digits: int = 3) -> str:
        mean, sd = _stats(values)
        return "n/a" if mean is None else f"{mean:.{digits}f} ± {sd:.{digits}f}"

    rows = []
    sync_round, _ = _stats([o.round_s for o in outcomes if o.arm == "sync"])
    for arm in ARMS:
        runs = [o for o in outcomes if o.arm == arm.name]
        if not runs:
            continue
        wall, _ = _stats([o.wall_s for o in runs])
        per_round, _ = _stats([o.round_s for o in runs])
        gain = f"{sync_round / per_round:.2f}x" if sync_round and per_round else "n/a"
        rows.append([
            arm.name, str(len(runs)), fmt([o.pass_at_1 for o in runs]),
            fmt([o.reward_auc for o in runs]), f"{wall:.0f} s" if wall else "n/a",
            f"{per_round:.2f} s" if per_round else "n/a", gain,
            fmt([o.worker_share for o in runs], 2), fmt([o.staleness for o in runs], 2),
            fmt([o.mismatch_kl for o in runs], 4),
            ", ".join(sorted({o.status for o in runs})),
        ])  # fmt: skip
    return rows


HEADER = ["arm", "seeds", "held-out pass@1", "reward AUC", "wall", "per round", "vs sync",
          "worker share", "staleness", "mismatch KL", "status"]  # fmt: skip


def markdown(rows: list[list[str]], checks: list[dict[str, Any]], note: str, cmd: str) -> str:
    lines = [f"Measured with `{cmd}`.", "", "| " + " | ".join(HEADER) + " |",
             "|" + "---|" * len(HEADER)]  # fmt: skip
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    for c in checks:
        if "gap" in c:
            verdict = "PASS" if c["ok"] else "FAIL"
            lines.append(f"- {c['arm']} {c['metric']}: {c['mean']:.3f} vs sync {c['sync']:.3f} "
                         f"(allowed gap {c['bound']:.3f}): {verdict}")  # fmt: skip
        else:
            lines.append(f"- {c['arm']} {c['metric']}: {c['why']}")
    lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def _knob(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set needs KEY=VALUE (got {text!r})")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 3 rounds: a smoke run")
    p.add_argument("--replicas", type=int, default=1, help="trainer replicas (one worker each)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(a.name for a in ARMS))
    p.add_argument("--eval-examples", type=int, default=64)
    p.add_argument("--set", action="append", default=[], type=_knob, metavar="KEY=VALUE",
                   help="a composer job knob for every arm (e.g. learning_rate=1e-3)")  # fmt: skip
    p.add_argument("--out", default=None, help="also write a markdown table here (+ .json)")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the table of a run's saved .json, running nothing")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.sync_every = "0", 3, 10
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = [Outcome(**o) for o in json.load(f)]
        print(markdown(table(saved), verdicts(saved), correction_note(saved),
                       f"python bench/async.py, saved in {args.report}"))  # fmt: skip
        return 0 if all(c["ok"] for c in verdicts(saved)) else 1
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    wanted = {a.strip() for a in args.arms.split(",") if a.strip()}
    arms = [a for a in ARMS if a.name in wanted]
    outcomes: list[Outcome] = []
    for seed in seeds:
        for arm in arms:
            print(f"running {arm.name}, seed {seed} ...", flush=True)
            o = run_arm(arm, seed, args)
            outcomes.append(o)
            print(f"  {o.status}: pass@1 {o.pass_at_1}, reward AUC {o.reward_auc}, "
                  f"{o.wall_s:.0f} s, {o.round_s} s/round, worker share {o.worker_share}, "
                  f"staleness {o.staleness}", flush=True)  # fmt: skip
    rows = table(outcomes)
    checks = verdicts(outcomes)
    note = correction_note(outcomes)
    cmd = "python bench/async.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, checks, note, cmd.strip())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump([o.__dict__ for o in outcomes], f, indent=1)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
