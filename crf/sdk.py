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
import os
import time
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crf import sdk_inputs as inputs
from crf.launcher.errors import LaunchError
from crf.launcher.names import (
    HARDWARE_KEYS,
    as_declared,
    did_you_mean,
    option_spellings,
    setting_spellings,
)
from crf.results import DryRun, RunInfo, RunResult, RunStatus
from crf.spec import AT_RESUME, RunSpec, is_number, run_options

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
        workers' (``rank``: a worker's index), as ``crf logs --role rollout``. Its arguments
        are checked at the call, before the first line is asked for."""
        from crf.launcher.attach import follow_logs

        inputs.rank_of(rank)
        inputs.flag("follow", follow)
        inputs.count("tail", tail, 0)
        if role not in ("trainer", "rollout"):
            raise LaunchError(f"role {role!r} is unknown; choose trainer or rollout")
        return follow_logs(self._attached(), rank, follow, tail, role=role)

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

        inputs.wait_timeout(timeout, poll_s)
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
#: where a keyword came from, as a message says it
_MAPPING, _KEYWORD = "in the options mapping", "as a keyword"


@dataclass
class _Request:
    """A launch's keywords sorted by what takes them, each under its one name."""

    function: str = "crf.launch"  # whose keywords these are, as a message names it
    spec: RunSpec | None = None  # the RunSpec given as the options, if one was
    options: dict[str, Any] = field(default_factory=dict)  # run options, by field name
    settings: dict[str, Any] = field(default_factory=dict)  # store, timeout, max_restarts...
    backend: dict[str, Any] = field(default_factory=dict)  # the executor's options
    watch: dict[str, Any] = field(default_factory=dict)  # plot, console, poll_s, report
    #: (part, name) -> (the spelling, where it came from) of each name given
    given_as: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def place(self, key: str) -> tuple[str, str]:
        """Which part takes a keyword, and its name there; LaunchError with what to do
        instead for any other name (the nearest name, never the name itself)."""
        if key in option_spellings():
            return "options", option_spellings()[key]
        if key in setting_spellings():
            return "settings", setting_spellings()[key]
        if key.replace("-", "_") in _BACKEND_KEYS:
            return "backend", key.replace("-", "_")
        if key in _WATCH:
            return "watch", key
        if key in inputs.CLI_ONLY:
            raise LaunchError(f"unknown launch option {key!r}: {inputs.CLI_ONLY[key]}")
        if key in _OWN:
            if self.function == "crf.resume":
                raise LaunchError(f"crf.resume takes no {key}: a resumed run keeps its run.json")
            raise LaunchError(f"{key} is a keyword of crf.launch, not a run option: give it "
                              f"as {key}=... beside the options mapping, not in it")  # fmt: skip
        known = [*option_spellings(), *setting_spellings(), *_BACKEND_KEYS, *_WATCH, *_OWN]
        what = "resume" if self.function == "crf.resume" else "launch"
        raise LaunchError(f"unknown {what} option {key!r}{did_you_mean(key, known)}")

    def add(self, pairs: Iterable[tuple[Any, Any]], source: str, *, override: bool = False) -> None:
        """Each (name, value) under its one name; LaunchError for one given twice (under any
        spellings, saying where each came from) unless ``override`` (keywords over a
        RunSpec's values)."""
        for key, value in pairs:
            if not isinstance(key, str):
                raise LaunchError(f"launch option names are strings (got {key!r})")
            part, name = self.place(key)
            target: dict[str, Any] = getattr(self, part)
            earlier = self.given_as.get((part, name))
            if earlier is not None or (name in target and not override):
                first = f"{earlier[0]!r} {earlier[1]}" if earlier else repr(name)
                raise LaunchError(f"{name} is given twice ({first} and {key!r} {source})")
            self.given_as[part, name] = (key, source)
            target[name] = as_declared(name, value) if part == "options" else value

    def named(self, name: str) -> bool:
        """Whether a run option was chosen, not left to its default: given by name, or
        set on the RunSpec to another value than RunSpec's default."""
        if ("options", name) in self.given_as:
            return True
        default = getattr(RunSpec, name, None)
        return self.spec is not None and getattr(self.spec, name) != default


#: crf.launch's own keywords (named in an unknown name's "did you mean")
_OWN = ("executor", "backend_options", "restart", "detach", "progress", "dry_run",
        "secret_values")  # fmt: skip


def _request(
    options: Any, keywords: Mapping[str, Any], backend_options: Any, function: str = "crf.launch"
) -> _Request:
    """The keywords of a launch (or a resume) sorted and checked: each a LaunchError that
    names it, before anything is read or written."""
    from crf.launcher.plan import launch_options

    options = inputs.options_of(options)
    req = _Request(function=function)
    if isinstance(options, RunSpec):
        req.spec, req.options = options, launch_options(options)
        req.add(keywords.items(), _KEYWORD, override=True)
    else:
        _refuse_recorded([*(options or {}), *keywords])
        req.add((options or {}).items(), _MAPPING)
        req.add(keywords.items(), _KEYWORD)
    backend = inputs.mapping("backend_options", backend_options, "{'gpu': 'A10G'}")
    for key, value in backend.items():
        name = str(key).replace("-", "_")
        if name in req.backend:
            raise LaunchError(f"{name} is given twice (as a keyword and in backend_options)")
        req.backend[name] = value
    _check_request(req)
    return req


