"""A loopback Hugging Face Jobs API for tests, driven by the official ``huggingface_hub`` client.

HF Jobs has no local emulator, so this is a small REST server (stdlib ``ThreadingHTTPServer``)
that answers the routes ``HfApi`` 2.4 calls for jobs, in the shapes its dataclasses parse
(``JobInfo``, ``JobHardwareInfo``, the whoami payload). Point a client at it with
``HfApi(endpoint=emu.endpoint, token=...)``.

Routes (all under the endpoint; tokens are checked on every one):

* ``GET /api/whoami-v2`` - the token's user and orgs (401 for an unknown token).
* ``GET /api/jobs/hardware`` - the flavors, with the published per-minute prices.
* ``POST /api/jobs/{ns}`` - create a job from the spec ``run_job`` sends (``dockerImage``,
  ``command``, ``arguments``, ``environment``, ``secrets``, ``flavor``, ``timeoutSeconds``,
  ``labels``, ``attempts``). 400 for an unknown flavor or a missing image, 403 for a namespace
  the token's user does not belong to.
* ``GET /api/jobs/{ns}/{id}`` - ``JobInfo``; 404 for an unknown id (the client maps it to
  ``JobNotFoundError``).
* ``GET /api/jobs/{ns}/{id}/logs`` - server-sent events ``data: {"data": line, "timestamp":
  iso}``, replayed from the first line on every connection (as the Hub does: the client
  de-duplicates by index), then new lines as they are printed, until the job has ended. The
  first event is the Hub's ``===== Job started at ... =====`` line, which the client drops.
* ``POST /api/jobs/{ns}/{id}/cancel`` - stage CANCELED at once; the process group gets
  SIGTERM, then SIGKILL after a grace period.
* ``GET /api/jobs/{ns}?label=k=v&stage=S`` - the namespace's jobs, filtered (one page).

How a job runs: its ``command + arguments`` run as a LOCAL SUBPROCESS in its own process group
and a fresh temporary folder. The "image" is the host environment: ``PATH`` starts with the
folder of this Python, so ``python`` is the test virtualenv's interpreter; ``dockerImage`` is
only recorded. The process gets ``PATH``/``HOME``/``LANG`` plus the job's ``environment`` and
``secrets`` - never the test process's own environment, so a replica reaches a store only with
credentials that travelled through the Jobs API. Stages: SCHEDULING on creation, RUNNING once
the process started, then COMPLETED (exit 0), ERROR (non-zero exit: ``Job failed with exit
code: N``, a command that cannot start, or ``timeoutSeconds`` passed: ``Job timed out after N
seconds``), or CANCELED. Like the Hub, the API reports no exit code field.

What is known only from the client, not from Hub documentation, and is therefore a guess:
the wording of ERROR messages, and how ``secrets`` are echoed back (here: names with a masked
value, never the value). ``attempts`` is accepted and echoed as ``retry`` but a failed job is
not retried.

Everything a test may want to check is kept: ``jobs`` (id -> ``Job``, with the exact ``spec``
the client posted) and ``requests`` (method, path, status) in order.
"""

from __future__ import annotations

import json
import os
import secrets as pysecrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit


def _gpu(model: str, count: int, vram_gb: int) -> dict[str, str]:
    return {"type": "gpu", "model": model, "quantity": str(count), "vram": f"{vram_gb} GB",
            "manufacturer": "Nvidia"}  # fmt: skip


