"""Guards every HTTP server here shares: bearer auth, a request body cap, a body read timeout.

Plain ASGI middleware so they act before the app parses anything: a request with no or the
wrong credential never reaches a handler (401), a body over the cap is refused (413) after
reading at most the cap, whether or not the client sent Content-Length, and a client that
stops sending its body mid-way gets 408 instead of holding a worker forever. Paths marked
`streamed` (a streamed exec's stdin) pass their body through as it arrives, uncapped, each
chunk still within the body timeout; their handler bounds what it keeps.

Who may call what is one function, `authorize(path, bearer) -> Grant | None`: the gateway
and the sandbox each pass their own (run token for control calls, a lease's secret for the
data calls of that lease), and the grant rides along in the ASGI scope for the handler.
Health and metrics stay open on purpose: kubelet probes and Prometheus scrapes cannot send
a per-run secret, and neither route reveals or changes anything sensitive.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from asyncgrpo.sandbox.common.messages import ApiError, Invalid, api_error_response

OPEN_PATHS: frozenset[str] = frozenset({"/healthz", "/metrics"})
GRANT_SCOPE_KEY = "asyncgrpo.grant"
#: on every answer sent before the request's body was read to its end (a refusal, a streamed
#: exec whose command exited or whose lease ended): uvicorn then closes the connection right
#: after the answer instead of reading (and discarding) the rest of the body to reuse it
CLOSE = (b"connection", b"close")


@dataclass(frozen=True)
class Grant:
    """What a credential allowed: `kind` is control or lease; `generation` pins a lease."""

    kind: str
    generation: int = 0
    lease_id: str = ""
    ticket: object | None = None  # the sandbox's reset: the opened credential (`challenge.ResetTicket`)


class Refused(Exception):
    """Raised by an `authorize` function to answer something other than 401 (e.g. 410)."""

    def __init__(self, status: int, error: str, detail: str):
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail


async def _send_json(send, status: int, body: dict, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def bearer(header_value: str | None) -> str | None:
    if not header_value or not header_value.startswith("Bearer "):
        return None
    return header_value[7:].strip() or None


def run_token(token: str) -> Callable[[str, str | None], Grant | None]:
    """The plain policy: every non-open path needs the one run-wide token."""
    if not token:
        raise ValueError("a non-empty token is required")

    def authorize(_path: str, presented: str | None) -> Grant | None:
        if presented is not None and hmac.compare_digest(presented.encode(), token.encode()):
            return Grant("control")
        return None

    return authorize


class GuardMiddleware:
    """401 unless `authorize` grants, 413 over `max_body_bytes`, 408 on a stalled body."""

    def __init__(
        self,
        app,
        *,
        token: str | None = None,
        authorize: Callable[[str, str | None], Grant | None] | None = None,
        max_body_bytes: int,
        body_timeout_seconds: float = 30.0,
        open_paths: frozenset[str] = OPEN_PATHS,
        streamed: Callable[[str], bool] = lambda _path: False,
        on_reject: Callable[[str], None] | None = None,
    ):
        if authorize is None:
            authorize = run_token(token or "")
        self.app = app
        self.authorize = authorize
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout_seconds
        self.open_paths = open_paths
        self.streamed = streamed
        self.on_reject = on_reject or (lambda reason: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in self.open_paths:
            try:
                grant = self.authorize(scope["path"], bearer(headers.get("authorization")))
            except Refused as err:
                self.on_reject(err.error)
                return await _send_json(send, err.status, {"error": err.error, "detail": err.detail}, [CLOSE])
            if grant is None:
                self.on_reject("unauthorized")
                return await _send_json(
                    send, 401, {"error": "unauthorized", "detail": "missing or wrong bearer token"},
                    [(b"www-authenticate", b"Bearer"), CLOSE],
                )
            scope[GRANT_SCOPE_KEY] = grant
        if self.streamed(scope["path"]):
            # the handler reads the body as it arrives (a streamed exec's stdin): no cap on
            # its size here, each chunk still within the body timeout; an answer sent before
            # the body's end closes the connection (no byte of the rest is read)
            ended = False

            async def tracked():
                nonlocal ended
                message = await self._timed(receive)()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    ended = True
                return message

            async def closing_send(message):
                if message["type"] == "http.response.start" and not ended:
                    message = {**message, "headers": [*message.get("headers", []), CLOSE]}
                await send(message)

            return await self.app(scope, tracked, closing_send)
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                self.on_reject("bad_length")
                return await _send_json(send, 400, {"error": "bad_request", "detail": "bad Content-Length"},
                                        [CLOSE])
            if int(declared) > self.max_body_bytes:
                self.on_reject("too_large")
                return await _send_json(send, 413, self._too_large(), [CLOSE])
        body = bytearray()
        more = True
        while more:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for wraps each receive in a task
                async with asyncio.timeout(self.body_timeout):
                    message = await receive()
            except TimeoutError:
                self.on_reject("body_timeout")
                return await _send_json(send, 408, {"error": "body_timeout",
                                                    "detail": f"body not received within {self.body_timeout:g}s"},
                                        [CLOSE])
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                self.on_reject("too_large")
                return await _send_json(send, 413, self._too_large(), [CLOSE])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _timed(self, receive):
        """`receive` that reports a client silent for the body timeout as gone (http.disconnect)."""
        async def timed():
            try:
                async with asyncio.timeout(self.body_timeout):
                    return await receive()
            except TimeoutError:
                self.on_reject("body_timeout")
                return {"type": "http.disconnect"}

        return timed

    def _too_large(self) -> dict:
        return {"error": "too_large", "detail": f"request body over {self.max_body_bytes} bytes"}


def grant_of(request) -> Grant:
    return request.scope[GRANT_SCOPE_KEY]


async def parse_body(request, model):
    """JSON body -> `messages` model whatever the Content-Type; 400 bad or too deep JSON, 422 bad fields."""
    raw = await request.body()
    try:
        data = loads(raw)
    except ValueError as err:
        raise ApiError(400, "bad_json", str(err)[:200]) from err
    return validate(data, model)


def validate(data, model):
    """A parsed JSON document -> `messages` model; 422 with the first few field errors."""
    try:
        return model.validate(data)
    except Invalid as err:
        detail = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in err.errors[:10]]
        raise ApiError(422, "invalid_request", detail) from err


def json_endpoint(handler):
    """A Starlette endpoint answering a handler's dict or `messages` model as JSON (a Response
    passes as it is): the routes of both servers, with no per-request signature work."""
    from starlette.responses import JSONResponse, Response

    async def endpoint(request) -> Response:
        out = await handler(request)
        if isinstance(out, Response):
            return out
        return JSONResponse(out.dump() if hasattr(out, "dump") else out)

    return endpoint


async def http_error_response(_request, exc):
    """Starlette's HTTPException (404, 405, a handler's own) as `{"detail": ...}` JSON, the
    shape FastAPI gave it (Starlette's own handler answers plain text)."""
    from starlette.responses import JSONResponse, Response

    headers = getattr(exc, "headers", None)
    if exc.status_code < 200 or exc.status_code in (204, 205, 304):
        return Response(status_code=exc.status_code, headers=headers)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)


