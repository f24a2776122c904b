"""The plan of a run: every input checked before anything is written or launched.

Everything a user can get wrong is checked in ``prepare`` before a single replica starts
(backend, job and its options, numbers, entrypoint, store, an existing run folder), because a
mistake found after launch costs N processes - or N paid containers - and leaves a half-made
run folder behind. A ``Plan`` is the checked result; ``crf.launcher.driver.run`` carries it
out, and ``crf.launcher.resume.prepare_resume`` makes one for a run that stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crf import layout
from crf.executors.base import ExecutorError, ServerlessExecutor, resolve_procs_per_replica
from crf.launcher.data_checks import builtin_data, check_inputs
from crf.launcher.errors import LaunchError
from crf.launcher.user_env import (
    check_plain_env,
    check_reserved,
    replica_variables,
    resolve_secrets,
    tracking_warnings,
)
from crf.launcher.workers import (
    WorkerPlan,
    check_rollout_options,
    idle_worker_gpus,
    plan_workers,
    split_options,
)
from crf.spec import RunSpec, SpecError, new_run_id, run_options

if TYPE_CHECKING:
    from crf.executors.workdir import PackedWorkdir
    from crf.store import RunStore

DEFAULT_STORE = "./crf-runs"


def store_base(store: str | None) -> str:
    """The normalized base URI of ``--store`` (None: ./crf-runs). Every command and the SDK
    open their store through here: a blank store is refused (StoreURIError) rather than
    taken for the default, and so is a URL with a typo or credentials in it
    (:func:`crf.store.check_uri`): a LaunchError whose message never repeats them."""
    from crf.store import StoreURIError, normalize_uri

    given = DEFAULT_STORE if store is None else store
    try:
        base = normalize_uri(given)
    except StoreURIError as e:
        raise LaunchError(f"--store: {e}") from None
    if base.startswith("file://"):
        _check_store_folder(given, Path(base.removeprefix("file://")))
    return base


def _check_store_folder(given: str, path: Path) -> None:
    """LaunchError when a store on this machine's disk is a file, or lies under one: a file
    holds no run folders, and every command would otherwise say only that there is no run
    (``crf runs``: "no runs") where the user mistyped --store."""
    found = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if found is None or os.path.isdir(found):
        return
    named = f"--store {given}" if found == path else f"--store {given}: {found}"
    if os.path.islink(found):  # its target is gone
        raise LaunchError(
            f"{named} is a symbolic link to {os.readlink(found)}, which does not exist: "
            "create that folder, or give another --store"
        )
    raise LaunchError(f"{named} is a file, not a folder: give the folder that holds the run "
                      "folders")  # fmt: skip


#: RunSpec fields the driver fills in itself; every other field is a run option (crf.spec)
_MANAGED = frozenset(f.name for f in dataclasses.fields(RunSpec)) - set(run_options())
DEFAULT_MAX_RESTARTS = 3


def make_executor(backend: str, options: Mapping[str, Any] | None = None) -> ServerlessExecutor:
    """The executor for a backend name and its options; LaunchError says what to fix."""
    from crf.executors.registry import make_executor as build

    try:
        return build(backend, options)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None


def display_path(store: RunStore, key: str = "") -> str:
    """A local path for file:// stores (what a user can open), the URI otherwise."""
    if store.scheme == "file":
        return store.path(key)
    return f"{store.uri}/{key}" if key else store.uri


