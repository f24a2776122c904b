"""What a replica's inner state (``replicas/<rank>/inner/<r>.pt``) holds, and how it is taken
apart on resume. :class:`~crf.exchange.checkpoints.Checkpoints` copies, writes and reads it;
the replica (:class:`~crf.replica.context.ReplicaContext`) says what goes in and where it
comes back to.

Without fragments or error feedback it is the inner optimizer's own state dict, as older runs
wrote it. Otherwise a dict ``{"inner_optimizer", "local_params", "error_feedback"}``: with
fragments (Streaming DiLoCo) only the fragment just synced is global, the others hold this
replica's local progress, which ``global/<r>`` does not have, so its trainable weights go in
too; with a sparse wire's error feedback, what the wire dropped, per fragment, which a
restarted or resumed replica resends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def compose(
    optimizer_state: Any,
    local_params: dict[str, torch.Tensor] | None = None,
    error_feedback: Any = None,
) -> Any:
    """The inner state to save: the tensors as they are (the checkpoint copies them)."""
    if local_params is None and not error_feedback:
        return optimizer_state
    state: dict[str, Any] = {"inner_optimizer": optimizer_state}
    if local_params is not None:
        state["local_params"] = local_params
    if error_feedback:
        state["error_feedback"] = error_feedback
    return state


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's own trainable weights, by name (what ``local_params`` holds)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class InnerState:
    """A saved inner state taken apart (:func:`split`)."""

    optimizer: Any
    local_params: dict[str, torch.Tensor] | None
    error_feedback: Any


def split(saved: Any) -> InnerState:
    """``saved`` (as :func:`compose` built it, by this or an older version) taken apart.
    KeyError when it is a wrapped state without the optimizer's."""
    if isinstance(saved, dict) and "inner_optimizer" in saved:
        return InnerState(
            saved["inner_optimizer"], saved.get("local_params"), saved.get("error_feedback")
        )
    return InnerState(saved, None, None)
