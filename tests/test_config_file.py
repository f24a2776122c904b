"""``crf launch -c FILE`` and ``--print-config`` (crf/launcher/config_file.py), and the
repeatable list / ``KEY=VALUE`` flags made from list and dict run options.

Everything here runs with ``--print-config`` or ``--dry-run``: nothing is launched, and the
tests check that nothing is written either.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from crf.launcher import driver
from crf.launcher.cli import _repeatable_values, _run_option_parameter, app
from crf.launcher.config_file import (
    ConfigError,
    dump_config,
    launch_config,
    load_config,
    parse_config,
    prepare_config,
    resolve_backend,
)
from crf.launcher.errors import LaunchError
from crf.spec import Option, RunSpec, run_options
from tests.fake_job import register_fake_job
from tests.test_cli import REPLICA_SCRIPT


@dataclasses.dataclass
class _FakeConfig:
    lr: float = 0.1
    steps: int = 10
    name_of_task: str = "reverse"

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"testjob option lr must be > 0 (got {self.lr})")


@pytest.fixture(autouse=True)
def testjob(monkeypatch: pytest.MonkeyPatch) -> str:
    """A registered job with a Config (no torch needed to check its options)."""
    return register_fake_job(monkeypatch, _FakeConfig)


EXAMPLE = """\
# a run of the test job
replicas = 3
sync-every = 4          # the flag's spelling works too
rounds = 2
round-timeout = 60.0
error_feedback = true
store = "{store}"
max_restarts = 1

[backend]
name = "local"
poll_s = 0.5

