"""The driver: validate, write run.json, launch, watch, gather - in that order.

``crf.launcher.plan.prepare`` checks every input before a single replica starts. ``run`` then
writes ``run.json`` with create-if-absent (two drivers racing for one run id cannot both win),
starts the replicas, watches them (``crf.launcher.supervise``, which restarts failed ones),
and writes the summary to ``result.json``. The replicas never need the driver: if it dies,
they go on, and the store still gets their results.

``crf.launcher.resume`` continues a run whose driver and replicas all stopped, from its
``run.json`` (never rewritten) and its newest committed ``global/<r>``. Every driver launch of
a run is recorded under ``launches/<k>.json`` (0 = the first launch, then one per resume), with
what each ended replica attempt left behind under ``launches/<k>/`` - so neither a restart nor a
resume overwrites anything without keeping it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from crf import layout
from crf.executors.base import ExecutorError, ReplicaHandle, ReplicaState, ServerlessExecutor
from crf.launcher.errors import LaunchError
from crf.launcher.interrupts import sigterm_as_interrupt
from crf.launcher.plan import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_STORE,
    Plan,
    RestartPolicy,
    ResumeInfo,
    backend_config,
    display_path,
    held_run_hint,
    make_executor,
    prepare,
    read_run_spec,
    saved_backend_options,
)
from crf.launcher.resume import claim_resume, prepare_resume, resume_point
from crf.launcher.supervise import Supervisor, log_tail, save_handles, watch
from crf.spec import RunSpec, SpecError, check_seconds, run_options

if TYPE_CHECKING:
    from rich.console import Console

    from crf.launcher.workers import WorkerPool
    from crf.store import RunStore

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_STORE",
    "Plan",
    "RestartPolicy",
    "ResumeInfo",
    "display_path",
    "finish_run",
    "launch",
    "make_executor",
    "prepare",
    "prepare_resume",
    "read_run_spec",
    "resume",
    "resume_point",
    "run",
    "saved_backend_options",
]


def _start_launch(plan: Plan, started: float) -> int:
    """Claim this driver launch in the store; return its number.

    A first launch creates ``run.json`` (create-if-absent: two drivers racing for one run id
    cannot both win), the packed ``--workdir`` it names, ``launches/0.json`` and
    ``backend.json``. A resume leaves ``run.json``
    alone and claims its own launch (``crf.launcher.resume.claim_resume``).
    """
    spec, store = plan.spec, plan.store
    record = layout.LaunchRecord(
        launch=0,
        started_at=started,
        host=socket.gethostname(),
        pid=os.getpid(),
        backend=spec.backend,
        restart_policy=plan.restart.to_dict(),
    )
    if plan.resume is not None:
        launch_no = claim_resume(plan, record)
        _keep_reward_code(plan)
        return launch_no
    if not store.put_if_absent(layout.RUN_SPEC, spec.to_json().encode()):
        raise LaunchError(
            f"run folder {display_path(store)} already holds a run (run.json exists); "
            f"{held_run_hint(store, spec.run_id)}"
        )
    if plan.workdir is not None and spec.workdir_key:  # one per content: put once
        store.put_if_absent(spec.workdir_key, plan.workdir.data)
    _keep_reward_code(plan)
    store.put_json_if_absent(layout.launch_key(0), record.opening())
    backend: dict[str, Any] = {"backend": spec.backend, "options": backend_config(plan)}
    if plan.workers is not None and plan.workers.overrides:  # the workers' own hardware
        backend["rollout_options"] = plan.workers.overrides
    store.put_json(layout.BACKEND, backend)
    return 0


def _keep_reward_code(plan: Plan) -> None:
    """Put the reward code this launch's checks read in the run folder (one per content),
    where its replicas import it from (crf/replica/reward_code.py)."""
    if plan.reward_code is not None:
        key = plan.code_env()[layout.ENV_REWARD_CODE]
        plan.store.put_if_absent(key, plan.reward_code)


def _what(spec: RunSpec) -> str:
    """The header's name for what runs: ``job 'composer'``, or a custom entrypoint's
    command (markup-escaped: a command may hold brackets)."""
    from rich.markup import escape

    return f"command {escape(spec.job_label)!r}" if spec.entrypoint else f"job {spec.job!r}"


def _announce(plan: Plan, launch_no: int, console: Console) -> None:
    """The run's header: what starts where, and for a resume from which round."""
    spec = plan.spec
    console.print(
        f"[bold]crf[/] run [bold]{spec.run_id}[/]: {spec.replicas} replica(s) of "
        f"{_what(spec)} on {spec.backend}, {spec.rounds} round(s) x {spec.sync_every} steps"
    )
    if plan.resume is not None:
        r = plan.resume.from_round
        where = f"round {r + 1} ({layout.global_dir(r)})" if r is not None else "the start"
        console.print(f"resuming (launch {launch_no}): replicas continue from {where}")
        if plan.resume.superseded:
            names = ", ".join(layout.global_dir(g) for g in plan.resume.superseded)
            console.print(
                f"set aside {names} (a replica's inner state of it never landed; kept "
                f"under {layout.LAUNCHES}/{launch_no}/superseded/): its rounds are computed again"
            )
        if plan.resume.fresh_inner:
            ranks = ", ".join(str(k) for k in plan.resume.fresh_inner)
            console.print(
                f"[yellow]replica(s) {ranks} have no saved inner-optimizer state of "
                f"{layout.global_dir(r)}: they start it afresh (the run will not be "
                "bit-identical)[/]"
            )
    console.print(f"run folder: {display_path(plan.store)}", soft_wrap=True, highlight=False)


