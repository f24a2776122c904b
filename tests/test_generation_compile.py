"""``generation_compile``: a static KV cache whose decoding step transformers compiles, sized in
buckets so one compilation serves the steps of a run; and one input-embeddings hook, however
many times TRL turns gradient checkpointing off and on around its generations.

Transformers compiles on a GPU only; on the CPU the tests let it compile anyway
(``CompileConfig._compile_all_devices``, transformers' own switch for this) with a backend
that records each graph dynamo hands it and runs it eagerly, so what is checked is what
compiles and how often, not how fast. The ``gpu`` case runs the real thing (inductor, CUDA
graphs) on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DEVICES

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hub_models import save_tiny_repo

    path = tmp_path_factory.mktemp("gen-compile") / "model"
    save_tiny_repo(path)
    return path


#: prompts of 4 to 18 characters: the steps' longest prompts differ
ROWS = [{"prompt": "ab" * k + "="} for k in (3, 8, 1, 5, 2, 7, 4, 6)]


def _trainer(
    folder: Path,
    device: str = "cpu",
    steps: int = 3,
    cls: Any = None,
    bf16: bool | None = None,
    lora: bool = False,
    **extra: Any,
) -> Any:
    """crf's trainer (or ``cls``, TRL's GRPOTrainer) on the tiny model, gradient
    checkpointing on (TRL turns it off and on around each generation); with ``lora``, the
    model as crf's replica loads it with LoRA adapters (crf/replica/model.py)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crf.composer import ComposerConfig, ComposerReplicationTrainer

    if lora:
        from types import SimpleNamespace

        from crf.replica.model import Placement, load_pretrained

        spec = SimpleNamespace(model=str(folder), lora_rank=4, lora_alpha=8,
                               gradient_checkpointing=True)  # fmt: skip
        model, _ = load_pretrained(spec, Placement(device, "fp32"), seed=0)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    args = ComposerConfig(
        output_dir=str(folder.parent / f"out-{device}"),
        use_cpu=device == "cpu",
        bf16=device == "cuda" if bf16 is None else bf16,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        gradient_checkpointing=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    return (cls or ComposerReplicationTrainer)(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tok,
    )


def _cache_length(trainer: Any) -> int:
    """The length of the one static cache the trainer keeps for its generations."""
    (_, length), *others = trainer._static_cache.values()
    assert not others
    return length


def _caches_per_step(trainer: Any) -> list[tuple[int, int]]:
    """The kept static cache (its identity and its first keys' address) after each step."""
    from transformers import TrainerCallback

    seen: list[tuple[int, int]] = []

    class Look(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ((cache, _),) = trainer._static_cache.values()
            seen.append((id(cache), cache.layers[0].keys.data_ptr()))

    trainer.add_callback(Look())
    return seen


def _graphs_per_step(trainer: Any) -> list[int]:
    """Dynamo's count of graphs compiled so far, at the end of each optimizer step."""
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    seen: list[int] = []

    class Count(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append(counters["stats"]["unique_graphs"])

    trainer.add_callback(Count())
    return seen


def _compile_on_cpu(trainer: Any) -> list[Any]:
    """Let transformers compile on the CPU, with a backend that keeps the graphs dynamo
    hands it and runs them as they are; the list of those graphs. (A function: ``generate``
    deep-copies its config, and a function is copied as itself.)"""
    from transformers import CompileConfig

    graphs: list[Any] = []

    def backend(gm: Any, example_inputs: Any, **_: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(backend=backend)
    config._compile_all_devices = True  # transformers' switch: compile off a GPU too
    trainer.generation_config.compile_config = config
    return graphs


def _input_hooks(model: Any) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_one_compilation_serves_every_step(folder: Path, bf16: bool) -> None:
    """Three optimizer steps whose prompts differ in length: the decoding step is compiled
    once, into one graph (no break at the input-embeddings hook), every generation decodes
    into the same cache of one bucket, and the master weights stay fp32. Under bf16
    autocast too, where the keys come out of the rotary embedding in fp32 and the values
    in bf16, and a static cache as transformers makes it (values in the keys' dtype) fails
    at the first generation."""
    trainer = _trainer(folder, bf16=bf16, generation_compile=True)
    assert trainer.generation_config.cache_implementation == "static"
    assert trainer.generation_config.disable_compile is False
    graphs = _compile_on_cpu(trainer)
    caches = _caches_per_step(trainer)
    trainer.train()
    assert trainer.state.global_step == 3
    assert len(graphs) == 1
    assert _cache_length(trainer) == 256
    assert len(caches) == 3 and len(set(caches)) == 1  # one cache, the same memory
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert _input_hooks(trainer.model) == 1


@pytest.mark.slow
def test_lora_compiles_once_and_keeps_one_hook(folder: Path) -> None:
    """With LoRA adapters (the model loaded as a replica loads it, PEFT's and crf's own
    turning on of input gradients included), under bf16 autocast: one graph over three
    steps, one cache, one input-embeddings hook, the adapters fp32."""
    trainer = _trainer(folder, bf16=True, lora=True, generation_compile=True)
    graphs = _compile_on_cpu(trainer)
    caches = _caches_per_step(trainer)
    trainer.train()
    assert len(graphs) == 1
    assert len(set(caches)) == 1
    assert _input_hooks(trainer.model) == 1
    trained = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    assert trained == {torch.float32}


@pytest.mark.slow
def test_a_cache_sized_to_each_prompt_recompiles(folder: Path, monkeypatch: Any) -> None:
    """The control: with the cache sized to each call's prompt and completion (what
    transformers does on its own), a step with a longer prompt than before is a new cache
    shape, and the decoding step compiles again."""
    import crf.composer.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "static_cache_length", lambda prompt, new: prompt + new)
    trainer = _trainer(folder, generation_compile=True)
    graphs = _compile_on_cpu(trainer)
    trainer.train()
    assert len(graphs) > 1


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_compiled_decoding_makes_the_same_tokens(folder: Path, bf16: bool) -> None:
    """Greedy, the compiled static-cache decoding gives the tokens plain ``generate`` gives
    (both under the trainer's autocast, as in training), called outside training as a
    rollout worker calls it."""
    made = []
    for compiled in (False, True):
        trainer = _trainer(folder, bf16=bf16, generation_compile=compiled)
        prompts = trainer.processing_class(text=["ab=", "abcdab="])["input_ids"]
        if compiled:
            graphs = _compile_on_cpu(trainer)
        trainer.generation_config.do_sample = False
        trainer.model.eval()
        with trainer.accelerator.autocast():
            completions, _ = trainer._generate_single_turn(prompts, None, {}, 1)
        made.append(completions)
    assert graphs
    assert made[0] == made[1]
    assert all(len(c) >= 1 for c in made[0])


@pytest.mark.slow
def test_the_input_embeddings_keep_one_hook(folder: Path) -> None:
    """TRL turns gradient checkpointing off and on around each generation; with
    transformers' own ``gradient_checkpointing_enable`` that adds a hook each time (TRL's
    GRPOTrainer: more hooks after every step); crf's trainer keeps one."""
    from trl import GRPOTrainer

    trainer = _trainer(folder)
    trainer.train()
    assert _input_hooks(trainer.model) == 1

    theirs = _trainer(folder, cls=GRPOTrainer)
    theirs.train()
    assert _input_hooks(theirs.model) > 1


def test_a_copy_of_the_model_binds_its_own_hook(folder: Path) -> None:
    """The idempotent ``enable_input_require_grads`` is bound to each model, so a deep copy
    (the replay channel's frozen reference is one) registers on its own embeddings."""
    import copy

    from transformers import AutoModelForCausalLM

    from crf.composer.generation import one_input_grads_hook

    model = AutoModelForCausalLM.from_pretrained(folder)
    one_input_grads_hook(model)
    twin = copy.deepcopy(model)
    for _ in range(3):
        twin.enable_input_require_grads()
    assert _input_hooks(twin) == 1
    assert _input_hooks(model) == 0


def test_cache_lengths_are_buckets() -> None:
    from crf.composer.generation import CACHE_BUCKET, static_cache_length

    assert static_cache_length(10, 6) == CACHE_BUCKET
    assert static_cache_length(CACHE_BUCKET - 6, 6) == CACHE_BUCKET
    assert static_cache_length(CACHE_BUCKET - 5, 6) == 2 * CACHE_BUCKET
    assert static_cache_length(300, 512, bucket=64) == 832


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"use_vllm": True}, "use_vllm replaces it"),
        ({"use_transformers_continuous_batching": True, "bf16": False}, "continuous_batching"),
        ({"cache_implementation": "dynamic"}, "cache_implementation is 'dynamic'"),
    ],
)
def test_the_config_refuses_what_replaces_generate(setting: dict, match: str) -> None:
    from crf.composer import ComposerConfig

    with pytest.raises(ValueError, match=match):
        ComposerConfig(output_dir="unused", use_cpu=True, generation_compile=True, **setting)


