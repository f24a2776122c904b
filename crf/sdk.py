"""The Python SDK: everything the CLI does, as functions that return objects.

``crf.launch({...})`` returns a :class:`Run` - at once with ``detach=True``, else when the run
has ended - and a ``Run`` is what ``crf status / logs / cancel / plot`` work on, from any
process that can reach the run's store and backend (``crf.attach(run_id, store=...)``). It is
quiet unless asked (``progress=True`` prints the tables ``crf launch`` prints): a script
decides what to show. Results are typed (:mod:`crf.results`).

Like the CLI, it keeps nothing in memory that matters: a ``Run`` is its id and its store, and
every method reads the run folder (and asks the backend) again.
"""

from __future__ import annotations

import json
import time
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crf.launcher.errors import LaunchError
from crf.launcher.names import (
    HARDWARE_KEYS,
    as_declared,
    did_you_mean,
    option_spellings,
    setting_spellings,
)
from crf.results import DryRun, RunInfo, RunResult, RunStatus
from crf.spec import RunSpec, is_number, run_options

if TYPE_CHECKING:
    from crf.launcher.plan import Plan, RestartPolicy

__all__ = ["Run", "attach", "dry_run", "launch", "resume", "runs"]


@dataclass(frozen=True)
class Run:
    """A run in a store: ``id`` and the ``store`` it lives in (None: ``./crf-runs``)."""

    id: str
    store: str | None = None

    def _attached(self) -> Any:
        from crf.launcher.attach import attach as attach_run

        return attach_run(self.id, self.store)

    def status(self) -> RunStatus:
        """The replicas now (backend state, heartbeat) and the result once written."""
        from crf.launcher.attach import status_record

        return RunStatus.from_dict(status_record(self._attached()))

    def logs(
        self,
        rank: int | None = None,
        *,
        follow: bool = False,
        tail: int | None = None,
        role: str = "trainer",
    ) -> Iterator[tuple[int, str]]:
        """(rank, line) of the replicas' logs; ``follow`` keeps going until they end,
        ``tail`` starts at each replica's last lines; ``role="rollout"``: the rollout
        workers' (``rank``: a worker's index), as ``crf logs --role rollout``."""
        from crf.launcher.attach import follow_logs

        if role not in ("trainer", "rollout"):
            raise LaunchError(f"role {role!r} is unknown; choose trainer or rollout")
        yield from follow_logs(self._attached(), rank, follow, tail, role=role)

    def cancel(self) -> RunResult | None:
        """Stop every replica still running and write the summary; the result (None if the
        summary could not be gathered)."""
        from crf.launcher.attach import cancel_run, gather

        run = self._attached()
        live = cancel_run(run)
        if run.result() is None:
            gather(run, report=False, cancelled=bool(live), cancelled_ranks=[h.rank for h in live])
        data = run.result()
        return RunResult.from_dict(data) if data else None

    def wait(self, timeout: float | None = None, *, poll_s: float = 1.0) -> RunResult:
        """Block until every replica has ended and return the result (gathering it, as
        ``crf status`` does, when no driver is watching). TimeoutError after ``timeout``
        seconds; the replicas keep running then."""
        from crf.launcher.attach import gather

        deadline = None if timeout is None else time.monotonic() + timeout
        run = self._attached()
        while True:
            data = run.result()
            if data is None and all(st.terminal for _, st, _ in run.statuses()):
                gathered = gather(run, report=False)
                data = run.result() or gathered  # as written: JSON's keys and values
            if data is not None:
                return RunResult.from_dict(data)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.id} still running after {timeout:g}s")
            time.sleep(poll_s)

    @property
    def result(self) -> RunResult | None:
        """The result of the run's latest launch, or None while it runs."""
        data = self._attached().result()
        return RunResult.from_dict(data) if data else None

    @property
    def figure(self) -> str | None:
        """Where the run's figure is (written at the end; ``crf plot`` redraws it)."""
        result = self.result
        if result is None:
            return None
        return result.figure or result.extra.get("loss_plot")


