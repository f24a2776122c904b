"""The ``crf`` command line (typer + rich).

Exit codes are part of the interface, so scripts and CI can rely on them:
0 the run finished ok; 1 the run started but failed (see result.json); 2 bad input, nothing was
launched; 130 interrupted with Ctrl-C (replicas were cancelled).

``crf launch --resume RUN_ID`` continues a stopped run from its own ``run.json``; the options
that define a run (replicas, job, H, rounds, ...) are refused with it rather than silently
ignored, since the run keeps the ones it was launched with.

Bad input prints one red line that says what to fix - no traceback. Heavy modules (the store,
torch, job configs) are imported inside the commands so ``crf --help`` stays instant.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from crf.launcher.driver import DEFAULT_MAX_RESTARTS  # light: no store, no torch
from crf.spec import RunSpec

app = typer.Typer(
    name="crf",
    help="Train one model as N replicas that meet only through an object store (DiLoCo).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold credentials
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# One source of truth for defaults: the run spec.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}
REPLICAS, SYNC_EVERY, ROUNDS = _DEFAULTS["replicas"], _DEFAULTS["sync_every"], _DEFAULTS["rounds"]
OUTER_LR, OUTER_MOMENTUM = _DEFAULTS["outer_lr"], _DEFAULTS["outer_momentum"]
MIN_REPLICAS, ROUND_TIMEOUT, SEED = (
    _DEFAULTS["min_replicas"],
    _DEFAULTS["round_timeout_s"],
    _DEFAULTS["seed"],
)


def _fail(message: str) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)


def parse_sets(items: list[str] | None) -> dict[str, str]:
    """``--set lr=3e-4 --set steps=10`` -> {"lr": "3e-4", "steps": "10"} (job_config coerces)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"--set expects KEY=VALUE (got {item!r})")
        out[key.strip()] = value
    return out


@app.command()
def version() -> None:
    """Print the crf version."""
    from crf import __version__

    Console().print(f"crf {__version__}")


#: launch options that define a run: fixed in its run.json, so refused with --resume
RUN_DEFINING = (
    "wire_dtype",
    "error_feedback",
    "replicas",
    "job",
    "sync_every",
    "rounds",
    "run_id",
    "outer_lr",
    "outer_momentum",
    "min_replicas",
    "round_timeout",
    "seed",
    "set_",
    "entrypoint",
)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set this option (by name: typer may carry its own click's enum)."""
    source = ctx.get_parameter_source(name)
    return source is not None and getattr(source, "name", "") not in ("DEFAULT", "DEFAULT_MAP")


def _flag(ctx: typer.Context, name: str) -> str:
    for param in ctx.command.params:
        if param.name == name and param.opts:
            return max(param.opts, key=len)
    return "--" + name.replace("_", "-")


@app.command()
def launch(
    ctx: typer.Context,
    backend: Annotated[
        str,
        typer.Option(help="Where replicas run: local (modal, hf, sagemaker come later)."),
    ] = "local",
    replicas: Annotated[
        int, typer.Option("--replicas", "-n", help="Number of replicas (N).")
    ] = REPLICAS,
    job: Annotated[
        str, typer.Option(help="What each replica trains (a registered job).")
    ] = "composer",
    sync_every: Annotated[
        int, typer.Option("--sync-every", "-H", help="Inner steps between syncs (H).")
    ] = SYNC_EVERY,
    rounds: Annotated[int, typer.Option("--rounds", "-r", help="Number of outer rounds.")] = ROUNDS,
    store: Annotated[
        str | None,
        typer.Option(
            help="Base folder/URI for runs (file:///..., or a path). The run lives in "
            "<store>/<run-id>. Default: ./crf-runs"
        ),
    ] = None,
    run_id: Annotated[
        str | None, typer.Option(help="Run id (default: run-<date>-<time>-<random>).")
    ] = None,
    outer_lr: Annotated[float, typer.Option(help="Outer (Nesterov) learning rate.")] = OUTER_LR,
    outer_momentum: Annotated[
        float, typer.Option(help="Outer momentum, in [0, 1).")
    ] = OUTER_MOMENTUM,
    min_replicas: Annotated[
        int, typer.Option(help="A round may close at its deadline with at least this many.")
    ] = MIN_REPLICAS,
    round_timeout: Annotated[
        float, typer.Option(help="Seconds a replica waits for the others in one round.")
    ] = ROUND_TIMEOUT,
    seed: Annotated[int, typer.Option(help="Seed for the shared initial weights.")] = SEED,
    wire_dtype: Annotated[
        str,
        typer.Option(
            help="Pseudo-gradient wire format: float32, bfloat16, float16 or int8 "
            "(block-wise scales, ~4x fewer bytes)."
        ),
    ] = "float32",
    error_feedback: Annotated[
        bool,
        typer.Option(help="With a lossy wire format, resend what quantization dropped."),
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Job option KEY=VALUE (repeatable).", metavar="KEY=VALUE"),
    ] = None,
    entrypoint: Annotated[
        str | None,
        typer.Option(
            help="Your own replica command, e.g. 'python my_train.py' "
            "(default: python -m crf.replica)."
        ),
    ] = None,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="No live table (summary still printed).")
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(help="Cancel the replicas if the run takes longer (seconds)."),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option(help="Restart a replica that dies at most this many times (per replica)."),
    ] = DEFAULT_MAX_RESTARTS,
    max_run_restarts: Annotated[
        int | None,
        typer.Option(help="At most this many restarts in the whole run (default: no cap)."),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN_ID",
            help="Continue a stopped run (in --store) from its last committed round, "
            "with the options in its run.json.",
        ),
    ] = None,
) -> None:
    """Launch N replicas, show their progress, and print a summary when they finish."""
    from crf.launcher.driver import prepare, prepare_resume, run
    from crf.launcher.errors import LaunchError

    job_options = parse_sets(set_)
    if timeout is not None and timeout <= 0:
        _fail(f"--timeout must be > 0 seconds (got {timeout})")
    if resume is not None:
        fixed = [_flag(ctx, name) for name in RUN_DEFINING if _given(ctx, name)]
        if fixed:
            _fail(
                f"{', '.join(fixed)} cannot be combined with --resume: a resumed run keeps the "
                "options in its run.json"
            )
        try:
            plan = prepare_resume(
                resume,
                store=store,
                backend=backend if _given(ctx, "backend") else None,
                max_restarts=max_restarts,
                max_run_restarts=max_run_restarts,
            )
            summary = run(plan, progress=not no_progress, timeout_s=timeout)
        except LaunchError as e:
            _fail(str(e))
        raise typer.Exit(_exit_code(summary))
    try:
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
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            min_replicas=min_replicas,
            round_timeout_s=round_timeout,
            seed=seed,
            wire_dtype=wire_dtype,
            error_feedback=error_feedback,
            max_restarts=max_restarts,
            max_run_restarts=max_run_restarts,
        )
        summary = run(plan, progress=not no_progress, timeout_s=timeout)
    except LaunchError as e:
        _fail(str(e))
    raise typer.Exit(_exit_code(summary))


def _exit_code(summary: dict) -> int:
    if summary["status"] == "ok":
        return EXIT_OK
    return EXIT_INTERRUPTED if summary["status"] == "cancelled" else EXIT_FAILED


def main() -> None:  # pragma: no cover - `python -m crf.launcher.cli`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