def _warn(plan: Plan, console: Console) -> None:
    """The checks' warnings (crf/launcher/data_checks.py: a folder's files the replicas'
    reader skips, a split checked on its first rows only, a Hub repo this machine cannot
    reach), one line each before any replica starts: a launch shows what its dry run shows."""
    from rich.markup import escape

    for note in plan.notes:
        console.print(f"[bold yellow]warning:[/] {escape(note)}", highlight=False)


def _start_replicas(
    plan: Plan, env: Mapping[str, str] | None, started: float, extra: Mapping[str, Any]
) -> list[ReplicaHandle]:
    """Launch the N replicas; if the backend cannot, result.json says so and LaunchError."""
    from crf.launcher.summary import build_summary

    spec = plan.spec
    try:
        return list(
            plan.executor.launch_replicas(
                spec.replicas,
                plan.command,
                (),
                {
                    **plan.secret_env,
                    **plan.code_env(),
                    **(env or {}),
                },  # secrets: through the secret mechanism
                run_uri=spec.run_uri,
                run_id=spec.run_id,
                max_restarts=plan.restart.max_restarts,
                plain_env=spec.env,  # plain: the container's visible environment
            )
        )
    except ExecutorError as e:
        failed = build_summary(spec=spec, results=[], started_at=started, error=str(e), **extra)
        plan.store.put_json(layout.RESULT, failed)
        raise LaunchError(f"could not start the replicas: {e}") from None


def _start_workers(
    plan: Plan, env: Mapping[str, str] | None, launch_no: int, console: Console | None
) -> WorkerPool | None:
    """Start the rollout workers after the replicas (None without any). A run never depends
    on its workers: one that cannot start leaves its trainers to generate for themselves
    (one yellow line says why)."""
    from crf.launcher.workers import WorkerPool, save_worker_handles, start_workers

    if plan.workers is None:
        return None
    try:
        handles = start_workers(plan.workers, plan.spec, plan.command,
                                {**plan.secret_env, **plan.code_env(), **(env or {})})  # fmt: skip
    except ExecutorError as e:
        if console is not None:
            console.print(f"[yellow]could not start the rollout workers ({e}); the replicas "
                          "generate their own rollouts[/]", highlight=False)  # fmt: skip
        return None
    save_worker_handles(plan.store, launch_no, handles)
    if console is not None:
        serve = "worker w serves replica w % N"
        console.print(f"{len(handles)} rollout worker(s) started ({serve})", highlight=False)
    return WorkerPool(plan.workers, handles, store=plan.store, launch_no=launch_no,
                      max_restarts=plan.restart.max_restarts, console=console)  # fmt: skip


