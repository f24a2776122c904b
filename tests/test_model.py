"""Model options (--model, --precision, --device, --lora-rank ...): the device and dtype
decisions, loading a model by Hub id through the loopback Hub with the real clients, and
bit-identical initial weights on every replica (crf/replica/model.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from crf.replica.context import split_model, weights_sha256
from crf.replica.model import (
    Placement,
    choose_device,
    choose_dtype,
    load_pretrained,
    trainable_count,
)
from crf.spec import RunSpec, SpecError
from tests.hub_models import GENERATION_PROMPT, TINY_REPO

ROOT = Path(__file__).resolve().parents[1]
CPU = Placement("cpu", "fp32")


@pytest.mark.parametrize(
    ("requested", "cuda", "want"),
    [("auto", True, "cuda"), ("auto", False, "cpu"), ("cuda", True, "cuda"),
     ("cpu", True, "cpu"), ("cpu", False, "cpu")],
)  # fmt: skip
def test_choose_device(requested: str, cuda: bool, want: str) -> None:
    assert choose_device(requested, cuda) == want


def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="no CUDA GPU"):
        choose_device("cuda", False)


@pytest.mark.parametrize(
    ("requested", "device", "bf16", "want"),
    [("auto", "cuda", True, "bf16"), ("auto", "cuda", False, "fp32"),
     ("auto", "cpu", True, "fp32"), ("auto", "cpu", False, "fp32"),
     ("bf16", "cuda", True, "bf16"), ("bf16", "cpu", False, "bf16"),
     ("fp16", "cuda", False, "fp16"), ("fp32", "cuda", True, "fp32")],
)  # fmt: skip
def test_choose_dtype(requested: str, device: str, bf16: bool, want: str) -> None:
    assert choose_dtype(requested, device, bf16) == want


@pytest.mark.parametrize(
    ("requested", "device", "bf16", "message"),
    [("fp16", "cpu", False, "needs a CUDA GPU"), ("bf16", "cuda", False, "use fp16")],
)
def test_dtypes_the_hardware_cannot_do_are_refused(
    requested: str, device: str, bf16: bool, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        choose_dtype(requested, device, bf16)


def test_trainer_args_follow_the_placement() -> None:
    assert CPU.trainer_args() == {"use_cpu": True, "bf16": False, "fp16": False}
    assert Placement("cuda", "bf16").trainer_args() == {
        "use_cpu": False, "bf16": True, "fp16": False}  # fmt: skip
    assert Placement("cuda", "fp16").trainer_args()["fp16"] is True
    # this machine: the spec's auto resolves to what torch sees
    auto = Placement.for_spec(RunSpec(run_id="r", run_uri="memory://x"))
    assert auto.device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("major", "want"), [(7, "fp32"), (8, "bf16"), (9, "bf16")],
                         ids=["t4-v100", "ampere", "hopper"])  # fmt: skip
def test_auto_is_bf16_only_where_the_gpu_has_it(
    monkeypatch: pytest.MonkeyPatch, major: int, want: str
) -> None:
    """torch.cuda.is_bf16_supported() says yes for a pre-Ampere GPU too (bf16 emulated, which
    makes a tensor but computes slower than fp32): --precision auto is bf16 on compute
    capability 8 and later only, and an explicit bf16 on an older GPU is refused. The GPU is
    simulated where torch reads it (its properties), torch's own check runs as it is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda d: True)  # emulation
    assert torch.cuda.is_bf16_supported()  # what torch says of every one of them
    spec = RunSpec(run_id="r", run_uri="memory://x")
    assert Placement.for_spec(spec) == Placement("cuda", want)
    explicit = RunSpec(run_id="r", run_uri="memory://x", precision="bf16")
    if want == "fp32":
        with pytest.raises(ValueError, match="no bfloat16 of its own"):
            Placement.for_spec(explicit)
    else:
        assert Placement.for_spec(explicit).dtype == "bf16"


