"""Rollout workers, the launcher's side: one launch starts two roles.

The options (CLI, config file, SDK), the refusals before launch, the dry run's two roles with
their hardware and price, the executors starting M workers with ``CRF_ROLE=rollout`` on their
own hardware (local processes and the HF Jobs emulator), the driver supervising them (a dead
worker restarted, never failing the run, all cancelled when the trainers end), and what
``crf status``, ``crf logs --role``, the summary and the figure show of them.

The worker process here is a stand-in (tests/rollout_worker_standin.py) that writes what the
launcher reads of a worker; the real worker loop has its own tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import crf
from crf import layout
from crf.executors.base import ReplicaState, Workers
from crf.executors.local import LocalProcessExecutor
from crf.launcher import rollout_view
from crf.launcher.cli import app
from crf.launcher.errors import LaunchError
from crf.launcher.figure import _ROLLOUTS, draw_figure, panels_for
from crf.launcher.plan import prepare
from crf.launcher.plan_view import plan_rows
from crf.launcher.summary import build_summary
from crf.launcher.workers import WorkerPool, plan_workers, split_options
from crf.rollouts.config import RolloutConfig
from crf.spec import ROLLOUT, RunSpec, SpecError, run_options
from crf.store import RunStore
from tests import cloud_servers

moto_s3 = cloud_servers.moto_s3  # the fixtures, visible to this module's tests
s3_env = cloud_servers.s3_env
ROOT = Path(__file__).resolve().parent.parent
STANDIN = [sys.executable, str(ROOT / "tests" / "rollout_worker_standin.py")]
ROLLOUT_FIELDS = {
    "rollout_workers": "workers",
    "publish_every": "publish_every",
    "max_staleness": "max_staleness",
    "rollout_wire": "wire",
    "rollout_wait": "wait_s",
    "rollout_grace": "grace_s",
    "rollout_correction": "correction",
    "rollout_clip_min": "clip_min",
    "rollout_clip_max": "clip_max",
    "rollout_max_mismatch": "max_mismatch",
}


def wait_for(pred: Any, what: str, timeout: float = 120.0) -> Any:
    """Poll until ``pred()`` is truthy (a generous deadline, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def accepted(*args: str) -> str:
    """The output of a command that must succeed, on one line (rich wraps long lines)."""
    result = cli(*args)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


# ------------------------------------------------------------------------------- options
def test_the_options_are_run_options_with_rollout_configs_defaults() -> None:
    declared = {n: o for n, o in run_options().items() if o.group == ROLLOUT}
    assert set(declared) == set(ROLLOUT_FIELDS)
    default = RolloutConfig()
    for name, attr in ROLLOUT_FIELDS.items():
        assert declared[name].default == getattr(default, attr), name
    spec = RunSpec(run_id="r", run_uri="file:///tmp/r", rollout_workers=3, publish_every=2,
                   max_staleness=0, rollout_wire="int8", rollout_wait=1.5,
                   rollout_correction="sequence_mask", rollout_clip_min=0.5,
                   rollout_clip_max=2.0, rollout_max_mismatch=0.1).validate()  # fmt: skip
    cfg = RolloutConfig.from_spec(spec)
    assert cfg == RolloutConfig(3, 2, 0, "int8", 1.5, "sequence_mask", 0.5, 2.0, 0.1,
                                sync_period=spec.sync_period)  # fmt: skip
    assert cfg.enabled and cfg.workers_of(0, 2) == [0, 2]
    # a run.json written before the options existed reads as no workers
    old = json.loads(RunSpec(run_id="r", run_uri="file:///tmp/r").to_json())
    for name in ROLLOUT_FIELDS:
        old.pop(name)
    assert RolloutConfig.from_spec(RunSpec.from_dict(old)) == RolloutConfig(sync_period=20)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"job": "lm"}, "--rollout-workers 2 needs --job composer"),
        ({"entrypoint": ["python", "x.py"]}, "needs the built-in replica"),
        ({"procs_per_replica": 2}, "needs --procs-per-replica 1 (got 2)"),
        ({"rollout_clip_min": 3.0}, "--rollout-clip-min (3.0) must be below"),
        ({"rollout_correction": "clip"}, "--rollout-correction 'clip' is unknown"),
        ({"rollout_wire": "int3"}, "--rollout-wire 'int3' is unknown"),
        ({"max_staleness": -1}, "--max-staleness must be an integer >= 0"),
        ({"rollout_wait": 0}, "--rollout-wait must be > 0 seconds"),
        ({"rollout_workers": 1025}, "--rollout-workers must be an integer >= 0 and at most 1024"),
    ],
)
def test_spec_refuses_what_workers_cannot_do(options: dict[str, Any], message: str) -> None:
    spec = RunSpec(run_id="r", run_uri="file:///tmp/r", **{"rollout_workers": 2, **options})
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec.validate()


def test_without_workers_the_rollout_options_change_nothing() -> None:
    """A RunSpec (a stored run.json) with rollout settings and no workers is valid: they are
    only read by workers, so no worker plan. A launch refuses them changed from their
    defaults (test_launch_refuses_what_workers_cannot_use_before_anything_starts)."""
    spec = RunSpec(run_id="r", run_uri="file:///tmp/r", job="lm", rollout_wire="int8").validate()
    assert plan_workers(spec, LocalProcessExecutor(), {}, {}) is None


