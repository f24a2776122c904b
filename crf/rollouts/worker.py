"""``CRF_ROLE=rollout python -m crf.replica``: a rollout worker's main loop.

Worker ``w`` (``CRF_WORKER``) serves trainer replica ``w % N`` and follows only its policy:

1. it builds what its trainer builds (the composer job's ``build()`` for the trainer's rank,
   seed and data seed: the same model, tokenizer and data shard) and the same
   ``ComposerReplicationTrainer`` (``new_trainer``), which it never trains: it generates
   through it (crf/rollouts/generate.py), so its rollouts and behaviour log-probs are what
   the trainer's TRL would produce on the same weights;
2. it loads the newest policy version its trainer published (crf/rollouts/policy.py) and
   acknowledges it, so that version is not deleted while it generates with it;
3. admission: holding version v, it writes its next batch only if (the step its trainer's
   next queued batch serves, ``rollouts/<rank>/cursor.json`` + the batches already queued)
   - v <= max_staleness and no outer step comes between (crf.rollouts.config.in_bound),
   i.e. if that batch will still be within the bound when the trainer gets to it;
   otherwise it waits (crf/rollouts/polling.py paces its looks to the trainer's steps) and
   loads a newer version (pacing: nothing is dropped);
4. it generates one TRL generation batch of its trainer (the batches its trainer returned as
   too stale first, then the next prompts of the shard) and writes it
   (crf/rollouts/batches.py);
5. it heartbeats ``workers/<w>/state.json`` throughout, and stops when its trainer has a
   result, writing ``workers/<w>/result.json`` (after deleting the queued batches it wrote
   that its trainer, finished ok, did not take); or, its status then ``stopped`` with the
   reason in its log and its result, when the run has ended or its trainer has shown no
   sign of life for ``--rollout-grace`` (crf/rollouts/lifeline.py).

A worker that dies costs its trainer only speed: the trainer generates locally.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from crf import layout
from crf.rollouts.config import in_bound

log = logging.getLogger("crf.rollouts.worker")

#: seconds between heartbeats while the worker lives
BEAT_S = 5.0
#: the longest pause between two looks at the store while pacing or waiting for a version
MAX_POLL_S = 1.0


def admits(
    trainer_step: int,
    queued: int,
    version: int,
    max_staleness: int,
    sync_period: int = 0,
    total_steps: int | None = None,
) -> bool:
    """Whether a batch of policy ``version`` written now will be within the bound when its
    trainer uses it (crf.rollouts.config.in_bound): the trainer (at ``trainer_step``, or at
    least at ``version``, which it published) takes one batch per generation, ``queued``
    are ahead of this one; and whether the trainer has that step to train at all (its
    ``total_steps``: a batch for a step past its last would be generated for nobody)."""
    use = max(trainer_step, version) + queued
    if total_steps is not None and use >= total_steps:
        return False
    return in_bound(version, use, max_staleness, sync_period)


@dataclass
class WorkerContext:
    """What the composer job's ``build()`` and ``trainer_config()`` read of a replica's
    context, for the trainer this worker serves (no store, no DiLoCo, no tracker)."""

    spec: Any
    rank: int
    world_size: int
    local: Any = None

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def data_seed(self) -> int:
        from crf.replica.seeds import data_seed_of

        return data_seed_of(self.spec.seed, self.rank)

    @property
    def total_steps(self) -> int:
        return self.spec.total_steps


@dataclass
class Prompts:
    """The rows worker ``index`` of ``count`` (for one trainer) generates next: consecutive
    groups of ``per_batch`` prompts of the shard, every ``count``-th group for this worker,
    each prompt repeated ``generations`` times (as TRL's RepeatSampler yields them)."""

    shard_size: int
    per_batch: int
    generations: int
    index: int = 0
    count: int = 1
    made: int = 0

    def next(self) -> list[int]:
        group = self.made * self.count + self.index
        self.made += 1
        start = group * self.per_batch
        prompts = [(start + k) % self.shard_size for k in range(self.per_batch)]
        return [i for i in prompts for _ in range(self.generations)]


@dataclass
class Beat:
    """The worker's state, written by a thread every BEAT_S seconds and on every change."""

    store: Any
    state: layout.WorkerState
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def update(self, **changes: Any) -> None:
        with self.lock:
            for k, v in changes.items():
                setattr(self.state, k, v)
        self.write()

    def write(self, key: str | None = None) -> None:
        with self.lock:
            self.state.updated_at = time.time()
            data = self.state.to_dict()
        try:
            self.store.put_json(key or layout.worker_state_key(self.state.worker), data)
        except Exception as e:  # noqa: BLE001 - a heartbeat must never end the worker
            log.warning("heartbeat failed: %s", e)

    def run(self) -> None:
        while not self.stop.wait(BEAT_S):
            self.write()


class RolloutWorker:
    """One rollout worker (module docstring)."""

    def __init__(self, store: Any, spec: Any, worker: int, world_size: int) -> None:
        from crf.rollouts.batches import RolloutQueue
        from crf.rollouts.config import RolloutConfig
        from crf.rollouts.policy import PolicyReader

        self.store, self.spec, self.worker = store, spec, worker
        self.cfg = RolloutConfig.from_spec(spec)
        self.rank = self.cfg.serves(worker, world_size)
        self.world_size = world_size
        self.reader = PolicyReader(store, self.rank, worker, run_id=spec.run_id,
                                   wire=self.cfg.wire)  # fmt: skip
        self.queue = RolloutQueue(store, self.rank)
        from crf.rollouts.lifeline import Lifeline

        self.lifeline = Lifeline.of(store, self.rank, self.cfg.grace_s)
        #: why it ended by itself without its trainer's result (None: it did not)
        self.stopped_because: str | None = None
        # a restarted worker goes on where its previous attempt stopped: its counts, its
        # sequence numbers and its place in the shard (no prompt generated twice for that)
        before = self._previous_state()
        state = layout.WorkerState(worker=worker, serves=self.rank, pid=os.getpid(),
                                   host=socket.gethostname(), rollouts=before.rollouts,
                                   batches=before.batches, returned=before.returned,
                                   staleness_mean=before.staleness_mean,
                                   generate_s=before.generate_s)  # fmt: skip
        self.beat = Beat(store, state)
        self.staleness: list[int] = []
        #: the earlier attempts' batches in the mean staleness (their sum, their count)
        self._stale_before = (0.0, 0)
        if before.staleness_mean is not None:
            self._stale_before = (before.staleness_mean * before.batches, before.batches)
        queued = max((s for _, s in self.queue.queued(worker)), default=-1)
        self.seq = max(queued + 1, before.batches)
        #: the error its previous attempt failed with (its result), None if it had none
        self.earlier_error = self._earlier_error()

    def _previous_state(self) -> layout.WorkerState:
        try:
            old = layout.WorkerState.from_dict(
                self.store.get_json(layout.worker_state_key(self.worker))
            )
        except Exception:  # noqa: BLE001 - none (the first attempt) or unreadable: start afresh
            return layout.WorkerState(worker=self.worker)
        return old if old.serves == self.rank else layout.WorkerState(worker=self.worker)

    def _earlier_error(self) -> str | None:
        try:
            old = self.store.get_json(layout.worker_result_key(self.worker))
        except Exception:  # noqa: BLE001 - none (no attempt failed before) or unreadable
            return None
        if not isinstance(old, dict) or old.get("status") != "failed":
            return None
        return str(old.get("error") or "").strip() or None

    # ------------------------------------------------------------------ setup
    def build(self, tmp: str) -> None:
        """The trainer's model, shard and ComposerReplicationTrainer (never trained)."""
        from crf.replica.jobs import composer as job
        from crf.replica.jobs import job_config
        from crf.replica.rewards import job_rewards, reward_timeout
        from crf.rollouts.generate import sampling_settings, tokenizer_digest

        if self.spec.job != "composer":
            raise ValueError(
                f"rollout workers generate for the composer job, not {self.spec.job!r}"
            )
        ctx = WorkerContext(self.spec, self.rank, self.world_size)
        cfg = job_config("composer", self.spec.job_config)
        from crf.composer.task import reverse_reward

        rewards = job_rewards(
            list(getattr(self.spec, "reward", [])), reverse_reward, reward_timeout(self.spec)
        )
        self.setup = job.build(ctx, cfg)
        rewards = self.setup.rewards_for(rewards)
        self.trainer = job.new_trainer(ctx, cfg, self.setup, rewards, tmp, 1, [])
        rollouts = int(self.trainer.args.generation_batch_size)
        generations = int(self.trainer.num_generations)
        mine = self.cfg.workers_of(self.rank, self.world_size)
        self.rows_per_batch = rollouts
        self.prompts = Prompts(len(self.setup.shard), rollouts // generations, generations,
                               index=mine.index(self.worker), count=len(mine),
                               made=self.beat.state.batches)  # fmt: skip
        self.sampling = sampling_settings(self.trainer)
        self.tokenizer = tokenizer_digest(self.trainer.processing_class)

    # ------------------------------------------------------------------ the loop
    def trainer_done(self) -> bool:
        return self.store.object_exists(layout.result_key(self.rank))

    def trainer_step(self) -> int:
        """The step the next batch queued for the trainer will serve: the trainer's cursor
        (written as it takes each batch), or before its first take its heartbeat's step."""
        cursor = self.queue.cursor()
        if cursor is not None:
            return cursor
        try:
            return int(self.store.get_json(layout.heartbeat_key(self.rank)).get("step") or 0)
        except Exception:  # noqa: BLE001 - no heartbeat yet, or unreadable: no news
            return 0

    def refresh(self) -> bool:
        """Load the newest version if it is newer than the one held; whether one is held."""
        from crf.rollouts.policy import PolicyUnavailable
        from crf.store import CorruptObjectError

        newest = self.reader.newest()
        if newest is None or newest == self.reader.version:
            return self.reader.version is not None
        self.beat.update(phase="loading")
        try:
            self.reader.load(self.trainer.model, newest)
        except PolicyUnavailable:
            pass  # deleted or superseded meanwhile: the next look finds a newer one
        except CorruptObjectError as e:
            log.warning("policy version %d unusable: %s", newest, e)
        else:
            # with use_vllm TRL generates from its own copy of the weights, pushed only when
            # told they changed: without this the worker would sample its first version on
            self.trainer.weights_replaced()
            self.beat.update(version=self.reader.version)
            log.info("loaded policy version %d of trainer %d", newest, self.rank)
        return self.reader.version is not None

    def run(self) -> None:
        from crf.rollouts.polling import Poll

        pending: list[list[int]] = []
        poll = Poll(first=0.05, cap=MAX_POLL_S)  # paced to the trainer's steps as seen
        seen: int | None = None
        while not self.trainer_done():
            why = self.lifeline.why_stop()
            if why is not None:  # it serves no one now: end rather than hold its GPU
                self.stopped_because = why
                log.warning("rollout worker %d stops: %s", self.worker, why)
                return
            if not self.refresh():
                poll.sleep()
                continue
            version = int(self.reader.version)  # type: ignore[arg-type]
            step = self.trainer_step()
            if seen is not None and step > seen:
                poll.event(step - seen)
            seen = step if seen is None else max(seen, step)
            queued = len(self.queue.queued())
            total = int(self.spec.total_steps)
            if not admits(step, queued, version, self.cfg.max_staleness, self.cfg.sync_period,
                          total):  # fmt: skip
                if self.beat.state.phase != "pacing":
                    self.beat.update(phase="pacing")
                poll.sleep()
                continue
            poll.start()
            returned = self.queue.take_returned(self.worker)
            if returned:  # its trainer could not use them in time: those rows first
                pending += [b.row_ids for b in returned]
                self.beat.update(returned=self.beat.state.returned + len(returned))
            row_ids = pending.pop(0) if pending else self.prompts.next()
            self.beat.update(phase="generating")
            self.generate(row_ids, version, max(step, version) + queued - version)

    def generate(self, row_ids: list[int], version: int, staleness: int) -> None:
        from crf.rollouts.batches import RolloutBatch
        from crf.rollouts.generate import generate_rollouts

        rows = [self.setup.shard[i] for i in row_ids]
        started = time.perf_counter()
        prompt_ids, completion_ids, logprobs = generate_rollouts(self.trainer, rows)
        slowdown = float(os.environ.get(layout.ENV_ROLLOUT_SLOWDOWN) or 1.0)
        if slowdown > 1.0:  # a benchmark's stand-in for a slower GPU
            time.sleep((slowdown - 1.0) * (time.perf_counter() - started))
        batch = RolloutBatch(
            rank=self.rank,
            worker=self.worker,
            seq=self.seq,
            version=version,
            row_ids=list(row_ids),
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            sampling=self.sampling,
            tokenizer_digest=self.tokenizer,
            policy_digest=self.reader.digest or "",
            created_at=time.time(),
        )
        self.queue.put(batch)
        self.seq += 1
        self.staleness.append(staleness)
        s = self.beat.state
        total, count = self._stale_before
        mean = (total + sum(self.staleness)) / (count + len(self.staleness))
        took = time.perf_counter() - started
        self.beat.update(rollouts=s.rollouts + len(batch), batches=s.batches + 1,
                         staleness_mean=mean, generate_s=s.generate_s + took)  # fmt: skip

    def finish(self, status: str, error: str | None = None) -> None:
        """Write its result: ``ok`` (its trainer has one), ``stopped`` (it ended by itself
        without: ``stopped_because``) or ``failed`` (``error``)."""
        self.beat.stop.set()
        try:
            self.reader.release()
        except Exception as e:  # noqa: BLE001 - the trainer deletes acks at its end anyway
            log.warning("could not release the acknowledgement: %s", e)
        if status == "ok":
            self.drop_leftovers()
        phase = "failed" if status == "failed" else "done"
        self.beat.update(phase=phase, status=status, error=error, reason=self.stopped_because)
        self.beat.write(layout.worker_result_key(self.worker))

    def drop_leftovers(self) -> None:
        """Its trainer finished ok: the queued batches this worker wrote that it did not take
        serve nobody (those returned to it stay: crf.rollouts.batches.RolloutQueue.clear).
        The trainer clears its queue at its end too; this removes one the worker wrote while
        it was clearing, before the result was there."""
        try:
            result = self.store.get_json(layout.result_key(self.rank))
            if isinstance(result, dict) and result.get("status") == "ok":
                self.queue.drop(self.worker)
        except Exception as e:  # noqa: BLE001 - only store space is at stake
            log.warning("could not delete this worker's untaken batches: %s", e)


def _env_int(name: str, env: Any) -> int:
    text = env.get(name)
    if text is None or not text.strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be set to an integer (got {text!r}); `crf launch` sets it")
    return int(text)


def main(environ: Any = None) -> int:
    """The worker process: 0 when its trainer finished, 1 if it failed, 2 if the
    environment breaks the contract, 3 (``EXIT_UNRECOVERABLE``, as a replica's) if it failed
    with an error a restart would raise again (crf.replica.failures: an error while it
    builds its trainer's model, data and trainer, or one its previous attempt failed with
    too, unless the machine or network failed), so the launcher does not start it again."""
    from crf.replica import logs
    from crf.resumed_options import with_changes
    from crf.spec import RunSpec
    from crf.store import RunStore

    env = os.environ if environ is None else environ
    logs.configure(f"w{env.get(layout.ENV_WORKER, '?')}", role="rollout worker")
    try:
        if not env.get(layout.ENV_RUN_URI):
            raise ValueError(f"{layout.ENV_RUN_URI} must be set; `crf launch` sets it")
        worker = _env_int(layout.ENV_WORKER, env)
        world = _env_int(layout.ENV_WORLD_SIZE, env)
        store = RunStore(env[layout.ENV_RUN_URI])
        spec = with_changes(store, RunSpec.from_json(store.get(layout.RUN_SPEC)))
        if not 0 <= worker < max(1, int(getattr(spec, "rollout_workers", 0) or 0)):
            raise ValueError(
                f"{layout.ENV_WORKER}={worker}, but the run has "
                f"{getattr(spec, 'rollout_workers', 0) or 0} rollout worker(s)"
            )
    except Exception as e:  # noqa: BLE001 - one line, the contract is the launcher's
        print(f"crf.replica (rollout worker): {e}", file=sys.stderr)
        return 2
    _set_threads(spec, world)
    w = RolloutWorker(store, spec, worker, world)
    w.beat.write()
    beats = threading.Thread(target=w.beat.run, name="crf-worker-beat", daemon=True)
    beats.start()
    log.info("rollout worker %d serves trainer %d (run %s)", worker, w.rank, spec.run_id)
    phase = "starting"
    try:
        with tempfile.TemporaryDirectory(prefix="crf-rollout-") as tmp:
            w.build(tmp)
            phase = "generating"
            w.run()
    except Exception as e:
        return _failed(w, e, phase)
    w.finish("ok" if w.stopped_because is None else "stopped")
    log.info("done: %d batches, %d rollouts", w.beat.state.batches, w.beat.state.rollouts)
    return 0


def _failed(w: RolloutWorker, error: Exception, phase: str) -> int:
    """Record the failure; the exit code: 3 when a restart would fail the same way (the
    worker's own input, e.g. a model folder only it cannot read; or an error its previous
    attempt failed with too, unless the machine or network failed), else 1 (a death)."""
    from crf.executors.secrets import hide_secrets
    from crf.replica.failures import EXIT_UNRECOVERABLE, deterministic, one_line, transient

    w.finish("failed", hide_secrets(f"{type(error).__name__}: {error}"))
    if deterministic(error, phase=phase):
        log.error("rollout worker failed%s, and a restart cannot fix it: %s",
                  " at setup" if phase == "starting" else "", one_line(error),
                  exc_info=True)  # fmt: skip
        return EXIT_UNRECOVERABLE
    earlier = (w.earlier_error or "").splitlines()[:1]
    if earlier == [one_line(error)] and not transient(error):
        log.error("rollout worker failed as its previous attempt did, so a restart cannot fix "
                  "it: %s", one_line(error), exc_info=True)  # fmt: skip
        return EXIT_UNRECOVERABLE
    log.exception("rollout worker failed")
    return 1


def _set_threads(spec: Any, world: int) -> None:
    """On one machine (local backend) trainers and workers split its cores."""
    import torch

    threads = os.environ.get(layout.ENV_TORCH_THREADS)
    if threads:
        torch.set_num_threads(int(threads))
    elif spec.backend == "local":
        share = world + int(getattr(spec, "rollout_workers", 0) or 0)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, share)))