@dataclass
class RestartPolicy:
    """How often the driver starts a failed replica again.

    ``max_restarts`` per replica (rank) and ``max_run_restarts`` for the whole run (None: no
    cap beyond N x max_restarts). A restarted replica resumes from the newest global state and
    its own saved inner-optimizer state, so a restart costs only that replica's work since the
    last committed round. A replica that exits 2 (its environment breaks the contract) or was
    cancelled is never restarted: running it again cannot help.
    """

    max_restarts: int = DEFAULT_MAX_RESTARTS
    max_run_restarts: int | None = None

    def validate(self) -> RestartPolicy:
        for name in ("max_restarts", "max_run_restarts"):
            value = getattr(self, name)
            if value is None and name == "max_run_restarts":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                flag = "--" + name.replace("_", "-")
                raise LaunchError(f"{flag} must be an integer >= 0 (got {value!r})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ResumeInfo:
    """What ``prepare_resume`` found: which launch this is and where the run stands."""

    launch: int  # this driver launch's number (0 was the first launch)
    #: the global round the replicas continue from (None: nothing committed yet): the newest
    #: one every replica's inner state was saved for, else the newest (see resume_point)
    from_round: int | None
    previous_status: str | None  # status in the previous result.json, if any
    #: newer global rounds set aside (under launches/<k>/superseded/) because a replica's
    #: inner state of that round never landed; the resumed replicas compute them again
    superseded: list[int] = field(default_factory=list)
    #: replicas that resume with a fresh inner optimizer (no saved state of from_round)
    fresh_inner: list[int] = field(default_factory=list)
    #: the options this resume changes (crf.spec.AT_RESUME), kept in its launch record
    changed: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """A validated run, ready to start: nothing has been written or launched yet.

    A dry run's plan may not be ready: ``missing`` then lists what an account or a setup
    step must provide first, and such a plan is only shown, never run.
    """

    spec: RunSpec
    #: None only in a dry run whose store could not be opened (``missing`` says why)
    store: RunStore | None
    executor: ServerlessExecutor
    command: list[str] | None  # None: the backend's default, python -m crf.replica
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    resume: ResumeInfo | None = None  # set when continuing an existing run
    #: the ``--secret`` values read at this launch (crf.launcher.user_env); never written,
    #: never shown (repr=False)
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    #: the packed ``--workdir``, put in the run folder at launch (None: no workdir)
    workdir: PackedWorkdir | None = field(default=None, repr=False)
    #: what a dry run found missing, one line each naming what provides it: credentials
    #: (the variable, file or login command), store access, a client library (empty: ready)
    missing: list[str] = field(default_factory=list)
    #: warnings, one line each: the checks' (a folder's files the replicas' reader skips, a
    #: split checked on its first rows only), shown by a dry run and a launch alike; and a
    #: dry run's about the job's settings (e.g. completions shorter than the dataset's answers)
    notes: list[str] = field(default_factory=list)
    #: the rollout workers (--rollout-workers; None: none), started after the replicas
    workers: WorkerPlan | None = None
    #: the source of the reward modules the checks imported from the user's folder, which
    #: this launch's replicas import (crf/replica/reward_code.py; None: none to keep)
    reward_code: bytes | None = field(default=None, repr=False)

    def code_env(self) -> dict[str, str]:
        """The variable that names :attr:`reward_code` in the run folder to the replicas."""
        from crf.replica.reward_code import key_of

        return {layout.ENV_REWARD_CODE: key_of(self.reward_code)} if self.reward_code else {}


def validate_job(job: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check the job exists and its options are valid; return the options as typed values."""
    from crf.replica.jobs import job_config, nest_dotted

    try:
        options = nest_dotted(dict(options or {}))
        cfg = job_config(job, options)
    except ImportError as e:
        from crf.replica.jobs import JOBS

        why = ("is crf fully installed?" if job in JOBS else
               "install what it imports where the driver and the replicas run")  # fmt: skip
        raise LaunchError(f"job {job!r} cannot be loaded ({e}); {why}") from None
    except (TypeError, ValueError) as e:
        raise LaunchError(str(e)) from None
    except Exception as e:  # a module-path job failing at import: a SyntaxError, its own code
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise LaunchError(
            f"job {job!r}: importing it raised {type(e).__name__}: "
            f"{getattr(e, 'msg', None) or e}{where}; fix the module"
        ) from None
    # Keep only what the user set (coerced to the option's type): the replica applies the
    # job's defaults itself, and run.json stays readable.
    return {k: getattr(cfg, k, v) for k, v in options.items()}


def check_local_batch(
    job: str, options: Mapping[str, Any] | None, k: int | None, spec: RunSpec | None = None
) -> None:
    """LaunchError if the job's batch cannot be split evenly over the replica's K local
    ranks (a job that names its batch: ``replica_batch(config)``), before any replica runs."""
    from crf.replica.jobs import get_job, job_config
    from crf.replica.local_ranks import batch_error

    if not k or k <= 1:
        return
    why = batch_error(job, get_job(job), job_config(job, dict(options or {})), k, spec)
    if why:
        raise LaunchError(why)


#: the rows of a --dataset file a dry run reads to compare with the job's settings
SAMPLE_ROWS = 64


def job_notes(spec: RunSpec, rows: list[dict[str, Any]]) -> list[str]:
    """The warnings about the job's settings against the sampled dataset rows (the job
    module's ``notes(config, spec, rows)``, if it has one): a launch prints them before its
    replicas start, as its dry run does."""
    from crf.replica.jobs import get_job, job_config

    notes = getattr(get_job(spec.job), "notes", None)
    if notes is None or spec.entrypoint:
        return []
    return list(notes(job_config(spec.job, spec.job_config), spec, rows))


def check_job_run(spec: RunSpec, executor: ServerlessExecutor | None) -> None:
    """The job's own checks that need the run options (``check_run(config, spec, gpus,
    local, bf16)`` in its module, if it has one: the composer job's TRL settings and vLLM;
    ``bf16`` whether a cloud backend's GPU has bfloat16 of its own, None if not known);
    LaunchError says what to fix. Without an executor (``--print-config``) the hardware is
    unknown."""
    from crf.replica.jobs import get_job, job_config

    check_hardware(spec, executor)
    check = getattr(get_job(spec.job), "check_run", None)
    if check is None:
        return
    local = getattr(executor, "name", spec.backend) == "local"
    gpus: int | None = None
    bf16: bool | None = None
    if executor is not None and not local:
        gpus, bf16 = executor.gpus_per_replica(), executor.gpu_bf16()
    try:
        check(job_config(spec.job, spec.job_config), spec, gpus, local, bf16)
    except (TypeError, ValueError) as e:
        raise LaunchError(str(e)) from None


def check_hardware(spec: RunSpec, executor: ServerlessExecutor | None) -> None:
    """LaunchError for a ``--device`` or ``--precision`` the replicas' hardware cannot do,
    where it is known before launch: a cloud backend's hardware option (no GPU; a GPU older
    than Ampere, whose bfloat16 torch emulates), or this machine for local replicas. Each
    replica would refuse the same at setup (crf.replica.model), after its start. Nothing
    for an own command (crf's options are not its)."""
    device, precision = spec.device, spec.precision
    if executor is None or spec.entrypoint or device == "cpu":
        return
    if device == "auto" and precision in ("auto", "fp32"):
        return
    known = _hardware(executor)
    if known is None:
        return
    gpu, bf16, shown = known
    local = getattr(executor, "name", "") == "local"
    other = "" if local else "choose GPU hardware (--hardware), or "
    if not gpu and (device == "cuda" or precision == "fp16"):
        what = "--device cuda" if device == "cuda" else "--precision fp16"
        fix = "use --device auto" if device == "cuda" else "use --precision bf16 or fp32"
        raise LaunchError(f"{what} needs a CUDA GPU, and {shown} has none: {other}{fix}")
    if gpu and precision == "bf16" and bf16 is False:
        raise LaunchError(
            f"--precision bf16, but {shown} has a GPU older than Ampere, without bfloat16 of "
            "its own (torch emulates it there, slower than fp32): use --precision fp16 or "
            "fp32" + ("" if local else ", or Ampere or later hardware (--hardware)")
        )


def _hardware(executor: ServerlessExecutor) -> tuple[bool, bool | None, str] | None:
    """What :func:`check_hardware` knows of the replicas' hardware: whether it has a GPU,
    whether that GPU has bfloat16 of its own (None: unknown), and its name in a message;
    None where the backend does not say (no hardware option)."""
    if getattr(executor, "name", "") == "local":
        import torch

        from crf.replica.model import native_bf16

        return (
            torch.cuda.is_available(),
            native_bf16(),
            "this machine (where the local replicas run)",
        )
    option = getattr(executor, "hardware_option", None)
    if option is None:
        return None
    value = getattr(executor, option, None)
    shown = f"the {executor.name} backend's hardware ({value or 'CPU only'})"
    return executor.gpus_per_replica() > 0, executor.gpu_bf16(), shown


def check_replica_limit(executor: ServerlessExecutor, replicas: int) -> None:
    """LaunchError if the backend cannot run that many replicas (see replica_limit)."""
    limit_of = getattr(executor, "replica_limit", None)
    found = limit_of() if callable(limit_of) else None
    if found is not None and replicas > found[0]:
        limit, why = found
        name = getattr(executor, "name", "this")
        raise LaunchError(
            f"--replicas {replicas} is more than the {name} backend can run: at most {limit} "
            f"({why}); lower --replicas or use a cloud backend"
        )


def launch_options(options: Mapping[str, Any] | RunSpec | None) -> dict[str, Any]:
    """The run options of a launch as a dict by RunSpec field name: a mapping's, by any
    spelling of each option (crf.launcher.names: LaunchError for a name that is none), or a
    RunSpec's own (its run_uri is not one: the store decides where a run lives)."""
    from crf.launcher.names import run_option_values

    if isinstance(options, RunSpec):
        return {name: getattr(options, name) for name in run_options()}
    return run_option_values(options or {})


def prepare(
    options: Mapping[str, Any] | RunSpec | None = None,
    *,
    store: str | None = None,
    executor: ServerlessExecutor | None = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: RestartPolicy | None = None,
    dry_run: bool = False,
) -> Plan:
    """Validate every input; LaunchError says what to fix. Writes nothing but a probe (and
    not even that with ``dry_run``).

    ``options``: the run options (RunSpec fields declared with ``option``: job, replicas,
    sync_every, rounds, job_config, entrypoint, ...); one left out takes its RunSpec default,
    ``run_id`` a new one. ``executor`` replaces the one ``backend`` and ``backend_options``
    name. With ``dry_run``, what an account or a setup step provides (credentials, store
    access, a client library) does not stop the checks: it is listed in ``Plan.missing``.
    """
    from crf.store import join_uri

    values = launch_options(options)
    policy = (restart or RestartPolicy()).validate()
    job_options, entrypoint = values.pop("job_config", None), values.pop("entrypoint", None)
    command = _command(entrypoint)  # on the spec before it is checked: workers refuse one
    run_id = values.pop("run_id", None)
    run_id = run_id if run_id is not None else new_run_id()
    # rollout_<option>: the rollout workers' own hardware (crf.launcher.workers)
    backend_options, rollout_options = split_options(
        values.get("backend", RunSpec.backend), backend_options
    )
    if executor is None:
        executor = make_executor(values.get("backend", RunSpec.backend), backend_options)
    values["backend"] = getattr(executor, "name", values.get("backend", RunSpec.backend))
    try:
        run_uri = join_uri(store_base(store), run_id)
    except LaunchError:
        raise
    except (TypeError, ValueError, OSError) as e:  # not a string; no working directory
        raise LaunchError(f"--store {store!r} is not a usable URI or path: {e}") from None
    try:
        spec = RunSpec(run_id=run_id, run_uri=run_uri, entrypoint=command, **values)
        if _is_count(spec.replicas):  # the machine's limit says more than N's range
            check_replica_limit(executor, spec.replicas)
        spec.validate()
        check_rollout_options(spec)
    except SpecError as e:
        raise LaunchError(str(e)) from None
    except TypeError as e:  # e.g. outer_lr="fast" from Python: comparisons fail
        raise LaunchError(f"a run option has the wrong type: {e}") from None
    missing = check_access(executor, run_uri, dry_run=dry_run)  # the backend's credentials
    packed = check_code(spec, executor)
    check_entrypoint_options(entrypoint, job_options, job_named="job" in values)
    try:
        with importable(packed if imports_user_code(spec) else None, spec):
            spec.job_config = validate_job(spec.job, job_options)
            check_job_run(spec, executor)
            rows = check_workload(spec)
            found = _check_inputs(spec, executor, dry_run, packed)  # data, model, rewards
            missing += found.missing  # a dry run: a Hub repo this machine cannot reach
            k = spec.procs_per_replica  # None: the GPUs of the hardware (the job says if)
            spec.procs_per_replica = resolve_procs_per_replica(k, executor, command, spec.job)
            check_local_batch(spec.job, spec.job_config, spec.procs_per_replica, spec)
            workers = plan_workers(spec, executor, backend_options, rollout_options)
            missing += check_workers(spec, workers, executor, dry_run, missing)
            notes = job_notes(spec, rows)  # the job may be the workdir's
            notes += idle_worker_gpus(workers)  # GPUs paid for that no worker uses
            notes += found.warnings  # a cloud backend's Hub repos not reached from here
            notes += tracking_warnings(spec)  # local wandb without a key: no tracking
        if not _shipped_program(command, packed):  # ./run.sh runs from the unpacked copy
            _check_command(executor, command, packed, missing if dry_run else None)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None
    secret_env = _read_secrets(spec, missing if dry_run else None)
    # The store last: the writability probe is the only check with a side effect.
    run_store = (_dry_run_folder(run_uri, run_id, missing) if dry_run
                 else _run_folder(run_uri, run_id, dry_run))  # fmt: skip
    return Plan(spec, run_store, executor, command, restart=policy, secret_env=secret_env,
                workdir=packed, missing=missing, notes=notes, workers=workers,
                reward_code=kept_reward_code(spec, executor))  # fmt: skip


def check_workers(
    spec: RunSpec,
    workers: WorkerPlan | None,
    executor: ServerlessExecutor,
    dry_run: bool,
    missing: list[str],
) -> list[str]:
    """The replicas' checks of the backend (:func:`check_access`) and of the job's settings
    on its hardware (:func:`check_job_run`: vLLM needs a GPU) again for the rollout workers'
    executor where it is their own (their hardware differs): the missing lines not already
    in ``missing``; a refusal says it is the workers'."""
    if workers is None or workers.executor is executor:
        return []
    try:
        found = check_access(workers.executor, spec.run_uri, dry_run=dry_run)
        check_job_run(spec, workers.executor)
    except LaunchError as e:
        said = str(e).replace("(--hardware)", "(--rollout-hardware)")
        raise LaunchError(f"rollout workers: {said}") from None
    return [line for line in found if line not in missing]


def check_access(executor: ServerlessExecutor, run_uri: str, *, dry_run: bool) -> list[str]:
    """The backend's checks before launch (``check_ready``: credentials, hardware names,
    the store reachable from its replicas and their credentials for it). A launch stops at
    the first problem (LaunchError); a dry run returns every missing access, a line each,
    to list after the plan (bad input, a misspelt GPU name, is a LaunchError either way)."""
    try:
        if not dry_run:
            executor.check_ready(run_uri)
            return []
        return executor.missing(run_uri)
    except ExecutorError as e:
        raise LaunchError(str(e)) from None


def store_access(run_uri: str) -> list[str]:
    """What keeps this machine from the run's store (empty: it answers): no credentials
    for it (the line says which variable or login gives them), its client library missing,
    or the store refusing a read. Reads only."""
    from crf.executors.secrets import MissingCredentials, store_secrets
    from crf.store import RunStore

    try:
        store_secrets(run_uri)
    except MissingCredentials as e:
        return [str(e)]
    try:
        with store_errors(run_uri):
            RunStore(run_uri, retries=0).exists(layout.RUN_SPEC)
    except LaunchError as e:
        return [str(e)]
    return []


def _check_command(
    executor: ServerlessExecutor,
    command: list[str] | None,
    packed: PackedWorkdir | None,
    missing: list[str] | None,
) -> None:
    """The executor's check of the command, then the local executor's of the Python script
    it runs (without ``--workdir``, whose copy is where the replicas run): at launch its
    refusal is the launch's; in a dry run (``missing`` given), which may run from another
    folder than the launch, it is listed among what is missing (``--strict``: exit 2)."""
    argv = executor.check_command(command)
    check = getattr(executor, "check_script", None)
    if packed is not None or check is None:
        return
    try:
        check(argv)
    except ExecutorError as e:
        if missing is None:
            raise
        missing.append(str(e))


def _dry_run_folder(run_uri: str, run_id: str, missing: list[str]) -> RunStore | None:
    """A dry run's run folder, checked as :func:`_run_folder` checks it, when the store
    answers; otherwise None, and why joins ``missing`` (once: a cloud backend's check may
    have said it already, in its own words that name the store)."""
    problems = store_access(run_uri)
    said = any(run_uri in line for line in missing)
    missing.extend(p for p in problems if p not in missing and not said)
    return None if problems else _run_folder(run_uri, run_id, dry_run=True)


def _read_secrets(spec: RunSpec, missing: list[str] | None) -> dict[str, str]:
    """The ``--secret`` values, each set (or its file readable) before launch; with a
    ``missing`` list (a dry run) one that is not is added there instead of raised. A
    credential given with ``--env`` is refused either way (check_plain_env)."""
    check_plain_env(spec)
    if missing is None:
        return resolve_secrets(spec)
    check_reserved(spec)  # a reserved name is bad input, not something missing
    try:
        return resolve_secrets(spec)
    except LaunchError as e:
        missing.append(str(e))
        return {}


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run options checked as :func:`prepare` checks them, with no backend and no store
    (``crf launch --print-config`` shows a config only once it would launch); returns the
    job's options as typed values. LaunchError says what to fix."""
    return checked_spec(options).job_config


def checked_spec(options: Mapping[str, Any] | None) -> RunSpec:
    """The RunSpec of :func:`check_options` (its job_config typed); no store, no backend."""
    values = launch_options(options)
    job_options, entrypoint = values.pop("job_config", None), values.pop("entrypoint", None)
    run_id = values.pop("run_id", None)
    command = _command(entrypoint)
    try:
        spec = RunSpec(
            run_id=run_id if run_id is not None else new_run_id(), run_uri="memory://check",
            entrypoint=command, **values,
        )  # fmt: skip
        spec.validate()
    except SpecError as e:
        raise LaunchError(str(e)) from None
    except TypeError as e:
        raise LaunchError(f"a run option has the wrong type: {e}") from None
    check_rollout_options(spec)
    check_entrypoint_options(entrypoint, job_options, job_named="job" in values)
    spec.job_config = validate_job(spec.job, job_options)
    check_job_run(spec, None)
    return spec


def job_settings(spec: RunSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's effective settings for a checked ``spec``: its own knobs (defaults
    included) and the TRL fields that differ from TRL's defaults (composer; {} for others)."""
    from crf.replica.jobs import get_job, job_config

    cfg = job_config(spec.job, spec.job_config)
    settings = getattr(get_job(spec.job), "settings", None)
    if settings is not None:
        return settings(cfg, spec)
    return (dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}), {}


