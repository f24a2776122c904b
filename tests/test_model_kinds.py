"""Models that cannot train correctly are refused before launch in one line, and the same
rules hold at a replica's setup for a model only a replica can read (a Hub id): weights
missing from the checkpoint, models that are no causal LM, custom code (never run nor
prompted for by the launcher), non-finite weights, a pad id past the embedding, and a path
that is an adapter, a file or a broken link."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from crf.launcher.data_checks import check_model
from crf.launcher.errors import LaunchError
from crf.replica.data_files import DataError
from crf.replica.model import Placement, load_pretrained
from tests.hub_models import save_tiny_repo

REPO = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip


def _folder(tmp_path: Path, name: str, model: Any) -> Path:
    """``model`` saved with the tiny repo's tokenizer (whose size it embeds)."""
    folder = tmp_path / name
    save_tiny_repo(folder)
    for stale in ("model.safetensors", "config.json", "generation_config.json"):
        (folder / stale).unlink(missing_ok=True)
    model.save_pretrained(folder)
    return folder


def _vocab(tmp_path: Path) -> int:
    save_tiny_repo(tmp_path / "vocab")
    return int(json.loads((tmp_path / "vocab" / "config.json").read_text())["vocab_size"])


def _refused(folder: Path, **spec: Any) -> str:
    with pytest.raises(LaunchError) as e:
        check_model(str(folder), SimpleNamespace(**spec))
    assert "\n" not in str(e.value)
    return str(e.value)


def _own_code(module: Path, marker: Path, base: str, body: str, name: str = "Custom") -> None:
    """A repo's own code: ``module`` defines class ``name``, a subclass of transformers'
    ``base``, and writes ``marker`` when it is imported (so a test sees whether it ran)."""
    module.write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        f"from transformers import {base}\n"
        f"class {name}({base}):\n    {body}\n"
    )


def _set_fields(path: Path, **fields: Any) -> None:
    """A JSON file of the model folder with ``fields`` set."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _fresh_python(code: str) -> str:
    """``code`` run by a new Python with stdin closed (a terminal prompt would fail, not
    wait); its stdout and stderr, once it exited 0."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def _llama(vocab: int, *, tie: bool, head: bool = True) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(vocab_size=vocab, tie_word_embeddings=tie, **SMALL)
    return (LlamaForCausalLM if head else LlamaModel)(config)


