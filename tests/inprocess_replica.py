"""A replica context for jobs run in the test process: DiLoCo is the identity and each
optimizer step is counted, so a job's own loop (the real TRL trainer) runs without a store,
peers or a driver. The real context is exercised end to end by the launch tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any


class InProcessContext(SimpleNamespace):
    """Build with the fields a job reads (``spec``, ``seed``, ``rank``, ``step``, ...) and
    ``logged=[]``: ``diloco`` keeps the model it wraps and counts steps, ``log_step``
    records each step's loss and metrics."""

    @contextlib.contextmanager
    def diloco(self, model: Any, inner: Any) -> Iterator[None]:
        self.model = model
        hook = inner.register_step_post_hook(lambda *_: setattr(self, "step", self.step + 1))
        try:
            yield
        finally:
            hook.remove()

    def log_step(self, loss: float | None = None, **metrics: float) -> None:
        self.logged.append({"loss": loss, **metrics})
