"""Before launch: a local ``--model`` folder's weights have the shapes its ``config.json``
gives them.

A config edited by hand, or saved beside another model's weights, loads nowhere: every
replica's ``from_pretrained`` fails the same way, with transformers' "size mismatch ... look
at the above report" and the report only in the replica's log. The launcher can tell first
and cheaply: the model is built from its config on the ``meta`` device (shapes, no memory,
no weights read) and its tensors' shapes compared with the safetensors headers. Only names
found in both are compared, so checkpoints whose keys transformers renames on load, and tied
weights stored once, are not misread. Models that bring their own code are not built here
(that would run it), and neither are quantized checkpoints (a ``quantization_config``: a
4-bit weight is stored packed, in another shape than the config's).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Iterable
from typing import Any


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header (the data is not read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}


def config_shapes(folder: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of the model ``config.json`` describes, built on the meta device;
    None when transformers cannot build it here."""
    model = meta_model(folder)
    return None if model is None else {k: tuple(v.shape) for k, v in model.state_dict().items()}


def learned_positions(folder: str) -> int | None:
    """The positions of the model in ``folder`` when it has a learned table of absolute
    positions (crf/replica/prompt_fit.py ``learned_positions``), from its meta build; None
    when it has none or is not built here."""
    from crf.replica.prompt_fit import learned_positions as of

    model = meta_model(folder)
    return None if model is None else of(model)


def meta_model(folder: str) -> Any:
    """The model ``config.json`` describes, built on the meta device (no memory, no weights
    read; kept for the checks that follow while the file is unchanged); None when
    transformers cannot build it here."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            config = f.read()
    except OSError:
        return None
    return _meta_model(folder, config)


@functools.lru_cache(maxsize=2)
def _meta_model(folder: str, config: bytes) -> Any:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from crf.replica.model import quiet_transformers

        with quiet_transformers():
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            if getattr(config, "quantization_config", None):
                return None  # packed weights: their stored shapes are not the config's
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a model type this check cannot build: the load will say
        return None
    return model


def shape_problem(folder: str, shards: Iterable[str]) -> str | None:
    """The first tensor whose stored shape differs from the config's (None: all agree)."""
    expected = config_shapes(folder)
    if expected is None:
        return None
    for shard in sorted(shards):
        try:
            stored = header_shapes(os.path.join(folder, shard))
        except (OSError, ValueError, struct.error):
            continue  # a damaged file is the weights check's to report
        for name, shape in stored.items():
            want = expected.get(name)
            if want is not None and want != shape:
                return (
                    f"{shard} stores {name} as {list(shape)} but config.json makes it "
                    f"{list(want)}: the config and the weights are of different models"
                )
    return None
