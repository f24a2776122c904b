"""The trained model comes out of the run: ``model/`` in Hugging Face format.

At the end of a run every replica that finished holds the same weights (the last committed
global state; the summary checks their ``weights_sha256``), so one of them writes the model:
the lowest-ranked replica that finished ok. A replica cannot know for sure that a lower one
will finish, so it asks the run folder: before writing its own result it looks at each lower
rank's result and waits for it while that replica is still heard from (its heartbeat is
younger than the exchange's alive window, as for a quorum). A lower replica that finished ok
writes the model itself; one that failed, or fell silent, leaves it to the next. Two
replicas may both write (a lower one failed, was restarted and finished after all; one was
silent for long while it uploaded): they write the same bytes.

The model is saved with the libraries' own ``save_pretrained`` (``model.safetensors``,
``config.json``, ``generation_config.json``; the tokenizer's files; for a peft model, the
adapter) into a temp folder and uploaded file by file through the run store, the config last
(:data:`COMPLETE_MARKERS`): ``crf export`` takes ``model/`` as whole once one is there.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crf import layout
from crf.store import ObjectNotFound, RunStore

log = logging.getLogger(__name__)

#: uploaded last: model/ is complete once one of these is in it (a full model's config, or
#: a peft adapter's)
COMPLETE_MARKERS = ("config.json", "adapter_config.json")


def is_lowest_survivor(
    store: RunStore, rank: int, silent_after_s: float, poll_s: float = 0.2
) -> bool:
    """Whether no lower rank finished ok (it would write the model). Waits for each lower
    rank's result while that replica's process is heard from (``Heartbeat.seen_at``: its
    news, or the beats that keep it alive through a long step such as writing a large model
    file) within ``silent_after_s``; a replica silent for longer leaves it to the next, so
    at worst two write the same files."""
    for k in range(rank):
        while True:
            status = _result_status(store, k)
            if status == "ok":
                return False
            if status is not None or _silent(store, k, silent_after_s):
                break  # failed or gone: the next one down decides
            time.sleep(poll_s)
    return True


def _result_status(store: RunStore, rank: int) -> str | None:
    try:
        return str(store.get_json(layout.result_key(rank)).get("status"))
    except (ObjectNotFound, ValueError, AttributeError):
        return None


def _silent(store: RunStore, rank: int, silent_after_s: float) -> bool:
    try:
        beat = layout.Heartbeat.from_dict(store.get_json(layout.heartbeat_key(rank)))
        return time.time() - beat.seen_at > silent_after_s
    except (ObjectNotFound, ValueError, TypeError, AttributeError):
        return True


def save_model(
    store: RunStore,
    model: Any,
    tokenizer: Any | None = None,
    on_file: Callable[[], None] = lambda: None,
) -> list[str]:
    """Write ``model`` (and ``tokenizer``) to ``model/`` in Hugging Face format; returns the
    keys written, the completing marker last. ``on_file`` is called after each upload (the
    replica's heartbeat: the replicas above it wait while it is heard from)."""
    with tempfile.TemporaryDirectory(prefix="crf-model-") as tmp:
        model.save_pretrained(tmp)  # safetensors is the libraries' default
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name in COMPLETE_MARKERS)  # stable: markers last
        keys = []
        for path in files:
            key = layout.model_key(path.relative_to(tmp).as_posix())
            store.put(key, path.read_bytes())
            keys.append(key)
            on_file()
    log.info("wrote the trained model: %s", ", ".join(keys))
    return keys


def finish_trained(ctx: Any, model: Any, tokenizer: Any, start: int) -> dict[str, Any]:
    """What a job returns when its replica (re)starts with every inner step trained (it was
    killed writing ``model/``, or a resume found its training done): the final global
    weights go into ``model`` (``ctx.restore_final``) and are saved at the end as an
    uninterrupted replica's would be, so its result reports the same loss and
    ``weights_sha256`` and the weights it writes are byte for byte the same (a config
    field the trainer would set while it trains, such as ``use_cache``, is not set: it
    trains nothing). The job's metrics are those the replica wrote when it finished
    training (``ctx.trained_metrics``: held-out scores, the last round's loss and reward),
    as an uninterrupted replica reports them; a context without those calls (a job run by
    hand) gets the counts alone."""
    if hasattr(ctx, "restore_final"):
        ctx.restore_final(model)
    if hasattr(ctx, "save_model_at_end"):
        ctx.save_model_at_end(model, tokenizer)
    trained = ctx.trained_metrics() if hasattr(ctx, "trained_metrics") else {}
    return {**trained, "resumed_at_step": start, "steps_trained": 0}


def stored_dtype(name: str) -> str | None:
    """The dtype model ``name``'s checkpoint is stored in, as its config.json says
    (``dtype``, or the older ``torch_dtype``; a multimodal model's text config), read from
    this machine's copy (a folder, or the Hub cache its load filled); None when unsaid. The
    run trains and saves fp32 master weights whatever the checkpoint's dtype, so ``crf
    export`` says when they are twice the size of what was given."""
    import json
    import os

    from huggingface_hub import try_to_load_from_cache

    folder = os.path.expanduser(name)
    path = os.path.join(folder, "config.json") if os.path.isdir(folder) else None
    try:
        path = path or try_to_load_from_cache(name, "config.json")
        with open(str(path), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, TypeError):  # not here (a cache miss), not JSON, not an id
        return None
    for where in (config, config.get("text_config") or {}):
        value = where.get("dtype") or where.get("torch_dtype") if isinstance(where, dict) else None
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def model_complete(store: RunStore) -> bool:
    """Whether ``model/`` holds a whole model (its marker landed)."""
    return any(store.exists(layout.model_key(name)) for name in COMPLETE_MARKERS)
