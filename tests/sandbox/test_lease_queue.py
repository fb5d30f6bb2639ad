"""The lease queue and group credentials against a real gateway and real sandbox servers.

The clients are hostile holders of the run's gateway token: one names another's group id to
join it and read its files, one floods the queue with waiters to starve a legitimate group
or to exhaust the gateway. Client addresses are distinct loopback addresses (127.0.0.x),
which is how the gateway tells clients apart.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from asyncgrpo.sandbox.client.gateway_client import GatewayClient
from tests.sandbox.conftest import (
    GW_TOKEN,
    gw_client,
    holder,
    start_gateway,
    start_sandbox,
    wait_until,
)
from tests.sandbox.test_gateway import all_warm, demand


def test_a_second_client_naming_a_group_id_cannot_join_that_group(pool_of_three):
    """The issue's attack: client B leases A's group id and reads A's files.

    Before: B joined A's lease (same lease id, same secret, same sandbox) and read them.
    Now the group is filed under A's key; B's request is a group of its own.
    """
    gw, _ = pool_of_three
    all_warm(gw, 3)
    a, b = GatewayClient(gw.url, GW_TOKEN), GatewayClient(gw.url, GW_TOKEN)
    la = a.lease("shared-group-id")
    a.write_file(la, "answer.txt", "group A's secret work", session="r0")
    assert a.lease("shared-group-id").lease_id == la.lease_id  # A's own rollouts do join
    lb = b.lease("shared-group-id")
    assert lb.lease_id != la.lease_id and lb.secret != la.secret and not lb.joined
    assert lb.sandbox != la.sandbox
    seen = b.exec(lb, "cat r0/answer.txt; ls -A", timeout_seconds=10)
    assert "secret work" not in seen.stdout and seen.stdout == ""
    # nor a raw request without any key: it can neither join A nor be joined
    with gw_client(gw) as c:
        bare = c.post("/v1/leases", json={"group_id": "shared-group-id", "wait_seconds": 0}).json()
        assert not bare["joined"] and bare["sandbox"] not in (la.sandbox, lb.sandbox)
        again = c.post("/v1/leases", json={"group_id": "shared-group-id", "wait_seconds": 0})
        assert again.status_code == 503  # nor did a second bare request join the bare one
        holder(gw, bare).delete(f"/v1/leases/{bare['lease_id']}")
        short = c.post("/v1/leases", json={"group_id": "x", "group_key": "short"})
        assert short.status_code == 422  # a key is a credential: too short to be one is refused
    for client, lease in ((a, la), (b, lb)):
        client.release(lease, all_holders=True)


def _client_at(address: str, limits: int = 1000) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address),
                             headers={"authorization": f"Bearer {GW_TOKEN}"}, timeout=120,
                             limits=httpx.Limits(max_connections=limits))


async def _until_waiting(c: httpx.AsyncClient, gw, n: int, timeout: float = 60.0) -> None:
    seen = -1
    for _ in range(int(timeout / 0.1)):
        seen = (await c.get(f"{gw.url}/v1/demand")).json()["waiting"]
        if seen >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{seen} waiting, not {n}")


@pytest.fixture
def one_busy_sandbox(tmp_path):
    """A gateway of one sandbox, leased by `first`: every further request waits."""
    sb = start_sandbox(tmp_path, "solo")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3",
                       "--max-waiters-per-client", "400")
    all_warm(gw, 1)
    with gw_client(gw) as c:
        first = c.post("/v1/leases", json={"group_id": "first"}).json()
    yield gw, first
    gw.stop()
    sb.stop()


def test_a_legit_group_is_not_starved_behind_many_hostile_waiters(one_busy_sandbox):
    """80 waiters of a hostile client queue first; a legitimate client's group is served by the
    second grant (round-robin across clients), not after all 80 (first come, first served)."""
    gw, first = one_busy_sandbox
    hostile_n = 80

    async def scenario() -> tuple[int, dict]:
        async with _client_at("127.0.0.2") as hostile, _client_at("127.0.0.1") as legit:
            flood = [asyncio.ensure_future(hostile.post(
                f"{gw.url}/v1/leases", json={"group_id": f"h{i}", "wait_seconds": 60}))
                for i in range(hostile_n)]
            await _until_waiting(legit, gw, hostile_n)
            mine = asyncio.ensure_future(legit.post(
                f"{gw.url}/v1/leases", json={"group_id": "legit", "wait_seconds": 60}))
            await _until_waiting(legit, gw, hostile_n + 1)
            grants = 0
            current = first
            while not mine.done():
                r = await legit.delete(f"{gw.url}/v1/leases/{current['lease_id']}",
                                       headers={"authorization": f"Bearer {current['secret']}"})
                assert r.status_code == 200, r.text
                grants += 1
                done, _ = await asyncio.wait([mine, *flood], return_when=asyncio.FIRST_COMPLETED,
                                             timeout=30)
                assert done, "no waiter was served after a release"
                if mine.done():
                    break
                served = next(f for f in flood if f.done())
                flood.remove(served)
                current = served.result().json()
            for f in flood:
                f.cancel()
            return grants, mine.result().json()

    grants, got = asyncio.run(scenario())
    assert got["group_id"] == "legit" and "lease_id" in got
    assert grants <= 2  # first come, first served: 81
    holder(gw, got).delete(f"/v1/leases/{got['lease_id']}")


def test_a_client_over_its_waiter_bound_gets_429_and_others_still_queue(tmp_path):
    sb = start_sandbox(tmp_path, "solo")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3",
                       "--max-waiters-per-client", "5")
    try:
        all_warm(gw, 1)
        with gw_client(gw) as c:
            first = c.post("/v1/leases", json={"group_id": "first"}).json()

        def wait_from(address: str, group: str) -> None:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=address),
                              headers={"authorization": f"Bearer {GW_TOKEN}"}, timeout=60) as h:
                h.post(f"{gw.url}/v1/leases", json={"group_id": group, "wait_seconds": 5})

        threads = [threading.Thread(target=wait_from, args=("127.0.0.3", f"g{i}")) for i in range(5)]
        for t in threads:
            t.start()
        wait_until(lambda: demand(gw)["waiting"] == 5, 20, what="5 waiters of one client")
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"),
                          headers={"authorization": f"Bearer {GW_TOKEN}"}, timeout=60) as h:
            over = h.post(f"{gw.url}/v1/leases", json={"group_id": "g5", "wait_seconds": 5})
        assert over.status_code == 429 and over.json()["error"] == "too_many_waiters"
        assert "5 lease requests waiting" in over.json()["detail"]
        assert over.headers["retry-after"] == "1"
        other = threading.Thread(target=wait_from, args=("127.0.0.4", "other"))
        other.start()
        wait_until(lambda: demand(gw)["waiting"] == 6, 20, what="another client still queues")
        assert 'asyncgrpo_gateway_requests_rejected_total{reason="too_many_waiters"} 1.0' in \
            httpx.get(f"{gw.url}/metrics").text
        holder(gw, first).delete(f"/v1/leases/{first['lease_id']}")
        for t in [*threads, other]:
            t.join(30)
    finally:
        gw.stop()
        sb.stop()


def test_waiters_that_hang_up_leave_the_queue_without_an_error(one_busy_sandbox):
    """A waiter that hangs up gives its place up, and the gateway's handler ends quietly.

    Before: the handler cancelled its acquire task and read its result at once, before the
    cancellation had run (`InvalidStateError`): a 500 and a traceback in the gateway's log
    for every waiter that left (10,000 of them per `bench/lease_queue_bench.py --http` run).
    """
    gw, first = one_busy_sandbox
    body = b'{"group_id": "%s", "wait_seconds": 60}'
    socks = []
    for i in range(5):
        s = socket.create_connection(("127.0.0.1", gw.port))
        payload = body % f"gone{i}".encode()
        s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + GW_TOKEN.encode() + b"\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        socks.append(s)
    wait_until(lambda: demand(gw)["waiting"] == 5, 20, what="5 waiters")
    for s in socks:
        s.close()
    wait_until(lambda: demand(gw)["waiting"] == 0, 20, what="the waiters gone from the queue")
    logs = gw.logs()
    assert "InvalidStateError" not in logs and "Exception in ASGI application" not in logs, logs[-2000:]
    with gw_client(gw) as c:  # the queue still serves: the next request gets the next grant
        holder(gw, first).delete(f"/v1/leases/{first['lease_id']}")
        assert c.post("/v1/leases", json={"group_id": "after", "wait_seconds": 10}).status_code == 200


def test_a_waiter_outlasting_the_head_timeout_keeps_its_place_while_a_silent_connection_is_cut(
        one_busy_sandbox):
    """The request-head timeout (10 s from accept) closes a connection that sends nothing, and
    counts it; it never closes a lease request whose head is in, however long it waits.

    This is what `bench/lease_queue_bench.py --http` hit (docs/benchmarks/lease-queue.md): the
    connections the gateway closed had sent no byte within 10 s of their accept (the bench's
    one client process, opening 10,000 connections at once on a busy machine, had not written
    them yet); no waiting request was ever closed. Before, those closes were not counted.
    """
    from asyncgrpo.sandbox.common.http_guard import HEADER_TIMEOUT_SECONDS

    gw, first = one_busy_sandbox
    answer: dict = {}

    def wait() -> None:
        with httpx.Client(headers={"authorization": f"Bearer {GW_TOKEN}"}, timeout=120) as h:
            r = h.post(f"{gw.url}/v1/leases", json={"group_id": "patient", "wait_seconds": 60})
            answer.update(status=r.status_code, body=r.json())

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: demand(gw)["waiting"] == 1, 20, what="the waiter queued")
    silent = socket.create_connection(("127.0.0.1", gw.port))  # connects after the waiter did
    silent.settimeout(HEADER_TIMEOUT_SECONDS * 6)
    assert silent.recv(100) == b""  # closed by the gateway, no answer: the head timeout
    silent.close()
    # the waiter has now waited longer than that timeout on its own connection: still queued
    assert demand(gw)["waiting"] == 1 and waiter.is_alive()
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert 'asyncgrpo_gateway_requests_rejected_total{reason="header_timeout"} 1.0' in metrics
    holder(gw, first).delete(f"/v1/leases/{first['lease_id']}")
    waiter.join(30)
    assert answer["status"] == 200 and answer["body"]["group_id"] == "patient", answer
    holder(gw, answer["body"]).delete(f"/v1/leases/{answer['body']['lease_id']}")
