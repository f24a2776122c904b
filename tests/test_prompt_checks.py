"""Before launch, a local --model reads the composer job's prompts as a replica will: through
its chat template (one that refuses a role says so, naming the row, even far past the first
rows) and within its positions (a prompt longer than max_position_embeddings is refused,
naming the row, instead of a replica dying of the memory it asks for and being restarted);
and the sft job's conversations through the same template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from crf.launcher import driver
from crf.launcher.errors import LaunchError
from tests.hub_models import save_tiny_repo

#: refuses any role but user and assistant, as many real templates do
STRICT = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


#: renders no turn for a role it does not know, as Qwen's templates do
SKIPS = (
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
    "{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)


def _with_template(folder: Path, template: str) -> Path:
    """The tiny model (128 positions) saved to ``folder`` with this chat template."""
    save_tiny_repo(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in folder.glob("chat_template.*"):
        extra.write_text(template)
    return folder


@pytest.fixture(scope="module")
def strict_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a template that refuses unknown roles."""
    return _with_template(tmp_path_factory.mktemp("strict") / "model", STRICT)


def _plan(tmp_path: Path, model: Path, rows: list[dict[str, Any]]) -> Any:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return driver.prepare(
        {"replicas": 2, "model": str(model), "dataset": str(data), "reward": ["exact_match"],
         "job_config": {"prompts_per_step": 2}},
        store=str(tmp_path / "runs"), dry_run=True,
    )  # fmt: skip


def _chat(role: str = "user", content: str = "abc=") -> list[dict[str, str]]:
    return [{"role": role, "content": content}]


def test_a_role_the_template_refuses_is_named_with_its_row(tmp_path, strict_model) -> None:
    rows = [{"prompt": _chat(), "answer": "cba"} for _ in range(40)]
    _plan(tmp_path, strict_model, rows)  # every role accepted
    rows[25]["prompt"] = _chat("usr")
    with pytest.raises(LaunchError) as caught:
        _plan(tmp_path, strict_model, rows)
    message = str(caught.value)
    assert "line 26: --model" in message and "chat template refuses the prompt" in message
    assert "Unknown role: usr" in message and "\n" not in message


def test_a_prompt_longer_than_the_models_positions_is_refused(tmp_path, strict_model) -> None:
    rows = [{"prompt": "abc=", "answer": "cba"} for _ in range(40)]
    rows[30]["prompt"] = "ab" * 100 + "="  # 201 characters: tokens, for a character tokenizer
    with pytest.raises(LaunchError) as caught:
        _plan(tmp_path, strict_model, rows)
    message = str(caught.value)
    assert "line 31: the prompt is" in message and "(128 positions" in message
    rows[30]["prompt"] = "ab" * 40 + "="  # fits, as do the template's few tokens around it
    _plan(tmp_path, strict_model, rows)


def test_a_refusal_on_the_command_line_is_one_line(tmp_path, strict_model) -> None:
    from tests.test_cli import crf

    rows = [{"prompt": _chat(), "answer": "cba"} for _ in range(16)]
    rows[9]["prompt"] = _chat("tool")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = crf("launch", "-n", "2", "--model", str(strict_model), "--dataset", str(data),
                 "--reward", "exact_match", "--store", str(tmp_path / "runs"))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert "line 10:" in result.output and "Unknown role: tool" in result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("form", ["messages", "prompt-completion"])
