"""The run spec: everything a replica needs to know, written once to ``run.json``.

The driver validates it before launching anything (bad input fails early with a message that
says what to fix); replicas read it from the store, so the environment carries only the run
URI, the rank and the world size (docs/design.md, "Replica runtime").
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import shlex
import threading
import time
import types
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crf import jsonsafe
from crf.exchange.codecs import codec_names
from crf.exchange.config import DEFAULT_SPARSE_DENSITY, DEFAULT_SPARSE_OUTER, SPARSE_OUTERS
from crf.rollouts.config import CORRECTION_MODES, RolloutConfig

SPEC_VERSION = 1
WIRE_DTYPES = codec_names()  # the built-in ones; validation asks the registry again
# matched with fullmatch: ``$`` would also match before a trailing newline ("abc\n")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: what crf.layout.workdir_key builds (checked here: run.json is read back by every process)
_WORKDIR_KEY_RE = re.compile(r"code/workdir-[0-9a-f]{16,64}\.tar\.gz")

# Bounds of the run options (declared on RunSpec's fields; RunSpec.validate checks them for
# the CLI and the SDK alike). Each bound is what something downstream accepts, so a value past
# it would only fail after launch, in every replica:
#: at most this many replicas on any backend: each one reads a slice of every other's
#: contribution, so a round costs N**2 store requests (a million at 1024)
MAX_REPLICAS = 1024
#: at most this many inner steps in a run (rounds x H): step numbers then fit in 32 bits
#: wherever they are stored, and no run of that length finishes (2**31 steps at 10 ms each
#: take 8 months; real runs stop well below 10**7)
MAX_TOTAL_STEPS = 2**31 - 1
#: seeds are in [0, 2**32): numpy's ``np.random.seed`` (which ``transformers.set_seed`` calls
#: with the replica's data seed) takes no other value; torch takes 64 bits
MAX_SEED = 2**32 - 1
#: the longest wait Python's threading and time.sleep accept (about 292 years); a longer
#: deadline raises OverflowError in the replica
MAX_WAIT_S = float(threading.TIMEOUT_MAX)
#: how long one call of a reward function may take in a replica by default (--reward-timeout):
#: a batch scored by an LLM judge over the network takes minutes, a hung call forever
REWARD_TIMEOUT_S = 600.0
#: at most this many local ranks per replica: a machine has at most 8 or 16 GPUs; more
#: CPU ranks than cores only slow it down
MAX_PROCS_PER_REPLICA = 64
#: --local-parallel: how the local ranks of a replica train (crf/replica/local_ranks.py)
LOCAL_PARALLEL = ("ddp", "fsdp")
#: training precisions and devices (crf/replica/model.py resolves ``auto``)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DEVICES = ("auto", "cuda", "cpu")
#: at most this many rollout workers: like replicas, each one polls the store for its
#: trainer's policy and writes rollout objects, so store requests grow with their number
MAX_ROLLOUT_WORKERS = MAX_REPLICAS
#: the job rollout workers generate for: GRPO's generation is what they take off the trainers
ROLLOUT_JOB = "composer"
#: where each replica reports its metrics (--report-to; crf/replica/tracking.py); each one but
#: none is a package of the optional ``tracking`` extra, imported by that name
TRACKERS = ("none", "tensorboard", "wandb", "trackio")
#: a variable that lets --report-to wandb log: its key, or a mode that needs none (offline)
WANDB_KEYS = frozenset({"WANDB_API_KEY", "WANDB_MODE"})


class SpecError(ValueError):
    """A run spec field is invalid; the message names the field and the fix."""


def check_run_id(run_id: object, what: str = "run id") -> str:
    """``run_id`` if it is a valid run id, else SpecError. A run id is one folder name under
    the store: no ``/``, no ``..``, no whitespace or control character, so neither a new run
    nor ``--resume`` / ``crf status`` / ``crf cancel`` can reach outside ``--store``."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise SpecError(
            f"{what} {run_id!r} is invalid: use letters, digits, '.', '_' or '-' "
            "(at most 128, starting with a letter or digit)"
        )
    return run_id


