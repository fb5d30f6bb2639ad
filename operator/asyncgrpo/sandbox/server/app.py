"""The sandbox server: one per sandbox pod, runs a rollout's tool calls.

Who may call: the run-wide token opens only the control call (`/v1/reset`), which the
gateway makes; execs and file calls need the secret of the lease the sandbox is under now
(a capability the gateway hands to one group). A reset revokes that secret first, then
kills every process and waits until they are dead, wipes the workspace and only then
installs the next lease's secret, so nothing a group started can run once the next group
holds the sandbox. An exec records the lease generation it was admitted under and checks it
again when it gets its slot, right before the fork (`LeaseGate`).

Everything a request may ask for is bounded by the server's own settings (timeout, output,
body size, concurrency, workspace size); a request can lower them, never raise them.
Commands get a clean environment built here (never the server's own, which holds the
token), run under the limits in `process.CommandLimits`. Anything a command or client can
cause (a FIFO, a symlink swapped mid-call, a full disk or quota, malformed or deeply nested
JSON) is a 4xx (or 507) with a reason.

Large stdin does not travel inside the JSON body (whose cap is small): `/v1/exec/stream`
takes one JSON line, then stdin raw, and feeds it to the command as it arrives, so a
client's stdin costs the server a few buffers, not its size.

The workspace quota (`quota.WorkspaceMeter`): after every exec and write, and every second
while execs run, the workspace is measured; over the quota, every process of the sandbox
is killed and every session goes back to its initial files (the lease holds), and each
exec that was running then answers 507 `workspace_full`. A write that would go over is
refused before anything is written.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import errno
import hashlib
import hmac
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from asyncgrpo.sandbox.common.challenge import NonceLedger, ResetTicket, open_reset, proof
from asyncgrpo.sandbox.common.http_guard import (
    Grant,
    GuardMiddleware,
    Refused,
    exception_handlers,
    grant_of,
    json_endpoint,
    loads,
    parse_body,
    validate,
)
from asyncgrpo.sandbox.common.messages import (
    ApiError,
    ExecRequest,
    ExecResult,
    ReadRequest,
    ReadResult,
    ResetRequest,
    ScoreRequest,
    ScoreResult,
    WriteRequest,
    WriteResult,
    read_stream_head,
)
from asyncgrpo.sandbox.server.cgroup import CommandCgroup
from asyncgrpo.sandbox.server.metrics import SandboxMetrics
from asyncgrpo.sandbox.server.process import CommandLimits, Revoked, Runner, use_pidfd_child_watcher
from asyncgrpo.sandbox.server.quota import DEFAULT_MAX_WORKSPACE_BYTES, WorkspaceMeter
from asyncgrpo.sandbox.server.residue import Residue
from asyncgrpo.sandbox.server.workspace import PathRefused, QuotaExceeded, Workspace

log = logging.getLogger("asyncgrpo.sandbox.server.app")
DEFAULT_COMMAND_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
QUOTA_CHECK_SECONDS = 1.0
#: where `/v1/score` builds the scoring session and its HOME (not a valid session name: no
#: exec or file call can name it)
SCORE_SESSION = "score"
SCORE_HOME = ".score-home"


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
    max_body_bytes: int = 1 << 20  # JSON bodies; large stdin goes through /v1/exec/stream
    max_concurrent_execs: int = 64
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES  # 0: unmeasured (the pod's limit only)
    command_path: str = DEFAULT_COMMAND_PATH
    shell: str = "/bin/bash"
    limits: CommandLimits = field(default_factory=CommandLimits)
    cgroup: CommandCgroup | None = None  # memory and pids of all commands together, where possible
    # shared scratch directories a reset empties of the sandbox's files (`residue.Residue`);
    # the CLI's default is /tmp, /dev/shm and /dev/mqueue
    wipe_dirs: list[str] = field(default_factory=list)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _encode(data: bytes, encoding: str) -> str:
    return base64.b64encode(data).decode() if encoding == "base64" else _decode(data)


def _not_started(timeout: float, encoding: str) -> ExecResult:
    note = f"not started: every exec slot stayed busy for the whole timeout ({timeout:g}s)\n".encode()
    return ExecResult(exit_code=None, stdout="", stderr=_encode(note, encoding), output_encoding=encoding,
                      stdout_truncated=False, stderr_truncated=False, stdout_bytes=0,
                      stderr_bytes=len(note), timed_out=True, duration_seconds=round(timeout, 6))


CONTROL_PATHS = frozenset({"/v1/reset"})
STREAM_PATHS = frozenset({"/v1/exec/stream"})
DATA_PATHS = frozenset({"/v1/exec", "/v1/files/read", "/v1/files/write", "/v1/score"}) | STREAM_PATHS


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
        self._token_text = token
        self.generation = 0
        self._secret: bytes | None = None
        self._revoked: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def grant(self, secret: str) -> int:
        self._secret = secret.encode()
        self.generation += 1
        return self.generation

    def fence(self) -> int:
        """A new generation under the same secret: calls admitted before it never start
        (the scoring run must not share the sandbox with a late call of the rollout)."""
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
            # never the token itself: only a credential made with it (`challenge.reset_call`)
            ticket = open_reset(self._token_text, presented)
            return Grant("control", ticket=ticket) if ticket is not None else None
        if path not in DATA_PATHS:
            return None  # 401 before a 404: unknown paths reveal nothing
        if self._secret is not None and hmac.compare_digest(presented.encode(), self._secret):
            return Grant("lease", self.generation)
        if _digest(presented) in self._revoked:
            raise Refused(410, "lease_revoked", "the lease this secret belonged to has ended")
        return None


_OS_ERRORS = {
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
}


def _os_error(err: OSError) -> ApiError:
    """An OS error from the workspace (the state commands made) as a 4xx with its reason."""
    status, error = _OS_ERRORS.get(err.errno, (409, "os_error"))
    return ApiError(status, error, f"{errno.errorcode.get(err.errno, err.errno)}: {err.strerror}")


def _revoked() -> ApiError:
    return ApiError(410, "lease_revoked", "the lease of this call has ended")


def _refused(err: Exception) -> ApiError:
    return ApiError(400, "path_refused", str(err))


class SandboxServer:
    """One sandbox's state (workspace, commands, lease gate, quota) and its HTTP routes.

    Plain Starlette routes, as the gateway's, and no FastAPI or pydantic: the server also
    runs from a bundle in a task's own image with that image's python3, where nothing
    compiled can come along (docs/sandboxes.md, "The server in a task's own image").
    """

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        limits = settings.limits
        self.workspace = Workspace(settings.workspace, settings.template, uid=limits.uid, gid=limits.gid)
        self.runner = Runner(limits, cgroup=settings.cgroup)
        self.metrics = SandboxMetrics()
        self.slots = asyncio.Semaphore(settings.max_concurrent_execs)
        self.started = time.monotonic()
        self.gate = LeaseGate(settings.token)
        self.reset_lock = asyncio.Lock()
        self.meter = WorkspaceMeter(settings.workspace, settings.max_workspace_bytes)
        self.wipes = 0  # quota wipes so far: an exec that sees it change was running during one
        self.dirty = False  # written since the last measurement
        self.nonces = NonceLedger()  # each reset credential opens once
        self.loop: asyncio.AbstractEventLoop | None = None  # set while serving (stop signals)
        residue_uid = limits.uid if limits.uid is not None else (os.getuid() if os.getpid() == 1 else None)
        self.residue = Residue(residue_uid, tuple(settings.wipe_dirs),
                               keep=tuple(p for p in (settings.workspace, settings.template) if p))

    # wiring ---------------------------------------------------------------------------
    def asgi(self) -> GuardMiddleware:
        routes = []
        for method, path, handler in (
            ("POST", "/v1/exec", self.exec_),
            ("POST", "/v1/exec/stream", self.exec_stream),
            ("POST", "/v1/files/read", self.read_file),
            ("POST", "/v1/files/write", self.write_file),
            ("POST", "/v1/reset", self.reset),
            ("POST", "/v1/score", self.score),
            ("GET", "/healthz", self.healthz),
            ("GET", "/metrics", self.prom),
        ):
            routes.append(Route(path, json_endpoint(handler), methods=[method]))
        app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers=exception_handlers())
        app.state.metrics = self.metrics
        app.state.gate = self.gate
        app.state.server = self
        return GuardMiddleware(
            app,
            authorize=self.gate.authorize,
            max_body_bytes=self.settings.max_body_bytes,
            streamed=STREAM_PATHS.__contains__,
            on_reject=lambda reason: self.metrics.rejected.labels(reason=reason).inc(),
        )

    @asynccontextmanager
    async def _lifespan(self, _app):
        self.loop = asyncio.get_running_loop()
        use_pidfd_child_watcher()
        tasks = [asyncio.create_task(self._reaper()), asyncio.create_task(self._quota_loop())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await self.runner.sweep()
            if self.settings.cgroup is not None:
                self.settings.cgroup.remove()

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            await self.runner.reap()

    async def _quota_loop(self) -> None:
        """Catches a command that keeps writing during a long exec (and writes since the last check)."""
        while True:
            await asyncio.sleep(QUOTA_CHECK_SECONDS)
            if self.dirty or self.metrics.in_flight._value.get() > 0:
                await self.enforce_quota()

    # quota ------------------------------------------------------------------------------
    async def enforce_quota(self) -> None:
        """Measure; wipe when over. Never raises: an exec's answer must not become a 500 here."""
        if not self.meter.enabled:
            return
        self.dirty = False
        try:
            used = await self.meter.measure()
            self.metrics.workspace_bytes.set(used)
            if used > self.meter.max_bytes:
                await self._wipe(used)
        except Exception:
            log.exception("workspace quota check failed")

    async def _wipe(self, used: int) -> None:
        """Kill every command and restore every session; the lease (and its secret) holds."""
        async with self.reset_lock:
            self.wipes += 1
            await self.runner.sweep()
            await asyncio.to_thread(self.workspace.reset)
        self.metrics.quota_wipes.inc()
        log.warning("workspace over its quota (%d > %d bytes): commands killed, sessions reset",
                    used, self.meter.max_bytes)

    def _full(self, during: str) -> ApiError:
        return ApiError(507, "workspace_full",
                        f"the workspace went over its quota of {self.meter.max_bytes} bytes {during}: every "
                        "process of the sandbox was killed and every session is back to its initial files; "
                        "the lease holds")

    # data calls ---------------------------------------------------------------------------
    async def exec_(self, request: Request) -> ExecResult:
        req = await parse_body(request, ExecRequest)
        stdin = req.stdin.encode() if req.stdin is not None else None
        return await self._exec(req, grant_of(request).generation, stdin)

    async def exec_stream(self, request: Request) -> ExecResult:
        """One line of `ExecRequest` JSON, then stdin raw: fed to the command as it arrives."""
        chunks = request.stream()
        head, rest = await read_stream_head(chunks, self.settings.max_body_bytes)
        try:
            req = validate(loads(head), ExecRequest)
        except ValueError as err:
            raise ApiError(400, "bad_json", str(err)[:200]) from err
        if req.stdin is not None:
            raise ApiError(422, "invalid_request", "a streamed exec's stdin is the body after the first line")

        async def stdin() -> AsyncIterator[bytes]:
            if rest:
                yield rest
            try:
                async for chunk in chunks:
                    if chunk:
                        yield chunk
            except ClientDisconnect:
                return  # the client went away or stalled (body timeout): stdin ends here

        return await self._exec(req, grant_of(request).generation, stdin())

    async def _exec(self, req: ExecRequest, generation: int, stdin) -> ExecResult:
        s, metrics = self.settings, self.metrics
        timeout = min(req.timeout_seconds or s.default_timeout_seconds, s.max_timeout_seconds)
        cap = s.max_output_bytes if req.max_output_bytes is None else min(req.max_output_bytes, s.max_output_bytes)
        if not self.gate.current(generation):
            raise _revoked()
        try:
            home = self.workspace.session_dir(req.session)
            cwd = self.workspace.confined_dir(req.session, req.cwd)
        except PathRefused as err:
            raise _refused(err) from err
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise ApiError(400, "bad_cwd", f"{req.cwd!r} is not a directory in the session") from err
            raise _os_error(err) from err
        argv = [s.shell, "-c", req.command] if isinstance(req.command, str) else list(req.command)
        env = {
            "PATH": s.command_path,
            "HOME": home,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONUNBUFFERED": "1",
            **req.env,
        }
        result = await self._run_in_slot(argv, cwd=cwd, env=env, stdin=stdin, timeout=timeout, cap=cap,
                                         generation=generation, during="during this call")
        if result is None:
            return _not_started(timeout, req.output_encoding)
        outcome = "timeout" if result.timed_out else ("ok" if result.exit_code == 0 else "nonzero")
        metrics.execs.labels(outcome=outcome).inc()
        metrics.exec_seconds.observe(result.duration_seconds)
        metrics.output_bytes.labels(stream="stdout").inc(result.stdout_bytes)
        metrics.output_bytes.labels(stream="stderr").inc(result.stderr_bytes)
        for stream, cut in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
            if cut:
                metrics.truncated.labels(stream=stream).inc()
        return ExecResult(
            exit_code=result.exit_code,
            stdout=_encode(result.stdout, req.output_encoding),
            stderr=_encode(result.stderr, req.output_encoding),
            output_encoding=req.output_encoding,
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
            stdout_bytes=result.stdout_bytes,
            stderr_bytes=result.stderr_bytes,
            timed_out=result.timed_out,
            duration_seconds=round(result.duration_seconds, 6),
        )

    async def _run_in_slot(self, argv: list[str], *, cwd: str, env: dict[str, str], stdin, timeout: float,
                           cap: int, generation: int, during: str, sweep_after: bool = False):
        """Run one command of an exec or a scoring run: wait for a slot, run, map errors; the
        quota is checked after. None when no slot came free within `timeout` (the caller
        answers "not started"); errors are 4xx (`lease_revoked`, `spawn_failed`,
        `process_limit`, an OS error's) and 507 `workspace_full` if a quota wipe happened
        while it ran. `sweep_after`: kill every process of the sandbox once it ended."""
        metrics = self.metrics
        wipes = self.wipes
        metrics.in_flight.inc()
        queued = time.monotonic()
        try:
            # the wait for a slot counts in the timeout: whoever called (the gateway, a
            # client) may treat silence past the timeout plus a small slack as a hung sandbox
            try:
                await asyncio.wait_for(self.slots.acquire(), timeout)
            except TimeoutError:
                metrics.execs.labels(outcome="timeout").inc()
                return None
            try:
                result = await self.runner.run(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=stdin,
                    timeout=max(0.001, timeout - (time.monotonic() - queued)),
                    max_output_bytes=cap,
                    admit=lambda: self.gate.current(generation),
                )
            except Revoked as err:
                metrics.execs.labels(outcome="revoked").inc()
                raise _revoked() from err
            except (FileNotFoundError, PermissionError, NotADirectoryError) as err:
                metrics.execs.labels(outcome="error").inc()
                raise ApiError(400, "spawn_failed", str(err)) from err
            except BlockingIOError as err:  # fork refused: process limit reached
                metrics.execs.labels(outcome="error").inc()
                raise ApiError(429, "process_limit", str(err)) from err
            except OSError as err:  # E2BIG, ENOMEM, ...: the request's, not the server's fault
                metrics.execs.labels(outcome="error").inc()
                raise _os_error(err) from err
            finally:
                self.slots.release()
                if sweep_after:
                    await self.runner.sweep()
            await self.enforce_quota()
        finally:
            metrics.in_flight.dec()
        if self.wipes != wipes:
            metrics.execs.labels(outcome="workspace_full").inc()
            raise self._full(during)
        return result

    async def read_file(self, request: Request) -> ReadResult:
        req = await parse_body(request, ReadRequest)
        if not self.gate.current(grant_of(request).generation):  # no await from here to the read
            raise _revoked()
        s = self.settings
        cap = s.max_read_bytes if req.max_bytes is None else min(req.max_bytes, s.max_read_bytes)
        try:
            data, size = self.workspace.read(req.session, req.path, cap)
        except PathRefused as err:
            self.metrics.path_refused.inc()
            raise _refused(err) from err
        except FileNotFoundError as err:
            raise ApiError(404, "not_found", req.path) from err
        except OSError as err:
            raise _os_error(err) from err
        return ReadResult(path=req.path, content=_encode(data, req.encoding), size=size,
                          truncated=size > len(data), encoding=req.encoding)

    async def write_file(self, request: Request) -> WriteResult:
        req = await parse_body(request, WriteRequest)
        try:
            data = base64.b64decode(req.content, validate=True) if req.encoding == "base64" else req.content.encode()
        except ValueError as err:
            raise ApiError(400, "bad_content", str(err)) from err
        room = None
        if self.meter.enabled:
            room = self.meter.max_bytes - await self.meter.measure()
        if not self.gate.current(grant_of(request).generation):  # no await from here to the write
            raise _revoked()
        try:
            written = self.workspace.write(req.session, req.path, data, req.mode, max_growth=room)
        except QuotaExceeded as err:
            raise ApiError(507, "workspace_full", f"{err}; nothing was written") from err
        except PathRefused as err:
            self.metrics.path_refused.inc()
            raise _refused(err) from err
        except OSError as err:
            raise _os_error(err) from err
        finally:
            self.dirty = True
        return WriteResult(path=req.path, bytes=written)

    # scoring -----------------------------------------------------------------------------
    async def score(self, request: Request) -> ScoreResult:
        """Score a rollout where it never ran: see `ScoreRequest` and docs/sandboxes.md "Reward integrity".

        Every process of the sandbox is killed first (the rollout's background jobs and
        escapees included: a sandbox serves one rollout) and its files in /tmp, /dev/shm and
        its SysV IPC objects are removed (where the server can tell them by uid), then only
        the editable paths are
        read out of the rollout's session, the workspace is wiped, and the row's files plus
        those are written into a fresh session. The test command runs there with a clean
        environment: the server's PATH, a fresh empty HOME, no user site, no cwd on
        Python's path (`PYTHONSAFEPATH`, `PYTHONNOUSERSITE`), nothing from the request.
        """
        req = await parse_body(request, ScoreRequest)
        s, metrics = self.settings, self.metrics
        timeout = min(req.timeout_seconds or s.default_timeout_seconds, s.max_timeout_seconds)
        cap = s.max_output_bytes if req.max_output_bytes is None else min(req.max_output_bytes, s.max_output_bytes)
        if not self.gate.current(grant_of(request).generation):
            raise _revoked()
        async with self.reset_lock:
            generation = self.gate.fence()
            await self.runner.sweep()
            # what the rollout left outside the workspace (/tmp, /dev/shm, SysV IPC) must not
            # reach the tests either (the same sweep as a reset: `residue.Residue`)
            await asyncio.to_thread(self.residue.remove)
            try:
                kept, home, cwd = await asyncio.to_thread(self._scoring_session, req)
            except PathRefused as err:
                raise _refused(err) from err
            except OSError as err:
                raise _os_error(err) from err
        argv = [s.shell, "-c", req.command] if isinstance(req.command, str) else list(req.command)
        env = {"PATH": s.command_path, "HOME": home, "LANG": "C.UTF-8", "TERM": "dumb",
               "PYTHONUNBUFFERED": "1", "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1",
               "PYTHONDONTWRITEBYTECODE": "1"}
        result = await self._run_in_slot(argv, cwd=cwd, env=env, stdin=None, timeout=timeout, cap=cap,
                                         generation=generation, during="during the scoring run",
                                         sweep_after=True)  # nothing of the scoring run outlives it
        if result is None:
            return ScoreResult(**_not_started(timeout, "utf-8").dump(), editable_found=kept)
        metrics.execs.labels(outcome="timeout" if result.timed_out else
                             ("ok" if result.exit_code == 0 else "nonzero")).inc()
        return ScoreResult(
            exit_code=result.exit_code, stdout=_decode(result.stdout), stderr=_decode(result.stderr),
            stdout_truncated=result.stdout_truncated, stderr_truncated=result.stderr_truncated,
            stdout_bytes=result.stdout_bytes, stderr_bytes=result.stderr_bytes, timed_out=result.timed_out,
            duration_seconds=round(result.duration_seconds, 6), editable_found=kept)

    def _scoring_session(self, req: ScoreRequest) -> tuple[list[str], str, str]:
        """(editable paths kept, HOME, cwd) of a fresh scoring session; runs with no command alive."""
        kept: dict[str, bytes] = {}
        for path in dict.fromkeys(req.editable):
            try:  # regular files only, no symlinks; in root mode owned by the commands' uid, one name
                data, size = self.workspace.read(req.session, path, self.settings.max_read_bytes)
            except (PathRefused, OSError):
                continue  # absent, refused or unreadable: the row's version (if any) is scored
            if size == len(data):
                kept[path] = data
        self.workspace.reset()
        for path, content in req.files.items():
            self.workspace.write(SCORE_SESSION, path, content.encode())
        for path, data in kept.items():
            self.workspace.write(SCORE_SESSION, path, data)
        home = os.path.join(self.workspace.root, SCORE_HOME)
        os.mkdir(home, 0o700)
        self.workspace._chown(home)
        return sorted(kept), home, self.workspace.session_dir(SCORE_SESSION)

    # control ---------------------------------------------------------------------------
    async def reset(self, request: Request) -> dict:
        """Revoke the lease, kill everything, wipe; then (optionally) admit the next lease.

        The credential was made with the run's token for this address, now, once
        (`challenge`); the answer's `proof` shows the gateway this is the real server.
        """
        ticket: ResetTicket = grant_of(request).ticket
        host, port = request.scope.get("server") or ("", 0)
        if not ticket.fresh() or not ticket.addressed_to(host, port) or not self.nonces.admit(ticket.nonce):
            self.metrics.rejected.labels(reason="unauthorized").inc()
            raise ApiError(401, "unauthorized", "reset credential expired, replayed or for another sandbox",
                           headers={"connection": "close"})
        raw = await request.body()
        req = await parse_body(request, ResetRequest) if raw.strip() else ResetRequest()
        if req.lease_secret is not None:
            raise ApiError(422, "invalid_request", "the next lease's secret travels sealed in the reset "
                           "credential (asyncgrpo.sandbox.common.challenge), never in the body")
        secret = ticket.lease_secret
        if secret is not None and len(secret) < 16:
            raise ApiError(422, "invalid_request", "a lease secret is at least 16 characters")
        t0 = time.monotonic()
        async with self.reset_lock:
            self.gate.revoke()  # from here no call of the old lease is admitted, nor starts
            killed = await self.runner.sweep()
            await asyncio.to_thread(self.workspace.reset)
            residue = await asyncio.to_thread(self.residue.remove)
            if secret is not None:
                self.gate.grant(secret)
        self.metrics.resets.inc()
        self.metrics.reset_seconds.observe(time.monotonic() - t0)
        return {"killed_processes": killed, "duration_seconds": round(time.monotonic() - t0, 6),
                "leased": self.gate.leased, "removed": residue,
                "proof": proof(self.settings.token, ticket.nonce)}

    async def stop(self) -> int:
        """A trusted stop signal: revoke the lease and kill every command, for good, before the
        listener closes, so no process of the sandbox is left to take the port."""
        self.gate.revoke()
        killed = await self.runner.close()
        log.warning("stopping: %d command processes killed, no command starts any more", killed)
        return killed

    async def healthz(self, _request: Request) -> dict:
        s = self.settings
        ok = os.path.isdir(s.workspace) and shutil.disk_usage(s.workspace).free > 0
        body = {
            "status": "ok" if ok else "unhealthy",
            "execs_in_flight": int(self.metrics.in_flight._value.get()),
            "leased": self.gate.leased,
            "cgroup": s.cgroup.describe() if s.cgroup else None,
            "workspace_bytes": self.meter.last_bytes if self.meter.enabled else None,
            "uptime_seconds": round(time.monotonic() - self.started, 3),
        }
        if not ok:
            raise HTTPException(503, detail=body)
        return body

    async def prom(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: ServerSettings) -> GuardMiddleware:
    return SandboxServer(settings).asgi()
