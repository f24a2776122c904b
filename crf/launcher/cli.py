"""The ``crf`` command line (typer + rich).

Exit codes are part of the interface, so scripts and CI can rely on them:
0 the run finished ok; 1 the run started but failed (see result.json), or its result.json
could not be written; 2 bad input, nothing was launched; 130 interrupted with Ctrl-C or
SIGTERM (replicas were cancelled).

``crf launch --resume RUN_ID`` continues a stopped run from its own ``run.json``; the options
that define a run (replicas, job, H, rounds, ...) are refused with it rather than silently
ignored, since the run keeps the ones it was launched with.

Bad input prints one red line that says what to fix - no traceback. Heavy modules (the store,
torch, job configs) are imported inside the commands so ``crf --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import shutil
import sys
import time
import typing
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from crf.launcher.plan import DEFAULT_MAX_RESTARTS  # light: no store, no torch
from crf.spec import AT_RESUME, BACKEND, ROLLOUT, RUN, RUN_DEFINING, Option, run_options


def _help_markup_mode() -> Literal["rich"] | None:
    """Typer's rich help on a wide terminal; click's plain formatter below 100 columns.

    Rich's options table gives each option six columns (long and short names, their
    negations, type, help) and cuts what does not fit with an ellipsis: at 80 columns that
    squeezes help to ~20 characters and cuts option names. Click's formatter wraps the help
    under each name instead, so nothing is cut; ``COLUMNS`` decides, as for any terminal."""
    return "rich" if shutil.get_terminal_size().columns >= 100 else None


app = typer.Typer(
    name="crf",
    rich_markup_mode=_help_markup_mode(),
    # click's formatter is narrowed to 80 columns by default; let it use the terminal
    context_settings={"max_content_width": shutil.get_terminal_size().columns},
    help="Train one model as N replicas that meet only through an object store (DiLoCo).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold credentials
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One red line (a message with line breaks, e.g. a client library's, is joined)."""
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    Console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def _user_errors(what: str = "") -> Iterator[None]:
    """The one mapping of the run commands' errors (rm, export, plot, status, logs, cancel)
    to one red line, exit 2: crf's own errors say what to fix; an OSError (a path under a
    file, a folder where a file goes, no permission) is said in words with its path
    (errors.os_error_line) instead of a traceback or a bare ``[Errno 20] ...``."""
    from crf.executors.base import ExecutorError
    from crf.launcher.errors import LaunchError, os_error_line
    from crf.store.errors import StoreError

    try:
        yield
    except (LaunchError, ExecutorError, StoreError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(os_error_line(e, what))


def parse_pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    """``--set lr=3e-4 --set steps=10`` -> {"lr": "3e-4", "steps": "10"}: a repeatable
    ``KEY=VALUE`` flag as a mapping (what reads it coerces the values)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"{flag} expects KEY=VALUE (got {item!r})")
        key = key.strip()
        if flag == "--column" and out.get(key, value) != value:  # a later --set wins; not this
            _fail(
                f"--column {key} is given twice ({out[key]!r} and {value!r}): a field reads "
                "one column; keep the one you mean"
            )
        out[key] = value
    return out


def parse_sets(items: list[str] | None) -> dict[str, str]:
    """``--set KEY=VALUE`` (job_config coerces the values to the job's types)."""
    return parse_pairs(items, "--set")


def _print_version(value: bool) -> None:
    if value:
        from crf import __version__

        typer.echo(f"crf {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _app(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_print_version, is_eager=True,
                     help="Print the crf version and exit."),
    ] = None,
) -> None:  # fmt: skip
    """Train one model as N replicas that meet only through an object store (DiLoCo)."""


@app.command()
def version() -> None:
    """Print the crf version (the same as crf --version)."""
    _print_version(True)


