"""``crf launch -c FILE``: every option of a launch in one TOML file.

TOML, not YAML: Python reads it with the standard library (``tomllib``, no new dependency),
its values are typed (``replicas = 4`` is an int, ``"4"`` a string, so a wrong type is the
same RunSpec error as for the flag), it allows comments, and it is the format Python projects
already write (pyproject.toml). YAML would need PyYAML and guesses types (``no`` is false).

The file's layout follows the declarations, so a new run option is a key with no extra work:

- top level: every run option by its RunSpec field name or its flag's name, with dashes or
  underscores alike (``round_timeout_s``, ``round-timeout``, ``round_timeout``; see
  crf.launcher.names), one value for a list option standing for a list of one (``reward =
  "exact_match"``), and the launch flags that are not run options but belong to a run's
  recipe (``store``, ``max_restarts``, ``max_run_restarts``, ``timeout``);
- ``[backend]``: ``name`` (the run option ``backend``: TOML cannot have both a top-level
  ``backend = "modal"`` and a ``[backend]`` table, so with a table the name goes inside; a
  file with no table may say ``backend = "modal"``) and the backend's options: ``hardware``
  (or ``gpu`` / ``flavor`` / ``instance_type``), ``image``, ``region`` and any constructor
  option of the executor (what ``-o KEY=VALUE`` takes);
- ``[job]``: ``name`` (the run option ``job``, as for ``[backend]``) and the job's options
  (what ``--set KEY=VALUE`` fills).

Flags on the command line override the file, key by key. ``dump_config`` writes a resolved
config back as TOML that ``load_config`` reads (``crf launch --print-config``), leaving out
secrets. The SDK reads the same files: ``launch_config(path, overrides)`` /
``prepare_config`` (or ``load_config`` for the parts, by the names ``crf.launch`` takes).
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from crf.launcher.errors import LaunchError
from crf.launcher.names import (
    HARDWARE_KEYS,
    as_declared,
    did_you_mean,
    option_spellings,
    setting_spellings,
)
from crf.spec import RunSpec, run_options

#: launch flags that are not run options but may be set in the file (their types as TOML)
LAUNCH_KEYS: dict[str, tuple[type, ...]] = {
    "store": (str,),
    "max_restarts": (int,),
    "max_run_restarts": (int,),
    "timeout": (int, float),
}
#: the key of ``[backend]`` / ``[job]`` that names the backend / the job (the run options)
TABLE_NAME = "name"
#: run options set through a table of their own, not as a top-level key
_TABLE_OPTIONS = {"job_config": "job", "backend_options": "backend"}
_SECRET_WORDS = ("token", "secret", "key", "password")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class ConfigError(LaunchError):
    """The config file cannot be used; the message names the file and what to fix."""


class LaunchConfig(NamedTuple):
    """A config file's contents, by the names the SDK takes."""

    #: run options by RunSpec field name (as ``crf.launch({...})`` takes them), no job_config
    options: dict[str, Any]
    #: the ``[backend]`` table (its hardware under any of HARDWARE_KEYS: see resolve_backend)
    backend_options: dict[str, Any]
    #: the ``[job]`` table (RunSpec.job_config)
    job_config: dict[str, Any]
    #: store, max_restarts, max_run_restarts, timeout
    launch_flags: dict[str, Any]


