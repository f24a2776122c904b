"""Loopback object-store servers for the cloud run-store tests (no internet, no credentials).

* S3: moto's ``ThreadedMotoServer`` on 127.0.0.1 (random port), reached by s3fs/boto3 through
  ``AWS_ENDPOINT_URL``. moto 5.2 honours ``If-None-Match: *`` on PutObject and on
  CompleteMultipartUpload, but checks-then-stores without a lock on its threaded server; real
  S3 makes the check atomic. The fixture serialises moto's conditional writes
  (``tests.emulators.moto_s3``) so a racing test measures our client, not moto's race window.
* GCS: ``gcp-storage-emulator`` on 127.0.0.1 (free port), reached by gcsfs through
  ``STORAGE_EMULATOR_HOST`` with ``token="anon"``. The emulator IGNORES ``ifGenerationMatch``
  (a second create silently overwrites; its source never reads the parameter), so the fixture
  adds the check real GCS makes: an upload carrying ``ifGenerationMatch=0`` for a name that
  exists gets 412. The emulator serves one request at a time, so check+store is atomic. Every
  precondition it sees is recorded, so tests also prove the client sends it.

Environment variables are set per test with monkeypatch; the servers live for the session.
Import the fixtures into a test module with ``from tests.cloud_servers import ...``.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port_url() -> str:
    """An http URL on loopback where nothing listens (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


# --------------------------------------------------------------------------- S3 (moto)
@dataclass
class MotoS3:
    endpoint: str
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def new_bucket(self) -> str:
        name = f"crf-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    pytest.importorskip("s3fs", reason="s3 tests need the s3 extra: pip install -e .[dev]")
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
    from tests.emulators.moto_s3 import serialize_conditional_puts

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    moto = MotoS3(endpoint=f"http://{host}:{port}")

    mp = pytest.MonkeyPatch()
    serialize_conditional_puts(moto.lock, mp.setattr)
    try:
        yield moto
    finally:
        mp.undo()
        server.stop()


@pytest.fixture
def s3_env(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> MotoS3:
    """Point boto/s3fs at the moto server with dummy credentials, isolated from ~/.aws."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no 1-2 s IMDS probe
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return moto_s3


# --------------------------------------------------------------------------- GCS (emulator)
@dataclass
class GcsEmulator:
    endpoint: str
    server: Any
    preconditions: list[tuple[str, str]] = field(default_factory=list)  # (object, value)

    def new_bucket(self) -> str:
        from gcp_storage_emulator.handlers import buckets

        name = f"crf-{uuid.uuid4().hex[:12]}"
        buckets.create_bucket(name, self.server._storage)
        return name


def _add_generation_precondition(mp: pytest.MonkeyPatch, emu: GcsEmulator) -> None:
    """Make the emulator answer 412 to ``ifGenerationMatch=0`` on an existing name, like GCS."""
    from gcp_storage_emulator import server as emu_server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def object_name(request: Any, storage: Any) -> str | None:
        if "upload_id" in request.query:  # a resumable upload's chunk: name from the session
            try:
                return storage.get_resumable_file_obj(request.query["upload_id"][0])["name"]
            except NotFound:
                return None
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data
        if isinstance(data, dict):
            meta = data.get("meta", data)
            return meta.get("name") if isinstance(meta, dict) else None
        return None

    def guard(handler: Any) -> Any:
        def guarded(request: Any, response: Any, storage: Any, *a: Any, **kw: Any) -> Any:
            match = request.query.get("ifGenerationMatch")
            if match:
                _ = request.data  # read the whole body before answering, as GCS does
                name = object_name(request, storage)
                emu.preconditions.append((name or "?", match[0]))
                if match[0] == "0" and name is not None:
                    try:
                        storage.get_file_obj(request.params["bucket_name"], name)
                    except NotFound:
                        pass
                    else:
                        response.status = HTTPStatus.PRECONDITION_FAILED
                        response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                        return None
            return handler(request, response, storage, *a, **kw)

        return guarded

    wrapped = {objects.insert: guard(objects.insert)}
    wrapped[objects.upload_partial] = guard(objects.upload_partial)
    for _, handlers in emu_server.HANDLERS:
        for method, fn in list(handlers.items()):
            if fn in wrapped:
                mp.setitem(handlers, method, wrapped[fn])
    mp.setattr(objects, "insert", wrapped[objects.insert])  # the router's fallback path


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    if importlib.util.find_spec("gcsfs") is None:  # not imported: see gcs_env
        pytest.skip("gcs tests need the gcs extra: pip install -e .[dev]")
    emu_server = pytest.importorskip(
        "gcp_storage_emulator.server", reason="needs gcp-storage-emulator (the dev extra)"
    )
    port = free_port()
    server = emu_server.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    emu = GcsEmulator(endpoint=f"http://127.0.0.1:{port}", server=server)
    httpd = server._api._httpd
    report = httpd.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        # a client that went away mid-answer (a pooled connection closed) is not an error
        if not isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            report(request, client_address)

    httpd.handle_error = handle_error
    mp = pytest.MonkeyPatch()
    _add_generation_precondition(mp, emu)
    try:
        yield emu
    finally:
        mp.undo()
        server.stop()


@pytest.fixture
def gcs_env(gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> GcsEmulator:
    """Point gcsfs at the emulator. The ZB/HNS switch is read when gcsfs is imported."""
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        pytest.fail(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set, so it "
            "uses its experimental zonal-bucket class, which the emulator cannot serve"
        )
    return gcs_emulator


def gcs_options(**extra: Any) -> dict[str, Any]:
    """Storage options for a gs:// RunStore on the emulator (anonymous, dummy project)."""
    return {"token": "anon", "project": "crf-test", **extra}


# --------------------------------------------------------------------------- shared checks
def check_basic_ops(store: Any) -> None:
    """put/get/list/delete through RunStore, as tests/test_store.py does for file://."""
    from crf.store import ObjectNotFound

    store.put("a/b/c.json", b"1")
    store.put("a/b/d", b"22")
    store.put("a/x", b"3")
    assert store.get("a/b/c.json") == b"1"
    assert store.list("a") == ["b", "x"]
    assert store.list("a/b") == ["c.json", "d"]
    assert store.list("nope") == []
    assert store.exists("a/b/d") and not store.exists("a/b/zz")
    store.put("a/b/d", b"replaced")
    assert store.get("a/b/d") == b"replaced"
    assert store.get_range("a/b/d", 2, 5) == b"pla"  # one ranged read
    assert store.get_range("a/b/d", 6, 100) == b"ed"
    with pytest.raises(ObjectNotFound):
        store.get_range("a/b/zz", 0, 3)
    store.delete("a/b")
    assert store.list("a") == ["x"]
    with pytest.raises(ObjectNotFound, match="does not exist"):
        store.get("a/b/d")
    store.delete("never/there")  # missing is fine


def check_single_winner(stores: list[Any], key: str = "rounds/0/quorum.json") -> None:
    """Threads race put_if_absent on one key (stores[i % len]): exactly one wins, whole bytes."""
    from tests.conftest import run_threads

    n = 8
    wins = run_threads(
        n, lambda r: stores[r % len(stores)].put_if_absent(key, str(r).encode() * 1000)
    )
    errors = [w for w in wins if isinstance(w, BaseException)]
    assert not errors, errors
    assert sum(1 for w in wins if w is True) == 1, wins
    winner = wins.index(True)
    for s in stores:
        assert s.get(key) == str(winner).encode() * 1000
    assert stores[0].put_if_absent(key, b"late") is False


def check_allreduce(store: Any, world: int = 3) -> None:
    """One ObjectStoreAllReduce round with replicas as threads: the exact fp32 mean, same bits
    on every replica."""
    import torch

    from crf.exchange.allreduce import ObjectStoreAllReduce
    from tests.conftest import run_threads

    shapes = [(7,), (3, 5), (1,), (2, 2, 3)]

    def tensors(rank: int) -> list[Any]:
        g = torch.Generator().manual_seed(100 + rank)
        return [torch.randn(s, generator=g) for s in shapes]

    def replica(rank: int) -> list[Any]:
        ar = ObjectStoreAllReduce(store, world, rank, run_id="cloud", round_timeout_s=30)
        ts = tensors(rank)
        res = ar.allreduce(ts)
        assert res.in_quorum and res.participants == list(range(world))
        return ts

    out = run_threads(world, replica)
    errors = [o for o in out if isinstance(o, BaseException)]
    assert not errors, errors
    per = [tensors(r) for r in range(world)]
    for i in range(len(shapes)):
        acc = per[0][i].clone()
        for p in per[1:]:
            acc += p[i]
        want = acc / world
        for got in out:
            assert torch.equal(got[i], want)  # bit-identical to the rank-ordered fp32 mean


__all__ = [
    "GcsEmulator",
    "MotoS3",
    "check_allreduce",
    "check_basic_ops",
    "check_single_winner",
    "closed_port_url",
    "free_port",
    "gcs_emulator",
    "gcs_env",
    "gcs_options",
    "moto_s3",
    "s3_env",
]
