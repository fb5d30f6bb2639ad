"""Guards every HTTP server here shares: bearer-token auth and a request body cap.

Both are plain ASGI middleware so they act before FastAPI parses anything: a request with
no or the wrong token never reaches a handler (401), and a body over the cap is refused
(413) after reading at most the cap, whether or not the client sent Content-Length.
Health and metrics stay open on purpose: kubelet probes and Prometheus scrapes cannot send
a per-run secret, and neither route reveals or changes anything sensitive.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterable

OPEN_PATHS: frozenset[str] = frozenset({"/healthz", "/metrics"})


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


def token_matches(header_value: str | None, token: str) -> bool:
    if not header_value or not header_value.startswith("Bearer "):
        return False
    return hmac.compare_digest(header_value[7:].strip().encode(), token.encode())


class GuardMiddleware:
    """401 without the run's token, 413 over `max_body_bytes`; `on_reject(reason)` counts."""

    def __init__(
        self,
        app,
        *,
        token: str,
        max_body_bytes: int,
        open_paths: frozenset[str] = OPEN_PATHS,
        on_reject: Callable[[str], None] | None = None,
    ):
        if not token:
            raise ValueError("a non-empty token is required")
        self.app = app
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths
        self.on_reject = on_reject or (lambda reason: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in self.open_paths and not token_matches(
            headers.get("authorization"), self.token
        ):
            self.on_reject("unauthorized")
            return await _send_json(
                send, 401, {"error": "unauthorized", "detail": "missing or wrong bearer token"},
                [(b"www-authenticate", b"Bearer")],
            )
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                self.on_reject("bad_length")
                return await _send_json(send, 400, {"error": "bad_request", "detail": "bad Content-Length"})
            if int(declared) > self.max_body_bytes:
                self.on_reject("too_large")
                return await _send_json(send, 413, self._too_large())
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                self.on_reject("too_large")
                return await _send_json(send, 413, self._too_large())
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _too_large(self) -> dict:
        return {"error": "too_large", "detail": f"request body over {self.max_body_bytes} bytes"}


async def parse_body(request, model):
    """JSON body -> pydantic model whatever the Content-Type; 400 bad JSON, 422 bad fields."""
    from fastapi import HTTPException
    from pydantic import ValidationError

    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise HTTPException(400, detail={"error": "bad_json", "detail": str(err)[:200]}) from err
    try:
        return model.model_validate(data)
    except ValidationError as err:
        detail = [{"loc": e["loc"], "msg": e["msg"]} for e in err.errors()[:10]]
        raise HTTPException(422, detail={"error": "invalid_request", "detail": detail}) from err
