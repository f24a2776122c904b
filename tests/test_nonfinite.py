"""Non-finite values: a NaN/Inf contribution is left out and reported, never
averaged; a replica whose own pseudo-gradient or weights go non-finite fails with
NonFiniteError (exit 3, not restarted); a run whose loss is NaN is never ``ok``; every JSON
file crf writes is valid JSON (a strict parser reads it).

The exchange runs as threads over one store; the end-to-end test runs ``crf launch`` with
real replica processes of the lm job, NaNs put in by ``CRF_FAULT`` (crf/faults.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from crf import jsonsafe
from crf.exchange.allreduce import NonFiniteError, ObjectStoreAllReduce, shard_bounds
from crf.executors.base import ReplicaHandle, ReplicaResult, ReplicaState
from crf.launcher.summary import build_summary
from crf.replica.context import ReplicaContext
from crf.spec import RunSpec
from crf.store import RunStore, decode_tensor
from tests.conftest import run_threads
from tests.fault_helpers import TINY_SETS


def strict_loads(text: str | bytes) -> Any:
    """json.loads that refuses the bare NaN/Infinity Python's json writes by default."""

    def refuse(token: str) -> Any:
        raise ValueError(f"not JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def assert_all_json_strict(root: Path) -> int:
    files = sorted(root.rglob("*.json"))
    for path in files:
        try:
            strict_loads(path.read_bytes())
        except ValueError as e:
            raise AssertionError(f"{path.relative_to(root)}: {e}") from None
    return len(files)


# ---------------------------------------------------------------------- JSON


def test_every_json_crf_writes_is_valid_json(tmp_path: Path) -> None:
    """put_json (metrics, heartbeats, results, result.json), put_json_if_absent (launch
    records) and run.json write NaN/Inf as the strings "NaN"/"Infinity"/"-Infinity", which
    read back as floats; Python's default (a bare NaN) is not JSON."""
    store = RunStore(str(tmp_path / "run"))
    body = {"loss": math.nan, "up": math.inf, "down": [-math.inf, 1.5], "n": 3, "s": "NaN"}
    store.put_json("metrics/0/0.json", body)
    assert store.put_json_if_absent("launches/0.json", body)
    for key in ("metrics/0/0.json", "launches/0.json"):
        got = strict_loads((tmp_path / "run" / key).read_bytes())
        assert got["loss"] == "NaN" and got["up"] == "Infinity" and got["down"][0] == "-Infinity"
        assert math.isnan(jsonsafe.number(got["loss"])) and jsonsafe.number(got["up"]) == math.inf
        assert got["down"][1] == 1.5 and got["n"] == 3
    spec = RunSpec(run_id="x", run_uri="memory://x", outer_lr=math.inf)
    text = spec.to_json()
    assert strict_loads(text)["outer_lr"] == "Infinity"
    assert RunSpec.from_json(text).outer_lr == math.inf  # read back as the float it was


# ---------------------------------------------------------------------- the exchange


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_check_finds_any_nan_or_inf(dtype: torch.dtype) -> None:
    """wire.finite (min and max in one pass) agrees with torch.isfinite wherever the bad
    value sits, and the int8 wire is judged by its block scales."""
    from crf.exchange import codecs as wirefmt

    assert wirefmt.finite(torch.empty(0, dtype=dtype))
    base = torch.randn(1000).to(dtype)
    assert wirefmt.finite(base) and wirefmt.all_finite([base[:10], base[10:]], "float32", 1000)
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 511, 999):
            x = base.clone()
            x[at] = bad
            assert not wirefmt.finite(x), (bad, at)
            assert not wirefmt.all_finite([base[:at], x[at:]], "float32", 1000)
    codes = wirefmt.encode(base.float(), "int8")
    assert wirefmt.all_finite(codes, "int8", 1000)
    codes[4:8].view(torch.float32)[0] = math.nan  # the second block's scale
    assert not wirefmt.all_finite(codes, "int8", 1000)


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return [
        torch.randn(300, generator=g),
        torch.randn(17, 5, generator=g),
        torch.randn(3, generator=g),
    ]


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "int8"])
def test_nan_contribution_is_left_out_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wire: str
) -> None:
    """Replica 2 uploads a NaN in shard 0 of its contribution (past its own check, as a
    buggy or foreign writer would): shard 0's owner leaves that part out and reports it, the
    published shard lists who was averaged, and every replica ends with exactly the average
    of the others there - finite, identical everywhere; the other shards average everyone."""
    n = 3
    monkeypatch.setenv("CRF_FAULT", "rank=2,point=nan_contribution,round=0")
    store = RunStore(str(tmp_path / "run"))

    def replica(rank: int) -> tuple[torch.Tensor, Any]:
        ar = ObjectStoreAllReduce(
            store, n, rank, run_id="run", wire_dtype=wire, round_timeout_s=30, shard_grace_s=5
        )
        ts = _tensors(rank)
        res = ar.allreduce(ts, round=0)
        return torch.cat([t.reshape(-1) for t in ts]), res

    out = run_threads(n, replica)
    for x in out:
        assert not isinstance(x, BaseException), x
    bounds = shard_bounds(sum(t.numel() for t in _tensors(0)), n)
    flat = {r: torch.cat([t.reshape(-1) for t in _tensors(r)]) for r in range(n)}
    _, header = decode_tensor((tmp_path / "run" / "rounds" / "0" / "reduced" / "0").read_bytes())
    assert header["participants"] == [0, 1]  # never averaged
    for s in range(1, n):
        _, header = decode_tensor(
            (tmp_path / "run" / "rounds" / "0" / "reduced" / str(s)).read_bytes()
        )
        assert header["participants"] == [0, 1, 2]
    first = out[0][0]
    for got, res in out:
        assert torch.isfinite(got).all()
        assert torch.equal(got, first)  # one truth for everyone
        assert res.participants == [0, 1, 2]
    a, b = bounds[0]
    expect0 = (flat[0][a:b] + flat[1][a:b]) / 2
    expect_rest = (flat[0][b:] + flat[1][b:] + flat[2][b:]) / 3
    if wire == "float32":  # exact: fp32 accumulation in rank order
        assert torch.equal(first[a:b], expect0)
        assert torch.equal(first[b:], expect_rest)
    else:  # quantized on the wire both ways
        tol = 0.05 if wire == "int8" else 0.03
        assert torch.allclose(first[a:b], expect0, atol=tol)
        assert torch.allclose(first[b:], expect_rest, atol=tol)
    rejected = out[0][1].rejected  # shard 0's owner is replica 0
    assert [str(x) for x in rejected] == [
        "rounds/0/contrib/2#0: holds NaN/Inf values: never averaged"
    ], rejected
    assert all(res.rejected == [] for _, res in out[1:])


