"""The dev-route guard: outside clients reach the OpenAI API, health and metrics only."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.weights.guard import DevRoutesLoopbackOnly, allowed


@pytest.mark.parametrize("path,host,ok", [
    ("/v1/completions", "10.1.2.3", True),
    ("/health", "10.1.2.3", True),
    ("/metrics", "10.1.2.3", True),
    ("/collective_rpc", "10.1.2.3", False),
    ("/pause", "10.1.2.3", False),
    ("/update_weight_version", "10.1.2.3", False),
    ("/reset_prefix_cache", "10.1.2.3", False),
    ("/v1load", "10.1.2.3", False),  # a prefix trick is not /v1/
    ("/collective_rpc", "127.0.0.1", True),
    ("/collective_rpc", "127.9.9.9", True),
    ("/collective_rpc", "::1", True),
    ("/collective_rpc", None, False),
    ("/collective_rpc", "not-an-ip", False),
])
def test_allowed(path, host, ok):
    assert allowed(path, host) is ok


def test_middleware_answers_403_without_calling_vllm():
    called = []

    async def app(scope, receive, send):
        called.append(scope["path"])

    sent = []

    async def send(msg):
        sent.append(msg)

    mw = DevRoutesLoopbackOnly(app)
    scope = {"type": "http", "path": "/collective_rpc", "client": ("10.0.0.7", 5555)}
    asyncio.run(mw(scope, None, send))
    assert called == [] and sent[0]["status"] == 403
    asyncio.run(mw({**scope, "client": ("127.0.0.1", 1)}, None, send))
    asyncio.run(mw({**scope, "path": "/v1/completions"}, None, send))
    assert called == ["/collective_rpc", "/v1/completions"]
