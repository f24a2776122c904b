"""Local ranks: a replica that is a whole machine (``--procs-per-replica K`` > 1).

The replica process (``python -m crf.replica``) becomes torch.distributed's elastic agent, the
launcher behind ``torchrun`` (``elastic_launch``: one node, K workers, no restarts, a c10d
rendezvous on a free local port). Each worker is ``python -m crf.replica`` again, told it is
one by ``CRF_LOCAL_WORKER`` and by torch's LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_* variables.
The workers form one process group (gloo for CPU tensors, NCCL for CUDA ones) and train
data-parallel: DDP averages the gradients of each inner step, every local rank computing them
on its own slice of the replica's batch (:meth:`LocalGroup.part`), so the replica's batch is
the one it would be with K = 1.

Local rank 0 is the replica as K = 1 knows it (a ReplicaContext: store, heartbeats, DiLoCo,
metrics, results, checkpoints); the others are :class:`LocalFollower` s that never write to
the store. Inner steps keep every local rank's weights and inner optimizer the same (same
averaged gradients, same optimizer); after each sync's outer step (and after a resume, and at
the end) local rank 0 broadcasts its step counter and weights to the others. A dead worker
ends the others (max_restarts=0) and the replica exits 1: the driver restarts it as it
restarts any failed replica. Design: docs/design.md, "Replica runtime".
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from crf import layout
from crf.replica import local_fsdp

log = logging.getLogger(__name__)

#: the exit codes of a replica (crf.replica.__main__), most telling first: a worker's code
#: the driver must see as it is (2: contract broken, 3: a restart cannot help)
_KEPT_EXIT_CODES = (3, 2)


def procs_per_replica(spec: Any) -> int:
    """K of a run (an older run.json has no such field: 1)."""
    return int(getattr(spec, "procs_per_replica", None) or 1)


def label(k: int | None, mode: str = "ddp") -> str:
    """``--procs-per-replica`` (and ``--local-parallel``) as the dry-run plan shows it."""
    if not k or k == 1:
        return "1"
    how = "FSDP2" if mode == "fsdp" else "DDP"
    return f"{k} local ranks ({how} inside each replica; one of them exchanges)"


def idle_gpus(gpus: int, k: int | None, job_trains_on_ranks: bool) -> str | None:
    """The dry-run plan's warning when each replica's hardware has more GPUs than its K
    local ranks use (None when it does not): the run pays for GPUs that sit idle."""
    k = k or 1
    if gpus <= k:
        return None
    fix = (
        f"leave --procs-per-replica out (it defaults to the {gpus} GPUs) or choose smaller hardware"
        if job_trains_on_ranks
        else "this job trains on one process per replica: choose hardware with one GPU"
    )
    return f"each replica has {gpus} GPUs but trains on {k} process(es), {gpus - k} idle: {fix}"


def is_worker(environ: Any = None) -> bool:
    """Whether this process is one of a replica's local ranks (started by :func:`run_agent`,
    which sets ``CRF_LOCAL_WORKER`` to its own pid)."""
    env = os.environ if environ is None else environ
    return bool(env.get(layout.ENV_LOCAL_WORKER))


def die_with_agent() -> None:
    """End this local rank when the replica's agent process ends, however it ends. The
    launcher starts each worker in a session of its own, so a ``killpg`` of the replica (the
    local backend's cancel) and a SIGKILL after it reach the agent only: without this, its
    local rank 0 would go on writing to the store of a cancelled run. (Linux: prctl's
    parent-death signal; elsewhere the launcher's own shutdown on SIGTERM is all there is.)"""
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if str(os.getppid()) != os.environ.get(layout.ENV_LOCAL_WORKER):
        os._exit(1)  # the agent was gone before the signal was armed


def supports_local_ranks(job: Any) -> bool:
    """Whether a job module trains data-parallel across local ranks (it says so with
    ``LOCAL_RANKS = True``; it then uses ``ctx.data_parallel`` and ``ctx.local_part``)."""
    return bool(getattr(job, "LOCAL_RANKS", False))


def size_of(ctx: Any) -> int:
    """K of the replica a job runs in (its context's local group; 1 without one)."""
    local = getattr(ctx, "local", None)
    return local.size if local is not None else 1


def batch_error(job_name: str, job: Any, config: Any, k: int, spec: Any = None) -> str | None:
    """Why the job's replica batch cannot be split over ``k`` local ranks (None if it can):
    a job that knows its batch says so with ``replica_batch(config, spec) -> int`` (the rows
    of one inner step, all local ranks together, for run options ``spec``), so a bad split
    stops before launch."""
    rows_of = getattr(job, "replica_batch", None)
    if k <= 1 or rows_of is None:
        return None
    rows = int(rows_of(config, spec))
    if rows % k == 0:
        return None
    return (
        f"job {job_name!r} takes {rows} rows per inner step, which {k} local ranks cannot share "
        f"evenly: make it a multiple of --procs-per-replica {k}, or pick another K"
    )


def trainer_args(ctx: Any, replica_batch: int) -> dict[str, Any]:
    """``TrainingArguments`` fields that make a transformers / TRL Trainer train one replica
    across its K local ranks: each rank's ``per_device_train_batch_size`` is the replica's
    batch / K (accelerate finds the local process group and wraps the model in DDP, and
    GRPOTrainer's sampler and reward gather span the K processes, so the replica's batch is
    the one it is with K = 1). DDP neither broadcasts buffers nor looks for unused
    parameters: either would make every forward a collective, and a job may run a different
    number of forwards on each rank (the composer's channels run on the rows a rank holds);
    the buffers are local rank 0's anyway (the weights it shares). With K = 1: the batch."""
    k = size_of(ctx)
    if replica_batch % k:
        raise ValueError(
            f"a batch of {replica_batch} rows cannot be split over {k} local ranks: make the "
            "job's batch a multiple of --procs-per-replica"
        )
    out: dict[str, Any] = {"per_device_train_batch_size": replica_batch // k}
    if k > 1:
        out.update(ddp_broadcast_buffers=False, ddp_find_unused_parameters=False)
    return out


def run_agent(k: int, replica_rank: int) -> int:
    """Run this replica as K local ranks under torch.distributed's elastic launcher; the
    replica's exit code: 0 if every local rank ended 0, else a kept code (3, 2) of one of
    them, else 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=k,
        run_id=f"crf-replica-{replica_rank}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: a free port of this machine
        max_restarts=0,  # a dead local rank fails the replica; the driver restarts it
        monitor_interval=0.2,
    )
    os.environ[layout.ENV_LOCAL_WORKER] = str(os.getpid())  # the workers inherit it
    try:
        elastic_launch(config, sys.executable)("-m", "crf.replica")
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        log.error("a local rank failed (exit codes %s): the replica fails", sorted(codes))
        return next((c for c in _KEPT_EXIT_CODES if c in codes), 1)
    return 0


@dataclass
class LocalGroup:
    """This worker's place in its replica's process group, and the collectives crf uses.
    ``mode`` is ``--local-parallel``: with "fsdp" the job's model is sharded (``sharded``,
    set by :meth:`wrap`) and weights move by full state dicts (crf/replica/local_fsdp.py)."""

    rank: int
    size: int
    mode: str = "ddp"
    #: the job's model as FSDP2 sharded it (mode "fsdp", once :meth:`wrap` ran)
    sharded: Any = None
    #: local rank 0 with FSDP: the full copy in host memory that DiLoCo wraps
    mirror: Any = None
    #: local rank 0 with FSDP: its gathering hook, which keeps the full inner state
    refresh: MirrorRefresh | None = None

    @property
    def fsdp(self) -> bool:
        return self.mode == "fsdp"

    @classmethod
    def init(cls) -> LocalGroup:
        """Join the replica's process group (env:// from the launcher's variables)."""
        import torch
        import torch.distributed as dist

        die_with_agent()
        rank, size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(rank)  # "cuda" is then this rank's own GPU
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        return cls(rank, size)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, obj: Any = None) -> Any:
        """Local rank 0's ``obj`` on every local rank (pickled; small things only)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share_weights(self, model: Any) -> None:
        """Local rank 0's parameters and buffers into every local rank's model, in place.
        With FSDP, ``model`` is rank 0's full mirror (ignored elsewhere) and goes into every
        rank's shards."""
        import torch
        import torch.distributed as dist

        if self.fsdp:
            local_fsdp.scatter_weights(self.sharded, model if self.leader else None)
            return
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the local ranks (a step's loss on the whole batch)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.size

    def part(self, batch: Any) -> Any:
        """This rank's contiguous slice of the replica's batch (rows)."""
        n = len(batch)
        if n % self.size:
            raise ValueError(
                f"a batch of {n} rows cannot be split over {self.size} local ranks: make the "
                "job's batch size a multiple of --procs-per-replica"
            )
        per = n // self.size
        return batch[self.rank * per : (self.rank + 1) * per]

    def wrap(self, model: Any) -> Any:
        """``model`` under DDP over the local group (gradients averaged every backward), or
        with FSDP sharded over it in place (the job then builds its optimizer after this)."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        if self.fsdp:
            if self.leader:
                self.mirror = local_fsdp.mirror_of(model)
            self.sharded = local_fsdp.shard(model)
            return self.sharded
        on_cuda = next(model.parameters()).is_cuda
        ids = [torch.cuda.current_device()] if on_cuda else None
        return DistributedDataParallel(model, device_ids=ids)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class LocalFollower:
    """What a job sees on local ranks 1..K-1: the replica's identity and schedule, and the
    same calls as a ReplicaContext, none of which touches the store. Its inner steps follow
    local rank 0's; after each sync it takes rank 0's weights and step."""

    store = None
    manager = None

    def __init__(self, spec: Any, rank: int, world_size: int, local: LocalGroup) -> None:
        from crf.replica.seeds import data_seed_of

        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.local = local
        self.seed = spec.seed
        self.data_seed = data_seed_of(spec.seed, rank)  # the replica's own
        self.total_steps = spec.total_steps
        self.step = 0
        self.model: Any = None
        self.tracker = _NoTracker()  # local rank 0 reports for the replica

    def data_parallel(self, model: Any) -> Any:
        return self.local.wrap(model)

    def local_part(self, batch: Any) -> Any:
        return self.local.part(batch)

    @contextlib.contextmanager
    def diloco(self, model: Any, inner_optimizer: Any) -> Iterator[None]:
        self.model = model
        hooks = []
        if self.local.fsdp:  # takes part in gathering rank 0's mirror (before the step hook)
            refresh = MirrorRefresh(self.local, self.spec, inner_optimizer, self._step)
            hooks.append(inner_optimizer.register_step_post_hook(refresh))
        self.step = receive_start(self.local, model, inner_optimizer)
        hooks.append(inner_optimizer.register_step_post_hook(self._after_inner_step))
        try:
            yield None
        finally:
            for hook in hooks:
                hook.remove()
        self.local.share_weights(model)

    def _step(self) -> int:
        return self.step  # the final weights (global copies with fragments)

    def _after_inner_step(self, *_: Any) -> None:
        self.step += 1
        if os.environ.get(layout.ENV_FAULT):  # chaos tests only: kill this local rank
            from crf.faults import maybe_fault
            from crf.store import RunStore

            store = RunStore(self.spec.run_uri)
            maybe_fault("inner_step", self.rank, None, store, self.step, self.local.rank)
        if self.step % self.spec.sync_period == 0:
            self.step = self.local.share()
            self.local.share_weights(self.model)

    def log_step(self, loss: float | None = None, **_: float) -> None:
        if loss is not None:
            self.local.mean(loss)

    def restore_final(self, model: Any) -> None:
        """Local rank 0's ``restore_final`` (a collective: its weights come to this rank)."""
        with self.diloco(model, idle_optimizer(model)):
            pass

    def resume_step(self) -> int:
        """Local rank 0's (a collective: every local rank asks, or none)."""
        return int(self.local.share())

    def save_model_at_end(self, model: Any, tokenizer: Any | None = None) -> None:
        """Local rank 0 saves the model."""

    def finish(self, job_metrics: dict[str, Any] | None = None) -> None:
        """Local rank 0 writes the result."""

    def __enter__(self) -> LocalFollower:
        return self

    def __exit__(self, *_: Any) -> bool:
        return False


class _NoTracker:
    """A follower's tracker: local rank 0 alone reports to ``--report-to``."""

    def trainer_args(self) -> dict[str, Any]:
        return {"report_to": []}

    def log_step(self, *_: Any) -> None:
        pass

    def log_round(self, *_: Any) -> None:
        pass

    def close(self) -> None:
        pass


class MirrorRefresh:
    """An inner optimizer's post-step hook for FSDP (every local rank registers one, before
    DiLoCo's hook and crf's own): where DiLoCo is about to read the weights
    (:func:`crf.replica.local_fsdp.action_at`), gather them into rank 0's mirror; at a sync
    also the full inner-optimizer state, which rank 0 saves with the round."""

    def __init__(self, local: LocalGroup, spec: Any, optimizer: Any, step_of: Any):
        self.local, self.spec, self.optimizer, self.step_of = local, spec, optimizer, step_of
        #: the full inner-optimizer state at the last sync (rank 0; {} on the others)
        self.inner_state: dict[str, Any] = {}

    def __call__(self, *_: Any) -> None:
        kind = local_fsdp.action_at(self.step_of() + 1, self.spec)
        if kind is None:
            return
        local_fsdp.gather_weights(self.local.sharded, self.local.mirror)  # None off rank 0
        if kind == local_fsdp.SYNC:
            self.inner_state = local_fsdp.gather_optimizer(self.local.sharded, self.optimizer)


def idle_optimizer(model: Any) -> Any:
    """The inner optimizer of a replica with no inner step left to take
    (``restore_final``): DiLoCo needs one, and this one never steps."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params or list(model.parameters()), lr=0.0)


def send_start(
    local: LocalGroup,
    step: int,
    model: Any,
    inner: Any,
    resumed: bool,
    inner_state: dict[str, Any] | None = None,
) -> None:
    """Local rank 0, on entering DiLoCo: its step, its inner-optimizer state if it resumed
    one, and its weights (loaded from a global state, or the seed's) to the other ranks.
    With FSDP the resumed state is the full one it saved (``inner_state``) and ``model`` is
    its mirror: both go into every rank's shards."""
    if local.fsdp:
        local.share((step, resumed))
        if resumed:
            local_fsdp.scatter_optimizer(local.sharded, inner, inner_state)
    else:
        local.share((step, _on_cpu(inner.state_dict()) if resumed else None))
    local.share_weights(model)


def _on_cpu(state: Any) -> Any:
    """An optimizer state with its tensors in CPU memory: objects travel pickled over the
    group's CPU backend, and a CUDA tensor would unpickle onto rank 0's GPU on every rank
    (``load_state_dict`` moves each to its parameter's device)."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, state)


def receive_start(local: LocalGroup, model: Any, inner: Any) -> int:
    """The other side of :func:`send_start`: the step to start from."""
    step, state = local.share()
    if local.fsdp:
        if state:  # rank 0 resumed a saved inner state: its shards come with the broadcast
            local_fsdp.scatter_optimizer(local.sharded, inner, None)
    elif state is not None:
        inner.load_state_dict(state)
    local.share_weights(model)
    return int(step)
