"""examples/ holds every config file the docs show, and each one loads: every ```toml block of
README.md or docs/ whose first line is ``# file: examples/NAME.toml`` is that file, word for
word, and every examples/*.toml is read with ``crf.launcher.config_file.load_config`` and its
options, ``[backend]`` and ``[job]`` tables pass the checks a launch makes (without the
backend's credentials: tests/test_readme_commands.py runs their dry runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from crf.launcher.config_file import check_job_keys, load_config, resolve_backend
from crf.replica.jobs import job_config
from crf.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.toml"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHOWN = [
    (doc, name, body)
    for doc in DOCS
    for body, name in re.findall(
        r"```toml\n(# file: (\S+\.toml)[^\n]*\n.*?)```", doc.read_text(), re.S
    )
]


def test_the_docs_show_the_shipped_examples() -> None:
    names = {name for _, name, _ in SHOWN}
    assert {"examples/grpo-qwen.toml", "examples/run.toml"} <= names
    # a whole config file in README or a guide page is a shipped example (other pages show
    # fragments of one, such as a [job.trl] table)
    guides = [ROOT / "README.md", *(ROOT / "docs" / n for n in ("config-file.md", "your-model.md"))]
    unshipped = [d for d in guides if re.search(r"```toml\n(?!# file: examples/)", d.read_text())]
    assert unshipped == []


@pytest.mark.parametrize(("doc", "name", "body"), SHOWN, ids=[f"{d.name}:{n}" for d, n, _ in SHOWN])
def test_a_config_shown_in_the_docs_is_the_shipped_file(doc: Path, name: str, body: str) -> None:
    assert (ROOT / name).read_text() == body, f"{doc.name} shows {name} other than it is"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.relative_to(ROOT).as_posix() for p in EXAMPLES])
def test_example_config_file_loads_and_validates(path: Path) -> None:
    cfg = load_config(path)
    backend = cfg.options.get("backend", "local")
    resolve_backend(backend, cfg.backend_options, str(path))
    job = cfg.options.get("job", "composer")
    check_job_keys(job, cfg.job_config, str(path))
    job_config(job, cfg.job_config)  # the values, as --set checks them
    spec = RunSpec(run_id="example", run_uri="s3://my-bucket/crf-runs/example", **cfg.options)
    spec.job_config = cfg.job_config
    spec.validate()
    if path.name == "grpo-qwen.toml":  # what README and docs/your-model.md say it holds
        assert (spec.model, spec.dataset, spec.reward, spec.eval_split) == (
            "Qwen/Qwen2.5-0.5B-Instruct",
            "openai/gsm8k",
            ["math_answer"],
            "test",
        )
        assert spec.columns == {"prompt": "question", "answer": "answer"}
        assert (backend, spec.replicas, cfg.backend_options["hardware"]) == ("modal", 4, "A10G")
        assert spec.report_to == "wandb" and "WANDB_API_KEY" in spec.secrets
        assert cfg.launch_flags["store"].startswith("s3://")


#: the crf config fragments other pages show (a [job.trl] table, a [job] with its trl table)
FRAGMENTS = [
    (doc, body)
    for doc in DOCS
    for body in re.findall(r"```toml\n(?!# file: )(.*?)```", doc.read_text(), re.S)
    if body.lstrip().startswith("[job")
]


@pytest.mark.parametrize(("doc", "body"), FRAGMENTS, ids=[d.name for d, _ in FRAGMENTS])
def test_a_config_fragment_in_the_docs_loads_and_validates(
    doc: Path, body: str, tmp_path: Path
) -> None:
    """A fragment is a whole config file too (every other key at its default): it loads, and
    its job settings are what the job checks before launch (TRL's config included)."""
    path = tmp_path / "fragment.toml"
    path.write_text(body)
    cfg = load_config(path)
    job = cfg.options.get("job", "composer")
    check_job_keys(job, cfg.job_config, f"{doc.name}")
    assert job_config(job, cfg.job_config).trl, f"{doc.name}: the fragment sets no trl field"


def test_the_docs_show_config_fragments() -> None:
    assert {d.name for d, _ in FRAGMENTS} >= {"composer.md", "sft.md"}
