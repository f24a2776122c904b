"""A run's own variables: ``--env`` (plain) and ``--secret`` (values read at each launch).

``--env KEY=VALUE`` is plain configuration (a project name, a log level): it is written in
``run.json`` and given to every replica as ordinary environment. ``--secret KEY`` is a
credential (``HF_TOKEN``, ``WANDB_API_KEY``): only its name (and ``@path``) is written in
``run.json``; ``resolve_secrets`` reads the value from the driver's environment or the file at
each launch - a resume reads it again, so a rotated token is picked up - and the driver hands
the values to the backend as the ``env`` of ``launch_replicas``, which every backend already
treats as secret: a Modal Secret, HF Jobs ``secrets=``, a SageMaker Secrets Manager secret,
the process environment for local replicas, each name in ``CRF_SECRET_NAMES`` so the
replica's output is redacted before it reaches a log (crf.executors.secrets).

The names crf manages are refused: ``CRF_*`` (crf.spec.check_env_names) and the store
credentials of the run's store scheme, which crf passes itself (``HF_TOKEN`` for an ``hf://``
store, the AWS keys for ``s3://``...).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from crf.executors.secrets import (
    credential_value,
    looks_like_credential,
    store_credential_names,
)
from crf.launcher.errors import LaunchError
from crf.spec import WANDB_KEYS, RunSpec, secret_name


def check_plain_env(spec: RunSpec) -> None:
    """LaunchError for an ``--env`` whose name says it is a credential (``HF_TOKEN``,
    ``AWS_SECRET_ACCESS_KEY``, ``*_API_KEY``, ``OPENAI_KEY``) or whose value is one (a URL
    with a password, a service's key by its prefix): an ``--env`` value is written in run.json and
    shown by the platform, so a credential goes through ``--secret`` (docs/backends.md).
    Checked for a new launch only: a resume cannot change its run.json."""
    for name, value in spec.env.items() if isinstance(spec.env, dict) else ():
        what = "a credential's value" if looks_like_credential(str(name)) else None
        if what is None and isinstance(value, str) and credential_value(value):
            what = f"its value, {credential_value(value)},"
        if what is not None:
            raise LaunchError(
                f"--env {name}: {what} would be written in run.json; pass it "
                f"with --secret {name} (its value read from this environment, or "
                f"{name}=@file) instead"
            )


def tracking_warnings(spec: RunSpec, environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning (one line) for ``--report-to wandb`` on the local backend with no key the
    replicas would find: none in this environment (they inherit it), in ``--env`` or
    ``--secret``, nor a ~/.netrc login for api.wandb.ai (what ``wandb login`` writes). The run
    would train, but every replica would log "tracking is off". A cloud backend refuses the
    same (RunSpec._validate_tracking); here the machine's own login may be what is meant."""
    env = os.environ if environ is None else environ
    if spec.report_to != "wandb" or spec.backend != "local":
        return []
    names = {secret_name(str(e)) for e in spec.secrets} | set(spec.env) | set(env)
    if names & WANDB_KEYS or _netrc_login("api.wandb.ai", env):
        return []
    return [
        "--report-to wandb: WANDB_API_KEY is not set here (nor a `wandb login` in ~/.netrc), so "
        "the replicas will train without tracking; export WANDB_API_KEY, run `wandb login`, "
        "or --env WANDB_MODE=offline"
    ]


def _netrc_login(host: str, environ: Mapping[str, str]) -> bool:
    """Whether the netrc file (``NETRC``, else ~/.netrc) has a login for ``host``."""
    import netrc

    try:
        return netrc.netrc(environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_reserved(spec: RunSpec) -> None:
    """LaunchError for an ``--env`` or ``--secret`` that names one of the run store's own
    credential variables: crf passes those to every replica itself."""
    reserved = store_credential_names(spec.run_uri)
    entries = [("--env", k) for k in spec.env]
    entries += [("--secret", secret_name(e)) for e in spec.secrets]
    for flag, name in entries:
        if name in reserved:
            scheme = spec.run_uri.split("://", 1)[0]
            raise LaunchError(
                f"{flag} {name}: {name} is a credential of the run's {scheme}:// store, which "
                "crf passes to every replica itself; leave it out"
            )


def resolve_secrets(spec: RunSpec, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The value of each ``--secret`` (name -> value), read now; LaunchError naming the
    first that is not set, is empty or cannot be read. Never written anywhere."""
    env = os.environ if environ is None else environ
    check_reserved(spec)
    out: dict[str, str] = {}
    for entry in spec.secrets:
        name, _, source = entry.partition("=")
        if source.startswith("@"):
            out[name] = _read_file(name, source[1:])
        else:
            value = env.get(name)
            if not value:
                state = "empty" if value == "" else "not set"
                raise LaunchError(
                    f"--secret {name}: {state} in this environment; export it or use {name}=@file"
                )
            out[name] = value
    return out


@contextlib.contextmanager
def replica_variables(spec: RunSpec) -> Iterator[None]:
    """Inside: this process's environment with the run's ``--env`` values and the
    ``--secret`` values it can read set, as every replica has them, so the checks before
    launch import and call the user's code (a reward that reads ``JUDGE_URL`` or a key) as
    the replicas will; the environment as it was afterwards. A secret that cannot be read is
    left out here (the launch names it, or a dry run lists it as missing)."""
    values = {k: v for k, v in (spec.env or {}).items() if isinstance(v, str)}
    for entry in spec.secrets or ():
        name, _, source = str(entry).partition("=")
        if source.startswith("@"):
            with contextlib.suppress(LaunchError):
                values[name] = _read_file(name, source[1:])
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _read_file(name: str, path: str) -> str:
    """A secret file's text without its final newline (``echo TOKEN > file`` adds one)."""
    where = os.path.expanduser(path)
    try:
        with open(where, encoding="utf-8") as f:
            value = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise LaunchError(f"--secret {name}=@{path}: cannot read {path} ({reason})") from None
    value = value.removesuffix("\n").removesuffix("\r")
    if not value:
        raise LaunchError(f"--secret {name}=@{path}: {path} is empty")
    return value
