"""The sandbox server: one per sandbox pod, runs a rollout's tool calls.

Who may call: the run-wide token opens only the control call (`/v1/reset`), which the
gateway makes; execs and file calls need the secret of the lease the sandbox is under now
(a capability the gateway hands to one group). A reset revokes that secret first, then
kills every process and waits until they are dead, wipes the workspace and only then
installs the next lease's secret, so nothing a group started can run once the next group
holds the sandbox. An exec records the lease generation it was admitted under and checks it
again when it gets its slot, right before the fork (`LeaseGate`).

Everything a request may ask for is bounded by the server's own settings (timeout, output,
body size, concurrency); a request can lower them, never raise them. Commands get a clean
environment built here (never the server's own, which holds the token), run under the
limits in `process.CommandLimits`. Anything a command or client can cause (a FIFO, a symlink
swapped mid-call, a full disk, malformed or deeply nested JSON) is a 4xx with a reason.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import errno
import hashlib
import hmac
import os
import re
import shutil
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncgrpo.sandbox.cgroup import CommandCgroup
from asyncgrpo.sandbox.http_guard import Grant, GuardMiddleware, Refused, grant_of, parse_body
from asyncgrpo.sandbox.metrics import SandboxMetrics
from asyncgrpo.sandbox.process import CommandLimits, Revoked, Runner, use_pidfd_child_watcher
from asyncgrpo.sandbox.workspace import PathRefused, Workspace

DEFAULT_COMMAND_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


@dataclass
class ServerSettings:
    """The server's limits; see `asyncgrpo sandbox serve --help` for each flag."""

    workspace: str
    token: str
    template: str | None = None
    max_timeout_seconds: float = 600.0
    default_timeout_seconds: float = 60.0
    max_output_bytes: int = 1 << 20  # kept per stream (head + tail)
    max_read_bytes: int = 8 << 20
    max_body_bytes: int = 4 << 20
    max_concurrent_execs: int = 64
    command_path: str = DEFAULT_COMMAND_PATH
    shell: str = "/bin/bash"
    limits: CommandLimits = field(default_factory=CommandLimits)
    cgroup: CommandCgroup | None = None  # memory and pids of all commands together, where possible


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExecRequest(_Strict):
    command: str | list[str] = Field(description="shell string (run by the server's shell) or argv")
    timeout_seconds: float | None = Field(None, gt=0)
    stdin: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="directory relative to the session directory")
    session: str | None = None
    max_output_bytes: int | None = Field(None, ge=0)
    output_encoding: Literal["utf-8", "base64"] = Field(
        "utf-8", description="base64: stdout/stderr exactly as written (binary-safe); utf-8: decoded, "
        "invalid bytes replaced")

    @field_validator("command")
    @classmethod
    def _non_empty(cls, v):
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            raise ValueError("command is empty")
        if isinstance(v, list) and any("\x00" in a for a in v) or isinstance(v, str) and "\x00" in v:
            raise ValueError("command contains NUL")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v):
        for k, val in v.items():
            if not _ENV_NAME.match(k) or "\x00" in val:
                raise ValueError(f"invalid environment variable {k!r}")
        return v


class ReadRequest(_Strict):
    path: str
    session: str | None = None
    max_bytes: int | None = Field(None, ge=0)
    encoding: Literal["utf-8", "base64"] = "utf-8"


class WriteRequest(_Strict):
    path: str
    content: str
    session: str | None = None
    encoding: Literal["utf-8", "base64"] = "utf-8"
    mode: int = Field(0o644, ge=0, le=0o777)


class ResetRequest(_Strict):
    lease_secret: str | None = Field(None, min_length=16, max_length=256,
                                     description="secret of the next lease, accepted once the reset is done")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _encode(data: bytes, encoding: str) -> str:
    return base64.b64encode(data).decode() if encoding == "base64" else _decode(data)


def _not_started(timeout: float, encoding: str) -> dict:
    note = f"not started: every exec slot stayed busy for the whole timeout ({timeout:g}s)\n".encode()
    return {"exit_code": None, "stdout": "", "stderr": _encode(note, encoding), "output_encoding": encoding,
            "stdout_truncated": False, "stderr_truncated": False, "stdout_bytes": 0,
            "stderr_bytes": len(note), "timed_out": True, "duration_seconds": round(timeout, 6)}


