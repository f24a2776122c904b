"""The run spec: everything a replica needs to know, written once to ``run.json``.

The driver validates it before launching anything (bad input fails early with a message that
says what to fix); replicas read it from the store, so the environment carries only the run
URI, the rank and the world size (docs/design.md, "Replica runtime").
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from crf import jsonsafe
from crf.exchange.codecs import codec_names

SPEC_VERSION = 1
WIRE_DTYPES = codec_names()  # the built-in codecs; validate() asks the registry itself
# matched with fullmatch: ``$`` would also match before a trailing newline ("abc\n")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# Ranges of the run options, declared once (RunSpec.validate, used by the CLI and the SDK
# alike). Each bound is what something downstream accepts, so a value past it would only fail
# after launch, in every replica:
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass
class RunSpec:
    """One training run: N replicas, H inner steps per round, R rounds."""

    run_id: str
    run_uri: str
    job: str = "composer"
    job_config: dict[str, Any] = field(default_factory=dict)
    entrypoint: list[str] | None = None  # a user's own command instead of `python -m crf.replica`
    replicas: int = 2
    sync_every: int = 20  # H: inner optimizer steps between outer steps
    rounds: int = 5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    seed: int = 0
    min_replicas: int = 1  # quorum may close at the deadline with at least this many
    round_timeout_s: float = 300.0  # how long a replica waits for the others in one round
    num_shards: int | None = None  # default: one shard per replica
    keep_rounds: int = 3  # rounds kept in the store; older ones are garbage-collected
    # global/<r> (weights + outer momentum, about 3 P) and the inner states are written every
    # this many exchange rounds, at the last round, and when a replica asks for one to heal
    checkpoint_every: int = 1
    wire_dtype: str = "float32"  # float32 | bfloat16 | float16 | int8 (block-wise scales)
    error_feedback: bool = False  # with a lossy wire: resend what quantization dropped
    save_inner_state: bool = True  # each replica saves its inner optimizer per round (resume)
    # Streaming DiLoCo (arXiv 2501.18512): the model is split into `fragments` contiguous groups
    # of parameters, synced one at a time every sync_every / fragments inner steps, each sync
    # its own exchange round; a fragment's exchange starts `fragment_sync_delay` inner steps
    # before the replica waits for it, so the transfer overlaps with training.
    fragments: int = 1
    fragment_sync_delay: int = 0
    backend: str = "local"
    backend_options: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    version: int = SPEC_VERSION

    @property
    def total_steps(self) -> int:
        return self.rounds * self.sync_every

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
        k = self.checkpoint_every
        return k == 1 or (r + 1) % k == 0 or r >= self.exchange_rounds - 1

    def validate(self) -> RunSpec:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise SpecError(msg)

        check_run_id(self.run_id)
        for name in ("run_uri", "job", "backend", "wire_dtype"):
            need(
                isinstance(getattr(self, name), str),
                f"{name} must be a string (got {getattr(self, name)!r})",
            )
        for name in ("job_config", "backend_options"):
            need(
                isinstance(getattr(self, name), dict),
                f"{name} must be a mapping (got {getattr(self, name)!r})",
            )
        need(
            self.entrypoint is None
            or (
                isinstance(self.entrypoint, list)
                and all(isinstance(a, str) for a in self.entrypoint)
            ),
            f"entrypoint must be a list of strings (got {self.entrypoint!r})",
        )
        need(
            is_number(self.created_at) and math.isfinite(self.created_at),
            f"created_at must be a time in seconds (got {self.created_at!r})",
        )
        need(
            _is_int(self.replicas) and 1 <= self.replicas <= MAX_REPLICAS,
            f"--replicas must be an integer >= 1 and at most {MAX_REPLICAS} "
            f"(got {self.replicas!r})",
        )
        need(
            _is_int(self.sync_every) and 1 <= self.sync_every <= MAX_TOTAL_STEPS,
            f"--sync-every must be an integer >= 1 and at most {MAX_TOTAL_STEPS} "
            f"(got {self.sync_every!r})",
        )
        need(
            _is_int(self.rounds) and 1 <= self.rounds <= MAX_TOTAL_STEPS,
            f"--rounds must be an integer >= 1 and at most {MAX_TOTAL_STEPS} (got {self.rounds!r})",
        )
        need(
            self.rounds * self.sync_every <= MAX_TOTAL_STEPS,
            f"--rounds x --sync-every is {self.rounds * self.sync_every} inner steps, more "
            f"than the {MAX_TOTAL_STEPS} a run may have; lower --rounds or --sync-every",
        )
        need(
            is_number(self.outer_lr) and math.isfinite(self.outer_lr) and self.outer_lr > 0,
            f"--outer-lr must be > 0 and finite (got {self.outer_lr!r})",
        )
        need(
            is_number(self.outer_momentum) and 0 <= self.outer_momentum < 1,
            f"--outer-momentum must be in [0, 1) (got {self.outer_momentum!r})",
        )
        need(
            _is_int(self.seed) and 0 <= self.seed <= MAX_SEED,
            f"--seed must be an integer between 0 and {MAX_SEED} (got {self.seed!r}): "
            "numpy, which seeds each replica's data order, takes no other",
        )
        need(
            _is_int(self.min_replicas) and 1 <= self.min_replicas <= self.replicas,
            f"--min-replicas must be between 1 and --replicas={self.replicas} "
            f"(got {self.min_replicas!r})",
        )
        check_seconds("--round-timeout", self.round_timeout_s)
        need(
            self.num_shards is None or (isinstance(self.num_shards, int) and self.num_shards >= 1),
            f"num_shards must be None or an integer >= 1 (got {self.num_shards!r})",
        )
        need(
            isinstance(self.keep_rounds, int) and self.keep_rounds >= 1,
            f"keep_rounds must be an integer >= 1 (got {self.keep_rounds!r})",
        )
        need(
            isinstance(self.checkpoint_every, int)
            and not isinstance(self.checkpoint_every, bool)
            and self.checkpoint_every >= 1,
            f"--checkpoint-every must be an integer >= 1 (got {self.checkpoint_every!r}): "
            "global states are written every that many rounds",
        )
        need(
            self.wire_dtype in codec_names(),
            f"wire dtype {self.wire_dtype!r} is unknown; choose one of {', '.join(codec_names())}",
        )
        need(
            isinstance(self.fragments, int)
            and not isinstance(self.fragments, bool)
            and 1 <= self.fragments <= self.sync_every,
            f"--fragments must be an integer between 1 and --sync-every={self.sync_every} "
            f"(got {self.fragments!r})",
        )
        need(
            self.sync_every % self.fragments == 0,
            f"--sync-every ({self.sync_every}) must be divisible by --fragments "
            f"({self.fragments}): each fragment syncs every sync_every / fragments inner steps",
        )
        need(
            isinstance(self.fragment_sync_delay, int)
            and not isinstance(self.fragment_sync_delay, bool)
            and 0 <= self.fragment_sync_delay < self.sync_period,
            f"--fragment-sync-delay must be an integer in [0, sync_every / fragments = "
            f"{self.sync_period}) (got {self.fragment_sync_delay!r}): a fragment's exchange "
            "must finish before the next fragment's starts",
        )
        return self

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
