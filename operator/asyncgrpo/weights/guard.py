"""vLLM middleware: dev-mode routes answer only to the pod itself.

Full fine-tuning needs ``VLLM_SERVER_DEV_MODE=1`` for the puller's swap (``/pause``,
``/collective_rpc``, ``/update_weight_version``, ``/resume``). Those routes would let anyone who
can reach the server run methods on its workers or freeze it, and vLLM's ``--api-key`` guards
only ``/v1``-style paths. Loaded with ``--middleware asyncgrpo.weights.guard.DevRoutesLoopbackOnly``
(the operator adds it for full fine-tuning), this lets clients from outside the pod reach only
what rollouts, probes and scrapers use (:data:`PUBLIC`); everything else answers 403 unless the
connection comes from the pod itself, where the puller sidecar is.

"From the pod itself" is: the client's address is the address the connection reached the
server on. In a pod the puller calls ``127.0.0.1`` from ``127.0.0.1`` (containers share the pod's
loopback); another pod's address differs, and Linux drops a packet from outside that claims a
local source address. Not "any loopback client": the local backend (docs/local.md) gives every
pod its own loopback address (``127.A.B.n``) on one machine, where a connection to any of them
comes from ``127.0.0.1`` unless the client binds its own, so "loopback" would admit every local
pod (the trainer included). The puller binds the address it calls (:mod:`asyncgrpo.weights.puller`),
which is its pod's address there and ``127.0.0.1`` in a pod.
"""

from __future__ import annotations

import ipaddress
import json

#: Paths (prefixes) any client may use: the OpenAI API, the token-in/token-out generate route
#: (rollouts of full fine-tuning: it reports which weights sampled each token), health, metrics.
PUBLIC = ("/v1/", "/inference/v1/generate", "/health", "/metrics", "/ping", "/version")
MIDDLEWARE = "asyncgrpo.weights.guard.DevRoutesLoopbackOnly"


def same_address(client_host: str | None, server_host: str | None) -> bool:
    """The connection's two ends have one address: it comes from the server's own pod."""
    try:
        return (client_host is not None and server_host is not None
                and ipaddress.ip_address(client_host) == ipaddress.ip_address(server_host))
    except ValueError:
        return False


def allowed(path: str, client_host: str | None, server_host: str | None) -> bool:
    return path.startswith(PUBLIC) or same_address(client_host, server_host)


class DevRoutesLoopbackOnly:
    """A pure ASGI middleware (vLLM's ``--middleware`` takes a class with ``__init__(app)``).
    ASGI's ``scope["server"]`` is the connection's local address (uvicorn: the socket's
    ``getsockname``), ``scope["client"]`` its peer."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") in ("http", "websocket"):
            path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
            client = scope.get("client") or (None, None)
            server = scope.get("server") or (None, None)
            if not allowed(path, client[0], server[0]):
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
