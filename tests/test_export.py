"""The trained model comes out of a run: the lowest replica that finished
writes ``model/`` in Hugging Face format; ``crf export RUN DEST`` copies it to a folder or
pushes it to a Hub repo, and refuses in one line when there is nothing (yet) to export or
the folder is not empty. (The end-to-end run that writes and exports a model is
tests/test_e2e_local.py's lm run.)"""

from __future__ import annotations

import os
import socket
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
from tests.emulators.hf_hub import HubEmulator

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
    assert not list(tmp_path.glob(".crf-export-*"))  # staged beside dest, then moved in

    # a folder that is not empty is refused, unless --force
    with pytest.raises(ExportError, match="not empty.*--force"):
        export(RUN, str(dest), store=base)
    export(RUN, str(dest), store=base, force=True)


def _set_status(store: RunStore, status: str) -> None:
    if status == "starting":  # a launch whose driver (this process) has started no replica
        record = {"launch": 0, "started_at": time.time(), "host": socket.gethostname(),
                  "pid": os.getpid(), "backend": "local"}  # fmt: skip
        store.put_json(layout.launch_key(0), record)
    elif status == "running":
        store.put_json(layout.heartbeat_key(0), {"rank": 0, "updated_at": time.time()})
    elif status != "stopped":
        store.put_json(layout.RESULT, {"status": status, "launch": 0})