def test_normal_saves_of_causal_lms_pass(tmp_path: Path) -> None:
    """Tied and untied Llama, GPT-2 and Qwen2 as save_pretrained writes them; and a tied
    Llama saved from its base model (no model. prefix), which from_pretrained loads whole."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    vocab = _vocab(tmp_path)
    models = {
        "tied": _llama(vocab, tie=True),
        "untied": _llama(vocab, tie=False),
        "base-tied": _llama(vocab, tie=True, head=False),
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **SMALL)),
    }
    for name, model in models.items():
        check_model(str(_folder(tmp_path, name, model)), SimpleNamespace())


def test_missing_weights_are_refused_before_launch_and_at_setup(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    vocab = _llama_vocab = _vocab(tmp_path)
    headless = _folder(tmp_path, "headless", _llama(_llama_vocab, tie=False, head=False))
    said = _refused(headless)
    assert "its weights lack lm_head.weight: it was saved without its LM head" in said
    assert "save it with AutoModelForCausalLM" in said

    cut = _folder(tmp_path, "cut", _llama(vocab, tie=False))
    tensors = load_file(cut / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if ".layers.1." not in k}
    save_file(kept, cut / "model.safetensors", metadata={"format": "pt"})
    assert "(and 8 more): the checkpoint is incomplete" in _refused(cut)

    # at the replica (a Hub model the launcher could not read): a DataError at setup
    with pytest.raises(DataError, match="its weights lack lm_head.weight: it was saved"):
        load_pretrained(SimpleNamespace(model=str(headless)), Placement("cpu", "fp32"), seed=0)


def test_models_that_are_no_causal_lm_are_refused(tmp_path: Path) -> None:
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    vocab = _vocab(tmp_path)
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=vocab, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    )
    t5_folder = _folder(tmp_path, "t5", t5)
    assert _refused(t5_folder).endswith(
        "is a t5 (an encoder-decoder model): crf trains causal (decoder-only) LMs"
    )
    bert = BertForMaskedLM(
        BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1,
                   num_attention_heads=2, intermediate_size=32)
    )  # fmt: skip
    bert_folder = _folder(tmp_path, "bert", bert)
    assert "is a bert (an encoder model, is_decoder false)" in _refused(bert_folder)
    for folder in (t5_folder, bert_folder):
        with pytest.raises(DataError, match="crf trains causal"):
            load_pretrained(SimpleNamespace(model=str(folder)), Placement("cpu", "fp32"), seed=0)


def test_custom_code_is_neither_run_nor_prompted_for(tmp_path: Path) -> None:
    """A folder whose config.json maps to its own code: the launcher's checks pass without
    asking on the terminal (stdin closed would hang or fail the prompt) and without running
    the code (which would write a marker file)."""
    folder = _folder(tmp_path, "custom", _llama(_vocab(tmp_path), tie=True))
    marker = tmp_path / "ran"
    _own_code(folder / "custom_config.py", marker, "LlamaConfig", "model_type = 'custom-llama'")
    _set_fields(folder / "config.json", model_type="custom-llama",
                auto_map={"AutoConfig": "custom_config.Custom"})  # fmt: skip
    code = (
        "import sys; from types import SimpleNamespace as S\n"
        "from crf.launcher.data_checks import check_model\n"
        "from crf.launcher.model_shapes import learned_positions\n"
        f"check_model({str(folder)!r}, S(trust_remote_code=True))\n"
        f"print('positions', learned_positions({str(folder)!r}))\n"
    )
    out = _fresh_python(code)
    assert "positions None" in out
    assert "Do you wish to run the custom code" not in out
    assert not marker.exists()


def test_a_tokenizer_with_its_own_code_is_not_run_before_launch(tmp_path: Path) -> None:
    """A tokenizer class from the repo's own code (tokenizer_config.json's auto_map) is left
    to the replicas, even with --trust-remote-code: the launcher's tokenizer checks neither
    run it (its module would write a marker) nor refuse the folder for not loading it."""
    from crf.launcher.data_checks import check_tokenizer_for

    folder = _folder(tmp_path, "own-tokenizer", _llama(_vocab(tmp_path), tie=True))
    marker = tmp_path / "ran"
    _own_code(folder / "own_tokenizer.py", marker, "PreTrainedTokenizerFast", "pass")
    _set_fields(folder / "tokenizer_config.json",
                auto_map={"AutoTokenizer": [None, "own_tokenizer.Custom"]})  # fmt: skip
    code = (
        "from types import SimpleNamespace as S\n"
        "from crf.launcher.data_checks import check_model, check_tokenizer_for\n"
        f"check_model({str(folder)!r}, S(trust_remote_code=True))\n"
        f"check_tokenizer_for({str(folder)!r}, [])\n"
        "print('checked')\n"
    )
    assert "checked" in _fresh_python(code)
    assert not marker.exists()
    check_tokenizer_for(str(folder), [])  # in this process too: no refusal, nothing run
    assert not marker.exists()


def test_non_finite_weights_are_a_data_error_at_setup(tmp_path: Path) -> None:
    model = _llama(_vocab(tmp_path), tie=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 0] = float("nan")
    folder = _folder(tmp_path, "nan", model)
    with pytest.raises(DataError, match=r"weight model.embed_tokens.weight holds NaN or inf"):
        load_pretrained(SimpleNamespace(model=str(folder)), Placement("cpu", "fp32"), seed=0)


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_a_pad_id_past_the_embedding_is_refused(tmp_path: Path, file: str) -> None:
    vocab = _vocab(tmp_path)
    folder = _folder(tmp_path, "pad", _llama(vocab, tie=True))
    path = folder / file
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, "pad_token_id": 500}))
    said = _refused(folder)
    assert f"{file}'s pad_token_id 500 is past the embedding (vocab_size {vocab})" in said


def test_an_adapter_a_file_and_a_broken_link_say_what_they_are(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "b/m"}))
    said = _refused(adapter)
    assert "is a LoRA adapter (of b/m)" in said and "crf export RUN DEST --merge" in said

    folder = tmp_path / "model"
    save_tiny_repo(folder)
    said = _refused(folder / "config.json")
    assert f"is a file: give the model's folder ({folder})" in said
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    assert "is a link to" in _refused(link) and "which does not exist" in _refused(link)


def test_an_embedding_padded_past_its_tokenizer_is_a_warning_not_a_refusal(
    tmp_path: Path,
) -> None:
    """A checkpoint may pad a small tokenizer's embedding to a round size: a tokenizer that
    covers under half the rows is said with the numbers before launch, and the launch goes
    on; token ids past the embedding (an index error in the first batch) stay a refusal."""
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    vocab = _vocab(tmp_path)
    padded = _folder(tmp_path, "padded", _llama(vocab * 4, tie=True))
    said = check_model(str(padded), SimpleNamespace())
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"its tokenizer has {vocab} token ids but the model embeds {vocab * 4} rows" in said[0]
    assert "if the tokenizer is another model's" in said[0]
    own = _folder(tmp_path, "own", _llama(vocab, tie=True))
    assert check_model(str(own), SimpleNamespace()) == []

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n"
                            for w in ["ab", "bca", "cab", "dd"] * 4))  # fmt: skip
    launch = ["launch", "--dataset", str(rows), "--reward", "exact_match", "--replicas", "2",
              "--store", str(tmp_path / "runs"), "--dry-run", "--model"]  # fmt: skip
    out = CliRunner().invoke(app, [*launch, str(padded)])
    flat = " ".join(out.output.split())
    assert out.exit_code == 0, out.output
    assert f"warning: --model {padded}: its tokenizer has {vocab} token ids" in flat, flat

    short = _folder(tmp_path, "short", _llama(vocab - 2, tie=True))
    assert "would crash" in _refused(short)
    refused = CliRunner().invoke(app, [*launch, str(short)])
    assert refused.exit_code == 2, refused.output
    assert f"its tokenizer has {vocab} token ids but the model embeds {vocab - 2}" in " ".join(
        refused.output.split()
    )


def _as_bin(folder: Path, *, legacy: bool = False, keep: Any = None) -> Path:
    """``folder``'s weights moved from model.safetensors to pytorch_model.bin (torch.save's
    zip format, or with ``legacy`` its pre-1.6 one), ``keep`` filtering the tensor names."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if keep is None or keep(k)}
    torch.save(tensors, folder / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    (folder / "model.safetensors").unlink()
    return folder


def test_a_bin_checkpoint_gets_the_weight_checks_of_a_safetensors_one(tmp_path: Path) -> None:
    """pytorch_model.bin, read memory-mapped onto the meta device (names and shapes, no
    data): a whole one passes and loads; one without its LM head, one missing layers, one
    whose shapes are another config's, a cut one and a shard its index names but that is
    absent are refused in one line, as for safetensors. A .bin in torch's pre-1.6 format
    (not mappable) is left to the replicas' load, and other .bin files are no weights."""
    vocab = _vocab(tmp_path)
    whole = _as_bin(_folder(tmp_path, "whole", _llama(vocab, tie=False)))
    (whole / "training_args.bin").write_bytes(b"not a state dict")
    assert check_model(str(whole), SimpleNamespace()) == []
    model, _ = load_pretrained(SimpleNamespace(model=str(whole)), Placement("cpu", "fp32"), seed=0)
    assert model.lm_head.weight.shape == (vocab, SMALL["hidden_size"])

    headless = _as_bin(_folder(tmp_path, "headless", _llama(vocab, tie=False, head=False)))
    assert "its weights lack lm_head.weight: it was saved without its LM head" in _refused(headless)
    cut = _as_bin(_folder(tmp_path, "cut", _llama(vocab, tie=False)),
                  keep=lambda k: ".layers.1." not in k)  # fmt: skip
    assert "(and 8 more): the checkpoint is incomplete" in _refused(cut)
    other = _as_bin(_folder(tmp_path, "other", _llama(vocab, tie=False)))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    said = _refused(other)
    assert f"--model {other}: pytorch_model.bin stores model.layers.0.mlp." in said
    assert "the config and the weights are of different models" in said

    truncated = _as_bin(_folder(tmp_path, "truncated", _llama(vocab, tie=False)))
    data = (truncated / "pytorch_model.bin").read_bytes()
    (truncated / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    said = _refused(truncated)
    assert said.startswith(f"--model {truncated}: pytorch_model.bin is not a whole PyTorch")
    assert said.endswith("download or save the model again")

    sharded = _as_bin(_folder(tmp_path, "sharded", _llama(vocab, tie=False)))
    (sharded / "pytorch_model.bin").rename(sharded / "pytorch_model-00001-of-00002.bin")
    index = {"weight_map": {"lm_head.weight": "pytorch_model-00002-of-00002.bin",
                            "model.norm.weight": "pytorch_model-00001-of-00002.bin"}}  # fmt: skip
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    said = _refused(sharded)
    assert "pytorch_model-00002-of-00002.bin named by pytorch_model.bin.index.json" in said

    legacy = _as_bin(_folder(tmp_path, "legacy", _llama(vocab, tie=False, head=False)), legacy=True)
    assert check_model(str(legacy), SimpleNamespace()) == []  # not mappable: no claim
