"""A model's positions against the sequences a run asks of it.

A model with a learned table of absolute positions (GPT-2's ``wpe``, OPT's
``embed_positions``) fails on a sequence longer than the table, in the first step of every
replica; a rotary one generates on past its ``max_position_embeddings``, if worse. So the
launch refuses a prompt plus ``max_completion_length`` (or an sft ``max_length``) past a
learned table, warns past a rotary model's positions, and a replica that first reads its
model (a Hub id) refuses the same at setup, where no restart follows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crf.launcher.cli import app
from crf.replica.data_files import DataError
from crf.replica.prompt_fit import check_setup_prompts, learned_positions
from tests.hub_models import save_tiny_repo


def _gpt2(folder: Path, positions: int = 64) -> Path:
    """A GPT-2 with ``positions`` learned positions and the tiny model's tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    save_tiny_repo(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    (folder / "model.safetensors").unlink()
    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def _rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    # "bca=" and the template's ">": 5 tokens, the longest prompt
    words = ["ab", "bca", "cab", "dd", "abc", "cd", "bad", "dab"] * 4
    path.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n"
                            for w in words))  # fmt: skip
    return path


def test_a_learned_table_is_found_and_a_rotary_model_has_none(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, OPTConfig, OPTForCausalLM

    gpt2 = AutoModelForCausalLM.from_pretrained(_gpt2(tmp_path / "gpt2", 48))
    assert learned_positions(gpt2) == 48
    # OPT's table keeps two rows more than the positions it takes
    opt = OPTForCausalLM(OPTConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1,
                                   ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16,
                                   max_position_embeddings=40))  # fmt: skip
    assert opt.model.decoder.embed_positions.num_embeddings == 42
    assert learned_positions(opt) == 40
    assert learned_positions(save_tiny_repo(tmp_path / "qwen2")) is None  # rotary