@pytest.mark.parametrize(
    ("status", "says"),
    [
        ("starting", "is still starting its replicas"),
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


def test_export_to_the_hub_creates_the_repo_and_uploads_the_folder(tmp_path, monkeypatch) -> None:
    """`crf export RUN hf://ORG/NAME` through the real huggingface_hub client against a
    loopback Hub: the repo is created (private), the model lands in one commit; a second
    export to the same repo is a new commit; a wrong token is one line."""
    store, base = _run(tmp_path)
    model, tok = _tiny()
    save_model(store, model, tok)
    runner = CliRunner()
    with HubEmulator(tmp_path / "hub") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        for _ in range(2):
            res = runner.invoke(app, ["export", RUN, "hf://my-org/my-model", "--store", base])
            assert res.exit_code == 0, res.output
        assert f"{hub.endpoint}/my-org/my-model/commit/" in res.output
        files = hub.files("my-org/my-model")
        assert hub.private["my-org/my-model"] and len(hub.commits) == 2
        assert files["model.safetensors"] == store.get(layout.model_key("model.safetensors"))
        assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(files)
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        res = runner.invoke(app, ["export", RUN, "hf://my-org/my-model", "--store", base])
        assert res.exit_code == 2 and "cannot push to hf://my-org/my-model" in res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
    with pytest.raises(ExportError, match="hf://ORG/NAME"):
        export(RUN, "hf://just-a-name", store=base)


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


def test_a_lower_replica_kept_alive_through_a_long_write_is_waited_for(tmp_path) -> None:
    """A replica busy writing a large model file has no news for minutes, but its heartbeat
    thread keeps ``alive_at`` fresh: the replicas above it wait for its result instead of
    writing the same files alongside it."""
    store, _ = _run(tmp_path)
    now = time.time()
    store.put_json(
        layout.heartbeat_key(0),
        {"rank": 0, "phase": "saving", "updated_at": now - 100, "alive_at": now},
    )
    later = threading.Timer(0.5, lambda: store.put_json(layout.result_key(0), {"status": "ok"}))
    later.start()
    try:
        assert is_lowest_survivor(store, 1, silent_after_s=30, poll_s=0.05) is False
    finally:
        later.join()


def test_a_peft_model_exports_its_adapter(tmp_path) -> None:
    """With LoRA the model/ is the adapter (peft's own save_pretrained), complete once its
    adapter_config.json landed, and loads back onto the base model with the same weights."""
    peft = pytest.importorskip("peft")
    store, base = _run(tmp_path)
    model, tok = _tiny()
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    keys = save_model(store, lora, tok)
    assert keys[-1] == layout.model_key("adapter_config.json") and model_complete(store)
    assert layout.model_key("adapter_model.safetensors") in keys
    dest = tmp_path / "adapter"
    export(RUN, str(dest), store=base)
    again = peft.PeftModel.from_pretrained(_tiny()[0], dest)
    assert weights_sha256(again) == weights_sha256(lora)


def _adapter_run(tmp_path: Path, *, base_dtype: torch.dtype = torch.float32, model: str = ""):
    """A run whose model/ is a trained-looking LoRA adapter (random, non-zero B) on a tiny
    base saved in ``base_dtype`` to tmp_path/base; run.json names that base as --model."""
    peft = pytest.importorskip("peft")
    base_dir = tmp_path / "base"
    model_, tok = _tiny()
    model_.to(base_dtype).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    store = RunStore((tmp_path / "runs" / RUN).as_uri())
    spec = RunSpec(run_id=RUN, run_uri=store.uri, replicas=2, sync_every=2, rounds=1,
                   model=model or str(base_dir), lora_rank=2).validate()  # fmt: skip
    store.put(layout.RUN_SPEC, spec.to_json().encode())
    base = AutoModelForCausalLM_fp32(base_dir)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                             init_lora_weights=False)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(5)
        lora = peft.get_peft_model(base, config)
    save_model(store, lora, tok)
    return store, str(tmp_path / "runs"), base_dir, lora, tok


def AutoModelForCausalLM_fp32(folder: Path) -> torch.nn.Module:  # noqa: N802
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_merge_folds_the_adapter_into_the_runs_base(tmp_path) -> None:
    """`crf export RUN DEST --merge`: one plain model (no adapter weights, no peft model
    card) whose outputs are the adapter-on-base outputs, with the run's tokenizer; the base is
    the run's --model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store, base, base_dir, lora, tok = _adapter_run(tmp_path)
    dest = tmp_path / "merged"
    res = CliRunner().invoke(app, ["export", RUN, str(dest), "--store", base, "--merge"])
    assert res.exit_code == 0 and "exported" in res.output, res.output
    files = {p.name for p in dest.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not files & {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    merged = AutoModelForCausalLM.from_pretrained(dest)
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert next(merged.parameters()).dtype == torch.float32
    torch.testing.assert_close(_logits(merged), _logits(lora), rtol=1e-5, atol=1e-5)
    base_model = AutoModelForCausalLM_fp32(base_dir)
    assert not torch.allclose(_logits(merged), _logits(base_model), atol=1e-3)  # it moved
    assert AutoTokenizer.from_pretrained(dest)("cab")["input_ids"] == tok("cab")["input_ids"]


def test_merge_keeps_the_bases_stored_dtype_and_rounds_once(tmp_path) -> None:
    """A bf16 base: the adapter is folded in fp32 and the merged weights are cast to bf16
    once, so they are exactly the fp32 merge rounded, and the model is the base's size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    store, base, base_dir, lora, _ = _adapter_run(tmp_path, base_dtype=torch.bfloat16)
    dest = tmp_path / "merged"
    export(RUN, str(dest), store=base, merge=True)
    merged = AutoModelForCausalLM.from_pretrained(dest, dtype="auto")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    assert str(AutoConfig.from_pretrained(dest).dtype).endswith("bfloat16")
    want = {k: v.to(torch.bfloat16) for k, v in lora.merge_and_unload().state_dict().items()}
    got = merged.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    size = (dest / "model.safetensors").stat().st_size
    assert size <= 1.05 * (base_dir / "model.safetensors").stat().st_size


def test_merge_refusals_are_one_line(tmp_path) -> None:
    """What --merge cannot do says what to give instead, and writes nothing."""
    runner = CliRunner()
    store, base, base_dir, _, _ = _adapter_run(tmp_path)
    out = tmp_path / "out"

    def refused(*args: str) -> str:
        res = runner.invoke(app, ["export", RUN, str(out), "--store", base, *args])
        assert res.exit_code == 2, res.output
        assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
        assert not out.exists() or not any(out.iterdir())
        assert not list(tmp_path.glob(".crf-export-*"))  # the staging folder is gone
        return res.output

    assert "add --merge" in refused("--base-model", str(base_dir))
    assert "not a folder on this machine" in refused("--merge", "--base-model", "./nowhere")
    other = tmp_path / "other"  # another architecture: wider layers
    tok = char_tokenizer("abc")
    tiny_qwen2(tok, seed=1, hidden_size=32, num_layers=1, num_heads=2).save_pretrained(other)
    assert "does not fit the base model" in refused("--merge", "--base-model", str(other))
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    assert "cannot load the base model" in refused("--merge", "--base-model", str(no_config))
    # a whole model is exported as it is
    model, tok = _tiny()
    full = RunStore((tmp_path / "full" / RUN).as_uri())
    full.put(layout.RUN_SPEC, store.get(layout.RUN_SPEC))
    save_model(full, model, tok)
    res = runner.invoke(app, ["export", RUN, str(out), "--store", str(tmp_path / "full"),
                              "--merge"])  # fmt: skip
    assert res.exit_code == 2 and "not a LoRA adapter" in res.output, res.output


def test_merge_of_a_run_on_the_embedded_model_asks_for_the_base(tmp_path) -> None:
    """No --model in run.json and an adapter that names no base: one line asking for it."""
    from crf.launcher.merge import MergeError, base_model_of

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": null}')
    with pytest.raises(MergeError, match="give --base-model"):
        base_model_of({"model": None}, adapter, None)
    assert base_model_of({"model": None}, adapter, "org/base") == "org/base"
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "org/named"}')
    assert base_model_of({}, adapter, None) == "org/named"
    assert base_model_of({"model": "org/run"}, adapter, None) == "org/run"
    # a cloud run's folder in --workdir: the launching machine's copy, when it is here
    (tmp_path / "code" / "models" / "base").mkdir(parents=True)
    shipped = {"model": "./models/base", "workdir": str(tmp_path / "code")}
    assert base_model_of(shipped, adapter, None) == str(tmp_path / "code" / "models" / "base")
    assert base_model_of({**shipped, "workdir": "/gone"}, adapter, None) == "./models/base"
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(MergeError, match="adapter_config.json is not valid JSON"):
        base_model_of({}, adapter, None)


