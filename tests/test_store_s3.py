"""s3:// run stores through s3fs against moto's S3 server on 127.0.0.1 (no AWS, no internet)."""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

import fsspec.asyn
import pytest

from crf.store import ObjectNotFound, RunStore, StoreError, StoreNotWritable, StoreTimeout
from tests import cloud_servers
from tests.cloud_servers import (
    MotoS3,
    check_allreduce,
    check_basic_ops,
    check_single_winner,
    closed_port_url,
)

moto_s3 = cloud_servers.moto_s3  # the fixtures, visible to this module's tests
s3_env = cloud_servers.s3_env

pytest.importorskip("s3fs", reason="s3 tests need the s3 extra: pip install -e .[dev]")

FRESH = {"skip_instance_cache": True}  # a client of its own, as another process would have


def spy_on_calls(store: RunStore, monkeypatch: pytest.MonkeyPatch, what: Any = None) -> list:
    """Record every S3 call the store's client makes: ``what(method, kwargs)`` (default:
    the method's name), in order."""
    calls: list = []
    real = store.fs._call_s3

    async def spy(method: str, *a: Any, **kw: Any) -> Any:
        calls.append(method if what is None else what(method, kw))
        return await real(method, *a, **kw)

    monkeypatch.setattr(store.fs, "_call_s3", spy)
    return calls


@pytest.fixture
def bucket(s3_env: MotoS3) -> str:
    return s3_env.new_bucket()


def test_put_get_list_delete(bucket: str) -> None:
    store = RunStore(f"s3://{bucket}/crf/run1")
    check_basic_ops(store)
    store.check_writable()


def test_put_if_absent_one_winner_among_threads(bucket: str) -> None:
    check_single_winner([RunStore(f"s3://{bucket}/run")])


def test_put_if_absent_one_winner_among_clients(bucket: str) -> None:
    uri = f"s3://{bucket}/run"
    check_single_winner([RunStore(uri, storage_options=FRESH) for _ in range(3)])


def test_put_if_absent_is_a_conditional_put(bucket: str, s3_env: MotoS3) -> None:
    store = RunStore(f"s3://{bucket}/run")
    assert store.put_if_absent("k", b"first") is True
    # the server refuses the second write: prove it with a raw client, outside our code
    client = s3_env.client()
    with pytest.raises(client.exceptions.ClientError, match="PreconditionFailed"):
        client.put_object(Bucket=bucket, Key="run/k", Body=b"x", IfNoneMatch="*")
    assert store.put_if_absent("k", b"second") is False
    assert store.get("k") == b"first"
    head = client.head_object(Bucket=bucket, Key="run/k")
    assert len(head["Metadata"]["crf-writer"]) == 32  # the creator's token, nothing secret


def test_put_if_absent_large_object_uses_multipart(bucket: str, monkeypatch) -> None:
    import crf.store.s3 as s3

    monkeypatch.setattr(s3, "MULTIPART_CHUNKSIZE", 5 * 2**20)  # S3's minimum part size
    big = bytes(range(256)) * (42 * 2**10)  # 10.5 MiB: three parts
    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    calls = spy_on_calls(store, monkeypatch)
    assert store.put_if_absent("big", big) is True
    assert "complete_multipart_upload" in calls and "put_object" not in calls
    calls.clear()
    assert store.put_if_absent("big", big[::-1]) is False  # IfNoneMatch on the completion
    assert "complete_multipart_upload" in calls and "abort_multipart_upload" in calls
    assert store.get("big") == big


