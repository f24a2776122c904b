"""DiLoCoHook: DiLoCo through the store inside a loop crf does not own.

The end-to-end case runs a plain torchrun script (tests/integrations_scripts/fsdp_loop.py, not
a crf job) as each replica's ``--entrypoint``: 2 replicas x 2 FSDP2 ranks over gloo, each rank
exchanging its own shard. The replicas must end bit-identical, shard by shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hook_results import assert_sharded_replicas_agree

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "tests" / "integrations_scripts" / "fsdp_loop.py"


def _crf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
def test_fsdp_loop_through_the_hook_ends_bit_identical(tmp_path: Path) -> None:
    entry = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 {LOOP}"
    proc = _crf(
        "launch", "--backend", "local", "--replicas", "2", "--sync-every", "3",
        "--rounds", "3", "--run-id", "hooked", "--store", str(tmp_path / "runs"),
        "--entrypoint", entry, "--no-progress", "--max-restarts", "0",
        "--round-timeout", "60", "--timeout", "150",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "hooked"
    assert_sharded_replicas_agree(run, rounds=3, steps=9)
    # the replicas trained on different data, so the rounds did average something
    assert all(m["loss"] is not None for m in map(json.loads, _metrics(run)))


def _metrics(run: Path) -> list[str]:
    return [p.read_text() for p in sorted((run / "metrics").rglob("*.json"))]


def test_an_optimizer_that_is_no_torch_optimizer_is_refused_in_one_line() -> None:
    """e.g. PRIME-RL's CPU-offload optimizers, which wrap one: DiLoCo needs its step hooks."""
    import torch

    from crf.integrations.hook import DiLoCoHook

    class CPUOffloadOptimizer:  # a wrapper with a step(), not a torch.optim.Optimizer
        def step(self) -> None: ...

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got CPUOffloadOptim") as e:
        DiLoCoHook(model, CPUOffloadOptimizer(), environ={})
    assert "\n" not in str(e.value)


def _model_and_optimizer(misuse: str) -> tuple[object, object]:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    if misuse == "meta":
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    if misuse == "another model's optimizer":
        other = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        return model, torch.optim.SGD(other.parameters(), lr=0.1)
    if misuse == "a second optimizer for a layer":
        return model, torch.optim.SGD(model[0].parameters(), lr=0.1)
    assert misuse == "a frozen layer left out"  # fine: it is not trained
    model[0].requires_grad_(False)
    return model, torch.optim.SGD(model[1].parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("misuse", "says"),
    [
        ("meta", "4 parameter(s) of the model are on the meta device (0.weight, 0.bias, 1.w"),
        ("another model's optimizer", "4 of the model's 4 trainable parameter(s) are not in"),
        ("a second optimizer for a layer", "2 of the model's 4 trainable parameter(s) are not"),
        ("a frozen layer left out", None),
    ],
)
def test_a_model_the_optimizer_does_not_train_is_refused_in_one_line(
    misuse: str, says: str | None
) -> None:
    """Before anything starts: an optimizer of another model (or of part of this one) would
    leave the model untrained, or averaged behind its own optimizer's back, while the run
    reports ok; a meta model has no values to send."""
    from crf.integrations.hook import misuse as problem_of

    problem = problem_of(*_model_and_optimizer(misuse))
    if says is None:
        assert problem is None
        return
    assert problem is not None and says in str(problem) and "\n" not in str(problem)


def _one_replica_run(tmp_path: Path, **options: object) -> dict[str, str]:
    from crf import layout
    from crf.spec import RunSpec
    from crf.store import RunStore

    uri = f"file://{tmp_path}/run"
    spec = RunSpec(run_id="own", run_uri=uri, replicas=1, round_timeout_s=20, **options)
    RunStore(uri).put(layout.RUN_SPEC, spec.validate().to_json().encode())
    return {"CRF_RUN_URI": uri, "CRF_RANK": "0", "CRF_WORLD_SIZE": "1"}