def test_own_nonfinite_pseudo_gradient_is_never_uploaded(tmp_path: Path) -> None:
    """A replica whose pseudo-gradient holds a NaN (its weights went NaN in its inner steps),
    or whose finite values overflow the float16 wire, raises NonFiniteError naming the round
    before anything is uploaded."""
    store = RunStore(str(tmp_path / "run"))
    ts = _tensors(1)
    ts[1][3, 2] = math.nan
    ar = ObjectStoreAllReduce(store, 2, 1, run_id="run", round_timeout_s=2)
    with pytest.raises(NonFiniteError, match=r"round 4: .*tensor 1 of 3: 1 NaN, 0 Inf"):
        ar.allreduce(ts, round=4)
    big = [torch.full((10,), 1e6)]
    ar16 = ObjectStoreAllReduce(store, 2, 1, run_id="run", round_timeout_s=2, wire_dtype="float16")
    with pytest.raises(NonFiniteError, match=r"round 5: .*overflows the float16 wire"):
        ar16.allreduce(big, round=5)
    assert store.list("rounds/4/contrib") == [] and store.list("rounds/5/contrib") == []


def test_weights_that_go_nonfinite_after_the_outer_step_end_the_replica(tmp_path: Path) -> None:
    """outer_lr=inf (the spec is built directly: the CLI refuses such values before launch):
    the first outer step makes the weights NaN; the replica raises NonFiniteError naming the
    round and step instead of training on, and its result (valid JSON) says so."""
    store = RunStore(str(tmp_path / "run"))
    spec = RunSpec(
        run_id="run", run_uri=store.uri, replicas=1, sync_every=2, rounds=3, outer_lr=math.inf
    )
    store.put("run.json", spec.to_json().encode())
    ctx = ReplicaContext(store, spec, 0, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError, match=r"round 0 \(step 2\): weights went non-finite"):
        with ctx, ctx.diloco(model, opt):
            while ctx.step < ctx.total_steps:
                x = torch.randn(8, 4)
                loss = ((model(x) - x[:, :2]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ctx.log_step(loss=loss.item())
    assert ctx.step == 2  # it stopped at the first sync
    result = strict_loads((tmp_path / "run" / "results" / "0.json").read_bytes())
    assert result["status"] == "failed" and result["error"].startswith("NonFiniteError: round 0")
    assert result["restartable"] is False  # the driver leaves it down
    assert_all_json_strict(tmp_path / "run")


# ---------------------------------------------------------------------- the summary


def test_a_nan_loss_is_never_ok() -> None:
    """Every replica exited 0 and reported ok, but the loss went NaN in round 1: the run is
    failed, and the error says where."""
    spec = RunSpec(run_id="x", run_uri="memory://x", replicas=2, rounds=3)

    def result(rank: int, loss: Any) -> ReplicaResult:
        handle = ReplicaHandle("local", "x", rank, str(rank), "memory://x", 2)
        return ReplicaResult(
            handle, ReplicaState.SUCCEEDED, 0, {"status": "ok", "final_loss": loss}
        )

    # as read back from metrics/<rank>/<r>.json: the NaN is its JSON token
    metrics = {
        0: [{"round": r, "loss": 2.0, "committed": True} for r in range(3)],
        1: [{"round": 0, "loss": 2.0, "committed": True}]
        + [{"round": r, "loss": "NaN", "committed": True} for r in (1, 2)],
    }
    summary = build_summary(
        spec=spec, results=[result(0, 2.0), result(1, "NaN")], started_at=0.0, metrics=metrics
    )
    assert summary["status"] == "failed"
    assert summary["error"] == "the loss is NaN on replica 1 from round 1"
    strict_loads(jsonsafe.dumps(summary))
    clean = build_summary(
        spec=spec,
        results=[result(0, 2.0), result(1, 2.0)],
        started_at=0.0,
        metrics={0: metrics[0], 1: metrics[0]},
    )
    assert clean["status"] == "ok" and clean["error"] is None


# ---------------------------------------------------------------------- end to end


def test_nonfinite_replica_fails_clearly_and_nan_parts_are_left_out(tmp_path: Path) -> None:
    """``crf launch`` with real replica processes: replica 1 uploads a NaN part in round 1
    (left out, reported in the summary); replica 2's weights go NaN in round 2. Replica 2
    ends with NonFiniteError and exit code 3 and is not restarted (a restart would compute
    the same NaN); the others finish; the run is failed and the CLI exits non-zero; every
    JSON file of the run parses strictly."""
    base = tmp_path / "runs"
    faults = "rank=1,point=nan_contribution,round=1;rank=2,point=nan_weights,step=7"
    cmd = [
        sys.executable, "-m", "crf.launcher.cli", "launch", "--backend", "local",
        "--store", str(base), "--run-id", "nan", "--job", "lm", *TINY_SETS,
        "-n", "3", "-H", "3", "-r", "4", "--min-replicas", "2", "--round-timeout", "10",
        "--max-restarts", "2", "--no-progress", "--timeout", "240",
    ]  # fmt: skip
    env = {**os.environ, "CRF_FAULT": faults, "CRF_LOG_LEVEL": "WARNING", "COLUMNS": "200"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "NonFiniteError: round 2" in out, out
    run = base / "nan"
    summary = strict_loads((run / "result.json").read_bytes())
    assert summary["status"] == "failed"
    rows = summary["replicas"]
    assert [row["ok"] for row in rows] == [True, True, False], out
    bad = rows[2]
    assert bad["exit_code"] == 3 and bad["restarts"] == 0, bad
    assert "restart cannot fix" in bad["not_restarted"] and bad["restartable"] is False, bad
    assert summary["fatal_error"].startswith("replica 2: NonFiniteError: round 2"), summary
    assert bad["error"].startswith("NonFiniteError: round 2"), bad["error"]
    assert "pseudo-gradient holds non-finite values" in bad["error"]
    # the NaN part was never averaged, and the summary says which object it was
    assert summary["rejected_objects"] == ["rounds/1/contrib/1#0"], summary["rejected_objects"]
    _, header = decode_tensor((run / "rounds" / "1" / "reduced" / "0").read_bytes())
    assert header["participants"] == [0, 2]
    assert rows[0]["rounds_committed"] == rows[1]["rounds_committed"] == 4
    # replica 2's last heartbeat has its NaN loss, as the string "NaN"
    assert strict_loads((run / "replicas" / "2" / "state.json").read_bytes())["loss"] == "NaN"
    n = assert_all_json_strict(run)
    assert n > 10
    print(f"\n[figure] {n} JSON files of a run with NaNs, all strict JSON")