def is_number(value: object) -> bool:
    """A real int or float (not a bool, not a string)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_seconds(flag: str, value: object) -> float:
    """``value`` as seconds if it is a finite number in (0, MAX_WAIT_S], else SpecError:
    ``nan`` compares false with everything, so a plain ``> 0`` check lets it through."""
    if not is_number(value) or not math.isfinite(value) or not 0 < value <= MAX_WAIT_S:
        raise SpecError(
            f"{flag} must be > 0 seconds, a finite number at most {MAX_WAIT_S:.0f} (got {value!r})"
        )
    return float(value)


def coerce_text(text: Any, like: Any, what: str) -> Any:
    """A command-line string (``--set lr=3e-4``, ``--backend-opt gpu=A10G``) as the type of
    ``like`` (the option's default: bool, int, float); anything else is returned as given.
    ValueError names ``what`` and the value."""
    if not isinstance(text, str) or like is None or isinstance(like, str):
        return text
    try:
        if isinstance(like, bool):
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(like, int | float):
            return type(like)(text)
    except ValueError:
        kind = "true/false" if isinstance(like, bool) else f"a valid {type(like).__name__}"
        raise ValueError(f"{what}={text!r} is not {kind}") from None
    return text


#: an environment variable's name, as every platform (and POSIX) accepts it
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: the prefix of the variables crf sets itself (the replica contract, CRF_SECRET_NAMES, ...)
RESERVED_ENV_PREFIX = "CRF_"


def secret_name(entry: str) -> str:
    """The variable a ``--secret`` entry sets: ``KEY`` or the KEY of ``KEY=@path``."""
    return entry.split("=", 1)[0]


def check_env_names(env: object, secrets: object, *, env_flag: str = "--env") -> None:
    """SpecError for an ``--env`` or ``--secret`` entry a replica cannot be given: a name
    that is no variable name, one of crf's own ``CRF_*`` variables, a value that is not a
    string, a secret given as ``KEY=value`` (a value on a command line is no secret), or a
    name given twice. ``env_flag`` names the mapping in a message (the SDK's
    ``secret_values`` follow the same rules as ``--env``)."""
    if not isinstance(env, dict) or not isinstance(secrets, list):
        return  # the declared type check has said so already
    seen: set[str] = set()
    for flag, name, value in [(env_flag, k, v) for k, v in env.items()] + [
        ("--secret", secret_name(str(e)), e) for e in secrets
    ]:
        if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
            raise SpecError(f"{flag} {name!r}: not a variable name (letters, digits, '_')")
        if name.startswith(RESERVED_ENV_PREFIX):
            raise SpecError(f"{flag} {name}: CRF_* variables are crf's own; use another name")
        if not isinstance(value, str):
            got = type(value).__name__  # not the value: it may be a secret's
            raise SpecError(
                f"{flag} {name}: the value must be a string (got a value of type {got})"
            )
        if flag == "--secret" and "=" in value and not value.split("=", 1)[1].startswith("@"):
            raise SpecError(
                f"--secret {name}: give the name only (its value is read from this "
                f"environment) or {name}=@path to read it from a file, never the value"
            )
        if name in seen:
            raise SpecError(f"{flag} {name}: {name} is given twice (in --env or --secret)")
        seen.add(name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


# ---------------------------------------------------------------------- run options
#: help panels of ``crf launch --help``, in the order they are shown
RUN, DILOCO, WIRE, BACKEND = "Run", "DiLoCo", "Streaming and wire format", "Backend"
WORKLOAD = "Model, data and reward"
ROLLOUT = "Rollout workers"


@dataclass(frozen=True)
class Option:
    """One run option, declared once on its RunSpec field with :func:`option`: its help, its
    command-line flag, its default, its range and whether it defines the run. The CLI builds
    ``crf launch``'s flags from these, the driver takes them as launch options, and
    ``RunSpec.validate`` checks their ranges (docs/extending.md, "Add a run option")."""

    help: str
    #: the long flag; None: ``--`` and the field's name with dashes
    flag: str | None = None
    #: its other names on the command line (``-H``)
    short: tuple[str, ...] = ()
    #: False: no flag made from this declaration: set from Python (``crf.launch``) only, or
    #: through a flag the CLI declares itself (``--set KEY=VALUE`` fills job_config)
    cli: bool = True
    #: fixed in run.json, so refused with ``crf launch --resume``
    run_defining: bool = True
    #: a limit on waiting that a resume may change (``crf launch --resume RUN
    #: --reward-timeout 1800``; not ``run_defining`` then): kept in the launch's record, never
    #: in run.json, and read by every replica and worker of that launch and the ones after
    #: (crf/resumed_options.py)
    at_resume: bool = False
    #: the range of a number: ``low`` <= value <= ``high`` (strict with ``open_low`` /
    #: ``open_high``); a str ``high`` names another option (min_replicas <= replicas)
    low: float | None = None
    high: float | str | None = None
    open_low: bool = False
    open_high: bool = False
    #: the values a string may take (a callable: asked at validation time, e.g. the wire
    #: codecs registered so far)
    choices: tuple[str, ...] | Callable[[], Sequence[str]] = ()
    #: a wait in seconds: finite, > 0 and at most MAX_WAIT_S (see check_seconds)
    seconds: bool = False
    #: the rule in words where the generated one ("an integer >= 1 ...") would read worse
    must: str | None = None
    #: said after the rule: what the bound protects
    why: str = ""
    #: the ``crf launch --help`` panel it is shown in
    group: str = RUN
    #: its type on the command line where that differs from the field's (entrypoint: a string)
    cli_type: Any = None
    # filled in by run_options() from the field
    name: str = ""
    type: Any = None
    default: Any = None
    #: no default: the driver fills it in (run_id)
    required: bool = False

    @property
    def label(self) -> str:
        """How error messages name it: the flag a user typed, else the field's name."""
        return self.flag if self.cli and self.flag else self.name

    @property
    def base(self) -> type:
        """The field's type without ``| None`` (int, float, bool, str, dict or list)."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        if typing.get_origin(self.type) in (types.UnionType, typing.Union):
            return _base(args[0])
        return _base(self.type)

    def check(self, spec: RunSpec) -> None:
        """SpecError if ``spec``'s value of this option is of the wrong type or out of range."""
        value = getattr(spec, self.name)
        if value is None and self.default is None and not self.required:
            return
        if self.seconds:
            check_seconds(self.label, value)
        elif self.choices:
            choices = self.choices() if callable(self.choices) else self.choices
            if value not in choices:
                raise SpecError(
                    f"{self.label} {value!r} is unknown; choose one of {', '.join(choices)}"
                )
        elif self.base in (int, float):
            if not self._in_range(value, spec):
                rule = self.must or self._rule(spec)
                why = f": {self.why}" if self.why else ""
                raise SpecError(f"{self.label} must be {rule} (got {value!r}){why}")
        elif not isinstance(value, self.base) or (
            self.base is list and not all(isinstance(a, str) for a in value)
        ):
            kind = _KINDS[self.base]
            if self.name == "env":  # its values may be credentials: never quoted
                raise SpecError(
                    f"env must be a mapping of variable names to values (got a "
                    f'{type(value).__name__}); in a config file: env = {{NAME = "value"}}'
                )
            raise SpecError(f"{self.name} must be {kind} (got {value!r})")

    def _high(self, spec: RunSpec) -> Any:
        return getattr(spec, self.high) if isinstance(self.high, str) else self.high

    def _in_range(self, value: Any, spec: RunSpec) -> bool:
        if self.base is int and not _is_int(value):
            return False
        if not is_number(value) or not math.isfinite(value):
            return False
        low, high = self.low, self._high(spec)
        if low is not None and (value <= low if self.open_low else value < low):
            return False
        return high is None or (value < high if self.open_high else value <= high)

    def _rule(self, spec: RunSpec) -> str:
        low, high = self.low, self.high
        if isinstance(high, str):
            rule = f"between {low} and {run_options()[high].label}={getattr(spec, high)}"
        elif self.base is int:
            rule = f"an integer >= {low}" + (f" and at most {high}" if high is not None else "")
        elif high is not None:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            rule = f"in {left}{low}, {high}{right}"
        else:
            rule = f"{'>' if self.open_low else '>='} {low} and finite"
        # a flag is either given or not: "None" is only a value to name in Python
        return f"None or {rule}" if self.default is None and self.label == self.name else rule


_KINDS = {str: "a string", dict: "a mapping", bool: "true or false", list: "a list of strings"}


def _base(annotation: Any) -> type:
    return typing.get_origin(annotation) or annotation


#: peft's choice of every linear layer but the output one: --lora-target-modules' default
LORA_ALL_LINEAR = "all-linear"


def lora_targets_problem(value: str) -> str | None:
    """Why ``--lora-target-modules`` is malformed, whatever the model (None: it is not)."""
    names = [name.strip() for name in value.split(",")]
    if not any(names):
        return (
            f"--lora-target-modules is empty: give {LORA_ALL_LINEAR} or module names separated "
            "by commas (q_proj,v_proj)"
        )
    if "" in names:
        return f"--lora-target-modules {value!r} has an empty name: separate names by one comma"
    if LORA_ALL_LINEAR in names and len(names) > 1:
        return f"--lora-target-modules {value!r}: {LORA_ALL_LINEAR} stands alone, without names"
    return None


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - the word every CLI library uses
    short: str | tuple[str, ...] = (),
    default_factory: Any = dataclasses.MISSING,
    **declared: Any,
) -> Any:
    """A RunSpec field that is a run option (see :class:`Option` for ``declared``)."""
    meta = Option(help=help, short=(short,) if isinstance(short, str) else short, **declared)
    return field(default=default, default_factory=default_factory, metadata={"option": meta})


