"""``crf export RUN DEST``: the trained model out of a run folder.

A run that finished writes ``model/`` in Hugging Face format (:mod:`crf.replica.export`).
This copies it to a local folder, or pushes it to a Hub model repo (``hf://org/name``)
through ``huggingface_hub.HfApi``: ``create_repo(exist_ok=True)`` (private when it creates
one) then ``upload_folder`` - one commit, token from ``HF_TOKEN`` (and the Hub from
``HF_ENDPOINT`` when set). Every refusal is one line
saying what to do: no such run, no ``model/`` yet (the run is still starting or running, failed, was
cancelled, stopped, or its job saves no model), a destination that is not empty.
With ``merge`` a LoRA run's adapter is first folded into its base model
(:mod:`crf.launcher.merge`), and what is copied or pushed is the merged model.

A run trains, and saves, fp32 master weights whatever dtype ``--model`` was stored in, so
the model/ of a bf16 or fp16 model is twice its size. That is the most precise copy of what
the run learned, so it stays the default, and :attr:`Exported.note` says so (each replica
records the checkpoint's dtype in its result); ``dtype`` writes the weights in float16 or
bfloat16 instead (:func:`cast_folder`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crf import layout
from crf.launcher.errors import LaunchError

HF_PREFIX = "hf://"


class ExportError(LaunchError):
    """The model cannot be exported (one line: what to do)."""


#: ``crf export --dtype`` values (and --precision's spellings of them) -> torch dtype names
EXPORT_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # fmt: skip


@dataclass
class Exported:
    """What :func:`export` did: where the model went and which files; ``note``: one line on
    the weights' dtype when it is not the one ``--model`` was stored in."""

    dest: str
    files: list[str]
    note: str | None = None


def export(
    run_id: str,
    dest: str,
    *,
    store: str | None = None,
    force: bool = False,
    merge: bool = False,
    base_model: str | None = None,
    dtype: str | None = None,
    api: Any = None,
    step: Callable[[str], None] = lambda _: None,
) -> Exported:
    """Copy run ``run_id``'s ``model/`` to ``dest`` (a folder, or ``hf://org/name``; ``api``:
    the HfApi to push with, for tests). With ``merge``, a LoRA adapter is folded into its base
    (``base_model``, else the run's model) and the merged model is what goes; ``step`` hears
    the merge's stages (for a progress line). ``dtype`` (float16, bfloat16, float32) casts
    the weights written; without it they go as the run saved them (fp32 master weights)."""
    from crf.launcher.attach import run_store
    from crf.launcher.merge import is_adapter

    if base_model is not None and not merge:
        raise ExportError("--base-model names the base to merge into: add --merge")
    cast = export_dtype(dtype)
    hub = dest.startswith(HF_PREFIX)
    repo_id = hub_repo(dest) if hub else ""
    target = Path() if hub else local_destination(dest, force)
    st = run_store(run_id, store)  # LaunchError: no such run
    files = model_files(st, run_id)
    if cast and is_adapter(files) and not merge:
        raise ExportError(
            f"--dtype casts a whole model and run {run_id}'s model/ is a LoRA adapter: add "
            "--merge (the merged model is written in --dtype)"
        )
    note = None if merge or is_adapter(files) else dtype_note(st, cast)
    if not merge and not hub and not cast:
        _copy(st, files, target)  # straight into the folder, a file at a time
        return Exported(str(target), files, note)
    # a Hub push uploads a folder; a merge writes the merged model beside the target (the
    # same disk, so each file is then moved, not copied, and /tmp need not hold a model)
    where = None if hub else _nearest_folder(target)
    with tempfile.TemporaryDirectory(prefix=".crf-export-", dir=where) as tmp:
        folder = Path(tmp) / "model"
        _copy(st, files, folder)
        if merge:
            merged = Path(tmp) / "merged"
            files = _merged(st, run_id, files, folder, merged, base_model, step)
            folder = merged
        if cast:
            step(f"writing the weights as {cast}")
            cast_folder(folder, files, cast)
        if hub:
            return Exported(push_to_hub(folder, repo_id, run_id, api), files, note)
        for rel in files:
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / rel, out)
    return Exported(str(target), files, note)


def export_dtype(dtype: str | None) -> str | None:
    """The torch dtype name of ``--dtype`` (None: not given); ExportError for another."""
    if dtype is None:
        return None
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype!r} is unknown; choose float16, bfloat16 or float32")
    return EXPORT_DTYPES[dtype]


