"""The dev-route guard: clients from outside the pod reach the OpenAI API, health and metrics
only; the pod itself (a client whose address is the server's) reaches everything."""

from __future__ import annotations

import asyncio
import http.client

import pytest

from asyncgrpo.weights.guard import DevRoutesLoopbackOnly, allowed


@pytest.mark.parametrize("path,client,server,ok", [
    ("/v1/completions", "10.1.2.3", "10.1.2.9", True),
    ("/health", "10.1.2.3", "10.1.2.9", True),
    ("/metrics", "10.1.2.3", "10.1.2.9", True),
    ("/collective_rpc", "10.1.2.3", "10.1.2.9", False),
    ("/pause", "10.1.2.3", "10.1.2.9", False),
    ("/update_weight_version", "10.1.2.3", "10.1.2.9", False),
    ("/reset_prefix_cache", "10.1.2.3", "10.1.2.9", False),
    ("/v1load", "10.1.2.3", "10.1.2.9", False),  # a prefix trick is not /v1/
    # rollouts of full fine-tuning generate here (it reports weight versions); aborting
    # other clients' requests stays inside the pod
    ("/inference/v1/generate", "10.1.2.3", "10.1.2.9", True),
    ("/inference/v1/abort_requests", "10.1.2.3", "10.1.2.9", False),
    ("/abort_requests", "10.1.2.3", "10.1.2.9", False),
    # in a pod: the puller calls 127.0.0.1 from 127.0.0.1
    ("/collective_rpc", "127.0.0.1", "127.0.0.1", True),
    ("/collective_rpc", "::1", "::1", True),
    # the local backend: the puller binds its pod's address; another pod's client comes
    # from 127.0.0.1 (unbound) or from its own pod address: loopback, but not this pod
    ("/collective_rpc", "127.9.9.2", "127.9.9.2", True),
    ("/collective_rpc", "127.0.0.1", "127.9.9.2", False),
    ("/collective_rpc", "127.9.9.3", "127.9.9.2", False),
    ("/collective_rpc", None, "127.0.0.1", False),
    ("/collective_rpc", "127.0.0.1", None, False),
    ("/collective_rpc", "not-an-ip", "not-an-ip", False),
])
def test_allowed(path, client, server, ok):
    assert allowed(path, client, server) is ok


def test_middleware_answers_403_without_calling_vllm():
    called = []

    async def app(scope, receive, send):
        called.append(scope["path"])

    sent = []

    async def send(msg):
        sent.append(msg)

    mw = DevRoutesLoopbackOnly(app)
    scope = {"type": "http", "path": "/collective_rpc", "client": ("10.0.0.7", 5555),
             "server": ("127.0.0.1", 8000)}
    asyncio.run(mw(scope, None, send))
    assert called == [] and sent[0]["status"] == 403
    asyncio.run(mw({**scope, "client": ("127.0.0.1", 1)}, None, send))
    asyncio.run(mw({**scope, "path": "/v1/completions"}, None, send))
    assert called == ["/collective_rpc", "/v1/completions"]


def status_from(host: str, port: int, path: str, source: str | None) -> int:
    """The HTTP status of GET `path` on host:port from local address `source` (None: the
    kernel's choice, 127.0.0.1 for a loopback destination)."""
    conn = http.client.HTTPConnection(host, port, timeout=10,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_over_real_sockets_the_puller_is_admitted_and_other_local_pods_refused():
    """The local backend's case on real connections: a server on one pod's loopback address
    (127.A.B.n), the guard in front. The puller's client (which calls from the address it
    calls) reaches the dev routes; a client of another local pod, unbound (as the trainer's
    HTTP clients are: the kernel picks 127.0.0.1) or bound to that pod's own address, gets 403."""
    import secrets
    import socket
    import threading
    import time
    import urllib.error
    import urllib.request

    import uvicorn

    from asyncgrpo.weights.puller import VLLMControl

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b'{"weight_version": "7"}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    block = f"127.{1 + secrets.randbelow(254)}.{secrets.randbelow(256)}"
    pod, other = f"{block}.2", f"{block}.3"
    with socket.socket() as s:
        s.bind((pod, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(DevRoutesLoopbackOnly(app), host=pod, port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        url = f"http://{pod}:{port}"
        assert VLLMControl(url).weight_version() == "7"  # the puller, from its pod's address

        assert status_from(pod, port, "/weight_info", None) == 403   # unbound: from 127.0.0.1
        assert status_from(pod, port, "/weight_info", other) == 403  # another pod's address
        assert status_from(pod, port, "/weight_info", pod) == 200
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            assert resp.status == 200         # the public routes answer anyone
    finally:
        server.should_exit = True
        thread.join(timeout=10)
