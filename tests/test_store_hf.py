"""hf:// run stores: repos (commits, parent_commit create-if-absent) and buckets.

The Hub has no offline emulator (repos are git + Xet storage; buckets write through the Xet
service), so these tests run the REAL crf.store.hf code — the writer and
RunStoreHfFileSystem — against a FAKE ``HfApi``: ``FakeHub`` below keeps repos, branches,
commits and bucket files in memory and answers the calls our code makes (``repo_info``,
``file_exists``, ``get_paths_info``, ``list_repo_tree``, ``create_commit`` with
``parent_commit``, the bucket calls) with the Hub's documented behaviour: a commit whose
``parent_commit`` is not the branch head gets 412 "A commit has happened since", limits give
429 with ``Retry-After``, a missing repo 404. Faults (lost responses, 429, concurrent commits)
are injected on purpose. Only the HTTP download of a file is replaced (``_crf_fetch``).

``test_real_hub`` talks to the real Hub and runs only when HF_TOKEN is set.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("huggingface_hub", reason="hf tests need the hf extra: pip install -e .[dev]")

import fsspec  # noqa: E402

try:  # the HTTP client of the installed huggingface_hub: httpx2 in 2.x, httpx in 1.x
    import httpx2  # noqa: E402
except ImportError:
    import httpx as httpx2  # noqa: E402
from huggingface_hub import CommitOperationAdd, CommitOperationDelete  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder  # noqa: E402

import crf.store.hf as hf  # noqa: E402
from crf.store import RunStore, StoreNotWritable, StoreTimeout  # noqa: E402
from tests.cloud_servers import check_basic_ops, check_single_winner  # noqa: E402

REPO = "crf-org/run-store"
BUCKET = "crf-org/run-bucket"
REPO_URI = f"hf://datasets/{REPO}/crf/run1"
BUCKET_URI = f"hf://buckets/{BUCKET}/crf/run1"


def http_error(status: int, message: str, cls: type = HfHubHTTPError, **headers: str):
    request = httpx2.Request("POST", "https://hub.invalid/api")
    return cls(message, response=httpx2.Response(status, headers=headers, request=request))


def fail(status: int, message: str, **headers: str) -> Callable[[Callable[[], Any]], Any]:
    """A fault: the call is refused with this HTTP error (nothing is applied)."""

    def fault(apply: Callable[[], Any]) -> Any:
        raise http_error(status, message, **headers)

    return fault


class FakeHub:
    """In-memory stand-in for the Hub (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.shas = (hashlib.sha1(str(i).encode()).hexdigest() for i in itertools.count())
        root = next(self.shas)
        # repo -> branch -> head sha; sha -> (files, title)
        self.branches: dict[str, dict[str, str]] = {REPO: {"main": root}}
        self.commits: dict[str, tuple[dict[str, bytes], str]] = {root: ({}, "initial")}
        self.buckets: dict[str, dict[str, bytes]] = {BUCKET: {}}
        self.commit_calls = 0
        # op name -> queue of faults; a fault is fn(apply) -> result, called under the lock
        self.faults: dict[str, list[Callable[[Callable[[], Any]], Any]]] = {}

    def fault(self, op: str, fn: Callable[[Callable[[], Any]], Any]) -> None:
        self.faults.setdefault(op, []).append(fn)

    def _run(self, op: str, apply: Callable[[], Any]) -> Any:
        with self.lock:
            queue = self.faults.get(op)
            if queue:
                return queue.pop(0)(apply)
            return apply()

    # --- repo state helpers
    def head(self, repo: str, revision: str | None) -> str:
        if repo not in self.branches:
            raise http_error(404, f"Repository Not Found for {repo}", RepositoryNotFoundError)
        rev = revision or "main"
        if rev in self.commits:
            return rev
        if rev not in self.branches[repo]:
            raise http_error(404, f"Revision Not Found {rev}")
        return self.branches[repo][rev]

    def files(self, repo: str, revision: str | None) -> dict[str, bytes]:
        return self.commits[self.head(repo, revision)][0]

    def commit(self, repo: str, branch: str, ops: list[Any], title: str, parent: str | None):
        self.commit_calls += 1
        head = self.head(repo, branch)
        if parent is not None and parent != head:
            raise http_error(412, "A commit has happened since. Please refresh and try again.")
        files = dict(self.commits[head][0])
        for op in ops:
            if isinstance(op, CommitOperationAdd):
                files[op.path_in_repo] = bytes(op.path_or_fileobj)
            elif isinstance(op, CommitOperationDelete):
                files.pop(op.path_in_repo, None)
        sha = next(self.shas)
        self.commits[sha] = (files, title)
        self.branches[repo][branch] = sha
        return sha


class FakeHfApi:
    """The subset of ``huggingface_hub.HfApi`` that crf.store.hf calls, served by FakeHub."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub

    def repo_info(self, repo_id, *, repo_type=None, revision=None, **kw):
        return self.hub._run(
            "repo_info", lambda: types.SimpleNamespace(sha=self.hub.head(repo_id, revision))
        )

    def file_exists(self, repo_id, filename, *, repo_type=None, revision=None, **kw):
        return self.hub._run("file_exists", lambda: filename in self.hub.files(repo_id, revision))

    def _last_commit(self, repo_id: str, revision: str | None, path: str) -> dict[str, str]:
        sha = self.hub.head(repo_id, revision)  # walk back to the commit that set `path`
        data = self.hub.commits[sha][0].get(path)
        order = list(self.hub.commits)
        for older in reversed(order[: order.index(sha) + 1]):
            if self.hub.commits[older][0].get(path) == data:
                sha = older
            else:
                break
        return {"id": sha, "title": self.hub.commits[sha][1], "date": "2026-01-01T00:00:00Z"}

    def _entry(self, repo_id: str, revision: str | None, path: str, files: dict[str, bytes]):
        if path in files:
            last = self._last_commit(repo_id, revision, path)
            return RepoFile(path=path, size=len(files[path]), oid="0" * 40, lastCommit=last)
        if any(f.startswith(path + "/") for f in files):
            return RepoFolder(path=path, oid="1" * 40)
        return None

    def get_paths_info(self, repo_id, paths, *, expand=False, revision=None, repo_type=None):
        def apply():
            files = self.hub.files(repo_id, revision)
            entries = [self._entry(repo_id, revision, p, files) for p in paths]
            return [e for e in entries if e is not None]

        return self.hub._run("get_paths_info", apply)

    def list_repo_tree(
        self, repo_id, path_in_repo=None, *, recursive=False, revision=None, repo_type=None, **kw
    ):
        def apply():
            files = self.hub.files(repo_id, revision)
            prefix = (path_in_repo or "").strip("/")
            under = {f: d for f, d in files.items() if not prefix or f.startswith(prefix + "/")}
            if prefix and not under:
                raise http_error(404, f"{prefix} not found", RemoteEntryNotFoundError)
            out: dict[str, Any] = {}
            for f in under:
                rest = f[len(prefix) + 1 :] if prefix else f
                if recursive or "/" not in rest:
                    out[f] = self._entry(repo_id, revision, f, files)
                else:
                    d = f"{prefix}/{rest.split('/')[0]}" if prefix else rest.split("/")[0]
                    out[d] = RepoFolder(path=d, oid="1" * 40)
            return list(out.values())

        return self.hub._run("list_repo_tree", apply)

    def create_commit(
        self,
        repo_id,
        operations,
        *,
        commit_message,
        repo_type=None,
        revision=None,
        parent_commit=None,
        **kw,
    ):
        ops = list(operations)

        def apply():
            sha = self.hub.commit(repo_id, revision or "main", ops, commit_message, parent_commit)
            return types.SimpleNamespace(oid=sha)

        return self.hub._run("create_commit", apply)

    # --- buckets
    def _bucket(self, bucket_id: str) -> dict[str, bytes]:
        if bucket_id not in self.hub.buckets:
            raise http_error(404, f"Bucket {bucket_id} not found")
        return self.hub.buckets[bucket_id]

    def list_bucket_tree(self, bucket_id, prefix=None, *, recursive=None, **kw):
        def apply():
            files = self._bucket(bucket_id)
            p = (prefix or "").strip("/")
            out: dict[str, Any] = {}
            for f, d in files.items():
                if p and not f.startswith(p + "/"):
                    continue
                rest = f[len(p) + 1 :] if p else f
                if recursive or "/" not in rest:
                    out[f] = types.SimpleNamespace(type="file", path=f, size=len(d))
                else:
                    name = f"{p}/{rest.split('/')[0]}" if p else rest.split("/")[0]
                    out[name] = types.SimpleNamespace(type="directory", path=name)
            return list(out.values())

        return self.hub._run("list_bucket_tree", apply)

    def get_bucket_paths_info(self, bucket_id, paths, **kw):
        def apply():
            files = self._bucket(bucket_id)
            return [types.SimpleNamespace(path=p, size=len(files[p])) for p in paths if p in files]

        return self.hub._run("get_bucket_paths_info", apply)

    def batch_bucket_files(self, bucket_id, *, add=None, delete=None, **kw):
        def apply():
            files = self._bucket(bucket_id)
            for data, dest in add or []:
                files[dest] = bytes(data)
            for path in delete or []:
                files.pop(path, None)

        return self.hub._run("batch_bucket_files", apply)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """A fresh FakeHub behind every hf:// RunStore of the test; backoff sleeps are recorded."""
    fake = FakeHub()

    class FakeTransportFs(hf.RunStoreHfFileSystem):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._api = FakeHfApi(fake)

        def _crf_fetch(self, u: Any, start: int | None = None, end: int | None = None) -> bytes:
            # the one HTTP GET (with a Range header when start/end are given), from the fake
            with fake.lock:
                try:
                    if u.type == "bucket":
                        data = FakeHfApi(fake)._bucket(u.id)[u.path_in_repo]
                    else:
                        data = fake.files(u.id, u.revision)[u.path_in_repo]
                except KeyError:
                    raise FileNotFoundError(u.path_in_repo) from None
            return data if start is None or end is None else data[start:end]

    fsspec.register_implementation("hf", FakeTransportFs, clobber=True)
    sleeps: list[float] = []
    fake.sleeps = sleeps
    monkeypatch.setattr(hf, "_sleep", sleeps.append)
    monkeypatch.setattr(hf, "BUCKET_SETTLE_S", 0.0)
    yield fake
    fsspec.register_implementation("hf", hf.RunStoreHfFileSystem, clobber=True)


def fresh(uri: str) -> RunStore:
    return RunStore(uri, storage_options={"skip_instance_cache": True})


# --------------------------------------------------------------------------- repos
def test_repo_put_get_list_delete(hub: FakeHub) -> None:
    store = fresh(REPO_URI)
    check_basic_ops(store)
    store.check_writable()
    assert "crf/run1/a/x" in hub.files(REPO, "main")
    assert isinstance(store.fs, hf.RunStoreHfFileSystem) and store.fs._crf_fresh


def test_repo_put_if_absent_one_winner(hub: FakeHub) -> None:
    check_single_winner([fresh(REPO_URI) for _ in range(3)])
    # one commit created it; every loser saw it (on a head) or lost the parent_commit race
    titles = [t for _, t in hub.commits.values() if "rounds/0/quorum.json" in t]
    assert len(titles) == 1 and "crf: create" in titles[0]


def test_repo_create_commits_on_the_head_it_checked(hub: FakeHub) -> None:
    """Another commit lands between our check and our commit: 412, re-check, then create."""
    store = fresh(REPO_URI)

    def concurrent_commit(apply):  # someone commits first; our parent_commit is now stale
        hub.commit(REPO, "main", [CommitOperationAdd("other", b"o")], "other", None)
        return apply()

    hub.fault("create_commit", concurrent_commit)
    assert store.put_if_absent("q", b"mine") is True
    assert store.get("q") == b"mine" and hub.files(REPO, "main")["other"] == b"o"
    assert hub.commit_calls == 3  # other + our refused attempt + our retry


def test_repo_create_loses_to_a_concurrent_creator(hub: FakeHub) -> None:
    store = fresh(REPO_URI)

    def concurrent_create(apply):
        hub.commit(REPO, "main", [CommitOperationAdd("crf/run1/q", b"theirs")], "theirs", None)
        return apply()

    hub.fault("create_commit", concurrent_create)
    assert store.put_if_absent("q", b"mine") is False
    assert store.get("q") == b"theirs"


def test_repo_create_after_a_lost_response(hub: FakeHub) -> None:
    """The commit lands but the answer is lost: the nonce in its title proves it was ours."""
    store = fresh(REPO_URI)

    def lost(apply):
        apply()
        raise httpx2.ReadTimeout("timed out reading the answer")

    hub.fault("create_commit", lost)
    assert store.put_if_absent("q", b"mine") is True
    assert store.get("q") == b"mine"

    def lost_then_other(apply):  # our attempt never landed; someone else created it
        hub.commit(REPO, "main", [CommitOperationAdd("crf/run1/r", b"theirs")], "x", None)
        raise httpx2.ReadTimeout("timed out")

    hub.fault("create_commit", lost_then_other)
    assert store.put_if_absent("r", b"mine") is False


def test_plain_put_replays_after_a_concurrent_commit(hub: FakeHub) -> None:
    store = fresh(REPO_URI)
    hub.fault(
        "create_commit", fail(412, "A commit has happened since. Please refresh and try again.")
    )
    store.put("k", b"v")
    assert store.get("k") == b"v"


def test_rate_limit_waits_for_the_server_hint(hub: FakeHub) -> None:
    store = fresh(REPO_URI)
    for _ in range(2):
        hub.fault("create_commit", fail(429, "Too Many Requests", **{"Retry-After": "7"}))
    assert store.put_if_absent("k", b"v") is True
    assert len(hub.sleeps) == 2 and all(7 <= s <= 8 for s in hub.sleeps)


def test_rate_limit_is_bounded_and_explained(hub: FakeHub, monkeypatch) -> None:
    monkeypatch.setattr(hf, "RATE_LIMIT_MAX_WAIT_S", 100.0)
    store = fresh(REPO_URI)
    for _ in range(50):
        message = "You have exceeded the rate limit for repository commits (128 per hour)."
        hub.fault("create_commit", fail(429, message, **{"Retry-After": "40"}))
    with pytest.raises(hf.HfRateLimited, match=r"rate limiting.*hf://buckets/"):
        store.put("k", b"v")
    assert 0 < sum(hub.sleeps) <= 100 and len(hub.sleeps) == 2


def test_rate_limit_without_hint_backs_off_with_jitter(hub: FakeHub) -> None:
    store = fresh(REPO_URI)
    for _ in range(4):
        hub.fault("create_commit", fail(429, "Too Many Requests"))
    store.put("k", b"v")
    caps = [hf.BACKOFF_BASE_S * 2**i for i in range(4)]
    assert len(hub.sleeps) == 4 and all(0 <= s <= c for s, c in zip(hub.sleeps, caps, strict=True))


def test_second_client_sees_new_objects(hub: FakeHub) -> None:
    """No stale listing cache: HfFileSystem would cache; RunStoreHfFileSystem must not."""
    reader, writer = fresh(REPO_URI), fresh(REPO_URI)
    assert reader.list("rounds/0") == [] and not reader.exists("rounds/0/a")
    writer.put("rounds/0/a", b"1")
    assert reader.list("rounds/0") == ["a"] and reader.exists("rounds/0/a")
    writer.put("rounds/0/b", b"2")
    assert reader.list("rounds/0") == ["a", "b"]
    writer.delete("rounds/0/a")
    assert reader.list("rounds/0") == ["b"] and not reader.exists("rounds/0/a")
    t = threading.Timer(0.2, lambda: writer.put("w/1", b"x"))
    t.start()
    reader.wait_for(["w/1"], timeout_s=10)
    t.join()
    with pytest.raises(StoreTimeout, match="w/2"):
        reader.wait_for(["w/2"], timeout_s=0.2)


def test_check_writable_failures(hub: FakeHub) -> None:
    with pytest.raises(StoreNotWritable, match=r"repo .* not found.*hf repos create"):
        fresh("hf://datasets/crf-org/missing/run").check_writable()
    for status, match in [(401, "not authenticated.*HF_TOKEN"), (403, "may not write")]:
        hub.fault("create_commit", fail(status, "denied"))
        with pytest.raises(StoreNotWritable, match=match):
            fresh(REPO_URI).check_writable()


def test_plain_hf_filesystems_keep_their_behaviour(hub: FakeHub) -> None:
    """Registering the subclass for hf:// changes nothing for other users of HfFileSystem."""
    from huggingface_hub import HfFileSystem

    fs = hf.RunStoreHfFileSystem(skip_instance_cache=True)
    assert isinstance(fs, HfFileSystem) and not fs._crf_fresh
    assert fresh(REPO_URI).fs._crf_fresh


# --------------------------------------------------------------------------- buckets
def test_bucket_put_get_list_delete(hub: FakeHub) -> None:
    store = fresh(BUCKET_URI)
    check_basic_ops(store)
    store.check_writable()
    assert hub.buckets[BUCKET]["crf/run1/a/x"] == b"3"


def test_bucket_put_if_absent_is_best_effort(hub: FakeHub, monkeypatch) -> None:
    monkeypatch.setattr(hf, "BUCKET_SETTLE_S", 1.5)
    store = fresh(BUCKET_URI)
    assert store.put_if_absent("q", b"first") is True
    assert store.put_if_absent("q", b"second") is False
    assert store.get("q") == b"first"
    assert 1.5 in hub.sleeps  # it waited for late writers before reading back

    # a writer that checked before our write landed overwrites it within the settle time:
    # the read-back sees their bytes and we report a loss (their decision stands)
    def late_writer(apply):
        apply()
        hub.buckets[BUCKET]["crf/run1/r"] = b"theirs"

    hub.fault("batch_bucket_files", late_writer)
    assert store.put_if_absent("r", b"mine") is False
    assert store.get("r") == b"theirs"


# --------------------------------------------------------------------------- the real Hub
@pytest.mark.skipif(
    not os.environ.get("HF_TOKEN"),
    reason="needs HF_TOKEN (a token with write access) to test against the real Hub",
)
def test_real_hub() -> None:  # pragma: no cover - needs the network and a token
    from huggingface_hub import HfApi

    fsspec.register_implementation("hf", hf.RunStoreHfFileSystem, clobber=True)
    api = HfApi()
    repo = os.environ.get("CRF_TEST_HF_REPO")  # e.g. "<you>/crf-store-test", a dataset repo
    created = None
    if not repo:
        repo = created = f"{api.whoami()['name']}/crf-store-test-{uuid.uuid4().hex[:8]}"
        api.create_repo(repo, repo_type="dataset", private=True)
    try:
        store = fresh(f"hf://datasets/{repo}/crf/{uuid.uuid4().hex[:8]}")
        store.check_writable()
        store.put("a/b", b"1")
        assert store.get("a/b") == b"1" and store.list("a") == ["b"]
        wins = [store.put_if_absent("q", b"x"), store.put_if_absent("q", b"y")]
        assert wins == [True, False] and store.get("q") == b"x"
        store.delete("")
    finally:
        if created:
            api.delete_repo(created, repo_type="dataset")