def given_dtype(st: Any) -> str | None:
    """The dtype the run's ``--model`` was stored in, as its replicas recorded it (None: no
    replica did: no ``--model``, or a run of an older crf)."""
    from crf.store import ObjectNotFound

    try:
        replicas = int(st.get_json(layout.RUN_SPEC).get("replicas") or 0)
    except (ObjectNotFound, ValueError, TypeError, AttributeError, OSError):
        return None
    for rank in range(replicas):
        try:
            value = st.get_json(layout.result_key(rank)).get("model_dtype")
        except (ObjectNotFound, ValueError, AttributeError, OSError):
            continue
        if isinstance(value, str) and value:
            return value
    return None


def dtype_note(st: Any, cast: str | None) -> str | None:
    """One line when the weights written are not in the dtype ``--model`` was stored in:
    fp32 master weights of a half-precision model (twice its size), or ``--dtype``'s cast."""
    given = given_dtype(st)
    if given is None or given == (cast or "float32"):
        return None
    if cast is None and given in ("float16", "bfloat16"):
        return (
            f"the weights are the run's fp32 master weights, twice the size of the {given} "
            f"model it started from; --dtype {given} writes them in {given}"
        )
    return f"the weights are written in {cast}; the model the run started from was {given}"


def local_destination(dest: str, force: bool) -> Path:
    """The folder ``dest`` names, checked before anything is read or written; ExportError in
    one line for a blank name, a URL with a typo (``hf:/org/name``, ``s3:/b``: it would
    become a local folder named ``hf:``), a URL this does not write to (s3://, gs://: export
    to a folder, then copy it with that store's tools), a file, a path under a file, or a
    folder that is not empty (without ``force``). ``file://`` URLs are folders."""
    from crf.store import StoreURIError, check_uri, split_uri

    if not dest.strip():
        raise ExportError(
            f"DEST is empty: give a folder (created if needed) or {HF_PREFIX}ORG/NAME"
        )
    try:
        check_uri(dest, "DEST")
    except StoreURIError as e:
        raise ExportError(f"{e}; DEST is a folder or {HF_PREFIX}ORG/NAME") from None
    scheme, sep, _ = dest.partition("://")
    if sep and scheme != "file":
        raise ExportError(
            f"DEST {scheme}://... is not a destination crf export writes to: give a folder (then "
            f"copy it to {scheme}:// with that store's tools) or {HF_PREFIX}ORG/NAME"
        )
    target = Path(split_uri(dest)[1] if sep else dest).expanduser()
    if target.exists() and not target.is_dir():
        raise ExportError(f"DEST {dest} exists and is not a folder: give a folder to export into")
    above = target.absolute()
    while not above.exists():
        above = above.parent
    if not above.is_dir():  # a path under a file
        raise ExportError(f"DEST {dest}: {above} is a file, not a folder: give a folder")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ExportError(f"DEST {dest} is not empty: give an empty or new folder, or --force")
    return target


def _nearest_folder(path: Path) -> Path:
    """``path``'s nearest existing ancestor folder (``path`` itself when it is one)."""
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


def _merged(
    st: Any,
    run_id: str,
    files: list[str],
    adapter: Path,
    out: Path,
    base_model: str | None,
    step: Callable[[str], None],
) -> list[str]:
    """The adapter in ``adapter`` merged into its base, written to ``out``; its files."""
    from crf.launcher.merge import base_model_of, is_adapter, merge_adapter

    if not is_adapter(files):
        raise ExportError(
            f"run {run_id}'s model/ is a whole model, not a LoRA adapter: export it without --merge"
        )
    from crf.store import ObjectNotFound

    try:
        spec = st.get_json(layout.RUN_SPEC)
    except (ObjectNotFound, ValueError):  # no run.json: the adapter names its base
        spec = {}
    spec = spec if isinstance(spec, dict) else {}
    base = base_model_of(spec, adapter, base_model)
    remote = bool(spec.get("trust_remote_code", False))
    return merge_adapter(adapter, base, out, trust_remote_code=remote, step=step)


