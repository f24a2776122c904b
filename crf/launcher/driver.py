"""The driver: validate, write run.json, launch, watch, gather - in that order.

Everything a user can get wrong is checked in ``prepare`` before a single replica starts
(backend, job and its options, numbers, entrypoint, store, an existing run folder), because a
mistake found after launch costs N processes - or N paid containers - and leaves a half-made
run folder behind. ``run`` then writes ``run.json`` with create-if-absent (two drivers racing
for one run id cannot both win), starts the replicas, shows their heartbeats, and writes the
summary to ``result.json``. The replicas never need the driver: if it dies, they go on, and
the store still gets their results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crf.executors.base import ExecutorError, ReplicaHandle, ReplicaState, ServerlessExecutor
from crf.launcher.errors import LaunchError
from crf.spec import RunSpec, SpecError, new_run_id

if TYPE_CHECKING:
    from rich.console import Console

    from crf.store import RunStore

AVAILABLE_BACKENDS = ("local",)
PLANNED_BACKENDS = ("modal", "hf", "sagemaker")
DEFAULT_STORE = "./crf-runs"
#: RunSpec fields that launch() takes under their own names; the rest pass through **spec_fields
_MANAGED = {"run_id", "run_uri", "job", "job_config", "entrypoint", "replicas", "sync_every",
            "rounds", "backend", "created_at", "version"}  # fmt: skip
LOG_TAIL_LINES = 15


def _backend_list() -> str:
    return f"{', '.join(AVAILABLE_BACKENDS)} (coming later: {', '.join(PLANNED_BACKENDS)})"


def make_executor(backend: str) -> ServerlessExecutor:
    """The executor for a backend name; LaunchError for unknown or not-yet-available ones."""
    if backend == "local":
        from crf.executors.local import LocalProcessExecutor

        return LocalProcessExecutor()
    if backend in PLANNED_BACKENDS:
        raise LaunchError(
            f"backend {backend!r} is not available yet; available backends: {_backend_list()}"
        )
    raise LaunchError(f"unknown backend {backend!r}; available backends: {_backend_list()}")


def display_path(store: RunStore, key: str = "") -> str:
    """A local path for file:// stores (what a user can open), the URI otherwise."""
    if store.scheme == "file":
        return store.path(key)
    return f"{store.uri}/{key}" if key else store.uri


@dataclass
class Plan:
    """A validated run, ready to start: nothing has been written or launched yet."""

    spec: RunSpec
    store: RunStore
    executor: ServerlessExecutor
    command: list[str] | None  # None: the backend's default, python -m crf.replica


