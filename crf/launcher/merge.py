"""``crf export --merge``: a LoRA run's adapter folded into its base model.

A run with ``--lora-rank`` trains adapters only, so its ``model/`` is peft's adapter folder
(:mod:`crf.replica.export`). Serving stacks (vLLM, TGI, llama.cpp converters) and
``AutoModelForCausalLM.from_pretrained`` want one plain model, so ``--merge`` loads the base,
applies the adapter with peft (``PeftModel.from_pretrained``) and folds it in with peft's
``merge_and_unload``; the result is saved with ``save_pretrained`` and the run's tokenizer
files.

Decisions:

- **Which base.** ``--base-model`` when given; else the run's ``--model`` (run.json), the
  model the replicas loaded; else the adapter's own ``base_model_name_or_path``. A run that
  trained the job's embedded model has none that ``from_pretrained`` can load, and is refused.
- **Precision.** The base is loaded in fp32 and the adapter folded in there, so the only
  rounding is one cast at the end to the base's stored dtype (its config's ``dtype``): the
  merged model has the base's size and loads like it. A config that names no dtype leaves
  the merged model in fp32. The replicas trained LoRA on a base in the compute dtype;
  folding in fp32 adds no second rounding on top of that. The cost is memory: the fp32
  base is held on this machine's CPU, 4 bytes per parameter (32 GB for an 8B model).
- **What is copied.** The run's tokenizer files go with the merged weights; peft's model card
  (``README.md``) and the adapter's own files do not, since they would label a plain model as
  an adapter.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crf.launcher.errors import LaunchError

#: peft's files in an adapter folder: not part of a merged model
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
#: a model card written by peft for the adapter (library_name: peft): wrong for the merge
MODEL_CARD = "README.md"
#: written by the base model's save_pretrained: never taken from the adapter folder
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


class MergeError(LaunchError):
    """The adapter cannot be merged (one line: what to do)."""


def is_adapter(files: list[str]) -> bool:
    """Whether a run's ``model/`` (its relative file names) is a peft adapter."""
    return "adapter_config.json" in files


def base_model_of(run_spec: dict[str, Any], adapter_dir: Path, override: str | None) -> str:
    """The base model to merge into (module docstring: which base); MergeError when none
    can be named."""
    if override:
        return override
    model = run_spec.get("model")
    workdir = run_spec.get("workdir")
    if model and workdir and str(model).startswith("./"):
        # a cloud run's folder inside --workdir: the launching machine's copy of it
        inside = Path(workdir) / str(model)
        if inside.is_dir():
            return str(inside)
    if model:
        return str(model)
    import json

    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
    except ValueError as e:
        raise MergeError(
            f"the run's adapter_config.json is not valid JSON ({_first_line(e)}): give "
            "--base-model, or export without --merge"
        ) from None
    named = config.get("base_model_name_or_path")
    if named:
        return str(named)
    raise MergeError(
        "the run trained the job's embedded model, which has no base to merge into: "
        "give --base-model (a folder or Hub id)"
    )


def merge_adapter(
    adapter_dir: Path,
    base: str,
    out_dir: Path,
    *,
    trust_remote_code: bool = False,
    step: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Fold the adapter in ``adapter_dir`` into ``base`` and write the merged model (and the
    adapter folder's tokenizer files) to ``out_dir``; returns the files written, relative.
    ``step`` hears each stage (loading, merging, writing): the caller shows it, in place of
    the libraries' per-stage progress bars, which would leave lines around a refusal."""
    if importlib.util.find_spec("peft") is None:
        raise MergeError("--merge needs peft: install composer-replication[lora]")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return _merge(adapter_dir, base, out_dir, trust_remote_code, step)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _merge(
    adapter_dir: Path,
    base: str,
    out_dir: Path,
    trust_remote_code: bool,
    step: Callable[[str], None],
) -> list[str]:
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    local = Path(base).expanduser()
    if base.startswith(("/", ".", "~")) and not local.is_dir():
        raise MergeError(
            f"the base model {base!r} is not a folder on this machine: give --base-model "
            "(the folder, or the Hub id it was saved from)"
        )
    source = str(local) if local.is_dir() else base
    step(f"loading the base model {base} (fp32)")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise MergeError(
            f"cannot load the base model {base!r}: {_first_line(e)}; give --base-model (the "
            "folder, or the Hub id the run trained)"
        ) from None
    step("merging the adapter")
    try:
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as e:  # another architecture, other shapes
        raise MergeError(
            f"the run's adapter does not fit the base model {base!r} ({_first_line(e)}): "
            "give --base-model the model the run trained"
        ) from None
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if isinstance(stored, torch.dtype) and stored.is_floating_point:
        merged = merged.to(stored)
    step(f"writing the merged model ({str(merged.dtype).removeprefix('torch.')})")
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir)
    skip = {*ADAPTER_FILES, MODEL_CARD, *MODEL_FILES}
    for path in sorted(adapter_dir.rglob("*")):
        rel = path.relative_to(adapter_dir).as_posix()
        if path.is_file() and rel not in skip:
            (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out_dir / rel)
    return sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].rstrip(':')}" if text else type(e).__name__
