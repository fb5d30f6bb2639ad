"""What travels between sandbox clients, the gateway and the sandbox servers: one definition each.

The client builds an exec from `ExecRequest`, the gateway reads the same model to cap a
proxied exec's timeout, the server validates it; results come back as `ExecResult`,
`ReadResult`, `WriteResult`, and errors as `ApiError` (status, machine-readable `error`,
human `detail`). Results index like the dicts they used to be (`r["exit_code"]`), so
code written against the old dict answers keeps working.

The streamed exec (`/v1/exec/stream`, large stdin) sends one line of `ExecRequest` JSON,
a newline, then stdin as raw bytes to the end of the body: `stream_head` builds that line.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: content type of a streamed exec's body: a JSON line, then raw stdin
EXEC_STREAM_TYPE = "application/x-asyncgrpo-exec-stream"
Encoding = Literal["utf-8", "base64"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    """A result: attributes, and `r["key"]`/`r.get` for callers written against dicts."""

    model_config = ConfigDict(extra="allow")

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


# requests -----------------------------------------------------------------------------
class ExecRequest(_Strict):
    command: str | list[str] = Field(description="shell string (run by the server's shell) or argv")
    timeout_seconds: float | None = Field(None, gt=0)
    stdin: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="directory relative to the session directory")
    session: str | None = None
    max_output_bytes: int | None = Field(None, ge=0)
    output_encoding: Encoding = Field(
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

    def body(self) -> dict:
        """The JSON body: only what was set, so the server's defaults apply to the rest."""
        return self.model_dump(exclude_unset=True)

    def stream_head(self) -> bytes:
        """The first line of a streamed exec's body (stdin follows it raw)."""
        return self.model_dump_json(exclude_unset=True, exclude={"stdin"}).encode() + b"\n"


class ReadRequest(_Strict):
    path: str
    session: str | None = None
    max_bytes: int | None = Field(None, ge=0)
    encoding: Encoding = "utf-8"


class WriteRequest(_Strict):
    path: str
    content: str
    session: str | None = None
    encoding: Encoding = "utf-8"
    mode: int = Field(0o644, ge=0, le=0o777)


class ResetRequest(_Strict):
    lease_secret: str | None = Field(None, min_length=16, max_length=256,
                                     description="secret of the next lease, accepted once the reset is done")


class ScoreRequest(_Strict):
    """Score a rollout where it never ran (`POST /v1/score`, lease secret).

    The server kills every process of the sandbox, keeps only the `editable` paths of
    `session` (regular files, no symlinks), wipes the workspace, builds a fresh scoring
    session from the template, `files` (the row's files: its tests restored) and the kept
    editable files, and runs `command` there in a clean, isolated environment.
    """

    session: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="the row's files, written first (tests restored)")
    editable: list[str] = Field(default_factory=list, max_length=1024,
                                description="paths the rollout may change: only these are carried over")
    command: str | list[str] = Field(description="the row's test command")
    timeout_seconds: float | None = Field(None, gt=0)
    max_output_bytes: int | None = Field(None, ge=0)


class LeaseRequest(_Strict):
    group_id: str = Field(min_length=1, max_length=256)
    wait_seconds: float | None = Field(None, ge=0)
    group_key: str | None = Field(
        None, min_length=16, max_length=256,
        description="the credential of the group: requests naming the same group_id join one "
        "lease only if they carry the same key (the gateway files the group under its digest); "
        "without it the lease can be joined by nobody. A group id alone is no credential.")


class HeldLease(_Strict):
    lease_id: str = Field(min_length=1, max_length=256)
    secret: str = Field(min_length=1, max_length=256)


class HeartbeatsRequest(_Strict):
    """Many leases' heartbeats in one call (`POST /v1/heartbeats`): a process beats every
    lease it holds at once, so the gateway's cost per lease is a dict lookup, not a request."""

    leases: list[HeldLease] = Field(max_length=4096)


# results ------------------------------------------------------------------------------
class ExecResult(_Answer):
    exit_code: int | None
    stdout: str
    stderr: str
    output_encoding: Encoding = "utf-8"
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    timed_out: bool
    duration_seconds: float


class ScoreResult(ExecResult):
    editable_found: list[str] = Field(default_factory=list, description="editable paths carried over")


class ReadResult(_Answer):
    path: str
    content: str
    size: int
    truncated: bool
    encoding: Encoding = "utf-8"


class WriteResult(_Answer):
    path: str
    bytes: int


# errors -------------------------------------------------------------------------------
class ApiError(Exception):
    """A refusal with a reason, raised by the servers' handlers.

    On the wire `{"detail": {"error": ..., "detail": ...}}` (FastAPI's envelope for handler
    errors, which the clients unwrap into `SandboxError` and its kinds); the servers turn
    it into that response (`api_error_response`). Plain Exception, not FastAPI's
    HTTPException: the clients import this module, and the trainer image has no FastAPI.
    """

    def __init__(self, status: int, error: str, detail: Any = "", headers: dict[str, str] | None = None):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail, self.headers = status, error, detail, headers

    def body(self) -> dict:
        return {"detail": {"error": self.error, "detail": self.detail}}


async def api_error_response(_request, exc: ApiError):
    """The exception handler both servers register for `ApiError`."""
    from starlette.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def read_stream_head(chunks: AsyncIterator[bytes], cap: int) -> tuple[bytes, bytes]:
    """(the first line of a streamed body, the bytes after it); 413 past `cap` without one."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        line_end = buf.find(b"\n")
        if line_end >= 0:
            return bytes(buf[:line_end]), bytes(buf[line_end + 1 :])
        if len(buf) > cap:
            break
    if len(buf) > cap:
        raise ApiError(413, "too_large", f"the request line of a streamed exec is over {cap} bytes")
    raise ApiError(400, "bad_request", "a streamed exec's body starts with one line of JSON and a newline")