def trl_config_name(spec: RunSpec) -> str:
    """The TRL config class a job's ``trl`` table fills (its module's ``TRL_CONFIG``:
    GRPOConfig for composer, SFTConfig for sft)."""
    from crf.replica.jobs import get_job

    return str(getattr(get_job(spec.job), "TRL_CONFIG", "GRPOConfig"))


def check_entrypoint_options(
    entrypoint: str | Sequence[str] | None,
    job_options: Mapping[str, Any] | None,
    *,
    job_named: bool,
) -> None:
    """LaunchError for ``--set`` with a custom ``--entrypoint`` and no job named: job
    options configure a crf job, and the command replaces the default one, so they would be
    checked against a job that never runs. (With ``--job`` named, they are that job's, in
    run.json, where an entrypoint that follows the replica contract may read them.)"""
    if entrypoint is None or not job_options or job_named:
        return
    given = " ".join(f"--set {k}={v}" for k, v in job_options.items())
    raise LaunchError(
        f"{given}: --set configures crf's built-in jobs, not an --entrypoint; pass "
        "arguments to your entrypoint in the command itself, e.g. --entrypoint "
        "'python train.py --lr 3e-4' (or read them from --env)"
    )


def check_workload(spec: RunSpec) -> list[dict[str, Any]]:
    """LaunchError for a --reward that does not parse or import, a --dataset (or held-out
    --eval-dataset / --eval-split) that cannot be read, lacks a column or has fewer rows than
    replicas (crf/replica/data.py); a job with its own data formats checks them itself
    (``check_launch(spec)`` in its module: the sft job). A local dataset path becomes
    absolute, so replicas in another directory find it. Returns the first rows of a
    --dataset file (at most SAMPLE_ROWS) for the dry run's notes."""
    from crf.launcher.reward_checks import import_rewards
    from crf.replica.data import DataError, check_dataset, check_eval
    from crf.replica.jobs import get_job
    from crf.replica.rewards import RewardError, check_rewards

    held_out = spec.eval_split or spec.eval_dataset or spec.eval_dataset_config
    parts = _dataset_parts(spec)
    if spec.job == "lm" and (spec.dataset or spec.reward or spec.columns or held_out or parts):
        raise LaunchError(
            "--dataset (with --dataset-config, --dataset-split), --eval-split, --eval-dataset "
            "(with --eval-dataset-config), --column and --reward are for the composer and sft "
            "jobs, not lm"
        )
    if spec.eval_dataset_config and not spec.eval_dataset:
        raise LaunchError(
            f"--eval-dataset-config {spec.eval_dataset_config} names a config of "
            "--eval-dataset, and there is none: give --eval-dataset (a config of --dataset's "
            "held-out split is --dataset-config's)"
        )
    if parts and not spec.dataset and spec.job in ("composer", "sft"):
        raise LaunchError(
            f"{parts[0]} names a part of --dataset, and there is none (the job's embedded "
            "task has no configs or splits): give --dataset, or drop it"
        )
    _check_column_use(spec)
    import_rewards(spec.reward)  # within a time limit: a module may block as it imports
    job_check = getattr(get_job(spec.job), "check_launch", None)
    if job_check is not None:  # the job checks its own data (sft: TRL's SFT formats)
        try:
            job_check(spec)
        except DataError as e:
            raise LaunchError(str(e)) from None
        return []
    try:
        specs = check_rewards(spec.reward)
        needs_answer = any(s.needs_answer for s in specs) or not specs
        spec.dataset = _local_data(spec, spec.dataset, "--dataset")
        spec.eval_dataset = _local_data(spec, spec.eval_dataset, "--eval-dataset")
        check_eval(spec, needs_answer)
        if spec.dataset is None:
            return []
        return check_dataset(
            spec.dataset,
            config=spec.dataset_config,
            split=spec.dataset_split,
            columns=spec.columns,
            replicas=spec.replicas,
            needs_answer=needs_answer,
            sample=SAMPLE_ROWS,
        )
    except (DataError, RewardError) as e:
        raise LaunchError(str(e)) from None