def _stop_workers(pool: WorkerPool | None, cancelled: bool = False) -> dict[str, Any]:
    """The trainers are done (or, ``cancelled``, the run was), so is what the workers
    generate for them: cancel the ones still running; their rows for the summary (``{}``
    without workers)."""
    if pool is None:
        return {}
    pool.stop(cancelled=cancelled)
    return {"workers": pool.collect()}


def _and_workers(spec: RunSpec) -> str:
    return f" and {spec.rollout_workers} rollout worker(s)" if spec.rollout_workers else ""


def _detached(
    plan: Plan, launch_no: int, handles: Sequence[ReplicaHandle], console: Console, report: bool
) -> dict[str, Any]:
    """What ``run(detach=True)`` returns once the replicas started: how to follow them."""
    spec = plan.spec
    if report:
        where = f" --store {spec.run_uri.rstrip('/').rsplit('/', 1)[0]}"
        console.print(
            f"detached: {spec.replicas} replica(s){_and_workers(spec)} started. Follow with "
            f"[bold]crf status {spec.run_id}{where}[/] or "
            f"[bold]crf logs {spec.run_id}{where} --follow[/]; "
            f"stop with [bold]crf cancel {spec.run_id}{where}[/]",
            highlight=False,
            soft_wrap=True,
        )
    return {
        "status": "detached",
        "run_id": spec.run_id,
        "run_uri": spec.run_uri,
        "launch": launch_no,
        "handles": [h.to_dict() for h in handles],
    }


def run(
    plan: Plan,
    *,
    env: Mapping[str, str] | None = None,
    progress: bool = True,
    report: bool = True,
    console: Console | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    plot: bool = True,
    detach: bool = False,
) -> dict[str, Any]:
    """Write run.json (or claim a resume), start the replicas, watch them (restarting failed
    ones), write result.json; return the summary.

    With ``detach`` it returns right after the launch, with ``status == "detached"``: the
    replicas go on by themselves, and ``crf status RUN`` gathers the summary once they end
    (restarts are then only those the platform does itself).
    """
    from rich.console import Console

    from crf.store import StoreError

    _check_timeout(timeout_s)
    console = console or Console()
    started = time.time()
    try:
        launch_no = _start_launch(plan, started)
    except (OSError, StoreError) as e:  # after the store's own retries
        where = display_path(plan.store)
        raise LaunchError(f"cannot write to the run folder {where}: {e}") from None
    if report:
        _announce(plan, launch_no, console)
        _warn(plan, console)
    extra: dict[str, Any] = {"launch": launch_no, "restart_policy": plan.restart.to_dict()}
    if plan.resume is not None:
        extra["resumed_from_round"] = plan.resume.from_round
    handles = _start_replicas(plan, env, started, extra)
    save_handles(plan.store, launch_no, handles)
    pool = _start_workers(plan, env, launch_no, console if report else None)
    if detach:
        return _detached(plan, launch_no, handles, console, report)
    sup = Supervisor(plan, handles, launch_no=launch_no, console=console if report else None)
    sup.workers = pool
    error, cancelled = _watched(plan, sup, console, progress, timeout_s, poll_s, started)
    extra |= _stop_workers(pool, cancelled)
    if plan.notes:  # printed above; kept in the result for a caller that did not watch
        extra["warnings"] = list(plan.notes)
    if sup.fatal is not None:  # an input error ended the run: that is its one-line reason
        error = sup.fatal
    return finish_run(
        plan.spec,
        plan.store,
        plan.executor,
        sup.handles,
        launch_no=launch_no,
        started=started,
        cancelled=cancelled,
        error=error,
        attempts=sup.attempts,
        restarts=sup.restarts,
        not_restarted=sup.not_restarted,
        cancelled_ranks=sup.cancelled_ranks,
        extra=extra,
        report=report,
        console=console,
        plot=plot,
    )