def _result(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "results" / "0.json").read_text())


def test_a_misused_hook_is_recorded_as_a_setup_error(tmp_path: Path) -> None:
    """The replica's result says it failed at setup, not restartable: the driver ends the
    run at once instead of restarting a script that fails the same way every time."""
    from crf.integrations.hook import DiLoCoHook

    environ = _one_replica_run(tmp_path)
    with pytest.raises(ValueError, match="are not in the optimizer"):
        DiLoCoHook(*_model_and_optimizer("another model's optimizer"), environ=environ)
    result = _result(tmp_path)
    assert (result["status"], result["failed_in"], result["restartable"]) == (
        "failed", "setup", False
    )  # fmt: skip


def test_a_step_after_done_is_refused_and_not_exchanged(tmp_path: Path) -> None:
    """A loop longer than --rounds x --sync-every: the optimizer step after the last round
    does not sync a round the run never asked for, and the next hook.step() says what to fix
    (recorded as not restartable: the loop is the same on every attempt)."""
    import torch

    from crf.integrations.hook import DiLoCoHook
    from crf.replica.context import ContractError

    environ = _one_replica_run(tmp_path, rounds=1, sync_every=1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = DiLoCoHook(model, opt, environ=environ)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()

    train_step()
    hook.step(loss=1.0)
    assert hook.done
    train_step()  # one step too many: with --sync-every 1 it would sync round 1
    with pytest.raises(ContractError, match=r"hook.step\(\) after hook.done: the run's 1 inner"):
        hook.step(loss=1.0)
    assert not (tmp_path / "run" / "rounds" / "1").exists()
    assert _result(tmp_path)["restartable"] is False


def test_close_reports_the_weights_once(tmp_path: Path) -> None:
    """The result carries weights_sha256 (the summary compares replicas by it, as for crf's
    own jobs); a number given to close() is kept as a job's return value is; a second
    close() writes nothing more, and a step after close() is refused."""
    import torch

    from crf.integrations.hook import DiLoCoHook
    from crf.replica.context import ContractError

    environ = _one_replica_run(tmp_path, rounds=1, sync_every=1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = DiLoCoHook(model, opt, environ=environ)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    hook.step()
    out = hook.close(0.5)
    assert out["result"] == 0.5 and hook.close({"other": 1}) is out
    result = _result(tmp_path)
    assert result["status"] == "ok" and result["job_metrics"]["result"] == 0.5
    assert result["weights_sha256"] == result["job_metrics"]["shard_sha256"][0]
    with pytest.raises(ContractError, match=r"after hook.close\(\)"):
        hook.step()


def test_torchrun_ranks_without_a_process_group_are_refused_in_one_line() -> None:
    """Without a group each of torchrun's ranks would take itself for the whole replica:
    two writers of one replica's objects, and a run that says ok."""
    import torch

    from crf.integrations.hook import DiLoCoHook
    from crf.replica.context import ContractError

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ContractError, match="one of 2 ranks .* not initialized: call") as e:
        DiLoCoHook(model, opt, environ={"WORLD_SIZE": "2"})
    assert "\n" not in str(e.value)


def test_an_error_escaping_the_script_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop without ``with hook:`` that raises: the replica's result names the error
    (the driver then tells a restart that fails the same way from a death)."""
    import sys

    import torch

    from crf.integrations.hook import DiLoCoHook

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # put back after the test
    environ = _one_replica_run(tmp_path)
    model = torch.nn.Linear(2, 1)
    DiLoCoHook(model, torch.optim.SGD(model.parameters(), lr=0.1), environ=environ)
    error = RuntimeError("user bug at step 3")
    sys.excepthook(RuntimeError, error, None)  # as Python does for an uncaught error
    result = _result(tmp_path)
    assert (result["status"], result["error"]) == ("failed", "RuntimeError: user bug at step 3")
