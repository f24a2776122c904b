"""A fake Modal control plane (gRPC) for tests, pinned to the ``modal`` client 1.6.4.

Modal has no local emulator and no HTTP API to replay, so this is a *fake*: a grpclib server
that answers the RPCs of ``modal_proto.api_grpc.ModalClientBase`` (and of the V2 sandboxes'
``TaskCommandRouter``, served on the same port) that the official client calls when crf
creates, polls, lists, tags, reads and terminates Sandboxes. Point the client at it with
``MODAL_SERVER_URL=http://127.0.0.1:PORT`` and any ``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET``.

What it does, and what it does not:

* Each Sandbox's command runs as a LOCAL SUBPROCESS (its own process group, in a fresh
  temporary folder). The "image" is the host environment: ``PATH`` starts with the folder of
  this Python, so ``python`` is the test virtualenv's interpreter; nothing of the image
  definition is built (``ImageGetOrCreate`` only records it and answers "built"). The process
  gets ``PATH``/``HOME``/``LANG`` and the Sandbox's secrets and ``env`` - never the test
  process's own environment, so a replica reaches a store only with the credentials that
  travelled through the Modal API.
* Output is kept per stream and served by ``SandboxGetLogs`` (V1 sandboxes: GPU ones) and by
  the command router's ``SandboxStdioReadV2`` (V2 sandboxes: the client's default for CPU).
* ``timeout_secs`` is enforced (result TIMEOUT, exit 124 on the client); ``SandboxTerminate``
  SIGTERMs the group, SIGKILLs it after a grace period (result TERMINATED, exit 137).
* Tokens are checked on every control-plane call; a wrong one is answered UNAUTHENTICATED
  (the real service does the same), so ``modal``'s ``AuthError`` can be tested.
* Every other RPC fails loudly (UNIMPLEMENTED) and is recorded in ``unimplemented``: a test
  that sees one has found a call the fake does not cover, not a behaviour of Modal.

Everything the client sent that a test may want to check is recorded: ``secrets`` (id -> env
dict from ``SecretGetOrCreate``), each sandbox's ``definition`` (the ``api_pb2.Sandbox``),
its inline ``secret_sources`` (V2), ``images`` and ``calls`` (RPC names in order).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets as pysecrets
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from grpclib.server import Server, Stream
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as sr_pb2

#: the image builder version the fake environment reports (one modal 1.6.4 supports)
IMAGE_BUILDER_VERSION = "2025.06"
_ALNUM = string.ascii_letters + string.digits
_GRACE_S = 3.0  # SIGTERM -> SIGKILL, like a container runtime's stop timeout


def _v1_id() -> str:
    """``sb-`` + 22 alphanumerics: the shape modal uses to route a sandbox id to V1."""
    return "sb-" + "".join(pysecrets.choice(_ALNUM) for _ in range(22))


def _v2_id() -> str:
    return "sb-v2-" + pysecrets.token_hex(8)


def _jwt(sub: str, ttl_s: float = 3600.0) -> str:
    """An unsigned JWT-shaped token with ``exp`` (the client reads exp, never the signature)."""

    def enc(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{enc({'alg': 'none'})}.{enc({'sub': sub, 'exp': int(time.time() + ttl_s)})}.sig"


@dataclass
class FakeSandbox:
    """One sandbox: what the client asked for, and the local process that plays it."""

    id: str
    task_id: str
    app_id: str
    v2: bool
    definition: api_pb2.Sandbox
    env: dict[str, str]  # everything the process got from secrets and env, merged
    secret_sources: list[dict[str, Any]]  # V2 inline sources / V1 secret ids, as sent
    tags: dict[str, str]
    created_at: float = field(default_factory=time.time)
    proc: subprocess.Popen[bytes] | None = None
    out: dict[int, bytearray] = field(default_factory=lambda: {1: bytearray(), 2: bytearray()})
    result: api_pb2.GenericResult | None = None
    terminated: bool = False
    timed_out: bool = False
    cwd: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def argv(self) -> list[str]:
        return list(self.definition.entrypoint_args)

    @property
    def done(self) -> bool:
        return self.result is not None

    def output(self, fd: int) -> str:
        return self.out[fd].decode("utf-8", errors="replace")


class FakeModal:
    """The fake service: start() it, point MODAL_SERVER_URL at ``url``, stop() it."""

    def __init__(self, token_id: str = "ak-fake", token_secret: str = "as-fake") -> None:
        self.token_id = token_id
        self.token_secret = token_secret
        self.apps: dict[str, str] = {}  # (env/name) -> app id
        self.secrets: dict[str, dict[str, str]] = {}
        self.images: dict[str, api_pb2.Image] = {}
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.calls: list[str] = []
        self.unimplemented: list[str] = []
        self.rejected: list[str] = []  # RPCs refused for a bad token
        self.auth_tokens: set[str] = set()
        self.router_jwts: set[str] = set()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeModal:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                server = Server([_control_plane(self), _router(self)])
                loop.run_until_complete(server.start("127.0.0.1", 0))
                self._server = server
                self.port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as e:  # surface a bind failure to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            server.close()
            loop.run_until_complete(server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-modal", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        for sb in list(self.sandboxes.values()):
            self.terminate(sb, grace_s=0.5)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        for sb in self.sandboxes.values():
            if sb.cwd:
                shutil.rmtree(sb.cwd, ignore_errors=True)

    # ------------------------------------------------------------------ auth
    def check_token(self, stream: Stream[Any, Any], method: str) -> None:
        md = stream.metadata or {}
        token_id, secret = md.get("x-modal-token-id"), md.get("x-modal-token-secret")
        if token_id != self.token_id or secret != self.token_secret:
            self.rejected.append(method)
            raise GRPCError(
                Status.UNAUTHENTICATED,
                f"Token ID {token_id!r} is invalid or expired (fake modal servicer)",
            )

    # ------------------------------------------------------------------ sandboxes
    def create_sandbox(
        self,
        app_id: str,
        definition: api_pb2.Sandbox,
        tags: list[api_pb2.SandboxTag],
        env: dict[str, str],
        sources: list[dict[str, Any]],
        *,
        v2: bool,
    ) -> FakeSandbox:
        sid = _v2_id() if v2 else _v1_id()
        sb = FakeSandbox(
            id=sid,
            task_id=("ta-v2-" if v2 else "ta-") + pysecrets.token_hex(8),
            app_id=app_id,
            v2=v2,
            definition=definition,
            env=env,
            secret_sources=sources,
            tags={t.tag_name: t.tag_value for t in tags},
        )
        self.sandboxes[sid] = sb
        self._spawn(sb)
        return sb

    def _spawn(self, sb: FakeSandbox) -> None:
        sb.cwd = tempfile.mkdtemp(prefix=f"fake-modal-{sb.id}-")
        base = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR") if k in os.environ}
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        env = {**base, "PATH": path, **sb.env}
        argv = sb.argv or ["sleep", "infinity"]
        try:
            sb.proc = subprocess.Popen(
                argv,
                cwd=sb.definition.workdir or sb.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            sb.out[2] += f"fake modal: cannot start {argv[0]!r}: {e}\n".encode()
            sb.result = api_pb2.GenericResult(
                status=api_pb2.GenericResult.GENERIC_STATUS_FAILURE, exitcode=127, exception=str(e)
            )
            return
        readers = [
            threading.Thread(target=self._pump, args=(sb, fd, pipe), daemon=True)
            for fd, pipe in ((1, sb.proc.stdout), (2, sb.proc.stderr))
        ]
        for t in readers:
            t.start()
        threading.Thread(target=self._reap, args=(sb, readers), daemon=True).start()
        timeout = sb.definition.timeout_secs or 300
        timer = threading.Timer(timeout, self._time_out, args=(sb,))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _pump(sb: FakeSandbox, fd: int, pipe: Any) -> None:
        while True:
            chunk = pipe.read1(1 << 16)
            if not chunk:
                return
            with sb.lock:
                sb.out[fd] += chunk

    @staticmethod
    def _reap(sb: FakeSandbox, readers: list[threading.Thread]) -> None:
        assert sb.proc is not None
        code = sb.proc.wait()
        for t in readers:
            t.join()
        G = api_pb2.GenericResult
        if sb.timed_out:
            result = G(status=G.GENERIC_STATUS_TIMEOUT, exception="Sandbox timed out")
        elif sb.terminated:
            result = G(status=G.GENERIC_STATUS_TERMINATED, exception="Sandbox terminated")
        elif code == 0:
            result = G(status=G.GENERIC_STATUS_SUCCESS, exitcode=0)
        else:
            result = G(status=G.GENERIC_STATUS_FAILURE, exitcode=code if code > 0 else 128 - code)
        with sb.lock:
            sb.result = result

    def _time_out(self, sb: FakeSandbox) -> None:
        if not sb.done:
            sb.timed_out = True
            self._kill(sb, grace_s=0.0)

    def terminate(self, sb: FakeSandbox, grace_s: float = _GRACE_S) -> None:
        if sb.done:
            return
        sb.terminated = True
        threading.Thread(target=self._kill, args=(sb, grace_s), daemon=True).start()

    @staticmethod
    def _kill(sb: FakeSandbox, grace_s: float) -> None:
        if sb.proc is None:
            return
        pgid = sb.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while grace_s > 0 and time.monotonic() < deadline and sb.proc.poll() is None:
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def sandbox(self, sandbox_id: str) -> FakeSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sb

    def by_task(self, task_id: str) -> FakeSandbox:
        for sb in self.sandboxes.values():
            if sb.task_id == task_id:
                return sb
        raise GRPCError(Status.NOT_FOUND, f"task {task_id} not found")

    def info(self, sb: FakeSandbox) -> api_pb2.SandboxInfo:
        return api_pb2.SandboxInfo(
            id=sb.id,
            app_id=sb.app_id,
            created_at=sb.created_at,
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()],
            task_info=api_pb2.TaskInfo(id=sb.task_id, result=sb.result),
            timeout_secs=sb.definition.timeout_secs,
            metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id, result=sb.result),
        )

    async def wait_result(self, sb: FakeSandbox, timeout: float) -> api_pb2.GenericResult | None:
        deadline = time.monotonic() + min(timeout, 50.0)
        while not sb.done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return sb.result


# ---------------------------------------------------------------------------- control plane
def _unimplemented(name: str) -> Callable[..., Any]:
    async def handler(self: Any, stream: Stream[Any, Any]) -> None:
        self.fake.unimplemented.append(name)
        raise GRPCError(
            Status.UNIMPLEMENTED,
            f"fake modal servicer: {name} is not implemented (the test reached a call the fake "
            "does not cover)",
        )

    handler.__name__ = name
    return handler


class _ControlPlane(api_grpc.ModalClientBase):
    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake

    async def _req(self, stream: Stream[Any, Any], name: str) -> Any:
        self.fake.calls.append(name)
        self.fake.check_token(stream, name)
        return await stream.recv_message()

    # -- session
    async def ClientHello(self, stream: Stream[Any, Any]) -> None:
        await self._req(stream, "ClientHello")
        await stream.send_message(api_pb2.ClientHelloResponse())

    async def AuthTokenGet(self, stream: Stream[Any, Any]) -> None:
        await self._req(stream, "AuthTokenGet")
        token = _jwt("fake-workspace")
        self.fake.auth_tokens.add(token)
        await stream.send_message(api_pb2.AuthTokenGetResponse(token=token))

    async def EnvironmentGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "EnvironmentGetOrCreate")
        name = req.deployment_name or "main"
        await stream.send_message(
            api_pb2.EnvironmentGetOrCreateResponse(
                environment_id=f"en-{name}",
                metadata=api_pb2.EnvironmentMetadata(
                    name=name,
                    settings=api_pb2.EnvironmentSettings(
                        image_builder_version=IMAGE_BUILDER_VERSION
                    ),
                ),
            )
        )

    async def AppGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "AppGetOrCreate")
        key = f"{req.environment_name or 'main'}/{req.app_name}"
        if key not in self.fake.apps:
            if req.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{req.app_name}' not found")
            self.fake.apps[key] = "ap-" + pysecrets.token_hex(8)
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=self.fake.apps[key]))

    async def SecretGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "SecretGetOrCreate")
        if req.object_creation_type not in (
            api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL,
            api_pb2.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP,
        ):  # named secrets (Secret.from_name) are not faked
            raise GRPCError(Status.NOT_FOUND, f"Secret '{req.deployment_name}' not found")
        sid = "st-" + pysecrets.token_hex(8)
        self.fake.secrets[sid] = dict(req.env_dict)
        await stream.send_message(api_pb2.SecretGetOrCreateResponse(secret_id=sid))

    # -- images: recorded, never built
    async def ImageGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "ImageGetOrCreate")
        iid = "im-" + pysecrets.token_hex(8)
        self.fake.images[iid] = req.image
        await stream.send_message(
            api_pb2.ImageGetOrCreateResponse(
                image_id=iid,
                result=api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS),
                metadata=api_pb2.ImageMetadata(image_builder_version=IMAGE_BUILDER_VERSION),
            )
        )

    async def ImageJoinStreaming(self, stream: Stream[Any, Any]) -> None:
        await self._req(stream, "ImageJoinStreaming")
        await stream.send_message(
            api_pb2.ImageJoinStreamingResponse(
                result=api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS),
                eof=True,
            )
        )

    # -- sandboxes, V1 (GPU) and V2 (CPU) flavours
    async def SandboxCreate(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "SandboxCreate")
        env: dict[str, str] = {}
        sources = []
        for sid in req.definition.secret_ids:
            if sid not in self.fake.secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret {sid} not found")
            env.update(self.fake.secrets[sid])
            sources.append({"secret_id": sid, "keys": sorted(self.fake.secrets[sid])})
        sb = self.fake.create_sandbox(
            req.app_id, req.definition, list(req.tags), env, sources, v2=False
        )
        await stream.send_message(
            api_pb2.SandboxCreateResponse(
                sandbox_id=sb.id, metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id)
            )
        )

    async def SandboxCreateV2(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "SandboxCreateV2")
        env: dict[str, str] = {}
        sources: list[dict[str, Any]] = []
        for sid in req.definition.secret_ids:
            env.update(self.fake.secrets[sid])
            sources.append({"secret_id": sid, "keys": sorted(self.fake.secrets[sid])})
        for src in req.secret_sources:
            if src.secret_id:
                if src.secret_id not in self.fake.secrets:
                    raise GRPCError(Status.NOT_FOUND, f"Secret {src.secret_id} not found")
                env.update(self.fake.secrets[src.secret_id])
                sources.append({"secret_id": src.secret_id})
            else:
                contents = dict(src.env.contents)
                env.update(contents)
                sources.append({"env": contents})
        sb = self.fake.create_sandbox(
            req.app_id, req.definition, list(req.tags), env, sources, v2=True
        )
        jwt = _jwt(sb.task_id)
        self.fake.router_jwts.add(jwt)
        await stream.send_message(
            api_pb2.SandboxCreateV2Response(
                sandbox_id=sb.id,
                task_id=sb.task_id,
                metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id),
                command_router_access=api_pb2.CommandRouterAccess(url=self.fake.url, jwt=jwt),
            )
        )

    async def _get_task_id(self, stream: Stream[Any, Any], name: str) -> None:
        req = await self._req(stream, name)
        sb = self.fake.sandbox(req.sandbox_id)
        await stream.send_message(
            api_pb2.SandboxGetTaskIdResponse(task_id=sb.task_id, task_result=sb.result)
        )

    async def SandboxGetTaskId(self, stream: Stream[Any, Any]) -> None:
        await self._get_task_id(stream, "SandboxGetTaskId")

    async def SandboxGetTaskIdV2(self, stream: Stream[Any, Any]) -> None:
        await self._get_task_id(stream, "SandboxGetTaskIdV2")

    async def SandboxGetCommandRouterAccess(self, stream: Stream[Any, Any]) -> None:
        req = await self._req(stream, "SandboxGetCommandRouterAccess")
        sb = self.fake.sandbox(req.sandbox_id) if req.sandbox_id else self.fake.by_task(req.task_id)
        jwt = _jwt(sb.task_id)
        self.fake.router_jwts.add(jwt)
        await stream.send_message(
            api_pb2.SandboxGetCommandRouterAccessResponse(url=self.fake.url, jwt=jwt)
        )

    async def _wait(self, stream: Stream[Any, Any], name: str) -> None:
        req = await self._req(stream, name)
        sb = self.fake.sandbox(req.sandbox_id)
        result = await self.fake.wait_result(sb, req.timeout)
        await stream.send_message(
            api_pb2.SandboxWaitResponse(
                result=result, metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id)
            )
        )

    async def SandboxWait(self, stream: Stream[Any, Any]) -> None:
        await self._wait(stream, "SandboxWait")

    async def SandboxWaitV2(self, stream: Stream[Any, Any]) -> None:
        await self._wait(stream, "SandboxWaitV2")

    async def _terminate(self, stream: Stream[Any, Any], name: str, resp: Any) -> None:
        req = await self._req(stream, name)
        sb = self.fake.sandbox(req.sandbox_id)
        existing = sb.result
        self.fake.terminate(sb)
        await stream.send_message(resp(existing_result=existing))

    async def SandboxTerminate(self, stream: Stream[Any, Any]) -> None:
        await self._terminate(stream, "SandboxTerminate", api_pb2.SandboxTerminateResponse)

    async def SandboxTerminateV2(self, stream: Stream[Any, Any]) -> None:
        await self._terminate(stream, "SandboxTerminateV2", api_pb2.SandboxTerminateResponse)

    async def _list(self, stream: Stream[Any, Any], name: str) -> None:
        req = await self._req(stream, name)
        want = {t.tag_name: t.tag_value for t in req.tags}
        rows = [
            sb
            for sb in self.fake.sandboxes.values()
            if (not req.app_id or sb.app_id == req.app_id)
            and (req.include_finished or not sb.done)
            and all(sb.tags.get(k) == v for k, v in want.items())
            and (not req.before_timestamp or sb.created_at < req.before_timestamp)
        ]
        rows.sort(key=lambda sb: sb.created_at, reverse=True)
        await stream.send_message(
            api_pb2.SandboxListResponse(sandboxes=[self.fake.info(sb) for sb in rows[:50]])
        )

    async def SandboxList(self, stream: Stream[Any, Any]) -> None:
        await self._list(stream, "SandboxList")

    async def SandboxListV2(self, stream: Stream[Any, Any]) -> None:
        await self._list(stream, "SandboxListV2")

    async def _tags_get(self, stream: Stream[Any, Any], name: str, resp: Any) -> None:
        req = await self._req(stream, name)
        sb = self.fake.sandbox(req.sandbox_id)
        tags = [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()]
        await stream.send_message(resp(tags=tags))

    async def SandboxTagsGet(self, stream: Stream[Any, Any]) -> None:
        await self._tags_get(stream, "SandboxTagsGet", api_pb2.SandboxTagsGetResponse)

    async def SandboxTagsGetV2(self, stream: Stream[Any, Any]) -> None:
        await self._tags_get(stream, "SandboxTagsGetV2", api_pb2.SandboxTagsGetResponse)

    async def _tags_set(self, stream: Stream[Any, Any], name: str, resp: Any) -> None:
        req = await self._req(stream, name)
        sb = self.fake.sandbox(req.sandbox_id)
        sb.tags = {t.tag_name: t.tag_value for t in req.tags}
        await stream.send_message(resp())

    async def SandboxTagsSet(self, stream: Stream[Any, Any]) -> None:
        await self._tags_set(stream, "SandboxTagsSet", empty_pb2.Empty)

    async def SandboxTagsSetV2(self, stream: Stream[Any, Any]) -> None:
        await self._tags_set(stream, "SandboxTagsSetV2", empty_pb2.Empty)

    async def SandboxGetLogs(self, stream: Stream[Any, Any]) -> None:
        """V1 output: batches after ``last_entry_id`` (a byte offset here), then ``eof``."""
        req = await self._req(stream, "SandboxGetLogs")
        sb = self.fake.sandbox(req.sandbox_id)
        fd = 2 if req.file_descriptor == api_pb2.FILE_DESCRIPTOR_STDERR else 1
        offset = int(req.last_entry_id or 0)
        deadline = time.monotonic() + (req.timeout or 55)
        decoder_tail = b""
        while time.monotonic() < deadline:
            with sb.lock:
                data, done = bytes(sb.out[fd][offset:]), sb.done
            if data:
                offset += len(data)
                text, decoder_tail = _decode(decoder_tail + data)
                item = api_pb2.TaskLogs(data=text, file_descriptor=req.file_descriptor)
                await stream.send_message(
                    api_pb2.TaskLogsBatch(
                        task_id=sb.task_id, items=[item], entry_id=str(offset - len(decoder_tail))
                    )
                )
                continue
            if done:
                await stream.send_message(
                    api_pb2.TaskLogsBatch(task_id=sb.task_id, entry_id=str(offset), eof=True)
                )
                return
            await asyncio.sleep(0.05)


def _decode(data: bytes) -> tuple[str, bytes]:
    """UTF-8 text of ``data`` and the bytes of a character cut at its end."""
    for cut in range(0, 4):
        try:
            return data[: len(data) - cut].decode("utf-8"), data[len(data) - cut :]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""


def _control_plane(fake: FakeModal) -> _ControlPlane:
    for name in _ControlPlane.__abstractmethods__:
        setattr(_ControlPlane, name, _unimplemented(name))
    _ControlPlane.__abstractmethods__ = frozenset()
    return _ControlPlane(fake)


# ---------------------------------------------------------------------------- command router
class _Router(task_command_router_grpc.TaskCommandRouterBase):
    """The worker-side service V2 sandboxes stream their stdio from (same port here)."""

    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake

    async def SandboxStdioReadV2(self, stream: Stream[Any, Any]) -> None:
        self.fake.calls.append("SandboxStdioReadV2")
        md = stream.metadata or {}
        auth = str(md.get("authorization", ""))
        if auth.removeprefix("Bearer ") not in self.fake.router_jwts:
            raise GRPCError(Status.UNAUTHENTICATED, "bad command router token")
        req = await stream.recv_message()
        sb = self.fake.by_task(req.task_id)
        fd = 2 if req.file_descriptor == sr_pb2.SANDBOX_STDIO_FILE_DESCRIPTOR_STDERR else 1
        offset = req.offset
        while True:
            with sb.lock:
                data, done = bytes(sb.out[fd][offset:]), sb.done
            if data:
                await stream.send_message(
                    sr_pb2.SandboxStdioReadV2Response(data=data, starting_offset=offset)
                )
                offset += len(data)
                continue
            if done:
                return  # the end of the stream is the end of the output
            await asyncio.sleep(0.05)


def _router(fake: FakeModal) -> _Router:
    for name in _Router.__abstractmethods__:
        setattr(_Router, name, _unimplemented(name))
    _Router.__abstractmethods__ = frozenset()
    return _Router(fake)


__all__ = ["IMAGE_BUILDER_VERSION", "FakeModal", "FakeSandbox"]
