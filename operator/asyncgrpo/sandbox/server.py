"""The sandbox server: one per sandbox pod, runs a rollout's tool calls.

Everything a request may ask for is bounded by the server's own settings (timeout, output,
body size, concurrency); a request can lower them, never raise them. Commands get a clean
environment built here (never the server's own, which holds the token), run under the
limits in `process.CommandLimits`, and a reset kills whatever they left running before the
workspace is restored, so the next group starts from the same state as the first.
"""

from __future__ import annotations

import asyncio
import base64
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

from asyncgrpo.sandbox.http_guard import GuardMiddleware, parse_body
from asyncgrpo.sandbox.metrics import SandboxMetrics
from asyncgrpo.sandbox.process import CommandLimits, Runner, use_pidfd_child_watcher
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
    max_body_bytes: int = 16 << 20
    max_concurrent_execs: int = 64
    command_path: str = DEFAULT_COMMAND_PATH
    shell: str = "/bin/bash"
    limits: CommandLimits = field(default_factory=CommandLimits)


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


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def create_app(settings: ServerSettings) -> FastAPI:
    limits = settings.limits
    workspace = Workspace(settings.workspace, settings.template, uid=limits.uid, gid=limits.gid)
    runner = Runner(limits)
    metrics = SandboxMetrics()
    slots = asyncio.Semaphore(settings.max_concurrent_execs)
    started = time.monotonic()
    state = {"resetting": False}

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

    app = FastAPI(title="asyncgrpo sandbox", lifespan=lifespan, docs_url=None, redoc_url=None)

    def refused(err: Exception, status: int = 400) -> HTTPException:
        return HTTPException(status, detail={"error": "path_refused", "detail": str(err)})

    @app.post("/v1/exec")
    async def exec_(request: Request):
        req = await parse_body(request, ExecRequest)
        timeout = min(req.timeout_seconds or settings.default_timeout_seconds, settings.max_timeout_seconds)
        cap = settings.max_output_bytes if req.max_output_bytes is None else min(
            req.max_output_bytes, settings.max_output_bytes
        )
        try:
            home = workspace.session_dir(req.session)
            cwd = home
            if req.cwd:
                cwd = os.path.join(home, *_confined_parts(req.cwd))
        except PathRefused as err:
            raise refused(err) from err
        if not os.path.isdir(cwd):
            raise HTTPException(400, detail={"error": "bad_cwd", "detail": f"{req.cwd!r} is not a directory"})
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
        try:
            async with slots:
                try:
                    result = await runner.run(
                        argv,
                        cwd=cwd,
                        env=env,
                        stdin=req.stdin.encode() if req.stdin is not None else None,
                        timeout=timeout,
                        max_output_bytes=cap,
                    )
                except (FileNotFoundError, PermissionError) as err:
                    metrics.execs.labels(outcome="error").inc()
                    raise HTTPException(
                        400, detail={"error": "spawn_failed", "detail": str(err)}
                    ) from err
                except BlockingIOError as err:  # fork refused: process limit reached
                    metrics.execs.labels(outcome="error").inc()
                    raise HTTPException(
                        429, detail={"error": "process_limit", "detail": str(err)}
                    ) from err
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
            "stdout": _decode(result.stdout),
            "stderr": _decode(result.stderr),
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
        cap = settings.max_read_bytes if req.max_bytes is None else min(req.max_bytes, settings.max_read_bytes)
        try:
            data, size = workspace.read(req.session, req.path, cap)
        except PathRefused as err:
            metrics.path_refused.inc()
            raise refused(err) from err
        except FileNotFoundError as err:
            raise HTTPException(404, detail={"error": "not_found", "detail": req.path}) from err
        except IsADirectoryError as err:
            raise refused(err) from err
        content = base64.b64encode(data).decode() if req.encoding == "base64" else _decode(data)
        return {"path": req.path, "content": content, "size": size, "truncated": size > len(data),
                "encoding": req.encoding}

    @app.post("/v1/files/write")
    async def write_file(request: Request):
        req = await parse_body(request, WriteRequest)
        try:
            data = base64.b64decode(req.content, validate=True) if req.encoding == "base64" else req.content.encode()
        except ValueError as err:
            raise HTTPException(400, detail={"error": "bad_content", "detail": str(err)}) from err
        try:
            written = workspace.write(req.session, req.path, data, req.mode)
        except PathRefused as err:
            metrics.path_refused.inc()
            raise refused(err) from err
        except (IsADirectoryError, NotADirectoryError) as err:
            raise refused(err) from err
        return {"path": req.path, "bytes": written}

    @app.post("/v1/reset")
    async def reset():
        t0 = time.monotonic()
        state["resetting"] = True
        try:
            killed = await runner.sweep()
            await asyncio.to_thread(workspace.reset)
        finally:
            state["resetting"] = False
        metrics.resets.inc()
        metrics.reset_seconds.observe(time.monotonic() - t0)
        return {"killed_processes": killed, "duration_seconds": round(time.monotonic() - t0, 6)}

    @app.get("/healthz")
    async def healthz():
        ok = os.path.isdir(settings.workspace) and shutil.disk_usage(settings.workspace).free > 0
        body = {
            "status": "ok" if ok else "unhealthy",
            "execs_in_flight": int(metrics.in_flight._value.get()),
            "uptime_seconds": round(time.monotonic() - started, 3),
        }
        if not ok:
            raise HTTPException(503, detail=body)
        return body

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    return GuardMiddleware(
        app,
        token=settings.token,
        max_body_bytes=settings.max_body_bytes,
        on_reject=lambda reason: metrics.rejected.labels(reason=reason).inc(),
    )


def _confined_parts(path: str) -> list[str]:
    from asyncgrpo.sandbox.workspace import split_path

    return split_path(path)
