"""Replicas that build different models: through the real driver, real
replica processes, ReplicaContext and torchft's DiLoCo, the run stops at the first exchange
with an error that names the mismatch - not a heal timeout minutes later - and the driver
does not restart a replica that would only hit it again.

The figure docs/faults.md quotes is printed here: run with ``-s``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from crf.executors.local import LocalProcessExecutor
from crf.launcher import driver
from tests.fault_helpers import SHIM, TINY, describe

#: the round deadline of these runs; healing (what main did) waits 3x this before giving up
DEADLINE_S = 30.0

#: a user's own entrypoint whose hidden layer is 10 wide on rank 0 and 9 wide elsewhere
OWN_SCRIPT = """\
import torch
from crf.replica import ReplicaContext

with ReplicaContext.from_env() as ctx:
    torch.manual_seed(ctx.seed)
    width = 10 if ctx.rank == 0 else 9
    model = torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(ctx.data_seed)
    with ctx.diloco(model, opt):
        while ctx.step < ctx.total_steps:
            x = torch.randn(16, 4, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log_step(loss=loss.item())
    ctx.finish({})
"""


def _launch(tmp_path: Path, how: str) -> dict[str, Any]:
    if how == "lm":  # python -m crf.replica (through the test shim): rank 1's lm is wider
        options: dict[str, Any] = {**TINY, "hidden_size": 10, "num_heads": 1}
        options.update(corpus_sentences=1000, eval_batches=1)  # a quicker start
        entrypoint = [sys.executable, SHIM]
        env = {"CRF_TEST_JOB_SET": json.dumps({"rank": 1, "set": {"hidden_size": 12}})}
    else:  # the user's own script: an uncaught error exits 1, whatever it is
        script = tmp_path / "own_train.py"
        script.write_text(OWN_SCRIPT)
        options, entrypoint, env = {}, [sys.executable, str(script)], {}
    return driver.launch(
        {
            "job": "lm",
            "replicas": 2,
            "sync_every": 3,
            "rounds": 3,
            "run_id": f"mismatch-{how}",
            "job_config": options,
            "entrypoint": entrypoint,
            "round_timeout_s": DEADLINE_S,
        },
        store=str(tmp_path / "runs"),
        env={"CRF_LOG_LEVEL": "WARNING", **env},
        executor=LocalProcessExecutor(grace_period_s=2.0),
        restart=driver.RestartPolicy(max_restarts=1),
        progress=False,
        report=False,
        plot=False,
        poll_s=0.1,
        timeout_s=240,
    )


@pytest.mark.parametrize("how", ["lm", "own-entrypoint"])
def test_replicas_with_different_models_stop_at_once_and_say_why(tmp_path: Path, how: str) -> None:
    """Both replicas fail in round 0 with the layout mismatch (both shapes named), within the
    round deadline; neither is restarted; the summary says a restart cannot fix it."""
    summary = _launch(tmp_path, how)
    print("\n" + describe(summary))
    rows = summary["replicas"]
    assert summary["status"] == "failed" and summary["restarts"] == 0, describe(summary)
    # lm: the embedding (vocab x hidden) differs; own script: the first layer (width x 4)
    shapes = (", 10)", ", 12)") if how == "lm" else ("(10, 4)", "(9, 4)")
    for row in rows:
        error = row["error"] or ""
        assert "LayoutMismatchError" in error and "HealError" not in error, error
        assert "disagree on the tensors to average" in error, error
        assert all(shape in error for shape in shapes), error
        assert row["restarts"] == 0 and row["attempts"] == [], row
        assert "restart cannot fix" in row["not_restarted"], row
        assert row["restartable"] is False
        assert row["exit_code"] == (3 if how == "lm" else 1)
    assert "LayoutMismatchError" in summary["fatal_error"]
    # the round that found the mismatch (its exchange: waiting for the other replica to arrive
    # included) ended within its deadline, and the replica stopped right there
    results = tmp_path / "runs" / f"mismatch-{how}" / "results"
    exchange_s = [json.loads((results / f"{r}.json").read_text())["transfer_s"] for r in (0, 1)]
    assert max(exchange_s) < DEADLINE_S, exchange_s
    # process start-up (torch, transformers) on a loaded machine included: generous, and yet
    # less than the heal timeout (3 deadlines) plus a restart that the replicas went through
    assert summary["wall_s"] < 4 * DEADLINE_S, summary["wall_s"]
    print(
        f"[figure] {how}: the run ended after {summary['wall_s']:.1f}s; the exchange that "
        f"found the mismatch took {max(exchange_s):.2f}s (deadline {DEADLINE_S:.0f}s); "
        f"replicas' own time {max(r['wall_s'] for r in rows):.1f}s"
    )
