"""bench/async.py's judgement of asynchronous arms against the synchronous seeds: the bounds
(max(0.05, 2σ) and 10% of sync), the correction note, the table and the command line. The
runs themselves take minutes per arm and are the benchmark's business."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "async.py"
_SPEC = importlib.util.spec_from_file_location("bench_async", _PATH)
bench = importlib.util.module_from_spec(_SPEC)  # "async" is a keyword: loaded by path
sys.modules["bench_async"] = bench  # dataclasses look their module up
_SPEC.loader.exec_module(bench)  # type: ignore[union-attr]


def outcome(arm: str, seed: int, pass_at_1: float, auc: float, **kw) -> object:
    return bench.Outcome(arm=arm, seed=seed, status="ok", pass_at_1=pass_at_1,
                         reward_auc=auc, wall_s=10.0, **kw)  # fmt: skip


def sync_seeds() -> list[object]:
    return [outcome("sync", s, p, a) for s, (p, a) in enumerate([(0.5, 0.30), (0.5, 0.32),
                                                                  (0.5, 0.31)])]  # fmt: skip


def test_an_arm_within_both_bounds_passes_and_one_behind_fails() -> None:
    runs = sync_seeds()
    runs += [outcome("async-s1", s, 0.48, 0.30) for s in range(3)]  # 0.02 and 0.01 behind
    runs += [outcome("async-s2", s, 0.40, 0.20) for s in range(3)]  # 0.10 and 0.11 behind
    checks = {(c["arm"], c["metric"]): c for c in bench.verdicts(runs)}
    assert checks[("async-s1", "pass_at_1")]["ok"]
    assert checks[("async-s1", "reward_auc")]["ok"]
    assert not checks[("async-s2", "pass_at_1")]["ok"]
    assert not checks[("async-s2", "reward_auc")]["ok"]
    # the tighter of max(0.05, 2σ) and 10% of sync's mean binds: 0.031 for an AUC of 0.31
    assert checks[("async-s1", "reward_auc")]["bound"] == pytest.approx(0.031)


def test_an_arm_ahead_of_sync_passes() -> None:
    runs = sync_seeds() + [outcome("async-s1", s, 0.9, 0.5) for s in range(3)]
    assert all(c["ok"] for c in bench.verdicts(runs))


def test_an_arm_without_a_measure_fails() -> None:
    runs = sync_seeds() + [bench.Outcome("async-s1", 0, "failed", None, None, 1.0)]
    assert not any(c["ok"] for c in bench.verdicts(runs))


def test_the_correction_note_says_when_the_benchmark_cannot_tell() -> None:
    same = [outcome("async-s2", s, 0.5, 0.30) for s in range(3)]
    same += [outcome("async-s2-off", s, 0.5, 0.30) for s in range(3)]
    assert "cannot tell" in bench.correction_note(same)
    behind = [outcome("async-s2", s, 0.5, 0.30) for s in range(3)]
    behind += [outcome("async-s2-off", s, 0.2, 0.10) for s in range(3)]
    assert "falls behind" in bench.correction_note(behind)
    # on pass@1 alone is enough
    one = [outcome("async-s2", s, 0.74, 0.42) for s in range(3)]
    one += [outcome("async-s2-off", s, 0.55, 0.40) for s in range(3)]
    note = bench.correction_note(one)
    assert "falls behind: pass@1 0.550 vs 0.740" in note and "AUC" not in note


def test_a_saved_run_reports_again(tmp_path, capsys) -> None:
    saved = tmp_path / "run.json"
    runs = sync_seeds() + [outcome("async-s1", s, 0.48, 0.30) for s in range(3)]
    saved.write_text(json.dumps([o.__dict__ for o in runs]))
    assert bench.main(["--report", str(saved)]) == 0
    assert "| async-s1 | 3 |" in capsys.readouterr().out


def test_the_table_has_one_row_per_arm_with_its_gain_against_sync() -> None:
    runs = sync_seeds()
    for o in runs:
        o.round_s = 2.0
    runs += [bench.Outcome("async-s1", s, "ok", 0.5, 0.3, 30.0, worker_share=1.0, staleness=1.0,
                           round_s=1.0) for s in range(3)]  # fmt: skip
    rows = bench.table(runs)
    assert [r[0] for r in rows] == ["sync", "async-s1"]
    assert rows[1][4:7] == ["30 s", "1.00 s", "2.00x"]  # half sync's time per round
    md = bench.markdown(rows, bench.verdicts(runs), "note", "python bench/async.py")
    assert "| async-s1 | 3 |" in md and "Measured with `python bench/async.py`" in md


def test_the_command_line() -> None:
    args = bench.parse_args(["--quick", "--set", "learning_rate=1e-3"])
    assert args.seeds == "0" and args.set == [("learning_rate", 0.001)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--set", "learning_rate"])


def test_the_time_per_round_leaves_out_the_start() -> None:
    from crf import layout

    def rec(rank: int, r: int, at: float) -> object:
        return layout.RoundMetrics(rank=rank, round=r, committed=True, updated_at=at)

    # round 0 ends at 100 s (start-up and filling the pipeline), then 2 s per round
    records = {r: [rec(0, r, 100.0 + 2 * r), rec(1, r, 101.0 + 2 * r)] for r in range(4)}
    assert bench.round_time(records) == pytest.approx(2.0)
    assert bench.round_time({0: [rec(0, 0, 5.0)]}) is None  # one round: no steady state


def test_the_mismatch_is_the_mean_over_rounds_and_workers() -> None:
    from crf import layout

    def rec(r: int, kls: dict[str, float]) -> object:
        correction = {w: {"mismatch_kl": kl, "ratio_max": 2.0} for w, kl in kls.items()}
        return layout.RoundMetrics(rank=0, round=r, committed=True,
                                   rollouts={"workers": 32, "correction": correction})  # fmt: skip

    records = {0: [rec(0, {"w0": 0.01, "w1": 0.03})], 1: [rec(1, {"w0": 0.02})]}
    assert bench.mismatch(records) == pytest.approx(0.02)
    assert bench.mismatch({0: [layout.RoundMetrics(rank=0, round=0)]}) is None  # no workers
