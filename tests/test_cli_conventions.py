"""CLI conventions, each from its own `crf` process on real runs of the
contract-following replica script: `runs --json/--status/--limit`, `status --json/--watch`,
`logs --tail`, `rm` (confirmation, -y, refused while a replica runs)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.test_cli_attach import CRF, _launch, _wait_ended, crf, script  # noqa: F401


def test_runs_status_logs_json_filters_and_tail(tmp_path: Path, script: Path) -> None:  # noqa: F811
    base = tmp_path / "runs"
    for run_id in ("first", "second"):
        code, out = _launch(base, script, run_id, "--detach")
        assert code == 0, out
        _wait_ended(base, run_id, 2)
    code, out = crf("status", "first", "--store", str(base), "--json")
    assert code == 0, out
    record = json.loads(out)  # stdout is the JSON alone
    assert record["run_id"] == "first" and record["status"] == "ok"
    assert [r["rank"] for r in record["replicas"]] == [0, 1]
    assert record["replicas"][0]["phase"] == "done" and record["result"]["status"] == "ok"

    code, out = crf("runs", "--store", str(base), "--json")
    assert code == 0 and {r["run_id"] for r in json.loads(out)} == {"first", "second"}
    code, out = crf("runs", "--store", str(base), "--json", "--limit", "1")
    assert code == 0 and len(json.loads(out)) == 1
    code, out = crf("runs", "--store", str(base), "--json", "--status", "ok")
    assert code == 0 and [r["run_id"] for r in json.loads(out)] == ["first"]
    # "second" ended but nobody gathered it (no crf status yet): stopped, not running
    code, out = crf("runs", "--store", str(base), "--json", "--status", "stopped")
    assert code == 0 and [r["run_id"] for r in json.loads(out)] == ["second"]
    code, out = crf("runs", "--store", str(base), "--json", "--status", "failed")
    assert code == 0 and json.loads(out) == []
    code, out = crf("runs", "--store", str(base), "--status", "done")
    assert code == 2 and "unknown --status done" in out

    code, out = crf("logs", "first", "--store", str(base), "--rank", "0")
    all_lines = out.splitlines()
    code, out = crf("logs", "first", "--store", str(base), "--rank", "0", "--tail", "1")
    assert code == 0 and out.splitlines() == all_lines[-1:]

    code, out = crf("status", "first", "--store", str(base), "--watch", "--interval", "0.2")
    assert code == 0 and "replica 1 ended: succeeded" in out and "run ok" in out


def test_rm_asks_refuses_a_running_run_and_deletes(tmp_path: Path, script: Path) -> None:  # noqa: F811
    base = tmp_path / "runs"
    code, out = _launch(base, script, "busy", "--detach", env={"SLEEP_RANKS": "1"})
    assert code == 0, out
    code, out = crf("rm", "busy", "--store", str(base), "-y")
    assert code == 2 and "still running" in out and "crf cancel busy" in out
    assert (base / "busy" / "run.json").exists()  # nothing deleted
    assert crf("cancel", "busy", "--store", str(base))[0] == 0

    no = subprocess.run([*CRF, "rm", "busy", "--store", str(base)], input="n\n",
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert no.returncode == 2 and (base / "busy" / "run.json").exists()
    # no answer to read (a script, CI: stdin at its end): one line saying how, not "Aborted!"
    eof = subprocess.run([*CRF, "rm", "busy", "--store", str(base)], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert eof.returncode == 2 and (base / "busy" / "run.json").exists(), eof.stderr
    assert "nothing deleted; pass -y" in eof.stderr and "Aborted" not in eof.stderr
    code, out = crf("rm", "busy", "--store", str(base), "-y")
    assert code == 0 and "deleted run busy" in out and "object(s)" in out
    assert not (base / "busy").exists()
    code, out = crf("rm", "busy", "--store", str(base), "-y")
    assert code == 2 and "no run 'busy'" in out