def test_a_list_of_buffers_goes_up_unjoined(bucket: str, monkeypatch) -> None:
    """A tensor frame (header bytes + the tensor's own memory) is put as a list: the body is
    read from the buffers as one file (no joined copy), in one PUT or, above the multipart
    threshold, in parts that cut across the buffers; create-if-absent holds either way."""
    import torch

    import crf.store.s3 as s3

    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    head = b"header!" * 10
    values = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB
    parts = [head, memoryview(values.numpy()).cast("B"), b"tail"]
    whole = b"".join(bytes(p) for p in parts)
    store.put("small", parts)
    assert store.get("small") == whole
    monkeypatch.setattr(s3, "MULTIPART_CHUNKSIZE", 5 * 2**20)  # S3's minimum part size
    calls = spy_on_calls(store, monkeypatch)
    assert store.put_if_absent("big", parts) is True
    assert calls.count("upload_part") == 3 and "complete_multipart_upload" in calls
    assert store.put_if_absent("big", parts) is False
    assert store.get("big") == whole


def test_parts_body_reads_seeks_and_slices_as_one_file() -> None:
    from crf.store.s3 import PartsBody

    parts = [b"abc", b"", bytearray(b"defgh"), memoryview(b"ij")]
    body = PartsBody(parts)
    assert len(body) == 10 and body.read() == b"abcdefghij" and body.read() == b""
    body.seek(2)
    assert body.read(4) == b"cdef" and body.tell() == 6
    body.seek(-3, 2)
    assert body.read() == b"hij"
    view = body[2:7]
    assert len(view) == 5 and view.read() == b"cdefg"
    view.seek(1)
    assert view.read(10) == b"defg"
    assert body[8:100].read() == b"ij" and body[5:5].read() == b""


def test_polls_and_small_reads_are_one_request_each(bucket: str, monkeypatch) -> None:
    """The exchange polls for objects and reads shards whose size it knows: on S3 each is
    one request (fsspec alone: a HEAD before every read, and a HEAD plus a LIST for every
    object not there yet)."""
    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    store.put("k", b"v" * 1000)
    calls = spy_on_calls(store, monkeypatch)
    real_sync = store.fs.call_s3

    def spy_sync(method, *a, **kw):
        calls.append(method)
        return real_sync(method, *a, **kw)

    monkeypatch.setattr(store.fs, "call_s3", spy_sync)
    assert store.get("k", size_hint=1000) == b"v" * 1000
    assert calls == ["get_object"]
    calls.clear()
    with pytest.raises(ObjectNotFound):
        store.get("missing", size_hint=1000)
    assert calls == ["get_object"]
    calls.clear()
    assert store.object_exists("k") and not store.object_exists("missing")
    assert calls == ["head_object", "head_object"]
    calls.clear()
    store.put_json("k2", {"a": 1})
    calls.clear()
    assert store.get_json("k2") == {"a": 1}  # JSON objects are small
    assert calls == ["get_object"]
    calls.clear()
    assert store.get("k") == b"v" * 1000  # no hint: fsspec's own path
    # a GET, after a HEAD in the s3fs releases that ask for the size first
    assert calls in (["head_object", "get_object"], ["get_object"])


def test_create_retried_after_a_lost_response_still_wins(bucket: str, monkeypatch) -> None:
    """The first PUT lands but its answer is lost: the retry gets 412 and must report a win."""
    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
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
    # someone else's object is still someone else's
    assert store.put_if_absent("q", b"other") is False


def test_a_read_damaged_in_transit_is_read_again(bucket: str, monkeypatch) -> None:
    """botocore checks a body's CRC32 and raises its own FlexibleChecksumError (not an
    OSError) on a mismatch; one such read against moto under load failed a whole round. The
    object is intact: the read is tried again, and only if every try fails the caller gets
    a StoreError it handles like any other store failure. (The damage is simulated around
    the real read: moto cannot be made to garble one response on purpose.)"""
    from botocore.exceptions import FlexibleChecksumError

    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH, retry_backoff_s=0.01)
    store.put("shard", b"x" * 1000)
    real = store.fs.cat_file
    damaged = []

    def garbled(path, **kw):
        data = real(path, **kw)
        if len(damaged) < 2:
            damaged.append(path)
            raise FlexibleChecksumError(error_msg="Expected checksum A did not match B")
        return data

    monkeypatch.setattr(store.fs, "cat_file", garbled)
    assert store.get("shard") == b"x" * 1000 and len(damaged) == 2

    def always(path, **kw):
        real(path, **kw)
        raise FlexibleChecksumError(error_msg="Expected checksum A did not match B")

    monkeypatch.setattr(store.fs, "cat_file", always)
    with pytest.raises(StoreError, match="FlexibleChecksumError on every one of 5 tries"):
        store.get("shard")