# ---------------------------------------------------------------------- crf launch
# The run options (replicas, -H, rounds, ...) are not declared here: each is declared once on
# its RunSpec field (crf/spec.py), and crf launch gets one flag per declaration, with its help
# and default (_run_option_parameter). What follows are the flags that are not run options,
# each declared once.
LAUNCH = "Launch"
Hardware = Annotated[
    str | None,
    typer.Option(
        "--hardware",
        "--gpu",
        "--flavor",
        "--instance-type",
        help="Per-replica hardware in the backend's own terms: a Modal GPU (A10G, H100:2), "
        "an HF Jobs flavor (a10g-small), a SageMaker instance type (ml.g5.xlarge).",
        rich_help_panel=BACKEND,
    ),
]
RolloutHardware = Annotated[
    str | None,
    typer.Option(
        "--rollout-hardware",
        "--rollout-gpu",
        "--rollout-flavor",
        "--rollout-instance-type",
        metavar="",
        help="Each rollout worker's hardware (--rollout-workers), in the backend's terms as "
        "--hardware (default: the replicas'). Any other backend option for the workers "
        "only: -o rollout_<option>=VALUE.",
        rich_help_panel=ROLLOUT,
    ),
]
Image = Annotated[
    str | None,
    typer.Option(help="Container image for cloud backends (default: see docs).",
                 rich_help_panel=BACKEND),
]  # fmt: skip
Region = Annotated[
    str | None,
    typer.Option(help="Region for cloud backends that have one.", rich_help_panel=BACKEND),
]
BackendOpts = Annotated[
    list[str] | None,
    typer.Option(
        "--opt",
        "-o",
        help="Other backend option KEY=VALUE (repeatable), e.g. -o namespace=my-org, "
        "-o role_arn=arn:aws:iam::123:role/crf, -o spot=true.",
        metavar="KEY=VALUE",
        rich_help_panel=BACKEND,
    ),
]
JobSets = Annotated[  # fills the run option job_config
    list[str] | None,
    typer.Option(
        "--set", help=run_options()["job_config"].help, metavar="KEY=VALUE", rich_help_panel=RUN
    ),
]
LaunchStore = Annotated[
    str | None,
    typer.Option(
        help="Base folder/URI for runs: a path, file:///..., or an object store (s3://, gs://, "
        "hf://; what cloud backends need). The run lives in <store>/<run-id>. "
        "Default: ./crf-runs",
        rich_help_panel=LAUNCH,
    ),
]
DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Check everything and print the plan (what starts where, hardware, "
        "hourly cost) and what is missing (credentials, store access), without launching "
        "or writing anything; exits 0 even when something is missing.",
        rich_help_panel=LAUNCH,
    ),
]
Strict = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="With --dry-run: exit 2 when anything is missing (for CI).",
        rich_help_panel=LAUNCH,
    ),
]
Detach = Annotated[
    bool,
    typer.Option(
        "--detach",
        help="Start the replicas, print the run id and return; follow with crf status / "
        "crf logs, stop with crf cancel.",
        rich_help_panel=LAUNCH,
    ),
]
NoProgress = Annotated[
    bool,
    typer.Option("--no-progress", help="No live table (summary still printed).",
                 rich_help_panel=LAUNCH),
]  # fmt: skip
Timeout = Annotated[
    float | None,
    typer.Option(help="Cancel the replicas if the run takes longer (seconds).",
                 rich_help_panel=LAUNCH),
]  # fmt: skip
MaxRestarts = Annotated[
    int,
    typer.Option(help="Restart a replica that dies at most this many times (per replica).",
                 rich_help_panel=LAUNCH),
]  # fmt: skip
MaxRunRestarts = Annotated[
    int | None,
    typer.Option(help="At most this many restarts in the whole run (default: no cap).",
                 rich_help_panel=LAUNCH),
]  # fmt: skip
ConfigFile = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        help="A TOML file with the run options and a backend and a job table "
        "(docs/config-file.md); flags given here override it.",
        rich_help_panel=LAUNCH,
    ),
]
PrintConfig = Annotated[
    bool,
    typer.Option(
        "--print-config",
        help="Print the resolved options (file + flags + defaults) as a TOML file that -c "
        "reads back, and launch nothing.",
        rich_help_panel=LAUNCH,
    ),
]
Resume = Annotated[
    str | None,
    typer.Option(
        "--resume",
        metavar="RUN_ID",
        help="Continue a stopped run (in --store) from its last committed round, "
        "with the options in its run.json.",
        rich_help_panel=LAUNCH,
    ),
]


def _launch_flags(
    hardware: Hardware = None,
    rollout_hardware: RolloutHardware = None,
    image: Image = None,
    region: Region = None,
    opt: BackendOpts = None,
    job_config: JobSets = None,
    store: LaunchStore = None,
    dry_run: DryRun = False,
    strict: Strict = False,
    detach: Detach = False,
    no_progress: NoProgress = False,
    timeout: Timeout = None,
    max_restarts: MaxRestarts = DEFAULT_MAX_RESTARTS,
    max_run_restarts: MaxRunRestarts = None,
    resume: Resume = None,
    config: ConfigFile = None,
    print_config: PrintConfig = False,
) -> None:
    """The flags of ``crf launch`` that are not run-option declarations (a signature only)."""


