"""gs:// run stores through gcsfs against gcp-storage-emulator on 127.0.0.1 (no GCP).

The emulator ignores ``ifGenerationMatch``; tests/cloud_servers.py adds the 412 real GCS
returns, and records every precondition it receives so the tests below also prove that our
writer sends ``ifGenerationMatch=0`` on creates (and nothing on plain puts).
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

from crf.store import RunStore, StoreNotWritable, StoreTimeout
from tests import cloud_servers
from tests.cloud_servers import (
    GcsEmulator,
    check_allreduce,
    check_basic_ops,
    check_single_winner,
    gcs_options,
)

gcs_emulator = cloud_servers.gcs_emulator  # the fixtures, visible to this module's tests
gcs_env = cloud_servers.gcs_env

# gcsfs must not be imported before gcs_env has set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
if importlib.util.find_spec("gcsfs") is None:
    pytest.skip("gcs tests need the gcs extra: pip install -e .[dev]", allow_module_level=True)


@pytest.fixture
def bucket(gcs_env: GcsEmulator) -> str:
    return gcs_env.new_bucket()


def store_for(uri: str, fresh: bool = False) -> RunStore:
    extra = {"skip_instance_cache": True} if fresh else {}
    return RunStore(uri, storage_options=gcs_options(**extra))


def test_put_get_list_delete(bucket: str) -> None:
    store = store_for(f"gs://{bucket}/crf/run1")
    check_basic_ops(store)
    store.check_writable()


def test_gcs_scheme_alias(bucket: str) -> None:
    store = store_for(f"gcs://{bucket}/run")
    assert store.put_if_absent("k", b"1") is True
    assert store_for(f"gs://{bucket}/run").get("k") == b"1"


def test_put_if_absent_sends_generation_precondition(bucket: str, gcs_env: GcsEmulator) -> None:
    store = store_for(f"gs://{bucket}/run")
    gcs_env.preconditions.clear()
    store.put("plain", b"x")
    assert gcs_env.preconditions == []  # a plain put overwrites: no precondition
    assert store.put_if_absent("q", b"first") is True
    assert gcs_env.preconditions == [("run/q", "0")]
    assert store.put_if_absent("q", b"second") is False  # 412 from the server
    assert store.get("q") == b"first"
    info = store.fs.info(f"{bucket}/run/q")
    assert len(info["metadata"]["crf-writer"]) == 32  # the creator's token


def test_put_if_absent_one_winner_among_threads(bucket: str) -> None:
    check_single_winner([store_for(f"gs://{bucket}/run")])


def test_put_if_absent_one_winner_among_clients(bucket: str) -> None:
    check_single_winner([store_for(f"gs://{bucket}/run", fresh=True) for _ in range(3)])


def test_put_if_absent_resumable_upload(bucket: str, gcs_env: GcsEmulator, monkeypatch) -> None:
    import crf.store.gcs as gcs

    monkeypatch.setattr(gcs, "UPLOAD_CHUNKSIZE", 256 * 2**10)  # gcsfs needs multiples of 256 KiB
    big = bytes(range(256)) * 3000  # 750 KiB: a resumable upload in three chunks
    store = store_for(f"gs://{bucket}/run")
    assert store.put_if_absent("big", big) is True
    assert store.put_if_absent("big", big[::-1]) is False
    assert store.get("big") == big


def test_create_retried_after_a_lost_response_still_wins(bucket: str, monkeypatch) -> None:
    store = store_for(f"gs://{bucket}/run", fresh=True)
    real = store.fs.pipe_file
    lost = []

    def flaky(path, data, **kw):
        real(path, data, **kw)
        if not lost:
            lost.append(path)
            raise ConnectionResetError("connection reset after the upload")

    monkeypatch.setattr(store.fs, "pipe_file", flaky)
    assert store.put_if_absent("q", b"mine") is True
    assert lost and store.get("q") == b"mine"
    assert store.put_if_absent("q", b"other") is False


def test_second_client_sees_new_objects(bucket: str) -> None:
    uri = f"gs://{bucket}/run"
    reader, writer = store_for(uri, fresh=True), store_for(uri, fresh=True)
    assert reader.list("rounds/0") == [] and not reader.exists("rounds/0/a")
    writer.put("rounds/0/a", b"1")
    assert reader.list("rounds/0") == ["a"] and reader.exists("rounds/0/a")
    writer.put("rounds/0/b", b"2")
    assert reader.list("rounds/0") == ["a", "b"]
    writer.delete("rounds/0/a")
    assert reader.list("rounds/0") == ["b"] and not reader.exists("rounds/0/a")


def test_wait_for(bucket: str) -> None:
    uri = f"gs://{bucket}/run"
    reader, writer = store_for(uri, fresh=True), store_for(uri)
    t = threading.Timer(0.3, lambda: [writer.put(k, b"x") for k in ("w/1", "w/2")])
    t.start()
    t0 = time.monotonic()
    reader.wait_for(["w/1", "w/2"], timeout_s=20)
    assert time.monotonic() - t0 < 15
    t.join()
    with pytest.raises(StoreTimeout, match="w/3"):
        reader.wait_for(["w/1", "w/3"], timeout_s=0.3)


def test_check_writable_missing_bucket(gcs_env: GcsEmulator) -> None:
    store = store_for("gs://crf-no-such-bucket/run", fresh=True)
    with pytest.raises(StoreNotWritable, match=r"not found.*create it"):
        store.check_writable()


def test_check_writable_auth_and_network_errors(bucket: str, monkeypatch) -> None:
    """What gcsfs raises without credentials (401), without permission (403) or without a
    reachable endpoint. The emulator authenticates nobody, and gcsfs retries a refused
    connection 6 times over ~30 s, so these errors are injected at gcsfs's pipe_file."""
    import aiohttp
    import gcsfs.retry

    store = RunStore(
        f"gs://{bucket}/run", storage_options=gcs_options(skip_instance_cache=True), retries=0
    )
    cases = [
        (gcsfs.retry.HttpError({"code": 401, "message": "Anonymous caller"}), "not authent"),
        (OSError(f"Forbidden: {bucket}/run\nno storage.objects.create"), "access denied"),
        (aiohttp.ClientConnectionError("Cannot connect to host"), "cannot reach the GCS"),
    ]
    for error, match in cases:

        def refuse(*a, _error=error, **kw):
            raise _error

        monkeypatch.setattr(store.fs, "pipe_file", refuse)
        with pytest.raises(StoreNotWritable, match=match):
            store.check_writable()


