"""Store credentials for replicas that run elsewhere, and keeping them out of sight.

A replica in a container needs the store's credentials, and nothing else of the driver's
environment. ``store_secrets`` picks exactly those for the run URI's scheme from the driver's
environment (or the SDK's own credential chain), so a backend can hand them to its secret
mechanism (a Modal Secret, HF Jobs ``secrets=``, ...) - never as plain environment that a
describe call would show, never on a command line, never in run.json.

A replica redacts its own output at the source: the container's bootstrap runs the replica
command under ``python -m crf.executors.redacted``, which hides the value of every variable
named in ``CRF_SECRET_NAMES`` (names only, set by the executor; values never travel in plain
environment) and of the well-known credential variables before a line reaches the platform's
log store. So ``crf logs`` from any process, which knows neither the caller's ``env`` nor a
deleted SageMaker secret, shows no secret either. ``redact`` is applied again to every log line
a cloud executor returns (lines printed before the command started, older runs).

Google credentials are a *file* (``GOOGLE_APPLICATION_CREDENTIALS``) on the driver's machine;
they travel as the file's contents in ``CRF_GCS_CREDENTIALS_JSON`` and ``materialize`` writes
them back to a private file inside the container before the store is opened.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Iterable, Mapping

from crf.layout import ENV_SECRET_NAMES

#: variables passed through per store scheme when set in the driver's environment
_PASS_THROUGH: dict[str, tuple[str, ...]] = {
    "s3": (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
    ),
    "gs": ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "GOOGLE_CLOUD_PROJECT"),
    "hf": ("HF_TOKEN", "HF_ENDPOINT"),
}
_PASS_THROUGH["gcs"] = _PASS_THROUGH["gs"]
GCS_JSON_VAR = "CRF_GCS_CREDENTIALS_JSON"
#: variable names whose values are secret (the rest of a secret bundle, e.g. an endpoint URL,
#: is only private); all of a bundle travels through the secret mechanism either way
SECRET_NAMES = frozenset(
    {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", GCS_JSON_VAR}
)
#: a variable name that says it holds a credential (HF_TOKEN, OPENAI_API_KEY, DB_PASSWORD,
#: AWS_SECRET_ACCESS_KEY): ``--env`` writes its value in run.json, so such a name goes
#: through ``--secret`` (crf.launcher.user_env.check_plain_env)
_CREDENTIAL_NAME = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|PASS|KEY|APIKEY|CREDENTIALS?|AUTH)$"
)
#: values that are credentials whatever their variable's name: a URL that carries a password
#: (``https://user:pw@host``) and the keys of well-known services, by their fixed prefixes
_CREDENTIAL_VALUES = (
    ("a URL with a password", re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@", re.I)),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("an OpenAI or Anthropic key", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")),
    ("a GitHub token", re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{20,})")),
    ("an AWS access key id", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
)


def looks_like_credential(name: str) -> bool:
    """Whether ``name`` is a credential's variable: one crf knows, or named like one
    (``*_TOKEN``, ``*_KEY``, ``*_PASSWORD``, ``*_PASS``, ``*_CREDENTIALS``, ``*_AUTH``...)."""
    return name in SECRET_NAMES or bool(_CREDENTIAL_NAME.search(name.upper()))


def credential_value(value: str) -> str | None:
    """What ``value`` is when it holds a credential whatever its variable's name (see
    :data:`_CREDENTIAL_VALUES`), else None."""
    for what, pattern in _CREDENTIAL_VALUES:
        if pattern.search(value):
            return what
    return None


#: shorter values are not redacted: hiding every "1" or "true" would garble the logs
MIN_SECRET_CHARS = 6


class MissingCredentials(RuntimeError):
    """The store's credentials cannot be found; the message says which variable to set."""


def scheme_of(run_uri: str) -> str:
    return run_uri.split("://", 1)[0] if "://" in run_uri else "file"


