"""A loopback stand-in for the Hugging Face Hub's model-repo write API, enough for the real
``huggingface_hub.HfApi.create_repo`` + ``upload_folder`` (``crf export RUN hf://ORG/NAME``).

Endpoints, as the client calls them (huggingface_hub 2.x):

* ``POST /api/repos/create`` ``{"name", "organization", "visibility", "type"}``: 200 with the
  repo's url, 409 when it exists (the client's ``exist_ok`` takes that as fine);
* ``POST /api/models/{org}/{name}/preupload/{rev}``: every file is a ``regular`` upload (so
  no LFS/Xet transfer is involved);
* ``POST /api/models/{org}/{name}/commit/{rev}``: the ndjson commit (a header, then one
  base64 ``file`` per addition), applied to the repo's files.

Every request must carry ``Authorization: Bearer <token>`` (401 otherwise). Point a client at
it with ``HfApi(endpoint=hub.endpoint, token=...)`` or ``HF_ENDPOINT``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_PRE = re.compile(r"^/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/?]+)")


class HubEmulator:
    """Model repos in memory: repo id -> {path: bytes}, plus what was asked of it."""

    def __init__(self, token: str = "hf_test_token") -> None:
        self.token = token
        self.repos: dict[str, dict[str, bytes]] = {}
        self.private: dict[str, bool] = {}
        self.commits: list[tuple[str, str]] = []  # (repo, summary)
        self.lock = threading.Lock()
        emu = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = emu.handle(self.path, self.headers.get("Authorization"), body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubEmulator:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, path: str, auth: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        if auth != f"Bearer {self.token}":
            return 401, {"error": "Invalid credentials in Authorization header"}
        with self.lock:
            if path.startswith("/api/repos/create"):
                return self._create(json.loads(body))
            m = _PRE.match(path)
            if m is None:
                return 404, {"error": f"no route {path}"}
            repo, what = m.group(1), m.group(2)
            if repo not in self.repos:
                return 404, {"error": f"Repository Not Found for {repo}"}
            if what == "preupload":
                files = json.loads(body)["files"]
                return 200, {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in files
                    ]
                }
            return self._commit(repo, body)

    def _create(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        repo = f"{req.get('organization')}/{req['name']}"
        if req.get("type", "model") != "model":
            return 400, {"error": "only model repos here"}
        if repo in self.repos:
            return 409, {"error": "You already created this model repo", "url": repo}
        self.repos[repo] = {}
        self.private[repo] = req.get("visibility") == "private"
        return 200, {"url": f"{self.endpoint}/{repo}", "name": repo}

    def _commit(self, repo: str, body: bytes) -> tuple[int, dict[str, Any]]:
        summary = ""
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                summary = item["value"]["summary"]
            elif item["key"] == "file":
                value = item["value"]
                self.repos[repo][value["path"]] = base64.b64decode(value["content"])
            else:
                return 400, {"error": f"unsupported commit item {item['key']}"}
        self.commits.append((repo, summary))
        oid = hashlib.sha1(f"{repo}{len(self.commits)}".encode()).hexdigest()
        return 200, {
            "commitUrl": f"{self.endpoint}/{repo}/commit/{oid}",
            "commitOid": oid,
            "pullRequestUrl": None,
        }