def _run_option_parameter(declared: Option) -> inspect.Parameter:
    """``crf launch``'s parameter for a run option, from its declaration on RunSpec: a list
    option is a repeatable flag (``--reward a --reward b``), a mapping a repeatable
    ``KEY=VALUE`` flag (``--env A=1 --env B=2``, parsed in launch by _repeatable_values)."""
    kind: Any = declared.cli_type or declared.type
    default = declared.default
    metavar = None
    if declared.cli_type is None and declared.base is list:
        item = _item_type(declared)
        kind, metavar = list[item] | None, "TEXT" if item is str else item.__name__.upper()
        default = None if default is None else list(default)
    elif declared.cli_type is None and declared.base is dict:
        kind, default, metavar = list[str] | None, None, "KEY=VALUE"
    elif default is None:  # unset: the driver decides (a new run id, python -m crf.replica)
        kind = kind | None
    names = (declared.flag, *declared.short)
    if declared.base is bool:  # keeps --no-<flag>
        names = (f"{declared.flag}/--no-{declared.flag.removeprefix('--')}",)
    info = typer.Option(*names, help=declared.help, rich_help_panel=declared.group,
                        metavar=metavar)  # fmt: skip
    return inspect.Parameter(
        declared.name, inspect.Parameter.KEYWORD_ONLY, default=default,
        annotation=Annotated[kind, info],
    )  # fmt: skip


def _item_type(declared: Option) -> Any:
    """The item type of a list option (``list[str] | None`` -> str)."""
    for arm in (declared.type, *typing.get_args(declared.type)):
        if typing.get_origin(arm) is list and typing.get_args(arm):
            return typing.get_args(arm)[0]
    return str


def _repeatable_values(
    ctx: typer.Context, options: dict[str, Any], declarations: Iterable[Option] | None = None
) -> None:
    """The values of the list and mapping options as RunSpec takes them: a mapping's
    ``KEY=VALUE`` items parsed; one not given takes its declared default."""
    for declared in run_options().values() if declarations is None else declarations:
        if not declared.cli or declared.cli_type is not None or declared.base not in (list, dict):
            continue
        name = declared.name
        if not _given(ctx, name):
            options[name] = copy.deepcopy(declared.default)
        elif declared.base is dict:
            options[name] = parse_pairs(options[name], declared.flag or name)
        else:
            options[name] = list(options[name])


def _launch_signature() -> inspect.Signature:
    """ctx, one parameter per run option with a flag, then the other launch flags."""
    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            annotation=typer.Context)  # fmt: skip
    options = [_run_option_parameter(o) for o in run_options().values() if o.cli]
    flags = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(_launch_flags, eval_str=True).parameters.values()
    ]
    return inspect.Signature([ctx, *options, *flags])


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set this option (by name: typer may carry its own click's enum)."""
    source = ctx.get_parameter_source(name)
    return source is not None and getattr(source, "name", "") not in ("DEFAULT", "DEFAULT_MAP")


def _flag(param: Any) -> str:
    return max(param.opts, key=len)


def launch(ctx: typer.Context, **params: Any) -> None:
    """Launch N replicas, show their progress, and print a summary when they finish."""
    from crf.launcher.driver import RestartPolicy, prepare, prepare_resume, run
    from crf.launcher.errors import LaunchError
    from crf.spec import SpecError, check_seconds
    from crf.store.errors import StoreError

    flags = {name: params.pop(name) for name in inspect.signature(_launch_flags).parameters}
    options = params  # what is left: the run options, by RunSpec field name
    _repeatable_values(ctx, options)
    cfg = _apply_config(ctx, options, flags)
    options["job_config"] = cfg.job_config | parse_sets(flags["job_config"])
    _check_entrypoint_sets(ctx, options, cfg)
    timeout, resume = flags["timeout"], flags["resume"]
    if flags["strict"] and not flags["dry_run"]:
        _fail("--strict only applies to --dry-run (a launch already stops at what is missing)")
    if timeout is not None:
        try:
            check_seconds("--timeout", timeout)
        except SpecError as e:
            _fail(str(e))
    if flags["print_config"]:
        _print_config(options, flags, _backend_options(options["backend"], flags, cfg, None))
    backend_options = (
        None
        if resume is not None and not (_backend_flags(flags) or cfg.backend_options)
        else _backend_options(options["backend"], flags, cfg, timeout)
    )
    policy = RestartPolicy(flags["max_restarts"], flags["max_run_restarts"])
    try:
        if resume is not None:
            _refuse_run_defining(ctx, cfg, flags["config"])
            chosen = _given(ctx, "backend") or "backend" in cfg.options
            plan = prepare_resume(
                resume,
                store=flags["store"],
                backend=options["backend"] if chosen else None,
                max_restarts=policy.max_restarts,
                max_run_restarts=policy.max_run_restarts,
                backend_options=backend_options,
                changes={n: options[n] for n in AT_RESUME if _given(ctx, n) or n in cfg.options},
            )
        else:
            # reading a big local split or a Hub dataset's first rows takes a while: a
            # spinner on a terminal (nothing elsewhere)
            try:
                with Console(stderr=True).status("checking the data, model and rewards"):
                    plan = prepare(options, store=flags["store"], backend_options=backend_options,
                                   restart=policy, dry_run=flags["dry_run"])  # fmt: skip
            except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) during the checks
                typer.echo("interrupted before launch: nothing was started", err=True)
                raise typer.Exit(EXIT_INTERRUPTED) from None
        if flags["dry_run"]:
            _print_plan(plan)
            raise typer.Exit(EXIT_USAGE if flags["strict"] and plan.missing else EXIT_OK)
        summary = run(plan, progress=not flags["no_progress"], timeout_s=timeout,
                      detach=flags["detach"])  # fmt: skip
    except LaunchError as e:
        _fail(str(e))
    except StoreError as e:  # after launch: the replicas fail on it too (exit 1, not 2)
        _fail(f"the run's store failed: {e}", EXIT_FAILED)
    raise typer.Exit(_exit_code(summary))