def model_files(st: Any, run_id: str) -> list[str]:
    """The files under the run's ``model/`` (relative names); ExportError, saying why, when
    there is no whole model there."""
    from crf.replica.export import model_complete

    if not model_complete(st):
        raise ExportError(_no_model_why(st, run_id))
    root = st.path(layout.MODEL_DIR).rstrip("/")
    names = []
    for path in st.fs.find(root):
        rel = str(path)[len(root) :].lstrip("/")
        if rel and not any(part.startswith(".") for part in rel.split("/")):  # temp files
            names.append(rel)
    return sorted(names)


def _no_model_why(st: Any, run_id: str) -> str:
    from crf.launcher.attach import run_row

    row = run_row(st) or {}
    status = row.get("status")
    why = {
        "starting": "is still starting its replicas: its model/ is written when it finishes",
        "running": "is still running: its model/ is written when it finishes",
        "failed": "failed, so it wrote no model/ (`crf status` says why; once that is "
        f"fixed, `crf launch --resume {run_id}` continues it)",
        "cancelled": "was cancelled before it finished, so it wrote no model/",
        "stopped": "stopped before it finished (its driver died?), so it wrote no model/ "
        f"(`crf status` tells more; `crf launch --resume {run_id}` continues it)",
        "ok": "finished but wrote no model/: its job does not save one "
        "(a job calls ctx.save_model_at_end(model, tokenizer))",
    }.get(str(status), f"has no model/ (status {status})")
    return f"run {run_id} {why}"


def _copy(st: Any, files: list[str], target: Path) -> None:
    for rel in files:
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.crf-tmp")
        tmp.write_bytes(st.get(layout.model_key(rel)))
        os.replace(tmp, out)


def hub_repo(dest: str) -> str:
    """``hf://org/name`` -> ``org/name``; ExportError for anything else."""
    repo_id = dest[len(HF_PREFIX) :].strip("/")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise ExportError(f"{dest}: a Hub destination is hf://ORG/NAME (a model repo)")
    return repo_id


def push_to_hub(folder: Path, repo_id: str, run_id: str, api: Any = None) -> str:
    """Create the model repo if needed (private) and upload ``folder`` as one commit."""
    if api is None:
        from huggingface_hub import HfApi

        # HF_ENDPOINT read now (the library reads it once, at import)
        api = HfApi(
            endpoint=os.environ.get("HF_ENDPOINT") or None, token=os.environ.get("HF_TOKEN")
        )
    try:
        api.create_repo(repo_id, repo_type="model", private=True, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message=f"crf export of run {run_id}",
        )
    except Exception as e:  # noqa: BLE001 - the client's errors, in one line
        hint = "" if os.environ.get("HF_TOKEN") else " (HF_TOKEN is not set)"
        raise ExportError(f"cannot push to hf://{repo_id}: {type(e).__name__}: {e}{hint}") from None
    return str(getattr(info, "commit_url", None) or f"{HF_PREFIX}{repo_id}")


def cast_folder(folder: Path, files: list[str], dtype: str) -> None:
    """The model in ``folder`` with its floating-point weights cast to ``dtype`` (a torch
    dtype name), each safetensors file rewritten in place with its metadata; config.json
    (and a shard index's total size) say the new dtype. ExportError when float16 cannot
    hold a weight (past ±65504: it would become inf)."""
    import json

    import torch

    target = getattr(torch, dtype)
    total = 0
    for rel in files:
        if rel.endswith(".safetensors"):
            total += _cast_file(folder / rel, target, dtype)
    config = folder / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        data["dtype"] = dtype
        if "torch_dtype" in data:
            data["torch_dtype"] = dtype
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        data.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _cast_file(path: Path, target: Any, dtype: str) -> int:
    """Rewrite one safetensors file with its floating-point tensors in ``target``; returns
    the bytes of its tensors."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out: dict[str, Any] = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
            tensor = f.get_tensor(name)
            if tensor.is_floating_point() and tensor.dtype != target:
                cast = tensor.to(target)
                if bool(torch.isinf(cast).any()) and not bool(torch.isinf(tensor).any()):
                    raise ExportError(
                        f"--dtype {dtype}: {name} holds values past {dtype}'s range (it would "
                        "hold inf): export it as bfloat16 or float32"
                    )
                tensor = cast
            out[name] = tensor.contiguous()
    tmp = path.with_name(f".{path.name}.crf-tmp")
    save_file(out, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return sum(t.numel() * t.element_size() for t in out.values())
