"""docs/integrations.md: every snippet is parsed, and checked where crf can check it."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest

from crf.integrations.prime_rl import check_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_prime_rl_toml_is_a_valid_composer_loss_table() -> None:
    (toml,) = _blocks("toml")
    kwargs = check_config(tomllib.loads(toml))
    assert kwargs["distill_alpha"] == 0.0 and kwargs["replay_beta"] == 0.0
    # the snippet's comment: distillation needs an algorithm that feeds it, grpo does not
    taught = toml.replace("distill_alpha = 0.0", "distill_alpha = 0.1")
    with pytest.raises(ValueError, match="PRIME-RL's algorithm\\(s\\) grpo"):
        check_config(tomllib.loads(taught))


def test_every_python_snippet_compiles() -> None:
    blocks = _blocks("python")
    assert len(blocks) == 2
    for block in blocks:
        ast.parse(block)


def test_the_verl_override_selects_the_composer_loss() -> None:
    commands = [shlex.split(b.replace("\\\n", " ")) for b in _blocks("bash")]
    verl = [c for c in commands if c[:3] == ["python", "-m", "verl.trainer.main_ppo"]]
    assert len(verl) == 1
    overrides = dict(arg.split("=", 1) for arg in verl[0][3:])
    assert overrides["actor_rollout_ref.actor.policy_loss.loss_mode"] == "composer"


@pytest.mark.parametrize("index", range(4))
def test_each_crf_launch_command_passes_a_dry_run(index: int, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    commands = [shlex.split(b.replace("\\\n", " ")) for b in _blocks("bash")]
    launches = [c for c in commands if c[:2] == ["crf", "launch"]]
    assert len(launches) == 4
    args = launches[index][1:]
    entry = args.index("--entrypoint") + 1
    program, *rest = shlex.split(args[entry])
    if shutil.which(program) is None:  # the stack's own launcher (uv) is not installed here
        args[entry] = shlex.join(["python", *rest])
    args += ["--dry-run", "--store", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