def _check_column_use(spec: RunSpec) -> None:
    """LaunchError for a ``--column`` mapping that reads nothing (no ``--dataset`` or
    ``--eval-dataset``: the embedded task has its own fields), a composer prompt read from
    the column another field reads (the answer would be in the prompt), and a
    ``--dataset-split`` other than ``train`` of a dataset that is one split (a file, or a
    saved Dataset): datasets reads it whole whatever the name, so a typo would train on it."""
    from crf.replica.data import one_split

    if spec.columns and not (spec.dataset or spec.eval_dataset):
        mapping = " ".join(f"--column {k}={v}" for k, v in spec.columns.items())
        raise LaunchError(
            f"{mapping} maps the columns of --dataset, and there is none (the job's embedded "
            "task has its own fields): give --dataset, or drop --column"
        )
    if spec.job == "composer" and spec.columns:
        read = {f: spec.columns.get(f, f) for f in ("prompt", "answer", "hint", "trace")}
        shared = [f for f in ("answer", "hint", "trace") if read[f] == read["prompt"]]
        if shared:
            raise LaunchError(
                f"--column maps prompt and {shared[0]} to one column {read['prompt']!r}: the "
                f"{shared[0]} would be the prompt itself; map each to its own column"
            )
    split = spec.dataset_split
    if spec.dataset and split != RunSpec.dataset_split and one_split(spec.dataset):
        raise LaunchError(
            f"--dataset-split {split}: --dataset {spec.dataset} is one split (a file, or a "
            "saved Dataset), which datasets reads whole as 'train'; drop --dataset-split, or "
            "give a folder (or Hub dataset) that has this split"
        )


