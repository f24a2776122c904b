"""Generation on transformers' continuous-batching path keeps the trainer's fp32 master weights.

TRL 1.16's ``use_transformers_continuous_batching`` path casts the model it generates with to
bf16 in place when ``bf16=True`` (and never back): the control case shows it does, on TRL's own
GRPOTrainer. crf's ComposerReplicationTrainer generates on the same path without that cast
(crf/composer/generation.py). The paged cache holds keys and values in the weights' dtype, so
under bf16 autocast (bf16 keys from fp32 weights) the path cannot run: crf refuses the
combination in its config, and trains on that path in fp32, every parameter still fp32
afterwards. The cases run on the CPU and, marked ``gpu``, on CUDA, where transformers serves
that path (>= 5.8; on older ones crf refuses the setting before launch:
tests/test_trl_settings.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

from crf.replica.trl_settings import CONTINUOUS_BATCHING_TRANSFORMERS
from crf.versions import distribution_version

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]

#: TRL runs its continuous-batching path only on transformers >= 5.8
NEEDS_CB = pytest.mark.skipif(
    Version(distribution_version("transformers") or "0")
    < Version(CONTINUOUS_BATCHING_TRANSFORMERS),
    reason=f"TRL's continuous batching needs transformers>={CONTINUOUS_BATCHING_TRANSFORMERS}",
)


def _trainer(cls: Any, folder: Path, device: str, bf16: bool = True, **extra: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from crf.composer import ComposerConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    config = GRPOConfig if cls is GRPOTrainer else ComposerConfig
    args = config(
        output_dir=str(folder / "out"),
        use_cpu=device == "cpu",
        bf16=bf16,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        use_transformers_continuous_batching=True,
        # a small paged cache: by default it takes a share of the device's free memory
        transformers_continuous_batching_config={"num_blocks": 8, "page_size": 16},
        report_to=[],
        save_strategy="no",
        **extra,
    )
    rows = [{"prompt": "ab="}, {"prompt": "ba="}] * 4
    return cls(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )


def _generate(trainer: Any) -> list[list[int]]:
    prompts = trainer.processing_class(text=["ab=", "ba="])["input_ids"]
    completions, _ = trainer._generate_single_turn(prompts, None, {}, 1)
    return completions


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    from tests.hub_models import save_tiny_repo

    save_tiny_repo(tmp_path / "model")
    return tmp_path / "model"


@NEEDS_CB
@pytest.mark.parametrize("device", DEVICES)
def test_trls_continuous_batching_casts_the_model_in_place(folder: Path, device: str) -> None:
    from trl import GRPOTrainer

    trainer = _trainer(GRPOTrainer, folder, device)
    assert len(_generate(trainer)) == 2
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


@NEEDS_CB
@pytest.mark.parametrize("device", DEVICES)
def test_crf_trains_on_that_path_in_fp32(folder: Path, device: str) -> None:
    """A generation on its own and then a whole optimizer step (generation inside the
    prepared model, where autocast would be): completions come back and every parameter is
    still fp32, on the device."""
    from crf.composer import ComposerReplicationTrainer

    trainer = _trainer(ComposerReplicationTrainer, folder, device, bf16=False)
    completions = _generate(trainer)
    assert len(completions) == 2 and all(len(c) >= 1 for c in completions)
    trainer.train()
    assert trainer.state.global_step == 1
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {p.device.type for p in trainer.model.parameters()} == {device}


def test_crf_refuses_that_path_under_autocast() -> None:
    """bf16 (or fp16) autocast with continuous batching is refused when the config is made,
    naming the setting and the fix: the paged cache would hold fp32 while autocast makes
    bf16 keys, and generation would fail at the first step."""
    from crf.composer import ComposerConfig

    with pytest.raises(ValueError, match="needs fp32 training .* --precision fp32"):
        ComposerConfig(output_dir="unused", use_cpu=True, bf16=True,
                       use_transformers_continuous_batching=True)  # fmt: skip


def test_a_cast_the_guard_cannot_prevent_is_refused() -> None:
    from types import SimpleNamespace

    from crf.composer.generation import MasterWeightsCast, master_weights_kept

    model = torch.nn.Linear(2, 2)
    args = SimpleNamespace(bf16=True, fp16=False)
    with pytest.raises(MasterWeightsCast, match="weight from torch.float32 to torch.bfloat16"):
        with master_weights_kept(model, args):
            model.to(torch.bfloat16)
    assert args.bf16 is True


@pytest.mark.parametrize("cudnn", [False, True])
def test_generation_attention_leaves_out_cudnn_on_cuda_only(cudnn: bool) -> None:
    """On a CUDA model SDPA may not pick cuDNN's attention inside the block (unless asked
    to), and the flags are as before after it; on a CPU model nothing changes."""
    from types import SimpleNamespace

    from crf.composer.generation import generation_attention

    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled())
    with generation_attention(SimpleNamespace(device=torch.device("cuda")), cudnn=cudnn):
        assert flags.cudnn_sdp_enabled() is (cudnn and before[0])
        assert flags.flash_sdp_enabled() is before[1]
    with generation_attention(SimpleNamespace(device=torch.device("cpu"))):
        assert flags.cudnn_sdp_enabled() is before[0]
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled()) == before
