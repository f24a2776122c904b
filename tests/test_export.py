"""The trained model comes out of a run (issue 15, item 8): the lowest replica that finished
writes ``model/`` in Hugging Face format; ``crf export RUN DEST`` copies it to a folder or
pushes it to a Hub repo, and refuses in one line when there is nothing (yet) to export or
the folder is not empty. (The end-to-end run that writes and exports a model is
tests/test_e2e_local.py's lm run.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from crf import layout
from crf.composer.tiny import char_tokenizer, tiny_qwen2
from crf.launcher.cli import app
from crf.launcher.export import ExportError, export
from crf.replica.context import weights_sha256
from crf.replica.export import is_lowest_survivor, model_complete, save_model
from crf.spec import RunSpec
from crf.store import RunStore

RUN = "exp"


def _run(tmp_path: Path) -> tuple[RunStore, str]:
    """An empty run folder (run.json only) in the store tmp_path/runs."""
    base = tmp_path / "runs"
    store = RunStore((base / RUN).as_uri())
    spec = RunSpec(run_id=RUN, run_uri=store.uri, replicas=2, sync_every=2, rounds=1).validate()
    store.put(layout.RUN_SPEC, spec.to_json().encode())
    return store, str(base)


def _tiny() -> tuple[torch.nn.Module, object]:
    tok = char_tokenizer("abc")
    return tiny_qwen2(tok, seed=3, hidden_size=16, num_layers=1, num_heads=2), tok


def test_saved_model_exports_to_a_folder_and_loads_with_the_same_weights(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store, base = _run(tmp_path)
    model, tok = _tiny()
    keys = save_model(store, model, tok)
    assert keys[-1] == layout.model_key("config.json")  # the marker lands last
    assert layout.model_key("model.safetensors") in keys and model_complete(store)
    dest = tmp_path / "out"
    done = export(RUN, str(dest), store=base)
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(done.files)
    assert "tokenizer.json" in done.files
    loaded = AutoModelForCausalLM.from_pretrained(dest)
    assert weights_sha256(loaded) == weights_sha256(model)
    assert AutoTokenizer.from_pretrained(dest)("cab")["input_ids"] == tok("cab")["input_ids"]

    # a folder that is not empty is refused, unless --force
    with pytest.raises(ExportError, match="not empty.*--force"):
        export(RUN, str(dest), store=base)
    export(RUN, str(dest), store=base, force=True)


def _set_status(store: RunStore, status: str) -> None:
    if status == "running":
        store.put_json(layout.heartbeat_key(0), {"rank": 0, "updated_at": time.time()})
    elif status != "stopped":
        store.put_json(layout.RESULT, {"status": status, "launch": 0})


@pytest.mark.parametrize(
    ("status", "says"),
    [
        ("running", "is still running"),
        ("failed", "failed, so it wrote no model/"),
        ("stopped", "stopped before it finished"),
        ("ok", "its job does not save one"),
    ],
)
def test_no_model_yet_says_why(tmp_path, status: str, says: str) -> None:
    store, base = _run(tmp_path)
    _set_status(store, status)
    with pytest.raises(ExportError, match=says):
        export(RUN, str(tmp_path / "out"), store=base)
    assert not (tmp_path / "out").exists()


def test_cli_errors_are_one_line(tmp_path) -> None:
    store, base = _run(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["export", "nope", str(tmp_path / "o"), "--store", base])
    assert res.exit_code == 2 and "no run 'nope'" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    _set_status(store, "failed")
    res = runner.invoke(app, ["export", RUN, str(tmp_path / "o"), "--store", base])
    assert res.exit_code == 2 and f"run {RUN} failed" in res.output, res.output
    model, tok = _tiny()
    save_model(store, model, tok)
    res = runner.invoke(app, ["export", RUN, str(tmp_path / "o"), "--store", base])
    assert res.exit_code == 0 and "exported" in res.output, res.output
    assert (tmp_path / "o" / "model.safetensors").is_file()


class FakeHfApi:
    """Records what HfApi would be asked (no Hub here): create_repo, then upload_folder of
    a folder holding the model."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kw}))

    def upload_folder(self, *, folder_path, repo_id, **kw):
        self.calls.append(("upload_folder", {"repo_id": repo_id, **kw}))
        root = Path(folder_path)
        self.uploaded = {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        return type("CommitInfo", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()


def test_export_to_the_hub_creates_the_repo_and_uploads_the_folder(tmp_path) -> None:
    store, base = _run(tmp_path)
    model, tok = _tiny()
    save_model(store, model, tok)
    api = FakeHfApi()
    done = export(RUN, "hf://my-org/my-model", store=base, api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]
    assert api.calls[0][1] == {
        "repo_id": "my-org/my-model", "repo_type": "model", "private": True, "exist_ok": True
    }  # fmt: skip
    assert api.uploaded["model.safetensors"] == store.get(layout.model_key("model.safetensors"))
    assert "config.json" in api.uploaded and done.dest.endswith("/commit/1")
    with pytest.raises(ExportError, match="hf://ORG/NAME"):
        export(RUN, "hf://just-a-name", store=base, api=api)


def test_the_lowest_replica_that_finished_writes_the_model(tmp_path) -> None:
    """Rank 2 defers to a lower rank that finished ok, waits for one still heard from, and
    writes when the lower ones failed or fell silent."""
    store, _ = _run(tmp_path)

    def beat(rank: int, age_s: float) -> None:
        store.put_json(
            layout.heartbeat_key(rank), {"rank": rank, "updated_at": time.time() - age_s}
        )

    store.put_json(layout.result_key(0), {"status": "failed"})
    beat(1, 100)  # silent for longer than the deadline: gone
    assert is_lowest_survivor(store, 2, silent_after_s=30) is True
    store.put_json(layout.result_key(1), {"status": "ok"})
    assert is_lowest_survivor(store, 2, silent_after_s=30) is False

    store.delete(layout.result_key(1))
    beat(1, 0)  # alive: rank 2 waits for its result
    later = threading.Timer(0.5, lambda: store.put_json(layout.result_key(1), {"status": "ok"}))
    later.start()
    t0 = time.monotonic()
    try:
        assert is_lowest_survivor(store, 2, silent_after_s=30, poll_s=0.05) is False
    finally:
        later.join()
    assert time.monotonic() - t0 >= 0.4
    assert is_lowest_survivor(store, 0, silent_after_s=30) is True