#: keywords that go to the driver's watch loop as they are (crf.launcher.driver.run)
_WATCH = ("plot", "console", "poll_s", "report")
#: backend options the SDK also takes as keywords, as the CLI's --hardware (--gpu, --flavor,
#: --instance-type), --image and --region
_BACKEND_KEYS = (*HARDWARE_KEYS, *(f"rollout_{k}" for k in HARDWARE_KEYS), "image", "region")


@dataclass
class _Request:
    """A launch's keywords sorted by what takes them, each under its one name."""

    options: dict[str, Any] = field(default_factory=dict)  # run options, by field name
    settings: dict[str, Any] = field(default_factory=dict)  # store, timeout, max_restarts...
    backend: dict[str, Any] = field(default_factory=dict)  # the executor's options
    watch: dict[str, Any] = field(default_factory=dict)  # plot, console, poll_s, report

    def place(self, key: str) -> tuple[dict[str, Any], str]:
        """Where a keyword goes and its name there; LaunchError with the nearest name."""
        if key in option_spellings():
            return self.options, option_spellings()[key]
        if key in setting_spellings():
            return self.settings, setting_spellings()[key]
        if key.replace("-", "_") in _BACKEND_KEYS:
            return self.backend, key.replace("-", "_")
        if key in _WATCH:
            return self.watch, key
        known = [*option_spellings(), *setting_spellings(), *_BACKEND_KEYS, *_WATCH, *_OWN]
        raise LaunchError(f"unknown launch option {key!r}{did_you_mean(key, known)}")

    def add(self, pairs: Iterable[tuple[Any, Any]], *, override: bool = False) -> None:
        """Each (name, value) under its one name; LaunchError for one given twice (under any
        spellings) unless ``override`` (keywords over a RunSpec's values)."""
        given_as: dict[tuple[int, str], Any] = {}
        for key, value in pairs:
            if not isinstance(key, str):
                raise LaunchError(f"launch option names are strings (got {key!r})")
            target, name = self.place(key)
            if (id(target), name) in given_as or (name in target and not override):
                first = given_as.get((id(target), name), name)
                raise LaunchError(f"{name} is given twice ({first!r} and {key!r})")
            given_as[id(target), name] = key
            target[name] = as_declared(name, value) if target is self.options else value


#: crf.launch's own keywords (named in an unknown name's "did you mean")
_OWN = ("executor", "backend_options", "restart", "detach", "progress", "dry_run",
        "secret_values")  # fmt: skip


def _request(
    options: Mapping[str, Any] | RunSpec | None,
    keywords: Mapping[str, Any],
    backend_options: Mapping[str, Any] | None,
) -> _Request:
    from crf.launcher.plan import launch_options

    req = _Request()
    if isinstance(options, RunSpec):
        req.options = launch_options(options)
        req.add(keywords.items(), override=True)
    else:
        req.add([*(options or {}).items(), *keywords.items()])
    for key, value in (backend_options or {}).items():
        name = str(key).replace("-", "_")
        if name in req.backend:
            raise LaunchError(f"{name} is given twice (as a keyword and in backend_options)")
        req.backend[name] = value
    return req