def test_model_options_are_validated_before_launch() -> None:
    spec = RunSpec(run_id="r", run_uri="memory://x", model="org/name", lora_rank=4)
    assert spec.validate().lora_alpha == 16
    for field, value, message in [
        ("precision", "fp8", "--precision 'fp8' is unknown; choose one of auto, bf16"),
        ("device", "tpu", "--device 'tpu' is unknown"),
        ("lora_rank", -1, "--lora-rank must be an integer >= 0"),
        ("model", " ", "--model must name a Hub id or a folder"),
    ]:
        bad = RunSpec(run_id="r", run_uri="memory://x", **{field: value})
        with pytest.raises(SpecError, match=message):
            bad.validate()
    with pytest.raises(SpecError, match="no such folder"):
        RunSpec(run_id="r", run_uri="memory://x", model="./no/such/model").validate()
    with pytest.raises(SpecError, match="fp16 needs a CUDA GPU"):
        RunSpec(run_id="r", run_uri="memory://x", precision="fp16", device="cpu").validate()


def test_lora_without_peft_names_the_extra() -> None:
    # a fresh interpreter where peft cannot be imported
    code = (
        "import sys; sys.modules['peft'] = None\n"
        "import importlib.util as u; u.find_spec = lambda n, *a: None if n == 'peft' else "
        "__import__('importlib').machinery.PathFinder.find_spec(n)\n"
        "from crf.spec import RunSpec, SpecError\n"
        "try:\n RunSpec(run_id='r', run_uri='memory://x', lora_rank=4).validate()\n"
        "except SpecError as e:\n print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True)  # fmt: skip
    assert "install composer-replication[lora]" in out.stdout


def _spec(**kw: Any) -> RunSpec:
    return RunSpec(run_id="r", run_uri="memory://x", model=TINY_REPO, **kw)


def test_load_by_hub_id_through_the_real_client(hf_hub: Any, hf_hub_env: dict) -> None:
    model, tokenizer = load_pretrained(_spec(), CPU, seed=0)
    asked = [path for _, path, status in hf_hub.requests if status == 200]
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert any(p.startswith(f"/{TINY_REPO}/resolve/") and p.endswith(name) for p in asked)
    assert (Path(hf_hub_env["HF_HOME"]) / "hub" / "models--crf-test--tiny-qwen2").is_dir()
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "abc="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "abc=" + GENERATION_PROMPT


def test_two_replicas_load_bit_identical_weights(hf_hub: Any, hf_hub_env: dict) -> None:
    a, _ = load_pretrained(_spec(), CPU, seed=3)
    b, _ = load_pretrained(_spec(), CPU, seed=3)
    assert weights_sha256(a) == weights_sha256(b)


def test_lora_adapters_are_seeded_and_only_they_train(hf_hub: Any, hf_hub_env: dict) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, _ = load_pretrained(_spec(lora_rank=4, lora_alpha=8), CPU, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's stream untouched
    b, _ = load_pretrained(_spec(lora_rank=4, lora_alpha=8), CPU, seed=7)
    c, _ = load_pretrained(_spec(lora_rank=4, lora_alpha=8), CPU, seed=8)
    assert weights_sha256(a) == weights_sha256(b) != weights_sha256(c)
    trainable = [n for n, p in a.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # only the adapters are exchanged: one fragment that holds exactly them
    (fragment,) = split_model(a, 1)
    assert fragment is not a
    assert sum(p.numel() for p in fragment.parameters()) == trainable_count(a)
    assert trainable_count(a) < sum(p.numel() for p in a.parameters()) / 4


@pytest.mark.e2e
@pytest.mark.slow
def test_composer_job_trains_a_hub_model_on_two_replicas(
    tmp_path: Path, hf_hub: Any, hf_hub_env: dict
) -> None:
    """2 real replica processes load ``--model crf-test/tiny-qwen2`` from the loopback Hub
    (HF_ENDPOINT through the launch env), add seeded LoRA adapters, train 1 round of 2 steps
    and end bit-identical; a round moves the adapters only. (One run, LoRA on: without it
    the same path runs with every parameter exchanged, which the tiny-model e2e covers.)"""
    lora_rank = 4
    from crf.executors.local import LocalProcessExecutor
    from crf.launcher import driver

    summary = driver.launch(
        {
            "job": "composer",
            "model": TINY_REPO,
            "lora_rank": lora_rank,
            "replicas": 2,
            "sync_every": 2,
            "rounds": 1,
            "run_id": f"hub-{lora_rank}",
            "job_config": {
                "prompts_per_step": 2,
                "num_generations": 2,
                "num_examples": 16,
            },  # fmt: skip
            "eval_examples": 4,
            "round_timeout_s": 120.0,
        },
        store=str(tmp_path / "runs"),
        env={"CRF_LOG_LEVEL": "WARNING", **hf_hub_env},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=0),
        progress=False,
        report=False,
        plot=False,
        poll_s=0.1,
        timeout_s=300,
    )
    rows = summary["replicas"]
    assert summary["status"] == "ok", [r.get("error") for r in rows]
    assert summary["weights_identical"] is True
    assert all(r["steps"] == 2 for r in rows), rows
    # the replicas downloaded the model from the emulator (an empty cache in HF_HOME)
    assert any(p.endswith("model.safetensors") and s == 200 for _, p, s in hf_hub.requests)
    model, _ = load_pretrained(_spec(lora_rank=lora_rank), CPU, seed=0)
    exchanged = 4 * trainable_count(model)  # fp32 bytes of what DiLoCo averages (P)
    for row in rows:
        # N = 2: P up and P (N-1)/N * 2 down, plus object headers
        assert 1.5 * exchanged <= row["bytes_per_round"] <= 2 * exchanged + 64_000, row
    assert exchanged < sum(4 * p.numel() for p in model.parameters()) / 4
    # its model/ is the adapter; `crf export --merge` folds it into the run's --model (the
    # Hub id, through the same loopback Hub): one plain model that computes what the adapter
    # on its base computes
    import peft
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    runner, store = CliRunner(), str(tmp_path / "runs")
    res = runner.invoke(app, ["export", f"hub-{lora_rank}", str(tmp_path / "adapter"),
                              "--store", store])  # fmt: skip
    assert res.exit_code == 0 and (tmp_path / "adapter" / "adapter_config.json").is_file()
    res = runner.invoke(app, ["export", f"hub-{lora_rank}", str(tmp_path / "merged"),
                              "--store", store, "--merge"])  # fmt: skip
    assert res.exit_code == 0, res.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(TINY_REPO, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_the_hub_emulator_serves_dataset_repos(
    tmp_path: Path, hf_hub: Any, hf_hub_env: dict
) -> None:
    """A dataset repo (for the data options): datasets.load_dataset by id, through the real
    HfFileSystem and hf_hub_download, and the typed 404s the client maps."""
    import datasets
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

    folder = tmp_path / "data"
    (folder / "data").mkdir(parents=True)
    rows = [{"prompt": f"{w}=", "answer": w[::-1]} for w in ("ab", "abc", "dcb")]
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf_hub.add_repo("crf-test/tiny-data", folder, kind="dataset")
    loaded = datasets.load_dataset(
        "crf-test/tiny-data", split="train", cache_dir=str(tmp_path / "ds-cache")
    )
    assert loaded.to_list() == rows
    api = HfApi(endpoint=hf_hub.endpoint)
    files = [f.path for f in api.list_repo_tree("crf-test/tiny-data", repo_type="dataset",
                                                recursive=True)]  # fmt: skip
    assert "data/train.jsonl" in files
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("crf-test/tiny-data", "nope.json", repo_type="dataset")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("crf-test/absent")


def test_lm_job_trains_a_hub_model_on_its_own_tokens(hf_hub: Any, hf_hub_env: dict) -> None:
    """The lm job with --model: from_pretrained, the corpus through the model's tokenizer,
    one loss on the chosen device."""
    from types import SimpleNamespace

    from crf.replica.jobs import lm

    ctx = SimpleNamespace(spec=_spec(), rank=1, world_size=2, seed=0)
    cfg = lm.Config(seq_len=16, batch_size=2, corpus_sentences=200, eval_batches=1)
    model, data = lm.build(ctx, cfg, CPU)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    batch = data.batch(0, 5)
    assert batch.shape == (2, 17) and int(batch.max()) < model.config.vocab_size
    assert lm.evaluate(model, data, CPU) > 0
