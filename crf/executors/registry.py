"""Backend names -> executor classes, and building an executor from plain options.

The CLI and ``crf status/logs/cancel`` build executors by name from plain ``KEY=VALUE``
options (the constructor's keyword arguments), so a run's executor can be rebuilt in another
process from ``config()`` saved in the store. Cloud backends are imported only when named:
``crf launch --backend local`` never needs modal, boto3 or huggingface_hub.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from crf.executors.adaptors import MissingSDK, import_with_extra
from crf.executors.base import ExecutorError, ServerlessExecutor
from crf.spec import coerce_text

BACKENDS: dict[str, tuple[str, str, str]] = {
    # name: (module, class, pip extra that provides its client)
    "local": ("crf.executors.local", "LocalProcessExecutor", ""),
    "modal": ("crf.executors.modal", "ModalExecutor", "modal"),
    "hf": ("crf.executors.hf_jobs", "HFJobsExecutor", "hf"),
    "sagemaker": ("crf.executors.sagemaker", "SageMakerExecutor", "sagemaker"),
}


def executor_class(name: str) -> type[ServerlessExecutor]:
    if name not in BACKENDS:
        raise ExecutorError(f"unknown backend {name!r}; available backends: {', '.join(BACKENDS)}")
    module, cls, extra = BACKENDS[name]
    try:
        return getattr(import_with_extra(module, extra), cls)
    except MissingSDK as e:
        raise ExecutorError(
            f"the {name} backend needs its client library ({e.name or e}): "
            f"pip install 'composer-replication[{extra}]'"
        ) from None


def option_names(cls: type[ServerlessExecutor]) -> list[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def make_executor(name: str, options: Mapping[str, Any] | None = None) -> ServerlessExecutor:
    """Build backend ``name`` from keyword options; ExecutorError names any unknown option."""
    cls = executor_class(name)
    opts = {k.replace("-", "_"): v for k, v in (options or {}).items() if v is not None}
    sig = inspect.signature(cls.__init__).parameters
    known = option_names(cls)
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise ExecutorError(
            f"the {name} backend has no option {', '.join(unknown)}; "
            f"its options are: {', '.join(known) or 'none'}"
        )
    try:
        typed = {k: coerce_text(v, sig[k].default, k) for k, v in opts.items()}
        return cls(**typed)
    except (TypeError, ValueError) as e:
        # a conversion's message quotes the value, not the option: name the option too
        named = [f"-o {k}={v}" for k, v in opts.items() if isinstance(v, str) and repr(v) in str(e)]
        which = f" ({', '.join(named)})" if named else ""
        raise ExecutorError(f"bad option for the {name} backend{which}: {e}") from None
