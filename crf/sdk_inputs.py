"""The SDK's own keywords checked before anything is read or written.

The run options are checked by the launcher (crf.launcher.plan.prepare) for the CLI and the
SDK alike. What only the SDK takes - an options mapping, ``restart=``, ``executor=``,
``backend_options=``, ``secret_values=``, a ``Run`` method's ``timeout``, ``tail`` or
``rank`` - comes from Python, where any object can arrive: each is checked here, with the
launcher's own rules where one exists, so a wrong one is one :class:`LaunchError` line that
names the keyword and what it takes, never an AttributeError from deep inside, and never
after a run folder was made.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from crf.launcher.errors import LaunchError
from crf.spec import RunSpec, SpecError, check_env_names, check_run_id, check_seconds, is_number

#: what a command-line flag that is not a launch option is in the SDK (``crf launch -c``,
#: ``--resume``, ...): the one line for that name
CLI_ONLY = {
    "config": "crf.launch takes no config file: run one with crf.launcher.config_file."
    "launch_config('run.toml', {overrides}) (prepare_config checks it only)",
    "resume": "crf.launch does not resume: use crf.resume(run_id, store=...)",
    "print_config": "crf.launch has no print_config: crf.dry_run(...).options is the "
    "options, defaults included",
    "no_progress": "crf.launch prints nothing unless progress=True",
    "strict": "crf.launch has no strict: a dry run's DryRun.missing says what is missing",
}
CLI_ONLY["c"] = CLI_ONLY["config"]


def shown(value: Any) -> str:
    """A wrong value as a message shows it: its type and repr (a class by its name)."""
    if isinstance(value, type):
        return f"the class {value.__name__}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def wrong(name: str, value: Any, takes: str) -> LaunchError:
    """The one line for a keyword of the wrong type: its name, what it takes, what came."""
    return LaunchError(f"{name} takes {takes} (got {shown(value)})")


def options_of(options: Any) -> Mapping[str, Any] | RunSpec | None:
    """The positional run options: a mapping, a RunSpec or None."""
    if options is None or isinstance(options, Mapping | RunSpec):
        return options
    raise wrong(
        "the options argument", options,
        "a dict or a RunSpec of run options; or give them as keywords, "
        "crf.launch(replicas=2, job='lm')",
    )  # fmt: skip


def mapping(name: str, value: Any, example: str) -> dict[str, Any]:
    """A keyword that takes a dict (``backend_options``, ``secret_values``), as a dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise wrong(name, value, f"a dict, like {example}")
    return dict(value)


def flag(name: str, value: Any) -> bool:
    """A yes/no keyword (``detach``, ``progress``, ``dry_run``, ``follow``): a bool."""
    if not isinstance(value, bool):
        raise wrong(name, value, "True or False")
    return value


def restart_policy(restart: Any) -> Any:
    """``restart=``: None or a checked crf.RestartPolicy (its counts as --max-restarts)."""
    from crf.launcher.plan import RestartPolicy

    if restart is None:
        return None
    if not isinstance(restart, RestartPolicy):
        raise wrong(
            "restart", restart,
            "a crf.RestartPolicy, like crf.RestartPolicy(max_restarts=3); or give "
            "max_restarts=3",
        )  # fmt: skip
    return restart.validate()


def executor_of(executor: Any) -> Any:
    """``executor=``: None or an executor object (an instance, not its class or a name)."""
    from crf.executors.base import ServerlessExecutor

    if executor is None or isinstance(executor, ServerlessExecutor):
        return executor
    if isinstance(executor, str):
        takes = f"an executor object; to choose a backend by name use backend={executor!r}"
    else:
        takes = "an executor object, like LocalProcessExecutor() (an instance, not the class)"
    raise wrong("executor", executor, takes)


def store_of(store: Any) -> str | None:
    """``store=``: None, or a path or URI as a string (an ``os.PathLike`` is accepted)."""
    if store is None or isinstance(store, str):
        return store
    if isinstance(store, os.PathLike):
        return os.fspath(store)  # type: ignore[return-value]
    raise wrong("store", store, "a path or a URI string, like './crf-runs' or 's3://bucket/runs'")