def _check_entrypoint_sets(ctx: typer.Context, options: dict[str, Any], cfg: Any) -> None:
    """``--set`` with an ``--entrypoint`` and no ``--job``: one line saying how to pass
    arguments to the command instead (crf.launcher.plan.check_entrypoint_options)."""
    from crf.launcher.errors import LaunchError
    from crf.launcher.plan import check_entrypoint_options

    named = _given(ctx, "job") or "job" in cfg.options
    try:
        check_entrypoint_options(options["entrypoint"], options["job_config"], job_named=named)
    except LaunchError as e:
        _fail(str(e))


#: the launch flags a config file may set (crf.launcher.config_file.LAUNCH_KEYS)
_FILE_FLAGS = ("store", "max_restarts", "max_run_restarts", "timeout")


def _apply_config(ctx: typer.Context, options: dict[str, Any], flags: dict[str, Any]) -> Any:
    """Fill in from ``-c FILE`` every option and launch flag not given on the command line;
    a mapping option (``--env``) given in both is merged key by key, the flag's keys winning
    ([job] and [backend] are merged the same way by the caller)."""
    from crf.launcher.config_file import ConfigError, LaunchConfig, check_job_keys, load_config

    if flags["config"] is None:
        return LaunchConfig({}, {}, {}, {})
    try:
        cfg = load_config(flags["config"])
    except ConfigError as e:
        _fail(str(e))
    for name, value in cfg.options.items():
        if not _given(ctx, name):
            options[name] = value
        elif isinstance(value, dict) and isinstance(options[name], dict):
            options[name] = value | options[name]  # KEY=VALUE flags: key by key, as [job]
    for name, value in cfg.launch_flags.items():
        if not _given(ctx, name):
            flags[name] = value
    try:
        check_job_keys(options["job"], cfg.job_config, flags["config"])
    except ConfigError as e:
        _fail(str(e))
    return cfg


def _print_config(options: dict[str, Any], flags: dict[str, Any], backend: dict) -> NoReturn:
    """``--print-config``: the resolved options, checked as for a launch, as TOML; nothing is
    launched or written."""
    from crf.launcher.config_file import dump_config, settings_comment
    from crf.launcher.errors import LaunchError
    from crf.launcher.plan import (
        DEFAULT_STORE,
        RestartPolicy,
        checked_spec,
        job_settings,
        store_base,
        trl_config_name,
    )
    from crf.launcher.user_env import check_plain_env
    from crf.launcher.workers import check_worker_hardware, split_options

    if flags["resume"] is not None:
        _fail("--print-config cannot be combined with --resume (the run's options are in its "
              "run.json)")  # fmt: skip
    try:
        RestartPolicy(flags["max_restarts"], flags["max_run_restarts"]).validate()
        spec = checked_spec(options)
        check_worker_hardware(spec, split_options(spec.backend, backend)[1])
        knobs, trl = job_settings(spec)
        store_base(flags["store"])  # a typo or credentials in --store: refused, not printed
        check_plain_env(spec)  # a credential in --env: refused, not printed
    except LaunchError as e:
        _fail(str(e))
    resolved = {n: options.get(n, o.default) for n, o in run_options().items()}
    resolved.pop("job_config")
    launch_flags = {name: flags[name] for name in _FILE_FLAGS}
    launch_flags["store"] = launch_flags["store"] or DEFAULT_STORE
    text = dump_config(resolved, backend, spec.job_config, launch_flags)
    typer.echo(text + settings_comment(knobs, trl, trl_config_name(spec)), nl=False)
    raise typer.Exit(EXIT_OK)