[job]
name = "testjob"
lr = 0.01
steps = 7
"""


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def example(tmp_path: Path) -> Path:
    return _write(tmp_path, EXAMPLE.format(store=tmp_path / "runs"))


def crf(*args: str | Path):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_load_reads_run_options_tables_and_launch_flags(example: Path, tmp_path: Path) -> None:
    cfg = load_config(example)
    assert cfg.options == {
        "replicas": 3, "sync_every": 4, "rounds": 2, "round_timeout_s": 60.0,
        "error_feedback": True, "backend": "local", "job": "testjob",
    }  # fmt: skip
    assert cfg.backend_options == {"poll_s": 0.5}
    assert cfg.job_config == {"lr": 0.01, "steps": 7}
    assert cfg.launch_flags == {"store": str(tmp_path / "runs"), "max_restarts": 1}
    # the SDK takes the same values: a checked plan, nothing written
    plan = driver.prepare(
        cfg.options | {"job_config": cfg.job_config, "run_id": "sdk"},
        store=cfg.launch_flags["store"],
        backend_options=resolve_backend(cfg.options["backend"], cfg.backend_options),
        dry_run=True,
    )
    assert (plan.spec.replicas, plan.spec.sync_every, plan.spec.round_timeout_s) == (3, 4, 60.0)
    assert plan.spec.job_config == {"lr": 0.01, "steps": 7}
    assert not (tmp_path / "runs").exists()


def test_sdk_prepares_a_config_file_with_overrides(example: Path, tmp_path: Path) -> None:
    plan = prepare_config(
        example, {"replicas": 2, "run_id": "sdk2", "job_config": {"lr": 0.2}}, dry_run=True
    )
    spec = plan.spec
    assert (spec.replicas, spec.sync_every, spec.job) == (2, 4, "testjob")
    assert spec.job_config == {"lr": 0.2, "steps": 7}
    assert plan.restart.max_restarts == 1 and plan.executor.name == "local"
    assert spec.run_uri.endswith("/runs/sdk2") and not (tmp_path / "runs").exists()
    with pytest.raises(LaunchError, match="--replicas must be an integer >= 1"):
        prepare_config(example, {"replicas": 0}, dry_run=True)


def test_sdk_launches_a_config_file(tmp_path: Path) -> None:
    """One real local run of 2 replicas from a file (the user-script replica of test_cli)."""
    script = _write(tmp_path, REPLICA_SCRIPT, "my_train.py")
    store = tmp_path / "runs"
    path = _write(
        tmp_path,
        f'replicas = 2\nsync_every = 2\nrounds = 2\nentrypoint = ["{sys.executable}", '
        f'"{script}"]\nstore = "{store}"\ntimeout = 120\n[job]\nname = "testjob"\nsteps = 3\n',
    )
    summary = launch_config(path, {"run_id": "sdk-run"}, progress=False, report=False)
    assert summary["status"] == "ok", summary
    spec = json.loads((store / "sdk-run" / "run.json").read_text())
    assert (spec["replicas"], spec["rounds"], spec["job_config"]) == (2, 2, {"steps": 3})


def test_backend_and_job_may_be_plain_keys_and_hardware_has_its_aliases() -> None:
    cfg = parse_config('backend = "modal"\njob = "lm"\nreplicas = 2\n')
    assert cfg.options == {"backend": "modal", "job": "lm", "replicas": 2}
    cfg = parse_config('[backend]\nname = "modal"\ngpu = "A10G"\ntimeout = 60\n')
    assert cfg.backend_options == {"gpu": "A10G"}
    assert cfg.launch_flags == {"timeout": 60}  # the launch's --timeout, as on the CLI
    assert resolve_backend("modal", cfg.backend_options) == {"gpu": "A10G"}
    assert resolve_backend("hf", {"hardware": "a10g-small"}) == {"flavor": "a10g-small"}
    assert resolve_backend("sagemaker", {"gpu": "ml.g5.xlarge"}) == {
        "instance_type": "ml.g5.xlarge"
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("repilcas = 3\n", "unknown key 'repilcas' in config file {f}; did you mean 'replicas'?"),
        ("bogus_thing = 1\n", "unknown key 'bogus_thing' in config file {f}"),
        ("job_config = {lr = 1}\n", "put these options in a [job] table"),
        ("[backend]\ngpu = 'a'\nflavor = 'b'\n", "names the hardware twice (gpu, flavor)"),
        ("job = 3\n[job]\n", "is not valid TOML"),
        ("max_restarts = 'many'\n", "max_restarts in config file {f} must be int"),
        ("[backend]\ntimeout = 'long'\n", "timeout in config file {f} must be int or float"),
        ("backend = 3\n", "backend in config file {f} must be a string or a [backend] table"),
        ("replicas = \n", "is not valid TOML: Invalid value (at line 1, column 12)"),
        ("[job]\nlr = 0.1\n[job]\n", "(at line 3, column 5)"),
    ],
)
def test_bad_file_is_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert message.format(f=path) in str(caught.value)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_missing_file_and_unknown_backend_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file .*nope.toml does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as caught:
        resolve_backend("modal", {"gpuu": "A10G"}, "f.toml")
    assert "unknown key 'gpuu' in [backend] in config file f.toml; did you mean 'gpu'?" in str(
        caught.value
    )
    assert "the modal backend's options: gpu, image" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("replicas = 'four'\n", "--replicas must be an integer >= 1 and at most 1024 (got 'four')"),
        ("outer_lr = -1.0\n", "--outer-lr must be > 0 and finite (got -1.0)"),
        ("replica = 2\n", "unknown key 'replica' in config file {f}; did you mean 'replicas'?"),
        ("[job]\nname = 'testjob'\nlr = 'fast'\n", "job option lr='fast' is not a valid float"),
        (
            "[job]\nname = 'testjob'\nstpes = 1\n",
            "unknown key 'stpes' in [job] in config file "
            "{f}; did you mean 'steps'? (job 'testjob''s options: lr, name_of_task, steps)",
        ),
        ("[backend]\nname = 'local'\ngpu = 'A10G'\n", "unknown key 'gpu' in [backend]"),
        ("[backend]\npoll = 1\n", "did you mean 'poll_s'?"),
        # an option one table off says where it goes (not the nearest other name)
        (
            "rollout_hardware = 'L4'\n",
            "'rollout_hardware' in config file {f} is a backend "
            "option: put it in the [backend] table",
        ),
        (
            "gpu = 'A10G'\n",
            "'gpu' in config file {f} is a backend option: put it in the [backend] table",
        ),
        (
            "[job]\nname = 'testjob'\nrollout_workers = 2\n",
            "'rollout_workers' in [job] in "
            "config file {f} is a run option, not an option of the testjob job: put it at the "
            "top level",
        ),
    ],
)
def test_cli_refuses_a_bad_file_before_launch(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    for mode in ("--dry-run", "--print-config"):
        result = crf("launch", "-c", path, "--store", tmp_path / "runs", mode)
        assert result.exit_code == 2, result.output
        assert message.format(f=path) in result.output
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_flags_override_the_file_key_by_key(example: Path) -> None:
    result = crf(
        "launch", "-c", example, "-n", "5", "--set", "lr=0.5", "--max-restarts", "2",
        "--print-config",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    printed = parse_config(result.output)
    assert printed.options["replicas"] == 5  # the flag
    assert printed.options["sync_every"] == 4  # the file
    assert printed.options["outer_lr"] == RunSpec.outer_lr  # the default
    assert printed.job_config == {"lr": 0.5, "steps": 7}  # --set over [job], typed
    assert printed.launch_flags["max_restarts"] == 2
    assert printed.backend_options == {"poll_s": 0.5}


def test_print_config_round_trips_and_writes_nothing(example: Path, tmp_path: Path) -> None:
    first = crf("launch", "-c", example, "-r", "9", "--entrypoint", "python x.py",
                "--print-config")  # fmt: skip
    assert first.exit_code == 0, first.output
    again = _write(tmp_path, first.output, "printed.toml")
    cfg = load_config(again)
    # every run option is there (None ones left out: TOML has no null, they default again)
    declared = {n for n, o in run_options().items() if o.default is not None}
    assert declared - {"job_config"} <= set(cfg.options)
    assert cfg.options["rounds"] == 9 and cfg.options["entrypoint"] == "python x.py"
    second = crf("launch", "-c", again, "--print-config")
    assert second.exit_code == 0 and second.output == first.output
    assert load_config(again) == parse_config(second.output)
    assert not (tmp_path / "runs").exists()
    # what is printed also launches: the dry run of the printed file checks it all
    dry = crf("launch", "-c", again, "--run-id", "dry", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "3 subprocess(es)" in dry.output and "nothing was launched" in dry.output
    assert not (tmp_path / "runs").exists()


def test_dump_config_values_read_back_the_same() -> None:
    options = {"job": "testjob", "entrypoint": ["python", "a b.py"], "outer_lr": float("inf"),
               "weird": 'q"uote\\back\nline', "run_id": None}  # fmt: skip
    job = {"columns": {"prompt": "question", "odd key": "x"}, "tags": ["a", "b"], "n": 3}
    text = dump_config(options, {}, job, {"timeout": 1.5})
    data = __import__("tomllib").loads(text)
    assert data["entrypoint"] == ["python", "a b.py"] and data["outer_lr"] == float("inf")
    assert data["weird"] == options["weird"] and "run_id" not in data
    assert data["job"] == {"name": "testjob", **job} and data["timeout"] == 1.5


def test_secrets_are_never_printed(tmp_path: Path) -> None:
    path = _write(tmp_path, '[backend]\nname = "hf"\ntoken = "hf_file_secret"\n')
    result = crf("launch", "-c", path, "-o", "namespace=org", "--print-config")
    assert result.exit_code == 0, result.output
    assert "hf_file_secret" not in result.output
    assert "# token: a secret, not printed" in result.output
    assert parse_config(result.output).backend_options == {"namespace": "org"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('env = ["WANDB_API_KEY=wk_file_secret_123"]\n',
         'env must be a mapping of variable names to values (got a list); in a config file: '
         'env = {NAME = "value"}'),
        ('env = {JUDGE_URL = "https://me:wk_file_secret_123@judge.example.com/v1"}\n',
         "--env JUDGE_URL: its value, a URL with a password, would be written in run.json; "
         "pass it with --secret JUDGE_URL"),
        ('env = {OPENAI_KEY = "wk_file_secret_123"}\n',
         "--env OPENAI_KEY: a credential's value would be written in run.json"),
        ('env = {TIMEOUT = 30}\n',
         "--env TIMEOUT: the value must be a string (got a value of type int)"),
    ],
)  # fmt: skip
def test_a_secret_written_in_the_file_is_refused_and_never_quoted(
    tmp_path: Path, text: str, message: str
) -> None:
    """A key written into a config file's ``env`` would be written in run.json: refused,
    with the fix, and the value is in no message (a CI log keeps them)."""
    path = _write(tmp_path, "job = 'lm'\n" + text)
    for mode in ("--dry-run", "--print-config"):
        result = crf("launch", "-c", path, "--store", tmp_path / "runs", mode)
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split()), result.output
        assert "wk_file_secret_123" not in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text", ["", "# replicas = 4\n\n", "[job]\n"])
def test_a_file_that_sets_nothing_is_refused(tmp_path: Path, text: str) -> None:
    """An empty file (emptied by an editor, never saved, or the wrong one) would launch the
    default run, two replicas of the embedded task: refused."""
    path = _write(tmp_path, text)
    result = crf("launch", "-c", path, "--store", tmp_path / "runs", "--dry-run")
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()) == (
        f"error: config file {path} sets no option (it is empty, or holds only comments); "
        "give it the run's options, or leave -c out for the defaults"
    )


def test_a_path_written_for_the_files_own_folder_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's relative paths are read from where crf launch runs, as the flags' are; one
    that names nothing there but a folder beside the file was written for the file's folder:
    the refusal says both fixes, not only that there is no such folder."""
    (tmp_path / "exp" / "code").mkdir(parents=True)
    path = _write(tmp_path / "exp", 'job = "lm"\nworkdir = "code"\ndataset = "org/hub-data"\n')
    monkeypatch.chdir(tmp_path)
    result = crf("launch", "-c", "exp/run.toml", "--dry-run")
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()) == (
        "error: workdir = 'code' in config file exp/run.toml: there is no code here, where a "
        "config file's paths are read from (the directory crf launch runs in), but there is "
        "one beside the file: write workdir = 'exp/code', or run crf launch from exp"
    )
    monkeypatch.chdir(tmp_path / "exp")  # from the file's folder: its paths are right
    assert load_config(path).options["workdir"] == "code"