#: (name, pretty name, cpu, ram, accelerator or None, USD per hour), as published on
#: https://huggingface.co/docs/hub/jobs-pricing (read 2026-11-23)
HARDWARE: tuple[tuple[str, str, str, str, dict[str, str] | None, float], ...] = (
    ("cpu-basic", "CPU Basic", "2 vCPU", "16 GB", None, 0.01),
    ("cpu-upgrade", "CPU Upgrade", "8 vCPU", "32 GB", None, 0.03),
    ("cpu-xl", "CPU XL", "16 vCPU", "124 GB", None, 1.00),
    ("cpu-performance", "CPU Performance", "32 vCPU", "256 GB", None, 1.90),
    ("t4-small", "Nvidia T4 - small", "4 vCPU", "15 GB", _gpu("T4", 1, 16), 0.40),
    ("t4-medium", "Nvidia T4 - medium", "8 vCPU", "30 GB", _gpu("T4", 1, 16), 0.60),
    ("l4x1", "1x Nvidia L4", "8 vCPU", "30 GB", _gpu("L4", 1, 24), 0.80),
    ("l4x4", "4x Nvidia L4", "48 vCPU", "186 GB", _gpu("L4", 4, 96), 3.80),
    ("l40sx1", "1x Nvidia L40S", "8 vCPU", "62 GB", _gpu("L40S", 1, 48), 1.80),
    ("l40sx4", "4x Nvidia L40S", "48 vCPU", "382 GB", _gpu("L40S", 4, 192), 8.30),
    ("l40sx8", "8x Nvidia L40S", "192 vCPU", "1534 GB", _gpu("L40S", 8, 384), 23.50),
    ("a10g-small", "Nvidia A10G - small", "4 vCPU", "15 GB", _gpu("A10G", 1, 24), 1.00),
    ("a10g-large", "Nvidia A10G - large", "12 vCPU", "46 GB", _gpu("A10G", 1, 24), 1.50),
    ("a10g-largex2", "2x Nvidia A10G - large", "24 vCPU", "92 GB", _gpu("A10G", 2, 48), 3.00),
    ("a10g-largex4", "4x Nvidia A10G - large", "48 vCPU", "184 GB", _gpu("A10G", 4, 96), 5.00),
    ("a100-large", "Nvidia A100 - large", "12 vCPU", "142 GB", _gpu("A100", 1, 80), 2.50),
    ("a100x4", "4x Nvidia A100 - large", "48 vCPU", "568 GB", _gpu("A100", 4, 320), 10.00),
    ("a100x8", "8x Nvidia A100 - large", "96 vCPU", "1136 GB", _gpu("A100", 8, 640), 20.00),
    ("h200", "Nvidia H200", "23 vCPU", "256 GB", _gpu("H200", 1, 141), 5.00),
    ("h200x2", "2x Nvidia H200", "46 vCPU", "512 GB", _gpu("H200", 2, 282), 10.00),
    ("h200x4", "4x Nvidia H200", "92 vCPU", "1024 GB", _gpu("H200", 4, 564), 20.00),
    ("h200x8", "8x Nvidia H200", "184 vCPU", "2048 GB", _gpu("H200", 8, 1128), 40.00),
    ("rtx-pro-6000", "Nvidia RTX PRO 6000", "23 vCPU", "256 GB", _gpu("RTX PRO 6000", 1, 96),
     2.75),
    ("rtx-pro-6000x2", "2x Nvidia RTX PRO 6000", "46 vCPU", "512 GB",
     _gpu("RTX PRO 6000", 2, 192), 5.50),
    ("rtx-pro-6000x4", "4x Nvidia RTX PRO 6000", "92 vCPU", "1024 GB",
     _gpu("RTX PRO 6000", 4, 384), 11.00),
    ("rtx-pro-6000x8", "8x Nvidia RTX PRO 6000", "184 vCPU", "2048 GB",
     _gpu("RTX PRO 6000", 8, 768), 22.00),
)  # fmt: skip
TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
GRACE_S = 3.0  # SIGTERM -> SIGKILL on cancel or timeout, like a container runtime's stop


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Job:
    id: str
    namespace: str
    owner: dict[str, str]
    spec: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    stage: str = "SCHEDULING"
    message: str | None = None
    exit_code: int | None = None  # kept for tests; never sent (the Hub reports none)
    logs: list[tuple[float, str]] = field(default_factory=list)
    output_closed: bool = False
    popen: subprocess.Popen[bytes] | None = None
    workdir: str = ""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def info(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {
            "id": self.id,
            "createdAt": _iso(self.created_at),
            "dockerImage": spec.get("dockerImage"),
            "spaceId": spec.get("spaceId"),
            "command": spec.get("command"),
            "arguments": spec.get("arguments", []),
            "environment": dict(spec.get("environment") or {}),
            "secrets": {k: "********" for k in spec.get("secrets") or {}},
            "flavor": spec.get("flavor"),
            "labels": dict(spec.get("labels") or {}) or None,
            "status": {"stage": self.stage, "message": self.message},
            "owner": self.owner,
            "retry": max(0, int(spec.get("attempts") or 1) - 1),
        }
        if self.started_at is not None:
            out["startedAt"] = _iso(self.started_at)
        if self.finished_at is not None:
            out["finishedAt"] = _iso(self.finished_at)
        return out


class HFJobsEmulator:
    """The server. ``tokens`` maps accepted tokens to user names; ``orgs`` maps a user to the
    organisations (namespaces) it may run jobs in."""

    def __init__(
        self,
        tokens: dict[str, str] | None = None,
        orgs: dict[str, list[str]] | None = None,
        *,
        start_delay_s: float = 0.0,
    ) -> None:
        self.tokens = dict(tokens or {"hf_emulator_token_0123456789": "crf-tester"})
        self.orgs = {k: list(v) for k, v in (orgs or {}).items()}
        self.start_delay_s = start_delay_s
        self.jobs: dict[str, Job] = {}
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._tmp = tempfile.mkdtemp(prefix="crf-hfjobs-emu-")

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HFJobsEmulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        for job in list(self.jobs.values()):
            self._kill(job, grace_s=0.5)
        self._httpd.shutdown()
        self._httpd.server_close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> HFJobsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def _create(self, ns: str, user: str, spec: dict[str, Any]) -> Job:
        owner_type = "user" if ns == user else "org"
        job = Job(
            id=pysecrets.token_hex(12),
            namespace=ns,
            owner={"id": f"id-{ns}", "name": ns, "type": owner_type},
            spec=spec,
        )
        job.workdir = tempfile.mkdtemp(prefix=f"job-{job.id}-", dir=self._tmp)
        with self._lock:
            self.jobs[job.id] = job
        threading.Thread(target=self._run, args=(job,), daemon=True).start()
        return job

    def _append(self, job: Job, line: str) -> None:
        with job.cond:
            job.logs.append((time.time(), line))
            job.cond.notify_all()

    def _finish(self, job: Job, stage: str, message: str | None) -> None:
        with job.cond:
            if job.stage not in TERMINAL:
                job.stage, job.message = stage, message
                job.finished_at = time.time()
            job.cond.notify_all()

    def _run(self, job: Job) -> None:
        if self.start_delay_s:
            time.sleep(self.start_delay_s)
        spec = job.spec
        argv = [str(a) for a in [*(spec.get("command") or []), *(spec.get("arguments") or [])]]
        env = {
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
            "HOME": os.environ.get("HOME", job.workdir),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
        }
        env.update({str(k): str(v) for k, v in (spec.get("environment") or {}).items()})
        env.update({str(k): str(v) for k, v in (spec.get("secrets") or {}).items()})
        with job.cond:
            if job.stage in TERMINAL:  # cancelled while scheduling
                job.output_closed = True
                job.cond.notify_all()
                return
            job.stage, job.started_at = "RUNNING", time.time()
        self._append(job, f"===== Job started at {_iso(time.time())} =====")
        try:
            job.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=job.workdir,
                start_new_session=True,
            )
        except OSError as e:
            self._append(job, f"exec failed: {e}")
            self._finish(job, "ERROR", f"Job failed to start: {e}")
            with job.cond:
                job.output_closed = True
                job.cond.notify_all()
            return
        timeout = spec.get("timeoutSeconds")
        if timeout:
            timer = threading.Timer(float(timeout), self._time_out, args=(job, int(timeout)))
            timer.daemon = True
            timer.start()
        assert job.popen.stdout is not None
        for raw in job.popen.stdout:
            self._append(job, raw.decode("utf-8", errors="replace").rstrip("\n"))
        code = job.popen.wait()
        job.exit_code = code
        if code == 0:
            self._finish(job, "COMPLETED", None)
        else:
            self._finish(job, "ERROR", f"Job failed with exit code: {code}")
        with job.cond:
            job.output_closed = True
            job.cond.notify_all()

    def _time_out(self, job: Job, seconds: int) -> None:
        if job.stage in TERMINAL:
            return
        self._finish(job, "ERROR", f"Job timed out after {seconds} seconds")
        self._kill(job)

    def _kill(self, job: Job, grace_s: float = GRACE_S) -> None:
        p = job.popen
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def cancel(self, job: Job) -> None:
        self._finish(job, "CANCELED", "Job canceled by user")
        threading.Thread(target=self._kill, args=(job,), daemon=True).start()

    # ------------------------------------------------------------------ http
    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        emu = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection; streams end on close

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                with emu._lock:
                    emu.requests.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _user(self) -> str | None:
                auth = self.headers.get("Authorization", "")
                token = auth[7:] if auth.startswith("Bearer ") else ""
                user = emu.tokens.get(token)
                if user is None:
                    self._send(401, {"error": "Invalid credentials in Authorization header"})
                return user

            def _route(self) -> tuple[list[str], dict[str, list[str]]]:
                parts = urlsplit(self.path)
                query: dict[str, list[str]] = {}
                for k, v in parse_qsl(parts.query, keep_blank_values=True):
                    query.setdefault(k, []).append(v)
                return [p for p in parts.path.split("/") if p], query

            def _job(self, ns: str, job_id: str) -> Job | None:
                job = emu.jobs.get(job_id)
                if job is None or job.namespace != ns:
                    self._send(404, {"error": f"Job {job_id} not found"})
                    return None
                return job

            def _may_use(self, user: str, ns: str) -> bool:
                if ns == user or ns in emu.orgs.get(user, []):
                    return True
                self._send(403, {"error": f"You don't have access to namespace {ns}"})
                return False

            def do_GET(self) -> None:  # noqa: N802
                path, query = self._route()
                user = self._user()
                if user is None:
                    return
                if path == ["api", "whoami-v2"]:
                    orgs = [{"name": o, "type": "org"} for o in emu.orgs.get(user, [])]
                    self._send(200, {"type": "user", "id": f"id-{user}", "name": user,
                                     "fullname": user, "orgs": orgs,
                                     "auth": {"type": "access_token",
                                              "accessToken": {"displayName": "emulator",
                                                              "role": "write"}}})  # fmt: skip
                elif path == ["api", "jobs", "hardware"]:
                    self._send(200, [
                        {"name": n, "prettyName": p, "cpu": c, "ram": r, "accelerator": a,
                         "ephemeralStorage": "50 GB", "unitCostMicroUSD": round(usd / 60 * 1e6),
                         "unitCostUSD": usd / 60, "unitLabel": "minute"}
                        for n, p, c, r, a, usd in HARDWARE
                    ])  # fmt: skip
                elif len(path) == 3 and path[:2] == ["api", "jobs"]:
                    if not self._may_use(user, path[2]):
                        return
                    labels = [tuple(v.split("=", 1)) for v in query.get("label", []) if "=" in v]
                    stages = set(query.get("stage", []))
                    out = []
                    for job in list(emu.jobs.values()):
                        job_labels = job.spec.get("labels") or {}
                        if job.namespace != path[2]:
                            continue
                        if any(job_labels.get(k) != v for k, v in labels):
                            continue
                        if stages and job.stage not in stages:
                            continue
                        out.append(job.info())
                    self._send(200, out)
                elif len(path) == 4 and path[:2] == ["api", "jobs"]:
                    job = self._job(path[2], path[3])
                    if job is not None:
                        self._send(200, job.info())
                elif len(path) == 5 and path[:2] == ["api", "jobs"] and path[4] == "logs":
                    job = self._job(path[2], path[3])
                    if job is not None:
                        self._stream_logs(job)
                else:
                    self._send(404, {"error": f"no route GET {self.path}"})

            def _stream_logs(self, job: Job) -> None:
                with emu._lock:
                    emu.requests.append((self.command, self.path, 200))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                sent = 0
                try:
                    while True:
                        with job.cond:
                            while sent >= len(job.logs) and not job.output_closed:
                                if job.stage in TERMINAL and job.popen is None:
                                    break  # ended without ever running (cancelled early)
                                job.cond.wait(timeout=1.0)
                            batch = job.logs[sent:]
                            done = job.output_closed or (
                                job.stage in TERMINAL and job.popen is None
                            )
                        for ts, line in batch:
                            event = json.dumps({"data": line, "timestamp": _iso(ts)})
                            self.wfile.write(f"data: {event}\n\n".encode())
                        self.wfile.flush()
                        sent += len(batch)
                        if done and sent >= len(job.logs):
                            return
                except (BrokenPipeError, ConnectionResetError):
                    return

            def do_POST(self) -> None:  # noqa: N802
                path, _ = self._route()
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                user = self._user()
                if user is None:
                    return
                if len(path) == 3 and path[:2] == ["api", "jobs"]:
                    if not self._may_use(user, path[2]):
                        return
                    try:
                        spec = json.loads(raw or b"{}")
                    except json.JSONDecodeError:
                        self._send(400, {"error": "body is not JSON"})
                        return
                    flavors = [h[0] for h in HARDWARE]
                    if spec.get("flavor") not in flavors:
                        self._send(
                            400,
                            {
                                "error": f"Invalid flavor {spec.get('flavor')!r}; "
                                f"expected one of {', '.join(flavors)}"
                            },
                        )
                        return  # fmt: skip
                    if not (spec.get("dockerImage") or spec.get("spaceId")):
                        self._send(400, {"error": "dockerImage or spaceId is required"})
                        return
                    if not spec.get("command"):
                        self._send(400, {"error": "command is required"})
                        return
                    job = emu._create(path[2], user, spec)
                    self._send(200, job.info())
                elif len(path) == 5 and path[:2] == ["api", "jobs"] and path[4] == "cancel":
                    job = self._job(path[2], path[3])
                    if job is not None:
                        emu.cancel(job)
                        self._send(200, {})
                else:
                    self._send(404, {"error": f"no route POST {self.path}"})

        return Handler


__all__ = ["HARDWARE", "HFJobsEmulator", "Job"]
