"""README's config files load: every ```toml block whose first line is ``# file: NAME.toml``
is written as NAME.toml and read with ``crf.launcher.config_file.load_config``, and its
options, ``[backend]`` and ``[job]`` tables pass the checks a launch makes (without the
backend's credentials: README's "Train your own model" shows the dry run itself)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from crf.launcher.config_file import check_job_keys, load_config, resolve_backend
from crf.replica.jobs import job_config
from crf.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
FILES = re.findall(
    r"```toml\n# file: (\S+\.toml)[^\n]*\n(.*?)```", (ROOT / "README.md").read_text(), re.S
)


def test_readme_has_the_train_your_own_model_file() -> None:
    assert "grpo-qwen.toml" in [name for name, _ in FILES]


@pytest.mark.parametrize(("name", "body"), FILES, ids=[name for name, _ in FILES])
def test_readme_config_file_loads_and_validates(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / name
    path.write_text(f"# file: {name}\n{body}")
    cfg = load_config(path)
    backend = cfg.options["backend"]
    resolve_backend(backend, cfg.backend_options, str(path))
    job = cfg.options.get("job", "composer")
    check_job_keys(job, cfg.job_config, str(path))
    job_config(job, cfg.job_config)  # the values, as --set checks them
    spec = RunSpec(run_id="readme", run_uri="s3://my-bucket/crf-runs/readme", **cfg.options)
    spec.job_config = cfg.job_config
    spec.validate()
    if name == "grpo-qwen.toml":  # what the section says the file holds
        assert (spec.model, spec.dataset, spec.reward) == (
            "Qwen/Qwen2.5-0.5B-Instruct",
            "openai/gsm8k",
            ["math_answer"],
        )
        assert spec.columns == {"prompt": "question", "answer": "answer"}
        assert (backend, spec.replicas, cfg.backend_options["hardware"]) == ("modal", 4, "A10G")
        assert spec.report_to == "wandb" and "WANDB_API_KEY" in spec.secrets
        assert cfg.launch_flags["store"].startswith("s3://")
