"""Leases are capabilities: what one group can do to another's sandbox (nothing), as attacks.

A real gateway and real sandbox servers on loopback; the clients are hostile rollout groups
that hold the run's gateway token and try to reach a sandbox that is not theirs, or to keep
running in a sandbox after their lease ended.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from asyncgrpo.sandbox.client.gateway_client import GatewayClient, LeaseLost, SandboxError
from asyncgrpo.sandbox.common.messages import ExecResult
from tests.sandbox.conftest import (
    GW_TOKEN,
    TOKEN,
    gw_client,
    holder,
    start_gateway,
    start_sandbox,
    wait_until,
)
from tests.sandbox.test_gateway import all_warm, demand
from tests.sandbox.test_server import cmdlines_containing


def in_flight(sb) -> int:
    return httpx.get(f"{sb.url}/healthz", timeout=10).json()["execs_in_flight"]


@pytest.fixture
def two_slot_sandbox(tmp_path):
    sb = start_sandbox(tmp_path, "leak", "--max-concurrent-execs", "2")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3")
    all_warm(gw, 1)
    yield gw, sb
    gw.stop()
    sb.stop()


def test_a_released_groups_queued_exec_never_runs_in_the_next_groups_sandbox(two_slot_sandbox):
    """The issue's leak: 2 slots, 3 execs of group A in flight, A releases, B gets the sandbox.

    Before: A's queued exec started after the reset and wrote into B's session (B's `ps`
    showed A's processes). Now the reset revokes A's secret first, kills A's running execs
    and waits for them, and A's queued exec finds its lease generation gone at its slot.
    """
    gw, sb = two_slot_sandbox
    a, b = GatewayClient(gw.url, GW_TOKEN), GatewayClient(gw.url, GW_TOKEN)
    la = a.lease("group-a")
    assert la.sandbox_url == sb.url  # direct data path: A talks to the sandbox itself
    results: dict[int, object] = {}

    def run(i: int, command: str) -> None:
        try:
            results[i] = a.exec(la, command, timeout_seconds=60)
        except SandboxError as err:
            results[i] = err

    threads = [threading.Thread(target=run, args=(0, "sleep 321.25")),
               threading.Thread(target=run, args=(1, "sleep 321.25"))]
    for t in threads:
        t.start()
    wait_until(lambda: len(cmdlines_containing("321.25")) == 2, 20, what="A holding both slots")
    queued = threading.Thread(target=run, args=(2, "touch A-was-here; sleep 322.75"))
    queued.start()
    wait_until(lambda: in_flight(sb) == 3, 20, what="A's third exec queued for a slot")

    a.release(la, all_holders=True)
    lb = b.lease("group-b", wait_seconds=30)
    assert lb.sandbox == la.sandbox and lb.secret != la.secret
    for t in [*threads, queued]:
        t.join(60)
    seen = b.exec(lb, "ls -A; echo ---; ps -eo args")
    assert seen["stdout"].startswith("---\n"), seen["stdout"]  # nothing of A's in B's session
    assert "321.25" not in seen["stdout"] and "322.75" not in seen["stdout"]
    assert not cmdlines_containing("322.75") and not cmdlines_containing("321.25")
    assert isinstance(results[2], LeaseLost) and results[2].error == "lease_revoked"
    for i in (0, 1):  # admitted under A's lease, killed by the reset before B got the sandbox
        assert isinstance(results[i], ExecResult) and results[i].exit_code == -9, results[i]
    # A's secret, sent straight to the sandbox it used to hold, is refused as revoked
    late = httpx.post(f"{sb.url}/v1/exec", json={"command": "touch late"},
                      headers={"authorization": f"Bearer {la.secret}"}, timeout=10)
    assert late.status_code == 410 and late.json()["error"] == "lease_revoked"
    assert b.exec(lb, "ls -A")["stdout"] == ""
    b.release(lb)


def test_an_expired_lease_is_revoked_before_the_sandbox_is_reset(tmp_path):
    sb = start_sandbox(tmp_path, "exp")
    gw = start_gateway(tmp_path, [sb.url], "--lease-ttl-seconds", "1", "--health-interval-seconds", "0.3")
    try:
        all_warm(gw, 1)
        c = GatewayClient(gw.url, GW_TOKEN)
        lease = c.lease("quiet-group")
        c.exec(lease, "setsid sh -c 'exec sleep 323.5' > /dev/null 2>&1 &")
        wait_until(lambda: demand(gw)["leases_active"] == 0, 30, what="the quiet lease expired")
        all_warm(gw, 1)
        assert not cmdlines_containing("323.5")  # the reset killed what outlived the exec
        with pytest.raises(LeaseLost) as err:
            c.exec(lease, "true")
        assert err.value.error == "lease_revoked"
    finally:
        gw.stop()
        sb.stop()


def test_a_lease_id_is_useless_to_another_group(pool_of_three):
    gw, sbs = pool_of_three
    all_warm(gw, 3)
    with gw_client(gw) as c:
        victim = c.post("/v1/leases", json={"group_id": "victim"}).json()
        thief = c.post("/v1/leases", json={"group_id": "thief"}).json()
        listing = c.get("/v1/pool").text
        assert victim["secret"] not in listing and thief["secret"] not in listing
        assert "victim" not in listing  # group names are not listed either: they let one join
        vid = victim["lease_id"]
        holder(gw, victim).post(f"/v1/leases/{vid}/files/write", json={"path": "answer.txt", "content": "42"})
        victim_sb = next(s for s in sbs if s.url == victim["sandbox_url"])
        for credential in (GW_TOKEN, thief["secret"], TOKEN, "x", vid):
            auth = {"authorization": f"Bearer {credential}"}
            for method, route, body in (("post", f"/v1/leases/{vid}/exec", {"command": "cat answer.txt"}),
                                        ("post", f"/v1/leases/{vid}/files/read", {"path": "answer.txt"}),
                                        ("post", f"/v1/leases/{vid}/heartbeat", None),
                                        ("delete", f"/v1/leases/{vid}", None)):
                r = httpx.request(method, gw.url + route, json=body, headers=auth, timeout=10)
                assert r.status_code == 401, (credential, route, r.text)
            for route, body in (("/v1/exec", {"command": "cat answer.txt"}), ("/v1/files/read", {"path": "answer.txt"})):
                r = httpx.post(victim_sb.url + route, json=body, headers=auth, timeout=10)
                assert r.status_code == 401, (credential, route, r.text)
        # the run-wide sandbox token opens only the control call (reset), and the lease
        # secret never opens it
        r = httpx.post(f"{victim_sb.url}/v1/reset", headers={"authorization": f"Bearer {victim['secret']}"})
        assert r.status_code == 401
        # an id the gateway never granted (say, before it restarted): told so, to lease again
        never = holder(gw, victim).post("/v1/leases/no-such-lease/exec", json={"command": "true"})
        assert never.status_code == 404 and never.json()["error"] == "lease_unknown"
        mine = holder(gw, victim).post(f"/v1/leases/{vid}/files/read", json={"path": "answer.txt"}).json()
        assert mine["content"] == "42"
        assert demand(gw)["leases_active"] == 2


def test_a_waiter_that_hangs_up_gives_its_place_up(tmp_path):
    sb = start_sandbox(tmp_path, "wait")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3")
    try:
        all_warm(gw, 1)
        with gw_client(gw) as c:
            first = c.post("/v1/leases", json={"group_id": "first"}).json()
            body = b'{"group_id": "gone", "wait_seconds": 120}'
            s = socket.create_connection(("127.0.0.1", gw.port))
            s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + GW_TOKEN.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
            wait_until(lambda: demand(gw)["waiting"] == 1, 10, what="the waiter queued")
            s.close()
            wait_until(lambda: demand(gw)["waiting"] == 0, 10, what="the waiter gone from the queue")
            holder(gw, first).delete(f"/v1/leases/{first['lease_id']}")
            nxt = c.post("/v1/leases", json={"group_id": "next", "wait_seconds": 30}).json()
            assert nxt["sandbox"] == first["sandbox"]
            assert demand(gw)["leases_active"] == 1
    finally:
        gw.stop()
        sb.stop()


@pytest.mark.parametrize("data_path", ["direct", "proxied"])
def test_a_hung_sandbox_fails_its_call_and_is_taken_out(tmp_path, data_path):
    import os
    import signal

    sb = start_sandbox(tmp_path, "hung")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "1", "--health-failures", "1000",
                       "--health-timeout-seconds", "0.5",
                       "--data-path", data_path)
    try:
        all_warm(gw, 1)
        c = GatewayClient(gw.url, GW_TOKEN)
        lease = c.lease("g")
        assert (lease.sandbox_url is None) == (data_path == "proxied")
        os.kill(sb.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(LeaseLost) as err:
                c.exec(lease, "true", timeout_seconds=1)
            waited = time.monotonic() - t0
            assert err.value.error == "sandbox_lost"
            assert demand(gw)["unhealthy_members"] == [lease.sandbox]
            with pytest.raises(LeaseLost):  # the next call on the lease fails at once
                c.exec(lease, "true", timeout_seconds=1)
        finally:
            os.kill(sb.pid, signal.SIGCONT)
        print(f"hung sandbox ({data_path}): call failed after {waited:.1f}s for a 1 s exec timeout")
        all_warm(gw, 1)  # back after health and a reset
    finally:
        gw.stop()
        sb.stop()