def _prepare(req: _Request, executor: Any, restart: RestartPolicy | None, dry_run: bool) -> Plan:
    """The checked plan of a sorted request (crf.launcher.plan.prepare), the backend options
    resolved as the CLI resolves them."""
    from crf.executors.registry import executor_class, option_names
    from crf.launcher.config_file import resolve_backend
    from crf.launcher.plan import DEFAULT_MAX_RESTARTS, RestartPolicy, prepare

    settings = req.settings
    counts = {k: settings[k] for k in ("max_restarts", "max_run_restarts") if k in settings}
    if restart is not None and counts:
        raise LaunchError(f"give restart= or {' and '.join(counts)}, not both")
    policy = restart or RestartPolicy(
        counts.get("max_restarts", DEFAULT_MAX_RESTARTS), counts.get("max_run_restarts")
    )
    backend_options: dict[str, Any] | None = None
    if executor is None:
        backend = req.options.get("backend", RunSpec.backend)
        backend_options = resolve_backend(backend, req.backend, where="")
        timeout = settings.get("timeout")
        known = option_names(executor_class(backend))
        if timeout is not None and "timeout_s" in known and "timeout_s" not in backend_options:
            # as crf launch --timeout: the platform's own limit is a safety net past it
            backend_options["timeout_s"] = timeout + 600 if is_number(timeout) else timeout
    return prepare(req.options, store=settings.get("store"), executor=executor,
                   backend_options=backend_options, restart=policy, dry_run=dry_run)  # fmt: skip


def launch(
    options: Mapping[str, Any] | RunSpec | None = None,
    /,
    *,
    executor: Any = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    detach: bool = False,
    progress: bool = False,
    dry_run: bool = False,
    secret_values: Mapping[str, str] | None = None,
    **keywords: Any,
) -> Run | DryRun:
    """Launch a run and return it: at once with ``detach=True`` (follow it with its
    methods), else once it has ended (``run.result``); with ``dry_run=True`` check it and
    return its :class:`~crf.results.DryRun` instead, launching nothing.

    The run options come as keywords (``launch(job="lm", replicas=4, sync_every=20)``), as a
    mapping (``launch({"job": "lm", ...})``), or both; each by its field name as in run.json
    or its flag's name, ``_`` or ``-`` alike (``round_timeout_s`` or ``round_timeout``,
    ``columns`` or ``column``, ``job_config`` or ``set``); one string for a list option is a
    list of one. So are the launch settings of a config file (``store``, ``timeout``,
    ``max_restarts``, ``max_run_restarts``) and the hardware (``hardware`` or ``gpu`` /
    ``flavor`` / ``instance_type``), ``image`` and ``region``, which join ``backend_options``
    (which takes the same names). ``env`` is the run option (plain variables, written in
    run.json); ``secret_values`` gives the replicas variables by value through the backend's
    secret mechanism, never written anywhere (``secrets=["NAME"]`` reads them from this
    environment instead). ``plot``, ``console``, ``poll_s`` and ``report`` go to the watch
    loop. Bad input, an unknown name included, is a LaunchError whose one line says what to
    fix, before anything starts."""
    from crf.launcher import driver

    req = _request(options, keywords, backend_options)
    plan = _prepare(req, executor, restart, dry_run)
    if dry_run:
        return dry_run_of(plan)
    watch = {"report": progress, **req.watch}
    summary = driver.run(plan, env=secret_values, progress=progress, detach=detach,
                         timeout_s=req.settings.get("timeout"), **watch)  # fmt: skip
    return Run(summary["run_id"], req.settings.get("store"))


def dry_run(options: Mapping[str, Any] | RunSpec | None = None, /, **keywords: Any) -> DryRun:
    """Check a launch as :func:`launch` would (same arguments) and return its plan - what
    would start where, on what hardware, at what price, what is missing - launching and
    writing nothing (``crf launch --dry-run``)."""
    return typing.cast(DryRun, launch(options, dry_run=True, **keywords))


