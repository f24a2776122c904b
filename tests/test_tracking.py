"""--report-to: every replica's steps and rounds reach TensorBoard, W&B or Trackio, offline.

The trackers are the real packages (the ``tracking`` extra), written to a temp folder and
read back with their own readers: TensorBoard's EventAccumulator, W&B's offline run folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crf import layout
from crf.launcher import driver
from crf.launcher.errors import LaunchError
from crf.replica.tracking import TensorBoardTracker, new_tracker, replica_run_name
from crf.spec import RUN_DEFINING, RunSpec
from crf.store import RunStore


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the TensorBoard event files in ``folder``: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


# --------------------------------------------------------------------------- the option
def test_report_to_is_checked_before_launch(tmp_path: Path, monkeypatch) -> None:
    plan = driver.prepare(
        {"job": "lm", "report_to": "tensorboard"}, store=str(tmp_path), dry_run=True
    )
    assert plan.spec.report_to == "tensorboard"
    assert driver.prepare({"job": "lm"}, store=str(tmp_path), dry_run=True).spec.report_to == (
        "none"
    )
    with pytest.raises(LaunchError, match="--report-to .mlflow. is unknown; choose one of none"):
        driver.prepare({"job": "lm", "report_to": "mlflow"}, store=str(tmp_path), dry_run=True)
    # a cloud replica needs somewhere to send its metrics that outlives the container
    spec = dict(run_id="x", run_uri="memory://x", backend="modal")
    with pytest.raises(ValueError, match="--secret WANDB_API_KEY"):
        RunSpec(**spec, report_to="wandb").validate()
    RunSpec(**spec, report_to="wandb", secrets=["WANDB_API_KEY"]).validate()
    RunSpec(**spec, report_to="wandb", env={"WANDB_MODE": "offline"}).validate()
    with pytest.raises(ValueError, match="TRACKIO_SPACE_ID"):
        RunSpec(**spec, report_to="trackio").validate()
    RunSpec(**spec, report_to="tensorboard").validate()  # its files go to the run folder
    # a resumed run keeps its run.json: --report-to with --resume is refused, not ignored
    assert "report_to" in RUN_DEFINING
    # a missing package: one line naming the extra
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    with pytest.raises(LaunchError, match=r"install composer-replication\[tracking\]"):
        driver.prepare({"job": "lm", "report_to": "wandb"}, store=str(tmp_path), dry_run=True)


def test_cloud_replicas_install_the_chosen_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cloud container installs the --report-to tracker's extra (only that one), pinned to
    the driver's version, with the rest of crf's requirements."""
    from crf.executors import bootstrap
    from crf.executors.workdir import RunNeeds

    declared = bootstrap._declared()  # an editable install's metadata may predate the extras
    per_tracker = (("tensorboard>=2.21", "tensorboard"), ("wandb>=0.31", "wandb"),
                   ("trackio>=0.43", "trackio"))  # fmt: skip
    monkeypatch.setattr(bootstrap, "_declared", lambda: (*declared, *per_tracker))
    uri = "s3://bucket/runs/x"
    spec = RunSpec(run_id="x", run_uri=uri, report_to="wandb", secrets=["WANDB_API_KEY"])
    needs = RunNeeds.of(spec)
    assert needs.extras == ("wandb",)
    reqs = bootstrap.requirements_for(uri, needs.extras)
    assert any(r.startswith("wandb==") for r in reqs)  # the driver's version
    assert not any(r.startswith(("trackio", "tensorboard")) for r in reqs)
    assert RunNeeds.of(RunSpec(run_id="y", run_uri=uri)).extras == ()