def _sft_run_of_an_fp16_model(tmp_path: Path) -> tuple[Path, str]:
    """A real sft run (1 replica process, 2 steps) of a tiny model stored in float16; the
    run's folder and its store."""
    import json

    from transformers import AutoModelForCausalLM

    from crf.executors.local import LocalProcessExecutor
    from crf.launcher import driver
    from tests.hub_models import save_tiny_repo

    folder = tmp_path / "fp16"
    save_tiny_repo(folder)
    AutoModelForCausalLM.from_pretrained(folder).to(torch.float16).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{w}=", "completion": w[::-1]}) + "\n"
                            for w in ["ab", "bca", "cab", "dd"] * 2))  # fmt: skip
    summary = driver.launch(
        {"job": "sft", "replicas": 1, "sync_every": 2, "rounds": 1, "run_id": "half",
         "model": str(folder), "dataset": str(data), "device": "cpu", "round_timeout_s": 120.0,
         "job_config": {"per_device_train_batch_size": 4, "max_length": 16}},
        store=str(tmp_path / "runs"), env={"CRF_LOG_LEVEL": "WARNING"},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=0),
        progress=False, report=False, plot=False, poll_s=0.1, timeout_s=300,
    )  # fmt: skip
    assert summary["status"] == "ok", [r.get("error") for r in summary["replicas"]]
    return folder, str(tmp_path / "runs")


