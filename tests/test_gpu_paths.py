"""Every crf path that puts tensors on a device, run on that device: the sft job with held-out
data and Streaming DiLoCo, the composer job with ``--model`` (full fine-tuning and LoRA),
bf16 and auto precision, a CUDA run killed whole then resumed and exported, and DiLoCoHook in
a loop whose tensors live on the device. (The exchange's average on CUDA tensors:
tests/test_allreduce_device.py.)

Each case runs on the CPU (marked slow/e2e: it proves the test body here) and on CUDA (marked
``gpu``; skipped without a GPU, with the reason): ``pytest -m gpu`` runs the CUDA ones, which is
what ``make gpu-check`` does on a GPU machine. Models are tiny Qwen2 folders built in the test:
nothing is downloaded."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
DEVICES = [
    pytest.param("cpu", marks=[pytest.mark.slow, pytest.mark.e2e]),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]
SMALL = {"prompts_per_step": 2, "num_generations": 2, "num_examples": 16,
         "max_completion_length": 6}  # fmt: skip


def _watch() -> dict[str, Any]:
    from crf.executors.local import LocalProcessExecutor
    from crf.launcher import driver

    return dict(
        env={"CRF_LOG_LEVEL": "WARNING"},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=0),
        progress=False, report=False, plot=False, poll_s=0.1, timeout_s=300,
    )  # fmt: skip


def _launch(tmp_path: Path, run_id: str, env: dict[str, str] | None = None, **options: Any):
    from crf.launcher import driver

    watch = _watch()
    watch["env"] = {**watch["env"], **(env or {})}
    spec = {"replicas": 2, "sync_every": 2, "rounds": 2, "run_id": run_id,
            "round_timeout_s": 120.0, **options}  # fmt: skip
    return driver.launch(spec, store=str(tmp_path / "runs"), **watch)


def _ok(summary: dict[str, Any]) -> None:
    rows = summary["replicas"]
    assert summary["status"] == "ok", [r.get("error") for r in rows]
    assert summary["weights_identical"] is True


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    from tests.hub_models import save_tiny_repo

    save_tiny_repo(tmp_path / "base")
    return str(tmp_path / "base")


def _jsonl(path: Path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 3))) for _ in range(n)]
    path.write_text("".join(json.dumps({"prompt": f"{w}=", "completion": w[::-1]}) + "\n"
                            for w in words))  # fmt: skip
    return str(path)


@pytest.mark.parametrize("device", DEVICES)
def test_sft_with_held_out_data_on_the_device(tmp_path: Path, model_dir: str, device: str) -> None:
    """The sft job, auto precision (bf16 on a GPU that has it), with Streaming DiLoCo (2
    fragments, each exchange overlapping a step), a held-out file scored each round: both
    replicas end bit-identical and each round has a held-out loss."""
    summary = _launch(
        tmp_path, "sft", env={"CRF_LOG_LEVEL": "INFO"}, job="sft", model=model_dir,
        device=device, precision="auto", sync_every=4, fragments=2, fragment_sync_delay=1,
        dataset=_jsonl(tmp_path / "train.jsonl", 64, 0),
        eval_dataset=_jsonl(tmp_path / "test.jsonl", 8, 1), eval_examples=8,
        job_config={"learning_rate": 3e-3, "per_device_train_batch_size": 8},
    )  # fmt: skip
    _ok(summary)
    assert all(r["steps"] == 8 for r in summary["replicas"])
    assert sorted(summary["held_out"]["loss_per_round"]) == [0, 1], summary["held_out"]
    # on a GPU the host buffers are page-locked before training (on the CPU none are needed)
    logs = [Path(r["log_path"]).read_text() for r in summary["replicas"]]
    assert all(("host buffers:" in log) == (device == "cuda") for log in logs)
    assert all(("inner-state buffers:" in log) == (device == "cuda") for log in logs)


@pytest.mark.parametrize("device", DEVICES)
def test_composer_lora_in_bf16_on_the_device(tmp_path: Path, model_dir: str, device: str) -> None:
    """The composer job on ``--model`` with LoRA adapters and ``--precision bf16`` (the frozen
    base in bf16, the adapters fp32): only the adapters are exchanged, the replicas end
    bit-identical, the embedded task's held-out prompts are scored, and on CUDA the
    generations decode compiled (the default there)."""
    summary = _launch(
        tmp_path, "lora", job="composer", model=model_dir, device=device, precision="bf16",
        lora_rank=4, eval_examples=4, job_config=SMALL,
    )  # fmt: skip
    _ok(summary)
    assert summary["held_out"], summary
    full = sum(p.numel() for p in _load(model_dir).parameters())
    assert all(0 < r["bytes_per_round"] < 4 * full for r in summary["replicas"])
    # generation_compile unset: the decoding step compiled on CUDA, plain generate on the CPU
    logs = [Path(r["log_path"]).read_text() for r in summary["replicas"]]
    assert all(("decoding step compiled" in log) == (device == "cuda") for log in logs)


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_killed_whole_resumes_and_exports(
    tmp_path: Path, model_dir: str, device: str
) -> None:
    """Full fine-tuning at auto precision: both replicas are killed in round 2 (of 3), the
    run ends failed; ``resume`` continues it from its newest saved round to the end, the
    replicas end bit-identical, and ``crf export`` writes a model that loads with fp32
    weights (the master weights stayed fp32 under bf16 autocast)."""
    from crf.launcher import driver
    from crf.launcher.export import export

    faults = ";".join(f"rank={k},point=inner_step,step=5" for k in range(2))  # H = 2
    first = _launch(
        tmp_path, "cut", env={"CRF_FAULT": faults}, job="composer", model=model_dir,
        device=device, precision="auto", rounds=3, eval_examples=4, job_config=SMALL,
    )  # fmt: skip
    assert first["status"] != "ok"
    resumed = driver.resume("cut", store=str(tmp_path / "runs"), **_watch())
    _ok(resumed)
    assert resumed["launch"] == 1
    export("cut", str(tmp_path / "out"), store=str(tmp_path / "runs"))
    model = _load(str(tmp_path / "out"), dtype="auto")  # as saved
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_the_hook_exchanges_tensors_on_the_device(tmp_path: Path, device: str) -> None:
    """DiLoCoHook in a plain loop whose model lives on the device (one process per
    replica): every round commits and the replicas end with the same bits."""
    loop = ROOT / "tests" / "integrations_scripts" / "device_loop.py"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CRF_LOG_LEVEL": "WARNING", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--backend", "local",
         "--replicas", "2", "--sync-every", "3", "--rounds", "2", "--run-id", "hooked",
         "--store", str(tmp_path / "runs"), "--entrypoint", f"{sys.executable} {loop}",
         "--env", f"LOOP_DEVICE={device}", "--no-progress", "--max-restarts", "0",
         "--round-timeout", "60", "--timeout", "200"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=260,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "runs" / "hooked" / "result.json").read_text())
    reps = result["replicas"]
    assert all(r["rounds_committed"] == 2 and r["steps"] == 6 for r in reps), reps
    assert all(r["job_metrics"]["devices"] == [device] for r in reps)
    assert reps[0]["job_metrics"]["sha256"] == reps[1]["job_metrics"]["sha256"]


def _load(folder: str, dtype: Any = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
