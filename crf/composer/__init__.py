"""The composer trainer: GRPO + hint-conditioned self-distillation + trace replay.

``loss = grpo + distill_alpha · distill + replay_beta · replay`` — see docs/composer.md.

Public API (imported lazily; ``losses`` needs only torch, the rest pulls in TRL):

- ``ComposerReplicationTrainer`` — the ``trl.GRPOTrainer`` subclass.
- ``ComposerConfig`` — ``trl.GRPOConfig`` plus the channels' knobs.
- ``DiLoCoCallback`` — joins a trainer to a crf run (``ctx.diloco`` + ``ctx.log_step``).
- ``compose_loss`` and the loss functions ``generalized_jsd``, ``taid_interpolate``,
  ``TAIDSchedule``, ``entropy_opd``, ``distill_per_token``, ``dpo_loss``, ``simpo_loss``,
  ``sequence_logps``.
- ``char_tokenizer``, ``tiny_qwen2``, ``save_tiny`` — tiny models built in code.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ComposerReplicationTrainer": "crf.composer.trainer",
    "capture_hidden": "crf.composer.trainer",
    "ComposerConfig": "crf.composer.config",
    "DiLoCoCallback": "crf.composer.callback",
    "ComposedLoss": "crf.composer.losses",
    "TAIDSchedule": "crf.composer.losses",
    "compose_loss": "crf.composer.losses",
    "distill_per_token": "crf.composer.losses",
    "dpo_loss": "crf.composer.losses",
    "entropy_opd": "crf.composer.losses",
    "generalized_jsd": "crf.composer.losses",
    "masked_row_mean": "crf.composer.losses",
    "sequence_logps": "crf.composer.losses",
    "simpo_loss": "crf.composer.losses",
    "taid_interpolate": "crf.composer.losses",
    "teacher_entropy": "crf.composer.losses",
    "char_tokenizer": "crf.composer.tiny",
    "tiny_qwen2": "crf.composer.tiny",
    "save_tiny": "crf.composer.tiny",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'crf.composer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