def test_resume_refuses_run_defining_keys_of_the_file(example: Path) -> None:
    result = crf("launch", "-c", example, "--resume", "old-run")
    assert result.exit_code == 2
    assert f"config file {example} sets job, replicas, sync_every" in result.output
    assert "cannot be combined with --resume" in result.output


# ------------------------------------------------- list and dict options as repeatable flags
def _declared(name: str, annotation: Any, default: Any, flag: str) -> Option:
    return Option(help=f"the {name}", name=name, type=annotation, default=default, flag=flag)


def _command(*declared: Option) -> tuple[typer.Typer, dict[str, Any]]:
    """A one-command app whose flags are made by crf launch's parameter builder."""
    seen: dict[str, Any] = {}
    cli = typer.Typer()

    def cmd(ctx: typer.Context, **params: Any) -> None:
        _repeatable_values(ctx, params, declared)
        seen.update(params)

    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            annotation=typer.Context)  # fmt: skip
    cmd.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [ctx, *(_run_option_parameter(d) for d in declared)]
    )
    cli.command()(cmd)
    return cli, seen


def test_list_and_dict_options_are_repeatable_flags() -> None:
    rewards = _declared("reward", list[str], ["exact"], "--reward")
    columns = _declared("column", dict[str, str], {}, "--column")
    cli, seen = _command(rewards, columns)
    result = CliRunner().invoke(
        cli, ["--reward", "a", "--reward", "b", "--column", "prompt=question",
              "--column", "answer=a=b"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen == {"reward": ["a", "b"], "column": {"prompt": "question", "answer": "a=b"}}
    seen.clear()
    result = CliRunner().invoke(cli, [])
    assert result.exit_code == 0 and seen == {"reward": ["exact"], "column": {}}
    result = CliRunner().invoke(cli, ["--column", "x"])
    assert result.exit_code == 2
    assert "--column expects KEY=VALUE (got 'x')" in result.output
    help_text = CliRunner().invoke(cli, ["--help"]).output
    assert "KEY=VALUE" in help_text and "--reward" in help_text


def test_env_and_secret_are_repeatable_flags_and_file_keys(tmp_path: Path) -> None:
    """The declared dict option env and list option secrets, on the command line and in a
    file (an [env] table is the option env)."""
    path = _write(tmp_path, '[env]\nPROJECT = "grpo"\nSTAGE = "1"\n')
    result = crf(
        "launch", "-c", path, "--env", "STAGE=2", "--env", "EXPR=a=b", "--secret", "MY_TOKEN",
        "--secret", "KEY_FILE=@/nowhere", "--print-config",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    printed = parse_config(result.output).options
    assert printed["env"] == {"PROJECT": "grpo", "STAGE": "2", "EXPR": "a=b"}  # key by key
    assert printed["secrets"] == ["MY_TOKEN", "KEY_FILE=@/nowhere"]
    assert parse_config(crf("launch", "-c", path, "--print-config").output).options["env"] == {
        "PROJECT": "grpo", "STAGE": "1",
    }  # fmt: skip
    bad = crf("launch", "--env", "NOVALUE", "--print-config")
    assert bad.exit_code == 2 and "--env expects KEY=VALUE (got 'NOVALUE')" in bad.output
    bad = crf("launch", "--env", "CRF_X=1", "--print-config")
    assert bad.exit_code == 2 and "CRF_* variables are crf's own" in bad.output


def test_entrypoint_keeps_its_string_flag() -> None:
    param = _run_option_parameter(run_options()["entrypoint"])
    assert param.default is None
    assert str in typing_args(param.annotation)


def typing_args(annotation: Any) -> tuple[Any, ...]:
    import typing

    kind = typing.get_args(annotation)[0]  # Annotated[kind, info]
    return typing.get_args(kind) or (kind,)


def test_the_config_file_example_loads_and_round_trips(tmp_path: Path) -> None:
    # docs/config-file.md's example (that the page shows this file: tests/test_readme_config.py)
    example = (Path(__file__).resolve().parents[1] / "examples" / "run.toml").read_text()
    path = _write(tmp_path, example)
    cfg = load_config(path)
    assert cfg.options == {"replicas": 4, "sync_every": 20, "rounds": 5, "backend": "modal",
                           "job": "lm"}  # fmt: skip
    assert cfg.backend_options == {"hardware": "A10G"}
    assert cfg.job_config == {"hidden_size": 128, "lr": 1e-3}
    printed = crf("launch", "-c", path, "-n", "8", "--print-config")
    assert printed.exit_code == 0, printed.output
    again = parse_config(printed.output)
    assert again.options["replicas"] == 8 and again.backend_options == {"gpu": "A10G"}
    assert again.launch_flags["timeout"] == 3600 and again.job_config == cfg.job_config


def test_a_job_option_at_the_top_level_is_sent_to_the_job_table(tmp_path) -> None:
    """A knob of the job written at the top level (``learning_rate = 1e-5``) says where it
    goes; a key that is nobody's option stays unknown."""
    from crf.launcher.config_file import ConfigError, parse_config

    with pytest.raises(ConfigError, match="is an option of the composer job: put it in the "
                                          r"\[job\] table"):  # fmt: skip
        parse_config("replicas = 2\nlearning_rate = 1e-5\n", "f.toml")
    with pytest.raises(ConfigError, match="is an option of the sft job"):
        parse_config('job = "sft"\nmax_length = 64\n', "f.toml")
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        parse_config("bogus = 1\n", "f.toml")


def _refused(tmp_path: Path, name: str, text: str) -> str:
    """crf launch -c FILE --print-config's one line for a config file it refuses."""
    path = tmp_path / name
    path.write_text(text)
    result = crf("launch", "-c", path, "--print-config")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    return " ".join(result.output.split())


TOML_HOW = (
    'a config file is TOML: write key = value (replicas = 4, reward = "exact_match", a list '
    'as ["a", "b"]) and a table as a [job] line; crf launch --print-config writes one to start '
    "from"
)


def test_a_config_file_in_yaml_is_told_a_config_file_is_toml(tmp_path: Path) -> None:
    """A file of YAML, whatever its name, says it looks like YAML and how a TOML line is
    written (TOML's own error, "Expected '=' after a key", named neither); a .yaml file TOML
    cannot read says the same; a .toml file with a TOML mistake keeps TOML's error."""
    yaml = "# my run\nreplicas: 2\nreward:\n  - exact_match\n"
    for name in ("run.toml", "run.yaml"):
        said = _refused(tmp_path, name, yaml)
        assert said == (
            f"error: config file {tmp_path / name} looks like YAML ('replicas: 2' on line 2); "
            f"{TOML_HOW}"
        ), said
    said = _refused(tmp_path, "run.yml", "replicas = = 2\n")
    assert said.startswith(f"error: config file {tmp_path / 'run.yml'} is named as YAML, and "
                           "TOML cannot read it (Invalid value (at line 1"), said  # fmt: skip
    assert said.endswith(TOML_HOW)
    said = _refused(tmp_path, "typo.toml", "replicas = = 2\n")
    assert said.startswith(f"error: config file {tmp_path / 'typo.toml'} is not valid TOML: "
                           "Invalid value (at line 1"), said  # fmt: skip


@pytest.mark.parametrize(
    ("job", "text", "says"),
    [
        ("composer", "[trl]\ntop_p = 0.9\n",
         "'trl' in config file {path} holds TRL's GRPOConfig settings of the composer job: "
         "write its table as [job.trl]"),
        ("sft", 'job = "sft"\n[trl]\nwarmup_steps = 3\n',
         "'trl' in config file {path} holds TRL's SFTConfig settings of the sft job: write "
         "its table as [job.trl]"),
        ("composer", "top_p = 0.9\n",
         "'top_p' in config file {path} is a setting of TRL's GRPOConfig, which the composer "
         "job takes in its trl table: put it in a [job.trl] table (a [job.trl] line, then the "
         "setting below it)"),
        ("composer", "[job]\ntop_p = 0.9\n",
         "'top_p' in [job] in config file {path} is a setting of TRL's GRPOConfig, which the "
         "composer job takes in its trl table: put it in a [job.trl] table (a [job.trl] line, "
         "then the setting below it)"),
        ("composer", "[job.trl]\ntemperature = 0.7\n",
         "trl.temperature is a knob of the composer job: set it as the job's own temperature "
         "(--set temperature=..., or temperature = ... in [job]), not in its trl table"),
    ],
)  # fmt: skip
def test_a_trl_setting_out_of_place_says_where_it_is_written(
    tmp_path: Path, job: str, text: str, says: str
) -> None:
    """A setting of TRL's config (the job's trl table) written anywhere but in a [job.trl]
    table says that section as it is written, and a job's own knob written in it says to
    set the knob instead."""
    said = _refused(tmp_path, "run.toml", text)
    assert said == "error: " + says.format(path=tmp_path / "run.toml"), said