def _refuse_recorded(names: Iterable[Any]) -> None:
    """LaunchError naming the fields run.json records for a run that are no launch options
    (its folder, when it was made, the version): a run.json read back is not a launch."""
    from crf.launcher.plan import _MANAGED

    recorded = [name for name in names if name in _MANAGED]
    if recorded:
        raise LaunchError(
            f"{', '.join(map(str, recorded))}: recorded in run.json for a run, not launch "
            "options; leave them out (store= says where a run goes, backend_options= a "
            "backend's options)"
        )


def _check_request(req: _Request) -> None:
    """The values only the SDK takes, or takes in Python's types, checked as the command
    line checks its flags: store, timeout, run_id, job_config, a RunSpec's run_uri, and
    job_config beside an entrypoint."""
    from crf.launcher.plan import check_entrypoint_options

    settings, options = req.settings, req.options
    settings["store"] = inputs.store_of(settings.get("store"))
    inputs.launch_timeout(settings.get("timeout"))
    inputs.run_id_of(options.get("run_id"))
    inputs.job_config(options.get("job_config"))
    if req.spec is not None:
        _spec_store(req.spec, settings)
        check_entrypoint_options(options.get("entrypoint"), options.get("job_config"),
                                 job_named=req.named("job"))  # fmt: skip


def _spec_store(spec: RunSpec, settings: dict[str, Any]) -> None:
    """A RunSpec's ``run_uri`` says where its run goes: its store is the folder above, unless
    ``store=`` is given, which must then name the same store. LaunchError if they disagree,
    or the run_uri does not end in the spec's run_id."""
    from crf.store import normalize_uri

    uri = spec.run_uri
    if not isinstance(uri, str) or "/" not in uri.rstrip("/"):
        return  # the spec's own check says what is wrong with it
    base, _, last = uri.rstrip("/").rpartition("/")
    if base.endswith(":/"):  # memory://x: a run folder with no store above it
        return
    if isinstance(spec.run_id, str) and last != spec.run_id:
        raise LaunchError(
            f"the RunSpec's run_uri {uri!r} does not end in its run_id {spec.run_id!r}: a run "
            f"lives in STORE/RUN_ID (run_uri=f'{{store}}/{spec.run_id}')"
        )
    given = settings.get("store")
    if given is None:
        settings["store"] = base
    elif normalize_uri(given) != normalize_uri(base):
        raise LaunchError(
            f"store={given!r} and the RunSpec's run_uri {uri!r} (a run in store {base}) "
            "disagree: give one of them, or make them name the same store"
        )


def _check_executor(req: _Request, executor: Any) -> None:
    """An ``executor=`` replaces the one ``backend`` and the backend options would make:
    LaunchError for either given beside it, which would be ignored."""
    shown = f"executor={type(executor).__name__}(...)"
    if req.backend:
        raise LaunchError(
            f"{', '.join(sorted(req.backend))}: backend options configure the executor crf "
            f"makes from backend=, and {shown} is given: set them on that executor instead"
        )
    backend, name = req.options.get("backend"), getattr(executor, "name", None)
    if req.named("backend") and backend != name:
        raise LaunchError(
            f"backend={backend!r} and {shown} (the {name} backend) disagree: an executor "
            f"given replaces the backend; drop backend=, or give a {backend} executor"
        )


def _prepare(req: _Request, executor: Any, restart: Any, dry_run: bool) -> Plan:
    """The checked plan of a sorted request (crf.launcher.plan.prepare), the backend options
    resolved as the CLI resolves them."""
    from crf.executors.registry import executor_class, option_names
    from crf.launcher.config_file import resolve_backend
    from crf.launcher.plan import DEFAULT_MAX_RESTARTS, RestartPolicy, prepare

    executor, restart = inputs.executor_of(executor), inputs.restart_policy(restart)
    settings = req.settings
    counts = {k: settings[k] for k in ("max_restarts", "max_run_restarts") if k in settings}
    if restart is not None and counts:
        raise LaunchError(f"give restart= or {' and '.join(counts)}, not both")
    policy = restart or RestartPolicy(
        counts.get("max_restarts", DEFAULT_MAX_RESTARTS), counts.get("max_run_restarts")
    )
    backend_options: dict[str, Any] | None = None
    if executor is not None:
        _check_executor(req, executor)
    else:
        backend = req.options.get("backend", RunSpec.backend)
        backend_options = resolve_backend(backend, req.backend, where="")
        timeout = settings.get("timeout")
        known = option_names(executor_class(backend))
        if timeout is not None and "timeout_s" in known and "timeout_s" not in backend_options:
            # as crf launch --timeout: the platform's own limit is a safety net past it
            backend_options["timeout_s"] = timeout + 600 if is_number(timeout) else timeout
    return prepare(req.options, store=settings.get("store"), executor=executor,
                   backend_options=backend_options, restart=policy, dry_run=dry_run)  # fmt: skip