def _watched(
    plan: Plan,
    sup: Supervisor,
    console: Console,
    progress: bool,
    timeout_s: float | None,
    poll_s: float,
    started: float,
) -> tuple[str | None, bool]:
    """Watch the replicas until they end: (the run's error, whether it was cancelled: by
    Ctrl-C or SIGTERM here, which cancels the replicas, or by crf cancel elsewhere)."""
    error: str | None = None
    cancelled = False
    try:
        with sigterm_as_interrupt():
            timed_out = watch(
                sup,
                console=console,
                progress=progress,
                timeout_s=timeout_s,
                poll_s=poll_s,
                started=started,
            )
        if timed_out:
            error = f"the run did not finish within {timeout_s}s; its replicas were cancelled"
    except KeyboardInterrupt:
        cancelled = True
        sup.stopped = True
        console.print("[yellow]interrupted: cancelling the replicas...[/]")
        plan.executor.cancel_all(sup.handles)
    return error, cancelled or sup.cancelled  # sup.cancelled: crf cancel from elsewhere


def _check_timeout(timeout_s: float | None) -> None:
    """``--timeout`` refused in one line before anything is written."""
    if timeout_s is not None:
        try:
            check_seconds("--timeout", timeout_s)
        except SpecError as e:
            raise LaunchError(str(e)) from None


def _one_line(e: BaseException) -> str:
    """A store error as one line: StoreErrors already say what to fix; others get their type."""
    from crf.store import StoreError

    text = str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _save_plot(
    spec: RunSpec, store: RunStore, metrics: Mapping[int, Any], console: Console
) -> str | None:
    """Draw the run's figure beside result.json; where it went, or None. A figure must never
    turn a good run into a crash: a failure is one yellow line."""
    from crf.launcher.figure import save_figure
    from crf.store import StoreError

    try:
        return save_figure(spec, store, metrics)
    except StoreError as e:  # the store went away (bucket deleted...): said here
        console.print(f"[yellow]could not save the figure: {_one_line(e)}[/]")
    except Exception as e:  # noqa: BLE001 - matplotlib can fail in many ways; said here
        console.print(f"[yellow]could not draw the figure: {type(e).__name__}: {e}[/]")
    return None


def _save_result(store: RunStore, summary: dict[str, Any], launch_no: int) -> None:
    """Write result.json and close the launch record. A store that disappeared mid-run
    (bucket deleted, credentials revoked) fails the replicas too; the user still gets the
    summary, with one line saying why it was not saved."""
    summary["result_path"] = display_path(store, layout.RESULT)
    try:
        store.put_json(layout.RESULT, summary)
    except Exception as e:  # noqa: BLE001 - the summary is still shown; the cause in one line
        summary["result_path"] = None
        why = f"result.json could not be written to {display_path(store)}: {_one_line(e)}"
        summary["error"] = f"{summary['error']}; {why}" if summary.get("error") else why
    with contextlib.suppress(Exception):  # the launch record is history, not the result
        record = store.get_json(layout.launch_key(launch_no))  # kept whole: newer fields too
        ended = {k: summary[k] for k in ("ended_at", "status", "restarts", "error")}
        store.put_json(layout.launch_key(launch_no), {**record, **ended})