# --------------------------------------------------------------------------- tensorboard
def test_tensorboard_tracker_writes_steps_and_rounds_to_the_run_folder(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    tracker = new_tracker("tensorboard", "tb-run", 1, store)
    assert isinstance(tracker, TensorBoardTracker)
    for step, loss in enumerate([2.0, 1.5], start=1):
        tracker.log_step(step, {"loss": loss, "reward": 0.25, "skipped": None})
    record = layout.RoundMetrics(
        round=0,
        rank=1,
        loss=1.75,
        metrics={"reward": 0.25},
        step=2,
        committed=True,
        sync_s=0.5,
        bytes_up=10,
        bytes_down=20,
    )
    tracker.log_round(record.to_dict())
    local = tracker.dir
    tracker.close()
    assert not local.exists()  # copied to the run folder, the local one is removed
    tracker.log_step(3, {"loss": 1.0})  # after close: nothing, no error
    folder = tmp_path / "run" / layout.TENSORBOARD_DIR / "r1"
    assert any(p.name.startswith("events.out.tfevents") for p in folder.iterdir())
    got = _scalars(folder)
    assert got["train/loss"] == [(1, 2.0), (2, 1.5)]
    assert got["train/reward"] == [(1, 0.25), (2, 0.25)]
    assert "train/skipped" not in got
    assert got["round/loss"] == [(0, 1.75)] and got["round/reward"] == [(0, 0.25)]
    assert got["round/bytes_down"] == [(0, 20.0)] and got["round/committed"] == [(0, 1.0)]


def test_a_failing_tracker_never_stops_training(tmp_path: Path, caplog) -> None:
    class Broken(TensorBoardTracker):
        def _log(self, *args: object) -> None:
            raise OSError("disk full")

    tracker = Broken("r", 0, RunStore(f"file://{tmp_path}/run"))
    tracker.log_step(1, {"loss": 1.0})
    tracker.log_step(2, {"loss": 1.0})
    assert not tracker.on
    assert [r.message for r in caplog.records].count(
        "--report-to tensorboard failed, tracking is off for this replica: disk full"
    ) == 1
    tracker.close()


def _run_job_in_process(tmp_path: Path, job: str, run_id: str, config: object) -> RunStore:
    """One replica of ``job`` (one round of two steps, --report-to tensorboard) under a real
    ReplicaContext in this process; the run folder's store."""
    from crf.replica.context import ReplicaContext
    from crf.replica.jobs import get_job

    uri = f"file://{tmp_path}/run"
    spec = RunSpec(
        run_id=run_id, run_uri=uri, job=job, replicas=1, sync_every=2, rounds=1,
        round_timeout_s=30.0, report_to="tensorboard",
    ).validate()  # fmt: skip
    store = RunStore(uri)
    store.put(layout.RUN_SPEC, spec.to_json().encode())
    saved = os.environ.get("TENSORBOARD_LOGGING_DIR")
    try:
        with ReplicaContext.from_env(layout.replica_env(uri, 0, 1, run_id)) as ctx:
            ctx.finish(get_job(job).run(ctx, config))
    finally:  # the tracker points transformers' callback at its folder for this process
        os.environ.pop("TENSORBOARD_LOGGING_DIR", None)
        if saved is not None:
            os.environ["TENSORBOARD_LOGGING_DIR"] = saved
    assert store.get_json(layout.result_key(0))["status"] == "ok"
    return store


def test_lm_job_reports_its_steps_through_the_replica_context(tmp_path: Path) -> None:
    """The lm job's own loop: ctx.log_step puts each step's loss on the tracker."""
    from crf.replica.jobs.lm import Config

    store = _run_job_in_process(tmp_path, "lm", "tb-lm", Config(corpus_sentences=400))
    got = _scalars(tmp_path / "run" / layout.TENSORBOARD_DIR / "r0")
    assert [s for s, _ in got["train/loss"]] == [1, 2]
    round_loss = store.get_json(layout.metrics_key(0, 0))["loss"]
    assert got["round/loss"] == [(0, pytest.approx(round_loss))]
    mean = sum(v for _, v in got["train/loss"]) / 2
    assert round_loss == pytest.approx(mean, rel=1e-5)


def test_composer_job_reports_trl_steps_to_tensorboard(tmp_path: Path) -> None:
    """The composer job (TRL's own TensorBoard callback, per step) and the replica's rounds
    land in tensorboard/r0 of the run folder: one round of two steps, in process."""
    from crf.replica.jobs.composer import Config

    config = Config(num_examples=16, prompts_per_step=2)
    store = _run_job_in_process(tmp_path, "composer", "tb-composer", config)
    got = _scalars(tmp_path / "run" / layout.TENSORBOARD_DIR / "r0")
    # TRL's per-step loss and reward (transformers' callback, step = the trainer's step)
    assert [s for s, _ in got["train/loss"]] == [1, 2]
    assert "train/reward" in got
    round_loss = store.get_json(layout.metrics_key(0, 0))["loss"]
    assert got["round/loss"] == [(0, pytest.approx(round_loss))]
    assert [s for s, _ in got["round/sync_s"]] == [0]


# --------------------------------------------------------------------------- wandb
WANDB_SCRIPT = """
import sys
from crf import layout
from crf.replica.context import ReplicaContext
from crf.replica.jobs.composer import Config, run
from crf.spec import RunSpec
from crf.store import RunStore

uri = sys.argv[1]
spec = RunSpec(run_id="wb-run", run_uri=uri, replicas=1, sync_every=2, rounds=1,
               round_timeout_s=30.0, report_to="wandb").validate()
store = RunStore(uri)
store.put(layout.RUN_SPEC, spec.to_json().encode())
with ReplicaContext.from_env(layout.replica_env(uri, 0, 1, spec.run_id)) as ctx:
    ctx.finish(run(ctx, Config(num_examples=16, prompts_per_step=2)))
sys.exit(0 if store.get_json(layout.result_key(0))["status"] == "ok" else 1)
"""


def _wandb_records(data: bytes) -> list[bytes]:
    """The protobuf records of a ``run-<id>.wandb`` file. W&B writes them in LevelDB's log
    format (a 7-byte ``:W&B`` header, 32 KiB blocks of chunks: crc32, length, type
    FULL/FIRST/MIDDLE/LAST); wandb 0.31 no longer ships a Python reader for it."""
    assert data[:4] == b":W&B"
    out, parts, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding at the end of the file
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            out.append(parts)
    return out


def test_wandb_offline_run_has_the_group_name_steps_and_rounds(tmp_path: Path) -> None:
    """The composer job with --report-to wandb in offline mode (no network), in its own
    process: W&B's run folder is written; its records carry group = run id, name =
    <run id>-r<rank>, TRL's per-step loss (transformers' callback reused crf's run) and the
    round's record."""
    from wandb.proto import wandb_internal_pb2

    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true",
               WANDB_PROJECT="crf-test")  # fmt: skip
    uri = f"file://{tmp_path}/run"
    proc = subprocess.run(
        [sys.executable, "-c", WANDB_SCRIPT, uri], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log_file,) = runs[0].glob("run-*.wandb")
    run_records, history = [], []
    for data in _wandb_records(log_file.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "run":
            run_records.append(rec.run)
        elif rec.WhichOneof("record_type") == "history":
            history.append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    assert run_records[0].run_group == "wb-run"
    assert run_records[0].display_name == replica_run_name("wb-run", 0) == "wb-run-r0"
    assert run_records[0].project == "crf-test"
    steps = [h["train/global_step"] for h in history if "train/loss" in h]
    assert steps == [1, 2]  # TRL's own loss, once per optimizer step
    record = RunStore(uri).get_json(layout.metrics_key(0, 0))
    rounds = [(h["round/round"], h["round/loss"]) for h in history if "round/loss" in h]
    assert rounds == [(0, pytest.approx(record["loss"]))]


# --------------------------------------------------------------------------- trackio
TRACKIO_SCRIPT = """
import json, sys
from crf import layout
from crf.replica.tracking import new_tracker
tracker = new_tracker("trackio", "tk-run", 1)
tracker.log_step(1, {"loss": 2.0})
tracker.log_step(2, {"loss": 1.0})
tracker.log_round(layout.RoundMetrics(round=0, rank=1, loss=1.5, step=2).to_dict())
tracker.close()
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps({"runs": SQLiteStorage.get_runs("crf"),
                  "logs": SQLiteStorage.get_logs("crf", "tk-run-r1"),
                  "config": SQLiteStorage.get_run_config("crf", "tk-run-r1")}))
"""


def test_trackio_local_run_has_the_group_and_name(tmp_path: Path) -> None:
    """Trackio's local database (TRACKIO_DIR; no Space, no network), read back with its own
    storage API: run <run id>-r<rank> in group = run id, the steps and the round."""
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", TRACKIO_SCRIPT], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["runs"] == ["tk-run-r1"]
    assert got["config"]["_Group"] == "tk-run"
    assert [(x["step"], x["train/loss"]) for x in got["logs"] if "train/loss" in x] == [
        (1, 2.0),
        (2, 1.0),
    ]
    assert [(x["round/round"], x["round/loss"]) for x in got["logs"] if "round/loss" in x] == [
        (0, 1.5)
    ]


# --------------------------------------------------------------------------- end to end
@pytest.mark.e2e
@pytest.mark.slow  # about 20 s: two replica processes
def test_crf_launch_report_to_tensorboard_one_log_per_replica(tmp_path: Path) -> None:
    """`crf launch --report-to tensorboard`: two real replica processes (lm, one round of two
    steps) each leave their own event files in the run folder, with every step's loss and
    the round's record; a bad tracker name stops at the door."""
    env = dict(os.environ, CRF_LOG_LEVEL="WARNING", CRF_TORCH_THREADS="1")
    args = ["--backend", "local", "-n", "2", "--job", "lm", "-H", "2", "-r", "1",
            "--set", "corpus_sentences=400", "--store", str(tmp_path), "--no-progress"]  # fmt: skip
    bad = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", *args, "--report-to", "mlflow"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--report-to 'mlflow' is unknown" in bad.stdout + bad.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", *args, "--run-id", "tb-e2e",
         "--report-to", "tensorboard"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "tb-e2e"
    for rank in (0, 1):
        got = _scalars(run / layout.TENSORBOARD_DIR / f"r{rank}")
        assert [s for s, _ in got["train/loss"]] == [1, 2]
        record = json.loads((run / layout.metrics_key(rank, 0)).read_text())
        assert got["round/loss"] == [(0, pytest.approx(record["loss"]))]
        assert got["round/bytes_up"] == [(0, float(record["bytes_up"]))]
