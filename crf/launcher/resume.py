"""Resume: continue a run whose driver and replicas all stopped.

``prepare_resume`` checks that the run can go on (its ``run.json`` is read, never rewritten;
no replica of it is still running; same backend) and where it goes on from
(``resume_point``); ``claim_resume`` then claims the new launch in the store and puts aside
what the stopped launch left after that point, keeping it under ``launches/<k>/``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crf import layout
from crf.executors.base import ExecutorError, ServerlessExecutor
from crf.launcher.errors import LaunchError
from crf.launcher.liveness import backend_live, launch_starting, live_replicas
from crf.launcher.plan import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_STORE,
    Plan,
    RestartPolicy,
    ResumeInfo,
    check_replica_limit,
    display_path,
    make_executor,
    read_run_spec,
    saved_backend_options,
    store_base,
    store_errors,
    validate_job,
)
from crf.launcher.user_env import resolve_secrets
from crf.spec import RunSpec, SpecError, check_run_id

if TYPE_CHECKING:
    from crf.store import RunStore


@dataclass
class _Found:
    """What the run folder says about a stopped run (read by ``_read_run``)."""

    uri: str  # the run folder
    spec: RunSpec
    previous: str | None  # the status in the previous result.json, if any
    live: list[str]  # replicas that may still be running
    launches: list[int]
    rounds: list[int]  # global rounds whose state landed
    inner: dict[int, set[int]]  # rank -> rounds it saved its inner state for
    backend_options: dict[str, Any]  # those it was launched with (backend.json)
    finished: bool = False  # every replica reported ok after its last step (results/<k>)


def _read_run(store: str | None, run_id: str) -> _Found:
    """Read what a resume needs; LaunchError for a folder without a run or a store error."""
    from crf.store import RunStore, join_uri

    base = store_base(store)  # LaunchError: blank, a typo, credentials
    with store_errors(f"{store or DEFAULT_STORE}/{run_id}"):
        return _read_found(RunStore(join_uri(base, run_id), retries=0))


def _read_found(run_store: RunStore) -> _Found:
    """:func:`_read_run` of an open run folder (store errors are the caller's)."""
    if not run_store.exists(layout.RUN_SPEC):
        raise LaunchError(
            f"nothing to resume at {display_path(run_store)}: it holds no run.json (check "
            "--store and the run id)"
        )
    spec = read_run_spec(run_store)
    previous = None
    if run_store.exists(layout.RESULT):
        with contextlib.suppress(ValueError, AttributeError):  # damaged: treated as none
            previous = run_store.get_json(layout.RESULT).get("status")
    return _Found(
        uri=run_store.uri,
        spec=spec,
        previous=previous,
        live=_live(run_store, spec),
        launches=layout.launch_numbers(run_store),
        rounds=layout.global_rounds(run_store, complete=True),
        inner={k: set(layout.inner_rounds(run_store, k)) for k in range(spec.replicas)},
        backend_options=saved_backend_options(run_store),
        finished=_replicas_finished(run_store, spec),
    )


def _replicas_finished(run_store: RunStore, spec: RunSpec) -> bool:
    """Whether every replica's result says it finished ok after the run's last step: a run
    whose driver stopped (killed, or a detached launch nobody gathered) before it wrote the
    summary. A resume would start every replica again only to find nothing left to train."""
    for rank in range(spec.replicas):
        try:
            result = run_store.get_json(layout.result_key(rank))
        except Exception:  # noqa: BLE001 - none, or unreadable: not known to have finished
            return False
        if not isinstance(result, dict) or result.get("status") != "ok":
            return False
        steps = result.get("steps")
        if not isinstance(steps, int) or steps < spec.total_steps:
            return False
    return spec.replicas > 0


def _live(run_store: RunStore, spec: RunSpec) -> list[str]:
    """What of the run may still run, by the run folder alone: replicas by their
    heartbeats, and a launch whose driver still starts replicas on this host (before it
    saved their handles, which the backend is asked about next: ``backend_live``)."""
    starting = launch_starting(run_store, spec.replicas, spec.run_id, known_only=True)
    live = live_replicas(run_store, spec.replicas, spec.run_id)
    return [*live, starting] if starting else live


def _refuse(run_id: str, found: _Found, backend: str | None) -> None:
    """LaunchError if the run must not be resumed: it finished, it still runs, or the
    backend named is not the one it was launched on."""
    if found.previous == "ok":
        raise LaunchError(
            f"run {run_id} already finished (result.json says ok); there is nothing to resume"
        )
    if found.previous is None and found.finished and not found.live:
        raise LaunchError(
            f"run {run_id} already finished: every replica reported ok after its last step, "
            f"but its summary was never written (its driver stopped first); `crf status "
            f"{run_id} --store {found.uri.rstrip('/').rsplit('/', 1)[0]}` writes it. There is "
            "nothing to resume"
        )
    if found.live:
        raise LaunchError(
            f"run {run_id} still has running replicas: {', '.join(found.live)}; stop them "
            f"(`crf cancel {run_id}`) or let them finish before resuming, or two replicas "
            "would share one rank"
        )
    if backend is not None and backend != found.spec.backend:
        raise LaunchError(
            f"run {run_id} was launched on backend {found.spec.backend!r}; resume it there "
            f"(got --backend {backend})"
        )


def prepare_resume(
    run_id: str,
    *,
    store: str | None = None,
    backend: str | None = None,
    executor: ServerlessExecutor | None = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    max_run_restarts: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    changes: Mapping[str, Any] | None = None,
) -> Plan:
    """Validate that run ``run_id`` in ``store`` can be continued; LaunchError otherwise.

    The run keeps everything in its ``run.json`` (job, N, H, rounds...), which is read and
    never rewritten, but for the limits on waiting in ``changes`` (crf.spec.AT_RESUME:
    ``reward_timeout``...), which this launch's record keeps for it and the launches after
    (crf/resumed_options.py). Refused: a run folder without ``run.json``, a run that already
    finished ok, a run whose replicas may still be running, and another backend than the one
    the run was launched on.
    """
    from crf.launcher.workers import plan_workers, saved_rollout_options, split_options
    from crf.store import RunStore

    policy = RestartPolicy(max_restarts, max_run_restarts).validate()
    try:
        check_run_id(run_id, "--resume run id")  # one folder in --store, never a path out
    except SpecError as e:
        raise LaunchError(str(e)) from None
    found = _read_run(store, run_id)
    _refuse(run_id, found, backend)
    spec = _changed(found.spec, changes or {})
    options = {**found.backend_options, **(backend_options or {})}
    options, rollout_options = split_options(spec.backend, options)
    rollout_options = {**saved_rollout_options(found.uri), **rollout_options}
    if executor is None:
        executor = make_executor(spec.backend, options)
    with store_errors(found.uri):
        found.live += backend_live(RunStore(found.uri, retries=0), executor, found.launches)
    _refuse(run_id, found, backend)  # its backend may run replicas without heartbeats yet
    check_replica_limit(executor, spec.replicas)
    workers = plan_workers(spec, executor, options, rollout_options)
    try:
        executor.check_ready(found.uri)
        executor.check_command(spec.entrypoint)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None
    validate_job(spec.job, spec.job_config)
    run_store = RunStore(found.uri)
    reward_code = recheck_inputs(spec, run_store)
    # replicas find the run where it is now, even if the folder was moved since launch
    spec.run_uri = run_store.uri
    secret_env = resolve_secrets(spec)  # read again: never kept anywhere since the launch
    start, superseded, fresh = resume_point(spec, found.rounds, found.inner)
    info = ResumeInfo(
        launch=(max(found.launches) + 1) if found.launches else 1,
        from_round=start,
        previous_status=found.previous,
        superseded=superseded,
        fresh_inner=fresh,
        changed={k: v for k, v in (changes or {}).items() if v != getattr(found.spec, k)},
    )
    return Plan(spec, run_store, executor, spec.entrypoint, policy, info, secret_env,
                workers=workers, reward_code=reward_code)  # fmt: skip


def _changed(spec: RunSpec, changes: Mapping[str, Any]) -> RunSpec:
    """``spec`` with the options a resume changes; LaunchError for one out of range."""
    from crf.resumed_options import apply

    try:
        return apply(spec, changes) if changes else spec
    except (SpecError, ValueError) as e:
        raise LaunchError(str(e)) from None


def recheck_inputs(spec: RunSpec, store: RunStore) -> bytes | None:
    """The run's data, model and rewards checked again before its replicas start, as at its
    launch (crf/launcher/data_checks.py, reward_checks.py): a file edited since, a model
    folder changed, or a reward module edited into an error would otherwise stop every
    replica at setup (or at its first step). LaunchError says what to fix and to continue
    the run once fixed. The local backend's only: its run.json names this machine's paths
    (a cloud run's may be paths inside its shipped --workdir, which the replicas unpack).
    The rewards are imported from where the replicas import them: the run's shipped
    ``--workdir`` (the archive in its run folder, not that folder as it is now), else this
    process's working directory; and anew, not from a module this process imported before.
    Returns the source of the reward modules so checked, which the resumed replicas import
    (``plan.kept_reward_code``: the code as it is now, the same for every replica)."""
    import copy

    from crf.launcher.plan import importable, imports_user_code, kept_reward_code

    if spec.backend != "local":
        return None
    shipped = _shipped_workdir(spec, store) if imports_user_code(spec) else None
    try:
        with importable(shipped, spec), _imported_afresh(spec.reward):
            _check_inputs_again(copy.deepcopy(spec))
            return kept_reward_code(spec, None)
    except LaunchError as e:  # a file of the shipped copy named as the user's (importable)
        raise LaunchError(
            f"{e} (checked again to continue run {spec.run_id}: fix it, then run crf launch "
            f"--resume {spec.run_id} again)"
        ) from None


def _check_inputs_again(spec: RunSpec) -> None:
    """:func:`recheck_inputs`'s checks, in the order a launch makes them
    (``plan.check_workload``, then ``plan._check_inputs``): each reward imported (within a
    time limit) and parsed, the data and model, then each reward called on the sampled
    rows."""
    from crf.launcher.data_checks import builtin_data, check_inputs
    from crf.launcher.reward_checks import check_rewards_on, import_rewards
    from crf.replica.data_files import DataError
    from crf.replica.rewards import RewardError, check_rewards

    import_rewards(spec.reward)  # a module that blocks as it imports: stopped in time
    try:
        check_rewards(spec.reward)
        if builtin_data(spec):
            found = check_inputs(spec, local=True)
            check_rewards_on(spec, found.splits)
    except (DataError, RewardError) as e:
        raise LaunchError(str(e)) from None


def _shipped_workdir(spec: RunSpec, store: RunStore) -> bytes | None:
    """The run's packed ``--workdir`` as its run folder keeps it (None: it has none), which
    each resumed replica unpacks; LaunchError when it cannot be read."""
    from crf.store import StoreError

    if not spec.workdir_key:
        return None
    try:
        return bytes(store.get(spec.workdir_key))
    except (StoreError, OSError) as e:
        raise LaunchError(
            f"cannot read run {spec.run_id}'s shipped --workdir "
            f"{display_path(store, spec.workdir_key)}: {e}"
        ) from None


@contextlib.contextmanager
def _imported_afresh(entries: list[str] | None) -> Iterator[None]:
    """The ``module:function`` rewards' modules imported anew inside, as a replica imports
    them: a process that launched the run has them cached, from before any edit. Put back
    as they were afterwards, so the caller's own imports stay its own."""
    from crf.replica.rewards import reward_modules

    names = reward_modules(entries)
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def resume_point(
    spec: RunSpec, rounds: list[int], inner: Mapping[int, set[int]]
) -> tuple[int | None, list[int], list[int]]:
    """Where a resume starts: (global round, newer global rounds to set aside, replicas
    without a saved inner state of that round). ``inner``: rank -> rounds it saved.

    A checkpoint is the global state of round r plus every replica's own inner-optimizer
    state of r, written by each replica in the background after the round committed. A run
    killed at any moment can hold ``global/<r>`` while a replica's ``inner/<r>`` never landed;
    resuming there would restart that replica's inner optimizer and the run would no longer
    be the run nobody killed. So the resume starts from the newest global round whose inner
    states all exist, and the newer ones (recomputed, bit for bit, by the resumed replicas)
    are set aside. If no kept round is complete (a replica was gone for a while, or the job
    has no inner optimizer), it starts from the newest and those replicas start afresh.
    """
    if not rounds:
        return None, [], []

    def missing(r: int) -> list[int]:
        return [k for k in range(spec.replicas) if r not in inner.get(k, set())]

    complete = [r for r in rounds if spec.saves_inner_state(r) and not missing(r)]
    start = max(complete) if complete else max(rounds)
    fresh = missing(start) if spec.saves_inner_state(start) else []
    return start, sorted(r for r in rounds if r > start), fresh


def claim_resume(plan: Plan, record: layout.LaunchRecord) -> int:
    """Claim resumed launch k (``launches/<k>.json``, create-if-absent: two drivers resuming
    at once cannot both win) and return k. The previous ``result.json`` and
    ``results/<rank>.json`` (and the rollout workers' results) are kept under
    ``launches/<k>/previous/`` before the replicas write new ones, and what the stopped
    launch left after the resume point is put aside."""
    assert plan.resume is not None
    spec, store, k = plan.spec, plan.store, plan.resume.launch
    record.launch, record.resumed_from_round = k, plan.resume.from_round
    record.superseded_globals = list(plan.resume.superseded)
    record.changed = dict(plan.resume.changed)
    if not store.put_json_if_absent(layout.launch_key(k), record.opening()):
        raise LaunchError(
            f"another driver is resuming run {spec.run_id} right now ({layout.launch_key(k)} "
            "exists); let it run, or wait for it to stop"
        )
    keep = [layout.RESULT] + [layout.result_key(r) for r in range(spec.replicas)]
    # a worker's result of the stopped launch would read as the new worker's end (phase
    # ``done``) until that one writes its own; its heartbeat stays: a worker goes on from
    # it (its counts, its batch numbers)
    keep += [layout.worker_result_key(w) for w in range(spec.rollout_workers)]
    for src in keep:
        with contextlib.suppress(Exception):  # missing is normal; nothing here may block
            store.put(layout.previous_key(k, src), store.get(src))
            if src != layout.RESULT:
                store.delete(src)
    _set_aside(plan, k)
    return k


def _set_aside(plan: Plan, k: int) -> None:
    """No replica of the run is alive (checked before): exchange rounds after the newest
    global state belong to the stopped launch, and the replicas will run them again from
    that state; so would heal requests. Left in place, a resumed round could read its old
    quorum and averages (with checkpoint_every > 1 there are up to that many such rounds).
    Superseded global states are kept, not lost: the replicas write them again. A global
    folder past the resume point whose state never landed whole (a writer killed mid-write
    leaves its temp file, or some parts without the others) is deleted: nothing in it can be
    read, and left in place it would tell every resumed replica that the others are already
    past that round (they would all wait to heal from a state nobody writes)."""
    from crf.store import ObjectNotFound

    assert plan.resume is not None
    store, top = plan.store, plan.resume.from_round
    for g in plan.resume.superseded:
        with contextlib.suppress(ObjectNotFound):
            for key in layout.global_parts(store, g):  # its parts, or an older run's file
                store.put(layout.superseded_key(k, key), store.get(key))
            store.delete(layout.global_dir(g))
    with contextlib.suppress(Exception):  # noqa: BLE001 - a leftover is cleaned next time
        for r in layout.round_numbers(store):
            if top is None or r > top:
                store.delete(layout.round_dir(r))
        for g in layout.global_rounds(store):
            if (top is None or g > top) and not layout.global_complete(store, g):
                store.delete(layout.global_dir(g))
        store.delete(layout.HEAL)