def finish_run(
    spec: RunSpec,
    store: RunStore,
    executor: ServerlessExecutor,
    handles: Sequence[ReplicaHandle],
    *,
    launch_no: int,
    started: float,
    report: bool = True,
    console: Console | None = None,
    plot: bool = True,
    **facts: Any,
) -> dict[str, Any]:
    """Gather ended replicas into the summary: ``result.json``, the figure, the launch
    record, and the rendered table. Used by the watching driver and by ``crf status`` for a
    detached run whose replicas have all ended. ``facts`` go to the summary: ``cancelled``,
    ``error``, ``attempts``, ``restarts``, ``not_restarted`` and ``extra`` (more fields)."""
    from rich.console import Console

    from crf.launcher.figure import read_metrics
    from crf.launcher.summary import build_summary, render_summary

    console = console or Console()
    extra = dict(facts.pop("extra", None) or {})
    workers = extra.pop("workers", None)  # the rollout workers' rows (crf.launcher.workers)
    warnings = extra.pop("warnings", None)  # the checks' before launch
    stopped = set(facts.pop("cancelled_ranks", None) or ())
    results = [
        # crf cancel from another process: to this executor its replicas died of a signal
        dataclasses.replace(r, state=ReplicaState.CANCELLED, error="cancelled")
        if r.rank in stopped and r.state is ReplicaState.FAILED and not r.ok
        else r
        for r in executor.collect(handles, timeout=60)
    ]
    tails = {
        r.rank: log_tail(executor, r.handle)
        for r in results
        if not r.ok and r.state is not ReplicaState.CANCELLED
    }
    try:
        metrics = read_metrics(store, spec.replicas)
    except Exception:  # noqa: BLE001 - a summary without per-round detail beats no summary
        metrics = {}
    summary = build_summary(
        spec=spec,
        results=results,
        started_at=started,
        log_tails=tails,
        metrics=metrics,
        **facts,
        **extra,
    )
    if workers is not None:  # never the status: the trainers generate what they do not
        from crf.launcher.rollout_view import workers_summary

        summary["workers"] = workers_summary(workers, metrics)
    if warnings:  # before the run's own (a reward that gave no value: build_summary)
        summary["warnings"] = [*warnings, *summary.get("warnings", [])]
    plot_path = _save_plot(spec, store, metrics, console) if plot else None
    summary["figure"] = plot_path
    _save_result(store, summary, launch_no)
    if report:
        render_summary(summary, console, result_path=summary["result_path"], plot_path=plot_path)
    return summary


def launch(
    options: Mapping[str, Any] | RunSpec | None = None,
    *,
    store: str | None = None,
    executor: ServerlessExecutor | None = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    **watch: Any,
) -> dict[str, Any]:
    """Run N replicas to the end and return the summary that was written to result.json.

    ``options`` are the run options, by RunSpec field name (``{"job": "lm", "replicas": 4,
    "sync_every": 20, "job_config": {...}}``; see :func:`prepare`), or a RunSpec. ``watch``
    goes to :func:`run`: ``env`` adds variables to every replica (credentials go there,
    never in ``entrypoint``), ``progress``, ``report``, ``plot``, ``timeout_s``, ``poll_s``,
    ``console``, ``detach``. A replica that fails is started again as ``restart`` allows
    (default: RestartPolicy()). Raises LaunchError for bad input, before launching; a run
    that starts and fails returns a summary with ``status == "failed"``.
    """
    _no_run_options_in(watch)
    plan = prepare(
        options, store=store, executor=executor, backend_options=backend_options, restart=restart
    )
    return run(plan, **watch)


def _no_run_options_in(watch: Mapping[str, Any]) -> None:
    """LaunchError for a run option passed as a keyword (``launch(replicas=4)``): it belongs
    in the options mapping."""
    # ``env=`` is run()'s own keyword (variables given to the replicas as secrets); the
    # ``env`` run option (plain variables, written in run.json) goes in the options mapping
    misplaced = sorted(set(watch) & set(run_options()) - {"env"})
    if misplaced:
        example = ", ".join(f"{name!r}: ..." for name in misplaced)
        raise LaunchError(
            f"run options go in the first argument, launch({{{example}}}), not as keywords "
            f"({', '.join(misplaced)})"
        )


def resume(
    run_id: str,
    *,
    store: str | None = None,
    backend: str | None = None,
    executor: ServerlessExecutor | None = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    **watch: Any,
) -> dict[str, Any]:
    """Continue run ``run_id`` whose driver and replicas stopped: start all N replicas again;
    each resumes from the newest committed ``global/<r>`` with its own inner-optimizer state
    and data position, so no committed round is lost and none is trained twice. (If a
    replica's inner state of that round never landed, the newest round saved whole is used
    instead and the newer global states are set aside: see :func:`resume_point`.) ``watch``
    goes to :func:`run`, as for :func:`launch`. Returns the summary written to result.json
    (``launch`` says which driver launch this was)."""
    policy = restart or RestartPolicy()
    plan = prepare_resume(
        run_id,
        store=store,
        backend=backend,
        executor=executor,
        max_restarts=policy.max_restarts,
        max_run_restarts=policy.max_run_restarts,
        backend_options=backend_options,
    )
    return run(plan, **watch)