def dry_run_of(plan: Plan) -> DryRun:
    """The :class:`~crf.results.DryRun` of a checked plan: the backend's description of it
    and the run's options and job settings."""
    from crf.launcher.plan import job_settings
    from crf.replica import local_ranks
    from crf.replica.jobs import get_job
    from crf.spec import secret_name

    spec = plan.spec
    bp = plan.executor.describe(spec.replicas, plan.command, spec.run_uri)
    knobs, trl = job_settings(spec) if not spec.entrypoint else ({}, {})
    ranks = plan.command is None and local_ranks.supports_local_ranks(get_job(spec.job))
    idle = local_ranks.idle_gpus(plan.executor.gpus_per_replica(), spec.procs_per_replica, ranks)
    warnings = [*([idle] if idle else []), *plan.notes]  # idle: GPUs paid for, never used
    free = spec.backend == "local"
    written = json.loads(spec.to_json())
    return DryRun(
        run_id=spec.run_id, backend=bp.backend, replicas=bp.replicas,
        options={name: written[name] for name in run_options()},
        where=bp.where, image=bp.image, hardware=bp.hardware, region=bp.region,
        command=list(bp.command), store=bp.store, timeout_s=bp.timeout_s,
        hourly_usd=0.0 if free else bp.hourly_usd,
        total_hourly_usd=0.0 if free else bp.total_hourly_usd,
        secrets=[*bp.secrets, *(secret_name(s) for s in spec.secrets)],
        job_settings=dict(knobs), trl_settings=dict(trl), notes=list(bp.notes),
        warnings=warnings, missing=list(plan.missing), workers=_workers_of(plan),
    )  # fmt: skip


def _workers_of(plan: Plan) -> dict[str, Any] | None:
    """The dry run's rollout-workers role: the workers' executor's plan, priced."""
    if plan.workers is None:
        return None
    bp = plan.workers.describe(plan.command, plan.spec.run_uri)
    free = plan.spec.backend == "local"
    return {
        "workers": bp.replicas, "serves": "worker w serves replica w % N",
        "where": bp.where, "hardware": bp.hardware, "resources": bp.resources,
        "hourly_usd": 0.0 if free else bp.hourly_usd,
        "total_hourly_usd": 0.0 if free else bp.total_hourly_usd,
        "worst_case_usd": 0.0 if free else bp.worst_case_usd,
    }  # fmt: skip


def resume(
    run_id: str,
    *,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    detach: bool = False,
    progress: bool = False,
    secret_values: Mapping[str, str] | None = None,
    **keywords: Any,
) -> Run:
    """Continue a stopped run from its last committed round (``crf launch --resume``).
    Takes :func:`launch`'s keywords but the run options: a resumed run keeps those of its
    run.json (``backend`` excepted: it may continue elsewhere)."""
    from crf.launcher import driver
    from crf.launcher.plan import RestartPolicy

    req = _request(None, keywords, backend_options)
    fixed = sorted(set(req.options) - {"backend"})
    if fixed:
        raise LaunchError(
            f"{', '.join(fixed)} cannot be combined with resume: a resumed run keeps the "
            "options in its run.json"
        )
    counts = {k: req.settings[k] for k in ("max_restarts", "max_run_restarts") if k in req.settings}
    policy = restart or RestartPolicy(**counts)
    plan = driver.prepare_resume(
        run_id, store=req.settings.get("store"), backend=req.options.get("backend"),
        max_restarts=policy.max_restarts, max_run_restarts=policy.max_run_restarts,
        backend_options=dict(req.backend) or None,
    )  # fmt: skip
    watch = {"report": progress, **req.watch}
    summary = driver.run(plan, env=secret_values, progress=progress, detach=detach,
                         timeout_s=req.settings.get("timeout"), **watch)  # fmt: skip
    return Run(summary["run_id"], req.settings.get("store"))


def attach(run_id: str, store: str | None = None) -> Run:
    """The run ``run_id`` in ``store``; LaunchError if there is none."""
    from crf.launcher.attach import run_store

    run_store(run_id, store)  # says clearly when there is no such run
    return Run(run_id, store)


def runs(
    store: str | None = None, *, status: str | Iterable[str] | None = None,
    limit: int | None = None,
) -> list[RunInfo]:  # fmt: skip
    """The runs in ``store``, newest first (``crf runs``)."""
    from crf.launcher.attach import list_runs

    wanted = [status] if isinstance(status, str) else status
    return [RunInfo.from_dict(row) for row in list_runs(store, status=wanted, limit=limit)]
