"""The Python SDK: everything the CLI does, as functions that return objects.

``crf.launch({...})`` returns a :class:`Run` - at once with ``detach=True``, else when the run
has ended - and a ``Run`` is what ``crf status / logs / cancel / plot`` work on, from any
process that can reach the run's store and backend (``crf.attach(run_id, store=...)``). It is
quiet unless asked (``progress=True`` prints the tables ``crf launch`` prints): a script
decides what to show. Results are typed (:mod:`crf.results`).

Like the CLI, it keeps nothing in memory that matters: a ``Run`` is its id and its store, and
every method reads the run folder (and asks the backend) again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from crf.results import RunInfo, RunResult, RunStatus

__all__ = ["Run", "attach", "launch", "resume", "runs"]


@dataclass(frozen=True)
class Run:
    """A run in a store: ``id`` and the ``store`` it lives in (None: ``./crf-runs``)."""

    id: str
    store: str | None = None

    def _attached(self) -> Any:
        from crf.launcher.attach import attach as attach_run

        return attach_run(self.id, self.store)

    def status(self) -> RunStatus:
        """The replicas now (backend state, heartbeat) and the result once written."""
        from crf.launcher.attach import status_record

        return RunStatus.from_dict(status_record(self._attached()))

    def logs(
        self, rank: int | None = None, *, follow: bool = False, tail: int | None = None
    ) -> Iterator[tuple[int, str]]:
        """(rank, line) of the replicas' logs; ``follow`` keeps going until they end,
        ``tail`` starts at each replica's last lines."""
        from crf.launcher.attach import follow_logs

        yield from follow_logs(self._attached(), rank, follow, tail)

    def cancel(self) -> RunResult | None:
        """Stop every replica still running and write the summary; the result (None if the
        summary could not be gathered)."""
        from crf.launcher.attach import gather

        run = self._attached()
        live = [h for h, st, _ in run.statuses() if not st.terminal]
        run.executor.cancel_all(live)
        if run.result() is None:
            gather(run, report=False, cancelled=bool(live))
        data = run.result()
        return RunResult.from_dict(data) if data else None

    def wait(self, timeout: float | None = None, *, poll_s: float = 1.0) -> RunResult:
        """Block until every replica has ended and return the result (gathering it, as
        ``crf status`` does, when no driver is watching). TimeoutError after ``timeout``
        seconds; the replicas keep running then."""
        from crf.launcher.attach import gather

        deadline = None if timeout is None else time.monotonic() + timeout
        run = self._attached()
        while True:
            data = run.result()
            if data is None and all(st.terminal for _, st, _ in run.statuses()):
                gathered = gather(run, report=False)
                data = run.result() or gathered  # as written: JSON's keys and values
            if data is not None:
                return RunResult.from_dict(data)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.id} still running after {timeout:g}s")
            time.sleep(poll_s)

    @property
    def result(self) -> RunResult | None:
        """The result of the run's latest launch, or None while it runs."""
        data = self._attached().result()
        return RunResult.from_dict(data) if data else None

    @property
    def figure(self) -> str | None:
        """Where the run's figure is (written at the end; ``crf plot`` redraws it)."""
        result = self.result
        if result is None:
            return None
        return result.figure or result.extra.get("loss_plot")


def launch(
    options: Mapping[str, Any] | None = None,
    *,
    store: str | None = None,
    executor: Any = None,
    backend_options: Mapping[str, Any] | None = None,
    restart: Any = None,
    detach: bool = False,
    progress: bool = False,
    **watch: Any,
) -> Run:
    """Launch a run and return it: at once with ``detach=True`` (follow it with its
    methods), else once it has ended (``run.result``). ``options`` are the run options by
    field name, as in run.json (``{"job": "lm", "replicas": 4, "sync_every": 20}``);
    ``watch`` goes to the driver (``env``, ``timeout_s``, ``plot``, ``console``...).
    LaunchError for bad input, before anything starts."""
    from crf.launcher import driver

    watch.setdefault("report", progress)
    summary = driver.launch(
        options, store=store, executor=executor, backend_options=backend_options,
        restart=restart, detach=detach, progress=progress, **watch,
    )  # fmt: skip
    return Run(summary["run_id"], store)


def resume(
    run_id: str,
    *,
    store: str | None = None,
    detach: bool = False,
    progress: bool = False,
    **kwargs: Any,
) -> Run:
    """Continue a stopped run from its last committed round (``crf launch --resume``)."""
    from crf.launcher import driver

    kwargs.setdefault("report", progress)
    summary = driver.resume(run_id, store=store, detach=detach, progress=progress, **kwargs)
    return Run(summary["run_id"], store)


def attach(run_id: str, store: str | None = None) -> Run:
    """The run ``run_id`` in ``store``; LaunchError if there is none."""
    from crf.launcher.attach import run_store

    run_store(run_id, store)  # says clearly when there is no such run
    return Run(run_id, store)


def runs(
    store: str | None = None, *, status: str | Iterable[str] | None = None,
    limit: int | None = None,
) -> list[RunInfo]:  # fmt: skip
    """The runs in ``store``, newest first (``crf runs``)."""
    from crf.launcher.attach import list_runs

    wanted = [status] if isinstance(status, str) else status
    return [RunInfo.from_dict(row) for row in list_runs(store, status=wanted, limit=limit)]