def store_location(store: str | None) -> str:
    """Where a store is, independent of the working directory: a local path made absolute
    (``relstore`` -> ``/cwd/relstore``, ``file://relstore`` likewise), a URI as given, so a
    Run still finds its run after ``os.chdir``."""
    from crf.launcher.plan import DEFAULT_STORE
    from crf.store import normalize_uri

    where = store or DEFAULT_STORE
    if "://" not in where:
        return os.path.abspath(os.path.expanduser(where))
    if where.startswith("file://"):
        return normalize_uri(where)
    return where


def run_id_of(run_id: Any, what: str = "run id") -> None:
    """A run id given (None: a new one is made): one folder name (crf.spec.check_run_id)."""
    if run_id is None:
        return
    try:
        check_run_id(run_id, what)
    except SpecError as e:
        raise LaunchError(str(e)) from None


def launch_timeout(timeout: Any) -> None:
    """``timeout=`` of a launch, as ``--timeout``: checked by a dry run as by a launch."""
    if timeout is not None:
        try:
            check_seconds("--timeout", timeout)
        except SpecError as e:
            raise LaunchError(str(e)) from None


def secret_values(values: Any) -> dict[str, str]:
    """``secret_values=``: a dict of variable name -> string, by ``--env``'s rules (a
    variable name, not one of crf's ``CRF_*``, a string value)."""
    out = mapping("secret_values", values, "{'HF_TOKEN': token}")
    try:
        check_env_names(out, [], env_flag="secret_values")
    except SpecError as e:
        raise LaunchError(str(e)) from None
    return out


def job_config(value: Any) -> None:
    """``job_config=`` (or ``set=``): a dict of the job's options; the command line's
    ``KEY=VALUE`` strings are refused with the dict they mean."""
    if value is None or isinstance(value, Mapping):
        return
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    meant = [item.partition("=") for item in items if isinstance(item, str) and "=" in item]
    example = "{'hidden_size': 16}"
    if meant and len(meant) == len(items):  # KEY=VALUE strings: the dict they mean
        example = "{" + ", ".join(f"{k.strip()!r}: {_literal(v.strip())}" for k, _, v in meant)
        example += "}"
    raise wrong("job_config", value, f"a dict of the job's options, like {example}")


def _literal(text: str) -> str:
    """A ``KEY=VALUE`` value as Python would write it: a number as it is, else a string."""
    try:
        float(text)
    except ValueError:
        return repr(text)
    return text


def wait_timeout(timeout: Any, poll_s: Any) -> None:
    """``Run.wait``'s ``timeout`` (seconds >= 0, or None: no limit) and ``poll_s`` (> 0)."""
    if timeout is not None and (not is_number(timeout) or math.isnan(timeout) or timeout < 0):
        raise wrong("timeout", timeout, "seconds, a number >= 0 (None: wait without a limit)")
    if not is_number(poll_s) or not math.isfinite(poll_s) or poll_s <= 0:
        raise wrong("poll_s", poll_s, "seconds between looks, a number > 0")


def count(name: str, value: Any, least: int) -> None:
    """An optional whole number at least ``least`` (``tail`` >= 0, ``limit`` >= 1), as
    the command line's ``--tail`` and ``--limit`` take."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise wrong(name, value, f"an integer >= {least}")


def rank_of(rank: Any) -> None:
    """``Run.logs``'s ``rank``: None (every replica) or a replica's rank, an int."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise wrong("rank", rank, "a replica's rank, an int like 0 (None: every replica)")


def statuses(status: Any) -> list[str] | None:
    """``crf.runs``'s ``status``: a status or a list of them, each one ``crf runs --status``
    takes (the same line for an unknown one)."""
    from crf.launcher.attach import RUN_STATUSES

    if status is None:
        return None
    if isinstance(status, str):
        wanted = [status]
    elif isinstance(status, Iterable) and not isinstance(status, Mapping):
        wanted = list(status)
    else:
        raise wrong("status", status, "a status or a list of them, like 'ok' or ['ok', 'failed']")
    odd = [s for s in wanted if not isinstance(s, str)]
    if odd:
        raise wrong("status", odd[0], "status names (strings), like 'ok' or ['ok', 'failed']")
    unknown = sorted(set(wanted) - set(RUN_STATUSES))
    if unknown:
        raise LaunchError(
            f"unknown status {', '.join(unknown)} (one of: {', '.join(RUN_STATUSES)})"
        )
    return wanted
