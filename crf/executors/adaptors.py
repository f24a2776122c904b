"""The cloud SDKs, each behind one lazy adaptor: imported on first use, never by ``import crf``.

Every backend and store reaches its SDK (modal, huggingface_hub, boto3/botocore, gcsfs,
s3fs) through here, so a missing SDK fails the same way everywhere: a ``MissingSDK`` (an
ImportError) naming the pip extra that installs it. Code that uses an SDK now and then goes
through its adaptor (``adaptors.modal.load()``, ``adaptors.boto3.Session()``); a module that is
all about one SDK (``crf.store.s3``, ``crf.executors.hf_jobs``, ...) imports it at its top and
is itself imported through ``import_with_extra`` (the backend registry, the store's schemes).

Each adaptor also lists the SDK's own error types (``errors()``), which callers catch instead
of a bare ``except Exception``: an error of the SDK or of the network under it is a failure to
report, anything else is a bug that must surface.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import Any


class MissingSDK(ImportError):
    """A cloud SDK is not installed; the message names the pip extra that installs it."""


class SDK:
    """One SDK: ``SDK("modal", extra="modal")``; attribute access imports it on first use."""

    def __init__(self, module: str, *, extra: str, errors: tuple[str, ...] = ()) -> None:
        self.module = module
        self.extra = extra
        #: dotted names (``"botocore.exceptions.ClientError"``) of the SDK's error types
        self.error_names = errors

    def load(self, submodule: str = "") -> ModuleType:
        """The SDK module (or ``<module>.<submodule>``); MissingSDK when it is not installed."""
        name = f"{self.module}.{submodule}" if submodule else self.module
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise MissingSDK(
                f"{self.module} is not installed ({e.name or e}): "
                f"pip install 'composer-replication[{self.extra}]'",
                name=e.name or self.module,
            ) from None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    @property
    def available(self) -> bool:
        try:
            self.load()
        except MissingSDK:
            return False
        return True

    def errors(self) -> tuple[type[BaseException], ...]:
        """The SDK's own error types, plus OSError (network and file errors under it).
        Only OSError when the SDK is not installed: nothing of its own can be raised then."""
        return _errors(self)


def import_with_extra(module: str, extra: str) -> ModuleType:
    """Import ``module`` (a crf module built on an SDK, such as ``crf.store.s3``); MissingSDK
    naming ``extra`` when the SDK under it is missing."""
    try:
        return importlib.import_module(module)
    except MissingSDK:
        raise
    except ImportError as e:
        raise MissingSDK(
            f"needs an optional dependency ({e.name or e}): "
            f"pip install 'composer-replication[{extra}]'",
            name=e.name,
        ) from None


@cache
def _errors(sdk: SDK) -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [OSError]
    for dotted in sdk.error_names:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


modal = SDK("modal", extra="modal", errors=("modal.exception.Error", "grpclib.GRPCError"))
huggingface_hub = SDK(
    "huggingface_hub",
    extra="hf",
    errors=(
        "huggingface_hub.errors.HfHubHTTPError",
        "httpx2.HTTPError",
        "httpx.HTTPError",
        "requests.RequestException",
    ),
)
boto3 = SDK("boto3", extra="sagemaker")
botocore = SDK(
    "botocore",
    extra="sagemaker",
    errors=("botocore.exceptions.ClientError", "botocore.exceptions.BotoCoreError"),
)
s3fs = SDK(
    "s3fs",
    extra="s3",
    errors=("botocore.exceptions.ClientError", "botocore.exceptions.BotoCoreError"),
)
gcsfs = SDK(
    "gcsfs",
    extra="gcs",
    errors=("gcsfs.retry.HttpError", "google.auth.exceptions.GoogleAuthError"),
)

__all__ = [
    "SDK",
    "MissingSDK",
    "import_with_extra",
    "boto3",
    "botocore",
    "gcsfs",
    "huggingface_hub",
    "modal",
    "s3fs",
]
