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


@dataclass
class Exported:
    """What :func:`export` did: where the model went and which files."""

    dest: str
    files: list[str]


def export(
    run_id: str,
    dest: str,
    *,
    store: str | None = None,
    force: bool = False,
    merge: bool = False,
    base_model: str | None = None,
    api: Any = None,
    step: Callable[[str], None] = lambda _: None,
) -> Exported:
    """Copy run ``run_id``'s ``model/`` to ``dest`` (a folder, or ``hf://org/name``; ``api``:
    the HfApi to push with, for tests). With ``merge``, a LoRA adapter is folded into its base
    (``base_model``, else the run's model) and the merged model is what goes; ``step`` hears
    the merge's stages (for a progress line)."""
    from crf.launcher.attach import run_store

    if base_model is not None and not merge:
        raise ExportError("--base-model names the base to merge into: add --merge")
    hub = dest.startswith(HF_PREFIX)
    repo_id = hub_repo(dest) if hub else ""
    target = Path() if hub else local_destination(dest, force)
    st = run_store(run_id, store)  # LaunchError: no such run
    files = model_files(st, run_id)
    if not merge and not hub:
        _copy(st, files, target)  # straight into the folder, a file at a time
        return Exported(str(target), files)
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
        if hub:
            return Exported(push_to_hub(folder, repo_id, run_id, api), files)
        for rel in files:
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / rel, out)
    return Exported(str(target), files)


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
    from crf.launcher.attach import _run_row

    row = _run_row(st) or {}
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