def test_cli_refusals_are_one_line_before_anything_starts(tmp_path: Path) -> None:
    store = str(tmp_path / "runs")
    cases = [
        (["--rollout-gpu", "A10G"], "the local backend has no --rollout-hardware option"),
        (["--backend", "modal", "--rollout-gpu", "A10G"], "add --rollout-workers M"),
        (["--rollout-workers", "2", "--job", "lm"], "needs --job composer"),
        (["--rollout-workers", "2", "--procs-per-replica", "2"], "--procs-per-replica 1"),
        (["--rollout-workers", "1", "-o", "rollout_nope=1"], "has no rollout_nope option"),
        (
            [
                "--rollout-workers",
                "2",
                "--backend",
                "modal",
                "--rollout-gpu",
                "L5",
                "--store",
                "s3://b/r",
            ],
            "rollout workers: unknown Modal GPU 'L5'",
        ),
        (
            [
                "--rollout-workers",
                "2",
                "--backend",
                "hf",
                "--rollout-flavor",
                "L4",
                "--store",
                "s3://b/r",
            ],
            "rollout workers: unknown HF Jobs flavor 'l4'",
        ),
        (
            [
                "--rollout-workers",
                "2",
                "--backend",
                "hf",
                "--flavor",
                "a100-large",
                "--rollout-flavor",
                "cpu-basic",
                "--set",
                "trl.use_vllm=true",
                "--store",
                "s3://b/r",
            ],
            "rollout workers: trl.use_vllm needs a CUDA GPU, and the backend's hardware has none "
            "crf knows of: choose GPU hardware (--rollout-hardware)",
        ),
        (
            ["--rollout-workers", "2", "--set", "trl.loss_type=vespo"],
            "trl.loss_type 'vespo' cannot take the off-policy correction rollout workers need",
        ),
    ]
    for args, message in cases:
        result = cli("launch", "--dry-run", "--store", store, *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()  # nothing written


def test_launch_refuses_what_workers_cannot_use_before_anything_starts(tmp_path: Path) -> None:
    """At launch (CLI, --dry-run, --print-config, a config file, the SDK), not only on a bare
    RunSpec: workers with an --entrypoint (the launch once set the entrypoint after checking
    the spec, so such a run started and failed), a rollout option changed without workers
    (the run would silently start none), fewer workers than replicas (a replica without one
    holds every round back). One line, exit 2, no traceback, nothing written."""
    store = str(tmp_path / "runs")
    cases = [
        (["--rollout-workers", "2", "--entrypoint", "python x.py"], "needs the built-in replica"),
        (["--max-staleness", "3"], "--max-staleness 3 configures rollout workers: add "
         "--rollout-workers M, or leave it out"),
        (["--rollout-wire", "int8", "--publish-every", "2"], "--publish-every 2, --rollout-wire "
         "int8 configure rollout workers"),
        (["--rollout-workers", "1", "--replicas", "2"], "--rollout-workers 1 leaves 1 of the 2 "
         "replicas without a worker"),
    ]  # fmt: skip
    for args, message in cases:
        for mode in ([], ["--dry-run"], ["--print-config"]):
            result = cli("launch", "--store", store, "--no-progress", *args, *mode)
            assert result.exit_code == 2, (args, mode, result.output)
            assert message in result.output, (args, mode, result.output)
            assert "Traceback" not in result.output and len(result.output.splitlines()) == 1
    # the workers' hardware without workers: --print-config writes no file that would not launch
    for mode in (["--dry-run"], ["--print-config"]):
        idle = cli("launch", *mode, "--backend", "modal", "--gpu", "A100", "--rollout-gpu", "L4",
                   "--store", "s3://b/r")  # fmt: skip
        assert idle.exit_code == 2, (mode, idle.output)
        assert (
            "rollout_gpu (--rollout-hardware and the other rollout_<option> backend options) "
            "configure rollout workers: add --rollout-workers M"
        ) in " ".join(idle.output.split())
    config = tmp_path / "run.toml"
    config.write_text("replicas = 2\nmax_staleness = 3\n")
    result = cli("launch", "-c", str(config), "--store", store)
    assert result.exit_code == 2 and "--max-staleness 3 configures" in result.output
    sdk_cases = [
        ({"rollout_workers": 2, "entrypoint": "python x.py"}, "needs the built-in replica"),
        ({"rollout_correction": "off"}, "--rollout-correction off configures rollout workers"),
        ({"replicas": 3, "rollout_workers": 2}, "leaves 1 of the 3 replicas without a worker"),
    ]
    for options, message in sdk_cases:
        with pytest.raises(LaunchError, match=message):
            crf.launch(**options, store=store)
        with pytest.raises(LaunchError, match=message):
            crf.dry_run(**options, store=store)
    assert not (tmp_path / "runs").exists()  # nothing written
    # left at their defaults they are no settings; more workers than replicas split unevenly
    assert crf.dry_run(replicas=2, max_staleness=1, store=store).workers is None
    uneven = crf.dry_run(replicas=2, rollout_workers=3, store=store).workers
    assert uneven is not None and uneven["workers"] == 3


def test_local_workers_and_replicas_together_are_capped_by_the_machine(tmp_path: Path) -> None:
    """On the local backend the workers are processes of this machine beside the replicas,
    each holding the model: more of both than its memory holds is refused before anything
    starts, naming the limit (one replica with 1000 workers was accepted, and would have run
    the machine out of memory after launching them)."""
    from crf.executors.local import local_replica_limit

    limit, _ = local_replica_limit()
    workers = min(limit, 1024)  # one replica more than fits, or the most workers a run takes
    store = tmp_path / "runs"
    result = cli("launch", "--dry-run", "--store", str(store), "--replicas", "1",
                 "--rollout-workers", str(workers))  # fmt: skip
    if workers + 1 > limit:
        assert result.exit_code == 2, result.output
        assert (
            f"--replicas 1 and --rollout-workers {workers} are {workers + 1} processes, more "
            f"than the local backend can run: at most {limit}"
        ) in " ".join(result.output.split()), result.output
        assert len(result.output.strip().splitlines()) == 1 and not store.exists()
    fits = cli("launch", "--dry-run", "--store", str(store), "--replicas", "1",
               "--rollout-workers", str(max(1, min(limit - 1, 1024))))  # fmt: skip
    assert fits.exit_code == 0, fits.output


def test_every_rollout_option_reaches_the_spec_from_flag_file_and_keyword(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout options' part of tests/test_option_names.py's walk (which runs a script
    of its own, so no workers): each one, unlike its default, reaches the same RunSpec value
    from its flag, a config file's key and the SDK's keyword."""
    from tests.test_option_names import _cli_spec, _command_line, _config_file

    samples = {
        "job": "composer", "job_config": {"learning_rate": 2e-6}, "replicas": 2,
        "rollout_workers": 3, "publish_every": 3, "max_staleness": 2, "rollout_wire": "int8",
        "rollout_wait": 2.5, "rollout_correction": "token_mask", "rollout_clip_min": 0.5,
        "rollout_clip_max": 2.5, "rollout_max_mismatch": 0.25, "rollout_grace": 600.0,
    }  # fmt: skip
    rollout = [name for name, opt in run_options().items() if opt.group == ROLLOUT]
    assert set(rollout) <= set(samples), "a rollout option has no sample value"
    store = str(tmp_path / "runs")
    expected = crf.dry_run(**samples, store=store).options
    for name in rollout:
        assert expected[name] == samples[name] != run_options()[name].default, name
    flags = _cli_spec([*_command_line(samples), "--store", store], monkeypatch)
    from_file = _cli_spec(
        ["-c", str(_config_file(samples, tmp_path / "w.toml")), "--store", store], monkeypatch
    )
    for name in rollout:
        assert flags[name] == from_file[name] == expected[name], name


def test_a_backend_that_cannot_start_workers_is_refused_before_launch(tmp_path: Path) -> None:
    """An executor handed to the SDK whose launch_replicas takes no ``workers=`` cannot
    start rollout workers: one line before anything starts, not a warning after the
    replicas did."""

    class NoWorkers(LocalProcessExecutor):
        def launch_replicas(  # type: ignore[override]
            self, n_replicas: int, entrypoint: Any = None, args: Any = (), env: Any = None, *,
            run_uri: str, run_id: str | None = None, ranks: Any = None, plain_env: Any = None,
        ) -> Any:  # fmt: skip
            kw = {"run_uri": run_uri, "run_id": run_id, "ranks": ranks, "plain_env": plain_env}
            return super().launch_replicas(n_replicas, entrypoint, args, env, **kw)

    assert LocalProcessExecutor().starts_workers() and not NoWorkers().starts_workers()
    with pytest.raises(LaunchError, match="the local backend cannot start rollout workers"):
        prepare({"replicas": 1, "rollout_workers": 1}, store=str(tmp_path), dry_run=True,
                executor=NoWorkers())  # fmt: skip
    assert not list(tmp_path.iterdir())


def test_split_options_sends_rollout_keys_to_the_workers() -> None:
    trainer, rollout = split_options(
        "modal", {"gpu": "A100", "rollout_hardware": "L4", "rollout-image": "img"}
    )
    assert trainer == {"gpu": "A100"} and rollout == {"gpu": "L4", "image": "img"}
    with pytest.raises(LaunchError, match="no rollout_spot option"):
        split_options("modal", {"rollout_spot": True})


# ------------------------------------------------------------------------------- dry run
def test_dry_run_without_workers_has_no_worker_rows(tmp_path: Path) -> None:
    plan = prepare({"replicas": 2}, store=str(tmp_path), dry_run=True)
    assert plan.workers is None
    keys = [k for k, _ in plan_rows(plan)]
    assert not [k for k in keys if "worker" in k or k in ("policy", "correction", "both roles")]


def test_workers_on_more_gpus_than_they_use_are_a_warning_before_launch() -> None:
    """A worker generates in one process on one GPU: on hardware with two, the other is
    paid for and idle. The dry run (CLI and SDK) says so, as it does for the replicas' idle
    GPUs; one GPU per worker is silent."""
    args = ["launch", "--dry-run", "--backend", "modal", "--gpu", "A100", "--replicas", "2",
            "--rollout-workers", "2", "--store", "s3://no-such-bucket/runs"]  # fmt: skip
    idle = cli(*args, "--rollout-gpu", "L4:2")
    assert idle.exit_code == 0, idle.output
    said = (
        "warning: each rollout worker has 2 GPUs but generates on one, 1 idle: choose worker "
        "hardware with one GPU (--rollout-hardware)"
    )
    assert said in " ".join(idle.output.split()), idle.output
    one = cli(*args, "--rollout-gpu", "L4")
    assert one.exit_code == 0 and "rollout worker has" not in one.output, one.output
    plan = crf.dry_run(backend="modal", gpu="A100", replicas=2, rollout_workers=2,
                       rollout_gpu="L4:2", store="s3://no-such-bucket/runs")  # fmt: skip
    assert said.removeprefix("warning: ") in plan.warnings


def test_dry_run_shows_both_roles_with_hardware_price_and_worst_case(tmp_path: Path) -> None:
    """Trainers on A100s, workers on L4s (HF Jobs): each role's hardware, hourly price and
    worst case, and both together; no network is needed."""
    result = cli(
        "launch", "--dry-run", "--backend", "hf", "--flavor", "a100-large", "--replicas", "2",
        "--rollout-workers", "4", "--rollout-flavor", "l4x1", "--timeout", "3000",
        "--store", "s3://no-such-bucket/runs",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    assert "rollout workers" in out and "4 (worker w serves replica w % 2, 2 each)" in out
    assert "worker hardware" in out and "l4x1 (1x Nvidia L4" in out
    assert "$2.50/h per replica, $5.00/h for 2" in out
    assert "$0.80/h per worker, $3.20/h for 4" in out
    # the timeout is --timeout + 600 s: 3600 s, so a worst case of exactly one hour each
    assert "$5.00: 2 replica(s) x 1 h" in out and "$3.20: 4 worker(s) x 1 h" in out
    assert "$8.20/h, worst case $8.20" in out


def test_dry_run_says_a_staleness_bound_a_round_cannot_reach(tmp_path: Path) -> None:
    """No rollout crosses an outer step, so with H / fragments = 4 a bound of 4 or more
    allows nothing beyond 3 steps: the dry run says so; a bound within the round is silent."""
    args = ["launch", "--dry-run", "--replicas", "2", "--rollout-workers", "2", "--sync-every",
            "8", "--fragments", "2", "--store", str(tmp_path)]  # fmt: skip
    flat = accepted(*args, "--max-staleness", "6")
    assert (
        "warning: --max-staleness 6: no rollout crosses an outer step (every 4 inner step(s) "
        "here), so none is more than 3 step(s) stale whatever the bound; set --max-staleness 3 "
        "or less, or raise --sync-every"
    ) in flat
    fits = cli(*args, "--max-staleness", "3")
    assert fits.exit_code == 0 and "--max-staleness 3:" not in fits.output


def test_dry_run_says_a_publish_interval_the_staleness_bound_cannot_span(tmp_path: Path) -> None:
    """A version published every 4 steps serves only the steps within --max-staleness of it:
    at a bound of 1 the replicas would generate half their batches themselves, which the
    plan says before launch (with the settings that cover every step); a bound that spans the
    interval, or a round shorter than it, is silent."""
    args = ["launch", "--dry-run", "--replicas", "2", "--rollout-workers", "2",
            "--store", str(tmp_path)]  # fmt: skip
    flat = accepted(*args, "--sync-every", "20", "--publish-every", "4")
    assert (
        "warning: --publish-every 4 with --max-staleness 1: a published version serves only "
        "the next 2 inner step(s), so the replicas generate the batches of the other steps "
        "themselves; set --max-staleness 3, or --publish-every 2"
    ) in flat, flat
    # a round of 10 steps publishes after its outer step: the bound 9 covers it whatever P
    rounds = cli(*args, "--sync-every", "10", "--publish-every", "50")
    assert "--max-staleness 9, or --publish-every 2" in " ".join(rounds.output.split())
    for fits in (("--publish-every", "4", "--max-staleness", "3"),
                 ("--publish-every", "50", "--sync-every", "2")):  # fmt: skip
        quiet = cli(*args, *fits)
        assert quiet.exit_code == 0 and "--publish-every" not in quiet.output, quiet.output


def test_the_workers_resources_row_names_their_own_options() -> None:
    """The workers' CPU and memory are set with -o rollout_<option>: the dry run's hint for
    them says so (the replicas' -o cpu=N would not change them)."""
    plan = prepare({"replicas": 2, "rollout_workers": 2, "backend": "modal"},
                   store="s3://no-such-bucket/runs", dry_run=True,
                   backend_options={"gpu": "A100", "rollout_gpu": "L4"})  # fmt: skip
    rows = dict(plan_rows(plan))
    assert rows["cpu and memory"].endswith("-o cpu=N -o memory_mb=MIB)")
    assert rows["worker cpu and memory"].endswith("-o rollout_cpu=N -o rollout_memory_mb=MIB)")
    # a worker's SageMaker job is named for w<k>, as it is started (crf-<run>-rw1-...)
    from crf.launcher.plan_view import _worker_note

    note = "each replica: training job crf-<run>-r<rank>-<nonce>, ml.g4dn.xlarge x 1"
    assert _worker_note(note) == "each worker: training job crf-<run>-rw<worker>-<nonce>, " \
        "ml.g4dn.xlarge x 1"  # fmt: skip


def test_config_file_and_sdk_take_the_same_options(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        "replicas = 2\nrollout_workers = 2\nmax_staleness = 2\n"
        'store = "s3://no-such-bucket/runs"\n'
        '[backend]\nname = "hf"\nflavor = "a100-large"\nrollout_hardware = "l4x1"\n'
    )
    result = cli("launch", "-c", str(config), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "l4x1 (1x Nvidia L4" in result.output and "at most 2 step(s) stale" in result.output
    printed = cli("launch", "-c", str(config), "--print-config")
    assert printed.exit_code == 0, printed.output
    assert "rollout_workers = 2" in printed.output and 'rollout_flavor = "l4x1"' in printed.output

    dry = crf.dry_run(backend="hf", replicas=2, rollout_workers=2, flavor="a100-large",
                      rollout_flavor="l4x1", store="s3://no-such-bucket/runs")  # fmt: skip
    assert dry.options["rollout_workers"] == 2 and dry.workers is not None
    assert dry.workers["workers"] == 2 and dry.workers["hardware"].startswith("l4x1")
    assert dry.workers["hourly_usd"] == 0.80 and dry.hardware.startswith("a100-large")
    assert crf.dry_run(replicas=2, store=str(tmp_path)).workers is None


# ------------------------------------------------------------------------------- executors
def test_local_executor_starts_workers_with_their_role(tmp_path: Path) -> None:
    names = "('CRF_ROLE', 'CRF_WORKER', 'CRF_RANK', 'CRF_WORLD_SIZE')"
    code = f"import os\nfor k in {names}: print(k, os.environ.get(k))"
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    uri = f"file://{tmp_path / 'run'}"
    trainers = ex.launch_replicas(2, [sys.executable, "-c", code], run_uri=uri, run_id="r")
    workers = ex.launch_workers(3, 2, [sys.executable, "-c", code], run_uri=uri, run_id="r")
    for h in [*trainers, *workers]:
        ended = wait_for(lambda h=h: (s := ex.status(h)).terminal and s, "exit")
        assert ended.state is ReplicaState.SUCCEEDED
    assert [h.extra.get("role") for h in workers] == ["rollout"] * 3
    assert all("role" not in h.extra for h in trainers)
    lines = {w: (tmp_path / "logs" / f"worker-{w}.log").read_text().split("\n") for w in range(3)}
    for w in range(3):
        assert "CRF_ROLE rollout" in lines[w] and f"CRF_WORKER {w}" in lines[w]
        assert f"CRF_RANK {w % 2}" in lines[w] and "CRF_WORLD_SIZE 2" in lines[w]
    assert "CRF_ROLE None" in (tmp_path / "logs" / "replica-0.log").read_text()
    # a worker relaunches as a worker, a replica as a replica: each role keeps its record
    again = ex.relaunch(workers[2])
    assert again.extra["role"] == "rollout" and again.extra["attempt"] == 1
    replica = ex.relaunch(trainers[1])
    for h in (again, replica):
        wait_for(lambda h=h: ex.status(h).terminal, "exit")
    log = (tmp_path / "logs" / "worker-2.log").read_text()
    assert "rollout worker 2 started again" in log and log.count("CRF_WORKER 2") == 2
    assert "CRF_ROLE None" in (tmp_path / "logs" / "replica-1.log").read_text().split("again")[1]


def test_workers_env_is_the_trainers_contract_plus_the_role() -> None:
    assert Workers(3).env(4) == {
        "CRF_RANK": "1", "CRF_WORLD_SIZE": "3", "CRF_ROLE": "rollout", "CRF_WORKER": "4",
    }  # fmt: skip


def test_a_worker_past_its_restarts_is_left_dead_saying_why(tmp_path: Path) -> None:
    """A worker process that dies (a real one, exit 1) with --max-restarts 0 is not started
    again; the line says which limit stopped it, and the run's other role does not care."""
    import io

    from rich.console import Console

    from crf.launcher.workers import WorkerPlan, start_workers

    uri = f"file://{tmp_path}/r"
    spec = RunSpec(run_id="r", run_uri=uri, replicas=1, rollout_workers=1).validate()
    plan = WorkerPlan(1, 1, LocalProcessExecutor(), command=[sys.executable, "-c", "exit(1)"])
    out = io.StringIO()
    console = Console(file=out, width=300)
    handles = start_workers(plan, spec, None, {})
    pool = WorkerPool(plan, handles, store=RunStore(uri), launch_no=0, max_restarts=0,
                      console=console)  # fmt: skip
    (status,) = wait_for(lambda: [s for s in pool.poll() if s.state.terminal], "its end")
    assert status.state is ReplicaState.FAILED and pool.restarts == {0: 0}
    line = out.getvalue().strip()
    assert line == (
        "rollout worker 0 exited with code 1; not restarting it (--max-restarts 0: it already "
        "restarted 0 time(s)): its trainer generates for itself"
    ), line
    # its heartbeat says so, so its trainer stops waiting for it at once (not after 30 s)
    state = RunStore(uri).get_json(layout.worker_state_key(0))
    assert (state["phase"], state["serves"]) == ("failed", 0) and "not restarted" in state["error"]


def test_a_worker_whose_error_would_come_again_is_not_restarted(tmp_path: Path) -> None:
    """A worker that exits 3 (crf.rollouts.worker: an error a restart would raise again,
    such as a model folder only it cannot read) is left dead at once, whatever
    --max-restarts allows, and the line says the error it recorded, verbatim (as markup, its
    ``[/INST]`` would end the driver with a traceback)."""
    import io

    from rich.console import Console

    from crf.launcher.workers import WorkerPlan, start_workers

    uri = f"file://{tmp_path}/r"
    store = RunStore(uri)
    failed = layout.WorkerState(worker=0, serves=0, phase="failed", status="failed",
                                error="ValueError: --model /m: its chat template ends "
                                      "without [/INST]")  # fmt: skip
    store.put_json(layout.worker_result_key(0), failed.to_dict())
    spec = RunSpec(run_id="r", run_uri=uri, replicas=1, rollout_workers=1).validate()
    plan = WorkerPlan(1, 1, LocalProcessExecutor(), command=[sys.executable, "-c", "exit(3)"])
    out = io.StringIO()
    pool = WorkerPool(plan, start_workers(plan, spec, None, {}), store=store, launch_no=0,
                      max_restarts=3, console=Console(file=out, width=300))  # fmt: skip
    wait_for(lambda: (pool.poll(), pool.not_restarted)[1], "its end")
    assert pool.restarts == {0: 0}
    assert out.getvalue().strip() == (
        "rollout worker 0 exited with code 3; not restarting it (a restart would fail the same "
        "way: ValueError: --model /m: its chat template ends without [/INST]): its trainer "
        "generates for itself"
    ), out.getvalue()


def test_workers_stopped_by_crf_cancel_are_not_restarted_and_read_as_cancelled(
    tmp_path: Path,
) -> None:
    """``crf cancel`` from another process stops a watched run's workers as it stops its
    replicas: the driver's pool finds them ended by a signal, which to its executor looks
    like a death. It must not start them again, and its summary shows them cancelled with
    the run (not ``failed: killed by SIGTERM``), as ``crf cancel``'s own summary does."""
    import io

    from rich.console import Console

    from crf.launcher.driver import _stop_workers
    from crf.launcher.workers import (
        WorkerPlan,
        read_worker_handles,
        save_worker_handles,
        start_workers,
    )

    uri = f"file://{tmp_path}/r"
    store = RunStore(uri)
    spec = RunSpec(run_id="r", run_uri=uri, replicas=1, rollout_workers=2).validate()
    live = [sys.executable, "-c", "import time; time.sleep(600)"]
    plan = WorkerPlan(2, 1, LocalProcessExecutor(), command=live)
    out = io.StringIO()
    handles = start_workers(plan, spec, None, {})
    pool = WorkerPool(plan, handles, store=store, launch_no=0, max_restarts=3,
                      console=Console(file=out, width=300))  # fmt: skip
    save_worker_handles(store, 0, handles)
    try:
        assert all(not s.terminal for s in pool.poll())
        # crf cancel, elsewhere: the request first, then its own executor stops the workers
        store.put_json(layout.cancel_key(0), {"requested_at": time.time()})
        LocalProcessExecutor().cancel_all(read_worker_handles(store, 0))

        def ended() -> bool:  # or started again: either ends the wait
            statuses = pool.poll()
            return any(pool.restarts.values()) or all(s.terminal for s in statuses)

        wait_for(ended, "both workers' end")
        assert pool.restarts == {0: 0, 1: 0}, out.getvalue()
        assert "restarted" not in out.getvalue()
        rows = _stop_workers(pool, cancelled=True)["workers"]
        assert [(r["worker"], r["state"]) for r in rows] == [(0, "cancelled"), (1, "cancelled")]
        assert all("cancelled with the run" in r["message"] for r in rows), rows
    finally:
        pool.stop()


def test_a_restarted_worker_s_line_says_the_error_it_failed_with(tmp_path: Path) -> None:
    """A worker that fails with an error (its result says which, then exit 1) and is started
    again: the line says the error, verbatim (as markup, ``[/INST]`` would end the driver
    with a traceback), which its next attempt's result replaces in the store, so the line is
    where the user reads why it failed (a death records none: no error)."""
    import io

    from rich.console import Console

    from crf.launcher.workers import WorkerPlan, start_workers

    uri = f"file://{tmp_path}/r"
    flag = tmp_path / "failed-once"
    code = (
        "import os, pathlib, sys, time\nfrom crf import layout\nfrom crf.store import RunStore\n"
        f"flag = pathlib.Path({str(flag)!r})\n"
        "if not flag.exists():\n    flag.touch()\n"
        "    error = 'ValueError: the prompt does not end with [/INST]'\n"
        "    state = layout.WorkerState(worker=0, phase='failed', status='failed',\n"
        "        error=error, updated_at=time.time())\n"
        "    RunStore(os.environ['CRF_RUN_URI']).put_json(layout.worker_result_key(0),\n"
        "        state.to_dict())\n    sys.exit(1)\ntime.sleep(600)"
    )
    spec = RunSpec(run_id="r", run_uri=uri, replicas=1, rollout_workers=1).validate()
    plan = WorkerPlan(1, 1, LocalProcessExecutor(), command=[sys.executable, "-c", code])
    out = io.StringIO()
    console = Console(file=out, width=300)
    pool = WorkerPool(plan, start_workers(plan, spec, None, {}), store=RunStore(uri),
                      launch_no=0, max_restarts=2, console=console)  # fmt: skip
    try:
        wait_for(lambda: pool.poll() and pool.restarts == {0: 1}, "its restart")
        assert out.getvalue().strip() == (
            "rollout worker 0 exited with code 1 (ValueError: the prompt does not end with "
            "[/INST]): restarted it (1/2)"
        ), out.getvalue()
    finally:
        pool.stop()


def test_a_restarted_worker_reads_as_starting_at_once(tmp_path: Path) -> None:
    """A worker that died and was started again reads as ``starting`` from the restart on
    (counts kept), before its new process writes anything: its trainer, past its first
    batches, generates at once instead of waiting for the dead one's last heartbeat to age."""
    from crf.launcher.workers import WorkerPlan, start_workers

    uri = f"file://{tmp_path}/r"
    flag = tmp_path / "died-once"
    code = (
        f"import pathlib, sys, time\nflag = pathlib.Path({str(flag)!r})\n"
        "if not flag.exists():\n    flag.touch()\n    sys.exit(1)\ntime.sleep(600)"
    )
    spec = RunSpec(run_id="r", run_uri=uri, replicas=1, rollout_workers=1).validate()
    plan = WorkerPlan(1, 1, LocalProcessExecutor(), command=[sys.executable, "-c", code])
    store = RunStore(uri)
    before = layout.WorkerState(worker=0, serves=0, phase="generating", batches=3, updated_at=1.0)
    store.put_json(layout.worker_state_key(0), before.to_dict())
    pool = WorkerPool(plan, start_workers(plan, spec, None, {}), store=store, launch_no=0,
                      max_restarts=1)  # fmt: skip
    try:
        wait_for(lambda: pool.poll() and pool.restarts == {0: 1}, "its restart")
        state = store.get_json(layout.worker_state_key(0))
        assert (state["phase"], state["batches"]) == ("starting", 3), state
        assert state["updated_at"] > 1.0
    finally:
        pool.stop()


# ------------------------------------------------------------------------- summary, figure
def _round(r: int, rank: int, workers: int, local: int, stale: float) -> dict[str, Any]:
    m = layout.RoundMetrics(round=r, rank=rank, committed=True, loss=1.0)
    m.rollouts = {"workers": workers, "local": local, "refused": 1 if local else 0,
                  "staleness_mean": stale, "staleness_max": 2, f"w{rank}": workers,
                  "wait_s": 0.25}  # fmt: skip
    return m.to_dict()


def test_summary_counts_what_workers_produced_and_what_each_trainer_used() -> None:
    spec = RunSpec(run_id="r", run_uri="file:///tmp/r", replicas=2, rounds=2, rollout_workers=2)
    metrics = {
        0: [_round(0, 0, 24, 8, 1.0), _round(1, 0, 32, 0, 0.5)],
        1: [_round(0, 1, 0, 32, 0.0), _round(1, 1, 16, 16, 2.0)],
    }
    rows = [
        rollout_view.worker_row(
            0, "succeeded", layout.WorkerState(worker=0, serves=0, rollouts=64, generate_s=3.25)
        ),
        rollout_view.worker_row(1, "failed", None, restarts=3),
    ]
    section = rollout_view.workers_summary(rows, metrics)
    assert section["count"] == 2 and section["rollouts_produced"] == 64
    # the time each side spent: generating (a worker), waiting for batches (a trainer)
    assert section["workers"][0]["generate_s"] == 3.2 and section["workers"][1]["generate_s"] == 0
    assert section["trainers"]["0"]["wait_s"] == 0.5
    t0, t1 = section["trainers"]["0"], section["trainers"]["1"]
    assert (t0["worker_rollouts"], t0["local_rollouts"], t0["share"]) == (56, 8, 0.875)
    assert t0["staleness_mean"] == pytest.approx((24 * 1.0 + 32 * 0.5) / 56, abs=1e-3)
    assert (t1["worker_rollouts"], t1["share"], t1["refused"]) == (16, 0.25, 2)
    assert t1["staleness_mean"] == 2.0 and t1["by_worker"] == {"w1": 16}
    assert section["rollouts_used"] == 72 and section["share"] == pytest.approx(72 / 128)
    assert "workers" not in build_summary(spec=spec, results=[], started_at=0.0)


def test_a_worker_yet_to_write_its_heartbeat_reads_as_its_process_state() -> None:
    """While a worker starts (its process runs, its heartbeat is not written yet: the first
    seconds locally, minutes while a cloud container starts) the live table shows its
    process's state, never "None"; once it beats, its phase."""
    from rich.console import Console

    beating = layout.WorkerState(worker=1, serves=1, phase="generating")
    row = rollout_view.worker_row
    rows = [row(0, "pending", None), row(2, "running", None), row(1, "running", beating)]
    console = Console(record=True, width=120, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(rollout_view.workers_table(rows, 120))
    text = console.export_text()
    assert "None" not in text, text
    cells = [line.split() for line in text.splitlines()]
    states = {c[0]: c[2] for c in cells if c and c[0][:1] == "w" and c[0][1:].isdigit()}
    assert states == {"w0": "pending", "w2": "running", "w1": "generating"}, text


def test_the_summary_says_why_each_failed_worker_failed() -> None:
    """Under the workers' table, one line per failed worker with the error it recorded and
    how its process ended; a worker that succeeded or was cancelled gets none."""
    import io

    from rich.console import Console

    failed = layout.WorkerState(worker=0, serves=0, phase="failed", status="failed",
                                error="FileNotFoundError: --model /m: no such folder")  # fmt: skip
    rows = [
        rollout_view.worker_row(0, "failed", failed, message="exited with code 3"),
        rollout_view.worker_row(1, "failed", None, message="killed by SIGKILL"),
        rollout_view.worker_row(2, "cancelled", None),
    ]
    section = rollout_view.workers_summary(rows, {})
    out = io.StringIO()
    rollout_view.print_workers({"workers": section}, Console(file=out, width=200))
    lines = [" ".join(line.split()) for line in out.getvalue().splitlines()]
    failures = [line for line in lines if " failed: " in line]
    assert failures == [
        "w0 failed: FileNotFoundError: --model /m: no such folder; exited with code 3",
        "w1 failed: killed by SIGKILL",
    ], lines


def test_a_worker_that_ended_by_itself_is_not_shown_cancelled() -> None:
    """At a run's end the driver cancels the workers still running; one that had already
    written its own result (done, ok) but whose process had not yet exited is shown as it
    ended, not as cancelled. One stopped short (its record not done) stays cancelled."""
    done = layout.WorkerState(worker=0, serves=0, rollouts=64, phase="done", status="ok")
    row = rollout_view.worker_row(0, "cancelled", done, message="cancelled")
    assert (row["state"], row["message"]) == ("succeeded", "")
    busy = layout.WorkerState(worker=1, serves=1, rollouts=32, phase="generating")
    assert rollout_view.worker_row(1, "cancelled", busy)["state"] == "cancelled"
    assert rollout_view.worker_row(2, "cancelled", None)["state"] == "cancelled"


def test_figure_has_a_worker_panel_only_with_workers() -> None:
    with_workers = {0: [_round(0, 0, 24, 8, 1.0), _round(1, 0, 32, 0, 0.5)]}
    assert _ROLLOUTS in panels_for("composer", with_workers)
    plain = {0: [layout.RoundMetrics(round=0, rank=0, loss=1.0, committed=True).to_dict()]}
    assert _ROLLOUTS not in panels_for("composer", plain)
    assert draw_figure(with_workers, job="composer", title="t")[:4] == b"\x89PNG"
    series = rollout_view.round_series(with_workers[0])
    assert series == {"round": [0.0, 1.0], "share": [0.75, 1.0], "staleness": [1.0, 0.5]}


def test_the_staleness_axis_starts_at_zero() -> None:
    """A steady staleness of 0.9 steps sits at 0.9 of a scale from 0, not at the top of one
    fitted to it (where it read as a share of 1)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from crf.launcher.figure import _draw_rollouts

    fig = Figure()
    ax = fig.add_subplot()
    _draw_rollouts(ax, {0: [_round(r, 0, 32, 0, 0.9) for r in range(3)]})
    low, high = fig.axes[1].get_ylim()
    assert low <= 0 < 0.9 < high <= 1.1
    fig = Figure()
    ax = fig.add_subplot()
    _draw_rollouts(ax, {0: [_round(0, 0, 32, 0, 3.0)]})
    assert fig.axes[1].get_ylim()[1] > 3.0


# ------------------------------------------------------------------------ the driver, e2e
@pytest.mark.e2e
@pytest.mark.slow
def test_one_launch_two_roles_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A composer run of 2 replicas with 3 (stand-in) workers: the driver starts them with
    their role, restarts the one that dies, never fails the run for it, stops them when the
    trainers end; the summary, crf status and crf logs --role rollout show them."""
    from rich.console import Console

    from crf.launcher.driver import run

    monkeypatch.setenv("CRF_TEST_WORKER_DIES", "1")
    store = tmp_path / "runs"
    options = {"replicas": 2, "rounds": 1, "sync_every": 1, "rollout_workers": 3,
               "job_config": {"num_examples": 64}, "run_id": "two-roles"}  # fmt: skip
    plan = prepare(options, store=str(store))
    assert plan.workers is not None and plan.workers.executor is plan.executor
    plan.workers.command = STANDIN
    console = Console(file=open(os.devnull, "w"), width=160)  # noqa: SIM115
    summary = run(plan, progress=False, console=console, plot=False)
    assert summary["status"] == "ok", summary.get("error")
    section = summary["workers"]
    assert section["count"] == 3
    by_worker = {r["worker"]: r for r in section["workers"]}
    assert by_worker[1]["restarts"] == 1  # died once, restarted, the run did not care
    assert {r["serves"] for r in by_worker.values()} == {0, 1}
    assert all(r["state"] in ("succeeded", "cancelled") for r in by_worker.values())
    run_store = RunStore(f"file://{store / 'two-roles'}")
    saved = run_store.get_json(layout.worker_handles_key(0))["handles"]
    assert sorted(h["rank"] for h in saved) == [0, 1, 2]

    status = cli("status", "two-roles", "--store", str(store), "--json")
    assert status.exit_code == 0, status.output
    record = json.loads(status.output)
    assert [w["worker"] for w in record["workers"]] == [0, 1, 2]
    assert all(w["rollouts"] == 8 for w in record["workers"])
    assert set(record["worker_share"]) == {"0", "1"}  # the replicas' rounds, by source
    table = cli("status", "two-roles", "--store", str(store))
    assert table.output.count("rollout workers") == 2 and "w2" in table.output  # + summary line
    assert "rollouts each replica trained on" in table.output
    logs = cli("logs", "two-roles", "--store", str(store), "--role", "rollout")
    assert logs.exit_code == 0, logs.output
    assert "[w1] dying on purpose" in logs.output and "[w2] CRF_WORKER=2" in logs.output
    one = cli("logs", "two-roles", "--store", str(store), "--role", "rollout", "--rank", "0")
    assert "CRF_ROLE=rollout" in one.output and "[w" not in one.output
    trainer = cli("logs", "two-roles", "--store", str(store), "--rank", "0")
    assert "CRF_ROLE=rollout" not in trainer.output and trainer.output
    sdk_lines = list(crf.attach("two-roles", str(store)).logs(2, role="rollout"))
    assert ("CRF_WORKER=2" in [line for _, line in sdk_lines]) and {r for r, _ in sdk_lines} == {2}
    missing = cli("logs", "two-roles", "--store", str(store), "--role", "rollout", "--rank", "7")
    assert missing.exit_code == 2 and "has no rollout worker 7" in missing.output


def test_worker_pool_never_fails_the_run_and_stops_at_the_end(tmp_path: Path) -> None:
    """A worker that keeps dying is restarted up to --max-restarts, then left dead; stop()
    cancels the ones still running."""
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", grace_period_s=5)
    uri = f"file://{tmp_path / 'run'}"
    die = [sys.executable, "-c", "import sys; sys.exit(1)"]
    live = [sys.executable, "-c", "import time; time.sleep(600)"]
    from crf.launcher.workers import WorkerPlan

    gone = f"file://{tmp_path / 'gone'}"  # its own run: the dead worker's heartbeat stays there
    dying = WorkerPool(WorkerPlan(1, 1, ex), ex.launch_workers(1, 1, die, run_uri=gone, run_id="a"),
                       store=RunStore(gone), launch_no=0, max_restarts=2)  # fmt: skip
    wait_for(lambda: (dying.poll(), dying.not_restarted)[1], "the restarts to run out")
    assert dying.restarts == {0: 2} and "restarted 2 time(s)" in dying.not_restarted[0]
    assert RunStore(gone).get_json(layout.worker_state_key(0))["phase"] == "failed"
    alive = WorkerPool(WorkerPlan(2, 1, ex), ex.launch_workers(2, 1, live, run_uri=uri, run_id="b"),
                       store=RunStore(uri), launch_no=0, max_restarts=2)  # fmt: skip
    assert all(not s.terminal for s in alive.poll())
    # the live table shows each worker below the replicas' table
    from rich.console import Console

    from crf.launcher.supervise import with_workers

    state = layout.WorkerState(worker=1, serves=0, phase="generating", version=7, rollouts=64,
                               staleness_mean=1.5, updated_at=time.time())  # fmt: skip
    RunStore(uri).put_json(layout.worker_state_key(1), state.to_dict())
    rows = alive.live_rows(alive.poll())
    assert [(r["worker"], r["phase"], r["rollouts"]) for r in rows] == [
        (0, None, 0), (1, "generating", 64)]  # fmt: skip
    console = Console(record=True, width=120, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(with_workers("replicas' table", rows, 120))
    text = console.export_text()
    assert "replicas' table" in text and "rollout workers" in text
    assert "generating" in text and "64" in text and "1.5" in text
    alive.stop()
    assert [r["state"] for r in alive.collect()] == ["cancelled", "cancelled"]


# ------------------------------------------------------------------------- a cloud backend
def test_hf_jobs_start_workers_on_their_own_flavor_found_apart_from_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_env: Any
) -> None:
    """Through the HF Jobs emulator: workers are jobs of their own flavor and name, with the
    same image, code and secrets handling as the replicas, labelled crf-role=rollout (so a
    lookup of the run's replicas by label leaves them out), relaunched as workers."""
    pytest.importorskip("huggingface_hub", reason="needs the hf extra: pip install -e .[hf]")
    from tests import test_executor_hf_jobs as hf
    from tests.emulators.hf_jobs import HFJobsEmulator

    monkeypatch.setenv("HF_TOKEN", hf.TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    dump = "import os\nfor k, v in sorted(os.environ.items()): print(f'{k}={v}')"
    with HFJobsEmulator({hf.TOKEN: hf.USER}, {hf.USER: [hf.ORG]}) as emu:
        uri = f"s3://{s3_env.new_bucket()}/runs/roles"
        trainer_opts, rollout_opts = split_options("hf", {"flavor": "a10g-small",
                                                          "rollout_hardware": "l4x1"})  # fmt: skip
        trainers = hf.make(emu, **trainer_opts)
        workers = hf.make(emu, **{**trainer_opts, **rollout_opts})
        (replica,) = trainers.launch_replicas(1, hf.py(dump), env={"MY_KEY": hf.SECRET},
                                              run_uri=uri, run_id="roles")  # fmt: skip
        handles = workers.launch_workers(2, 1, hf.py(dump), env={"MY_KEY": hf.SECRET},
                                         run_uri=uri, run_id="roles")  # fmt: skip
        for h in [replica, *handles]:
            assert hf.ended(workers, h).state is ReplicaState.SUCCEEDED
        spec = emu.jobs[handles[1].backend_id].spec
        assert (
            spec["flavor"] == "l4x1" and emu.jobs[replica.backend_id].spec["flavor"] == "a10g-small"
        )
        assert spec["labels"]["crf-role"] == "rollout" and spec["labels"]["crf-rank"] == "1"
        assert "crf-role" not in emu.jobs[replica.backend_id].spec["labels"]
        env = spec["environment"]
        assert (env["CRF_ROLE"], env["CRF_WORKER"], env["CRF_RANK"]) == ("rollout", "1", "0")
        assert "MY_KEY" in spec["secrets"] and hf.SECRET not in json.dumps(env)
        lines = list(workers.logs(handles[1]))
        assert "CRF_ROLE=rollout" in lines and "MY_KEY=***" in lines
        found = trainers.find_replicas("roles", uri, 1)
        assert [h.backend_id for h in found] == [replica.backend_id]
        again = workers.relaunch(handles[0])
        assert again.extra["role"] == "rollout"
        assert emu.jobs[again.backend_id].spec["environment"]["CRF_WORKER"] == "0"
        hf.ended(workers, again)


def test_a_resumed_run_starts_its_workers_again_on_their_hardware(tmp_path: Path) -> None:
    """--resume reads the workers' own backend options from backend.json (a launch without
    workers writes none there) and plans the workers again."""
    from crf.launcher.resume import prepare_resume

    store = tmp_path / "runs"
    spec = RunSpec(run_id="again", run_uri=f"file://{store / 'again'}", rollout_workers=2)
    folder = RunStore(spec.run_uri)
    folder.put(layout.RUN_SPEC, spec.validate().to_json().encode())
    backend = {"backend": "local", "options": {"log_dir": None}}
    folder.put_json(layout.BACKEND, {**backend, "rollout_options": {"grace_period_s": 3.0}})
    plan = prepare_resume("again", store=str(store))
    assert plan.workers is not None and plan.workers.workers == 2
    assert plan.workers.executor is not plan.executor
    assert plan.workers.executor.grace_period_s == 3.0 and plan.executor.grace_period_s == 10.0
    folder.put_json(layout.BACKEND, backend)  # no workers' options: the replicas' executor
    assert prepare_resume("again", store=str(store)).workers.executor.grace_period_s == 10.0
    # the stopped launch's worker results are kept aside: a new worker's row is no longer
    # read as ended; its heartbeat stays, the new worker goes on from its counts
    from crf.launcher.resume import claim_resume
    from crf.launcher.workers import worker_states

    ended = layout.WorkerState(worker=1, phase="done", batches=7).to_dict()
    folder.put_json(layout.worker_result_key(1), ended)
    folder.put_json(layout.worker_state_key(1), {**ended, "phase": "generating"})
    assert worker_states(folder, 2)[1].phase == "done"
    plan = prepare_resume("again", store=str(store))
    k = claim_resume(plan, layout.LaunchRecord(0, time.time(), "here", os.getpid(), "local"))
    assert worker_states(folder, 2)[1].phase == "generating"
    assert worker_states(folder, 2)[1].batches == 7
    assert folder.get_json(layout.previous_key(k, layout.worker_result_key(1))) == ended


@pytest.mark.e2e
@pytest.mark.slow
def test_a_detached_run_gathers_its_workers_in_crf_status(tmp_path: Path) -> None:
    """Detached: the workers start with the replicas and end on their own when their
    trainers have; `crf status` then writes the summary with the workers' section."""
    from rich.console import Console

    from crf.launcher.driver import run

    store = tmp_path / "runs"
    options = {"replicas": 1, "rounds": 1, "sync_every": 1, "rollout_workers": 2,
               "job_config": {"num_examples": 32}, "run_id": "away"}  # fmt: skip
    plan = prepare(options, store=str(store))
    plan.workers.command = STANDIN  # type: ignore[union-attr]
    console = Console(file=open(os.devnull, "w"), width=160)  # noqa: SIM115
    out = run(plan, detach=True, console=console)
    assert out["status"] == "detached"

    def summary() -> Any:
        status = cli("status", "away", "--store", str(store), "--json")
        record = json.loads(status.output)
        return record["result"] and all(
            w["state"] in ("succeeded", "failed", "cancelled") for w in record["workers"]
        ) and record  # fmt: skip

    record = wait_for(summary, "the detached run and its workers to end", timeout=400)
    assert record["result"]["status"] == "ok"
    section = record["result"]["workers"]
    assert section["count"] == 2 and {w["serves"] for w in section["workers"]} == {0}
    # they end on their own once their trainer has; one still ending when the summary is
    # gathered is cancelled then
    assert all(w["status"] in ("ok", "cancelled") for w in section["workers"])


@pytest.mark.e2e
@pytest.mark.slow
def test_crf_cancel_of_a_detached_run_shows_its_workers_cancelled(tmp_path: Path) -> None:
    """`crf cancel` from another process than the one that started the run stops its
    workers with its replicas, and the summary says they were cancelled: the backend sees
    only that a process it did not start ended without an ok result, which once read as
    ``failed``."""
    from rich.console import Console

    from crf.launcher.driver import run

    store = tmp_path / "runs"
    options = {"replicas": 1, "rounds": 50, "sync_every": 2, "rollout_workers": 2,
               "job_config": {"num_examples": 32}, "run_id": "stopped"}  # fmt: skip
    plan = prepare(options, store=str(store))
    plan.workers.command = STANDIN  # type: ignore[union-attr]
    console = Console(file=open(os.devnull, "w"), width=160)  # noqa: SIM115
    assert run(plan, detach=True, console=console)["status"] == "detached"
    folder = RunStore(f"file://{store / 'stopped'}")
    wait_for(lambda: all(folder.exists(layout.worker_state_key(w)) for w in (0, 1)),
             "both workers' heartbeats")  # fmt: skip
    cancelled = cli("cancel", "stopped", "--store", str(store))
    assert cancelled.exit_code == 0, cancelled.output
    result = folder.get_json(layout.RESULT)
    assert result["status"] == "cancelled"
    states = [(w["worker"], w["state"]) for w in result["workers"]["workers"]]
    assert states == [(0, "cancelled"), (1, "cancelled")], result["workers"]