def load_config(path: str | Path) -> LaunchConfig:
    """Read a config file; ConfigError (one line naming the file) if it is missing, not valid
    TOML, or holds a key that is no option. Values are not range-checked here: RunSpec and the
    job's Config check them at launch, with the same message as for a flag."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {where} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {where} cannot be read: {e}") from None
    cfg = parse_config(text, where)
    if not any(cfg):  # not one option: a file emptied or never saved, or the wrong one
        raise ConfigError(
            f"config file {where} sets no option (it is empty, or holds only comments); "
            "give it the run's options, or leave -c out for the defaults"
        )
    _check_paths(cfg, Path(path), where)
    return cfg


#: the keys whose values are paths on this machine (or a URL, or a Hub id)
_PATH_KEYS = ("workdir", "dataset", "eval_dataset", "model", "requirements", "store")


def _check_paths(cfg: LaunchConfig, path: Path, where: str) -> None:
    """ConfigError for a relative path of the file that names nothing in the working
    directory, where it is read from (as the flag's would be), but names something beside
    the file: the file was written for its own folder."""
    folder = path.resolve().parent
    if folder == Path.cwd().resolve():
        return
    for key in _PATH_KEYS:
        value = {**cfg.options, **cfg.launch_flags}.get(key)
        if not isinstance(value, str) or not value or "://" in value:
            continue
        if Path(value).expanduser().is_absolute() or os.path.lexists(value):
            continue
        if (folder / value).exists():
            here = os.path.relpath(folder / value)
            raise ConfigError(
                f"{key} = {value!r} in config file {where}: there is no {value} here, where "
                "a config file's paths are read from (the directory crf launch runs in), but "
                f"there is one beside the file: write {key} = {here!r}, or run crf launch "
                f"from {os.path.relpath(folder)}"
            )


def parse_config(text: str, where: str = "<config>") -> LaunchConfig:
    """The config in ``text`` (``where`` names it in errors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends "(at line L, column C)"
        raise ConfigError(_not_toml(text, where, e)) from None
    spellings = option_spellings() | setting_spellings()
    options: dict[str, Any] = {}
    launch: dict[str, Any] = {}
    backend = _named_table(data, "backend", options, where)
    job = _named_table(data, "job", options, where)
    for key, value in data.items():
        name = spellings.get(key, key)
        if name in _TABLE_OPTIONS:
            raise ConfigError(
                f"{key!r} in config file {where}: put these options in a "
                f"[{_TABLE_OPTIONS[name]}] table"
            )
        if key not in spellings:
            job_name = str(options.get("job") or RunSpec.job)
            trl = _trl_hint(key, job_name)
            if trl:  # a TRL setting outside the job's [job.trl] table
                raise ConfigError(f"{key!r} in config file {where} {trl}")
            if key in _job_fields(job_name):  # a knob of the job, one level too high
                raise ConfigError(
                    f"{key!r} in config file {where} is an option of the {job_name} job: put "
                    "it in the [job] table"
                )
            if _is_backend_key(key):  # the replicas' or the workers' hardware, image...
                raise ConfigError(
                    f"{key!r} in config file {where} is a backend option: put it in the "
                    "[backend] table"
                )
            raise _unknown(key, where, list(spellings))
        target = launch if name in LAUNCH_KEYS else options
        if name in target:
            raise ConfigError(f"config file {where} sets {name} twice ({key!r} and another)")
        target[name] = value if target is launch else as_declared(name, value)
    if "timeout" in backend:  # as on the command line: --timeout is the launch's and the backend's
        if "timeout" in launch:
            raise ConfigError(f"config file {where} sets timeout twice (top level and [backend])")
        launch["timeout"] = backend.pop("timeout")
    for name, value in launch.items():
        if not isinstance(value, LAUNCH_KEYS[name]) or isinstance(value, bool):
            kinds = " or ".join(t.__name__ for t in LAUNCH_KEYS[name])
            raise ConfigError(f"{name} in config file {where} must be {kinds} (got {value!r})")
    return LaunchConfig(options, _one_hardware_key(backend, where), job, launch)


#: a line only YAML writes: ``key: value``, a list item ``- value`` or a document marker
_YAML_LINE = re.compile(r"^(---|\.\.\.|- |[A-Za-z_][\w.-]*:(\s|$))")


def _not_toml(text: str, where: str, error: Exception) -> str:
    """The one line for a config file TOML cannot read: for one that holds YAML (a
    ``key: value`` line, whatever the file's name) or that is named ``.yaml``, that a config
    file is TOML and how its lines are written; else TOML's own error, with its place."""
    lines = text.splitlines()
    yaml = next((i for i, line in enumerate(lines) if _YAML_LINE.match(line.strip())), None)
    how = (
        'a config file is TOML: write key = value (replicas = 4, reward = "exact_match", '
        'a list as ["a", "b"]) and a table as a [job] line; crf launch --print-config '
        "writes one to start from"
    )
    if yaml is not None:
        said = f"{lines[yaml].strip()!r} on line {yaml + 1}"
        return f"config file {where} looks like YAML ({said}); {how}"
    if where.lower().endswith((".yaml", ".yml")):
        return f"config file {where} is named as YAML, and TOML cannot read it ({error}); {how}"
    return f"config file {where} is not valid TOML: {error}"


def _named_table(
    data: dict[str, Any], name: str, options: dict[str, Any], where: str
) -> dict[str, Any]:
    """``backend = "modal"`` (the run option alone) or a ``[backend]`` table whose ``name`` is
    the run option; the same for ``job`` and ``[job]`` (TOML cannot have both a key and a
    table of one name)."""
    value = data.pop(name, {})
    if isinstance(value, str):
        options[name] = value
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{name} in config file {where} must be a string or a [{name}] table (got {value!r})"
        )
    table = _table(value, name, where)
    if TABLE_NAME in table:
        options[name] = table.pop(TABLE_NAME)
    return table


def _table(value: Any, name: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] in config file {where} must be a table (got {value!r})")
    return {str(k).replace("-", "_"): v for k, v in value.items()}


def _one_hardware_key(backend: dict[str, Any], where: str) -> dict[str, Any]:
    given = [k for k in HARDWARE_KEYS if k in backend]
    if len(given) > 1:
        raise ConfigError(
            f"[backend] in config file {where} names the hardware twice ({', '.join(given)})"
        )
    return backend


def _unknown(key: str, where: str, known: list[str], table: str = "") -> ConfigError:
    inside = f" in [{table}]" if table else ""
    place = f" in config file {where}" if where else ""
    return ConfigError(f"unknown key {key!r}{inside}{place}{did_you_mean(key, known)}")


def resolve_backend(
    backend: str, table: Mapping[str, Any], where: str = "<config>"
) -> dict[str, Any]:
    """A ``[backend]`` table (or the SDK's ``backend_options``: ``where`` empty) as the
    executor's constructor options, dashes or underscores alike: ``hardware`` (or any of
    HARDWARE_KEYS, as on the command line) becomes the backend's own name for it (modal
    ``gpu``, hf ``flavor``, sagemaker ``instance_type``); ConfigError for a key the backend
    does not take (naming the key, the file and the backend's options), or for the hardware
    given twice."""
    from crf.executors.base import ExecutorError
    from crf.executors.registry import executor_class, option_names
    from crf.launcher.workers import PREFIX as ROLLOUT_PREFIX
    from crf.launcher.workers import rollout_key

    try:
        cls = executor_class(backend)
    except ExecutorError as e:
        raise ConfigError(str(e)) from None
    known = option_names(cls)
    hardware = getattr(cls, "hardware_option", None)
    out: dict[str, Any] = {}
    given_as: dict[str, Any] = {}
    for given, value in table.items():
        key = str(given).replace("-", "_")
        name = hardware if key in HARDWARE_KEYS else key
        if key.startswith(ROLLOUT_PREFIX):  # the rollout workers' own: rollout_<option>
            name = rollout_key(cls, key)
        if name is None or name.removeprefix(ROLLOUT_PREFIX) not in known:
            near = [*known, *(["hardware"] if hardware else [])]
            if where:  # a config file's [backend] key: the file and the key
                error = f"{_unknown(key, where, near, 'backend')} (the {backend} backend's options"
                raise ConfigError(f"{error}: {', '.join(known)})")
            # the SDK's keyword or backend_options key: worded as the CLI's -o and --hardware
            what = f"hardware option ({key})" if key in HARDWARE_KEYS else f"option {key}"
            raise ConfigError(
                f"the {backend} backend has no {what}{did_you_mean(key, near)}; its options "
                f"are: {', '.join(known) or 'none'}"
            )
        if name in out:
            place = f"[backend] in config file {where}" if where else "backend_options"
            raise ConfigError(f"{place} names {name} twice ({given_as[name]!r} and {given!r})")
        out[name], given_as[name] = value, given
    return out


def _job_fields(job: str) -> list[str]:
    """The option names of job ``job``'s Config; none when the job cannot be loaded (the
    launch's own check names it)."""
    import dataclasses

    from crf.replica.jobs import get_job

    try:
        return [f.name for f in dataclasses.fields(get_job(job).Config)]
    except (ImportError, ValueError, TypeError):
        return []


def _trl_hint(key: str, job: str) -> str:
    """Where a key that belongs in the job's ``[job.trl]`` table goes, for a ``[trl]`` table
    written at the top level or a field of the job's TRL config (``top_p``: GRPOConfig's)
    written outside it; empty for any other key, or a job without a ``trl`` table."""
    import dataclasses

    from crf.replica.jobs import get_job

    if "trl" not in _job_fields(job) or (key in _job_fields(job) and key != "trl"):
        return ""
    config = str(getattr(get_job(job), "TRL_CONFIG", "GRPOConfig"))
    if key == "trl":
        return f"holds TRL's {config} settings of the {job} job: write its table as [job.trl]"
    try:
        import trl

        fields = {f.name for f in dataclasses.fields(getattr(trl, config))}
    except (ImportError, AttributeError, TypeError):
        return ""
    if key not in fields:
        return ""
    return (
        f"is a setting of TRL's {config}, which the {job} job takes in its trl table: put it "
        "in a [job.trl] table (a [job.trl] line, then the setting below it)"
    )


def _is_backend_key(key: str) -> bool:
    """Whether a top-level key that is no run option is one of ``[backend]``'s: the
    hardware under any of its names, the image or region, or a ``rollout_<option>``."""
    name = key.replace("-", "_")
    return name in ("hardware", "gpu", "flavor", "instance_type", "image", "region") or (
        name.startswith("rollout_")
    )


def check_job_keys(job: str, table: Mapping[str, Any], where: str = "<config>") -> None:
    """ConfigError naming the key, the file and the nearest option for a ``[job]`` key that
    job ``job``'s Config lacks. A job that cannot be loaded is left to the launch's own check
    (which names it); the values are checked there too, as for ``--set``."""
    fields = _job_fields(job)
    if not fields:
        return
    for key in table:
        if key not in fields:
            trl = _trl_hint(key, job)
            if trl:  # a TRL setting in [job] itself, not in its trl table
                raise ConfigError(f"{key!r} in [job] in config file {where} {trl}")
            if key in option_spellings() | setting_spellings():  # one level too low
                raise ConfigError(
                    f"{key!r} in [job] in config file {where} is a run option, not an option "
                    f"of the {job} job: put it at the top level, above the tables"
                )
            error = _unknown(key, where, fields, "job")
            raise ConfigError(f"{error} (job {job!r}'s options: {', '.join(sorted(fields))})")


def prepare_config(
    path: str | Path, overrides: Mapping[str, Any] | None = None, *, dry_run: bool = False
) -> Any:
    """The checked :class:`~crf.launcher.plan.Plan` of config file ``path`` (what ``crf launch
    -c FILE --dry-run`` shows); ``overrides`` are run options by RunSpec field name that win
    over the file, as flags do (``job_config`` key by key). Run it with
    ``crf.launcher.driver.run(plan, timeout_s=load_config(path).launch_flags.get("timeout"))``
    or call :func:`launch_config`."""
    from crf.launcher.plan import DEFAULT_MAX_RESTARTS, RestartPolicy, prepare

    where = str(path)
    cfg = load_config(path)
    given = dict(overrides or {})
    job_config = cfg.job_config | dict(given.pop("job_config", None) or {})
    options = cfg.options | given
    check_job_keys(options.get("job", "composer"), cfg.job_config, where)
    flags = cfg.launch_flags
    backend = options.get("backend", "local")
    policy = RestartPolicy(
        flags.get("max_restarts", DEFAULT_MAX_RESTARTS), flags.get("max_run_restarts")
    )
    return prepare(
        options | {"job_config": job_config},
        store=flags.get("store"),
        backend_options=resolve_backend(backend, cfg.backend_options, where),
        restart=policy,
        dry_run=dry_run,
    )


def launch_config(
    path: str | Path, overrides: Mapping[str, Any] | None = None, **watch: Any
) -> dict[str, Any]:
    """``crf launch -c FILE`` from Python: run config file ``path`` (with ``overrides``, see
    :func:`prepare_config`) to the end and return its summary; ``watch`` goes to
    ``crf.launcher.driver.run`` (the file's ``timeout`` is its ``timeout_s`` unless given)."""
    from crf.launcher.driver import run

    plan = prepare_config(path, overrides)
    watch.setdefault("timeout_s", load_config(path).launch_flags.get("timeout"))
    return run(plan, **watch)


def is_secret(name: str) -> bool:
    """Whether a backend option's value is a credential (never printed nor recorded)."""
    return any(word in name.lower() for word in _SECRET_WORDS)


def dump_config(
    options: Mapping[str, Any],
    backend_options: Mapping[str, Any],
    job_config: Mapping[str, Any],
    launch_flags: Mapping[str, Any],
) -> str:
    """A resolved config as TOML that :func:`load_config` reads back to the same values.
    None values are left out (TOML has no null: left out, they take the same default);
    secrets are left out with a comment saying so."""
    lines = ["# crf launch -c FILE (written by crf launch --print-config)"]
    declared = run_options()
    top = {k: v for k, v in options.items() if k not in ("backend", "job")}
    for name, value in [*top.items(), *launch_flags.items()]:
        if getattr(declared.get(name), "secret", False):
            lines.append(f"# {name}: a secret, not printed")
        elif value is not None:
            lines.append(f"{_key(name)} = {_value(value)}")
    for table, given in (("backend", backend_options), ("job", job_config)):
        values = ({TABLE_NAME: options[table]} if table in options else {}) | dict(given)
        lines += ["", f"[{table}]"]
        subtables = []
        for name, value in values.items():
            if table == "backend" and is_secret(name):
                lines.append(f"# {name}: a secret, not printed")
            elif table == "job" and name == "trl" and isinstance(value, Mapping):
                subtables.append((name, value))  # [job.trl], after the table's own keys
            elif value is not None:
                lines.append(f"{_key(name)} = {_value(value)}")
        for name, sub in subtables:
            lines += ["", f"[{table}.{_key(name)}]"]
            lines += [f"{_key(k)} = {_value(v)}" for k, v in sub.items() if v is not None]
    return "\n".join(lines) + "\n"


def settings_comment(
    knobs: Mapping[str, Any], trl: Mapping[str, Any], config_name: str = "GRPOConfig"
) -> str:
    """The job's effective settings as TOML comments under a printed config (read back, they
    change nothing): its knobs, defaults included, and the fields of the job's TRL config
    (``config_name``) not at TRL's default."""
    lines = ["", "# effective job settings (defaults included):"]
    lines += [f"#   {_key(k)} = {_value(v)}" for k, v in knobs.items() if v is not None]
    if trl:
        lines.append(f"# TRL {config_name} fields that differ from TRL's defaults:")
        lines += [f"#   {_key(k)} = {_value(v)}" for k, v in trl.items() if v is not None]
    return "\n".join(lines) + "\n"


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name)


def _value(value: Any) -> str:
    """One TOML value: JSON's string escapes are TOML's basic-string escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)
