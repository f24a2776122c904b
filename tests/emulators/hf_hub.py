"""A loopback Hugging Face Hub for tests: model and dataset repos served from local folders,
and the write routes ``crf export RUN hf://ORG/NAME`` uses.

The Hub has no offline emulator, so this is a small read-only REST server (stdlib
``ThreadingHTTPServer``) that answers the routes ``huggingface_hub`` (1.x) calls to download,
in the shapes its parsers read. The REAL clients then work against it: ``hf_hub_download``,
``snapshot_download``, ``HfApi().model_info / list_repo_tree / get_paths_info``,
``HfFileSystem`` (``hf://`` paths, hence ``datasets.load_dataset``) and
``transformers``' ``from_pretrained``, with ``HF_ENDPOINT=emu.endpoint`` and an empty
``HF_HOME``.

Routes (``{type}`` is ``models`` or ``datasets``; a model repo's files have no type prefix):

* ``GET /api/{type}/{org}/{name}[/revision/{rev}]`` - repo info: ``id``, ``sha`` (the
  commit), ``siblings`` (``rfilename``, ``size``), ``private``, ``lastModified``.
* ``GET /api/{type}/{org}/{name}/tree/{rev}[/{path}]?recursive=&expand=`` - a folder's
  entries (``type`` file/directory, ``path``, ``size``, ``oid``), one page.
* ``POST /api/{type}/{org}/{name}/paths-info/{rev}`` - entries of the form's ``paths``.
* ``HEAD``/``GET /[datasets/]{org}/{name}/resolve/{rev}/{path}`` - the file, with the
  headers the client requires: ``X-Repo-Commit``, ``ETag`` (the content's SHA-256, as the Hub
  gives for LFS files), ``Content-Length``; ``GET`` honours ``Range``.

Writes (``HfApi.create_repo`` + ``upload_folder``), each needing ``Authorization: Bearer
<token>`` (401 otherwise):

* ``POST /api/repos/create`` ``{"name", "organization", "visibility", "type"}``: 200 with the
  repo's url, 409 when it exists (the client's ``exist_ok`` takes that as fine);
* ``POST /api/models/{org}/{name}/preupload/{rev}``: every file is a ``regular`` upload (no
  LFS/Xet transfer);
* ``POST /api/models/{org}/{name}/commit/{rev}``: the ndjson commit (a header, then one
  base64 ``file`` per addition), applied to the repo's files (a new commit sha).

Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``), which the client maps to its typed exceptions. A revision is ``main`` or
the repo's commit sha. A repo's commit is a hash of its files, fixed when it is added
(``add_repo`` again to publish a new one). Every request is kept in ``requests`` (method,
path, status) so a test can check what the client asked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LAST_MODIFIED = "2026-01-01T00:00:00.000Z"


@dataclass
class Repo:
    """One repo: its files (path in repo -> local file) and its commit sha."""

    repo_id: str
    kind: str  # "model" or "dataset"
    files: dict[str, Path]
    sha: str
    etags: dict[str, str]

    @classmethod
    def from_folder(cls, repo_id: str, kind: str, folder: Path) -> Repo:
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))}
        files = {k: v for k, v in files.items() if v.is_file()}
        etags = {k: hashlib.sha256(v.read_bytes()).hexdigest() for k, v in files.items()}
        commit = hashlib.sha1(json.dumps(sorted(etags.items())).encode()).hexdigest()
        return cls(repo_id, kind, files, commit, etags)

    def entry(self, path: str) -> dict[str, Any] | None:
        """The tree entry of ``path`` (a file or a folder), None if there is none."""
        if path in self.files:
            return {"type": "file", "path": path, "size": self.files[path].stat().st_size,
                    "oid": self.etags[path][:40]}  # fmt: skip
        prefix = path.rstrip("/") + "/"
        if path == "" or any(f.startswith(prefix) for f in self.files):
            oid = hashlib.sha1(f"{self.sha}:{path}".encode()).hexdigest()
            return {"type": "directory", "path": path, "oid": oid}
        return None

    def tree(self, folder: str, recursive: bool) -> list[dict[str, Any]] | None:
        """Entries under ``folder`` (its children, or everything below with ``recursive``)."""
        if folder and (self.entry(folder) or {}).get("type") != "directory":
            return None
        prefix = f"{folder}/" if folder else ""
        paths: set[str] = set()
        for f in self.files:
            if not f.startswith(prefix):
                continue
            parts = f[len(prefix) :].split("/")
            for depth in range(1, len(parts) + 1 if recursive else 2):
                paths.add(prefix + "/".join(parts[:depth]))
        return [e for e in (self.entry(p) for p in sorted(paths)) if e is not None]


class HubEmulator:
    """The server (see module docstring). ``add_repo`` copies a folder into ``root``."""

    def __init__(self, root: str | Path, token: str = "hf_test_token") -> None:
        self.root = Path(root)
        self.token = token  # what writes must carry
        self.repos: dict[tuple[str, str], Repo] = {}
        self.private: dict[str, bool] = {}
        self.commits: list[tuple[str, str]] = []  # (repo id, summary) of each write
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(self, repo_id: str, folder: str | Path, kind: str = "model") -> Repo:
        """Publish ``folder``'s files as repo ``repo_id`` (``org/name``) of ``kind``."""
        if kind not in ("model", "dataset") or repo_id.count("/") != 1:
            raise ValueError(f"bad repo {kind} {repo_id!r}")
        dest = self.root / f"{kind}s" / repo_id
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(folder, dest)
        repo = Repo.from_folder(repo_id, kind, dest)
        with self._lock:
            self.repos[(kind, repo_id)] = repo
        return repo

    def files(self, repo_id: str, kind: str = "model") -> dict[str, bytes]:
        """A repo's files as they are now: path -> bytes."""
        repo = self.repos[(kind, repo_id)]
        return {path: local.read_bytes() for path, local in repo.files.items()}

    # ------------------------------------------------------------------ writes
    def create(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        repo_id = f"{req.get('organization')}/{req['name']}"
        if req.get("type", "model") != "model":
            return 400, {"error": "only model repos are created here"}
        with self._lock:
            if ("model", repo_id) in self.repos:
                return 409, {"error": "You already created this model repo", "url": repo_id}
        dest = self.root / "models" / repo_id
        dest.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.repos[("model", repo_id)] = Repo.from_folder(repo_id, "model", dest)
            self.private[repo_id] = req.get("visibility") == "private"
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id}

    def commit(self, repo_id: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """Apply an ndjson commit: its files land in the repo's folder, a new sha."""
        dest, summary = self.root / "models" / repo_id, ""
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                summary = item["value"]["summary"]
            elif item["key"] == "file":
                target = dest / item["value"]["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(item["value"]["content"]))
            else:
                return 400, {"error": f"unsupported commit item {item['key']}"}
        with self._lock:
            repo = Repo.from_folder(repo_id, "model", dest)
            self.repos[("model", repo_id)] = repo
            self.commits.append((repo_id, summary))
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{repo.sha}",
                     "commitOid": repo.sha, "pullRequestUrl": None}  # fmt: skip

    def start(self) -> HubEmulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def find(self, kind: str, repo_id: str, rev: str) -> tuple[Repo | None, str | None]:
        """(repo, None), or (None, the X-Error-Code why not)."""
        with self._lock:
            repo = self.repos.get((kind, repo_id))
        if repo is None:
            return None, "RepoNotFound"
        if rev not in ("main", repo.sha):
            return None, "RevisionNotFound"
        return repo, None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        emu = self

        class Handler(_HubHandler):
            hub = emu

        return Handler


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubEmulator

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    # ------------------------------------------------------------------ replies
    def _reply(self, status: int, body: bytes, headers: dict[str, str], head: bool = False):
        self.hub.requests.append((self.command, self.path, status))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
        self.end_headers()
        if not head and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, **headers: str) -> None:
        body = json.dumps(obj).encode()
        self._reply(status, body, {"Content-Type": "application/json", **headers})

    def _error(self, code: str, message: str, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._json(404, {"error": message}, **headers)

    # ------------------------------------------------------------------ routing
    def _parts(self) -> tuple[list[str], dict[str, list[str]]]:
        url = urlsplit(self.path)
        return [unquote(p) for p in url.path.split("/") if p], parse_qs(url.query)

    def do_HEAD(self) -> None:  # noqa: N802
        self._resolve(self._parts()[0], head=True)

    def do_GET(self) -> None:  # noqa: N802
        parts, query = self._parts()
        if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            self._api(parts[1][:-1], parts[2:], query)
        else:
            self._resolve(parts, head=False)

    def do_POST(self) -> None:  # noqa: N802
        parts, _ = self._parts()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if parts[:3] == ["api", "repos", "create"] or (
            len(parts) == 6 and parts[1] == "models" and parts[4] in ("preupload", "commit")
        ):
            return self._write(parts, raw)
        form = parse_qs(raw.decode())
        if parts[:1] == ["api"] and len(parts) == 6 and parts[4] == "paths-info":
            kind, repo_id = parts[1][:-1], "/".join(parts[2:4])
            repo, why = self.hub.find(kind, repo_id, parts[5])
            if repo is None:
                return self._error(why, f"{kind} {repo_id}@{parts[5]}: {why}")
            entries = [repo.entry(p.strip("/")) for p in form.get("paths", [])]
            return self._json(200, [e for e in entries if e is not None])
        self._json(404, {"error": f"no route POST {self.path}"})

    def _write(self, parts: list[str], raw: bytes) -> None:
        """The write routes (module docstring): a token, then create / preupload / commit."""
        if self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            return self._json(401, {"error": "Invalid credentials in Authorization header"})
        if parts[1] == "repos":
            return self._json(*self.hub.create(json.loads(raw)))
        repo_id = "/".join(parts[2:4])
        repo, why = self.hub.find("model", repo_id, "main")
        if repo is None:
            return self._error(why, f"Repository Not Found for {repo_id}")
        if parts[4] == "preupload":
            files = json.loads(raw)["files"]
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                     for f in files]  # fmt: skip
            return self._json(200, {"files": modes})
        self._json(*self.hub.commit(repo_id, raw))

    def _api(self, kind: str, rest: list[str], query: dict[str, list[str]]) -> None:
        repo_id, tail = "/".join(rest[:2]), rest[2:]
        if not tail or tail[0] == "revision":
            rev = tail[1] if len(tail) > 1 else "main"
            repo, why = self.hub.find(kind, repo_id, rev)
            if repo is None:
                return self._error(why, f"{kind} {repo_id}@{rev}: {why}")
            siblings = [{"rfilename": f, "size": p.stat().st_size} for f, p in repo.files.items()]
            return self._json(200, {"id": repo_id, "sha": repo.sha, "siblings": siblings,
                                    "private": False, "lastModified": LAST_MODIFIED,
                                    "author": repo_id.split("/")[0]})  # fmt: skip
        if tail[0] == "tree" and len(tail) >= 2:
            repo, why = self.hub.find(kind, repo_id, tail[1])
            if repo is None:
                return self._error(why, f"{kind} {repo_id}@{tail[1]}: {why}")
            folder = "/".join(tail[2:]).strip("/")
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            listing = repo.tree(folder, recursive)
            if listing is None:
                return self._error("EntryNotFound", f"{folder} not in {repo_id}", repo.sha)
            return self._json(200, listing)
        self._json(404, {"error": f"no route GET {self.path}"})

    def _resolve(self, parts: list[str], head: bool) -> None:
        kind = "model"
        if parts[:1] == ["datasets"]:
            kind, parts = "dataset", parts[1:]
        if len(parts) < 5 or parts[2] != "resolve":
            return self._json(404, {"error": f"no route {self.command} {self.path}"})
        repo_id, rev, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        repo, why = self.hub.find(kind, repo_id, rev)
        if repo is None:
            return self._error(why, f"{kind} {repo_id}@{rev}: {why}")
        if path not in repo.files:
            return self._error("EntryNotFound", f"{path} not in {repo_id}", repo.sha)
        data = repo.files[path].read_bytes()
        headers = {
            "X-Repo-Commit": repo.sha,
            "ETag": f'"{repo.etags[path]}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status, body = 200, data
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            start = int(first) if first else max(0, len(data) - int(last))
            end = int(last) if first and last else len(data) - 1
            body, status = data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(body))
        self._reply(status, body, headers, head=head)
