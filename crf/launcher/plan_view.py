"""What ``crf launch --dry-run`` prints: the checked plan as rows, the price, what is missing.

The plan is the last thing a user reads before paying for N containers, so it says what will
train (model, data, reward, held-out evaluation, tracker, the job's effective settings), on
what (hardware, each replica's CPU and memory, idle GPUs), and what it may cost: the hourly
price with its basis (a spot run priced at on-demand says so) and the worst case, every
replica running until the platform's timeout stops it. :func:`plan_rows` is the plain
content; :func:`print_plan` lays it out for a terminal of any width (80 columns included)
without cutting an image name or a URI in the middle of a word.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from crf.executors.base import BackendPlan
    from crf.launcher.plan import Plan
    from crf.spec import RunSpec

Rows = list[tuple[str, str]]
#: where a word too long for its column may break, strongest first (rich breaks only at
#: spaces, and folds anything longer mid-word)
_BREAKS = ("/", ":", ",", "=", "-", ".", "_")
#: the table's borders and padding around its two columns
_TABLE_CHROME = 7
_TRACKERS = {
    "none": "none (--report-to tensorboard, wandb or trackio)",
    "tensorboard": "tensorboard: event files in the run folder's tensorboard/",
    "wandb": "wandb: one run per replica, grouped by the run id",
    "trackio": "trackio: one run per replica, grouped by the run id",
}


def resume_text(plan: Plan) -> str:
    """What a resume continues from, and the limits it changes (crf/resumed_options.py)."""
    from crf.spec import run_options

    info = plan.resume
    assert info is not None
    if info.from_round is None:
        text = "starts over (the run committed no round)"
    else:
        text = f"continues from round {info.from_round}'s saved state"
    text += f", as launch {info.launch}"
    if info.previous_status:
        text += f" (the last one ended {info.previous_status})"
    declared = run_options()
    for name, value in info.changed.items():
        text += f"; {declared[name].flag} {value:g} from this launch on"
    return text


def plan_rows(plan: Plan, bp: BackendPlan | None = None) -> Rows:
    """The dry run's table as (key, value) rows, in the order they are shown (``bp``: the
    executor's ``describe`` of the plan, asked for here when not given)."""
    from crf.exchange import groups
    from crf.replica import local_ranks

    spec = plan.spec
    bp = bp or plan.executor.describe(spec.replicas, plan.command, spec.run_uri)
    rows: Rows = [
        ("backend", bp.backend),
        ("replicas", str(bp.replicas)),
        ("procs per replica", local_ranks.label(spec.procs_per_replica, spec.local_parallel)),
    ]
    if plan.resume is not None:
        rows.append(("resume", resume_text(plan)))
    idle = idle_gpus(plan)
    if idle:
        rows.append(("warning", idle))
    command = " ".join(bp.command)
    rows += [
        ("where", bp.where),
        ("image", bp.image),
        ("hardware", bp.hardware),
        ("cpu and memory", bp.resources),
        ("region", bp.region or "-"),
        ("command", command if len(command) < 200 else bp.command[0]),
        ("store", bp.store),
        ("job", f"{spec.job_label} {spec.job_config or ''}".strip()),
        *workload_rows(spec),
        *settings_rows(plan),
        ("schedule", _schedule(spec)),
        ("exchange", f"{spec.wire_dtype} wire, "
                     f"{groups.describe(bp.replicas, spec.reduce_group_size)}"),
        ("timeout", "-" if bp.timeout_s is None else f"{bp.timeout_s:.0f} s"),
        ("secrets", ", ".join(secret_names(plan, bp.secrets)) or "-"),
    ]  # fmt: skip
    if plan.workdir is not None:
        w = plan.workdir
        rows.append(("workdir", f"{spec.workdir}: {w.files} file(s), {w.size / 2**20:.1f} MB "
                                f"(by {w.how})"))  # fmt: skip
    if spec.pip:
        rows.append(("pip", " ".join(spec.pip)))
    wb = worker_plan(plan)
    rows += worker_rows(plan, wb) if wb is not None else []
    rows += cost_rows(spec, bp)
    if wb is not None:
        rows += cost_rows(spec, wb, role="worker") + both_roles_cost(spec, bp, wb)
    return rows


