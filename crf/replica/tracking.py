"""Experiment tracking (``--report-to``): each replica's metrics to TensorBoard, W&B or Trackio.

Every replica is one tracker run, named ``<run id>-r<rank>`` and grouped by the run id (W&B's
``group``, Trackio's ``group``; TensorBoard: one log dir per replica, ``tensorboard/r<rank>``
in the run folder). Two kinds of points go there:

- **per step**: the trainer's own logs. The composer job hands the tracker to TRL
  (``ComposerConfig(report_to=..., run_name=...)``: transformers' own TensorBoard and W&B
  callbacks, logging everything TRL logs); for Trackio, whose transformers callback cannot be
  given a group, and for the lm job and custom entrypoints, ``ReplicaContext.log_step`` logs
  the step's loss and metrics (``train/<name>``) itself.
- **per round**: the record each replica writes to ``metrics/<rank>/<r>.json`` (the one
  ``crf.launcher.figure.read_metrics`` reads: loss, reward, sync and compute time, bytes
  moved, committed), logged once per round as ``round/<name>`` at step = round, by the
  replica that wrote it. Not by the driver: a driver may be detached (``--detach``) or on a
  laptop that sleeps, while the replicas always run; the group puts the replicas side by side.
  The held-out evaluation's record holds sums over the replica's share of the rows; the
  tracker gets them as that share's means (``round/eval/pass@1``, ``round/eval/reward/<name>``,
  ``round/eval/examples``; ``round/eval_before/...`` for the initial model). The run's
  figure, all shares added up, is in ``result.json``'s ``held_out`` and the figure.

The packages are imported lazily (the optional ``tracking`` extra; ``RunSpec`` refuses a
missing one before launch). Tracking never stops training: a tracker that fails logs a
warning once and turns itself off. The project is ``WANDB_PROJECT`` / ``TRACKIO_PROJECT``
from the replica's environment (``--env``), else ``crf``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crf import layout
from crf.replica.evaluation import replica_means

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "crf"
#: pip extra that holds the trackers (pyproject's optional-dependencies)
EXTRA = "tracking"


def replica_run_name(run_id: str, rank: int) -> str:
    """The tracker run of replica ``rank``: ``<run id>-r<rank>``."""
    return f"{run_id}-r{rank}"


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``values`` (a bool as 0/1); None, NaN and text left out."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, int | float) and math.isfinite(v):
            out[k] = float(v)
    return out


def round_values(record: Mapping[str, Any]) -> dict[str, float]:
    """What a round's metrics record (``layout.RoundMetrics.to_dict``) puts on the tracker:
    loss, the job's metrics (reward...), time and bytes, committed."""
    keys = ("loss", "sync_s", "transfer_s", "compute_s", "bytes_up", "bytes_down", "committed")
    flat = {k: record.get(k) for k in keys}
    # held-out partial sums as this replica's means over its share (the run's combined
    # figure is the driver's: result.json's held_out)
    flat.update(replica_means(record.get("metrics") or {}))
    return _numbers(flat)


class Tracker:
    """``--report-to none``: every call does nothing. Subclasses implement ``_start``,
    ``_log`` and ``_close``; this class keeps them from ever failing the replica."""

    kind = "none"
    #: transformers' name for it in ``report_to`` (None: TRL is not given it)
    trainer_name: str | None = None

    def __init__(self, run_id: str, rank: int, store: Any = None) -> None:
        self.run_id, self.rank, self.store = run_id, rank, store
        self.name = replica_run_name(run_id, rank)
        self.project = DEFAULT_PROJECT
        self.on = self.kind != "none"
        #: the trainer logs the steps itself (trainer_args was used): log_step does not
        self.trainer_logs_steps = False
        self._started = False

    # ------------------------------------------------------------------ public
    def trainer_args(self) -> dict[str, Any]:
        """``TrainingArguments`` fields that make a transformers/TRL trainer report here."""
        if not self.on or self.trainer_name is None or not self._guard(self._start_once):
            return {"report_to": []}
        self.trainer_logs_steps = True
        return {"report_to": [self.trainer_name], "run_name": self.name}

    def log_step(self, step: int, values: Mapping[str, Any]) -> None:
        """One inner step's metrics, as ``train/<name>`` (unless the trainer logs them)."""
        if self.on and not self.trainer_logs_steps:
            nums = {f"train/{k}": v for k, v in _numbers(replica_means(values)).items()}
            self._guard(lambda: self._log(nums, step, "train/step", step))

    def log_round(self, record: Mapping[str, Any]) -> None:
        """A round's metrics record, as ``round/<name>`` at step = round."""
        if self.on:
            r, inner = int(record.get("round", 0)), int(record.get("step") or 0)
            nums = {f"round/{k}": v for k, v in round_values(record).items()}
            self._guard(lambda: self._log(nums, r, "round/round", inner))

    def close(self) -> None:
        if self.on and self._started:
            self._guard(self._close)
        self.on = False

    # ------------------------------------------------------------------ subclass side
    def _start(self) -> None: ...

    def _log(self, values: dict[str, float], step: int, axis: str, inner: int) -> None:
        """Log ``values`` at ``step`` of ``axis`` (``train/step`` or ``round/round``);
        ``inner`` is the inner step they were taken at."""

    def _close(self) -> None: ...

    def _start_once(self) -> None:
        if not self._started:
            self._start()
            self._started = True

    def _guard(self, fn: Any) -> bool:
        """Run ``fn`` (after starting the tracker); on any error warn once and turn off."""
        if not self.on:
            return False
        try:
            self._start_once()
            fn()
            return True
        # a tracker (its SDK, its server, its disk) must never fail the training run
        except Exception as e:
            log.warning("--report-to %s failed, tracking is off for this replica: %s", self.kind, e)
            self.on = False
            return False


