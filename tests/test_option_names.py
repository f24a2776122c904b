"""One name per option everywhere: every declared run option reaches the same RunSpec value
from the CLI's flag, a config file's key, the SDK's keyword and run.json's field.

Each option is declared once on RunSpec (crf.spec.option); crf.launcher.names makes the
spellings a user meets (the field name, the flag's name, ``-`` or ``_``) mean that one option
on every surface, and an unknown name a one-line LaunchError with the nearest one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import crf
from crf.launcher import cli
from crf.launcher.config_file import dump_config
from crf.launcher.errors import LaunchError
from crf.results import DryRun
from crf.spec import ROLLOUT, run_options
from tests.test_cli import REPLICA_SCRIPT

#: run options the command line does not take (declared ``cli=False``; --set fills job_config)
NOT_ON_THE_COMMAND_LINE: set[str] = set()


def _samples(tmp: Path) -> dict[str, Any]:
    """A value for every declared run option, each unlike its default where the others allow
    (backend stays local: the walk launches nothing else; job composer: it takes data)."""
    (tmp / "data").mkdir()  # a folder of files: its config is "default"; a file has none
    (tmp / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(8))
    )
    (tmp / "eval").mkdir()  # a folder too: --eval-dataset-config names its "default"
    (tmp / "eval" / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    (tmp / "code").mkdir()
    (tmp / "code" / "replica.py").write_text(REPLICA_SCRIPT)
    (tmp / "requirements.txt").write_text("typer\n")
    return {
        "run_id": "walk",
        "job": "composer",
        "job_config": {"learning_rate": 2e-6},
        "entrypoint": f"{sys.executable} replica.py",
        "replicas": 3,
        "procs_per_replica": 1,
        "local_parallel": "fsdp",
        "sync_every": 12,
        "rounds": 2,
        "outer_lr": 0.5,
        "outer_momentum": 0.25,
        "nesterov": False,
        "seed": 7,
        "min_replicas": 2,
        "round_timeout_s": 120.0,
        "num_shards": 2,
        "reduce_group_size": 2,
        "keep_rounds": 4,
        "checkpoint_every": 2,
        "wire_dtype": "int8",
        "error_feedback": True,
        "sparse_density": 0.05,
        "sparse_outer": "diloco",
        "save_inner_state": False,
        "fragments": 2,
        "fragment_sync_delay": 1,
        "model": "acme/tiny-model",
        "trust_remote_code": True,
        "precision": "fp32",
        "device": "cpu",
        "gradient_checkpointing": True,
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_target_modules": "q_proj,v_proj",
        "dataset": str(tmp / "data"),
        "dataset_config": "default",
        "dataset_split": "train",
        "eval_split": "train",
        "eval_dataset": str(tmp / "eval"),
        "eval_dataset_config": "default",
        "eval_examples": 3,
        "columns": {"prompt": "question"},
        "reward": ["exact_match"],
        "reward_timeout": 1200.0,
        "report_to": "tensorboard",
        # no workers: they need the built-in replica, which this walk's script replaces, and
        # without workers a rollout option is refused unless left at its default
        # (tests/test_rollout_launch.py walks them with workers)
        **{name: opt.default for name, opt in run_options().items() if opt.group == ROLLOUT},
        "backend": "local",
        "env": {"STAGE": "2"},
        "secrets": ["WALK_TOKEN"],
        "workdir": str(tmp / "code"),
        "pip": ["pytest"],
        "requirements": str(tmp / "requirements.txt"),
    }


def _command_line(samples: dict[str, Any]) -> list[str]:
    """The samples as ``crf launch`` flags, each by its declared flag."""
    args: list[str] = []
    for name, value in samples.items():
        if name in NOT_ON_THE_COMMAND_LINE or value is None:  # None: the default, no flag
            continue
        flag = run_options()[name].flag
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif isinstance(value, dict):
            args += [a for k, v in value.items() for a in (flag, f"{k}={v}")]
        elif isinstance(value, list):
            args += [a for v in value for a in (flag, v)]
        else:
            args += [flag, str(value)]
    return args


def _config_file(samples: dict[str, Any], path: Path) -> Path:
    """The samples as a config file, each key spelt another way in turn: the field name, the
    flag's name with dashes, with underscores; one value for a one-item list."""
    top: dict[str, Any] = {}
    for i, (name, value) in enumerate(samples.items()):
        if name in ("job", "job_config", "backend"):
            continue
        flag = run_options()[name].flag.removeprefix("--")
        key = (name, flag, flag.replace("-", "_"))[i % 3]
        top[key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    text = dump_config(top, {}, samples["job_config"], {})
    path.write_text(text.replace("[job]", f'[job]\nname = "{samples["job"]}"'))
    return path


def _cli_spec(args: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``crf launch ARGS --dry-run``'s checked RunSpec, as run.json would hold it."""
    seen = []
    monkeypatch.setattr(cli, "_print_plan", seen.append)  # the plan the dry run would print
    out = CliRunner().invoke(cli.app, ["launch", *args, "--dry-run"])
    assert out.exit_code == 0, out.output
    (plan,) = seen
    return json.loads(plan.spec.to_json())


def test_every_option_has_one_value_from_flag_file_keyword_and_run_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = _samples(tmp_path)
    assert set(samples) == set(run_options()), "a declared option has no sample value"
    monkeypatch.setenv("WALK_TOKEN", "not-a-real-token")
    monkeypatch.chdir(tmp_path)
    store = str(tmp_path / "runs")
    sdk = crf.dry_run(**samples, store=store)
    assert isinstance(sdk, DryRun) and sdk.run_id == "walk" and sdk.missing == []
    expected = sdk.options
    for name, declared in run_options().items():  # the samples reached the spec
        if name not in ("job", "backend", "dataset_split") and declared.group != ROLLOUT:
            assert expected[name] != declared.default, name
    assert expected["round_timeout_s"] == 120.0 and expected["reward"] == ["exact_match"]
    assert expected["pip"] == ["pytest", "typer"]  # --requirements' lines join --pip

    flags = _cli_spec([*_command_line(samples), "--store", store], monkeypatch)
    for name in run_options():
        if name not in NOT_ON_THE_COMMAND_LINE:
            assert flags[name] == expected[name], name

    path = _config_file(samples, tmp_path / "walk.toml")
    from_file = _cli_spec(["-c", str(path), "--store", store], monkeypatch)
    for name in run_options():
        assert from_file[name] == expected[name], name

    by_flag_names = {run_options()[n].flag.removeprefix("--"): v for n, v in samples.items()}
    assert crf.dry_run(by_flag_names, store=store).options == expected

    monkeypatch.undo()  # a real launch: the replica script writes run.json's own reading
    monkeypatch.setenv("WALK_TOKEN", "not-a-real-token")
    monkeypatch.chdir(tmp_path)
    run = crf.launch(**samples, store=store, plot=False)
    assert run.result is not None and run.result.ok, run.result
    written = json.loads((tmp_path / "runs" / "walk" / "run.json").read_text())
    for name in run_options():
        assert written[name] == expected[name], name


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"timeot": 3600}, "unknown launch option 'timeot'; did you mean 'timeout'?"),
        ({"replica": 4}, "unknown launch option 'replica'; did you mean 'replicas'?"),
        ({"replicas": 2, "n_replicas": 3}, "unknown launch option 'n_replicas'"),
        ({"round_timeout": 9, "round_timeout_s": 9}, "round_timeout_s is given twice"),
        ({"replicas": "4"}, "--replicas must be an integer >= 1 and at most 1024 (got '4')"),
        ({"backend_options": {"hardware": "A10G"}}, "the local backend has no hardware option"),
        ({"gpu": "A10G"}, "the local backend has no hardware option (gpu); its options are"),
        ({"restart": crf.RestartPolicy(1), "max_restarts": 2}, "not both"),
    ],
)
def test_every_refusal_of_the_sdk_is_one_line(
    call: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(LaunchError) as caught:
        crf.dry_run(job="lm", store=str(tmp_path), **call)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(LaunchError):  # launch refuses the same, before anything starts
        crf.launch(job="lm", store=str(tmp_path), **call)
    assert not any(tmp_path.iterdir())


def test_spellings_and_single_values_mean_the_one_option(tmp_path: Path) -> None:
    store = str(tmp_path / "runs")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"q": "ab{i}=", "answer": "ba"}}\n' for i in range(16)))
    options = {"round-timeout": 50, "column": {"prompt": "q"}, "set": {"learning_rate": 1e-6}}
    plan = crf.dry_run(
        options, dataset=str(data), reward="exact_match", secret=[], timeout=60, store=store
    )
    assert plan.options["round_timeout_s"] == 50 and plan.options["reward"] == ["exact_match"]
    assert plan.options["columns"] == {"prompt": "q"}
    assert plan.options["job_config"] == {"learning_rate": 1e-6}
    assert plan.hourly_usd == 0.0 and plan.ready and plan.job_settings["learning_rate"] == 1e-6
    assert DryRun.from_dict(plan.to_dict()) == plan
    path = tmp_path / "run.toml"
    path.write_text('round_timeout = 50\nreward = "exact_match"\n[job]\nname = "composer"\n')
    from crf.launcher.config_file import load_config

    assert load_config(path).options == {"round_timeout_s": 50, "reward": ["exact_match"],
                                         "job": "composer"}  # fmt: skip


def test_backend_options_take_the_command_lines_names() -> None:
    from crf.launcher.config_file import resolve_backend

    for key in ("hardware", "gpu"):
        assert resolve_backend("modal", {key: "A10G"}, where="") == {"gpu": "A10G"}
    assert resolve_backend("sagemaker", {"instance-type": "ml.g5.xlarge"}, where="") == {
        "instance_type": "ml.g5.xlarge"
    }
    with pytest.raises(LaunchError, match="names gpu twice"):
        resolve_backend("modal", {"hardware": "A10G", "gpu": "T4"}, where="")


def test_resume_takes_the_launch_settings_but_no_run_option(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="replicas cannot be combined with resume"):
        crf.resume("walk", replicas=3, store=str(tmp_path))
    with pytest.raises(LaunchError, match="nothing to resume"):
        crf.resume("walk", store=str(tmp_path), max_restarts=1, timeout=60)
    with pytest.raises(LaunchError, match="did you mean 'max_restarts'"):
        crf.resume("walk", store=str(tmp_path), max_restart=1)
