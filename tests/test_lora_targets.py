"""``--lora-target-modules``: the modules ``--lora-rank`` adapts.

peft's default choice (every linear layer, ``all-linear``) is refused on a Mamba: peft puts
no LoRA on its ``out_proj`` or ``conv1d``, so every replica failed as it wrapped the model.
The launch now refuses it before anything starts, in one line naming the option and the
model's linear layers that take LoRA, and the names a user gives are checked against the
model's modules (a typo among them was skipped by peft without a word). A replica that
first reads its model (a Hub id) refuses the same at setup, in the same words, and a Mamba
with the layers named trains its adapters through the real sft job.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from crf.launcher.cli import app
from crf.replica.data_files import DataError
from crf.spec import RunSpec, SpecError
from tests.hub_models import save_tiny_repo
from tests.inprocess_replica import InProcessContext

#: the linear layers of a Mamba block that peft takes (its out_proj it refuses)
MAMBA_TARGETS = "in_proj,x_proj,dt_proj"


def _mamba(folder: Path) -> Path:
    """A 2-layer Mamba with the tiny model's tokenizer."""
    from transformers import MambaConfig, MambaForCausalLM

    save_tiny_repo(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    for stale in ("model.safetensors", "config.json", "generation_config.json"):
        (folder / stale).unlink(missing_ok=True)
    config = MambaConfig(vocab_size=vocab, hidden_size=16, state_size=4, num_hidden_layers=2,
                         expand=2)  # fmt: skip
    MambaForCausalLM(config).save_pretrained(folder)
    return folder


def _data(tmp_path: Path) -> str:
    words = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{w}=", "completion": w[::-1]}) + "\n"
                            for w in words))  # fmt: skip
    return str(path)


def _launch(tmp_path: Path, model: Path, *extra: str) -> tuple[int, str]:
    out = CliRunner().invoke(app, [
        "launch", "--job", "sft", "--dataset", _data(tmp_path), "--model", str(model),
        "--lora-rank", "4", "--store", str(tmp_path / "runs"), "--dry-run", *extra,
    ])  # fmt: skip
    return out.exit_code, " ".join(out.output.split())


def test_peft_default_choice_on_a_mamba_is_refused_before_launch_naming_the_option(
    tmp_path: Path,
) -> None:
    mamba = _mamba(tmp_path / "mamba")
    code, said = _launch(tmp_path, mamba)
    assert code == 2, said
    assert (
        f"error: --lora-rank: peft refuses LoRA on every linear layer of --model {mamba} "
        "(its default, all-linear): Module 'out_proj' is incompatible with Mamba" in said
    ), said
    assert f"pass --lora-target-modules with some of its linear layers: {MAMBA_TARGETS}" in said
    assert "Traceback" not in said

    code, said = _launch(tmp_path, mamba, "--lora-target-modules", MAMBA_TARGETS)
    assert code == 0, said
    code, said = _launch(tmp_path, mamba, "--lora-target-modules", "in_proj,inproj")
    assert code == 2 and f"--model {mamba} has no module named 'inproj'" in said, said
    code, said = _launch(tmp_path, mamba, "--lora-target-modules", "in_proj,out_proj")
    assert code == 2, said
    assert "--lora-target-modules in_proj,out_proj: peft refuses LoRA there" in said, said


def test_a_llama_family_model_takes_the_default_and_named_layers_and_a_typo_is_refused(
    tmp_path: Path,
) -> None:
    qwen2 = tmp_path / "qwen2"
    save_tiny_repo(qwen2)
    assert _launch(tmp_path, qwen2)[0] == 0
    assert _launch(tmp_path, qwen2, "--lora-target-modules", "q_proj,v_proj")[0] == 0
    assert _launch(tmp_path, qwen2, "--lora-target-modules", "all-linear")[0] == 0
    code, said = _launch(tmp_path, qwen2, "--lora-target-modules", "q_proj,vproj")
    assert code == 2, said
    assert f"--lora-target-modules: --model {qwen2} has no module named 'vproj'" in said
    assert "its linear layers: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj (and 1 more)" in said
    code, said = _launch(tmp_path, qwen2, "--lora-target-modules", "input_layernorm")
    assert code == 2 and "is not supported" in said, said


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lora_target_modules": "q_proj"}, "--lora-target-modules names what --lora-rank"),
        ({"lora_rank": 4, "lora_target_modules": " , "}, "--lora-target-modules is empty"),
        ({"lora_rank": 4, "lora_target_modules": "q_proj,,v_proj"}, "has an empty name"),
        ({"lora_rank": 4, "lora_target_modules": "all-linear,q_proj"}, "all-linear stands alone"),
    ],
)
def test_the_option_is_checked_with_the_run_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        RunSpec(run_id="r", run_uri="memory://x", **options).validate()


def test_a_replica_refuses_the_same_at_setup_and_trains_the_named_layers(tmp_path: Path) -> None:
    """A model the launcher could not read (a Hub id) is checked as the replica wraps it: a
    DataError (a setup error, not restarted) in the launch's words; with the layers named,
    the real sft job trains the adapters on them and nothing else."""
    from crf.replica.jobs import sft
    from crf.replica.model import Placement, load_pretrained

    mamba = _mamba(tmp_path / "mamba")
    spec = SimpleNamespace(model=str(mamba), lora_rank=4, lora_alpha=8)
    with pytest.raises(DataError) as caught:
        load_pretrained(spec, Placement("cpu", "fp32"), seed=0)
    said = str(caught.value)
    assert said.startswith(
        f"--lora-rank: peft refuses LoRA on every linear layer of --model {mamba}"
    )
    assert said.endswith(f"some of its linear layers: {MAMBA_TARGETS}") and "\n" not in said
    spec.lora_target_modules = "in_proj,x_proj,inproj"
    with pytest.raises(DataError, match="has no module named 'inproj'"):
        load_pretrained(spec, Placement("cpu", "fp32"), seed=0)

    data = _data(tmp_path)
    spec = SimpleNamespace(
        model=str(mamba), lora_rank=4, lora_alpha=8, lora_target_modules=MAMBA_TARGETS,
        dataset=data, dataset_config=None, dataset_split="train", eval_dataset=None,
        eval_split=None, eval_examples=0, columns={}, sync_every=2, device="cpu",
        precision="fp32", report_to="none",
    )  # fmt: skip
    ctx = InProcessContext(spec=spec, seed=0, data_seed=1, rank=0, world_size=1,
                           total_steps=2, step=0, logged=[])  # fmt: skip
    sft.run(ctx, sft.Config(per_device_train_batch_size=4, max_length=16))
    assert ctx.step == 2 and all(row["loss"] is not None for row in ctx.logged), ctx.logged
    trained = [n for n, p in ctx.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained), trained
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    assert layers == set(MAMBA_TARGETS.split(",")), layers
