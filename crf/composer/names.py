"""The composer's enumerated option values (torch-free, so job configs validate cheaply)."""

from __future__ import annotations

DISTILL_WRAPPERS = ("none", "taid", "entropy_opd")
REPLAY_LOSSES = ("dpo", "simpo")
TAID_SCHEDULES = ("linear", "adaptive")