def _dataset_parts(spec: RunSpec) -> list[str]:
    """The options given that choose a part of --dataset: --dataset-config, and
    --dataset-split when it is not the default."""
    split = spec.dataset_split if spec.dataset_split != RunSpec.dataset_split else None
    given = (("--dataset-config", spec.dataset_config), ("--dataset-split", split))
    return [f"{flag} {value}" for flag, value in given if value]


def _check_inputs(
    spec: RunSpec, executor: ServerlessExecutor, dry_run: bool, packed: PackedWorkdir | None
) -> Any:
    """The run's data, model and rewards checked (crf/launcher/data_checks.py), then
    ``--model`` named as the replicas will find it (:func:`replica_model_path`)."""
    from crf.launcher.reward_checks import (
        check_rewards_on,
        check_rewards_shipped,
        embedded_splits,
        reward_warnings,
    )

    local = getattr(executor, "name", spec.backend) == "local"
    check_rewards_shipped(spec, executor, packed.names if packed else ())
    found = check_inputs(spec, local=local, dry_run=dry_run)
    if builtin_data(spec):  # each reward called on the sampled rows (none: not called)
        check_rewards_on(spec, found.splits or embedded_splits(spec))
        found.warnings += reward_warnings(list(spec.reward or []), spec.job)
    spec.model = replica_model_path(spec, packed)
    return found


