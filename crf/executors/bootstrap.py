"""The program every cloud container runs first, and what it installs.

A container starts from a stock Python/PyTorch image, so before ``python -m crf.replica`` can
run it needs crf's requirements and crf's code. ``BOOTSTRAP`` (run as ``python -c BOOTSTRAP
<command>``) installs the requirements the image lacks, fetches the driver's exact crf source
from the run folder and ``exec``s the replica command under ``crf.executors.redacted`` - in
the run's unpacked ``--workdir`` when it has one (``CRF_WORKDIR_KEY``; crf.executors.workdir).

The requirements are not repeated here: ``requirements_for`` reads them from the installed
package's own metadata (pyproject's ``dependencies`` plus the extra of the run folder's store),
so the list a container installs is the list ``pip install composer-replication[s3]`` would -
each pinned to the version the driver has installed (``trl==1.16.0``, ``s3fs==2025.3.0``...),
so replicas run the code the driver was tested with, not whatever is newest that day. torch is
the exception: an image's torch is a build for its CUDA and is kept as it is (its requirement
stays the declared range, the bootstrap does not touch a torch that imports, and pip is held
to that torch by a constraint so no dependency pulls another build over it), unless it is
older than crf's declared floor: then pip installs a newer torch, with the image's
torchvision and torchaudio, which are builds of the old one, and says so. Each replica
records the versions it ran with (crf.versions); the summary warns when they differ.

SageMaker cannot take a long command line, so it runs ``LOADER`` which joins the program from
environment variables; its ``SECRET_STEP`` runs first and turns a Secrets Manager secret into
environment variables.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from importlib import metadata

from crf.executors.secrets import scheme_of

#: the distribution whose metadata lists crf's requirements
DISTRIBUTION = "composer-replication"
ENV_CODE_KEY = "CRF_CODE_KEY"
ENV_REQUIREMENTS = "CRF_REQUIREMENTS"
#: the pip extra that holds a store scheme's client (pyproject's optional-dependencies)
STORE_EXTRAS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "hf": "hf"}
#: import name of a requirement whose module is not its project name with '-' -> '_'
IMPORT_NAMES = {"torchft-nightly": "torchft"}
#: requirements an image's own build of is kept (not pinned, not reinstalled if it imports)
KEEP_IMAGE = frozenset({"torch"})

_EXTRA = re.compile(r"""^\s*extra\s*==\s*["']([^"']+)["']\s*$""")

# Runs inside the container with only the standard library guaranteed. Kept short: it is on
# the job's command line (it holds no secret: credentials are read from the environment).
BOOTSTRAP = r"""
import importlib.metadata as md, importlib.util as u, io, os, re, subprocess, sys, tarfile
import tempfile
need = os.environ.get("CRF_REQUIREMENTS", "").split()
names, keep = %r, %r
def ver(n):
    try:
        return md.version(n).split("+")[0]
    except md.PackageNotFoundError:
        return None
def nums(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
def older(r):  # an image's build below the floor crf declares: replaced, with its companions
    n, floor = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0], re.search(r">=\s*([\d.]+)", r)
    return n in keep and floor and ver(n) and nums(ver(n)) < nums(floor.group(1))
def have(r):
    n = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]
    if u.find_spec(names.get(n, n.replace("-", "_"))) is None or older(r):
        return False
    return n in keep or "==" not in r or ver(n) == r.split("==")[1]
missing = [r for r in need if not have(r)]
if missing:
    pin, old = [], [r for r in missing if older(r)]
    for r in old:
        n = r.split(">=")[0].strip()
        print("crf bootstrap: this image's " + n + " " + ver(n) + " is older than crf's " + r
              + ": installing a newer one (an image with it starts faster)", flush=True)
        missing += [c for c in ("torchvision", "torchaudio") if ver(c)]  # builds of that torch
    print("crf bootstrap: installing " + " ".join(missing), flush=True)
    if not old and u.find_spec("torch") is not None and ver("torch"):  # nothing replaces it
        fd, c = tempfile.mkstemp(suffix=".txt")
        os.write(fd, ("torch==" + ver("torch") + "\n").encode()); os.close(fd)
        pin = ["-c", c]
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *pin, *missing])
data = os.environ.pop("CRF_GCS_CREDENTIALS_JSON", "")
if data and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
    fd, p = tempfile.mkstemp(suffix=".json"); os.write(fd, data.encode()); os.close(fd)
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = p
import fsspec, shutil
code = os.environ["CRF_CODE_KEY"]  # content-addressed: one unpacked copy per machine
src = os.path.join(tempfile.gettempdir(), "crf-src-" + re.sub(r"\W", "_", code))
if not os.path.isdir(src):
    with fsspec.open(os.environ["CRF_RUN_URI"].rstrip("/") + "/" + code, "rb") as f:
        blob = f.read()
    part = tempfile.mkdtemp(prefix="crf-src-part-")
    tarfile.open(fileobj=io.BytesIO(blob)).extractall(part, filter="data")
    try:
        os.rename(part, src)
    except OSError:  # another process on this machine unpacked it first
        shutil.rmtree(part, ignore_errors=True)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("PYTHONUNBUFFERED", "1")
