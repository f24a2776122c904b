"""``--workdir``, ``--pip`` and ``--requirements``: what is packed, what is
refused, what the bootstrap installs, and a local run whose replica runs ``python train.py``
in an unpacked copy of the user's folder. The same run on a cloud backend (the fake Modal
servicer over the S3 emulator) is in tests/test_executor_modal.py."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from crf import layout
from crf.executors.bootstrap import requirements_for
from crf.executors.workdir import (
    RunNeeds,
    WorkdirError,
    check_requirement,
    pack_workdir,
    read_requirements,
    run_needs,
)
from crf.launcher import driver
from crf.launcher.errors import LaunchError
from crf.spec import RunSpec

#: the user's script: imports a helper module from the workdir, writes into its cwd, and
#: leaves what it saw as its result (results/<rank>.json) through fsspec; it counts the one
#: round it was asked for as committed, as a replica that exchanged does (a run in which no
#: replica committed a round is not ok)
TRAIN_PY = """\
import hashlib, json, os, sys
import fsspec
import helper
from crf import layout
open("written-by-replica.txt", "w").write("x")
seen = {
    "status": "ok", "rounds_committed": 1,
    "cwd": os.getcwd(), "helper": helper.VALUE, "argv": sys.argv[1:],
    "files": sorted(os.listdir(".")),
    "secret_sha256": hashlib.sha256(os.environ.get("MY_SECRET", "").encode()).hexdigest(),
}
uri = os.environ["CRF_RUN_URI"].rstrip("/") + "/" + layout.result_key(int(os.environ["CRF_RANK"]))
with fsspec.open(uri, "w") as f:
    json.dump(seen, f)
"""


def make_workdir(root: Path) -> Path:
    """A user's folder: a script, a helper module, and what .gitignore keeps out."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(TRAIN_PY)
    (root / "helper.py").write_text("VALUE = 42\n")
    (root / ".gitignore").write_text("*.log\ndata/\n__pycache__/\n")
    (root / "run.log").write_text("ignored\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 1000)
    (root / "pkg").mkdir()
    (root / "pkg" / ".gitignore").write_text("!keep.log\n")
    (root / "pkg" / "keep.log").write_text("re-included below\n")
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    return root


def names_in(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return sorted(tar.getnames())


def test_packing_honours_gitignore_without_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_workdir(tmp_path / "code")
    packed = pack_workdir(root)
    assert packed.how == ".gitignore (pathspec)"
    assert names_in(packed.data) == [
        ".gitignore", "helper.py", "pkg/.gitignore", "pkg/keep.log", "pkg/mod.py", "train.py",
    ]  # fmt: skip
    # reproducible: one key per content, also when packed later (gzip's header holds a time)
    later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: later)
    assert pack_workdir(root).sha256 == packed.sha256


def test_packing_a_git_checkout_takes_what_git_would(tmp_path: Path) -> None:
    root = make_workdir(tmp_path / "repo")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".git" / "info" / "exclude").write_text("helper.py\n")  # git's own rules too
    packed = pack_workdir(root)
    assert packed.how == "git ls-files"
    assert names_in(packed.data) == [
        ".gitignore", "pkg/.gitignore", "pkg/keep.log", "pkg/mod.py", "train.py",
    ]  # fmt: skip


def test_the_size_limit_names_the_biggest_files(tmp_path: Path) -> None:
    root = tmp_path / "code"
    root.mkdir()
    (root / "model.bin").write_bytes(b"\1" * 3_000_000)
    (root / "cache.npz").write_bytes(b"\1" * 2_000_000)
    (root / "train.py").write_text("print(1)\n")
    with pytest.raises(WorkdirError) as e:
        pack_workdir(root, limit=4_000_000)
    msg = str(e.value)
    assert "\n" not in msg and "more than the 4 MB" in msg
    assert msg.index("model.bin (2.9 MB)") < msg.index("cache.npz (1.9 MB)")
    assert ".gitignore" in msg


def test_prepare_packs_keys_and_keeps_the_local_store_out(tmp_path: Path) -> None:
    root = make_workdir(tmp_path / "code")
    opts = {"job": "lm", "replicas": 1, "rounds": 1, "run_id": "w", "workdir": str(root)}
    # the store inside the workdir (--workdir . with the default ./crf-runs)
    (root / "runs" / "old").mkdir(parents=True)
    (root / "runs" / "old" / "weights.bin").write_bytes(b"\0" * 10)
    plan = driver.prepare(opts, store=str(root / "runs"), dry_run=True)
    assert plan.workdir is not None and "runs/old/weights.bin" not in names_in(plan.workdir.data)
    assert plan.spec.workdir == str(root.resolve())
    assert plan.spec.workdir_key == layout.workdir_key(plan.workdir.sha256[:16])
    with pytest.raises(LaunchError, match="no such folder"):
        driver.prepare({**opts, "workdir": str(tmp_path / "nope")}, store=str(tmp_path / "r"))
    # a relative program is looked for in the workdir, where each replica runs
    (root / "run.sh").write_text("#!/bin/sh\nexec true\n")
    (root / "run.sh").chmod(0o755)
    opts = {**opts, "entrypoint": "./run.sh", "run_id": "w2"}
    assert driver.prepare(opts, store=str(root / "runs"), dry_run=True).workdir is not None
    with pytest.raises(LaunchError, match="does not exist or is not executable"):
        driver.prepare({**opts, "workdir": None}, store=str(root / "runs"), dry_run=True)
    bad = RunSpec.from_json(plan.spec.to_json())
    bad.workdir_key = "../../etc/passwd"
    with pytest.raises(ValueError, match="workdir_key"):
        bad.validate()


