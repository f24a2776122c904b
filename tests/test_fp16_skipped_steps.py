"""A step fp16's gradient scaler skips still counts as an inner step.

Under ``--precision fp16`` (a T4's or a V100's fast choice) the trainer's gradient scaler skips
the optimizer step whenever the scaled gradients overflow: common in the first steps, and
again now and then as the scale grows. The trainer still counts the step (``global_step``,
and so ``max_steps``), but no optimizer step hook runs, so crf's and torchft's step counts
would fall behind and the run would end before its last sync. These tests run real
trainers with a real ``torch.amp.GradScaler`` on the CPU (accelerate makes none there, so
the test gives the trainer one) and gradients that overflow at chosen steps, while the loss
stays finite, as fp16's do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from crf.replica.context import ReplicaContext
from crf.spec import RunSpec
from crf.store import RunStore
from tests.conftest import DEVICES

pytest.importorskip("transformers")

#: the 0-based optimizer steps whose gradients overflow
OVERFLOW = (1, 4)


class _Overflow(torch.autograd.Function):
    """Identity forward; the gradient times infinity backward (the scaled fp16 gradient that
    no longer fits)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


class _Regression(torch.nn.Module):
    """A model the Hugging Face Trainer takes: ``loss`` from ``x`` and ``y``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        self.overflow = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        if self.overflow:
            out = _Overflow.apply(out)
        return {"loss": ((out - y) ** 2).mean()}


def _run(
    tmp_path: Path, optim: str, device: str = "cpu", sync_every: int = 2, rounds: int = 3
) -> tuple[Any, Any, RunStore]:
    """3 rounds of 2 steps of a real Trainer under DiLoCoCallback, the gradients overflowing
    at OVERFLOW. On the CPU the trainer gets the gradient scaler accelerate makes for fp16 on
    a GPU; on CUDA it trains in fp16 and accelerate makes its own."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from crf.composer import DiLoCoCallback

    store = RunStore(str(tmp_path / "run"))
    spec = RunSpec(
        run_id="run", run_uri=store.uri, replicas=1, sync_every=sync_every, rounds=rounds
    )
    store.put("run.json", spec.to_json().encode())
    ctx = ReplicaContext(store, spec, 0, 1)
    model = _Regression()
    g = torch.Generator().manual_seed(1)
    rows = [{"x": torch.randn(4, generator=g), "y": torch.randn(2, generator=g)} for _ in range(64)]

    class OverflowAt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            model.overflow = state.global_step in OVERFLOW

    callback = DiLoCoCallback(ctx)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=spec.total_steps, per_device_train_batch_size=4,
        learning_rate=0.01, use_cpu=device == "cpu", fp16=device == "cuda", report_to=[],
        logging_steps=1, save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        optim=optim,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      callbacks=[OverflowAt(), callback])  # fmt: skip
    if device == "cpu":  # what accelerate makes for fp16 on a GPU (on the CPU it makes none)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    with ctx:
        trainer.train()
    return trainer, callback, store


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optim", ["adamw_torch", "sgd", "adamw_torch_fused"])
def test_a_skipped_step_counts_and_the_last_round_syncs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, optim: str, device: str
) -> None:
    """Two steps overflow in 3 rounds of 2: the trainer takes its 6 steps, crf counts 6,
    every round syncs (the last one at step 6) and the weights stay finite.
    The scaler skips the step of AdamW's foreach and of SGD (crf then counts it itself, with
    one warning, then info lines); torch's fused AdamW (the trainer's default) takes the
    scaler in its own step and skips the update inside it, so its step hooks ran already."""
    with caplog.at_level("INFO", logger="crf.composer.callback"):
        trainer, callback, store = _run(tmp_path, optim, device)
    assert trainer.state.global_step == 6
    assert callback.ctx.step == 6
    result = json.loads(store.get("results/0.json"))
    assert result["status"] == "ok", result
    assert (result["steps"], result["rounds_committed"], result["syncs_missed"]) == (6, 3, [])
    last = json.loads(store.get("metrics/0/2.json"))  # the last round's record
    assert (last["committed"], last["step"]) == (True, 6)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    warned = [r.levelname for r in caplog.records if "scaler skipped" in r.getMessage()]
    if optim == "adamw_torch_fused":
        assert callback.skipped_steps == 0 and not warned
    elif device == "cpu":
        assert callback.skipped_steps == len(OVERFLOW)
        assert warned == ["WARNING", "INFO"]
    else:  # fp16 on CUDA may also overflow on its own while the scale comes down
        assert callback.skipped_steps >= len(OVERFLOW)
        assert warned[0] == "WARNING" and set(warned[1:]) <= {"INFO"}


@pytest.mark.parametrize("foreach", [True, False])
def test_the_hook_counts_a_skipped_step_as_the_loop_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, foreach: bool
) -> None:
    """A loop of its own with ``scaler.step(optimizer)`` and ``hook.step()`` after it: the
    steps the scaler skips still count, so ``hook.done`` comes after ``--rounds`` ×
    ``--sync-every`` calls, every round syncs, and the replica's result says so."""
    from crf.integrations.hook import DiLoCoHook
    from crf.layout import ENV_RANK, ENV_RUN_URI, ENV_WORLD_SIZE

    store = RunStore(str(tmp_path / "run"))
    spec = RunSpec(run_id="run", run_uri=store.uri, replicas=1, sync_every=2, rounds=3)
    store.put("run.json", spec.to_json().encode())
    environ = {ENV_RUN_URI: store.uri, ENV_RANK: "0", ENV_WORLD_SIZE: "1"}
    model = _Regression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=foreach)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    calls = 0
    with caplog.at_level("INFO", logger="crf.integrations.hook"):
        hook = DiLoCoHook(model, optimizer, environ=environ)
        while not hook.done:
            model.overflow = calls in OVERFLOW
            loss = model(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g))["loss"]
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            hook.step(loss=loss.item())
            calls += 1
        hook.close()
    assert calls == spec.total_steps == 6
    result = json.loads(store.get("results/0.json"))
    assert result["status"] == "ok", result
    assert (result["steps"], result["rounds_committed"], result["syncs_missed"]) == (6, 3, [])
    assert hook.skipped_steps == len(OVERFLOW)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    warned = [r.levelname for r in caplog.records if "skipped it" in r.getMessage()]
    assert warned == ["WARNING", "INFO"]