def test_a_replica_refuses_completions_past_a_learned_table_at_setup(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _gpt2(tmp_path / "gpt2")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = ["ab=", "abcd" * 5 + "="]  # 21 tokens: one per character
    with pytest.raises(DataError) as caught:
        check_setup_prompts(tokenizer, model, prompts, "org/gpt2", new_tokens=50)
    assert "a prompt of 21 tokens and max_completion_length 50 need 71 positions" in str(
        caught.value
    )
    assert "--set max_completion_length=43" in str(caught.value)
    check_setup_prompts(tokenizer, model, prompts, "org/gpt2", new_tokens=43)  # fits
    tiny = save_tiny_repo(tmp_path / "qwen2")
    check_setup_prompts(tokenizer, tiny, prompts, "org/qwen2", new_tokens=10_000)  # rotary


def test_the_launch_takes_completions_that_fit_and_warns_past_rotary_positions(
    tmp_path: Path,
) -> None:
    runner = CliRunner()
    data = _rows(tmp_path)
    base = ["launch", "--dataset", str(data), "--reward", "exact_match", "--replicas", "2",
            "--store", str(tmp_path / "runs"), "--dry-run"]  # fmt: skip
    gpt2 = str(_gpt2(tmp_path / "gpt2"))
    fits = runner.invoke(app, [*base, "--model", gpt2, "--set", "max_completion_length=59"])
    assert fits.exit_code == 0, fits.output
    past = runner.invoke(app, [*base, "--model", gpt2, "--set", "max_completion_length=60"])
    assert past.exit_code == 2 and "need 65 positions" in past.output, past.output
    sft = runner.invoke(app, ["launch", "--job", "sft", "--dataset", str(data), "--model", gpt2,
                              "--column", "completion=answer", "--set", "max_length=64",
                              "--store", str(tmp_path / "runs"),
                              "--dry-run"])  # fmt: skip
    assert sft.exit_code == 0, sft.output
    qwen2 = tmp_path / "qwen2"
    save_tiny_repo(qwen2)
    limit = json.loads((qwen2 / "config.json").read_text())["max_position_embeddings"]
    rotary = runner.invoke(app, [*base, "--model", str(qwen2), "--set",
                                 f"max_completion_length={limit}"])  # fmt: skip
    flat = " ".join(rotary.output.split())
    assert rotary.exit_code == 0, rotary.output
    assert f"run past --model {qwen2}'s {limit} positions" in flat, flat


def test_sft_prompts_that_take_the_whole_max_length_are_warned_of_or_refused(
    tmp_path: Path,
) -> None:
    """TRL cuts an sft sequence at max_length and drops a row with no completion token left
    to train on, without a word: the launch says how many of the prompts it checked are such
    rows, and refuses when all are (no step would train)."""
    from crf.launcher.errors import LaunchError
    from crf.launcher.plan import prepare

    data = tmp_path / "pc.jsonl"
    prompts = ["ab=", "abcd=", "abcdab="]  # 3, 5 and 7 characters: tokens of the tiny model
    data.write_text("".join(json.dumps({"prompt": p, "completion": "ba"}) + "\n"
                            for p in prompts * 8))  # fmt: skip
    options = {"job": "sft", "dataset": str(data), "replicas": 2}
    plan = prepare({**options, "job_config": {"max_length": 5}}, store=str(tmp_path / "runs"))
    said = [n for n in plan.notes if "prompts checked are max_length 5" in n]
    assert len(said) == 1 and said[0].startswith(f"--dataset {data}: 16 of 24 prompts"), said
    assert "raise --set max_length above 7 (the longest prompt" in said[0]
    fits = prepare({**options, "job_config": {"max_length": 8}}, store=str(tmp_path / "runs"))
    assert not [n for n in fits.notes if "max_length" in n], fits.notes
    with pytest.raises(LaunchError) as caught:
        prepare({**options, "job_config": {"max_length": 3}}, store=str(tmp_path / "runs"))
    assert "every prompt checked is max_length 3 tokens or longer" in str(caught.value)


def test_sft_held_out_answers_past_a_learned_table_are_refused_before_launch_and_at_setup(
    tmp_path: Path,
) -> None:
    """sft's held-out pass@1 answers greedily, up to ``max_new_tokens`` (256 with --model),
    before the first step: on a model with a learned table of 64 positions that evaluation
    failed on every replica (an IndexError after launch). The launch refuses it naming the
    row and the setting, and a replica (a Hub model, first read there) refuses the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crf.replica.prompt_fit import check_answer_room

    runner = CliRunner()
    data = _rows(tmp_path)
    gpt2 = _gpt2(tmp_path / "gpt2")
    base = ["launch", "--job", "sft", "--dataset", str(data), "--eval-dataset", str(data),
            "--column", "completion=answer", "--reward", "exact_match", "--model", str(gpt2),
            "--set", "max_length=64", "--store", str(tmp_path / "runs"),
            "--dry-run"]  # fmt: skip
    past = runner.invoke(app, base)
    flat = " ".join(past.output.split())
    assert past.exit_code == 2, past.output
    assert "held-out pass@1: a prompt of 4 tokens and max_new_tokens 256 need 260" in flat
    assert "--set max_new_tokens=60" in flat and f"--eval-dataset {data} line 2" in flat, flat
    fits = runner.invoke(app, [*base, "--set", "max_new_tokens=60"])
    assert fits.exit_code == 0, fits.output
    unscored = [a for a in base if a not in ("--reward", "exact_match", "--eval-dataset")]
    unscored.remove(str(data))  # the --eval-dataset's; --dataset's stays
    assert runner.invoke(app, unscored).exit_code == 0  # no pass@1: nothing generated

    qwen2 = tmp_path / "qwen2"  # rotary: past its positions, a warning
    save_tiny_repo(qwen2)
    limit = json.loads((qwen2 / "config.json").read_text())["max_position_embeddings"]
    rotary = [*base[: base.index("--model") + 1], str(qwen2), *base[base.index("--model") + 2 :]]
    warned = runner.invoke(app, [*rotary, "--set", f"max_new_tokens={limit}"])
    flat = " ".join(warned.output.split())
    assert warned.exit_code == 0, warned.output
    assert f"held-out pass@1: a prompt of 4 tokens and max_new_tokens {limit} run past" in flat

    model = AutoModelForCausalLM.from_pretrained(gpt2)
    tokenizer = AutoTokenizer.from_pretrained(gpt2)
    prompts = ["ab=", "bca="]  # held-out text prompts go untemplated: 4 tokens the longest
    with pytest.raises(DataError) as caught:
        check_answer_room(tokenizer, model, prompts, "org/gpt2", 256)
    assert "max_new_tokens 256 need" in str(caught.value), caught.value
    check_answer_room(tokenizer, model, prompts, "org/gpt2", 60)  # fits
    check_answer_room(tokenizer, save_tiny_repo(tmp_path / "q"), prompts, "org/q", 10_000)


def test_an_sft_max_length_past_the_positions_is_refused_or_warned_of_alike(
    tmp_path: Path,
) -> None:
    """The sft job's max_length past a learned table is refused before launch and, for a
    model first read by a replica (a Hub id), at setup, in the same words; past a rotary
    model's max_position_embeddings it is a warning (the model trains on past them, worse),
    as the held-out answers' are."""
    from transformers import AutoModelForCausalLM

    from crf.replica.prompt_fit import check_length_room

    runner = CliRunner()
    data = _rows(tmp_path)
    gpt2 = _gpt2(tmp_path / "gpt2")
    qwen2 = tmp_path / "qwen2"
    save_tiny_repo(qwen2)
    limit = json.loads((qwen2 / "config.json").read_text())["max_position_embeddings"]
    base = ["launch", "--job", "sft", "--dataset", str(data), "--column", "completion=answer",
            "--store", str(tmp_path / "runs"), "--dry-run", "--model"]  # fmt: skip

    past = runner.invoke(app, [*base, str(gpt2), "--set", "max_length=65"])
    flat = " ".join(past.output.split())
    assert past.exit_code == 2, past.output
    said = f"--model {gpt2} has 64 positions (a learned table: a longer sequence fails"
    assert said in flat and "max_length is 65: --set max_length=64 (or less)" in flat, flat
    with pytest.raises(DataError) as caught:
        check_length_room(AutoModelForCausalLM.from_pretrained(gpt2), "org/gpt2", 65)
    assert "--model org/gpt2 has 64 positions (a learned table" in str(caught.value)
    assert "max_length is 65: --set max_length=64 (or less)" in str(caught.value)
    check_length_room(AutoModelForCausalLM.from_pretrained(gpt2), "org/gpt2", 64)  # fits
    check_length_room(AutoModelForCausalLM.from_pretrained(qwen2), "org/qwen2", 10_000)

    warned = runner.invoke(app, [*base, str(qwen2), "--set", f"max_length={limit + 1}"])
    flat = " ".join(warned.output.split())
    assert warned.exit_code == 0, warned.output
    assert (
        f"warning: --model {qwen2} has {limit} positions (max_position_embeddings) but the "
        f"sft job's max_length is {limit + 1}" in flat
    ), flat
    assert f"--set max_length={limit} cuts sequences there" in flat
    fits = runner.invoke(app, [*base, str(qwen2), "--set", f"max_length={limit}"])
    assert fits.exit_code == 0 and "(max_position_embeddings) but" not in fits.output