def store_secrets(run_uri: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a replica needs to reach ``run_uri``'s store (empty for local folders).

    S3 falls back to boto3's credential chain (profile files, SSO) and HF to the token saved
    by ``hf auth login``, resolved here on the driver so the container gets plain values.
    MissingCredentials when none can be found.
    """
    env = os.environ if environ is None else environ
    scheme = scheme_of(run_uri)
    out = {k: env[k] for k in _PASS_THROUGH.get(scheme, ()) if env.get(k)}
    if scheme == "s3" and "AWS_ACCESS_KEY_ID" not in out:
        from crf.executors.adaptors import MissingSDK, boto3, botocore

        try:
            creds = boto3.Session().get_credentials()
        except (MissingSDK, *botocore.errors()) as e:  # no boto3 or a broken profile
            if type(e).__name__ == "ProfileNotFound":
                profile = env.get("AWS_PROFILE")
                raise MissingCredentials(
                    f"AWS_PROFILE={profile} names no profile in ~/.aws/config or "
                    f"~/.aws/credentials (for {run_uri}): fix AWS_PROFILE, or create the "
                    f"profile with `aws configure --profile {profile}`"
                ) from None
            creds = None
        if creds is None:
            raise MissingCredentials(
                f"no AWS credentials for {run_uri}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or configure a profile with `aws configure`)"
            )
        frozen = creds.get_frozen_credentials()
        out["AWS_ACCESS_KEY_ID"] = frozen.access_key
        out["AWS_SECRET_ACCESS_KEY"] = frozen.secret_key
        if frozen.token:
            out["AWS_SESSION_TOKEN"] = frozen.token
    elif scheme in ("gs", "gcs") and "STORAGE_EMULATOR_HOST" not in out:
        path = env.get("GOOGLE_APPLICATION_CREDENTIALS")
        if not path:
            raise MissingCredentials(
                f"no Google credentials for {run_uri}: set GOOGLE_APPLICATION_CREDENTIALS to a "
                "service-account JSON file (replicas in containers cannot use your gcloud login)"
            )
        try:
            with open(path, encoding="utf-8") as f:
                out[GCS_JSON_VAR] = f.read()
        except OSError as e:
            raise MissingCredentials(
                f"GOOGLE_APPLICATION_CREDENTIALS={path} cannot be read ({e})"
            ) from None
        except UnicodeDecodeError:
            out[GCS_JSON_VAR] = ""
        _check_key_file(path, out[GCS_JSON_VAR])
    elif scheme == "hf" and "HF_TOKEN" not in out:
        from crf.executors.adaptors import MissingSDK, huggingface_hub

        try:
            token = huggingface_hub.get_token()
        except MissingSDK:
            token = None
        if not token:
            raise MissingCredentials(
                f"no Hugging Face token for {run_uri}: set HF_TOKEN or run `hf auth login`"
            )
        out["HF_TOKEN"] = token
    return out


def _check_key_file(path: str, text: str) -> None:
    """MissingCredentials unless ``text`` is a Google credentials file (JSON with a
    ``type``: a service-account key, ...). gcsfs falls back to anonymous access on any other
    file, so the first request would fail half a minute later with a 401 (or, off Google's
    network, as an endpoint it cannot reach). Nothing of the file is quoted."""
    import json

    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise MissingCredentials(
            f"GOOGLE_APPLICATION_CREDENTIALS={path} is not a Google credentials file (JSON "
            'with a "type", such as a service-account key): point it at the key file '
            "(`gcloud iam service-accounts keys create KEY.json --iam-account ...`)"
        )


def store_credential_names(run_uri: str) -> frozenset[str]:
    """The variables crf itself passes to replicas for ``run_uri``'s store (a user's own
    ``--env`` / ``--secret`` may not name them)."""
    names = set(_PASS_THROUGH.get(scheme_of(run_uri), ()))
    if scheme_of(run_uri) in ("gs", "gcs"):
        names |= {GCS_JSON_VAR, "GOOGLE_APPLICATION_CREDENTIALS"}
    return frozenset(names)


def materialize(environ: dict[str, str] | None = None) -> None:
    """Inside a replica: turn ``CRF_GCS_CREDENTIALS_JSON`` back into a private credentials file
    and point ``GOOGLE_APPLICATION_CREDENTIALS`` at it (no-op when it is absent)."""
    env = os.environ if environ is None else environ
    data = env.pop(GCS_JSON_VAR, None)
    if not data or env.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return
    fd, path = tempfile.mkstemp(prefix="crf-gcs-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(data)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    env["GOOGLE_APPLICATION_CREDENTIALS"] = path


def secret_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """The values to hide from a replica's output: those of the variables ``CRF_SECRET_NAMES``
    names and of the credential variables in ``SECRET_NAMES``, as set in ``environ``. A
    multi-line value also counts line by line (output is filtered a line at a time)."""
    env = os.environ if environ is None else environ
    names = {n.strip() for n in env.get(ENV_SECRET_NAMES, "").split(",") if n.strip()}
    values = set()
    for name in names | SECRET_NAMES:
        value = env.get(name)
        if value:
            values.add(value)
            if "\n" in value:
                values.update(part.strip() for part in value.splitlines())
    return {v for v in values if len(v) >= MIN_SECRET_CHARS}


def hide_secrets(text: str) -> str:
    """``text`` with the value of every secret this process was given replaced by ``***``
    (:func:`secret_values`): for what a replica writes to the run folder (its error and
    traceback), where an exception's message may quote a key (an HTTP error's URL)."""
    return redact(text, secret_values())


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret value (of 6+ characters) replaced by ``***``."""
    values = {s for s in secrets if s and len(s) >= MIN_SECRET_CHARS}
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text
