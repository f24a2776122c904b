"""What a replica's inner state (``replicas/<rank>/inner/<r>.pt``) holds, and how it is taken
apart on resume. :class:`~crf.exchange.checkpoints.Checkpoints` copies, writes and reads it;
the replica (:class:`~crf.replica.context.ReplicaContext`) says what goes in and where it
comes back to.

A dict ``{"inner_optimizer", "local_params", "error_feedback", "rng"}``: the inner
optimizer's own state dict; with fragments (Streaming DiLoCo) only the fragment just synced
is global, the others hold this replica's local progress, which ``global/<r>`` does not have,
so its trainable weights go in too; with a sparse wire's error feedback, what the wire
dropped, per fragment, which a restarted or resumed replica resends; and the training
thread's random-number generators where the round's last inner step left them
(:func:`rng_states`: torch's CPU and CUDA generators, Python's ``random``, NumPy's global
one), so a resumed replica draws what the uninterrupted one would have drawn next (a GRPO
job samples its completions from them). Older runs wrote the optimizer's state dict alone,
or the dict without ``rng``: both still load (without ``rng`` the generators stay as the
job seeded them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def compose(
    optimizer_state: Any,
    local_params: dict[str, torch.Tensor] | None = None,
    error_feedback: Any = None,
    rng: dict[str, Any] | None = None,
) -> Any:
    """The inner state to save: the tensors as they are (the checkpoint copies them)."""
    if local_params is None and not error_feedback and rng is None:
        return optimizer_state
    state: dict[str, Any] = {"inner_optimizer": optimizer_state}
    if rng is not None:
        state["rng"] = rng
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
    #: the random-number generators' states (:func:`rng_states`); None in older states
    rng: dict[str, Any] | None = None


def split(saved: Any) -> InnerState:
    """``saved`` (as :func:`compose` built it, by this or an older version) taken apart.
    KeyError when it is a wrapped state without the optimizer's."""
    if isinstance(saved, dict) and "inner_optimizer" in saved:
        return InnerState(
            saved["inner_optimizer"],
            saved.get("local_params"),
            saved.get("error_feedback"),
            saved.get("rng"),
        )
    return InnerState(saved, None, None)


def rng_states() -> dict[str, Any]:
    """The process's random-number generators now, in what ``torch.load(weights_only=True)``
    reads back (tensors, ints, floats, tuples): torch's CPU generator, each CUDA device's
    once CUDA is initialized, Python's ``random`` and NumPy's global ``np.random``. Read
    only: taking them draws nothing."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss),
                  float(cached)),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the generators :func:`rng_states` took (a CUDA state only where this process has
    CUDA and as many devices: a replica resumed on other hardware draws on from its seed)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
