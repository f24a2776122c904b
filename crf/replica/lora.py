"""Which modules of a model ``--lora-rank`` adapts (``--lora-target-modules``), checked the
same way before launch and at a replica's setup.

crf asks peft for ``all-linear`` by default: every linear layer but the output one, which
fits every architecture peft knows a layout for and many it does not. Some it refuses: peft
puts no LoRA on a Mamba's ``out_proj`` or ``conv1d`` (its fused kernels bypass them), so a
Mamba run would fail on every replica as it wraps the model. Names a user gives can be
wrong too: one that matches no module is a typo, and peft skips it without a word as long
as another name matches. So :func:`target_problem` says, in one line naming the option and
the model's own linear-layer names, what peft would refuse; the launcher runs it on the
model built on the meta device (crf/launcher/model_shapes.py: no weights read), and
:func:`add_lora` on the loaded model, for a model only the replica reads (a Hub id), where
the refusal is a setup error that ends the run instead of a restart.
"""

from __future__ import annotations

import copy
from typing import Any

from crf.spec import LORA_ALL_LINEAR as ALL_LINEAR

#: the model's linear-layer names a refusal lists
SHOWN = 6


def lora_targets(value: str | None) -> str | list[str]:
    """peft's ``target_modules`` for ``--lora-target-modules`` (``all-linear`` when unset,
    else the comma-separated names)."""
    if value is None or value.strip() in ("", ALL_LINEAR):
        return ALL_LINEAR
    return [name.strip() for name in value.split(",") if name.strip()]


def linear_names(model: Any) -> list[str]:
    """The last names of ``model``'s linear layers (``nn.Linear``, and transformers'
    ``Conv1D`` of GPT-2), each once, in the model's order; the output layer left out (peft's
    ``all-linear`` leaves it out too)."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out: list[str] = []
    for name, module in model.named_modules():
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        leaf = name.rsplit(".", 1)[-1]
        if linear and module is not output and leaf not in out:
            out.append(leaf)
    return out


def _matches(module: str, target: str) -> bool:
    """peft's rule for a name in ``target_modules``: the module's whole name, or its end."""
    return module == target or module.endswith("." + target)


def lora_config(rank: int, alpha: int, targets: str | list[str]) -> Any:
    """The peft ``LoraConfig`` of a run: no dropout (every replica's step the same)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )


def target_problem(model: Any, value: str | None, model_name: str) -> str | None:
    """One line saying why peft cannot put LoRA on ``model``'s modules as
    ``--lora-target-modules`` (``value``) names them, and which of its linear layers to
    name (None: it can). ``model``: built on the meta device; peft wraps a copy of it."""
    from peft import get_peft_model

    targets = lora_targets(value)
    unmatched = _unmatched(model, targets)
    if unmatched:
        return (
            f"--lora-target-modules: --model {model_name} has no module named "
            f"{unmatched[0]!r}; {_candidates(model)}"
        )
    try:
        get_peft_model(copy.deepcopy(model), lora_config(1, 1, targets))
    except ValueError as e:
        return _refusal(e, model, targets, model_name)
    return None


def _unmatched(model: Any, targets: str | list[str]) -> list[str]:
    if not isinstance(targets, list):
        return []
    names = [name for name, _ in model.named_modules()]
    return [t for t in targets if not any(_matches(name, t) for name in names)]


def _refusal(error: ValueError, model: Any, targets: str | list[str], model_name: str) -> str:
    """The one line for peft's refusal of ``targets``: its reason's first sentence."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if reason.startswith("[PEFT:") and "] " in reason:
        reason = reason.split("] ", 1)[1]  # "[PEFT:PeftType.LORA] Module 'x' is ..."
    reason = reason.split(". ", 1)[0].rstrip(".")
    if targets == ALL_LINEAR:
        where = f"--lora-rank: peft refuses LoRA on every linear layer of --model {model_name}"
        where += f" (its default, {ALL_LINEAR})"
    else:
        where = f"--lora-target-modules {','.join(targets)}: peft refuses LoRA there on --model"
        where += f" {model_name}"
    return f"{where}: {reason}; {_candidates(model)}"


def _candidates(model: Any) -> str:
    """What to pass instead: the model's linear layers that peft takes, one at a time (each
    tried on a copy of the meta build)."""
    from peft import get_peft_model

    meta = meta_build(model)
    fit = []
    for name in linear_names(meta):
        try:
            get_peft_model(copy.deepcopy(meta), lora_config(1, 1, [name]))
        except ValueError:
            continue
        fit.append(name)
    if not fit:
        return "none of its linear layers takes LoRA: train it without --lora-rank"
    more = f" (and {len(fit) - SHOWN} more)" if len(fit) > SHOWN else ""
    return (
        f"pass --lora-target-modules with some of its linear layers: {','.join(fit[:SHOWN])}{more}"
    )


def meta_build(model: Any) -> Any:
    """``model`` (loaded, or already a meta build) as a meta-device build of its own class
    and config: copies of it cost no memory."""
    import torch

    if all(p.device.type == "meta" for p in model.parameters()):
        return model
    with torch.device("meta"):
        return type(model)._from_config(copy.deepcopy(model.config))


def add_lora(
    model: Any, rank: int, alpha: int, *, seed: int, targets: str | None = None, name: str = ""
) -> Any:
    """``model`` (``--model`` ``name``) with LoRA adapters on ``targets``
    (``--lora-target-modules``; every linear layer by default); only they require grad.
    Their random initial values come from ``seed`` alone, on every device, and the caller's
    random streams are left as they were. DataError (a setup error: no restart) for targets
    peft refuses (:func:`target_problem`'s line)."""
    import torch
    from peft import get_peft_model

    from crf.replica.data_files import DataError

    name = name or str(getattr(model, "name_or_path", "") or "the model")
    wanted = lora_targets(targets)
    if _unmatched(model, wanted):
        raise DataError(str(target_problem(meta_build(model), targets, name)))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, lora_config(rank, alpha, wanted))
        except ValueError as e:
            raise DataError(_refusal(e, model, wanted, name)) from None