@functools.cache
def run_options() -> dict[str, Option]:
    """Every run option of RunSpec by field name, in declaration order."""
    hints = typing.get_type_hints(RunSpec)
    out = {}
    for f in dataclasses.fields(RunSpec):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        default, required = f.default, False
        if default is dataclasses.MISSING:
            has_factory = f.default_factory is not dataclasses.MISSING
            default, required = (f.default_factory(), False) if has_factory else (None, True)
        flag = meta.flag or "--" + f.name.replace("_", "-")
        out[f.name] = dataclasses.replace(
            meta, name=f.name, type=hints[f.name], default=default, required=required, flag=flag
        )
    return out


@dataclass
class RunSpec:
    """One training run: N replicas, H inner steps per round, R rounds.

    Every field a user sets is declared with :func:`option` (help, flag, default, range,
    whether it defines the run); the rest (``run_uri``, ``backend_options``, ``created_at``,
    ``version``) the driver fills in.
    """

    run_id: str = option(help="Run id (default: run-<date>-<time>-<random>).")
    run_uri: str
    job: str = option(
        "composer",
        help="What each replica trains: a built-in job (lm, composer, sft) or a job "
        "module's path (mypkg.myjob).",
    )
    job_config: dict[str, Any] = option(  # on the command line: --set KEY=VALUE, repeatable
        default_factory=dict,
        flag="--set",
        cli=False,
        help="Job option KEY=VALUE (repeatable); for the composer job, trl.FIELD=VALUE sets "
        "any field of TRL's GRPOConfig.",
    )
    entrypoint: list[str] | None = option(  # a user's own command, not `python -m crf.replica`
        None,
        cli_type=str,
        help="Your own replica command, e.g. 'python my_train.py' "
        "(default: python -m crf.replica).",
    )
    replicas: int = option(2, short="-n", low=1, high=MAX_REPLICAS, help="Number of replicas (N).")
    procs_per_replica: int | None = option(
        None,
        low=1,
        high=MAX_PROCS_PER_REPLICA,
        must=f"an integer between 1 and {MAX_PROCS_PER_REPLICA}",
        why="leave it out for the GPUs of each replica's hardware",
        help="Processes (local ranks) per replica, training data-parallel inside it (DDP "
        "under torch.distributed's launcher); only one of them exchanges through the store. "
        "Default: the GPUs of each replica's hardware (--gpu H100:2, --flavor l4x4, "
        "ml.g5.12xlarge), 1 on CPU.",
    )
    local_parallel: str = option(
        "ddp",
        choices=LOCAL_PARALLEL,
        help="How a replica's local ranks split the training: ddp (each holds the whole "
        "model; gradients averaged every step) or fsdp (FSDP2: parameters, gradients and "
        "inner-optimizer state sharded over them, for a model that does not fit one GPU).",
    )
    sync_every: int = option(  # H: inner optimizer steps between outer steps
        20, short="-H", low=1, high=MAX_TOTAL_STEPS, help="Inner steps between syncs (H)."
    )
    rounds: int = option(5, short="-r", low=1, high=MAX_TOTAL_STEPS, help="Number of outer rounds.")
    outer_lr: float = option(
        0.7, low=0, open_low=True, group=DILOCO, help="Outer (Nesterov) learning rate."
    )
    # 0.5, not the DiLoCo paper's 0.9: on bench/quality.py (8 and 40 rounds) 0.9 ends 3.9-5.7%
    # and 22.7% behind DDP, 0.5 level with it; see
    # (docs/performance.md, "Quality: DiLoCo vs DDP vs one replica")
    outer_momentum: float = option(
        0.5,
        low=0,
        high=1,
        open_high=True,
        group=DILOCO,
        help="Outer (Nesterov) momentum, in [0, 1). 0.5 suits runs of a few to tens of "
        "rounds; the DiLoCo paper's 0.9 was tuned for hundreds.",
    )
    nesterov: bool = option(
        True,
        group=DILOCO,
        help="Nesterov outer momentum (DiLoCo's choice); --no-nesterov: plain momentum.",
    )
    seed: int = option(
        0,
        low=0,
        high=MAX_SEED,
        must=f"an integer between 0 and {MAX_SEED}",
        why="numpy, which seeds each replica's data order, takes no other",
        group=DILOCO,
        help="Seed for the shared initial weights.",
    )
    min_replicas: int = option(
        1,
        low=1,
        high="replicas",
        group=DILOCO,
        help="A round may close at its deadline with at least this many.",
    )
    round_timeout_s: float = option(
        300.0,
        flag="--round-timeout",
        seconds=True,
        run_defining=False,
        at_resume=True,
        group=DILOCO,
        help="Seconds a replica waits for the others in one round.",
    )
    num_shards: int | None = option(
        None,
        low=1,
        group=WIRE,
        help="Shards the round's average is split into, each reduced by one replica "
        "(default: one per replica; with --reduce-group-size, G).",
    )
    reduce_group_size: int = option(
        0,
        low=0,
        high=MAX_REPLICAS,
        group=WIRE,
        help="Two-level reduction for many replicas: groups of G consecutive replicas sum "
        "their slices, one leader per slice adds the groups' sums; about 2G + 4 requests "
        "per replica and round (a slice's leader: N/G more) instead of 2N + 2. G near "
        "sqrt(N) pays from N = 32 (0 = one level, G >= N: one level with G shards).",
    )
    keep_rounds: int = option(
        3,
        low=1,
        group=DILOCO,
        help="Checkpoints kept in the store (global states and the replicas' inner states): "
        "the newest this many; older ones are deleted as rounds commit. A resume needs "
        "the newest.",
    )
    checkpoint_every: int = option(
        1,
        low=1,
        why="global states are written every that many rounds",
        group=DILOCO,
        help="Write the global checkpoint (weights + outer momentum, ~3x the model) every "
        "this many rounds (outer rounds: with --fragments, after the last fragment's sync), "
        "at the last round and when a replica needs one to heal; a whole-run resume "
        "restarts from the newest.",
    )
    wire_dtype: str = option(
        "float32",
        choices=codec_names,
        group=WIRE,
        help="Pseudo-gradient wire format: float32, bfloat16, float16, int8 "
        "(block-wise scales, ~4x fewer bytes) or the sparse topk2, topk4, topk8 (top-k "
        "values per chunk at 2/4/8 bits, with error feedback; at 2% density 43-60x fewer "
        "bytes up and 30-43x fewer down than float32: docs/performance.md).",
    )
    error_feedback: bool = option(
        False,
        group=WIRE,
        help="With a lossy wire format, resend what quantization dropped.",
    )
    sparse_density: float = option(
        DEFAULT_SPARSE_DENSITY,
        low=0.005,
        high=0.1,
        group=WIRE,
        why="a sparse wire keeps 0.5% to 10% of each chunk's values",
        help="A sparse wire (topk2/topk4/topk8) keeps this share of each chunk's values.",
    )
    sparse_outer: str = option(
        DEFAULT_SPARSE_OUTER,
        choices=SPARSE_OUTERS,
        group=WIRE,
        help="A sparse wire's error feedback and outer step: sparseloco (decaying error "
        "buffer, plain averaged outer step at outer_lr / (1 - outer_momentum), no outer "
        "momentum) or diloco (full residual, Nesterov outer step).",
    )
    save_inner_state: bool = option(  # each replica saves its inner optimizer (resume)
        True,
        group=DILOCO,
        help="Each replica saves its inner optimizer state with each checkpoint, so a resume "
        "continues exactly; --no-save-inner-state stores less, and a resumed replica "
        "starts a fresh inner optimizer.",
    )
    # Streaming DiLoCo (arXiv 2501.18512): the model is split into `fragments` contiguous groups
    # of parameters, synced one at a time every sync_every / fragments inner steps, each sync
    # its own exchange round; a fragment's exchange starts `fragment_sync_delay` inner steps
    # before the replica waits for it, so the transfer overlaps with training.
    fragments: int = option(
        1,
        low=1,
        high="sync_every",
        group=WIRE,
        help="Streaming DiLoCo: sync the model in this many fragments, one every "
        "H/fragments steps (1 = vanilla DiLoCo).",
    )
    fragment_sync_delay: int = option(
        0,
        low=0,
        group=WIRE,
        help="Streaming DiLoCo: inner steps a fragment's upload overlaps with training "
        "before the replica waits for it.",
    )
    model: str | None = option(
        None,
        group=WORKLOAD,
        help="The model to train: a Hugging Face Hub id (Qwen/Qwen2.5-0.5B-Instruct) or a "
        "folder saved with save_pretrained (default: the job's embedded tiny model).",
    )
    trust_remote_code: bool = option(
        False,
        group=WORKLOAD,
        help="Run the model repo's own Python code (only for a model you trust).",
    )
    precision: str = option(
        "auto",
        choices=PRECISIONS,
        group=WORKLOAD,
        help="Training precision: auto (bf16 on a CUDA GPU with bfloat16 of its own, Ampere "
        "or later; else fp32), bf16, fp16 or fp32.",
    )
    device: str = option(
        "auto",
        choices=DEVICES,
        group=WORKLOAD,
        help="Where each replica trains: auto (cuda when a GPU is present), cuda or cpu.",
    )
    gradient_checkpointing: bool = option(
        False,
        group=WORKLOAD,
        help="Recompute activations in the backward pass: less GPU memory, about a third "
        "more compute.",
    )
    lora_rank: int = option(
        0,
        low=0,
        high=4096,
        group=WORKLOAD,
        help="Train LoRA adapters of this rank (peft) instead of every weight; only the "
        "adapters are exchanged (0 = off).",
    )
    lora_alpha: int = option(
        16, low=1, high=65536, group=WORKLOAD, help="LoRA scaling numerator (alpha / rank)."
    )
    lora_target_modules: str | None = option(
        None,
        group=WORKLOAD,
        help="The modules --lora-rank adapts: all-linear (every linear layer but the output "
        "one) or module names separated by commas (in_proj,x_proj); default all-linear.",
    )
    dataset: str | None = option(
        None,
        group=WORKLOAD,
        help="Training data: a Hub dataset id, a .jsonl/.json/.parquet/.csv file by path or "
        "URL (s3://, gs://, hf://, memory://, file://...; .jsonl/.json/.csv also as .gz, .bz2, "
        ".xz or .zst), or a local folder of such files or saved with save_to_disk; default: the "
        "job's embedded task.",
    )
    dataset_config: str | None = option(
        None,
        group=WORKLOAD,
        help="The config (subset) of a Hub dataset, or of a folder whose README names several; "
        "a file or a save_to_disk folder has none.",
    )
    dataset_split: str = option("train", group=WORKLOAD, help="The dataset split to train on.")
    eval_split: str | None = option(
        None,
        group=WORKLOAD,
        help="Held-out split of the same dataset, scored each round on the global model "
        "(e.g. test); default: none (the embedded task has its own held-out prompts).",
    )
    eval_dataset: str | None = option(
        None,
        group=WORKLOAD,
        help="Held-out data from another dataset or file (same forms as --dataset, same "
        "--column mapping; its --eval-split, default train), scored each round.",
    )
    eval_dataset_config: str | None = option(
        None,
        group=WORKLOAD,
        help="The config (subset) of --eval-dataset, as --dataset-config is of --dataset.",
    )
    eval_examples: int = option(
        64,
        low=1,
        high=1_000_000,
        group=WORKLOAD,
        help="Held-out rows scored each round: a fixed subsample, the same for every "
        "replica; the replicas share the work.",
    )
    columns: dict[str, str] = option(
        default_factory=dict,
        flag="--column",
        group=WORKLOAD,
        help="FIELD=COLUMN, repeatable: the job's field (composer: prompt, answer, hint, trace; "
        "sft: text, prompt, completion, messages) is read "
        "from the file's COLUMN, e.g. --column prompt=question (default: same names).",
    )
    reward: list[str] = option(
        default_factory=list,
        group=WORKLOAD,
        help="Reward NAME or NAME=WEIGHT, repeatable: exact_match, math_answer, "
        "format:<regex> or module:function (default: the embedded task's).",
    )
    reward_timeout: float = option(
        REWARD_TIMEOUT_S,
        low=0,
        high=MAX_WAIT_S,
        must=f"0 (no limit) or a number of seconds at most {MAX_WAIT_S:.0f}",
        run_defining=False,
        at_resume=True,
        group=WORKLOAD,
        help="Seconds one call of a reward function may take in a replica (a batch of "
        "completions; an LLM judge's too): past it the run stops, naming the reward "
        "(0 = no limit).",
    )
    report_to: str = option(
        "none",
        choices=TRACKERS,
        group=WORKLOAD,
        help="Experiment tracker every replica reports to: tensorboard (event files in the "
        "run folder's tensorboard/), wandb or trackio (one run per replica, grouped by run "
        "id), or none.",
    )
    # Rollout workers (docs/rollout-workers.md): M processes that only generate GRPO
    # rollouts for the trainers, meeting them through the store (weights out, rollouts in).
    rollout_workers: int = option(
        RolloutConfig.workers,
        low=0,
        high=MAX_ROLLOUT_WORKERS,
        group=ROLLOUT,
        help="Start this many rollout workers besides the replicas: they generate the "
        "composer job's GRPO rollouts on their own hardware (--rollout-hardware) from the "
        "policy the trainers publish through the store; worker w serves replica w % N "
        "(0 = none: every replica generates its own).",
    )
    publish_every: int = option(
        RolloutConfig.publish_every,
        low=1,
        high=MAX_TOTAL_STEPS,
        group=ROLLOUT,
        help="With rollout workers: each replica publishes its policy (a delta against the "
        "round's global weights) every this many inner steps.",
    )
    max_staleness: int = option(
        RolloutConfig.max_staleness,
        low=0,
        high=MAX_TOTAL_STEPS,
        group=ROLLOUT,
        help="With rollout workers: the most inner steps a rollout's policy may lag its "
        "trainer's; workers are paced to it (never dropped), 0 = on-policy.",
    )
    rollout_wire: str = option(
        RolloutConfig.wire,
        choices=codec_names,
        group=ROLLOUT,
        help="The wire format of the published policy deltas: float32 (exact), bfloat16, "
        "float16, int8 or the sparse topk2, topk4, topk8 (as --wire-dtype).",
    )
    rollout_wait: float = option(
        RolloutConfig.wait_s,
        seconds=True,
        group=ROLLOUT,
        help="Seconds a replica waits for a worker's batch before it generates the batch "
        "itself (so a slow or dead worker costs only speed).",
    )
    rollout_grace: float = option(
        RolloutConfig.grace_s,
        seconds=True,
        run_defining=False,
        at_resume=True,
        group=ROLLOUT,
        help="Seconds a rollout worker goes on without a sign of life from its trainer "
        "replica before it ends itself (a detached run's trainers killed and not "
        "restarted); keep it longer than a replica takes to restart.",
    )
    rollout_correction: str = option(
        RolloutConfig.correction,
        choices=CORRECTION_MODES,
        group=ROLLOUT,
        help="Off-policy correction of worker rollouts (decoupled PPO: the clip is taken "
        "against the trainer's recomputed log-probs, the advantage weighted by "
        "pi_prox/pi_behaviour): token_truncate, token_mask, sequence_truncate, sequence_mask, "
        "or off (comparison only).",
    )
    rollout_clip_min: float | None = option(
        RolloutConfig.clip_min,
        low=0,
        group=ROLLOUT,
        help="The ratio pi_prox/pi_behaviour is raised to this (or, *_mask, masked below "
        "it) (default: none).",
    )
    rollout_clip_max: float = option(
        RolloutConfig.clip_max,
        low=0,
        open_low=True,
        group=ROLLOUT,
        help="The ratio pi_prox/pi_behaviour is truncated at (or, *_mask, masked above) this.",
    )
    rollout_max_mismatch: float = option(
        RolloutConfig.max_mismatch,
        low=0,
        open_low=True,
        group=ROLLOUT,
        help="A worker batch whose mean mismatch KL to the trainer's policy exceeds this "
        "was generated by other weights than it names: refused, generated locally.",
    )
    backend: str = option(
        "local",
        run_defining=False,
        group=BACKEND,
        help="Where replicas run: local, modal, hf (Hugging Face Jobs), sagemaker.",
    )
    env: dict[str, str] = option(  # plain: written in run.json, shown by describe calls
        default_factory=dict,
        flag="--env",
        group=BACKEND,
        help="Plain (non-secret) environment variable KEY=VALUE for every replica "
        "(repeatable); written in run.json.",
    )
    secrets: list[str] = option(  # names only: the values are read at each launch
        default_factory=list,
        flag="--secret",
        group=BACKEND,
        help="Secret variable for every replica (repeatable): KEY takes its value from this "
        "environment, KEY=@path from a file; only the name is written anywhere.",
    )
    workdir: str | None = option(
        None,
        group=BACKEND,
        help="Your code folder: packed at launch (honouring .gitignore, at most 100 MB) into "
        "the run folder; every replica runs in its own unpacked copy, on its PYTHONPATH.",
    )
    pip: list[str] = option(
        default_factory=list,
        group=BACKEND,
        help="Extra package for the cloud replicas to pip install (repeatable), e.g. "
        "--pip scipy>=1.13; local replicas must find it installed here.",
    )
    requirements: str | None = option(
        None,
        group=BACKEND,
        help="A requirements file read at launch; its lines join --pip.",
    )
    backend_options: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    version: int = SPEC_VERSION
    #: where the driver put the packed --workdir (crf.layout.workdir_key); None without one
    workdir_key: str | None = None

    @property
    def total_steps(self) -> int:
        return self.rounds * self.sync_every

    @property
    def job_label(self) -> str:
        """What the run trains, as its records and tables name it: the job, or for a custom
        ``--entrypoint`` its command (the job is not what runs then; run.json keeps both)."""
        command = self.entrypoint
        if not command:
            return self.job
        return command if isinstance(command, str) else shlex.join(map(str, command))

    @property
    def sync_period(self) -> int:
        """Inner steps between two exchange rounds (one per fragment sync)."""
        return self.sync_every // max(1, self.fragments) if isinstance(self.fragments, int) else 0

    @property
    def exchange_rounds(self) -> int:
        """Exchange rounds in the whole run: ``fragments`` per outer round."""
        return self.rounds * self.fragments

    def saves_inner_state(self, r: int) -> bool:
        """Whether each replica saves its inner-optimizer state after exchange round r: with
        the periodic global states (a resume starts from one) and at the last round."""
        if not self.save_inner_state:
            return False
        period = self.checkpoint_every * max(1, self.fragments)
        return (r + 1) % period == 0 or r >= self.exchange_rounds - 1

    def validate(self) -> RunSpec:
        """SpecError naming the first option out of range (as its flag), else self. Each
        option's own type and range are declared on its field; what relates two options is
        checked here."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise SpecError(msg)

        check_run_id(self.run_id)
        need(isinstance(self.run_uri, str), f"run_uri must be a string (got {self.run_uri!r})")
        need(
            isinstance(self.backend_options, dict),
            f"backend_options must be a mapping (got {self.backend_options!r})",
        )
        need(
            self.workdir_key is None
            or (
                isinstance(self.workdir_key, str)
                and _WORKDIR_KEY_RE.fullmatch(self.workdir_key) is not None
            ),
            f"workdir_key must be a packed workdir's key (got {self.workdir_key!r})",
        )
        need(
            is_number(self.created_at) and math.isfinite(self.created_at),
            f"created_at must be a time in seconds (got {self.created_at!r})",
        )
        for declared in run_options().values():
            declared.check(self)
        check_env_names(self.env, self.secrets)
        need(
            self.rounds * self.sync_every <= MAX_TOTAL_STEPS,
            f"--rounds x --sync-every is {self.rounds * self.sync_every} inner steps, more "
            f"than the {MAX_TOTAL_STEPS} a run may have; lower --rounds or --sync-every",
        )
        need(
            self.sync_every % self.fragments == 0,
            f"--sync-every ({self.sync_every}) must be divisible by --fragments "
            f"({self.fragments}): each fragment syncs every sync_every / fragments inner steps",
        )
        need(
            self.fragment_sync_delay < self.sync_period,
            f"--fragment-sync-delay must be an integer in [0, sync_every / fragments = "
            f"{self.sync_period}) (got {self.fragment_sync_delay!r}): a fragment's exchange "
            "must finish before the next fragment's starts",
        )
        if self.reduce_group_size:
            from crf.exchange.codecs import is_sparse
            from crf.exchange.config import two_level_sparse_error

            need(not is_sparse(self.wire_dtype), two_level_sparse_error(self.wire_dtype))
        self._validate_workload()
        self._validate_rollouts()
        return self

    def _validate_rollouts(self) -> None:
        """What rollout workers need of the other options (docs/rollout-workers.md): the
        composer job (GRPO generation is what they take over), the built-in replica, one
        process per replica, a clip range that is one; refused here, before anything starts.
        (--procs-per-replica left out resolves to the hardware's GPUs: crf.launcher.plan
        checks the resolved value.)"""
        if not self.rollout_workers:
            return
        flag = f"--rollout-workers {self.rollout_workers}"
        if self.job != ROLLOUT_JOB:
            raise SpecError(
                f"{flag} needs --job {ROLLOUT_JOB} (workers generate GRPO rollouts; "
                f"job {self.job!r} has none to hand out): drop --rollout-workers"
            )
        if self.entrypoint:
            raise SpecError(
                f"{flag} needs the built-in replica (python -m crf.replica), which publishes "
                "the policy and takes the rollouts: drop --entrypoint or --rollout-workers"
            )
        if self.procs_per_replica not in (None, 1):
            raise SpecError(
                f"{flag} needs --procs-per-replica 1 (got {self.procs_per_replica}): a "
                "replica's rollouts come from its workers to one trainer process"
            )
        low, high = self.rollout_clip_min, self.rollout_clip_max
        if low is not None and is_number(high) and low >= high:
            raise SpecError(f"--rollout-clip-min ({low}) must be below --rollout-clip-max ({high})")

    def _validate_workload(self) -> None:
        """What relates the model options, and the optional packages they need."""
        if self.precision == "fp16" and self.device == "cpu":
            raise SpecError(
                "--precision fp16 needs a CUDA GPU (--device cuda or auto); on a CPU use "
                "bf16 or fp32"
            )
        if self.lora_rank > 0 and importlib.util.find_spec("peft") is None:
            raise SpecError(
                f"--lora-rank {self.lora_rank} needs peft: install composer-replication[lora]"
            )
        self._validate_lora_targets()
        self._validate_tracking()
        if self.model is not None and not self.model.strip():
            raise SpecError("--model must name a Hub id or a folder (got an empty string)")
        self._validate_data_names()
        folder = self.model and os.path.expanduser(self.model)
        if folder and self.model.startswith(("/", ".", "~")) and not os.path.isdir(folder):
            # a path, not a Hub id (org/name): local replicas would each fail to load it
            if self.backend == "local":
                raise SpecError(model_path_problem(self.model))

    def _validate_lora_targets(self) -> None:
        """``--lora-target-modules`` goes with ``--lora-rank``, and is well formed; whether
        the model has such modules is the launcher's check of the model."""
        if self.lora_target_modules is None:
            return
        if self.lora_rank == 0:
            raise SpecError(
                "--lora-target-modules names what --lora-rank adapts: add --lora-rank, or "
                "leave it out"
            )
        problem = lora_targets_problem(self.lora_target_modules)
        if problem:
            raise SpecError(problem)

    def _validate_data_names(self) -> None:
        """An empty data option (``--dataset "$DATA"`` with DATA unset) would read as the
        option left out: the embedded task trained instead of the user's rows."""
        names = {"--dataset": self.dataset, "--eval-dataset": self.eval_dataset,
                 "--dataset-config": self.dataset_config, "--dataset-split": self.dataset_split,
                 "--eval-split": self.eval_split,
                 "--eval-dataset-config": self.eval_dataset_config}  # fmt: skip
        for flag, value in names.items():
            if value is not None and not str(value).strip():
                raise SpecError(f"{flag} is an empty string: give its name, or leave it out")

    def _validate_tracking(self) -> None:
        """--report-to needs its package here (the replicas import the one the driver has)
        and, on a cloud backend, somewhere to send the metrics that outlives the container."""
        tracker = self.report_to
        if tracker not in TRACKERS or tracker == "none":
            return
        if importlib.util.find_spec(tracker) is None:
            raise SpecError(
                f"--report-to {tracker} needs the {tracker} package: install "
                "composer-replication[tracking]"
            )
        if self.backend == "local" or not isinstance(self.env, dict):
            return
        names = {secret_name(str(e)) for e in self.secrets} | set(self.env)
        if tracker == "wandb" and not names & WANDB_KEYS:
            raise SpecError(
                f"--report-to wandb on {self.backend}: give the replicas your key with "
                "--secret WANDB_API_KEY (or --env WANDB_MODE=offline)"
            )
        if tracker == "trackio" and not names & {"TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"}:
            raise SpecError(
                f"--report-to trackio on {self.backend}: a replica's local trackio database "
                "goes with its container; set --env TRACKIO_SPACE_ID=org/space (with --secret "
                "HF_TOKEN) or --env TRACKIO_SERVER_URL=..."
            )

    def to_json(self) -> str:
        return jsonsafe.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SpecError(
                f"run.json has unknown fields {sorted(unknown)}: written by a newer crf?"
            )
        data = dict(data)
        for f in dataclasses.fields(cls):  # a non-finite float is written as its token
            value = data.get(f.name)
            if "float" in str(f.type).split(" | ") and jsonsafe.is_nonfinite(value):
                data[f.name] = jsonsafe.number(value)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunSpec:
        return cls.from_dict(json.loads(text))


#: run options that define a run: fixed in its run.json, so ``crf launch --resume`` refuses them
RUN_DEFINING = tuple(name for name, o in run_options().items() if o.run_defining)
#: the options a resume may change (limits on waiting: they never change what is trained)
AT_RESUME = tuple(name for name, o in run_options().items() if o.at_resume)


def model_path_problem(model: str) -> str:
    """The line for a ``--model`` path that is no folder, saying what it is instead: a file
    (config.json, model.safetensors) is inside the folder wanted, a link's target is gone."""
    path = os.path.expanduser(model)
    if os.path.islink(path) and not os.path.exists(path):
        return (
            f"--model {model} is a link to {os.readlink(path)}, which does not exist; fix "
            "the link or give the model's folder"
        )
    if os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        return f"--model {model} is a file: give the model's folder ({parent}) or a Hub id"
    return (
        f"--model {model!r}: no such folder (give a Hub id org/name or a folder saved with "
        "save_pretrained)"
    )