launch.__signature__ = _launch_signature()  # type: ignore[attr-defined]
app.command()(launch)


def _refuse_run_defining(ctx: typer.Context, cfg: Any, path: str | None) -> None:
    """Options that define a run are fixed in its run.json: refused with --resume, rather
    than silently ignored (given as flags or in the config file)."""
    fixed = [_flag(p) for p in ctx.command.params if p.name in RUN_DEFINING and _given(ctx, p.name)]
    if fixed:
        _fail(
            f"{', '.join(fixed)} cannot be combined with --resume: a resumed run keeps the "
            "options in its run.json"
        )
    in_file = [n for n in RUN_DEFINING if n in cfg.options] + (["[job]"] if cfg.job_config else [])
    if in_file:
        _fail(
            f"config file {path} sets {', '.join(in_file)}, which cannot be combined with "
            "--resume: a resumed run keeps the options in its run.json"
        )


def _backend_flags(flags: dict[str, Any]) -> list[Any]:
    names = ("hardware", "rollout_hardware", "image", "region", "opt")
    return [flags[name] for name in names if flags[name]]


def _backend_options(
    backend: str, flags: dict[str, Any], cfg: Any, timeout: float | None
) -> dict[str, Any]:
    """The executor's constructor options: the config file's [backend] table, then ``-o
    KEY=VALUE``, then the generic flags (--hardware, --image, --region), each overriding the
    one before key by key; with ``timeout``, the platform's own limit past it."""
    from crf.executors.base import ExecutorError
    from crf.executors.registry import executor_class, option_names
    from crf.launcher.config_file import ConfigError, resolve_backend

    try:
        cls = executor_class(backend)
        out = resolve_backend(backend, cfg.backend_options, flags["config"] or "")
    except (ExecutorError, ConfigError) as e:
        _fail(str(e))
    known = option_names(cls)
    out |= parse_pairs(flags["opt"], "--opt")
    out = {key.replace("-", "_"): value for key, value in out.items()}
    hw_name = getattr(cls, "hardware_option", None)
    for flag, name, value in (
        ("--hardware", hw_name, flags["hardware"]),
        ("--rollout-hardware", hw_name and f"rollout_{hw_name}", flags["rollout_hardware"]),
        ("--image", "image", flags["image"]),
        ("--region", "region", flags["region"]),
    ):
        if value is None:
            continue
        if name is None or name.removeprefix("rollout_") not in known:
            _fail(
                f"the {backend} backend has no {flag} option; its options are: {', '.join(known)}"
            )
        out[name] = value
    if timeout is not None and "timeout_s" in known and "timeout_s" not in out:
        out["timeout_s"] = timeout + 600  # the platform's limit is a safety net past --timeout
    return out


def _print_plan(plan: Any) -> None:
    """``--dry-run``: the plan, its price and what is missing (crf.launcher.plan_view)."""
    from crf.launcher.plan_view import print_plan

    print_plan(plan)


StoreOpt = Annotated[
    str | None,
    typer.Option(help="Base folder/URI the run lives in (as for crf launch). Default: ./crf-runs"),
]


JsonOut = Annotated[
    bool, typer.Option("--json", help="Print JSON on stdout (and nothing else) for scripts.")
]
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="Run id.")]


def _print_json(data: Any) -> None:
    from crf import jsonsafe

    typer.echo(jsonsafe.dumps(data, indent=1))