def test_an_sft_conversation_the_template_refuses_is_named_with_its_row(
    tmp_path, strict_model, form: str
) -> None:
    """The sft job's conversations meet the template when each replica tokenizes its
    dataset (a setup error on every replica): the launcher renders them first."""

    def row(role: str) -> dict[str, Any]:
        if form == "messages":
            return {"messages": [*_chat(role), *_chat("assistant", "cba")]}
        return {"prompt": _chat(role), "completion": _chat("assistant", "cba")}

    rows = [row("user") for _ in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"replicas": 2, "job": "sft", "model": str(strict_model), "dataset": str(data)}
    driver.prepare(spec, store=str(tmp_path / "runs"), dry_run=True)  # every role accepted
    rows[33] = row("human")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(LaunchError) as caught:
        driver.prepare(spec, store=str(tmp_path / "runs"), dry_run=True)
    message = str(caught.value)
    assert "line 34: --model" in message and "chat template refuses the conversation" in message
    assert "Unknown role: human" in message and "\n" not in message


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_a_role_the_template_leaves_out_is_named_with_its_row(tmp_path, job: str) -> None:
    """ShareGPT's roles through a template that renders no turn for them: the model would
    train without those turns; refused, naming the row and the role."""
    model = _with_template(tmp_path / "model", SKIPS)

    def row(user: str) -> dict[str, Any]:
        if job == "composer":
            return {"prompt": _chat(user), "answer": "cba"}
        return {"messages": [*_chat(user), *_chat("assistant", "cba")]}

    rows = [row("human" if i == 10 else "user") for i in range(12)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"replicas": 2, "job": job, "model": str(model), "dataset": str(data),
            "job_config": {"prompts_per_step": 2} if job == "composer" else {}}  # fmt: skip
    with pytest.raises(LaunchError) as caught:
        driver.prepare(spec, store=str(tmp_path / "runs"), dry_run=True)
    message = str(caught.value)
    assert "line 11: --model" in message, message
    assert "chat template leaves out the message of role 'human'" in message


def test_weights_of_other_shapes_than_the_config_are_refused(tmp_path) -> None:
    """A config.json beside another model's weights: every replica's from_pretrained would
    fail alike; the launcher compares the safetensors headers with the model the config
    builds on the meta device, and names the tensor."""
    from crf.launcher.model_shapes import shape_problem

    folder = tmp_path / "model"
    save_tiny_repo(folder)  # hidden size 32
    assert shape_problem(str(folder), ["model.safetensors"]) is None
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    rows = [{"prompt": "abc=", "answer": "cba"} for _ in range(8)]
    with pytest.raises(LaunchError) as caught:
        _plan(tmp_path, folder, rows)
    message = str(caught.value)
    assert "model.safetensors stores model.embed_tokens.weight as [" in message
    assert ", 32] but config.json makes it [" in message and ", 64]" in message
    # a quantized checkpoint stores packed weights in other shapes: not compared
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    assert shape_problem(str(folder), ["model.safetensors"]) is None


def test_a_replica_renders_its_own_prompts_at_setup(tmp_path, strict_model) -> None:
    """A Hub model, or a URL dataset's rows past the first, are first seen by a replica: it
    renders the same choice of rows while it builds (a setup error ends the run at once),
    rather than meeting the template's error in a training step (taken for a death and
    restarted, on every attempt)."""
    from transformers import AutoModelForCausalLM

    from crf.replica.data import DataError
    from crf.replica.model import local_tokenizer
    from crf.replica.prompt_fit import check_setup_prompts

    model = AutoModelForCausalLM.from_pretrained(strict_model)
    tokenizer = local_tokenizer(str(strict_model))
    prompts: list[Any] = [_chat() for _ in range(40)]
    check_setup_prompts(tokenizer, model, prompts, "org/strict")  # every role accepted
    prompts[25] = _chat("usr")
    with pytest.raises(DataError, match=r"--model org/strict's chat template refuses a prompt "
                       r"\('usr: abc='\): TemplateError: Unknown role: usr"):  # fmt: skip
        check_setup_prompts(tokenizer, model, prompts, "org/strict")
    prompts[25] = _chat(content="ab" * 100 + "=")  # 128 positions
    with pytest.raises(DataError, match=r"is \d+ tokens, more than --model org/strict takes"):
        check_setup_prompts(tokenizer, model, prompts, "org/strict")
    skips = local_tokenizer(str(_with_template(tmp_path / "skips", SKIPS)))
    prompts[25] = _chat("human")
    with pytest.raises(DataError, match="leaves out the message of role 'human'"):
        check_setup_prompts(skips, model, prompts, "org/skips")