def test_second_client_sees_new_objects(bucket: str) -> None:
    """No stale listing cache: objects written by another client show up in list/exists."""
    uri = f"s3://{bucket}/run"
    reader, writer = RunStore(uri, storage_options=FRESH), RunStore(uri, storage_options=FRESH)
    assert reader.list("rounds/0") == [] and not reader.exists("rounds/0/a")
    writer.put("rounds/0/a", b"1")
    assert reader.list("rounds/0") == ["a"] and reader.exists("rounds/0/a")
    writer.put("rounds/0/b", b"2")
    assert reader.list("rounds/0") == ["a", "b"]
    writer.delete("rounds/0/a")
    assert reader.list("rounds/0") == ["b"] and not reader.exists("rounds/0/a")


def test_wait_for(bucket: str) -> None:
    uri = f"s3://{bucket}/run"
    reader, writer = RunStore(uri, storage_options=FRESH), RunStore(uri)
    t = threading.Timer(0.3, lambda: [writer.put(k, b"x") for k in ("w/1", "w/2")])
    t.start()
    t0 = time.monotonic()
    reader.wait_for(["w/1", "w/2"], timeout_s=20)
    assert time.monotonic() - t0 < 15
    t.join()
    with pytest.raises(StoreTimeout, match="w/3"):
        reader.wait_for(["w/1", "w/3"], timeout_s=0.3)


def test_check_writable_missing_bucket(s3_env: MotoS3) -> None:
    store = RunStore("s3://crf-no-such-bucket/run", storage_options=FRESH)
    with pytest.raises(StoreNotWritable, match=r"does not exist.*create it"):
        store.check_writable()


def test_check_writable_without_credentials(s3_env: MotoS3, monkeypatch, bucket: str) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    with pytest.raises(StoreNotWritable, match="no usable AWS credentials.*AWS_ACCESS_KEY_ID"):
        store.check_writable()


