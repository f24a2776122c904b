"""bench/gpu.py on a 2-layer model on the CPU: every phase runs through the code a GPU run takes
(the offline model and tokenizer, the three generation engines, the profile of a decoding step,
the composer trainer with TRL's generate and with continuous batching, a 2-replica crf launch
read through its round records), writes its table, and puts it between docs/performance.md's
markers. The GPU's numbers are the
benchmark's business; here it must not rot before a GPU machine runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402


def test_offline_tokenizer_decodes_every_id_of_the_model() -> None:
    tok = gpu.tokenizer_offline(600)
    assert len(tok) == 600
    assert tok.decode([599]) == "<|t599|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    assert tok.decode(ids) == text


def test_update_docs_replaces_only_the_marked_table(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(f"# P\n{gpu.SECTION}\nintro\n{gpu.BEGIN}\nold\n{gpu.END}\nafter\n")
    gpu.update_docs("| new |\n", str(doc))
    assert doc.read_text() == f"# P\n{gpu.SECTION}\nintro\n{gpu.BEGIN}\n| new |\n{gpu.END}\nafter\n"


def test_the_docs_have_the_markers() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    assert gpu.SECTION in text and gpu.BEGIN in text and gpu.END in text


def test_round_phases_read_the_records_fields_and_leave_the_rest_unrecorded() -> None:
    from crf import layout

    rec = layout.RoundMetrics.from_dict(
        {"round": 0, "rank": 0, "snapshot_s": 0.5, "phases_s": {"upload": 2.0, "wait": 1.5}}
    )
    got = gpu.round_phases(rec)
    assert list(got) == [key for _, key in gpu.ROUND_PHASES]
    assert got["snapshot_s"] == 0.5 and got["upload_s"] == 2.0 and got["wait_s"] == 1.5
    assert got["d2h_s"] is None and got["encode_s"] is None
    assert set(gpu.round_phases(layout.RoundMetrics(round=0, rank=0)).values()) == {None}


def test_the_largest_h_that_fits_a_budget() -> None:
    over = gpu.RUN_OVERHEAD_S + gpu.ROUND_WAIT_S
    assert gpu.fit_sync_every(over + 50 * 6.0, 6.0, rounds=1) == 50
    assert gpu.fit_sync_every(over + 10 * 6.0, 6.0, rounds=1) == 10
    assert gpu.fit_sync_every(1e6, 6.0, rounds=1) == 50  # never more than asked
    assert gpu.fit_sync_every(over + 3 * 6.0, 6.0, rounds=1, most=3) == 3
    with pytest.raises(gpu.NoTimeLeft, match="skipped: 100 s of the budget left"):
        gpu.fit_sync_every(100.0, 6.0, rounds=2)  # too little left to measure a round
    # the replicas' first generation compiles: that time is not there for steps
    assert gpu.fit_sync_every(over + 30 + 20 * 6.0, 6.0, rounds=1, overhead_s=30.0) == 20


def test_a_crf_run_is_planned_from_the_step_measured_here_else_the_documented_one() -> None:
    here = {"grpo": {"generate": {"step_s": 4.0}}, "generate": [{"key": "generate", "step_ms": 30}]}
    docs = {"grpo": {"generate": {"step_s": 7.0}}, "profile": [{"key": "generate", "step_ms": 50}]}
    assert gpu.crf_run_step("grpo", (here, docs), 8) == 8.0  # the GPU shared by 2
    assert gpu.crf_run_step("grpo", ({}, docs), 8) == 14.0
    assert gpu.crf_run_step("grpo", ({}, {}), 8) == 10.0
    assert gpu.crf_run_step("small", (here, docs), 8) == pytest.approx(1.25 * 8 * 0.03 + 0.1)
    assert gpu.crf_run_step("small", ({}, docs), 8) == pytest.approx(1.25 * 8 * 0.05 + 0.1)
    # replicas that decode compiled: the GRPO step's compiled path, the static engine's step
    here["grpo"]["compiled"] = {"step_s": 1.0}
    here["generate"].append({"key": "static", "step_ms": 5})
    assert gpu.crf_run_step("grpo", (here, docs), 8, compiled=True) == 2.0
    assert gpu.crf_run_step("grpo", ({}, docs), 8, compiled=True) == 4.0  # no such step known
    small = gpu.crf_run_step("small", (here, docs), 8, compiled=True)
    assert small == pytest.approx(1.25 * 8 * 0.005 + 0.1)
    # a streaming run's steps are GRPO-sized
    assert gpu.crf_run_step("stream", (here, docs), 8) == gpu.crf_run_step("grpo", (here, docs), 8)
    # a run leaves the runs after it what they need, as many as fit, else takes it all
    assert gpu.crf_run_share(400.0, 230.0, [100.0]) == 300.0
    assert gpu.crf_run_share(300.0, 230.0, [100.0]) == 300.0
    assert gpu.crf_run_share(400.0, 230.0, []) == 400.0
    assert gpu.crf_run_share(600.0, 230.0, [230.0, 100.0]) == 270.0  # both after it fit
    assert gpu.crf_run_share(500.0, 230.0, [230.0, 100.0]) == 270.0  # the first of them only
    assert gpu.crf_run_share(500.0, 230.0, [300.0, 100.0]) == 500.0  # not the first: none


def test_streaming_takes_the_longest_delay_torchft_allows() -> None:
    assert gpu.streaming(50, 2) == (50, 24)  # a fragment every 25 steps, 24 of them overlap
    assert gpu.streaming(11, 2) == (10, 4)  # H rounded down to a multiple of the fragments
    assert gpu.streaming(12, 4) == (12, 2)
    assert gpu.streaming(2, 2) == (2, 0)
    assert gpu.streaming(1, 2) == (2, 0)  # never fewer steps than fragments


def test_a_streaming_run_shows_its_overlap_and_its_goal() -> None:
    rep = {"crf_share": 0.02, "sync_s": 1.0, "sync_per_round_s": [0.6, 0.4],
           "compute_per_round_s": [30.0, 30.0], "transfer_per_round_s": [4.0, 3.0],
           "phases_per_round": []}  # fmt: skip
    run = {"label": "stream", "replicas": [rep, rep], "crf_share": 0.02, "goal": 0.05,
           "sync_every": 10, "rounds": 2, "rounds_committed": 2, "rollouts_per_step": 32,
           "completion": 128, "fragments": 2, "fragment_sync_delay": 4}  # fmt: skip
    rows = "\n".join(gpu._run_rows(run, {"step_s": 1.0}))
    size = "GRPO-sized steps, Streaming DiLoCo"
    told = f"{size} (2 fragments, each exchange overlapping 4 steps of training), H = 10"
    assert told in rows and "(goal ≤ 5%: met)" in rows
    assert f"the exchange per replica and round ({size}), s: its transfer in the background" in rows
    assert "the time training waited | 3.5 / 0.5, 3.5 / 0.5 |" in rows
    assert "derived" not in rows  # measured at GRPO-sized steps: nothing to derive
    # a vanilla run has no background transfer to show
    vanilla = {**run, "label": "grpo", "fragments": 1, "fragment_sync_delay": 0}
    rows = "\n".join(gpu._run_rows(vanilla, {"step_s": 1.0}))
    assert "GRPO-sized steps, H = 10" in rows and "in the background" not in rows


def test_a_partial_run_keeps_the_documented_phases_it_did_not_run(tmp_path: Path) -> None:
    before = {"commit": "abc1234", "generate": [{"engine": "HF generate", "note": "x"}],
              "crf": {"old": True}, "merged": {"generate": "0000000"}}  # fmt: skip
    path = tmp_path / gpu.DOCS_RESULT
    path.write_text(json.dumps(before))
    now = {"commit": "def5678", "crf": {"new": True}, "errors": {"generate": "failed: x"},
           "skipped": {"crf-small": "skipped: 9 s left"}}  # fmt: skip
    got = gpu.merge_documented(now, str(path))
    assert got["crf"] == {"new": True} and got["generate"] == before["generate"]
    assert got["merged"] == {"generate": "0000000"}  # the commit that measured it
    assert got["errors"] == {"generate": "failed: x"}  # still shown
    assert got["skipped"] == {"crf-small": "skipped: 9 s left"}  # nothing earlier to show
    # a row kept from a run on another machine names that machine with its commit
    before = {"commit": "abc1234", "environment": {"gpu": "NVIDIA H100 80GB HBM3"},
              "generate": [{"engine": "HF generate"}]}  # fmt: skip
    path.write_text(json.dumps(before))
    got = gpu.merge_documented({"commit": "def5678", "environment": {"gpu": "NVIDIA H200"}},
                               str(path))  # fmt: skip
    assert got["merged"] == {"generate": "abc1234 on NVIDIA H100 80GB HBM3"}
    assert gpu.merge_documented(now, str(tmp_path / "none.json")) == now


def test_a_failed_profile_process_is_the_phase_s_error(tmp_path: Path) -> None:
    # the profile runs in a process of its own; what it could not do reaches the parent as
    # the phase's error, not as a missing row
    why = "the profile's process failed: .*--model .*no-model: no model saved there"
    with pytest.raises(RuntimeError, match=why):
        gpu.profile_in_child(str(tmp_path / "no-model"), [2], tiny=True)


def test_the_copies_floor_and_the_round_s_copies_against_it() -> None:
    floor = gpu.bench_copies(1 << 20, "cpu", at_once=2, repeats=2)
    assert floor["bytes"] == 1 << 20 and floor["at_once"] == 2 and floor["pinned"] is False
    assert floor["d2h_s"] > 0 and floor["h2d_s"] > 0
    run = {"copies": {"bytes": 2_000_000_000, "at_once": 2, "pinned": True,
                      "d2h_s": 0.2, "h2d_s": 0.25}}  # fmt: skip
    phases = [{"d2h_s": 0.1, "h2d_s": 0.5}, {"d2h_s": 0.3, "h2d_s": None}]
    (row,) = gpu._copy_rows(run, phases, "small steps")
    assert "2 plain pinned copies of the same 2.00 GB at once" in row
    assert "device-to-host 0.200 against 0.200 (1.00x)" in row
    assert "host-to-device 0.500 against 0.250 (2.00x)" in row
    # a run whose tensors stayed on the host (a CPU run) has no device copies to show
    assert gpu._copy_rows(run, [{"d2h_s": None, "h2d_s": None}], "small steps") == []
    assert gpu._copy_rows({"copies": None}, phases, "small steps") == []
    assert gpu._copy_rows({"copies": {**run["copies"], "pinned": False}}, phases, "x") == []


def _serves_continuous_batching() -> bool:
    from packaging.version import Version

    from crf.replica.trl_settings import CONTINUOUS_BATCHING_TRANSFORMERS
    from crf.versions import distribution_version

    have = distribution_version("transformers") or "0"
    return Version(have) >= Version(CONTINUOUS_BATCHING_TRANSFORMERS)


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_run_of_every_phase(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "performance.md", repo / "docs" / "performance.md")
    (repo / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "gpu.py", repo / "bench" / "gpu.py")
    out = tmp_path / "out"
    # the crf phase (GRPO-sized) is bench_crf with other sizes: crf-small stands for both;
    # crf-stream runs the same with Streaming DiLoCo.
    # continuous batching as the bench drives it (generate_batch with a persistent manager,
    # TRL's path) needs transformers>=5.8 (crf refuses it before launch on older ones): the
    # generate and GRPO phases run it where the installed transformers serves it
    cb = _serves_continuous_batching()
    engines = ["generate", "nocudnn", "continuous", "static"] if cb else ["generate", "static"]
    generations = ["compiled", "cudnn", "generate"] + (["continuous"] if cb else [])
    generations.sort()
    cmd = [sys.executable, str(repo / "bench" / "gpu.py"), "--tiny", "--out", str(out),
           "--steps", "2", "--sync-every", "2", "--rounds", "2", "--completion", "4",
           "--prompts", "1", "--new-tokens", "4", "--batches", "2,4",
           "--engines", ",".join(engines), "--grpo-generation", ",".join(generations),
           "--grpo-repeats", "2",
           "--phases", "generate,profile,grpo,crf-stream,crf-small",
           "--update-docs"]  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((out / "gpu.json").read_text())
    assert res["errors"] == {}
    made = [(g["key"], g["batch"]) for g in res["generate"] if "tokens_per_s" in g]
    assert made == [(e, b) for e in engines for b in (2, 4)]
    assert all(g["tokens_per_s"] > 0 for g in res["generate"] if "batch" in g)
    profiled = [(p["key"], p["batch"]) for p in res["profile"]]
    assert profiled == [(e, b) for e in ("generate", "nocudnn") for b in (2, 4)]
    assert all(p["step_ms"] > 0 and p["top_cpu"] for p in res["profile"])
    grpo = res["grpo"]
    assert sorted(grpo) == generations
    assert all(g["steps"] == 2 and g["step_s"] > 0 for g in grpo.values())
    assert all(len(g["step_s_runs"]) == 2 for g in grpo.values())  # each path twice
    assert grpo["generate"]["learning_rate"] == 1e-6  # TRL's GRPO default, not the toy's
    assert all(g["master_dtypes"] == ["float32"] for g in grpo.values())
    # generation timed inside each step: a part of it, as often as the step
    assert all(0 < g["generation_s"] <= max(g["step_s_runs"]) for g in grpo.values())
    assert all(len(g["generation_s_runs"]) == 2 for g in grpo.values())
    assert grpo["compiled"]["first_step_s"] > 0  # a static cache (compiled on a GPU only)
    run = res["crf-small"]
    assert run["weights_identical"] is True and run["sync_every"] == 2
    assert all(0 <= r["crf_share"] < 1 for r in run["replicas"])
    assert 0 <= run["crf_share"] < 1 and run["goal"] == 0.10
    assert all(len(r["phases_per_round"]) == 2 for r in run["replicas"])
    # the floor of the round's device copies, for the model's fp32 bytes
    assert run["copies"]["bytes"] == 4 * res["parameters"] and run["copies"]["d2h_s"] > 0
    table = (out / "gpu.md").read_text()
    assert "crf's share of wall time, measured" in table and "goal ≤ 10%" in table
    by_round = next(line for line in table.splitlines() if line.startswith("| by round"))
    assert "round 0: " in by_round and "round 1: " in by_round  # first apart from the rest
    assert "crf's share of wall time after round 0" in table
    assert "one decoding step (torch.profiler)" in table
    assert "of it generating the rollouts / the rest" in table
    assert table in (repo / "docs" / "performance.md").read_text()
    stream = res["crf-stream"]
    assert stream["weights_identical"] is True and stream["fragments"] == 2
    assert (stream["sync_every"], stream["fragment_sync_delay"]) == (2, 0)
    assert all(len(r["transfer_per_round_s"]) == 2 for r in stream["replicas"])
    assert "Streaming DiLoCo (2 fragments" in table and "in the background" in table
    assert "plain generate" in table  # the default decodes plainly on a CPU