def test_allreduce_over_gcs(bucket: str) -> None:
    check_allreduce(store_for(f"gs://{bucket}/crf/ar"))


def test_a_misspelt_bucket_is_named_by_crf_runs(gcs_env: GcsEmulator) -> None:
    """crf runs in a GCS bucket that does not exist names the bucket (it said 'no runs')."""
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    result = CliRunner().invoke(app, ["runs", "--store", "gs://crf-no-such-bucket/runs"])
    assert result.exit_code == 2, result.output
    assert "bucket gs://crf-no-such-bucket does not exist" in " ".join(result.output.split())


def test_a_down_endpoint_is_named_without_a_request(gcs_env: GcsEmulator, monkeypatch) -> None:
    """crf runs against an emulator address nothing listens on says so at once: it made no
    request (each would be retried by gcsfs for ~17 s). A replica's store (more retries)
    opens as before and leaves an endpoint that is down for a while to its retries."""
    import socket

    import gcsfs
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")

    def no_request(*a, **kw):
        raise AssertionError("a request was made")

    monkeypatch.setattr(gcsfs.GCSFileSystem, "_call", no_request)
    result = CliRunner().invoke(app, ["runs", "--store", "gs://crf-down/runs"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert (
        f"cannot reach the GCS endpoint for gs://crf-down (endpoint: http://127.0.0.1:{port})"
        in line
    )
    assert "Traceback" not in result.output
    RunStore("gs://crf-down/run", storage_options=gcs_options(skip_instance_cache=True))