def worker_plan(plan: Plan) -> BackendPlan | None:
    """The executor's ``describe`` of the rollout workers (None without any)."""
    if plan.workers is None:
        return None
    return plan.workers.describe(plan.command, plan.spec.run_uri)


def worker_rows(plan: Plan, wb: BackendPlan) -> Rows:
    """The rollout workers' role: how many, whom they serve, how they meet the trainers,
    and what they run on (the hardware, price and worst case come with the cost rows)."""
    spec = plan.spec
    m, n = spec.rollout_workers, spec.replicas
    each = f"{m // n}" if m % n == 0 else f"{m // n}-{m // n + 1}"
    serve = f"worker w serves replica w % {n}" + (f", {each} each" if m > n else "")
    clip = f"[{spec.rollout_clip_min}, {spec.rollout_clip_max}]"
    if spec.rollout_clip_min is None:
        clip = f"<= {spec.rollout_clip_max}"
    return [
        ("rollout workers", f"{m} ({serve}); python -m crf.replica with CRF_ROLE=rollout"),
        ("worker where", wb.where),
        ("worker hardware", wb.hardware),
        ("worker cpu and memory", _worker_options(wb.resources)),
        ("policy", f"published every {spec.publish_every} inner step(s) on the "
                   f"{spec.rollout_wire} wire, at most {spec.max_staleness} step(s) stale"),
        ("correction", f"{spec.rollout_correction} (ratio {clip}), batches with mismatch KL "
                       f"> {spec.rollout_max_mismatch} refused; a replica waits "
                       f"{spec.rollout_wait:g} s for a batch, then generates it itself"),
    ]  # fmt: skip


def _worker_note(note: str) -> str:
    """A backend's note on its replicas as it holds for the rollout workers: a worker's job
    is named for ``w<k>`` where a replica's is for its rank (crf.executors.sagemaker)."""
    return note.replace("each replica: ", "each worker: ").replace("-r<rank>-", "-rw<worker>-")


def _worker_options(text: str) -> str:
    """A backend's text about its options (``-o cpu=N``) as the workers' own spelling of
    them (``-o rollout_cpu=N``): the replicas' options do not change the workers'."""
    import re

    return re.sub(r"-o (?!rollout_)(\w+)=", r"-o rollout_\1=", text)


def both_roles_cost(spec: RunSpec, bp: BackendPlan, wb: BackendPlan) -> Rows:
    """The run's price with its two roles together (where both are published)."""
    if spec.backend == "local" or bp.total_hourly_usd is None or wb.total_hourly_usd is None:
        return []
    total = bp.total_hourly_usd + wb.total_hourly_usd
    row = [("both roles", f"${total:.2f}/h")]
    if bp.worst_case_usd is not None and wb.worst_case_usd is not None:
        row = [("both roles", f"${total:.2f}/h, worst case "
                              f"${bp.worst_case_usd + wb.worst_case_usd:,.2f}")]  # fmt: skip
    return row


def _schedule(spec: RunSpec) -> str:
    every = spec.checkpoint_every
    tail = f", global state every {every} rounds" if every > 1 else ""
    return f"{spec.rounds} round(s) x {spec.sync_every} inner steps{tail}"


def cost_rows(spec: RunSpec, bp: BackendPlan, role: str = "replica") -> Rows:
    """The "cost" row (hourly, per replica and for the run, with its basis) and the "worst
    case" row: the hourly price of every replica times the platform's timeout. With
    ``role="worker"``, the same for the rollout workers ("worker cost", "worker worst
    case")."""
    prefix = "" if role == "replica" else f"{role} "
    if spec.backend == "local":
        return [(f"{prefix}cost", "free (this machine)")]
    if bp.hourly_usd is None or bp.total_hourly_usd is None:
        return [(f"{prefix}cost", "not published for this hardware")]
    basis = f" ({bp.price_basis})" if bp.price_basis else ""
    hourly = f"${bp.hourly_usd:.2f}/h per {role}, ${bp.total_hourly_usd:.2f}/h for {bp.replicas}"
    rows = [(f"{prefix}cost", hourly + basis)]
    worst = bp.worst_case_usd
    if worst is not None and bp.timeout_s is not None:
        label = f" ({bp.price_basis.split(';')[0]})" if bp.price_basis else ""
        rows.append((
            f"{prefix}worst case",
            f"${worst:,.2f}: {bp.replicas} {role}(s) x {_duration(bp.timeout_s)} (the "
            f"timeout that stops each one) x ${bp.hourly_usd:.2f}/h{label}",
        ))  # fmt: skip
    return rows