argv = sys.argv[1:]
if argv and argv[0] in ("python", "python3"):
    argv[0] = sys.executable
print("crf bootstrap: code " + os.environ["CRF_CODE_KEY"], flush=True)
key = os.environ.get("CRF_WORKDIR_KEY")
if key:  # the user's --workdir: the replica runs in it, and imports from it
    with fsspec.open(os.environ["CRF_RUN_URI"].rstrip("/") + "/" + key, "rb") as f:
        blob = f.read()
    work = tempfile.mkdtemp(prefix="crf-workdir-")
    tarfile.open(fileobj=io.BytesIO(blob)).extractall(work, filter="data")
    os.chdir(work)
    os.environ["PYTHONPATH"] += os.pathsep + work
    print("crf bootstrap: workdir " + key, flush=True)
os.execvpe(sys.executable, [sys.executable, "-m", "crf.executors.redacted", *argv], os.environ)
""" % (IMPORT_NAMES, sorted(KEEP_IMAGE))  # noqa: UP031 (the program's own braces would need escaping in format)

# Runs in a SageMaker container before BOOTSTRAP (same namespace): the secret's values become
# environment variables. The job's role needs secretsmanager:GetSecretValue on it.
SECRET_STEP = r"""
import json, os, subprocess, sys
_arn = os.environ.pop("CRF_SECRET_ARN", "")
if _arn:
    try:
        import boto3
    except ImportError:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "boto3"])
        import boto3
    _sm = boto3.client("secretsmanager", region_name=_arn.split(":")[3])
    os.environ.update(json.loads(_sm.get_secret_value(SecretId=_arn)["SecretString"]))
    del _sm
    print("crf bootstrap: secret loaded from Secrets Manager", flush=True)
"""
#: a SageMaker container's entrypoint program: joins CRF_BOOT_0..N-1, decodes and runs them
LOADER = (
    "import os,base64 as b;exec(b.b64decode(''.join(os.environ.pop('CRF_BOOT_%d'%i)"
    "for i in range(int(os.environ.pop('CRF_BOOT_N'))))))"
)


@cache
def _declared() -> tuple[tuple[str, str | None], ...]:
    """(requirement, extra or None) for each requirement crf's metadata declares."""
    try:
        lines = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"crf's requirements come from the installed {DISTRIBUTION} package's metadata, "
            "and it is not installed: pip install -e . (or pip install composer-replication)"
        ) from None
    out = []
    for line in lines:
        req, _, marker = line.partition(";")
        extra = _EXTRA.match(marker)
        if marker.strip() and extra is None:
            continue  # a platform marker: not something a container image needs from crf
        out.append((req.strip(), extra.group(1) if extra else None))
    return tuple(out)


def base_requirements() -> list[str]:
    """crf's own dependencies (pyproject's ``dependencies``)."""
    return [req for req, extra in _declared() if extra is None]


def extra_requirements(extra: str) -> list[str]:
    """The requirements of one pip extra (pyproject's ``optional-dependencies``)."""
    return [req for req, name in _declared() if name == extra]


_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


def pinned(requirement: str) -> str:
    """``requirement`` pinned to the version installed here (``trl>=1`` -> ``trl==1.16.0``,
    extras kept, a local label such as ``+cpu`` dropped: ``==1.2.3`` matches any build of
    it); as declared for KEEP_IMAGE and for a distribution not installed here."""
    found = _NAME.match(requirement)
    if found is None or found.group(1) in KEEP_IMAGE:
        return requirement
    try:
        version = metadata.version(found.group(1))
    except metadata.PackageNotFoundError:
        return requirement
    return f"{found.group(1)}{found.group(2) or ''}=={version.split('+')[0]}"


def requirements_for(
    run_uri: str, extras: Sequence[str] = (), pip: Sequence[str] = ()
) -> list[str]:
    """What a container needs for ``run_uri``: crf's dependencies plus the extra of the run
    folder's store (s3fs for ``s3://``, gcsfs for ``gs://``, ...) and the ``extras`` the
    run's options use (``lora``: peft, ``math``: math-verify; crf.executors.workdir.RunNeeds),
    each pinned to the driver's installed version (torch excepted: the image's is kept);
    then the user's ``pip`` entries as given."""
    names = [STORE_EXTRAS.get(scheme_of(run_uri)), *extras]
    declared = [*base_requirements(), *(r for e in names if e for r in extra_requirements(e))]
    out = list(dict.fromkeys(pinned(r) for r in declared))
    return out + [r for r in pip if r not in out]


__all__ = [
    "BOOTSTRAP",
    "ENV_CODE_KEY",
    "ENV_REQUIREMENTS",
    "LOADER",
    "SECRET_STEP",
    "STORE_EXTRAS",
    "base_requirements",
    "extra_requirements",
    "pinned",
    "requirements_for",
]
