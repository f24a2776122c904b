"""Mistakes in the run-management commands get one line that says what to fix, before
anything is changed: a store URL with a typo or credentials in it, an export destination or a
figure path that cannot be, a run folder that cannot (all) be deleted. Each runs the real CLI
in-process (typer's CliRunner) on run folders written through RunStore."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crf import layout
from crf.launcher.cli import app
from crf.spec import RunSpec
from crf.store import RunStore

RUN = "r1"


def crf(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def one_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert "Traceback" not in out and "[Errno" not in out, out
    return lines[0]


def make_run(base: Path, run_id: str = RUN, status: str | None = "ok", rounds: int = 0) -> RunStore:
    """A run folder as a finished run leaves it: run.json, ``rounds`` rounds of metrics per
    replica, result.json with ``status`` (none: a run nobody gathered)."""
    store = RunStore((base / run_id).as_uri())
    spec = RunSpec(run_id=run_id, run_uri=store.uri, replicas=2, sync_every=2, rounds=2)
    store.put(layout.RUN_SPEC, spec.validate().to_json().encode())
    for rank in range(2):
        for r in range(rounds):
            store.put_json(layout.metrics_key(rank, r), {"round": r, "rank": rank,
                           "committed": True, "loss": 1.0 / (r + 1), "metrics": {}})  # fmt: skip
    if status is not None:
        store.put_json(layout.RESULT, {"status": status, "launch": 0})
    return store


# ------------------------------------------------------------------ store URLs
TYPOS = [
    ("s3:/mybucket/runs", "did you mean s3://mybucket/runs?"),
    ("gs:/mybucket/runs", "did you mean gs://mybucket/runs?"),
    ("hf:/my-org/runs", "did you mean hf://my-org/runs?"),
    ("S3:mybucket", "did you mean s3://mybucket?"),
    ("S3://mybucket/runs", "did you mean s3://mybucket/runs?"),
    ("s3://", "names no bucket: write s3://BUCKET/PREFIX"),
    ("s3:///runs", "names no bucket"),
    ("gs://my bucket/runs", "'my bucket' is not a bucket name (it holds ' ')"),
    ("file:relative", "did you mean a plain path (relative)"),
    ("file:/abs/runs", "did you mean file:///abs/runs?"),
    ("memory:/x", "did you mean memory://x?"),
    (" ", "the store is blank"),
    ("", "the store is blank"),
]
COMMANDS = [
    ("runs",),
    ("status", RUN),
    ("logs", RUN),
    ("rm", RUN, "-y"),
    ("cancel", RUN),
    ("export", RUN, "out"),
    ("plot", RUN),
    ("launch", "--resume", RUN),
    ("launch", "--job", "lm", "-n", "2", "-H", "2", "--rounds", "1", "--dry-run"),
    ("launch", "--job", "lm", "--print-config"),
]


@pytest.mark.parametrize(("store", "says"), TYPOS)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_store_url_with_a_typo_is_refused_by_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...], store: str, says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = crf(*command, "--store", store)
    assert code == 2, out
    assert says in one_line(out)
    assert os.listdir(tmp_path) == []  # no folder named s3: (or ./crf-runs) appeared


@pytest.mark.parametrize(
    ("store", "says"),
    [
        ("notes.txt", "--store notes.txt is a file, not a folder: give the folder that holds"),
        ("notes.txt/runs", "--store notes.txt/runs: {tmp}/notes.txt is a file, not a folder"),
        ("gone", "--store gone is a symbolic link to {tmp}/nowhere, which does not exist"),
    ],
    ids=["a file", "under a file", "a broken link"],
)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_store_that_is_a_file_is_refused_by_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...], store: str, says: str
) -> None:
    """A --store that is a file (or lies under one) holds no runs: every command says that
    in one line, rather than that the store holds no runs or no such run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a store\n")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    code, out = crf(*command, "--store", store)
    assert code == 2, out
    assert says.format(tmp=tmp_path) in one_line(out)
    assert sorted(os.listdir(tmp_path)) == ["gone", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "not a store\n"


def test_the_sdk_refuses_a_store_that_is_a_file(tmp_path: Path) -> None:
    import crf as sdk
    from crf.launcher.errors import LaunchError

    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(LaunchError, match="notes.txt is a file, not a folder"):
        sdk.runs(store=str(tmp_path / "notes.txt"))
    with pytest.raises(LaunchError, match="notes.txt is a file, not a folder"):
        sdk.attach(RUN, store=str(tmp_path / "notes.txt" / "runs")).status()


@pytest.mark.parametrize("store", ["./s3:/mybucket", "/tmp/a:b", "runs"])
def test_a_local_folder_with_a_colon_is_still_a_folder(tmp_path: Path, store: str) -> None:
    from crf.store import normalize_uri

    assert normalize_uri(store).startswith("file:///")


def test_the_sdk_refuses_the_same_store_urls(tmp_path: Path) -> None:
    import crf as sdk
    from crf.launcher.errors import LaunchError

    with pytest.raises(LaunchError, match="did you mean s3://b/runs"):
        sdk.runs(store="s3:/b/runs")
    with pytest.raises(LaunchError, match="blank"):
        sdk.attach(RUN, store=" ")


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYsecret"


@pytest.mark.parametrize(
    "command",
    [
        ("launch", "--job", "lm", "-n", "2", "-H", "2", "--rounds", "1", "--dry-run"),
        ("launch", "--job", "lm", "--print-config"),
        ("runs",),
        ("status", RUN),
        ("rm", RUN, "-y"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_credentials_in_a_store_url_are_refused_and_never_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = crf(*command, "--store", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs")
    assert code == 2, out
    line = one_line(out)
    assert "holds credentials" in line and "environment or a profile" in line
    assert SECRET not in out and "AKIAEXAMPLE" not in out


# ------------------------------------------------------------------ crf export DEST
@pytest.mark.parametrize(
    ("dest", "says"),
    [
        ("s3://my-bucket/models/x", "DEST s3://... is not a destination crf export writes to"),
        ("gs://my-bucket/models/x", "DEST gs://... is not a destination crf export writes to"),
        ("hf:/my-org/my-model", "did you mean hf://my-org/my-model?"),
        ("s3:/my-bucket/x", "did you mean s3://my-bucket/x?"),
        ("hf://only-a-name", "a Hub destination is hf://ORG/NAME"),
        ("", "DEST is empty"),
        (" ", "DEST is empty"),
        ("afile", "DEST afile exists and is not a folder"),
        ("afile/sub", "afile is a file, not a folder"),
        ("full", "DEST full is not empty"),
    ],
)
def test_export_refuses_a_destination_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dest: str, says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "runs")
    (tmp_path / "afile").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out = crf("export", RUN, dest, "--store", str(tmp_path / "runs"))
    assert code == 2, out
    assert says in one_line(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ------------------------------------------------------------------ crf rm
def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_rm_refuses_a_run_folder_that_is_a_symlink(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    make_run(tmp_path / "elsewhere", "lnk")
    base.mkdir()
    (base / "lnk").symlink_to(tmp_path / "elsewhere" / "lnk")
    code, out = crf("rm", "lnk", "--store", str(base), "-y")
    assert code == 2, out
    line = one_line(out)
    assert "is a symbolic link to" in line and "delete the link or its target yourself" in line
    assert (base / "lnk").is_symlink() and (tmp_path / "elsewhere" / "lnk" / "run.json").is_file()


def _freeze(path: Path) -> bool:
    """Make ``path``'s entries undeletable (root: chattr +i, where the file system allows it;
    anyone else: no write permission); False where neither works here."""
    import subprocess

    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    return done.returncode == 0


def _thaw(path: Path) -> None:
    import subprocess

    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    else:
        path.chmod(0o755)


def test_rm_deletes_nothing_when_a_folder_in_the_run_refuses_deletes(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    store = make_run(base, rounds=1)
    store.put(layout.FIGURE, b"png")
    frozen = base / RUN / "metrics" / "0"
    if not _freeze(frozen):
        pytest.skip("neither chattr nor permissions can refuse a delete here")
    try:
        before = _files(base / RUN)
        code, out = crf("rm", RUN, "--store", str(base), "-y")
        assert code == 2, out
        line = one_line(out)
        assert str(frozen) in line and "nothing was deleted" in line
        assert _files(base / RUN) == before  # figure.png and result.json too
        code, out = crf("runs", "--store", str(base), "--json")
        assert code == 0 and '"ok"' in out
    finally:
        _thaw(frozen)


def test_rm_that_fails_part_way_says_what_and_how_much_was_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that refuses a delete after some objects are gone (no pre-check can foresee
    every refusal): one line with the object, why, and the count, counted again."""
    from fsspec.implementations.local import LocalFileSystem

    base = tmp_path / "runs"
    store = make_run(base, rounds=1)
    store.put(layout.FIGURE, b"png")
    total = len(_files(base / RUN))

    def rm(self: LocalFileSystem, path: str, recursive: bool = False, maxdepth=None) -> None:
        figure = os.path.join(path, layout.FIGURE)
        if os.path.exists(figure):  # one object goes, then a refusal (each time it is tried)
            os.unlink(figure)
        blocked = os.path.join(path, layout.RESULT)
        raise PermissionError(1, "Operation not permitted", blocked)

    monkeypatch.setattr(LocalFileSystem, "rm", rm)
    code, out = crf("rm", RUN, "--store", str(base), "-y")
    assert code == 2, out
    line = one_line(out)
    assert f"{base / RUN / layout.RESULT}: Operation not permitted" in line
    assert f"1 of {total} object(s) deleted, {total - 1} left" in line
    assert "deleted run" not in out


# ------------------------------------------------------------------ crf plot
@pytest.mark.parametrize(
    ("suffix", "magic"),
    [(".png", b"\x89PNG"), (".jpg", b"\xff\xd8"), (".jpeg", b"\xff\xd8"), (".pdf", b"%PDF"),
     (".svg", b"<?xml")],
)  # fmt: skip
def test_plot_writes_the_format_its_suffix_names(tmp_path: Path, suffix: str, magic: bytes) -> None:
    make_run(tmp_path / "runs", rounds=2)
    out = tmp_path / f"fig{suffix}"
    code, text = crf("plot", RUN, "--store", str(tmp_path / "runs"), "-o", str(out))
    assert code == 0, text
    assert out.read_bytes().startswith(magic)


@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("fig", "--out fig has no suffix: name a .png, .jpg, .jpeg, .pdf, .svg file"),
        ("fig.gif", "--out fig.gif ends in .gif"),
        ("adir", "--out adir is a folder: give a file name in it (adir/figure.png)"),
        ("nodir/x.png", "--out nodir/x.png: folder nodir does not exist: create it first"),
        ("afile/x.png", "afile is a file, not a folder"),
    ],
)
def test_plot_refuses_an_out_path_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    store = make_run(tmp_path / "runs", rounds=2)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    code, text = crf("plot", RUN, "--store", str(tmp_path / "runs"), "-o", out)
    assert code == 2, text
    assert says in one_line(text)
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile", "runs"]
    assert not store.exists(layout.FIGURE)


def test_plot_of_an_unwritable_out_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path as P

    make_run(tmp_path / "runs", rounds=2)

    def refuse(self: P, data: bytes) -> int:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(P, "write_bytes", refuse)
    code, text = crf("plot", RUN, "--store", str(tmp_path / "runs"), "-o", str(tmp_path / "f.png"))
    assert code == 2
    assert one_line(text) == f"error: --out: {tmp_path / 'f.png'}: Permission denied"


@pytest.mark.parametrize(
    ("status", "says", "code"),
    [
        ("failed", f"run {RUN} ended (status: failed) before recording any round: there is "
         "nothing to plot", 1),
        ("cancelled", "ended (status: cancelled) before recording any round", 1),
        (None, "ended (status: stopped) before recording any round", 1),
    ],
)  # fmt: skip
def test_plot_of_a_run_that_ended_before_any_round_says_so(
    tmp_path: Path, status: str | None, says: str, code: int
) -> None:
    make_run(tmp_path / "runs", status=status)
    got, text = crf("plot", RUN, "--store", str(tmp_path / "runs"))
    assert got == code
    line = one_line(text)
    assert says in line and "try again later" not in line


# ------------------------------------------------------------------ crf launch
LAUNCH = ("launch", "--backend", "local", "--job", "lm", "-n", "2", "-H", "2", "--rounds", "1")


@pytest.mark.parametrize(
    ("status", "says"),
    [
        ("ok", "choose another --run-id (it cannot be resumed: run r1 already finished"),
        ("damaged", "choose another --run-id (it cannot be resumed: "),
        ("failed", "choose another --run-id, or continue it with --resume r1"),
        (None, "choose another --run-id, or continue it with --resume r1"),
    ],
)
def test_a_launch_into_an_existing_run_suggests_resume_only_when_it_would_be_accepted(
    tmp_path: Path, status: str | None, says: str
) -> None:
    base = tmp_path / "runs"
    store = make_run(base, status=None if status == "damaged" else status)
    if status == "damaged":
        store.put(layout.RUN_SPEC, b"{not json")
    code, out = crf(*LAUNCH, "--store", str(base), "--run-id", RUN, "--dry-run")
    assert code == 2, out
    line = one_line(out)
    assert "already holds a run" in line and says in line
    if "--resume" in says:  # and a resume is indeed not refused for being finished/damaged
        code, out = crf("launch", "--resume", RUN, "--store", str(base), "--dry-run")
        assert "already finished" not in out and "damaged" not in out, out


def test_workdir_that_is_a_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "code.py").write_text("")
    code, out = crf(*LAUNCH, "--store", str(tmp_path / "runs"), "--workdir",
                    str(tmp_path / "code.py"), "--dry-run")  # fmt: skip
    assert code == 2, out
    assert "is a file: --workdir takes a folder" in one_line(out)


@pytest.mark.parametrize("how", ["--dry-run", "--print-config"])
@pytest.mark.parametrize(
    "name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "OPENAI_KEY", "JUDGE_KEY",
             "DB_PASS", "GITHUB_AUTH", "SERVICE_CREDENTIALS"],
)  # fmt: skip
def test_a_credential_in_env_is_refused_and_not_written(
    tmp_path: Path, name: str, how: str
) -> None:
    code, out = crf(*LAUNCH, "--store", str(tmp_path / "runs"), "--env",
                    f"{name}=hf_value_never_printed", how)  # fmt: skip
    assert code == 2, out
    assert f"pass it with --secret {name}" in one_line(out)
    assert "hf_value_never_printed" not in out and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ("https://me:pw-never-printed@judge.example.com/score", "a URL with a password"),
        ("postgres://app:pw-never-printed@db:5432/rl", "a URL with a password"),
        ("sk-proj-" + "pw_never_printed" * 2, "an OpenAI or Anthropic key"),
        ("hf_" + "PwNeverPrinted" * 3, "a Hugging Face token"),
        ("ghp_" + "PwNeverPrinted" * 3, "a GitHub token"),
    ],
)
def test_a_credential_value_in_env_is_refused_whatever_its_name(
    tmp_path: Path, value: str, what: str
) -> None:
    """A judge's URL with its password, or a key under a name that does not say so: the
    value would be written in run.json all the same."""
    code, out = crf(*LAUNCH, "--store", str(tmp_path / "runs"), "--env", f"JUDGE={value}",
                    "--dry-run")  # fmt: skip
    assert code == 2, out
    assert f"--env JUDGE: its value, {what}, would be written in run.json" in one_line(out)
    assert "ever_printed" not in out.lower() and not (tmp_path / "runs").exists()


def test_plain_env_is_still_accepted(tmp_path: Path) -> None:
    code, out = crf(*LAUNCH, "--store", str(tmp_path / "runs"), "--env", "WANDB_PROJECT=grpo",
                    "--env", "TOKENIZERS_PARALLELISM=false", "--env", "JUDGE_URL=https://j.example.com/v1",
                    "--env", "KEYWORDS=a,b", "--dry-run")  # fmt: skip
    assert code == 0, out


@pytest.mark.parametrize(
    ("given", "warned"),
    [({}, True), ({"WANDB_API_KEY": "k" * 40}, False), ({"WANDB_MODE": "offline"}, False),
     ({"netrc": "machine api.wandb.ai login user password " + "k" * 40}, False)],
)  # fmt: skip
def test_wandb_on_the_local_backend_without_a_key_is_warned_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: dict[str, str], warned: bool
) -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        pytest.skip("--report-to wandb needs the wandb package")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    for var, value in given.items():
        if var == "netrc":
            netrc.write_text(value + "\n")
            netrc.chmod(0o600)
        else:
            monkeypatch.setenv(var, value)
    code, out = crf(*LAUNCH, "--store", str(tmp_path / "runs"), "--report-to", "wandb",
                    "--dry-run")  # fmt: skip
    assert code == 0, out
    assert ("WANDB_API_KEY is not set here" in " ".join(out.split())) == warned, out
