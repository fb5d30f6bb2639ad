"""vLLM middleware: dev-mode routes answer only to the pod itself.

Full fine-tuning needs ``VLLM_SERVER_DEV_MODE=1`` for the puller's swap (``/pause``,
``/collective_rpc``, ``/update_weight_version``, ``/resume``). Those routes would let anyone who
can reach the server run methods on its workers or freeze it, and vLLM's ``--api-key`` guards
only ``/v1``-style paths. Loaded with ``--middleware asyncgrpo.weights.guard.DevRoutesLoopbackOnly``
(the operator adds it for full fine-tuning), this lets clients from outside the pod reach only
what rollouts, probes and scrapers use (:data:`PUBLIC`); everything else answers 403 unless it
comes from loopback, where the puller sidecar is (containers of a pod share its network).
"""

from __future__ import annotations

import ipaddress
import json

#: Path prefixes any client may use: the OpenAI API, health, metrics.
PUBLIC = ("/v1/", "/health", "/metrics", "/ping", "/version")
MIDDLEWARE = "asyncgrpo.weights.guard.DevRoutesLoopbackOnly"


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed(path: str, client_host: str | None) -> bool:
    return path.startswith(PUBLIC) or is_loopback(client_host)


class DevRoutesLoopbackOnly:
    """A pure ASGI middleware (vLLM's ``--middleware`` takes a class with ``__init__(app)``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") in ("http", "websocket"):
            path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
            client = scope.get("client") or (None, None)
            if not allowed(path, client[0]):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps({"error": "route available only inside the pod"}).encode()
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