def test_check_writable_wrong_endpoint(s3_env: MotoS3, monkeypatch) -> None:
    secret = "crfSECRETvalue0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed_port_url())
    fast = {**FRESH, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = RunStore("s3://crf-bucket/run", storage_options=fast, retries=0)
    store.fs.retries = 1  # s3fs's own retry loop (class default 5): keep the test fast
    with pytest.raises(StoreNotWritable, match="cannot reach the S3 endpoint") as exc:
        store.check_writable()
    assert secret not in str(exc.value)


def test_an_endpoint_without_its_scheme_is_named(s3_env: MotoS3, monkeypatch) -> None:
    """AWS_ENDPOINT_URL=host:port (no http://) is said in one line that names it; it was
    botocore's bare ValueError ('Invalid endpoint'), reported as a store to check."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    store = RunStore("s3://crf-bucket/run", storage_options=FRESH, retries=0)
    with pytest.raises(StoreNotWritable, match=r"'127.0.0.1:9000' is not a URL.*http://127"):
        store.check_writable()


def test_allreduce_over_s3(bucket: str) -> None:
    check_allreduce(RunStore(f"s3://{bucket}/crf/ar"))


def test_ranged_reads_are_one_get_with_a_range(bucket: str, monkeypatch) -> None:
    """``get_range`` is one GET with an HTTP Range header (no HEAD first), shorter at the end
    of the object, and a missing object is ObjectNotFound."""
    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    store.put("k", bytes(range(256)) * 4)
    calls = spy_on_calls(store, monkeypatch, lambda method, kw: (method, kw.get("Range")))
    assert store.get_range("k", 10, 20) == bytes(range(10, 20))
    assert calls == [("get_object", "bytes=10-19")]
    assert store.get_range("k", 1020, 2000) == bytes(range(252, 256))
    assert store.get_range("k", 5000, 6000) == b""  # past the end: S3's 416, read as empty
    with pytest.raises(ObjectNotFound):
        store.get_range("missing", 0, 10)


def test_a_round_puts_one_object_per_contribution(bucket: str, monkeypatch) -> None:
    """One exchange round of 4 replicas, each with a client of its own, every S3 call
    recorded: a replica's contribution is ONE PutObject (not one per shard plus a manifest);
    each owner reads each peer's part of its shard once, with a ranged GET; nobody reads a
    manifest (at the object's start): the quorum is decided from the listing."""
    import torch

    from crf.exchange.allreduce import ObjectStoreAllReduce
    from tests.conftest import run_threads

    n = 4
    calls: dict[int, list[tuple[str, str, str | None]]] = {}

    def replica(rank: int) -> torch.Tensor:
        store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
        calls[rank] = spy_on_calls(
            store, monkeypatch, lambda m, kw: (m, str(kw.get("Key", "")), kw.get("Range"))
        )
        ar = ObjectStoreAllReduce(store, n, rank, run_id="t", round_timeout_s=60)
        t = torch.full((1000,), float(rank))
        ar.allreduce([t])
        return t

    out = run_threads(n, replica)
    assert all(torch.equal(t, torch.full((1000,), 1.5)) for t in out), out
    for rank in range(n):
        puts = [k for m, k, _ in calls[rank] if m == "put_object"]
        assert sum(f"rounds/0/contrib/{rank}." in k for k in puts) == 1, puts
        assert not any("manifest" in k for k in puts)
        reads = [
            (int(k.rsplit("/", 1)[1].split(".")[0]), rng)
            for m, k, rng in calls[rank]
            if m == "get_object" and "/contrib/" in k
        ]
        peers = sorted(p for p, _ in reads)
        assert peers == [p for p in range(n) if p != rank], reads  # once each
        assert all(rng and not rng.startswith("bytes=0-") for _, rng in reads), reads


def test_the_benchmarks_moto_serves_ranges_like_moto(bucket: str, monkeypatch) -> None:
    """bench/exchange.py makes moto read only the requested bytes of a ranged GET
    (tests.emulators.moto_s3.serve_ranges_from_the_range): the answers are moto's own - the
    range, short at the end, empty past it, and the whole object for a plain GET or a range
    moto does not honour - for objects kept in memory and for those moto spills to disk."""
    from tests.emulators.moto_s3 import serve_ranges_from_the_range

    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    small = bytes(range(256)) * 40
    big = bytes(range(251)) * (6 * 2**20 // 251)  # over moto's 5 MB in-memory buffer
    store.put("small", small)
    store.put("big", big)
    serve_ranges_from_the_range(monkeypatch.setattr)
    for data, key in ((small, "small"), (big, "big")):
        n = len(data)
        assert store.get_range(key, 7, 1000) == data[7:1000]
        assert store.get_range(key, n - 5, n + 10) == data[n - 5 :]
        assert store.get_range(key, n + 1, n + 10) == b""
        assert store.get(key) == data
    client = store.fs.call_s3
    bucket_name, key = store.fs.split_path(store.path("small"))[:2]
    multi = client("get_object", Bucket=bucket_name, Key=key, Range="bytes=0-1,5-6")
    assert fsspec.asyn.sync(store.fs.loop, multi["Body"].read) == small


def test_large_reads_go_as_parallel_ranged_gets(bucket: str, monkeypatch) -> None:
    """A read longer than RANGE_PIECE (a shard of a large model) goes as ranged GETs of
    RANGE_PIECE bytes, the first one alone (its answer gives the object's size) and the rest
    together, each pinned to the first one's version (If-Match): the bytes are the object's,
    as one GET would give them, whole or a range, short at the end and empty past it."""
    from crf.store import s3 as s3store

    monkeypatch.setattr(s3store, "RANGE_PIECE", 1000)
    store = RunStore(f"s3://{bucket}/run", storage_options=FRESH)
    data = bytes(range(251)) * 40  # 10040 bytes: 11 pieces
    store.put("k", data)
    calls = spy_on_calls(store, monkeypatch, lambda m, kw: (m, kw.get("Range"), "IfMatch" in kw))
    assert store.get("k", size_hint=len(data)) == data
    assert [c[0] for c in calls] == ["get_object"] * 11
    assert calls[0] == ("get_object", "bytes=0-999", False)
    assert all(c[2] for c in calls[1:])  # the same version as the first answer
    assert sorted(c[1] for c in calls[1:]) == sorted(
        f"bytes={a}-{min(a + 1000, len(data)) - 1}" for a in range(1000, len(data), 1000)
    )
    calls.clear()
    assert store.get_range("k", 123, 4567) == data[123:4567]
    assert len(calls) == 5
    assert store.get_range("k", 9000, 20000) == data[9000:]
    assert store.get_range("k", 20000, 30000) == b""
    assert store.get("k", size_hint=0) == data  # a small-object read: one plain GET
    with pytest.raises(ObjectNotFound):
        store.get("missing", size_hint=5000)


class _Denying(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint whose every answer is 403 AccessDenied (a bucket policy that denies
    these credentials, or a grant revoked mid-run)."""

    def log_message(self, *args: Any) -> None:
        pass

    def _deny(self) -> None:
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _deny


def test_a_store_that_denies_access_refuses_writes_for_good(s3_env: MotoS3, monkeypatch) -> None:
    """A store that answers AccessDenied refuses writes for good: the driver stops the run
    on it, as on a read-only folder, rather than restart replicas that would meet the same
    answer (each restart a new container on a cloud backend); a replica that meets it (a
    role without access to the bucket, while the driver's credentials have it) is not
    restarted either, and stops the run, at any round. An endpoint out of reach may come
    back: it is not such a refusal."""
    from crf.launcher.supervise import refuses_writes
    from crf.replica.failures import deterministic, stops_run

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Denying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
        store = RunStore("s3://crf-bucket/run", storage_options=FRESH, retries=0)
        with pytest.raises(StoreNotWritable, match="access denied") as denied:
            store.put_json("launches/0/attempts/0/0.json", {"attempt": 0})
        assert refuses_writes(denied.value)
        for phase in ("starting", "training", "syncing"):
            assert deterministic(denied.value, phase=phase), phase
        assert stops_run(denied.value)
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed_port_url())
    fast = {**FRESH, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = RunStore("s3://crf-bucket/run", storage_options=fast, retries=0)
    store.fs.retries = 1
    with pytest.raises(StoreNotWritable, match="cannot reach") as unreachable:
        store.put_json("launches/0/attempts/0/0.json", {"attempt": 0})
    assert not refuses_writes(unreachable.value)
    assert not deterministic(unreachable.value, phase="training")
    assert not deterministic(unreachable.value, phase="starting")
    assert not stops_run(unreachable.value)


@pytest.mark.parametrize("command", [("runs",), ("status", "r1"), ("logs", "r1")])
def test_a_misspelt_bucket_is_named_by_the_run_commands(
    s3_env: MotoS3, bucket: str, command: tuple[str, ...]
) -> None:
    """A bucket that does not exist holds no runs, which the commands said ('no runs in
    s3://crf-mian/runs', exit 0; 'no run r1'): they name the bucket instead. An existing
    bucket with nothing under the prefix still has no runs."""
    from typer.testing import CliRunner

    from crf.launcher.cli import app

    result = CliRunner().invoke(app, [*command, "--store", "s3://crf-no-such-bucket/runs"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "bucket s3://crf-no-such-bucket does not exist" in line and "--store" in line
    result = CliRunner().invoke(app, [*command, "--store", f"s3://{bucket}/runs"])
    assert "does not exist" not in result.output
    assert ("no runs in" if command == ("runs",) else "no run 'r1'") in result.output
