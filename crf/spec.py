"""The run spec: everything a replica needs to know, written once to ``run.json``.

The driver validates it before launching anything (bad input fails early with a message that
says what to fix); replicas read it from the store, so the environment carries only the run
URI, the rank and the world size (DESIGN.md, "The replica contract").
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from crf import jsonsafe

SPEC_VERSION = 1
WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SpecError(ValueError):
    """A run spec field is invalid; the message names the field and the fix."""


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

        need(
            bool(_RUN_ID_RE.match(self.run_id)),
            f"run id {self.run_id!r} is invalid: use letters, digits, '.', '_' or '-' "
            "(at most 128, starting with a letter or digit)",
        )
        need(
            isinstance(self.replicas, int) and self.replicas >= 1,
            f"--replicas must be an integer >= 1 (got {self.replicas!r})",
        )
        need(
            isinstance(self.sync_every, int) and self.sync_every >= 1,
            f"--sync-every must be an integer >= 1 (got {self.sync_every!r})",
        )
        need(
            isinstance(self.rounds, int) and self.rounds >= 1,
            f"--rounds must be an integer >= 1 (got {self.rounds!r})",
        )
        need(self.outer_lr > 0, f"--outer-lr must be > 0 (got {self.outer_lr})")
        need(
            0 <= self.outer_momentum < 1,
            f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})",
        )
        need(
            isinstance(self.min_replicas, int) and 1 <= self.min_replicas <= self.replicas,
            f"--min-replicas must be between 1 and --replicas={self.replicas} "
            f"(got {self.min_replicas!r})",
        )
        need(
            self.round_timeout_s > 0,
            f"--round-timeout must be > 0 seconds (got {self.round_timeout_s})",
        )
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
            self.wire_dtype in WIRE_DTYPES,
            f"wire dtype {self.wire_dtype!r} is unknown; choose one of {', '.join(WIRE_DTYPES)}",
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