#: the files of a model folder the replicas need to load it from a shipped --workdir
_MODEL_FILES = ("config.json",)
_WEIGHTS = (".safetensors", ".bin")


def replica_model_path(spec: RunSpec, packed: PackedWorkdir | None = None) -> str | None:
    """``--model`` as the replicas must name it. A Hub id stays as it is. A folder on this
    machine becomes an absolute path on the local backend (each replica runs in its own
    directory, a copy of ``--workdir`` when there is one); on a cloud backend it is the path
    (``./...``) inside the ``--workdir`` copy the replicas run from, when the workdir ships
    the folder's config and weights (``packed``: what it ships), and is refused otherwise
    (those replicas cannot read this machine's disk)."""
    from crf.executors.workdir import MAX_WORKDIR_BYTES

    model = spec.model
    if not model or not os.path.isdir(os.path.expanduser(model)):
        return model
    path = os.path.abspath(os.path.expanduser(model))
    if spec.backend == "local":
        return path
    hub = (
        f"--model {model} is a folder on this machine, which the {spec.backend} replicas "
        "cannot read: upload it to the Hub (huggingface-cli upload ORG/NAME FOLDER) and pass "
        "its id"
    )
    real = os.path.realpath(path)
    workdir = os.path.realpath(spec.workdir) if spec.workdir else None
    if not workdir or os.path.commonpath([real, workdir]) != workdir:
        cap = MAX_WORKDIR_BYTES // 2**20
        raise LaunchError(f"{hub}, or put it in the --workdir folder (up to {cap} MB ships)")
    inside = os.path.relpath(real, workdir).replace(os.sep, "/")
    names = packed.names if packed else ()
    shipped = {n[len(inside) + 1 :] for n in names if n.startswith(inside + "/")}
    weights = any(n.endswith(_WEIGHTS) for n in shipped)
    if not weights or not all(f in shipped for f in _MODEL_FILES):
        raise LaunchError(
            f"{hub}: --workdir {spec.workdir} does not ship its config.json and weights (git "
            "ignores them, or they are not committed)"
        )
    return "./" + inside


def _local_data(spec: RunSpec, dataset: str | None, flag: str) -> str | None:
    """A local data file or folder as an absolute path (DataError off the local backend,
    whose replicas cannot read this machine's disk); anything else as it is."""
    from crf.replica.data import DataError, is_local

    if dataset is None or not is_local(dataset):
        return dataset
    if spec.backend != "local":
        raise DataError(
            f"{flag} {dataset} is a local file the {spec.backend} replicas "
            "cannot read: copy it to the store (or any URL) and pass that URL"
        )
    return os.path.abspath(os.path.expanduser(dataset))


def check_code(spec: RunSpec, executor: ServerlessExecutor) -> PackedWorkdir | None:
    """Check ``--pip``/``--requirements`` (their entries join spec.pip, normalised) and pack
    ``--workdir`` (its absolute path and its run-folder key go to the spec); LaunchError
    says what to fix. A backend that installs nothing (local: the replicas run in this
    Python) must find every package installed here instead."""
    from crf.executors.workdir import (
        WorkdirError,
        check_requirement,
        missing_here,
        pack_workdir,
        read_requirements,
    )

    try:
        entries = list(spec.pip)
        if spec.requirements is not None:
            entries += read_requirements(spec.requirements)
            spec.requirements = os.path.abspath(os.path.expanduser(spec.requirements))
        spec.pip = list(dict.fromkeys(check_requirement(e) for e in entries))
        installs = getattr(executor, "installs_packages", False)
        missing = [] if installs else missing_here(spec.pip)
        if missing:
            raise WorkdirError(
                f"--pip/--requirements: {', '.join(missing)} not installed in this Python, "
                f"where the {spec.backend} replicas run (that backend installs nothing): "
                "pip install them here, or use a cloud backend"
            )
        if spec.workdir is None:
            return None
        store = spec.run_uri.removeprefix("file://") if spec.run_uri.startswith("file://") else ""
        # a local store inside the workdir (the default ./crf-runs with --workdir .) stays out
        packed = pack_workdir(spec.workdir, exclude=[Path(store).parent] if store else [])
    except WorkdirError as e:
        raise LaunchError(str(e)) from None
    spec.workdir = str(Path(spec.workdir).expanduser().resolve())
    spec.workdir_key = layout.workdir_key(packed.sha256[:16])
    return packed