def _flags(**given: Any) -> None:
    """The yes/no keywords (``detach``, ``progress``, ``dry_run``): each True or False."""
    for name, value in given.items():
        inputs.flag(name, value)


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
    loop. A RunSpec's ``run_uri`` is where its run goes (``store=``, if given, must agree);
    an ``executor`` replaces ``backend`` and the backend options, so neither may be given
    beside it. Bad input, an unknown name or a value of the wrong type included, is a
    LaunchError whose one line says what to fix, before anything is written or started."""
    from crf.launcher import driver

    _flags(detach=detach, progress=progress, dry_run=dry_run)
    secrets = inputs.secret_values(secret_values)
    req = _request(options, keywords, backend_options)
    plan = _prepare(req, executor, restart, dry_run)
    if dry_run:
        return dry_run_of(plan)
    watch = {"report": progress, **req.watch}
    summary = driver.run(plan, env=secrets, progress=progress, detach=detach,
                         timeout_s=req.settings.get("timeout"), **watch)  # fmt: skip
    return Run(summary["run_id"], inputs.store_location(req.settings.get("store")))


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
    dry_run: bool = False,
    secret_values: Mapping[str, str] | None = None,
    **keywords: Any,
) -> Run | DryRun:
    """Continue a stopped run from its last committed round (``crf launch --resume``);
    with ``dry_run=True`` check it and return its :class:`~crf.results.DryRun` instead
    (``crf launch --resume RUN --dry-run``), starting nothing. Takes :func:`launch`'s
    keywords but the run options: a resumed run keeps those of its run.json (``backend``
    excepted: it may continue elsewhere), and takes new limits on waiting
    (``reward_timeout``, ``round_timeout_s``, ``rollout_grace``), which hold from this
    launch on."""
    from crf.launcher import driver
    from crf.launcher.plan import RestartPolicy

    _flags(detach=detach, progress=progress, dry_run=dry_run)
    secrets = inputs.secret_values(secret_values)
    restart = inputs.restart_policy(restart)
    req = _request(None, keywords, backend_options, function="crf.resume")
    fixed = sorted(set(req.options) - {"backend", *AT_RESUME})
    if fixed:
        raise LaunchError(
            f"{', '.join(fixed)} cannot be combined with resume: a resumed run keeps the "
            "options in its run.json"
        )
    counts = {k: req.settings[k] for k in ("max_restarts", "max_run_restarts") if k in req.settings}
    if restart is not None and counts:
        raise LaunchError(f"give restart= or {' and '.join(counts)}, not both")
    policy = restart or RestartPolicy(**counts)
    plan = driver.prepare_resume(
        run_id, store=req.settings.get("store"), backend=req.options.get("backend"),
        max_restarts=policy.max_restarts, max_run_restarts=policy.max_run_restarts,
        backend_options=dict(req.backend) or None,
        changes={k: v for k, v in req.options.items() if k in AT_RESUME},
    )  # fmt: skip
    if dry_run:
        return dry_run_of(plan)
    watch = {"report": progress, **req.watch}
    summary = driver.run(plan, env=secrets, progress=progress, detach=detach,
                         timeout_s=req.settings.get("timeout"), **watch)  # fmt: skip
    return Run(summary["run_id"], inputs.store_location(req.settings.get("store")))


def attach(run_id: str, store: str | os.PathLike[str] | None = None) -> Run:
    """The run ``run_id`` in ``store``; LaunchError if there is none."""
    from crf.launcher.attach import run_store

    where = inputs.store_of(store)
    run_store(run_id, where)  # says clearly when there is no such run
    return Run(run_id, inputs.store_location(where))


def runs(
    store: str | os.PathLike[str] | None = None, *, status: str | Iterable[str] | None = None,
    limit: int | None = None,
) -> list[RunInfo]:  # fmt: skip
    """The runs in ``store``, newest first (``crf runs``); LaunchError, as ``crf runs``
    exits 2, for an unknown status, a limit below 1 or a store that cannot be listed."""
    from crf.launcher.attach import list_runs

    where = inputs.store_of(store)
    wanted = inputs.statuses(status)
    inputs.count("limit", limit, 1)
    try:
        rows = list_runs(where, status=wanted, limit=limit)
    except Exception as e:  # noqa: BLE001 - any client error: one line, as crf runs says it
        raise LaunchError(
            f"cannot list runs in {where or './crf-runs'}: {e} (check --store)"
        ) from None
    return [RunInfo.from_dict(row) for row in rows]