def test_a_reward_module_is_imported_from_the_workdir(tmp_path: Path) -> None:
    root = tmp_path / "code"
    root.mkdir()
    (root / "my_wd_rewards.py").write_text(
        "def score(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    opts = {"replicas": 1, "rounds": 1, "run_id": "rw", "reward": ["my_wd_rewards:score"]}
    with pytest.raises(LaunchError, match="cannot import"):  # not on the driver's path
        driver.prepare(opts, store=str(tmp_path / "runs"), dry_run=True)
    plan = driver.prepare({**opts, "workdir": str(root)}, store=str(tmp_path / "r"), dry_run=True)
    assert plan.spec.reward == ["my_wd_rewards:score"]
    # a module-path job too, its options checked against its Config
    (root / "wd_jobs").mkdir()
    (root / "wd_jobs" / "__init__.py").write_text("")
    (root / "wd_jobs" / "tiny.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass Config:\n    lr: float = 0.1\n\n"
        "def run(ctx, config):\n    return {}\n"
    )
    job = {"replicas": 1, "rounds": 1, "job": "wd_jobs.tiny", "job_config": {"lr": "0.5"}}
    with pytest.raises(LaunchError, match="no module"):
        driver.prepare({**job, "run_id": "j1"}, store=str(tmp_path / "r"), dry_run=True)
    plan = driver.prepare(
        {**job, "run_id": "j2", "workdir": str(root)}, store=str(tmp_path / "r"), dry_run=True
    )
    assert plan.spec.job_config == {"lr": 0.5}


def test_pip_and_requirements(tmp_path: Path) -> None:
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# tools\npackaging>=20  # inline\n\nnumpy\n")
    assert read_requirements(reqs) == ["packaging>=20", "numpy"]
    assert check_requirement(" scipy >= 1.13 ") == "scipy>=1.13"
    for bad in ("-r other.txt", "", "not a requirement!"):
        with pytest.raises(WorkdirError, match="--pip"):
            check_requirement(bad)
    opts = {"job": "lm", "replicas": 1, "rounds": 1, "run_id": "p", "pip": ["numpy"]}
    plan = driver.prepare(
        {**opts, "requirements": str(reqs)}, store=str(tmp_path / "runs"), dry_run=True
    )
    assert plan.spec.pip == ["numpy", "packaging>=20"]  # joined, normalised, once each
    # local replicas run in this Python: a package missing here stops the launch
    with pytest.raises(LaunchError, match=r"no-such-crf-pkg.*not installed in this Python"):
        driver.prepare({**opts, "pip": ["no-such-crf-pkg"]}, store=str(tmp_path / "r2"))
    with pytest.raises(LaunchError, match=r"packaging<1 \(installed: "):
        driver.prepare({**opts, "pip": ["packaging<1"]}, store=str(tmp_path / "r3"))


def test_requirements_add_the_extras_a_run_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crf.executors import bootstrap

    # the extras as pyproject declares them (an editable install's metadata may predate them)
    declared = bootstrap._declared()
    monkeypatch.setattr(
        bootstrap,
        "_declared",
        lambda: (*declared, ("peft>=0.21", "lora"), ("math-verify>=0.9", "math")),
    )
    uri = "s3://bucket/runs/x"
    base = requirements_for(uri)
    assert not any(r.startswith(("peft", "math-verify")) for r in base)
    spec = RunSpec(run_id="x", run_uri=uri, lora_rank=8, reward=["math_answer=2", "format:^a"])
    needs = RunNeeds.of(spec)
    assert needs.extras == ("lora", "math")
    reqs = requirements_for(uri, needs.extras, ["scipy>=1.13"])
    assert any(r.startswith("peft==") for r in reqs)  # pinned to the driver's version
    assert any(r.startswith("math-verify==") for r in reqs)
    assert reqs[-1] == "scipy>=1.13" and reqs[: len(base)] == base
    assert RunNeeds.of(RunSpec(run_id="y", run_uri=uri, reward=["exact_match"])).extras == ()
    # the executors read them from the run's run.json; no run.json: nothing extra
    assert run_needs((tmp_path / "none").as_uri()) == RunNeeds()
    folder = tmp_path / "run"
    folder.mkdir()
    spec.run_uri = folder.as_uri()
    (folder / layout.RUN_SPEC).write_text(spec.to_json())
    assert run_needs(folder.as_uri()).extras == ("lora", "math")


def test_local_replica_runs_in_an_unpacked_copy(tmp_path: Path) -> None:
    """`--workdir DIR --entrypoint "python train.py"` on the local backend: the replica's
    cwd is its own copy (ignored files left out), it imports the helper module from there,
    and the user's folder is not touched."""
    root = make_workdir(tmp_path / "code")
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    summary = driver.launch(
        {
            "replicas": 2, "rounds": 1, "run_id": "wd", "workdir": str(root),
            "entrypoint": "python train.py --steps 3",
        },
        store=str(tmp_path / "runs"), progress=False, report=False, plot=False,
    )  # fmt: skip
    assert summary["status"] == "ok", summary
    run = tmp_path / "runs" / "wd"
    for rank in (0, 1):
        seen = json.loads((run / layout.result_key(rank)).read_text())
        assert seen["cwd"] == str(run / "workdir" / str(rank))
        assert seen["helper"] == 42 and seen["argv"] == ["--steps", "3"]
        assert "train.py" in seen["files"] and "pkg" in seen["files"]
        assert "data" not in seen["files"] and "run.log" not in seen["files"]
    key = json.loads((run / layout.RUN_SPEC).read_text())["workdir_key"]
    assert (run / key).is_file()
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before


def test_cli_flags_reach_the_plan(tmp_path: Path) -> None:
    """`--workdir`, repeatable `--pip` and `--requirements` on the command line: the dry-run
    plan shows what ships and what the replicas would install."""
    import os
    import sys

    root = make_workdir(tmp_path / "code")
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("packaging\n")
    proc = subprocess.run(
        [sys.executable, "-m", "crf.launcher.cli", "launch", "--dry-run", "-n", "1",
         "--workdir", str(root), "--pip", "numpy", "--pip", "numpy>=1", "--requirements",
         str(reqs), "--entrypoint", "python train.py", "--store", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "6 file(s)" in out and ".gitignore (pathspec)" in out
    assert "numpy numpy>=1 packaging" in out


def test_a_model_folder_is_named_as_the_replicas_find_it(tmp_path: Path, monkeypatch) -> None:
    """A relative --model folder: absolute on the local backend (each replica runs in its
    own copy of --workdir, where the relative path is not); on a cloud backend the path in
    the shipped --workdir copy, and refused when it is not in one. A replica given a path
    that is not there fails as a bug of the input (no restart), not as a failing machine."""
    from crf.replica.failures import deterministic
    from crf.replica.model import Placement, load_pretrained
    from tests.hub_models import save_tiny_repo

    root = make_workdir(tmp_path / "code")
    save_tiny_repo(root / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    opts = {"job": "lm", "replicas": 1, "rounds": 1, "model": "code/models/tiny",
            "workdir": "code"}  # fmt: skip
    store = str(tmp_path / "runs")
    plan = driver.prepare({**opts, "run_id": "m1"}, store=store, dry_run=True)
    assert plan.spec.model == str(root / "models" / "tiny")
    plan = driver.prepare({**opts, "run_id": "m2", "backend": "modal"}, store="s3://b/runs",
                          dry_run=True)  # fmt: skip
    assert plan.spec.model == "./models/tiny"  # where the replica's copy of code/ has it
    (tmp_path / "link").symlink_to(root)  # the same folder through a link
    plan = driver.prepare(
        {**opts, "run_id": "m2l", "backend": "modal", "model": "link/models/tiny"},
        store="s3://b/runs",
        dry_run=True,
    )
    assert plan.spec.model == "./models/tiny"
    (root / "models" / ".gitignore").write_text("*.safetensors\n")  # weights not shipped
    with pytest.raises(LaunchError, match="does not ship its config.json and weights"):
        driver.prepare({**opts, "run_id": "m2i", "backend": "modal"}, store="s3://b/runs",
                       dry_run=True)  # fmt: skip
    (root / "models" / ".gitignore").unlink()
    with pytest.raises(LaunchError, match="the modal replicas cannot read: upload it"):
        driver.prepare({**opts, "run_id": "m3", "backend": "modal", "workdir": None},
                       store="s3://b/runs", dry_run=True)  # fmt: skip
    monkeypatch.setenv("HOME", str(tmp_path))  # "~/..." as a config file or quoted flag has it
    plan = driver.prepare({**opts, "run_id": "m5", "model": "~/code/models/tiny"},
                          store=store, dry_run=True)  # fmt: skip
    assert plan.spec.model == str(root / "models" / "tiny")
    assert driver.prepare({**opts, "run_id": "m4", "model": "org/name", "workdir": None},
                          store=store, dry_run=True).spec.model == "org/name"  # fmt: skip
    spec = RunSpec(run_id="r", run_uri="memory://x", model="./not-here")
    with pytest.raises(FileNotFoundError, match="no such folder on this replica") as caught:
        load_pretrained(spec, Placement("cpu", "fp32"), seed=0)
    assert deterministic(caught.value, phase="starting")