@app.command()
def runs(
    store: StoreOpt = None,
    status: Annotated[
        list[str] | None,
        typer.Option("--status", help="Only runs with this status (repeatable): ok, failed, "
                     "cancelled, starting (replicas not yet beating), running, stopped, "
                     "unknown (cloud replicas that never beat: crf status RUN asks the "
                     "backend), damaged (its run.json cannot be read)."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="At most this many runs, newest first.")
    ] = None,
    json_out: JsonOut = False,
) -> None:  # fmt: skip
    """List the runs in a store, newest first: id, backend, job, replicas, rounds, when,
    status."""
    import datetime

    from rich.table import Table

    from crf.launcher.attach import RUN_STATUSES, list_runs
    from crf.launcher.errors import LaunchError

    unknown = sorted(set(status or ()) - set(RUN_STATUSES))
    if unknown:
        _fail(f"unknown --status {', '.join(unknown)} (one of: {', '.join(RUN_STATUSES)})")
    try:
        rows = list_runs(store, status=status, limit=limit)
    except LaunchError as e:  # a blank --store, a typo, credentials in it: said, not repeated
        _fail(str(e))
    except Exception as e:
        _fail(f"cannot list runs in {store or './crf-runs'}: {e} (check --store)")
    if json_out:
        _print_json(rows)
        return
    console = Console()
    if not rows:
        where = escape(store or "./crf-runs")
        if status:
            console.print(f"no {' or '.join(status)} runs in {where}")
        else:
            console.print(f"no runs in {where}")
        return
    table = Table(title=f"runs in {store or './crf-runs'}")
    for col in ("run", "backend", "job", "replicas", "rounds", "created", "status"):
        table.add_column(col, overflow="fold")
    colors = {"ok": "green", "failed": "red", "running": "cyan", "starting": "cyan",
              "cancelled": "yellow", "unknown": "yellow", "damaged": "red"}  # fmt: skip
    for r in rows:
        when = r["created_at"]
        created = "-" if when is None else datetime.datetime.fromtimestamp(when).strftime(
            "%Y-%m-%d %H:%M"
        )  # fmt: skip
        color = colors.get(r["status"], "white")
        cells = [r["backend"], r["job"], r["replicas"], r["rounds"]]
        table.add_row(
            escape(r["run_id"]), *("-" if c is None else escape(str(c)) for c in cells),
            created, f"[{color}]{escape(r['status'])}[/]",
        )  # fmt: skip
    console.print(table)
    for r in rows:  # why each damaged run cannot be read (crf status RUN says the same)
        if r["status"] == "damaged":
            console.print(f"[red]damaged[/] {escape(r['run_id'])}: {escape(r['error'])}",
                          soft_wrap=True, highlight=False)  # fmt: skip
    where = f" --store {store}" if store else ""
    for r in rows:  # what crf runs cannot know without asking the backend
        if r["status"] == "unknown":
            ask = f"crf status {r['run_id']}{where}"
            console.print(f"[yellow]unknown[/] {escape(r['run_id'])}: {escape(r['note'])}; "
                          f"ask it with [bold]{escape(ask)}[/]", soft_wrap=True,
                          highlight=False)  # fmt: skip


def _progress_of(run_: Any, width: int = 80) -> Any:
    """The live table of an attached run, as crf launch shows it; an ended run's time is
    its summary's wall time (before the summary is written: until its replicas' last
    heartbeat, as a gather will count it), not the time until now."""
    from crf.launcher.attach import last_beat
    from crf.launcher.progress import ReplicaView, render_progress

    spec = run_.spec
    started = float(run_.launch_record.get("started_at") or spec.created_at)
    views = [ReplicaView(h.rank, st, beat, st.restarts) for h, st, beat in run_.statuses()]
    now = time.time()
    if views and all(v.status.terminal for v in views):  # how long it ran, not since when
        ended = (run_.result() or {}).get("ended_at")
        ended = ended if isinstance(ended, int | float) else None
        now = ended or last_beat((v.heartbeat for v in views), started) or now
    return render_progress(views, run_id=spec.run_id, rounds=spec.rounds, width=width,
                           sync_every=spec.sync_every, elapsed_s=now - started)  # fmt: skip


def _watch(run_: Any, console: Console, interval: float) -> None:
    """Redraw the table every ``interval`` s until every replica has ended: in place on a
    terminal, else (a pipe, a CI log) one plain line per replica per round and per event,
    as crf launch prints them."""
    from rich.live import Live

    from crf.launcher.progress import PlainReporter, ReplicaView, round_records

    def ended() -> bool:
        return all(st.terminal for _, st, _ in run_.statuses())

    if console.is_terminal:
        with Live(_progress_of(run_, console.width), console=console, auto_refresh=False) as live:
            while not ended():
                time.sleep(interval)
                live.update(_progress_of(run_, console.width), refresh=True)
        return
    reporter = PlainReporter(console, run_.spec.rounds, round_records(run_.store), None)
    while True:
        rows = run_.statuses()
        reporter.update([ReplicaView(h.rank, st, beat, st.restarts) for h, st, beat in rows])
        if all(st.terminal for _, st, _ in rows):
            return
        time.sleep(interval)


def _print_workers(run_: Any, console: Console) -> None:
    """The rollout workers' table under the replicas' (nothing for a run without)."""
    rows = run_.worker_rows()
    if rows:
        from crf.launcher.rollout_view import print_failures, trainers_table, workers_table

        console.print(workers_table(rows, console.width))
        print_failures(rows, console)
        console.print(trainers_table(run_.trainer_rollouts(), console.width))