def _validate_job(job: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check the job exists and its options are valid; return the options as typed values."""
    from crf.replica.jobs import job_config

    try:
        cfg = job_config(job, dict(options or {}))
    except ImportError as e:
        raise LaunchError(f"job {job!r} cannot be loaded ({e}); is crf fully installed?") from None
    except (TypeError, ValueError) as e:
        raise LaunchError(str(e)) from None
    # Keep only what the user set (coerced to the option's type): the replica applies the
    # job's defaults itself, and run.json stays readable.
    return {k: getattr(cfg, k, v) for k, v in (options or {}).items()}


def prepare(
    *,
    job: str = "lm",
    replicas: int = 2,
    sync_every: int = 20,
    rounds: int = 5,
    store: str | None = None,
    run_id: str | None = None,
    backend: str = "local",
    job_options: Mapping[str, Any] | None = None,
    entrypoint: str | Sequence[str] | None = None,
    executor: ServerlessExecutor | None = None,
    **spec_fields: Any,
) -> Plan:
    """Validate every input; LaunchError says what to fix. Writes nothing but a probe."""
    from crf.store import RunStore, StoreError, join_uri, normalize_uri

    unknown = sorted(set(spec_fields) - ({f.name for f in dataclasses.fields(RunSpec)} - _MANAGED))
    if unknown:
        raise LaunchError(f"unknown launch option(s): {', '.join(unknown)}")
    if executor is None:
        executor = make_executor(backend)
    run_id = run_id if run_id is not None else new_run_id()
    try:
        run_uri = join_uri(normalize_uri(store or DEFAULT_STORE), run_id)
    except Exception as e:
        raise LaunchError(f"--store {store!r} is not a usable URI or path: {e}") from None

    spec = RunSpec(
        run_id=run_id,
        run_uri=run_uri,
        job=job,
        replicas=replicas,
        sync_every=sync_every,
        rounds=rounds,
        backend=getattr(executor, "name", backend),
        **spec_fields,
    )
    try:
        spec.validate()
    except SpecError as e:
        raise LaunchError(str(e)) from None
    except TypeError as e:  # e.g. outer_lr="fast" from Python: comparisons fail
        raise LaunchError(f"a run option has the wrong type: {e}") from None
    try:
        executor.check_run_uri(run_uri)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None

    spec.job_config = _validate_job(job, job_options)

    command: list[str] | None = None
    if entrypoint is not None:
        try:
            command = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
        except ValueError as e:
            raise LaunchError(f"--entrypoint {entrypoint!r} cannot be parsed: {e}") from None
        spec.entrypoint = command
    try:
        executor.check_command(command)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None

    # The store last: the writability probe is the only check with a side effect.
    try:
        probe = RunStore(run_uri, retries=0)
        if probe.exists("run.json"):
            raise LaunchError(
                f"run folder {display_path(probe)} already holds a run (run.json exists); "
                "choose another --run-id (resuming a run is not supported yet)"
            )
        probe.check_writable()
        leftovers = [n for n in probe.list() if not n.startswith(".crf-probe-")]
        if leftovers:
            raise LaunchError(
                f"run folder {display_path(probe)} is not empty ({', '.join(leftovers[:5])}); "
                "choose another --run-id or another --store"
            )
        run_store = RunStore(run_uri)
    except StoreError as e:
        raise LaunchError(f"{e} (check --store)") from None
    except OSError as e:
        raise LaunchError(f"cannot use store {run_uri}: {e} (check --store)") from None
    return Plan(spec, run_store, executor, command)


def _read_heartbeat(store: RunStore, rank: int) -> dict[str, Any] | None:
    try:
        data = store.get_json(f"replicas/{rank}/state.json")
    except Exception:  # not written yet, or the store hiccupped: keep the last one we had
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def _newline_after(console: Console, enabled: bool) -> Iterator[None]:
    """Off a terminal, Live prints its last frame without a final newline; add it."""
    try:
        yield
    finally:
        if enabled and not console.is_terminal:
            console.line()


def _watch(
    plan: Plan,
    handles: Sequence[ReplicaHandle],
    *,
    console: Console,
    progress: bool,
    timeout_s: float | None,
    poll_s: float,
    started: float,
) -> bool:
    """Poll process status and heartbeats until every replica ended; True if timed out."""
    from rich.live import Live

    from crf.launcher.progress import ReplicaView, render_progress

    spec, store, executor = plan.spec, plan.store, plan.executor
    beats: dict[int, dict[str, Any] | None] = {h.rank: None for h in handles}

    def refresh() -> tuple[bool, Any]:
        views = []
        for h in handles:
            st = executor.status(h)
            beats[h.rank] = _read_heartbeat(store, h.rank) or beats[h.rank]
            views.append(ReplicaView(h.rank, st, beats[h.rank]))
        table = render_progress(
            views,
            run_id=spec.run_id,
            rounds=spec.rounds,
            sync_every=spec.sync_every,
            elapsed_s=time.time() - started,
        )
        return all(v.status.terminal for v in views), table

    live = Live(console=console, refresh_per_second=4, transient=False) if progress else None
    with _newline_after(console, live is not None), live or contextlib.nullcontext():
        while True:
            done, table = refresh()
            if live is not None:
                live.update(table, refresh=True)
            if done:
                return False
            if timeout_s is not None and time.time() - started > timeout_s:
                executor.cancel_all(handles)
                if live is not None:
                    live.update(refresh()[1], refresh=True)
                return True
            time.sleep(poll_s)


def _log_tail(executor: ServerlessExecutor, handle: ReplicaHandle) -> list[str]:
    try:
        return list(deque(executor.logs(handle), maxlen=LOG_TAIL_LINES))
    except Exception:  # logs are a courtesy; never let them hide the real result
        return []


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
) -> dict[str, Any]:
    """Write run.json, start the replicas, watch them, write result.json; return the summary."""
    from rich.console import Console

    from crf.launcher.summary import build_summary, plot_losses, read_metrics, render_summary

    console = console or Console()
    spec, store, executor = plan.spec, plan.store, plan.executor
    if not store.put_if_absent("run.json", spec.to_json().encode()):
        raise LaunchError(
            f"run folder {display_path(store)} already holds a run (run.json exists); "
            "choose another --run-id"
        )
    started = time.time()
    if report:
        console.print(
            f"[bold]crf[/] run [bold]{spec.run_id}[/]: {spec.replicas} replica(s) of job "
            f"{spec.job!r} on {spec.backend}, {spec.rounds} round(s) x {spec.sync_every} steps"
        )
        console.print(f"run folder: {display_path(store)}", soft_wrap=True, highlight=False)
    try:
        handles = executor.launch_replicas(
            spec.replicas, plan.command, (), env, run_uri=spec.run_uri, run_id=spec.run_id
        )
    except ExecutorError as e:
        failed = build_summary(spec=spec, results=[], started_at=started, error=str(e))
        store.put_json("result.json", failed)
        raise LaunchError(f"could not start the replicas: {e}") from None

    error: str | None = None
    cancelled = False
    try:
        timed_out = _watch(
            plan,
            handles,
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
        console.print("[yellow]interrupted: cancelling the replicas...[/]")
        executor.cancel_all(handles)

    results = executor.collect(handles, timeout=60)
    tails = {
        r.rank: _log_tail(executor, r.handle)
        for r in results
        if not r.ok and r.state is not ReplicaState.CANCELLED
    }
    summary = build_summary(
        spec=spec,
        results=results,
        started_at=started,
        cancelled=cancelled,
        error=error,
        log_tails=tails,
    )
    plot_path = None
    if plot:
        try:
            png = plot_losses(read_metrics(store, spec.replicas), title=f"crf run {spec.run_id}")
        except Exception as e:  # a plot must never turn a good run into a crash
            png = None
            console.print(f"[yellow]could not draw the loss plot: {type(e).__name__}: {e}[/]")
        if png is not None:
            store.put("loss.png", png)
            plot_path = display_path(store, "loss.png")
    summary["loss_plot"] = plot_path
    summary["result_path"] = display_path(store, "result.json")
    store.put_json("result.json", summary)
    if report:
        render_summary(summary, console, result_path=summary["result_path"], plot_path=plot_path)
    return summary


def launch(
    *,
    job: str = "lm",
    replicas: int = 2,
    sync_every: int = 20,
    rounds: int = 5,
    store: str | None = None,
    run_id: str | None = None,
    backend: str = "local",
    job_options: Mapping[str, Any] | None = None,
    entrypoint: str | Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    executor: ServerlessExecutor | None = None,
    progress: bool = True,
    report: bool = True,
    console: Console | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    plot: bool = True,
    **spec_fields: Any,
) -> dict[str, Any]:
    """Run N replicas to the end and return the summary that was written to result.json.

    ``spec_fields`` are the other RunSpec fields (outer_lr, outer_momentum, min_replicas,
    round_timeout_s, seed, ...). ``env`` adds variables to every replica (credentials go
    here, never in ``entrypoint``). Raises LaunchError for bad input, before launching;
    a run that starts and fails returns a summary with ``status == "failed"``.
    """
    plan = prepare(
        job=job,
        replicas=replicas,
        sync_every=sync_every,
        rounds=rounds,
        store=store,
        run_id=run_id,
        backend=backend,
        job_options=job_options,
        entrypoint=entrypoint,
        executor=executor,
        **spec_fields,
    )
    return run(
        plan,
        env=env,
        progress=progress,
        report=report,
        console=console,
        timeout_s=timeout_s,
        poll_s=poll_s,
        plot=plot,
    )
