"""bench/scale.py's quick path on the file store (N = 2, 4): the machine-independent columns -
bytes and the requests the protocol needs - are what the scaling table is read for, so they
are asserted here; times are the benchmark's business (this machine is noisy)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale  # noqa: E402

from crf.store import ObjectNotFound, RunStore  # noqa: E402


def test_request_counter_counts_calls_and_misses(tmp_path: Path) -> None:
    store = RunStore(f"file://{tmp_path}/run")
    counter = scale.RequestCounter(store)
    store.put("a", b"x")
    assert store.get("a") == b"x"
    assert store.get_range("a", 0, 1) == b"x"
    with pytest.raises(ObjectNotFound):
        store.get("b")
    assert store.object_exists("a") and not store.object_exists("b")
    assert store.list("") == ["a"]
    store.get_json  # noqa: B018 - a composite: its get is what counts
    store.delete("a")
    c = counter.snapshot()
    assert dict(c) == {
        "put": 1,
        "get": 2,
        "get_range": 1,
        "object_exists": 2,
        "list": 1,
        "delete": 1,
        "miss": 2,
    }


@pytest.mark.parametrize("n", [2, 4])
def test_quick_rounds_count_what_the_protocol_needs(tmp_path: Path, n: int) -> None:
    numel, rounds = 65536, 2
    got = scale.measure(f"file://{tmp_path}/run", n, numel, rounds, limit_s=60.0)
    assert "error" not in got, got
    res = scale.summarize(got["records"], numel, cores=2)
    assert len(res["rounds"]) == rounds
    for rnd in res["rounds"]:
        # P up (everything but the shard a replica owns, plus its reduced shard), and
        # 2 (N-1)/N P down (the others' parts of its shard, the others' reduced shards);
        # headers, manifest and quorum.json are what is over
        assert rnd["up_p"] == pytest.approx(1.0, abs=0.05)
        assert rnd["bytes_p"] - rnd["up_p"] == pytest.approx(2 * (n - 1) / n, abs=0.05)
        # reads that found their object: N-1 parts and N-1 reduced shards, and the quorum
        # decision for all but its writer; writes: contribution, reduced shard, decision
        assert rnd["gets"] - rnd["misses"] >= 2 * (n - 1)
        assert 2 <= rnd["puts"] <= 3
        assert rnd["lists"] >= 1
        assert rnd["req"] == pytest.approx(
            rnd["lists"] + rnd["gets"] + rnd["puts"] + rnd["heads"] + rnd["deletes"]
        )
        assert rnd["decide_s"] >= 0 and rnd["round_s"] > 0
    # every replica ends every round with the same bits (the bench measures a working exchange)
    assert res["identical"] and all(rnd["identical"] for rnd in res["rounds"])


def test_main_writes_markdown_and_json(tmp_path: Path) -> None:
    out = tmp_path / "scale.md"
    argv = ["--quick", "--replicas", "2", "--numel", "1024", "--out", str(out)]
    assert scale.main(argv) == 0
    text = out.read_text()
    assert "| file | 2 |" in text
    assert out.with_suffix(".json").exists()


def test_two_level_rows_run_the_built_exchange(tmp_path: Path) -> None:
    """``--reduce-group-size 2`` at N = 4: two groups of two; every replica still ends with the
    same bits, and a replica uploads its whole contribution plus its group's sum of a slice."""
    numel = 8192
    got = scale.measure(f"file://{tmp_path}/run", 4, numel, 2, limit_s=60.0, group=2)
    assert "error" not in got, got
    res = scale.summarize(got["records"], numel, cores=2)
    assert res["identical"]
    for rnd in res["rounds"]:
        assert rnd["up_p"] >= 1.0 + 0.5 - 0.05  # P, then P / G of its group's sum