@app.command()
def status(
    run_id: RunArg,
    store: StoreOpt = None,
    json_out: JsonOut = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Keep the table live until the run ends.")
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.2, help="Seconds between two redraws with --watch.")
    ] = 2.0,
) -> None:
    """Show a run's replicas as its backend and heartbeats see them; a detached run whose
    replicas have all ended gets its summary (result.json) here."""
    with _user_errors():
        _status(run_id, store, json_out, watch, interval)


def _status(run_id: str, store: str | None, json_out: bool, watch: bool, interval: float) -> None:
    """``crf status``'s body (its errors are mapped by the caller)."""
    from crf.launcher.attach import attach, gather, status_record

    run_ = attach(run_id, store)
    console = Console(stderr=json_out)  # --json: stdout carries the JSON alone
    try:
        if watch and not json_out:
            _watch(run_, console, interval)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    rows = run_.statuses()
    if not json_out and not watch:
        console.print(_progress_of(run_, console.width))
        if run_.result() is None:  # else the summary below shows them
            _print_workers(run_, console)
    result = run_.result()
    if result is None and all(st.terminal for _, st, _ in rows):
        result = gather(run_, report=not json_out, console=console)
    elif result is not None and not json_out:
        from crf.launcher.summary import render_summary

        render_summary(result, console, result_path=result.get("result_path"),
                       plot_path=result.get("figure"))  # fmt: skip
    if json_out:
        _print_json(status_record(run_))
    if result is None:
        if not json_out:
            from crf.launcher.attach import unended_status

            now = unended_status(run_, True)  # some replica has not ended: no summary yet
            console.print(f"[cyan]{now}[/] (launch {run_.launch_no} on {run_.spec.backend})")
        raise typer.Exit(EXIT_OK)
    raise typer.Exit(_exit_code(result))


@app.command()
def logs(
    run_id: RunArg,
    store: StoreOpt = None,
    rank: Annotated[
        int | None,
        typer.Option(help="Only this replica (with --role rollout: this worker; default: all)."),
    ] = None,
    role: Annotated[
        str,
        typer.Option(
            "--role",
            help="Whose logs: trainer (the replicas) or rollout (the rollout workers).",
        ),
    ] = "trainer",
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the replicas end.")
    ] = False,
    tail: Annotated[
        int | None,
        typer.Option("--tail", "-n", min=0, help="Only the last N lines of each replica "
                     "(then new ones, with --follow)."),
    ] = None,
) -> None:  # fmt: skip
    """Print a run's replica logs (prefixed with the rank when showing several; a rollout
    worker's with w and its index)."""
    from crf.launcher.attach import attach, follow_logs

    if role not in ("trainer", "rollout"):
        _fail(f"--role {role!r} is unknown; choose trainer or rollout")
    try:
        with _user_errors():
            run_ = attach(run_id, store)
            several = len(run_.workers if role == "rollout" else run_.handles) > 1
            prefix = rank is None and several
            mark = "w" if role == "rollout" else ""
            for r, line in follow_logs(run_, rank, follow, tail, role=role):
                typer.echo(f"[{mark}{r}] {line}" if prefix else line)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


@app.command()
def rm(
    run_id: RunArg,
    store: StoreOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete a run's objects from the store (refused while any replica may still run)."""
    from crf.launcher.attach import remove_run, run_store

    with _user_errors("cannot delete"):
        where = run_store(run_id, store).root
        if not yes and not _confirm(f"delete run {run_id} ({where}) and all its objects?"):
            raise typer.Exit(EXIT_USAGE)
        count, size = remove_run(run_id, store)
    from crf.launcher.summary import fmt_bytes

    Console().print(f"deleted run {escape(run_id)}: {count} object(s), {fmt_bytes(size)}")


@app.command()
def cancel(
    run_id: RunArg,
    store: StoreOpt = None,
) -> None:
    """Stop every replica of a run (from any machine that can reach its store and backend),
    then write its summary."""
    from crf.launcher.attach import attach, cancel_run, gather

    with _user_errors():
        run_ = attach(run_id, store)
        live = cancel_run(run_)
        console = Console()
        console.print(f"cancelled {len(live)} running replica(s) of run {escape(run_id)}")
        if run_.result() is None:
            summary = gather(run_, report=False, console=console, cancelled=bool(live),
                             cancelled_ranks=[h.rank for h in live])  # fmt: skip
            if summary.get("result_path") is None:  # the store refused it: say why, exit 1
                _fail(str(summary.get("error")), EXIT_FAILED)
            console.print(f"summary written: {escape(str(summary['result_path']))}")


@app.command()
def export(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="Run id.")],
    dest: Annotated[
        str,
        typer.Argument(
            metavar="DEST",
            help="A folder (created if needed), or hf://ORG/NAME: a Hub model repo "
            "(created private if needed; token from HF_TOKEN).",
        ),
    ],
    store: StoreOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Write into a folder that is not empty (same-named files replaced)."
        ),
    ] = False,
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="A LoRA run: fold the adapter into its base model and export one plain model "
            "(in the base's dtype) instead of the adapter. Needs peft.",
        ),
    ] = False,
    base_model: Annotated[
        str | None,
        typer.Option(
            "--base-model",
            metavar="MODEL",
            help="With --merge: the base model (folder or Hub id). Default: the run's --model.",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Write the weights in float16 or bfloat16 (or float32). Default: as the run "
            "saved them, its fp32 master weights (with --merge: in the base's dtype).",
        ),
    ] = None,
) -> None:
    """Copy the trained model (the run's model/, Hugging Face format, written when the run
    finished) to a folder, or push it to a Hub repo."""
    from crf.launcher.export import export as export_model

    console = Console(stderr=True)
    with _user_errors("cannot export"), console.status("exporting", spinner="dots") as shown:
        done = export_model(
            run_id, dest, store=store, force=force, merge=merge, base_model=base_model,
            dtype=dtype, step=lambda text: shown.update(escape(text)),
        )  # fmt: skip
    Console().print(
        f"exported {len(done.files)} file(s) of run {escape(run_id)} to {escape(done.dest)}"
    )
    if done.note:
        Console().print(f"note: {escape(done.note)}", soft_wrap=True, highlight=False)