def exception_handlers() -> dict:
    """The exception handlers both servers' Starlette apps register."""
    from starlette.exceptions import HTTPException

    return {HTTPException: http_error_response, ApiError: api_error_response}


def loads(raw: bytes):
    """json.loads whose every failure is a ValueError.

    The parser recurses per nesting level and raises RecursionError (not a ValueError) at
    Python's recursion limit: 200k nested brackets were a 500 before this.
    """
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from err


HEADER_TIMEOUT_SECONDS = 10.0


class _CoalescingTransport:
    """A transport whose writes within one event-loop turn leave as one `send`.

    uvicorn writes a response's head and its body separately: two system calls, two TCP
    segments. For the small JSON answers served here (a heartbeat, an exec result) the
    second `send` was about a third of the server's CPU per request on loopback. Writes are
    joined and flushed at the end of the current loop turn (`call_soon`), so nothing waits
    longer than that; `close` flushes first. Everything else goes to the real transport.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def header_timeout_protocol(seconds: float = HEADER_TIMEOUT_SECONDS,
                            on_expire: Callable[[str], None] | None = None):
    """uvicorn's h11 protocol, closing a connection that does not finish a request head in time,
    and sending each response in one write (`_CoalescingTransport`).

    uvicorn times out idle keep-alive connections but not a client that opens a connection
    and sends its request line and headers a byte at a time: each such client held a
    connection (and a file descriptor) for as long as it liked.

    The timer runs from the connection's accept to the end of its first request head (and
    from the first byte of each later head on a kept-alive connection); once a head is in,
    nothing here closes the connection, so a lease request may wait as long as its
    `wait_seconds`. Each close is reported as `on_expire("header_timeout")` (the servers
    count it in their `requests_rejected_total`): a client that connects and then sends
    nothing for `seconds` (a process too busy to write what it connected for) is closed
    like a slow one, and that counter is where it shows.
    """
    expired = on_expire or (lambda _reason: None)
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(_CoalescingTransport(transport, self.loop))
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                if self._head_timer is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                expired("header_timeout")
                self.transport.close()

    return HeaderTimeoutH11
