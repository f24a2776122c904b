"""ObjectStoreManager covers the part of ``torchft.Manager`` that torchft's DiLoCo uses.

torchft's DiLoCo is driven, as torchft's own local_sgd tests drive it, over
``create_autospec(torchft.manager.Manager, instance=True)`` (every sync commits), for a few
syncs of plain DiLoCo and of Streaming DiLoCo (two fragments, a sync delay). A recorder in
front of the mock notes every attribute DiLoCo reads and every call it makes, with its
arguments, and every method it calls on the works ``allreduce`` returns. ObjectStoreManager
must have each of them, take each recorded call's arguments (``inspect.signature(...).bind``)
and hold the value DiLoCo needs of each plain attribute. A torchft that starts to use
something new fails here, naming it, rather than deep inside a run.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.work import _DummyWork

from crf.exchange.manager import ObjectStoreManager
from crf.store import RunStore

SYNCS = 2  # outer rounds driven per case


@dataclass
class Usage:
    """What DiLoCo used: attributes read without a call (and the value it got), calls with
    their arguments, and the methods it called on the works allreduce returned."""

    reads: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = field(default_factory=dict)
    work_calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = field(
        default_factory=dict
    )


class _Recording:
    """Forwards every attribute to ``target`` and notes its use in ``usage``."""

    def __init__(
        self,
        target: Any,
        calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]],
        reads: dict[str, Any] | None = None,
        wrap: Any = None,
    ) -> None:
        object.__setattr__(self, "_rec_target", target)
        object.__setattr__(self, "_rec_calls", calls)
        object.__setattr__(self, "_rec_reads", reads)
        object.__setattr__(self, "_rec_wrap", wrap)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._rec_target, name)
        if not callable(value):
            if self._rec_reads is not None:
                self._rec_reads[name] = value
            return value
        calls = self._rec_calls.setdefault(name, [])
        wrap = self._rec_wrap

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            out = value(*args, **kwargs)
            return wrap(out) if wrap is not None else out

        return call


def autospec_manager(usage: Usage) -> tuple[Any, Any]:
    """A torchft Manager mock set up as torchft's local_sgd tests do (synchronous quorum,
    allreduce returns its tensor as a finished work, every sync commits and advances the
    step), and the recorder DiLoCo is given in front of it."""
    manager = create_autospec(Manager, instance=True)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    step = {"n": 0}

    def commit(timeout: Any = None) -> bool:
        step["n"] += 1
        return True

    manager.allreduce.side_effect = lambda tensor, should_quantize=False: _DummyWork(tensor)
    manager.current_step.side_effect = lambda: step["n"]
    manager.should_commit.side_effect = commit

    def wrap_work(out: Any) -> Any:
        return _Recording(out, usage.work_calls) if isinstance(out, _DummyWork) else out

    return manager, _Recording(manager, usage.calls, usage.reads, wrap_work)


def drive_diloco(fragments: int, sync_every: int, fragment_sync_delay: int) -> Usage:
    """torchft's DiLoCo on a tiny model over the recorded mock, for ``SYNCS`` outer rounds."""
    usage = Usage()
    mock, recorder = autospec_manager(usage)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    parts = [model] if fragments == 1 else [model[0], model[2]]
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outers = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
    with DiLoCo(
        recorder,
        parts,
        inner,
        outers[0] if len(outers) == 1 else outers,
        sync_every=sync_every,
        use_bucketization=False,
        pin_memory=False,
        fragment_sync_delay=fragment_sync_delay,
    ):
        for _ in range(SYNCS * sync_every):
            loss = model(torch.rand(2, 3)).pow(2).mean()
            inner.zero_grad()
            loss.backward()
            inner.step()
    assert mock.should_commit.call_count == SYNCS * fragments  # every fragment synced
    return usage


@pytest.fixture
def manager() -> Iterator[ObjectStoreManager]:
    m = ObjectStoreManager(RunStore(f"memory://conformance/{uuid.uuid4().hex}"), 1, 0, run_id="t")
    yield m
    m.close()


def _cannot_bind(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    shown = [type(a).__name__ for a in args] + [
        f"{k}={type(v).__name__}" for k, v in kwargs.items()
    ]
    return f"({', '.join(shown)})"


CASES = {
    "diloco": dict(fragments=1, sync_every=2, fragment_sync_delay=0),
    "streaming": dict(fragments=2, sync_every=4, fragment_sync_delay=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_manager_has_what_diloco_uses(case: str, manager: ObjectStoreManager) -> None:
    usage = drive_diloco(**CASES[case])
    # the recorder saw DiLoCo at work (a torchft that calls nothing would pass vacuously)
    core = {"start_quorum", "allreduce", "should_commit", "current_step", "register_state_dict_fn"}
    assert core <= usage.calls.keys(), usage.calls.keys()
    assert "_use_async_quorum" in usage.reads and "wait" in usage.work_calls

    problems = []
    for name, calls in sorted(usage.calls.items()):
        assert hasattr(Manager, name), f"DiLoCo called {name}, which torchft's Manager lacks"
        ours = getattr(manager, name, None)
        if not callable(ours):
            problems.append(f"ObjectStoreManager has no method {name}() (torchft's Manager has)")
            continue
        for args, kwargs in calls:
            why = _cannot_bind(ours, args, kwargs)
            if why is not None:
                problems.append(f"{name}{_describe(args, kwargs)}: {why}")
    for name, value in sorted(usage.reads.items()):
        if not hasattr(manager, name):
            problems.append(f"ObjectStoreManager has no attribute {name} (DiLoCo reads it)")
        elif getattr(manager, name) != value:
            problems.append(f"{name} is {getattr(manager, name)!r}, DiLoCo needs {value!r}")
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("case", list(CASES))
def test_queued_work_has_what_diloco_calls_on_a_work(
    case: str, manager: ObjectStoreManager
) -> None:
    """DiLoCo waits on what allreduce returns: the manager's works take the same calls."""
    usage = drive_diloco(**CASES[case])
    manager.start_quorum()
    work = manager.allreduce(torch.zeros(2))
    problems = []
    for name, calls in sorted(usage.work_calls.items()):
        ours = getattr(work, name, None)
        if not callable(ours):
            problems.append(f"the manager's work has no method {name}()")
            continue
        problems += [
            f"work.{name}{_describe(a, k)}: {why}"
            for a, k in calls
            if (why := _cannot_bind(ours, a, k)) is not None
        ]
    assert problems == [], "\n".join(problems)
    assert manager.should_commit()  # one replica: its own average
