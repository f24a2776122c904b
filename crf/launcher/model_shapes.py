"""Before launch: a local ``--model`` folder's weights have the shapes its ``config.json``
gives them, whether stored as safetensors or as ``pytorch_model.bin``.

A config edited by hand, or saved beside another model's weights, loads nowhere: every
replica's ``from_pretrained`` fails the same way, with transformers' "size mismatch ... look
at the above report" and the report only in the replica's log. The launcher can tell first
and cheaply: the model is built from its config on the ``meta`` device (shapes, no memory,
no weights read) and its tensors' shapes compared with the safetensors headers (a ``.bin``
checkpoint's names and shapes come from its pickle, loaded memory-mapped onto the meta
device: its data is never read). Only names found in both are compared, so checkpoints
whose keys transformers renames on load, and tied weights stored once, are not misread.
Models that bring their own code are not built here (that would run it: a config with
``auto_map`` is left to the replicas, and transformers is told never to trust remote code
here, so it raises instead of asking on the terminal), and neither are quantized
checkpoints (a ``quantization_config``: a 4-bit weight is stored packed, in another shape
than the config's).

The same build says which tensors the checkpoint lacks (:func:`missing_weights`):
transformers initialises a missing tensor at random, differently on every replica, so a
model saved without its LM head would train from noise and its replicas would disagree. And
with ``--lora-rank``, whether peft can put adapters on the modules ``--lora-target-modules``
names (:func:`lora_problem`): a Mamba refuses peft's default choice on every replica.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Iterable
from typing import Any

#: a zip archive's first bytes: ``torch.save``'s format since torch 1.6
ZIP_MAGIC = b"PK\x03\x04"
#: ``save_pretrained``'s names of a checkpoint in torch's own format, and its shards' index
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, or a ``pytorch_model*.bin``'s
    pickle (the data is not read); ValueError or OSError for a file that cannot be read
    so, and an empty mapping for a ``.bin`` in torch's pre-1.6 format (not mappable)."""
    if path.endswith(".bin"):
        return bin_shapes(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}


def bin_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a ``torch.save``'d state dict, loaded memory-mapped onto the
    meta device: its pickle is read (with ``weights_only``: no code runs), its tensor data
    never is. A file in torch's pre-1.6 format cannot be mapped and gives {} (no claim); a
    zip that does not open (a cut download) raises ValueError."""
    stat = os.stat(path)
    return dict(_bin_shapes(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _bin_shapes(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """:func:`bin_shapes`, read once while the file is unchanged (the weights check and the
    shape checks read it in turn)."""
    import torch

    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return ()
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="meta")
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise ValueError(f"is not a whole PyTorch checkpoint ({first})") from None
    if not isinstance(state, dict):
        raise ValueError("holds no state dict (tensor names -> tensors)")
    return tuple((str(k), tuple(v.shape)) for k, v in state.items() if isinstance(v, torch.Tensor))


def weight_files(folder: str, names: Iterable[str]) -> list[str]:
    """The files of ``folder`` (whose entries are ``names``) that ``from_pretrained`` reads
    the weights from: its safetensors files, else its ``pytorch_model*.bin`` shards (the
    ones a ``pytorch_model.bin.index.json`` lists, or ``pytorch_model.bin``); other
    ``.bin`` files (``training_args.bin``) are no weights."""
    names = set(names)
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if shards:
        return shards
    index = os.path.join(folder, BIN_INDEX)
    if BIN_INDEX in names:
        try:
            with open(index, encoding="utf-8") as f:
                listed = json.load(f).get("weight_map", {}).values()
        except (OSError, ValueError, AttributeError):
            return []
        return sorted({str(n) for n in listed} & names)
    return [BIN_WEIGHTS] if BIN_WEIGHTS in names else []


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


def lora_problem(folder: str, targets: str | None) -> str | None:
    """Why peft would refuse LoRA on the model in ``folder`` with ``--lora-target-modules``
    ``targets`` (crf/replica/lora.py ``target_problem``), from its meta build; None when it
    would not, or the model is not built here (a replica's setup checks it then)."""
    model = meta_model(folder)
    if model is None:
        return None
    from crf.replica.lora import target_problem

    return target_problem(model, targets, folder)


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
        if "auto_map" in json.loads(config):
            return None  # the repo's own code: only a replica (with --trust-remote-code) runs it
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from crf.replica.model import quiet_transformers

        with quiet_transformers():
            config = AutoConfig.from_pretrained(
                folder, local_files_only=True, trust_remote_code=False
            )
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


def stored_names(folder: str, shards: Iterable[str]) -> set[str] | None:
    """The tensor names the safetensors files hold (headers only); None when one cannot be
    read (a damaged file is the weights check's to report)."""
    names: set[str] = set()
    for shard in shards:
        try:
            names |= set(header_shapes(os.path.join(folder, shard)))
        except (OSError, ValueError, struct.error):
            return None
    return names


def missing_weights(folder: str, shards: Iterable[str]) -> list[str]:
    """The tensors the model needs that the checkpoint lacks, as ``from_pretrained`` would
    find them: a tied tensor stored under either name counts, non-persistent buffers are not
    needed, and a checkpoint saved from the base model (no ``model.`` prefix) is matched as
    transformers matches it. When a stored name matches no tensor of the model (a checkpoint
    in an older naming that transformers converts on load), nothing is claimed."""
    model = meta_model(folder)
    stored = stored_names(folder, list(shards)) if model is not None else None
    if model is None or not stored:
        return []
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    params = model.state_dict(keep_vars=True)  # tied tensors are one object under two names
    sharing: dict[int, list[str]] = {}
    for name, tensor in params.items():
        sharing.setdefault(id(tensor), []).append(name)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})

    def spellings(name: str) -> set[str]:
        bare = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        return {name, bare}

    known = set().union(*(spellings(n) for n in params))
    if not stored <= known:
        return []  # names transformers renames on load: the replica's load will say
    missing = []
    for name, tensor in params.items():
        names = set(sharing[id(tensor)]) | ({tied[name]} if name in tied else set())
        if not any(spellings(n) & stored for n in names):
            missing.append(name)
    return missing
