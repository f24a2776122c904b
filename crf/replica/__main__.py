"""``python -m crf.replica``: the replica entrypoint every backend starts.

With ``CRF_ROLE=rollout`` the process is a rollout worker instead (crf/rollouts/worker.py).

Reads the env contract and ``run.json``, runs the job named there, writes the result. Exits 0
on success, 1 if the job failed (the failure is also recorded in ``results/<rank>.json``),
2 if the environment breaks the contract, 3 if the job failed with an error a restart cannot
fix (the replicas disagree on the model: ``crf.exchange.manager.restart_cannot_help``). The
driver restarts a replica that exited 1, never one that exited 2 or 3.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from crf import layout
from crf.replica.failures import EXIT_UNRECOVERABLE  # the job failed; a restart would too


def _set_threads(world_size: int, backend: str) -> None:
    """Replicas sharing one machine (local backend) split its cores instead of oversubscribing."""
    import torch

    threads = os.environ.get(layout.ENV_TORCH_THREADS)
    if threads:
        torch.set_num_threads(int(threads))
    elif backend == "local":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def main() -> int:
    if os.environ.get(layout.ENV_ROLE, layout.ROLE_TRAINER) == layout.ROLE_ROLLOUT:
        from crf.rollouts.worker import main as rollout_worker

        return rollout_worker()
    from crf.exchange.memory import limit_malloc_arenas
    from crf.replica import local_ranks

    # before any transfer thread exists: shard-sized buffers then come back to one arena
    limit_malloc_arenas()
    from crf.replica import logs

    rank = os.environ.get(layout.ENV_RANK, "?")
    worker = local_ranks.is_worker()
    logs.configure(f"{rank}.{os.environ.get('LOCAL_RANK', '?')}" if worker else rank)
    if worker:
        return _local_rank()
    from crf.replica.context import ContractError, ReplicaContext

    try:
        store, spec, rank_n, world = ReplicaContext.read_contract()
        k = local_ranks.procs_per_replica(spec)
        if k > 1:  # this process is the replica's launcher; its local ranks train
            return _launch_local_ranks(spec, k, rank_n)
        ctx = ReplicaContext(store, spec, rank_n, world)
    except ContractError as e:
        print(f"crf.replica: {e}", file=sys.stderr)
        return 2
    _set_threads(ctx.world_size, ctx.spec.backend)
    return _train(ctx)


def _launch_local_ranks(spec: Any, k: int, rank: int) -> int:
    """Replica ``rank`` as ``k`` local ranks (crf/replica/local_ranks.py)."""
    from crf.replica import local_ranks
    from crf.replica.jobs import get_job

    if not local_ranks.supports_local_ranks(get_job(spec.job)):
        print(
            f"crf.replica: job {spec.job!r} trains on one process per replica; "
            f"--procs-per-replica {k} needs a job that trains data-parallel (lm, composer)",
            file=sys.stderr,
        )
        return EXIT_UNRECOVERABLE
    return local_ranks.run_agent(k, rank)


def _local_rank() -> int:
    """One local rank of a replica: rank 0 is the replica (store, DiLoCo, results), the
    others follow it over the local process group."""
    from crf.replica.context import ContractError, ReplicaContext
    from crf.replica.local_ranks import LocalFollower, LocalGroup
    from crf.spec import RunSpec

    local = LocalGroup.init()
    try:
        ctx: Any
        if local.leader:
            try:
                ctx = ReplicaContext.from_env()
            except ContractError as e:
                print(f"crf.replica: {e}", file=sys.stderr)
                return 2
            ctx.local = local
            local.share(ctx.spec.to_json())
            local.mode = getattr(ctx.spec, "local_parallel", None) or "ddp"
        else:
            spec = RunSpec.from_json(local.share())
            local.mode = getattr(spec, "local_parallel", None) or "ddp"
            rank, world = int(os.environ[layout.ENV_RANK]), int(os.environ[layout.ENV_WORLD_SIZE])
            ctx = LocalFollower(spec, rank, world, local)
        _set_threads(ctx.world_size * local.size, ctx.spec.backend)
        return _train(ctx)
    finally:
        local.close()


def _train(ctx: Any) -> int:
    """Run the job in ``ctx``; the exit code."""
    from crf.exchange.manager import restart_cannot_help
    from crf.replica.failures import one_line
    from crf.replica.jobs import get_job, job_config
    from crf.replica.rewards import record_stuck_with

    log = logging.getLogger("crf.replica")
    log.info("run %s rank %d/%d job %s", ctx.spec.run_id, ctx.rank, ctx.world_size, ctx.spec.job)
    if hasattr(ctx, "fail"):  # a reward call that outlives its time is recorded, then ends us
        record_stuck_with(ctx.fail)
    try:
        with ctx:
            job = get_job(ctx.spec.job)
            metrics = job.run(ctx, job_config(ctx.spec.job, ctx.spec.job_config))
            ctx.finish(metrics)
    # a job may raise anything: it is recorded (ctx.fail) and becomes the exit code
    except Exception as e:
        if restart_cannot_help(e):  # one line: the traceback adds nothing to what it says
            log.error("replica failed, and a restart cannot fix it: %s", one_line(e))
            return EXIT_UNRECOVERABLE
        failure = getattr(ctx, "failure", None)
        if failure is not None and failure[1]:
            # the run's input or the job's code: the traceback (the user's own frames) stays
            # in this log for whoever fixes it; the driver's summary shows the one line
            log.error(
                "replica failed%s, and a restart cannot fix it: %s",
                " at setup" if failure[0] == "starting" else "",
                one_line(e),
                exc_info=True,
            )
            return EXIT_UNRECOVERABLE
        log.exception("replica failed")
        return 1
    log.info(
        "done: %d steps, %s rounds committed",
        ctx.step,
        ctx.manager.rounds_committed if ctx.manager else 0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