class TensorBoardTracker(Tracker):
    """Event files in a local folder, copied to the run folder's ``tensorboard/r<rank>/``
    after every round and at the end (a cloud container's disk goes with it). TRL's
    TensorBoard callback writes to the same folder (``TENSORBOARD_LOGGING_DIR``)."""

    kind = "tensorboard"
    trainer_name = "tensorboard"

    def _start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(tempfile.mkdtemp(prefix=f"crf-tensorboard-r{self.rank}-"))
        # transformers' TensorBoardCallback reads it when the trainer starts
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(self.dir)
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def _log(self, values: dict[str, float], step: int, axis: str, inner: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()
        if axis == "round/round":
            self._upload()

    def _upload(self) -> None:
        if self.store is None:
            return
        for path in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            key = layout.tensorboard_key(self.rank, path.relative_to(self.dir).as_posix())
            self.store.put(key, path.read_bytes())

    def _close(self) -> None:
        self.writer.close()
        self._upload()
        if self.store is not None:  # copied to the run folder: the local folder goes
            shutil.rmtree(self.dir, ignore_errors=True)


class WandbTracker(Tracker):
    """A W&B run per replica (``group`` = run id, ``name`` = ``<run id>-r<rank>``), started
    before the trainer so transformers' W&B callback reuses it. ``WANDB_MODE=offline`` and
    ``WANDB_DIR`` work as W&B documents them."""

    kind = "wandb"
    trainer_name = "wandb"

    def _start(self) -> None:
        import wandb

        self.project = os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        os.environ.setdefault("WANDB_PROJECT", self.project)  # the trainer's callback reads it
        self.run = wandb.init(
            project=self.project,
            group=self.run_id,
            name=self.name,
            job_type="replica",
            config={"crf_run_id": self.run_id, "crf_rank": self.rank},
        )
        self.run.define_metric("round/round")
        self.run.define_metric("round/*", step_metric="round/round")

    def _log(self, values: dict[str, float], step: int, axis: str, inner: int) -> None:
        if axis == "round/round":
            self.run.log({**values, axis: step})
        else:
            self.run.log(values, step=step)

    def _close(self) -> None:
        self.run.finish()


class TrackioTracker(Tracker):
    """A Trackio run per replica in ``group`` = run id. Local by default (a SQLite database
    under ``TRACKIO_DIR``); ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` send it elsewhere.
    transformers' Trackio callback takes no group, so the steps go through ``log_step``."""

    kind = "trackio"

    def _start(self) -> None:
        import trackio

        self.project = os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT
        self.trackio = trackio
        self.run = trackio.init(
            project=self.project,
            name=self.name,
            group=self.run_id,
            config={"crf_run_id": self.run_id, "crf_rank": self.rank},
            resume="allow",  # a restarted replica continues its run
            embed=False,
        )

    def _log(self, values: dict[str, float], step: int, axis: str, inner: int) -> None:
        # one step axis per run: a round's point sits at the inner step it closed at
        self.trackio.log({**values, axis: step}, step=inner)

    def _close(self) -> None:
        self.trackio.finish()


TRACKER_CLASSES: dict[str, type[Tracker]] = {
    "none": Tracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
}


def new_tracker(report_to: str, run_id: str, rank: int, store: Any = None) -> Tracker:
    """The tracker ``--report-to`` names (``none`` for an unknown name, with a warning)."""
    cls = TRACKER_CLASSES.get(report_to)
    if cls is None:
        log.warning("--report-to %r is not a tracker crf knows; tracking is off", report_to)
        cls = Tracker
    return cls(run_id, rank, store)


__all__ = [
    "DEFAULT_PROJECT",
    "EXTRA",
    "TRACKER_CLASSES",
    "Tracker",
    "new_tracker",
    "replica_run_name",
    "round_values",
]