@contextlib.contextmanager
def importable(packed: PackedWorkdir | bytes | None, spec: RunSpec) -> Iterator[None]:
    """What the replicas of ``spec`` will have, for the checks before launch: the run's
    ``--env`` and ``--secret`` variables (:func:`replica_variables`), and the packed workdir
    (or its archive's bytes, as the run folder keeps them) unpacked in a temporary folder
    first on sys.path, so they import a job or a reward from exactly what the replicas will
    get. A refusal that names a file of the copy names it in the user's ``--workdir``
    instead; SIGTERM, like Ctrl-C, removes the copy on its way out."""
    with replica_variables(spec):
        if packed is None:
            yield
        else:
            with _unpacked(packed, spec.workdir):
                yield


@contextlib.contextmanager
def _unpacked(packed: PackedWorkdir | bytes, workdir: str | None) -> Iterator[None]:
    """:func:`importable`'s copy of the packed workdir, first on sys.path while it lasts."""
    from crf.executors.workdir import unpack_workdir
    from crf.launcher.interrupts import sigterm_as_interrupt

    data = packed if isinstance(packed, bytes) else packed.data

    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="crf-workdir-check-") as tmp:
        where = str(unpack_workdir(data, Path(tmp) / "workdir"))
        if "" not in sys.path:  # a reward's import adds the working directory (import_reward):
            sys.path.insert(0, "")  # now, behind the copy, whose version a replica imports
        sys.path.insert(0, where)
        importlib.invalidate_caches()
        try:
            yield
        except LaunchError as e:
            if workdir is None or where not in str(e):
                raise
            raise LaunchError(str(e).replace(where, workdir.rstrip(os.sep))) from None
        finally:
            sys.path.remove(where)
            for name, module in list(sys.modules.items()):  # none stays cached from it
                if (getattr(module, "__file__", None) or "").startswith(where):
                    del sys.modules[name]


def kept_reward_code(spec: RunSpec, executor: ServerlessExecutor | None) -> bytes | None:
    """The source of the reward modules the checks just imported from the user's folder,
    for a run whose replicas would import them from that folder as it is when each starts
    (a backend that runs them on this machine, without --workdir): each replica of this
    launch imports this copy instead (crf/replica/reward_code.py)."""
    from crf.replica.reward_code import snapshot
    from crf.replica.rewards import reward_modules

    if spec.workdir is not None or getattr(executor, "installs_packages", False):
        return None
    modules = reward_modules(spec.reward)
    return snapshot(modules) if modules else None


def imports_user_code(spec: RunSpec) -> bool:
    """Whether the checks before launch import the user's code: a module-path job or a
    ``module:function`` reward."""
    from crf.replica.jobs import JOBS

    custom = [r for r in spec.reward if ":" in r and not r.startswith("format:")]
    return spec.job not in JOBS or bool(custom)


def _shipped_program(command: list[str] | None, packed: PackedWorkdir | None) -> bool:
    """Whether the command's program is a relative path to a file the workdir ships (it is
    then found in each replica's unpacked copy, not where the driver runs)."""
    if not command or packed is None or os.path.isabs(command[0]) or "/" not in command[0]:
        return False
    return os.path.normpath(command[0]) in packed.names


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _command(entrypoint: str | Sequence[str] | None) -> list[str] | None:
    """The replica command of ``--entrypoint`` (a shell-quoted string or a list)."""
    if entrypoint is None:
        return None
    if not isinstance(entrypoint, str):
        return list(entrypoint)
    try:
        argv = shlex.split(entrypoint)
    except ValueError as e:
        raise LaunchError(f"--entrypoint {entrypoint!r} cannot be parsed: {e}") from None
    _check_no_shell(entrypoint, argv)
    return argv


#: what a shell would act on, and the replica's program would get as an argument
_SHELL_OPERATORS = frozenset({"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1", "1>"})


def _check_no_shell(text: str, argv: list[str]) -> None:
    """LaunchError for an ``--entrypoint`` written for a shell: it is split as a shell
    would split it but run without one (on every backend), so ``VAR=value`` before the
    program is no variable and ``&&``, ``|`` or ``>`` would reach the program as arguments."""
    if argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        raise LaunchError(
            f"--entrypoint {text!r} starts with {argv[0]!r}, but no shell runs it: give the "
            f"variable with --env {argv[0]}"
        )
    ops = [a for a in argv if a in _SHELL_OPERATORS]
    if ops:
        raise LaunchError(
            f"--entrypoint {text!r} has {ops[0]!r}, but no shell runs it (the program would "
            "get it as an argument): put the commands in a script, or give "
            "--entrypoint \"bash -c '...'\""
        )


@contextlib.contextmanager
def store_errors(where: str) -> Iterator[None]:
    """Any store error inside as one LaunchError line that says to check --store (never a
    traceback): StoreErrors already say what to fix; another client error gets its type."""
    from crf.store import StoreError

    try:
        yield
    except LaunchError:
        raise
    except StoreError as e:
        raise LaunchError(f"{e} (check --store)") from None
    except Exception as e:  # noqa: BLE001 - any other client error: one line, not a traceback
        raise LaunchError(
            f"cannot use store {where}: {type(e).__name__}: {e} (check --store)"
        ) from None


def _run_folder(run_uri: str, run_id: str, dry_run: bool) -> RunStore:
    """The new run's folder, checked: it holds no run, it is empty, and it is writable. A
    ``dry_run`` writes nothing in the store: it reads, and a local folder's writability is
    tried in the nearest folder that exists (:func:`_local_writable`); a cloud store's
    write permission shows at launch."""
    from crf.store import RunStore

    with store_errors(run_uri):
        probe = RunStore(run_uri, retries=0)
        if probe.exists(layout.RUN_SPEC):
            raise LaunchError(
                f"run folder {display_path(probe)} already holds a run (run.json exists); "
                f"{held_run_hint(probe, run_id)}"
            )
        if dry_run:
            _local_writable(probe)
        else:
            probe.check_writable()
        leftovers = [n for n in probe.list() if not n.startswith(".crf-probe-")]
        if leftovers:
            raise LaunchError(
                f"run folder {display_path(probe)} is not empty ({', '.join(leftovers[:5])}); "
                "choose another --run-id or another --store"
            )
        return probe if dry_run else RunStore(run_uri)


