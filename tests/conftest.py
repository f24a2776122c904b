"""Shared fixtures: fresh stores on memory:// and file://, a thread runner for replicas, and
a loopback Hugging Face Hub serving a tiny model (``hf_hub``, ``hf_hub_env``)."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from crf.store import RunStore

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> RunStore:
    """An empty run folder, on memory:// and on file://."""
    if request.param == "memory":
        s = RunStore(f"memory://crf-test/{uuid.uuid4().hex}")
        yield s
        s.delete("")
    else:
        yield RunStore(f"file://{tmp_path}/run")


@pytest.fixture(scope="session")
def hf_hub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A loopback Hub (tests/emulators/hf_hub.py) serving ``tests.hub_models.TINY_REPO``."""
    from tests.emulators.hf_hub import HubEmulator
    from tests.hub_models import TINY_REPO, save_tiny_repo

    root = tmp_path_factory.mktemp("hf-hub")
    save_tiny_repo(root / "tiny")
    with HubEmulator(root / "repos") as emu:
        emu.add_repo(TINY_REPO, root / "tiny")
        yield emu


@pytest.fixture
def hf_hub_env(hf_hub: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This test's clients talk to ``hf_hub`` with an empty cache: ``HF_ENDPOINT`` and
    ``HF_HOME`` set here (what a replica process reads at start, returned for launch ``env``)
    and in the already-imported huggingface_hub, which read them at import."""
    from huggingface_hub import constants, hf_api

    env = {"HF_ENDPOINT": hf_hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cache = str(tmp_path / "hf-home" / "hub")
    monkeypatch.setattr(constants, "ENDPOINT", hf_hub.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE",
        hf_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )  # fmt: skip
    monkeypatch.setattr(constants, "HF_HOME", env["HF_HOME"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(hf_api.api, "endpoint", hf_hub.endpoint)
    try:  # datasets keeps its own copy of the endpoint, read at import
        from datasets import config as datasets_config
    except ImportError:
        return env
    monkeypatch.setattr(datasets_config, "HF_ENDPOINT", hf_hub.endpoint)
    monkeypatch.setattr(
        datasets_config, "HUB_DATASETS_URL",
        hf_hub.endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}",
    )  # fmt: skip
    return env


#: a test's devices: the CPU, and CUDA as a ``gpu`` test (skipped without one, with the reason)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def run_threads(n: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run fn(rank) in n threads; return results (exceptions are returned, not raised)."""
    out: list[Any] = [None] * n

    def _target(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[r] = e

    threads = [threading.Thread(target=_target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "replica thread hung"
    return out