CONTROL_PATHS = frozenset({"/v1/reset"})
DATA_PATHS = frozenset({"/v1/exec", "/v1/files/read", "/v1/files/write"})


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class LeaseGate:
    """The current lease's secret and generation; the only place either changes.

    `generation` grows at every grant and every revocation, so a call admitted under one
    lease compares unequal forever after that lease ends, even if a later lease happened to
    reuse its secret. Revoked secrets are remembered (as digests) only to answer 410
    "lease_revoked" instead of 401, which tells a client its lease is over.
    """

    def __init__(self, token: str):
        self._token = token.encode()
        self.generation = 0
        self._secret: bytes | None = None
        self._revoked: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def grant(self, secret: str) -> int:
        self._secret = secret.encode()
        self.generation += 1
        return self.generation

    def revoke(self) -> None:
        if self._secret is not None:
            self._revoked[hashlib.sha256(self._secret).digest()] = None
            while len(self._revoked) > 1024:
                self._revoked.popitem(last=False)
        self._secret = None
        self.generation += 1

    @property
    def leased(self) -> bool:
        return self._secret is not None

    def current(self, generation: int) -> bool:
        return self._secret is not None and generation == self.generation

    def authorize(self, path: str, presented: str | None) -> Grant | None:
        if presented is None:
            return None
        if path in CONTROL_PATHS:
            return Grant("control") if hmac.compare_digest(presented.encode(), self._token) else None
        if path not in DATA_PATHS:
            return None  # 401 before a 404: unknown paths reveal nothing
        if self._secret is not None and hmac.compare_digest(presented.encode(), self._secret):
            return Grant("lease", self.generation)
        if _digest(presented) in self._revoked:
            raise Refused(410, "lease_revoked", "the lease this secret belonged to has ended")
        return None


def _os_error(err: OSError) -> HTTPException:
    """An OS error from the workspace (the state commands made) as a 4xx with its reason."""
    status, error = {
        errno.ENOENT: (404, "not_found"),
        errno.EACCES: (403, "permission_denied"),
        errno.EPERM: (403, "permission_denied"),
        errno.ENOSPC: (507, "no_space"),
        errno.EDQUOT: (507, "no_space"),
        errno.EFBIG: (413, "file_too_large"),
        errno.ELOOP: (400, "path_refused"),
        errno.ENOTDIR: (400, "path_refused"),
        errno.EISDIR: (400, "path_refused"),
        errno.ENXIO: (400, "path_refused"),
    }.get(err.errno, (409, "os_error"))
    return HTTPException(status, detail={"error": error, "detail": f"{errno.errorcode.get(err.errno, err.errno)}: "
                                                                   f"{err.strerror}"})


def _revoked() -> HTTPException:
    return HTTPException(410, detail={"error": "lease_revoked", "detail": "the lease of this call has ended"})