def test_unset_it_compiles_where_it_can_run(folder: Path) -> None:
    """``generation_compile`` unset: on for a trainer on CUDA, on TRL's generate path, for a
    model transformers compiles whole (LoRA's base model included); off on the CPU, beside
    vLLM or continuous batching, with another cache, or for a model that cannot compile.
    Set, it is what it says."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from crf.composer.generation import decoding_compiled

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model._can_compile_fullgraph

    def args(device: str = "cuda", **kw: Any) -> SimpleNamespace:
        base = dict(device=torch.device(device), generation_compile=None, use_vllm=False,
                    use_transformers_continuous_batching=False,
                    cache_implementation=None)  # fmt: skip
        return SimpleNamespace(**{**base, **kw})

    assert decoding_compiled(args(), model)
    assert decoding_compiled(args(cache_implementation="static"), model)
    peft = SimpleNamespace(get_base_model=lambda: model)
    assert decoding_compiled(args(), peft)
    assert not decoding_compiled(args("cpu"), model)
    assert not decoding_compiled(args(use_vllm=True), model)
    assert not decoding_compiled(args(use_transformers_continuous_batching=True), model)
    assert not decoding_compiled(args(cache_implementation="dynamic"), model)
    assert not decoding_compiled(args(), SimpleNamespace(_can_compile_fullgraph=False))
    assert decoding_compiled(args("cpu", generation_compile=True), model)
    assert not decoding_compiled(args(generation_compile=False), model)


def test_unset_it_is_off_without_a_c_compiler(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton builds its launcher with a C compiler (CC, else gcc or clang): where there is
    none, as in slim images, unset ``generation_compile`` is off on CUDA too, with one line
    saying what to install; set, it is what it says."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from crf.composer.generation import c_compiler, decoding_compiled, no_compiler_note

    model = AutoModelForCausalLM.from_pretrained(folder)
    cuda = SimpleNamespace(device=torch.device("cuda"), generation_compile=None, use_vllm=False,
                           use_transformers_continuous_batching=False,
                           cache_implementation=None)  # fmt: skip
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert c_compiler() is None
    assert not decoding_compiled(cuda, model)
    assert "install gcc in the image" in (no_compiler_note(cuda, model) or "")
    explicit = SimpleNamespace(**{**vars(cuda), "generation_compile": True})
    assert decoding_compiled(explicit, model) and no_compiler_note(explicit, model) is None
    on_cpu = SimpleNamespace(**{**vars(cuda), "device": torch.device("cpu")})
    assert no_compiler_note(on_cpu, model) is None  # it would not compile there anyway
    (tmp_path / "clang").write_text("#!/bin/sh\n")
    (tmp_path / "clang").chmod(0o755)
    assert c_compiler() == str(tmp_path / "clang")
    assert decoding_compiled(cuda, model) and no_compiler_note(cuda, model) is None
    monkeypatch.setenv("CC", "/opt/cc")  # CC is taken as it is, as Triton takes it
    assert c_compiler() == "/opt/cc"


def _failing_compiler(trainer: Any) -> None:
    """Compile on the CPU with a backend that fails as inductor does on a machine without a C
    compiler (Triton's error, which dynamo wraps in its own)."""
    from transformers import CompileConfig

    def backend(gm: Any, example_inputs: Any, **_: Any) -> Any:
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    config = CompileConfig(backend=backend)
    config._compile_all_devices = True
    trainer.generation_config.compile_config = config


@pytest.mark.slow
def test_a_failed_compilation_by_default_falls_back_to_plain_generate(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset ``generation_compile`` chose compiled decoding (as on CUDA) and compiling fails:
    the generation is made again with plain ``generate`` (the tokens it makes), compiled
    decoding is off for the rest of the run, one warning says why, and training goes on.
    Set to True, the failure is raised as one line that a restart is not tried for."""
    import logging

    import crf.composer.trainer as trainer_module
    from crf.composer.generation import CompileFailed, compile_failed
    from crf.replica.failures import deterministic, one_line

    plain = _trainer(folder, generation_compile=False)
    prompts = plain.processing_class(text=["ab=", "abcdab="])["input_ids"]

    def greedy(trainer: Any) -> list:
        trainer.generation_config.do_sample = False
        trainer.model.eval()
        with trainer.accelerator.autocast():
            return trainer._generate_single_turn(prompts, None, {}, 1)[0]

    expected = greedy(plain)
    chosen = _trainer(folder, generation_compile=True)
    _failing_compiler(chosen)
    with pytest.raises(CompileFailed) as raised:  # asked for: one line, no restart
        greedy(chosen)
    assert compile_failed(raised.value) and deterministic(raised.value, phase="training")
    assert one_line(raised.value).startswith(
        "CompileFailed: generation_compile=true, and compiling the decoding step failed "
        "(RuntimeError: Failed to find C compiler."
    )

    monkeypatch.setattr(trainer_module, "decoding_compiled", lambda args, model: True)
    trainer = _trainer(folder, steps=2)
    assert trainer.args.generation_compile is None and trainer.compiled_decoding
    _failing_compiler(trainer)
    with caplog.at_level(logging.WARNING, logger="crf.composer.trainer"):
        assert greedy(trainer) == expected
        trainer.model.train()
        trainer.train()
    assert not trainer.compiled_decoding
    assert trainer.state.global_step == 2
    assert trainer.generation_config.cache_implementation != "static"
    assert trainer.generation_config.disable_compile is True
    warned = [r.getMessage() for r in caplog.records if "generation_compile" in r.getMessage()]
    assert len(warned) == 1 and "Failed to find C compiler" in warned[0], warned
    assert "plain generate" in warned[0]


def test_unset_on_the_cpu_generate_is_left_as_it_is(folder: Path) -> None:
    """A trainer on the CPU with ``generation_compile`` unset keeps TRL's generation config:
    no static cache, compilation off as TRL sets it."""
    trainer = _trainer(folder)
    assert trainer.args.generation_compile is None and not trainer.compiled_decoding
    assert trainer.generation_config.cache_implementation != "static"
    assert trainer.generation_config.disable_compile is True


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_decoding_sees_weights_changed_in_place(folder: Path, device: str) -> None:
    """DiLoCo's outer step, a heal and a resume write the model's weights in place between
    generations: the compiled decoding step (and on CUDA its recorded graphs) then decodes
    with the new weights, the tokens plain ``generate`` makes from them."""
    from transformers import AutoModelForCausalLM

    trainer = _trainer(folder, device, bf16=False, generation_compile=True)
    graphs = _compile_on_cpu(trainer) if device == "cpu" else [True]
    trainer.generation_config.do_sample = False
    trainer.model.eval()
    prompts = trainer.processing_class(text=["ab=", "abcdab="])["input_ids"]

    def greedy(model: Any = None) -> list:
        if model is None:
            return trainer._generate_single_turn(prompts, None, {}, 1)[0]
        enc = trainer.processing_class(text=["ab=", "abcdab="], return_tensors="pt",
                                       padding=True).to(device)  # fmt: skip
        out = model.generate(**enc, max_new_tokens=6, do_sample=False,
                             pad_token_id=trainer.processing_class.pad_token_id)  # fmt: skip
        width = enc["input_ids"].shape[1]
        eos = trainer.processing_class.eos_token_id
        return [_until(row[width:].tolist(), eos) for row in out]

    before = greedy()
    assert graphs  # it compiled
    torch.manual_seed(7)
    other = AutoModelForCausalLM.from_config(trainer.model.config).to(device).eval()
    with torch.no_grad():  # weights far from the tiny model's (which decodes one token)
        for p in other.parameters():
            p.normal_(0.0, 0.5)
    assert greedy(other) != before  # the new weights decode otherwise
    with torch.no_grad():
        for mine, theirs in zip(trainer.model.parameters(), other.parameters(), strict=True):
            mine.copy_(theirs)  # as torchft's DiLoCo restores and steps the weights
    assert greedy() == greedy(other)
    trainer.model.load_state_dict(_load_twin(folder).state_dict())  # as a resume loads
    assert greedy() == before


def _until(tokens: list[int], eos: int | None) -> list[int]:
    """A completion up to and with its first EOS, as TRL returns it."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def _load_twin(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_compiled_decoding_on_cuda(folder: Path) -> None:
    """On CUDA, with ``generation_compile`` unset (the default), transformers' own
    compilation (inductor, CUDA graphs) under bf16 autocast: three steps whose prompts differ
    in length compile nothing after the first and decode into one cache, and the weights
    stay fp32 on the GPU."""
    trainer = _trainer(folder, "cuda", steps=3)
    assert trainer.compiled_decoding
    seen = _graphs_per_step(trainer)
    caches = _caches_per_step(trainer)
    trainer.train()
    assert trainer.state.global_step == 3
    assert seen[0] >= 1 and seen[-1] == seen[0], seen
    assert _cache_length(trainer) == 256
    assert len(set(caches)) == 1  # CUDA graphs recorded once, on one cache
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {p.device.type for p in trainer.model.parameters()} == {"cuda"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_lora_compiled_decoding_on_cuda(folder: Path) -> None:
    """On CUDA, LoRA adapters with ``generation_compile`` unset: compiled by default, three
    steps on one cache and no compilation after the first, the adapters fp32."""
    trainer = _trainer(folder, "cuda", steps=3, lora=True)
    assert trainer.compiled_decoding
    seen = _graphs_per_step(trainer)
    caches = _caches_per_step(trainer)
    trainer.train()
    assert seen[0] >= 1 and seen[-1] == seen[0], seen
    assert len(set(caches)) == 1
    trained = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    assert trained == {torch.float32}


_NO_COMPILER = """
import logging
from pathlib import Path
from tests.test_generation_compile import _trainer
logging.basicConfig(level=logging.WARNING)
trainer = _trainer(Path(FOLDER), "cuda", steps=2)
assert trainer.compiled_decoding
trainer.train()
assert trainer.state.global_step == 2
print("compiled" if trainer.compiled_decoding else "fell back")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_compiled_decoding_without_a_working_compiler_trains_on(
    folder: Path, tmp_path: Path
) -> None:
    """On CUDA, in a process whose C compiler is missing (``CC`` names none) and whose Triton
    and inductor caches are new (nothing built before is reused): the default compiled
    decoding fails at the first generation where Triton needs the compiler, the trainer warns
    once and trains on with plain ``generate``. (A Triton that builds nothing with the C
    compiler compiles instead; the run trains on either way.)"""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    code = _NO_COMPILER.replace("FOLDER", repr(str(folder)))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=140)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    said = out.stdout.strip().splitlines()[-1]
    assert said in ("compiled", "fell back"), out.stdout
    if said == "fell back":
        warned = [line for line in out.stderr.splitlines() if "generation_compile:" in line]
        assert len(warned) == 1 and "plain generate" in warned[0], warned