@pytest.mark.e2e
def test_an_fp16_model_exports_the_fp32_master_weights_saying_so_or_cast_with_dtype(
    tmp_path,
) -> None:
    """A run trains fp32 master weights whatever --model's dtype: ``crf export`` writes them
    as they are (the most precise copy) and says they are twice the size of the float16
    model given, and how to write float16; ``--dtype float16`` writes exactly those weights
    rounded once to float16, with config.json saying so, at about half the size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    runner = CliRunner()
    folder, runs = _sft_run_of_an_fp16_model(tmp_path)
    plain = runner.invoke(app, ["export", "half", str(tmp_path / "out32"), "--store", runs])
    assert plain.exit_code == 0, plain.output
    said = " ".join(plain.output.split())
    assert (
        "note: the weights are the run's fp32 master weights, twice the size of the float16 "
        "model it started from; --dtype float16 writes them in float16" in said
    ), said
    master = AutoModelForCausalLM.from_pretrained(tmp_path / "out32", dtype="auto")
    assert {p.dtype for p in master.parameters()} == {torch.float32}

    half = runner.invoke(app, ["export", "half", str(tmp_path / "out16"), "--store", runs,
                               "--dtype", "float16"])  # fmt: skip
    assert half.exit_code == 0 and "note:" not in half.output, half.output
    assert str(AutoConfig.from_pretrained(tmp_path / "out16").dtype).endswith("float16")
    cast = AutoModelForCausalLM.from_pretrained(tmp_path / "out16", dtype="auto")
    want = {k: v.to(torch.float16) for k, v in master.state_dict().items()}
    got = cast.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    sizes = [(tmp_path / d / "model.safetensors").stat().st_size for d in ("out16", "out32")]
    assert sizes[0] < 0.55 * sizes[1], sizes
    assert (tmp_path / "out16" / "tokenizer.json").is_file()

    bf16 = runner.invoke(app, ["export", "half", str(tmp_path / "outbf"), "--store", runs,
                               "--dtype", "bf16"])  # fmt: skip
    assert bf16.exit_code == 0, bf16.output
    assert "the weights are written in bfloat16; the model the run started from was float16" in (
        " ".join(bf16.output.split())
    )


def test_dtype_refusals_are_one_line_and_an_fp32_run_has_nothing_to_note(tmp_path) -> None:
    """An unknown --dtype, a LoRA adapter without --merge, and float16 that cannot hold a
    weight are refused in one line, writing nothing; a run of an fp32 model (the embedded
    default's) exports byte for byte, with no note."""
    store, base = _run(tmp_path)
    model, tok = _tiny()
    with torch.no_grad():
        model.model.embed_tokens.weight[1, 0] = 1e6  # past float16's 65504
    save_model(store, model, tok)
    store.put_json(layout.result_key(0), {"rank": 0, "status": "ok", "model_dtype": "float32"})
    done = export(RUN, str(tmp_path / "same"), store=base)
    assert done.note is None
    for rel in done.files:
        assert (tmp_path / "same" / rel).read_bytes() == store.get(layout.model_key(rel))
    runner = CliRunner()
    for args, says in [
        (["--dtype", "fp8"], "--dtype 'fp8' is unknown; choose float16, bfloat16 or float32"),
        (["--dtype", "float16"], "model.embed_tokens.weight holds values past float16's range"),
    ]:
        out = runner.invoke(app, ["export", RUN, str(tmp_path / "o"), "--store", base, *args])
        assert out.exit_code != 0 and says in " ".join(out.output.split()), out.output
        assert len(out.output.strip().splitlines()) == 1, out.output
        assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    bf16 = export(RUN, str(tmp_path / "bf16"), store=base, dtype="bfloat16")
    assert (
        bf16.note
        == "the weights are written in bfloat16; the model the run started from was float32"
    )

    lora_store, lora_base, _, _, _ = _adapter_run(tmp_path / "lora")
    with pytest.raises(ExportError, match="LoRA adapter: add --merge"):
        export(RUN, str(tmp_path / "adapter16"), store=lora_base, dtype="float16")