def held_run_hint(run_store: RunStore, run_id: str) -> str:
    """What to do about a new launch into a folder that already holds run ``run_id``:
    continue it with ``--resume`` unless a resume would be refused for what the folder says
    (crf/launcher/resume.py refuses a run that finished ok, one whose run.json is damaged,
    and one whose replicas still run or start: follow or stop those instead), else choose
    another run id, and why."""
    try:
        spec: RunSpec | None = read_run_spec(run_store)
    except LaunchError as e:  # a damaged run.json
        return f"choose another --run-id (it cannot be resumed: {e})"
    except Exception:  # noqa: BLE001 - the store failed the read: the hint says less
        spec = None
    try:
        result = run_store.get_json(layout.RESULT) if run_store.exists(layout.RESULT) else {}
    except Exception:  # noqa: BLE001 - a torn result.json: a resume treats it as none
        result = {}
    if isinstance(result, dict) and result.get("status") == "ok":
        return (
            f"choose another --run-id (it cannot be resumed: run {run_id} already finished "
            "(result.json says ok); there is nothing to resume)"
        )
    live = _held_run_live(run_store, spec) if spec is not None else []
    if live:
        base = run_store.uri.rstrip("/").rsplit("/", 1)[0].removeprefix("file://")
        return (
            f"it is still running ({', '.join(live)}): follow it with `crf status {run_id} "
            f"--store {base} --watch`, or stop it with `crf cancel {run_id} --store {base}`; "
            "or choose another --run-id"
        )
    return f"choose another --run-id, or continue it with --resume {run_id}"


def _held_run_live(run_store: RunStore, spec: RunSpec) -> list[str]:
    """What of a held run may still run, as a resume would find it (crf/launcher/liveness.py):
    replicas by their heartbeats, a launch still starting its replicas, and replicas its
    backend still runs. Empty when nothing says so, or when it cannot be asked (a hint
    must never be the error)."""
    from crf.launcher.liveness import backend_live, launch_starting, live_replicas

    try:
        live = live_replicas(run_store, spec.replicas, spec.run_id)
        starting = launch_starting(run_store, spec.replicas, spec.run_id, known_only=True)
        if live or starting:
            return [*live, *([starting] if starting else [])]
        executor = make_executor(spec.backend, saved_backend_options(run_store))
        return backend_live(run_store, executor, layout.launch_numbers(run_store))
    except Exception:  # noqa: BLE001 - any store or backend client error: nothing known
        return []


def _local_writable(store: RunStore) -> None:
    """For a store on this machine's disk: LaunchError unless a folder can be made where the
    run folder would go (tried, then removed, in the nearest folder that exists), which a
    launch would find out only when it writes. Other stores: nothing (a dry run does not
    write to them)."""
    protocol = store.fs.protocol
    if "file" not in (protocol if isinstance(protocol, tuple | list) else (protocol,)):
        return
    path = Path(store.path(""))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is a file")
        Path(tempfile.mkdtemp(prefix=".crf-probe-", dir=path)).rmdir()
    except OSError as e:
        raise LaunchError(
            f"cannot write to store {store.uri}: {type(e).__name__}: {e}. "
            "Check the path exists and that you may write there (check --store)"
        ) from None


def read_run_spec(store: RunStore) -> RunSpec:
    """The run's ``run.json`` as a valid RunSpec, as its resumes changed it
    (crf/resumed_options.py). A damaged one (not UTF-8, not JSON, not an object, a field of
    the wrong type or out of range) is a LaunchError that names the file and what is wrong
    with it, for ``--resume``, ``crf status``, ``crf logs`` and ``crf cancel`` alike."""
    from crf.resumed_options import with_changes

    return with_changes(store, _read_run_json(store))


def _read_run_json(store: RunStore) -> RunSpec:
    where = display_path(store, layout.RUN_SPEC)
    raw = store.get(layout.RUN_SPEC)
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise LaunchError(
            f"{where} is damaged: not UTF-8 text (bad byte at offset {e.start}); restore it "
            "from a copy, or remove the run folder"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LaunchError(
            f"{where} is damaged: not valid JSON ({e.msg} at line {e.lineno}, column "
            f"{e.colno}); restore it from a copy, or remove the run folder"
        ) from None
    if not isinstance(data, dict):
        raise LaunchError(
            f"{where} is damaged: it holds a JSON {type(data).__name__}, not the run's "
            "options (an object); restore it from a copy, or remove the run folder"
        )
    try:
        spec = RunSpec.from_dict(data)
        for name, declared in run_options().items():  # each field alone: the message names it
            try:
                declared.check(spec)
            except (SpecError, TypeError) as e:
                raise LaunchError(f"{where} is damaged: field {name}: {e}") from None
        return spec.validate()
    except (SpecError, TypeError) as e:  # TypeError: a missing field, or one of a wrong type
        raise LaunchError(f"{where} is damaged: {e}") from None


def saved_backend_options(store: RunStore) -> dict[str, Any]:
    """The executor options a run was launched with (``backend.json``; empty if absent)."""
    from crf.store import StoreError

    try:
        data = store.get_json(layout.BACKEND)
    except (StoreError, OSError, ValueError):  # absent (an old run) or damaged: no options
        return {}
    options = data.get("options") if isinstance(data, dict) else None
    return {k: v for k, v in (options or {}).items() if v is not None}


def backend_config(plan: Plan) -> dict[str, Any]:
    """The executor's non-secret options, for rebuilding it in another process."""
    try:
        return dict(plan.executor.config())
    except Exception:  # noqa: BLE001 - any executor's code: a record must not stop a launch
        return {}
