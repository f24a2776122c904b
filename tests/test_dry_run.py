"""`crf launch --dry-run` for someone without an account: the plan and its price, then the
list of what is missing (exit 0; exit 2 with --strict), and a custom entrypoint's labels.

Every credential variable is cleared and HOME points at an empty folder, so no config file
(~/.modal.toml, ~/.aws, ~/.cache/huggingface/token) is found either. The CLI runs in-process
(typer's CliRunner): nothing here starts a replica or reaches a network.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from crf.launcher.cli import app

CREDENTIAL_VARS = (
    "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_PROFILE", "HF_TOKEN", "HF_TOKEN_PATH",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "GOOGLE_APPLICATION_CREDENTIALS", "CRF_SAGEMAKER_ROLE_ARN",
)  # fmt: skip


@pytest.fixture
def no_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No credential in the environment and an empty HOME; the working directory is a fresh
    folder (the default store ./crf-runs lands there)."""
    for var in CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / ".aws" / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / ".aws" / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role probe
    monkeypatch.setenv("COLUMNS", "200")
    try:  # the modal client read ~/.modal.toml when it was first imported
        import modal.config

        monkeypatch.setattr(modal.config, "_user_config", {})
    except ImportError:
        pass
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def crf(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, " ".join(result.output.split())  # wrapped lines joined


def missing_list(out: str) -> str:
    assert "missing before this run can launch" in out, out
    return out.split("missing before this run can launch", 1)[1]


@pytest.mark.parametrize(
    ("backend", "price", "wanted"),
    [
        (
            "modal",
            "/h for 4",
            ["no Modal credentials", "modal token new", "MODAL_TOKEN_ID/MODAL_TOKEN_SECRET",
             "use an object store: --store s3://"],
        ),
        (
            "hf",
            "$0.04/h for 4",
            ["no Hugging Face token", "HF_TOKEN", "hf auth login", "use an object store"],
        ),
        (
            "sagemaker",
            "/h for 4",
            ["IAM execution role", "-o role_arn=", "no AWS region", "--region",
             "no AWS credentials for SageMaker", "AWS_ACCESS_KEY_ID", "aws configure",
             "-o output_path=s3://"],
        ),
    ],
)  # fmt: skip
def test_dry_run_without_an_account_shows_plan_price_and_what_is_missing(
    no_account: Path, backend: str, price: str, wanted: list[str]
) -> None:
    code, out = crf("launch", "--backend", backend, "--replicas", "4", "--dry-run")
    assert code == 0, out
    assert "Traceback" not in out and "error:" not in out
    for row in ("backend", "replicas", "where", "hardware", "cost"):  # the plan
        assert f"│ {row}" in out, row
    assert f"│ {backend} " in out and price in out  # the price, from crf's catalog
    listed = missing_list(out)
    for text in wanted:
        assert text in listed, text
    assert "nothing was launched or written" in out
    assert not (no_account / "crf-runs").exists()

    code, strict = crf("launch", "--backend", backend, "--replicas", "4", "--dry-run", "--strict")
    assert code == 2, strict
    for text in wanted:  # the same list, and the same plan before it
        assert text in missing_list(strict), text


def test_an_aws_profile_that_does_not_exist_is_named(
    no_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS_PROFILE naming no profile is said as such (it was 'no AWS credentials: set
    AWS_ACCESS_KEY_ID ...', though the user had chosen a profile)."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_PROFILE", "nosuchprofile")
    code, out = crf("launch", "--backend", "modal", "--store", "s3://crf-bucket/runs", "--dry-run")
    assert code == 0, out
    listed = missing_list(out)
    assert "AWS_PROFILE=nosuchprofile names no profile in ~/.aws/config" in listed
    assert "aws configure --profile nosuchprofile" in listed


def test_a_google_credentials_file_that_is_no_key_is_named(
    no_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GOOGLE_APPLICATION_CREDENTIALS pointing at a file that is no credentials JSON is
    refused at once, without quoting it; gcsfs fell back to anonymous access and the launch
    failed half a minute later with an endpoint it 'cannot reach'."""
    key = no_account / "key.json"
    key.write_text("PRIVATE-notjson-0123\n")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    code, out = crf("launch", "--backend", "modal", "--store", "gs://crf-bucket/runs", "--dry-run")
    assert code == 0, out
    listed = missing_list(out)
    assert f"GOOGLE_APPLICATION_CREDENTIALS={key} is not a Google credentials file" in listed
    assert "PRIVATE-notjson" not in out


def test_s3_store_without_credentials_is_listed(no_account: Path) -> None:
    pytest.importorskip("s3fs")
    args = ("launch", "--job", "lm", "--store", "s3://crf-bucket/runs", "--dry-run")
    code, out = crf(*args)
    assert code == 0, out
    assert "│ store" in out and "s3://crf-bucket/runs/" in out and "free (this machine)" in out
    listed = missing_list(out)
    assert "no AWS credentials for s3://crf-bucket/runs/" in listed
    assert "AWS_ACCESS_KEY_ID" in listed and "aws configure" in listed
    assert listed.count("no AWS credentials") == 1  # said once, not again by the store probe
    code, out = crf(*args, "--strict")
    assert code == 2 and "no AWS credentials" in out


def test_a_complete_local_setup_lists_nothing(no_account: Path) -> None:
    code, out = crf("launch", "--job", "lm", "--dry-run", "--strict")
    assert code == 0, out
    assert "nothing missing" in out and "missing before" not in out


def test_bad_input_still_stops_a_dry_run(no_account: Path) -> None:
    """A misspelt GPU name is no missing account: one error line, exit 2, as for a launch."""
    pytest.importorskip("modal")
    code, out = crf("launch", "--backend", "modal", "--gpu", "A10X", "--dry-run")
    assert code == 2 and "unknown Modal GPU 'A10X'" in out and "│" not in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--backend", "modal", "--device", "cuda"],
         "--device cuda needs a CUDA GPU, and the modal backend's hardware (CPU only) has "
         "none: choose GPU hardware (--hardware), or use --device auto"),
        (["--backend", "modal", "--precision", "fp16"],
         "--precision fp16 needs a CUDA GPU, and the modal backend's hardware (CPU only)"),
        (["--backend", "modal", "--gpu", "T4", "--precision", "bf16"],
         "--precision bf16, but the modal backend's hardware (T4) has a GPU older than "
         "Ampere"),
        (["--backend", "hf", "--flavor", "t4-small", "--precision", "bf16"],
         "the hf backend's hardware (t4-small) has a GPU older than Ampere"),
        (["--backend", "sagemaker", "--instance-type", "ml.p3.2xlarge", "--precision", "bf16"],
         "the sagemaker backend's hardware (ml.p3.2xlarge) has a GPU older than Ampere"),
        (["--backend", "sagemaker", "--instance-type", "ml.m5.xlarge", "--device", "cuda"],
         "the sagemaker backend's hardware (ml.m5.xlarge) has none"),
        (["--backend", "modal", "--rollout-workers", "2", "--rollout-hardware", "T4",
          "--gpu", "A10G", "--precision", "bf16"],
         "rollout workers: --precision bf16, but the modal backend's hardware (T4)"),
    ],
    ids=["modal-cuda-no-gpu", "modal-fp16-no-gpu", "modal-t4-bf16", "hf-t4-bf16",
         "sagemaker-v100-bf16", "sagemaker-cpu-cuda", "workers-t4-bf16"],
)  # fmt: skip
def test_a_device_or_precision_the_hardware_cannot_do_stops_the_launch(
    no_account: Path, args: list[str], says: str
) -> None:
    """The replicas would refuse it at setup, each after its start (crf.replica.model): the
    backend's hardware option already says, so the launch stops in one line before."""
    for module in {"modal": "modal", "hf": "huggingface_hub", "sagemaker": "boto3"}.values():
        pytest.importorskip(module)
    code, out = crf("launch", *args, "--store", "s3://bucket/runs", "--dry-run")
    assert code == 2 and says in out and "│" not in out, out


def test_local_replicas_are_checked_against_this_machine(no_account: Path) -> None:
    """Local replicas run here: --device cuda and fp16 need this machine's CUDA GPU."""
    import torch

    for args, what in ((["--device", "cuda"], "--device cuda"),
                       (["--precision", "fp16"], "--precision fp16")):  # fmt: skip
        code, out = crf("launch", "--job", "lm", *args, "--dry-run")
        if torch.cuda.is_available():
            assert code == 0, out
        else:
            said = f"{what} needs a CUDA GPU, and this machine (where the local replicas run)"
            assert code == 2 and said in out, out


def test_what_the_hardware_can_do_is_launched(no_account: Path) -> None:
    """fp16 on a T4, bf16 on an A10G and a model of its own on a CPU backend pass."""
    pytest.importorskip("modal")
    for args in (["--gpu", "T4", "--precision", "fp16"], ["--gpu", "A10G", "--precision", "bf16"],
                 ["--device", "cpu", "--precision", "bf16"], ["--gpu", "T4"]):  # fmt: skip
        code, out = crf("launch", "--backend", "modal", *args, "--store", "s3://b/runs",
                        "--dry-run")  # fmt: skip
        assert code == 0, (args, out)


def test_continuous_batching_is_judged_on_the_backends_gpu(no_account: Path) -> None:
    """TRL's continuous batching needs fp32 training. Under --precision auto that is so on a
    T4 (no bfloat16 of its own: auto is fp32 there) and not on an A10G: the launch is
    refused only on the A10G (on a transformers too old for the path, both name that)."""
    pytest.importorskip("modal")
    from packaging.version import Version

    from crf.replica.trl_settings import CONTINUOUS_BATCHING_TRANSFORMERS
    from crf.versions import distribution_version

    served = Version(distribution_version("transformers") or "0") >= Version(
        CONTINUOUS_BATCHING_TRANSFORMERS
    )
    cb = ("--set", "trl.use_transformers_continuous_batching=true")
    for gpu, ok in (("T4", True), ("A10G", False)):
        code, out = crf("launch", "--backend", "modal", "--gpu", gpu, *cb,
                        "--store", "s3://b/runs", "--dry-run")  # fmt: skip
        if not served:
            assert code == 2 and "needs transformers>=" in out, (gpu, out)
        elif ok:
            assert code == 0, (gpu, out)
        else:
            assert code == 2 and "auto (bf16 on a GPU)" in out and "│" not in out, out


def test_without_dry_run_the_first_missing_credential_stops_the_launch(no_account: Path) -> None:
    code, out = crf("launch", "--backend", "hf", "--job", "lm", "--store", "hf://buckets/me/b")
    assert code == 2 and out.startswith("error:") and "Hugging Face token" in out
    code, out = crf("launch", "--job", "lm", "--strict")
    assert code == 2 and "--strict only applies to --dry-run" in out


# --------------------------------------------------------------------------- entrypoint
def test_entrypoint_run_is_labelled_with_its_command_in_the_plan(no_account: Path) -> None:
    (no_account / "train.py").write_text("print('hi')\n")
    code, out = crf("launch", "--entrypoint", "python train.py --lr 3e-4", "--dry-run")
    assert code == 0, out
    assert "│ job │ python train.py --lr 3e-4 │" in out
    assert "composer" not in out


def test_set_with_an_entrypoint_says_how_to_pass_arguments(no_account: Path) -> None:
    (no_account / "train.py").write_text("print('hi')\n")
    code, out = crf("launch", "--entrypoint", "python train.py", "--set", "lr=3e-4", "--dry-run")
    assert code == 2
    assert out.startswith("error: --set lr=3e-4: --set configures crf's built-in jobs")
    assert "--entrypoint 'python train.py --lr 3e-4'" in out and "composer" not in out
    # with a job named, --set is that job's (in run.json, for an entrypoint that reads it)
    code, out = crf("launch", "--job", "lm", "--entrypoint", "python train.py",
                    "--set", "lr=3e-4", "--dry-run")  # fmt: skip
    assert code == 0, out
    assert "│ job │ python train.py {'lr': 0.0003} │" in out


def test_a_missing_client_library_is_listed_with_its_extra(
    no_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Modal executor is built without its client, so a dry run can still price the run
    and list the pip extra that installs the client."""
    from crf.executors import adaptors

    def not_installed(submodule: str = "") -> None:
        raise adaptors.MissingSDK("modal is not installed", name="modal")

    monkeypatch.setattr(adaptors.modal, "load", not_installed)
    code, out = crf("launch", "--backend", "modal", "--job", "lm", "--dry-run", "--strict")
    assert code == 2, out
    assert "│ cost │ $" in out
    assert (
        "the modal backend needs the modal client: pip install 'composer-replication[modal]'"
        in missing_list(out)
    )