@app.command()
def plot(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="Run id.")],
    store: StoreOpt = None,
    out: Annotated[
        str | None,
        typer.Option("--out", "-o", metavar="FILE",
                     help="Write the figure here instead of the run folder's figure.png; its "
                     "suffix is the format: .png, .jpg, .pdf or .svg (its folder must exist)."),
    ] = None,
) -> None:  # fmt: skip
    """Redraw a run's figure (figure.png) from its store: a finished run or one still
    running, on any backend (only the store is read)."""
    from pathlib import Path

    from crf import layout
    from crf.launcher.attach import run_store
    from crf.launcher.figure import (
        draw_figure,
        figure_format,
        figure_job,
        figure_title,
        read_metrics,
    )
    from crf.launcher.plan import display_path, read_run_spec

    with _user_errors("--out" if out else ""):
        fmt = figure_format(out) if out else "png"  # before anything is read or written
        st = run_store(run_id, store)
        spec = read_run_spec(st)
        image = draw_figure(read_metrics(st, spec.replicas), job=figure_job(spec),
                            title=figure_title(spec), fmt=fmt)  # fmt: skip
        if image is None:
            _fail(_nothing_to_plot(st, run_id), EXIT_FAILED)
        if out:
            Path(out).expanduser().write_bytes(image)
            where = out
        else:
            st.put(layout.FIGURE, image)
            where = display_path(st, layout.FIGURE)
    Console().print(f"figure: {escape(where)}", soft_wrap=True, highlight=False)


def _nothing_to_plot(st: Any, run_id: str) -> str:
    """Why a run has no figure: still before its first round, or it ended (failed, was
    cancelled, stopped) before recording one, so that trying again would not help."""
    from crf.launcher.attach import run_row

    status = (run_row(st) or {}).get("status")
    if status == "running":
        return f"run {run_id} has no round recorded yet: nothing to draw (try again later)"
    return (
        f"run {run_id} ended (status: {status}) before recording any round: there is nothing "
        "to plot"
    )


def _confirm(question: str) -> bool:
    """Ask; with no answer to read (stdin closed or at its end: a script, CI) say how to
    skip the question, in one line, exit 2, instead of click's bare "Aborted!" and exit 1."""
    try:
        return typer.confirm(question)
    except typer.Abort:
        if sys.stdin is not None and sys.stdin.isatty():
            raise  # Ctrl-C at the question: click's own "Aborted!"
        typer.echo("", err=True)  # end the question's line
        _fail("no answer to read (stdin is not a terminal): nothing deleted; pass -y to "
              "delete without asking")  # fmt: skip


def _exit_code(summary: dict) -> int:
    """0 for a run that ended ok and whose summary was saved (or one left detached); a run
    whose result.json could not be written exits 1 whatever its status: scripts (and
    ``crf runs``) would otherwise find no record of the run that "succeeded"."""
    if summary["status"] == "detached":
        return EXIT_OK
    if "result_path" in summary and summary["result_path"] is None:
        return EXIT_FAILED
    if summary["status"] == "ok":
        return EXIT_OK
    return EXIT_INTERRUPTED if summary["status"] == "cancelled" else EXIT_FAILED


def main() -> None:  # pragma: no cover - `python -m crf.launcher.cli`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
