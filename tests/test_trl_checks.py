"""Settings and models every replica would fail on, refused before launch in one line: a
``trl`` setting that needs a package the replicas will not have, ``generation_kwargs``
GenerationConfig refuses, ``assistant_only_loss`` with a chat template that marks no
assistant turns, and tokenizers generation or SFT cannot use."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from crf.replica import trl_settings
from tests.test_cli import crf


def _dry_run(tmp_path: Path, *args: str) -> str:
    """The output of a refused ``crf launch --dry-run`` (one line, nothing written)."""
    result = crf("launch", *args, "--store", str(tmp_path / "runs"), "--dry-run")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "runs").exists()
    return result.output


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_liger_kernel_not_installed_is_refused_locally(tmp_path: Path, job: str) -> None:
    out = _dry_run(tmp_path, "--job", job, "--set", "trl.use_liger_kernel=true")
    assert "trl.use_liger_kernel needs liger-kernel, which is not installed" in out
    assert "pip install liger-kernel" in out


def test_liger_kernel_on_a_cloud_backend_must_be_in_pip() -> None:
    fields = {"use_liger_kernel": True}
    with pytest.raises(trl_settings.SettingError, match="add --pip liger-kernel"):
        trl_settings.check_packages(fields, SimpleNamespace(pip=["scipy"]), local=False)
    trl_settings.check_packages(fields, SimpleNamespace(pip=["Liger_Kernel>=0.5"]), local=False)
    trl_settings.check_packages({"use_liger_kernel": False}, SimpleNamespace(pip=[]), local=True)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"max_new_tokens": "x"}', "GenerationConfig refuses max_new_tokens='x': '<='"),
        ('{"max_new_tokens": 0}', "refuses max_new_tokens=0: `max_new_tokens` must be greater"),
        ("[1, 2]", "trl.generation_kwargs must be a table of GenerationConfig fields"),
    ],
)
def test_generation_kwargs_generation_config_refuses(tmp_path: Path, value: str, says: str) -> None:
    out = _dry_run(tmp_path, "--set", f"trl.generation_kwargs={value}")
    assert says in out


def test_good_generation_kwargs_pass() -> None:
    trl_settings.check_generation_kwargs({"generation_kwargs": {"min_tokens": 2, "top_k": 5}})


def test_zero_completion_tokens_is_the_default() -> None:
    from crf.replica.jobs import job_config

    assert job_config("composer", {"max_completion_length": "0"}).max_completion_length is None


# --------------------------------------------------------------------------- the tokenizer
WORDS = [a + b + c for a in "abcd" for b in "abcd" for c in "abcd"]  # 64 rows


def _folder(tmp_path: Path, change: Callable[[Path], None] | None = None) -> str:
    """The tiny model saved in ``tmp_path``, then changed by ``change``."""
    from tests.hub_models import save_tiny_repo

    folder = tmp_path / "model"
    save_tiny_repo(folder)
    if change is not None:
        change(folder)
    return str(folder)


def _edit_config(folder: Path, **values: object) -> None:
    path = folder / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def _data(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _no_eos(folder: Path) -> None:
    data = json.loads((folder / "tokenizer_config.json").read_text())
    assert data.get("pad_token")
    data.pop("eos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_a_tokenizer_without_eos_is_refused(tmp_path: Path, job: str) -> None:
    rows = [{"prompt": w, "completion": w[::-1], "answer": w[::-1]} for w in WORDS]
    model = _folder(tmp_path, _no_eos)
    out = _dry_run(tmp_path, "--job", job, "--model", model, "--dataset", _data(tmp_path, rows))
    assert f"--model {model}: its tokenizer has no EOS token, which generation stops on and " \
           "SFT appends; set tokenizer.eos_token and save_pretrained" in out  # fmt: skip


def _slow_only(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    _edit_config(folder, tokenizer_class="PreTrainedTokenizerFast")


def test_a_tokenizer_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    from crf.replica.model import load_local_tokenizer

    model = _folder(tmp_path, _slow_only)
    assert load_local_tokenizer(model)[0] is None
    rows = [{"prompt": w, "answer": w[::-1]} for w in WORDS]
    out = _dry_run(tmp_path, "--model", model, "--dataset", _data(tmp_path, rows))
    assert f"--model {model}: its tokenizer does not load (" in out
    assert "save a fast tokenizer (tokenizer.json) with save_pretrained, or install " \
           "sentencepiece" in out  # fmt: skip


MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


def _marked(folder: Path) -> None:
    (folder / "chat_template.jinja").write_text(MARKED)


def test_assistant_only_loss_needs_generation_markers(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}
        for w in WORDS
    ]
    data = _data(tmp_path, rows)
    args = ["--job", "sft", "--dataset", data, "--set", "trl.assistant_only_loss=true"]
    out = _dry_run(tmp_path, *args, "--model", _folder(tmp_path))
    assert "trl.assistant_only_loss needs a chat template that marks the assistant's turns " \
           "with {% generation %}" in out  # fmt: skip
    marked = _folder(tmp_path / "marked", _marked)
    result = crf("launch", *args, "--model", marked, "--store", str(tmp_path / "r"), "--dry-run")
    assert result.exit_code == 0, result.output