def create_app(settings: ServerSettings) -> FastAPI:
    limits = settings.limits
    workspace = Workspace(settings.workspace, settings.template, uid=limits.uid, gid=limits.gid)
    runner = Runner(limits, cgroup=settings.cgroup)
    metrics = SandboxMetrics()
    slots = asyncio.Semaphore(settings.max_concurrent_execs)
    started = time.monotonic()
    gate = LeaseGate(settings.token)
    reset_lock = asyncio.Lock()

    async def reaper():
        while True:
            await asyncio.sleep(2.0)
            await runner.reap()

    @asynccontextmanager
    async def lifespan(_app):
        use_pidfd_child_watcher()
        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()
            await runner.sweep()
            if settings.cgroup is not None:
                settings.cgroup.remove()

    app = FastAPI(title="asyncgrpo sandbox", lifespan=lifespan, docs_url=None, redoc_url=None)

    def refused(err: Exception, status: int = 400) -> HTTPException:
        return HTTPException(status, detail={"error": "path_refused", "detail": str(err)})

    @app.post("/v1/exec")
    async def exec_(request: Request):
        req = await parse_body(request, ExecRequest)
        generation = grant_of(request).generation
        timeout = min(req.timeout_seconds or settings.default_timeout_seconds, settings.max_timeout_seconds)
        cap = settings.max_output_bytes if req.max_output_bytes is None else min(
            req.max_output_bytes, settings.max_output_bytes
        )
        if not gate.current(generation):
            raise _revoked()
        try:
            home = workspace.session_dir(req.session)
            cwd = workspace.confined_dir(req.session, req.cwd)
        except PathRefused as err:
            raise refused(err) from err
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise HTTPException(400, detail={"error": "bad_cwd",
                                                 "detail": f"{req.cwd!r} is not a directory in the session"}) from err
            raise _os_error(err) from err
        argv = [settings.shell, "-c", req.command] if isinstance(req.command, str) else list(req.command)
        env = {
            "PATH": settings.command_path,
            "HOME": home,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONUNBUFFERED": "1",
            **req.env,
        }
        metrics.in_flight.inc()
        queued = time.monotonic()
        try:
            # the wait for a slot counts in the timeout: whoever called (the gateway, a
            # client) may treat silence past the timeout plus a small slack as a hung sandbox
            try:
                await asyncio.wait_for(slots.acquire(), timeout)
            except TimeoutError:
                metrics.execs.labels(outcome="timeout").inc()
                return _not_started(timeout, req.output_encoding)
            try:
                result = await runner.run(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=req.stdin.encode() if req.stdin is not None else None,
                    timeout=max(0.001, timeout - (time.monotonic() - queued)),
                    max_output_bytes=cap,
                    admit=lambda: gate.current(generation),
                )
            except Revoked as err:
                metrics.execs.labels(outcome="revoked").inc()
                raise _revoked() from err
            except (FileNotFoundError, PermissionError, NotADirectoryError) as err:
                metrics.execs.labels(outcome="error").inc()
                raise HTTPException(400, detail={"error": "spawn_failed", "detail": str(err)}) from err
            except BlockingIOError as err:  # fork refused: process limit reached
                metrics.execs.labels(outcome="error").inc()
                raise HTTPException(429, detail={"error": "process_limit", "detail": str(err)}) from err
            except OSError as err:  # E2BIG, ENOMEM, ...: the request's, not the server's fault
                metrics.execs.labels(outcome="error").inc()
                raise _os_error(err) from err
            finally:
                slots.release()
        finally:
            metrics.in_flight.dec()
        outcome = "timeout" if result.timed_out else ("ok" if result.exit_code == 0 else "nonzero")
        metrics.execs.labels(outcome=outcome).inc()
        metrics.exec_seconds.observe(result.duration_seconds)
        metrics.output_bytes.labels(stream="stdout").inc(result.stdout_bytes)
        metrics.output_bytes.labels(stream="stderr").inc(result.stderr_bytes)
        for stream, cut in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
            if cut:
                metrics.truncated.labels(stream=stream).inc()
        return {
            "exit_code": result.exit_code,
            "stdout": _encode(result.stdout, req.output_encoding),
            "stderr": _encode(result.stderr, req.output_encoding),
            "output_encoding": req.output_encoding,
            "stdout_truncated": result.stdout_truncated,
            "stderr_truncated": result.stderr_truncated,
            "stdout_bytes": result.stdout_bytes,
            "stderr_bytes": result.stderr_bytes,
            "timed_out": result.timed_out,
            "duration_seconds": round(result.duration_seconds, 6),
        }

    @app.post("/v1/files/read")
    async def read_file(request: Request):
        req = await parse_body(request, ReadRequest)
        if not gate.current(grant_of(request).generation):  # no await from here to the read
            raise _revoked()
        cap = settings.max_read_bytes if req.max_bytes is None else min(req.max_bytes, settings.max_read_bytes)
        try:
            data, size = workspace.read(req.session, req.path, cap)
        except PathRefused as err:
            metrics.path_refused.inc()
            raise refused(err) from err
        except FileNotFoundError as err:
            raise HTTPException(404, detail={"error": "not_found", "detail": req.path}) from err
        except OSError as err:
            raise _os_error(err) from err
        return {"path": req.path, "content": _encode(data, req.encoding), "size": size,
                "truncated": size > len(data), "encoding": req.encoding}

    @app.post("/v1/files/write")
    async def write_file(request: Request):
        req = await parse_body(request, WriteRequest)
        try:
            data = base64.b64decode(req.content, validate=True) if req.encoding == "base64" else req.content.encode()
        except ValueError as err:
            raise HTTPException(400, detail={"error": "bad_content", "detail": str(err)}) from err
        if not gate.current(grant_of(request).generation):  # no await from here to the write
            raise _revoked()
        try:
            written = workspace.write(req.session, req.path, data, req.mode)
        except PathRefused as err:
            metrics.path_refused.inc()
            raise refused(err) from err
        except OSError as err:
            raise _os_error(err) from err
        return {"path": req.path, "bytes": written}

    @app.post("/v1/reset")
    async def reset(request: Request):
        """Revoke the lease, kill everything, wipe; then (optionally) admit the next lease."""
        raw = await request.body()
        req = await parse_body(request, ResetRequest) if raw.strip() else ResetRequest()
        t0 = time.monotonic()
        async with reset_lock:
            gate.revoke()  # from here no call of the old lease is admitted, nor starts
            killed = await runner.sweep()
            await asyncio.to_thread(workspace.reset)
            if req.lease_secret is not None:
                gate.grant(req.lease_secret)
        metrics.resets.inc()
        metrics.reset_seconds.observe(time.monotonic() - t0)
        return {"killed_processes": killed, "duration_seconds": round(time.monotonic() - t0, 6),
                "leased": gate.leased}

    @app.get("/healthz")
    async def healthz():
        ok = os.path.isdir(settings.workspace) and shutil.disk_usage(settings.workspace).free > 0
        body = {
            "status": "ok" if ok else "unhealthy",
            "execs_in_flight": int(metrics.in_flight._value.get()),
            "leased": gate.leased,
            "cgroup": settings.cgroup.describe() if settings.cgroup else None,
            "uptime_seconds": round(time.monotonic() - started, 3),
        }
        if not ok:
            raise HTTPException(503, detail=body)
        return body

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    app.state.gate = gate
    return GuardMiddleware(
        app,
        authorize=gate.authorize,
        max_body_bytes=settings.max_body_bytes,
        on_reject=lambda reason: metrics.rejected.labels(reason=reason).inc(),
    )