def _duration(seconds: float) -> str:
    """``86400`` -> "24 h", ``4200`` -> "1 h 10 min", ``90`` -> "2 min", ``30`` -> "30 s"."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    return " ".join(([f"{hours} h"] if hours else []) + ([f"{minutes} min"] if minutes else []))


def workload_rows(spec: RunSpec) -> Rows:
    """What a built-in job trains: model, dataset, reward (composer), held-out evaluation and
    tracker; none for a custom ``--entrypoint``, whose command decides all of it."""
    if spec.entrypoint:
        return []
    from crf.replica.jobs import job_config

    cfg = job_config(spec.job, spec.job_config)
    rows = [("model", _model(spec)), ("dataset", _dataset(spec, cfg))]
    if spec.reward:
        rows.append(("reward", ", ".join(spec.reward)))
    elif spec.job == "composer":
        default = "the embedded task's partial credit against the answer"
        rows.append(("reward", f"{default} (crf.composer.task.reverse_reward; --reward to choose)"))
    if spec.job != "lm":
        rows.append(("evaluation", _evaluation(spec, cfg)))
    rows.append(("tracker", _TRACKERS.get(spec.report_to, spec.report_to)))
    return rows


def _model(spec: RunSpec) -> str:
    if spec.job == "lm":
        return "the lm job's character model (embedded)"
    if not spec.model:
        base = "the job's embedded tiny model (random weights; --model to train your own)"
    else:
        base = spec.model
    extra = [f"LoRA rank {spec.lora_rank}, alpha {spec.lora_alpha}"] if spec.lora_rank else []
    extra += (
        [f"on {spec.lora_target_modules}"] if spec.lora_rank and spec.lora_target_modules else []
    )
    extra += [f"precision {spec.precision}"] if spec.precision != "auto" else []
    extra += [f"device {spec.device}"] if spec.device != "auto" else []
    extra += ["gradient checkpointing"] if spec.gradient_checkpointing else []
    extra += ["trusts the repo's code"] if spec.trust_remote_code else []
    return base + (f" ({', '.join(extra)})" if extra else "")


def _dataset(spec: RunSpec, cfg: Any) -> str:
    if spec.dataset:
        parts = [spec.dataset]
        if spec.dataset_config:
            parts.append(f"config {spec.dataset_config}")
        parts.append(f"split {spec.dataset_split}")
        if spec.columns:
            parts.append("columns " + ", ".join(f"{k}={v}" for k, v in spec.columns.items()))
        return ", ".join(parts)
    if spec.job == "lm":
        return "the lm job's synthetic corpus (embedded)"
    letters, low, high = (getattr(cfg, k, None) for k in ("letters", "min_len", "max_len"))
    if letters is None:
        return "the job's own"
    return (
        f"the embedded task: reverse strings of {low} to {high} of {letters!r}, "
        f"{cfg.num_examples} examples (--dataset to train on yours)"
    )


def _evaluation(spec: RunSpec, cfg: Any) -> str:
    from crf.replica.data import eval_source

    what = "greedy reward means and pass@1"
    if spec.job == "sft":
        what = "held-out loss" + (f", {what}" if spec.reward or not spec.dataset else "")
    source = eval_source(spec)
    if source is not None:
        dataset, config, split = source
        part = f"config {config}, " if config else ""
        return f"{dataset}, {part}split {split}: {spec.eval_examples} rows each round ({what})"
    if spec.dataset:
        return "none (--eval-split or --eval-dataset scores held-out rows each round)"
    return f"the embedded task's {spec.eval_examples} held-out prompts each round ({what})"


def settings_rows(plan: Plan) -> Rows:
    """The "job settings" (the job's knobs, defaults included) and "TRL settings" (the TRL
    config fields not at TRL's default) rows; none for a custom --entrypoint."""
    from crf.launcher.plan import job_settings, trl_config_name

    if plan.spec.entrypoint:
        return []
    knobs, trl = job_settings(plan.spec)
    out = [("job settings", ", ".join(f"{k}={v!r}" for k, v in knobs.items()))]
    if trl:
        name = trl_config_name(plan.spec)
        out.append(("TRL settings", ", ".join(f"{k}={v!r}" for k, v in trl.items())
                    + f" (every other {name} field: TRL's default)"))  # fmt: skip
    return out


def secret_names(plan: Plan, store_secrets: list[str]) -> list[str]:
    """The names of every secret the replicas get: the store's credentials and the user's
    ``--secret`` entries (names only: a value is never shown)."""
    from crf.spec import secret_name

    return [*store_secrets, *(secret_name(s) for s in plan.spec.secrets)]


def idle_gpus(plan: Plan) -> str | None:
    """The plan's warning when each replica has GPUs its local ranks leave idle (a job
    that trains on one process per replica, or a --procs-per-replica below the GPUs)."""
    from crf.replica import local_ranks
    from crf.replica.jobs import get_job

    spec = plan.spec
    gpus = plan.executor.gpus_per_replica()
    if gpus <= (spec.procs_per_replica or 1):
        return None
    try:
        can = plan.command is None and local_ranks.supports_local_ranks(get_job(spec.job))
    except (ImportError, ValueError):
        can = False
    return local_ranks.idle_gpus(gpus, spec.procs_per_replica, can)


def breakable(text: str, width: int) -> str:
    """``text`` with each word longer than ``width`` split into lines after a separator
    (``/`` first, then ``:`` ``,`` ``=``, then ``-`` ``.`` ``_``), so a long image name or URI
    breaks where it reads (rich breaks lines at spaces and would cut such a word anywhere)."""
    if width < 16:
        return text
    words = []
    for word in text.split(" "):
        pieces = []
        while len(word) > width:
            cut = _cut(word, width)
            if cut is None:
                break  # no separator: rich folds it
            pieces.append(word[:cut])
            word = word[cut:]
        words.append("\n".join([*pieces, word]))
    return " ".join(words)


def _cut(word: str, width: int) -> int | None:
    """Where to break ``word`` (after a separator, at most ``width`` in), preferring the
    strongest separator that leaves at least a third of the line filled."""
    for sep in _BREAKS:
        at = word.rfind(sep, 0, width)
        if at + 1 >= width // 3:
            return at + 1
    return None


def plan_table(rows: Rows, title: str, width: int) -> Table:
    """The rows as a two-column table for a console ``width`` columns wide."""
    table = Table(title=title, show_header=False)
    key_width = max(len(k) for k, _ in rows)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    room = width - key_width - _TABLE_CHROME
    for key, value in rows:
        table.add_row(key, escape(breakable(str(value), room)))
    return table


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """``--dry-run``: the plan's table, the backend's notes, the job's warnings, and what is
    missing before the run can launch."""
    console = console or Console()
    spec = plan.spec
    bp = plan.executor.describe(spec.replicas, plan.command, spec.run_uri)
    rows = plan_rows(plan, bp)
    console.print(plan_table(rows, f"crf launch --dry-run: run {spec.run_id}", console.width))
    for note in bp.notes:
        console.print(f"- {escape(note)}", highlight=False)
    wb = worker_plan(plan)
    for note in wb.notes if wb is not None else []:
        if note not in bp.notes:
            console.print(f"- rollout workers: {escape(_worker_note(note))}", highlight=False)
    for note in plan.notes:
        console.print(f"[bold yellow]warning:[/] {escape(note)}", highlight=False)
    print_missing(console, plan.missing)
    console.print("nothing was launched or written (--dry-run)")


def print_missing(console: Console, missing: list[str]) -> None:
    """A dry run's list of what an account or setup must provide before the run can
    launch, each line naming where it comes from (a variable, a file, a login command)."""
    if not missing:
        console.print("[green]nothing missing:[/] the backend and the store accept this "
                      "machine's credentials")  # fmt: skip
        return
    console.print(f"[bold yellow]missing[/] before this run can launch ({len(missing)}):")
    for line in missing:
        console.print(f"- {escape(line)}", highlight=False)
