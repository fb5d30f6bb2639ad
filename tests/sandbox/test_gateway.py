"""The gateway and several sandbox servers as real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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

GROUP_KEY = "group-key-of-these-tests-0123456789"


def demand(gw) -> dict:
    return httpx.get(f"{gw.url}/v1/demand", timeout=10).json()


def all_warm(gw, n: int) -> None:
    wait_until(lambda: demand(gw)["members"] and list(demand(gw)["members"].values()) == ["warm"] * n,
               30, what=f"{n} warm sandboxes")


@pytest.fixture
def one_sandbox(tmp_path):
    sb = start_sandbox(tmp_path, "solo")
    gw = start_gateway(tmp_path, [sb.url], "--lease-ttl-seconds", "3", "--health-interval-seconds", "0.3")
    all_warm(gw, 1)
    yield gw, sb
    gw.stop()
    sb.stop()


def test_group_shares_one_lease_and_the_next_group_gets_a_reset_sandbox(one_sandbox):
    gw, _ = one_sandbox
    with gw_client(gw) as c:
        # one group = one id under one key (the key is the group's credential, not the id)
        first = c.post("/v1/leases", json={"group_id": "g1", "group_key": GROUP_KEY}).json()
        second = c.post("/v1/leases", json={"group_id": "g1", "group_key": GROUP_KEY}).json()
        assert second["lease_id"] == first["lease_id"] and second["joined"] and second["holders"] == 2
        assert second["secret"] == first["secret"]
        lid = first["lease_id"]
        h = holder(gw, first)
        h.post(f"/v1/leases/{lid}/files/write", json={"path": "notes.txt", "content": "from rollout 0"})
        seen = h.post(f"/v1/leases/{lid}/exec", json={"command": "cat notes.txt"}).json()
        assert seen["stdout"] == "from rollout 0"
        assert h.delete(f"/v1/leases/{lid}").json() == {"lease_id": lid, "ended": False, "holders": 1}
        assert h.delete(f"/v1/leases/{lid}").json()["ended"] is True
        gone = h.post(f"/v1/leases/{lid}/exec", json={"command": "true"})
        assert gone.status_code == 410 and gone.json()["error"] == "lease_released"
        nxt = c.post("/v1/leases", json={"group_id": "g2", "wait_seconds": 30}).json()
        assert nxt["sandbox"] == first["sandbox"] and nxt["lease_id"] != lid
        assert nxt["secret"] != first["secret"]
        after = holder(gw, nxt).post(f"/v1/leases/{nxt['lease_id']}/exec", json={"command": "ls -A"}).json()
        assert after["stdout"] == ""  # the previous group's files were reset away
        holder(gw, nxt).delete(f"/v1/leases/{nxt['lease_id']}")


def test_groups_get_distinct_sandboxes_and_wait_when_none_is_free(pool_of_three):
    gw, _sbs = pool_of_three
    all_warm(gw, 3)
    with gw_client(gw) as c:
        leases = [c.post("/v1/leases", json={"group_id": f"g{i}"}).json() for i in range(3)]
        assert len({lease["sandbox"] for lease in leases}) == 3
        full = c.post("/v1/leases", json={"group_id": "late", "wait_seconds": 0.2})
        assert full.status_code == 503 and full.json()["error"] == "no_sandbox"
        got: dict = {}
        waiter = threading.Thread(target=lambda: got.update(
            c.post("/v1/leases", json={"group_id": "late", "wait_seconds": 60}).json()))
        waiter.start()
        wait_until(lambda: demand(gw)["waiting"] == 1, 10, what="one waiting lease request")
        d = demand(gw)
        assert (d["busy"], d["idle"], d["waiting"]) == (3, 0, 1)
        holder(gw, leases[1]).delete(f"/v1/leases/{leases[1]['lease_id']}")
        waiter.join(30)
        assert got["sandbox"] == leases[1]["sandbox"] and got["joined"] is False
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'asyncgrpo_gateway_lease_wait_seconds_count{start="cold"} 1.0' in metrics
        assert 'asyncgrpo_gateway_lease_wait_seconds_count{start="warm"} 3.0' in metrics
        assert 'asyncgrpo_gateway_lease_wait_timeouts_total 1.0' in metrics
        for lease in (leases[0], leases[2], got):
            holder(gw, lease).delete(f"/v1/leases/{lease['lease_id']}")
        all_warm(gw, 3)
        assert demand(gw)["leases_active"] == 0


ROLLOUT = r"""
import sys, time
from asyncgrpo.sandbox.client.gateway_client import GatewayClient, Heartbeats
c = GatewayClient(sys.argv[1], sys.argv[2])
lease = c.lease("crashy-group")
Heartbeats.for_client(c, 0.2).add(lease)
c.exec(lease, "echo hi > proof.txt")
print(lease.lease_id, lease.secret, flush=True)
time.sleep(3600)
"""


def test_a_killed_rollouts_lease_expires_and_the_sandbox_comes_back(one_sandbox):
    gw, _ = one_sandbox
    proc = subprocess.Popen([sys.executable, "-c", ROLLOUT, gw.url, GW_TOKEN], stdout=subprocess.PIPE, text=True)
    try:
        lease_id, secret = proc.stdout.readline().split()
        # heartbeats keep it: the lease outlives several TTLs while the rollout lives
        with gw_client(gw) as c:
            pool = c.get("/v1/pool").json()
            assert [lease["lease_id"] for lease in pool["leases"]] == [lease_id]
            for _ in range(4):
                before = demand(gw)["leases_active"]
                threading.Event().wait(1.0)  # 4 s in all: more than the 3 s TTL
                assert before == demand(gw)["leases_active"] == 1
        proc.kill()
        proc.wait()
        wait_until(lambda: demand(gw)["leases_active"] == 0, 20, what="lease taken back")
        all_warm(gw, 1)
        with gw_client(gw) as c:
            r = holder(gw, {"secret": secret}).post(f"/v1/leases/{lease_id}/exec", json={"command": "true"})
            assert r.status_code == 410 and r.json()["error"] == "lease_expired"
            fresh = c.post("/v1/leases", json={"group_id": "next"}).json()
            assert holder(gw, fresh).post(f"/v1/leases/{fresh['lease_id']}/exec",
                                          json={"command": "ls"}).json()["stdout"] == ""
        assert 'asyncgrpo_gateway_leases_ended_total{how="expired"} 1.0' in httpx.get(f"{gw.url}/metrics").text
    finally:
        proc.kill()


def test_a_sandbox_that_dies_mid_exec_is_reported_and_replaced(pool_of_three, tmp_path):
    gw, sbs = pool_of_three
    all_warm(gw, 3)
    with gw_client(gw) as c:
        lease = c.post("/v1/leases", json={"group_id": "doomed"}).json()
        victim = next(s for s in sbs if s.url.endswith(lease["sandbox"]))
        result: dict = {}
        h = holder(gw, lease)
        t = threading.Thread(target=lambda: result.update(r=h.post(
            f"/v1/leases/{lease['lease_id']}/exec", json={"command": "echo started > s; sleep 60"})))
        t.start()
        wait_until(lambda: os.path.exists(victim.workspace / "main" / "s"), 20, what="exec started")
        victim.kill()
        t.join(60)
        r = result["r"]
        assert r.status_code == 502 and r.json()["error"] == "sandbox_lost"
        assert r.json()["sandbox"] == lease["sandbox"]
        again = h.post(f"/v1/leases/{lease['lease_id']}/exec", json={"command": "true"})
        assert again.status_code == 410 and again.json()["error"] == "sandbox_lost"
        d = demand(gw)
        assert d["unhealthy_members"] == [lease["sandbox"]] and d["idle"] == 2
        # the group leases again and lands on a healthy sandbox
        retry = c.post("/v1/leases", json={"group_id": "doomed"}).json()
        assert retry["sandbox"] != lease["sandbox"]
        h2 = holder(gw, retry)
        assert h2.post(f"/v1/leases/{retry['lease_id']}/exec", json={"command": "echo ok"}).json()["stdout"] == "ok\n"
        h2.delete(f"/v1/leases/{retry['lease_id']}")
        # a replacement process on the same address rejoins after passing health and reset
        victim.start()
        all_warm(gw, 3)
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'asyncgrpo_gateway_sandbox_failures_total{reason="lost"} 1.0' in metrics
        assert 'asyncgrpo_gateway_leases_ended_total{how="broken"} 1.0' in metrics


def test_an_idle_sandbox_failing_health_is_taken_out(pool_of_three):
    gw, sbs = pool_of_three
    all_warm(gw, 3)
    sbs[2].kill()
    name = sbs[2].url.split("//")[1]
    wait_until(lambda: demand(gw)["unhealthy_members"] == [name], 20, what="member reported unhealthy")
    with gw_client(gw) as c:
        leases = [c.post("/v1/leases", json={"group_id": f"g{i}"}).json() for i in range(2)]
        assert name not in {lease["sandbox"] for lease in leases}
        assert c.post("/v1/leases", json={"group_id": "g3", "wait_seconds": 0.1}).status_code == 503
    assert 'asyncgrpo_gateway_sandboxes{state="unhealthy"} 1.0' in httpx.get(f"{gw.url}/metrics").text


def test_gateway_auth_demand_and_drain(pool_of_three):
    gw, _sbs = pool_of_three
    all_warm(gw, 3)
    for headers in ({}, {"authorization": "Bearer nope"}):
        assert httpx.post(f"{gw.url}/v1/leases", json={"group_id": "x"}, headers=headers).status_code == 401
        assert httpx.get(f"{gw.url}/v1/pool", headers=headers).status_code == 401
    d = demand(gw)
    assert {k: d[k] for k in ("busy", "idle", "waiting", "starting", "unhealthy", "total")} == {
        "busy": 0, "idle": 3, "waiting": 0, "starting": 0, "unhealthy": 0, "total": 3}
    with gw_client(gw) as c:
        assert c.post("/v1/leases", content=b"{oops").status_code == 400
        assert c.post("/v1/leases", json={"group_id": ""}).status_code == 422
        assert c.post("/v1/leases", content=json.dumps({"group_id": "g", "x": "y" * (5 << 20)})).status_code == 413
        lease = c.post("/v1/leases", json={"group_id": "g"}).json()
        busy = c.post(f"/v1/members/{lease['sandbox']}/drain").json()
        assert busy["safe_to_delete"] is False
        idle_name = next(n for n, s in demand(gw)["members"].items() if s == "warm")
        assert c.post(f"/v1/members/{idle_name}/drain").json()["safe_to_delete"] is True
        holder(gw, lease).delete(f"/v1/leases/{lease['lease_id']}")
        wait_until(lambda: demand(gw)["members"][lease["sandbox"]] == "draining", 20, what="drained after release")
        assert demand(gw)["idle"] == 1


@pytest.mark.slow
def test_500_concurrent_execs_through_the_gateway(pool_of_three):
    import asyncio

    gw, _ = pool_of_three
    all_warm(gw, 3)

    async def run():
        async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": f"Bearer {GW_TOKEN}"},
                                     timeout=300, limits=httpx.Limits(max_connections=600)) as c:
            leases = [(await c.post("/v1/leases", json={"group_id": f"g{i}"})).json() for i in range(3)]

            async def one(i):
                lease = leases[i % 3]
                r = await c.post(f"/v1/leases/{lease['lease_id']}/exec", json={"command": f"echo {i}"},
                                 headers={"authorization": f"Bearer {lease['secret']}"})
                return r.json()["stdout"]

            out = await asyncio.gather(*(one(i) for i in range(500)))
            for lease in leases:
                await c.delete(f"/v1/leases/{lease['lease_id']}", headers={"authorization": f"Bearer {lease['secret']}"})
            return out

    assert asyncio.run(run()) == [f"{i}\n" for i in range(500)]
    all_warm(gw, 3)
    assert demand(gw)["leases_active"] == 0


def test_an_exec_longer_than_the_gateway_allows_is_cut_by_the_sandbox_not_dropped(tmp_path):
    sb = start_sandbox(tmp_path, "capped")
    gw = start_gateway(tmp_path, [sb.url], "--max-exec-seconds", "1", "--health-interval-seconds", "0.3")
    try:
        all_warm(gw, 1)
        with gw_client(gw) as c:
            lease = c.post("/v1/leases", json={"group_id": "g"}).json()
            lid, h = lease["lease_id"], holder(gw, lease)
            r = h.post(f"/v1/leases/{lid}/exec", json={"command": "sleep 30", "timeout_seconds": 100})
            assert r.status_code == 200 and r.json()["timed_out"] is True
            assert h.post(f"/v1/leases/{lid}/exec", json={"command": "echo on"}).json()["stdout"] == "on\n"
            assert demand(gw)["unhealthy"] == 0
    finally:
        gw.stop()
        sb.stop()


def test_a_waiting_group_takes_one_sandbox_and_waiters_are_served_in_order(one_sandbox):
    gw, _ = one_sandbox
    with gw_client(gw) as c:
        first = c.post("/v1/leases", json={"group_id": "first"}).json()
        got: dict[str, list] = {"early": [], "late": []}

        def ask(group: str) -> None:
            r = c.post("/v1/leases", json={"group_id": group, "wait_seconds": 60, "group_key": GROUP_KEY})
            got[group].append(r.json())

        threads = [threading.Thread(target=ask, args=("early",)) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: demand(gw)["waiting"] == 1, 10, what="the early group waiting (once)")
        late = threading.Thread(target=ask, args=("late",))
        late.start()
        wait_until(lambda: demand(gw)["waiting"] == 2, 10, what="the late group waiting behind it")
        holder(gw, first).delete(f"/v1/leases/{first['lease_id']}")
        for t in threads:
            t.join(30)
        early = got["early"]
        assert len({g["lease_id"] for g in early}) == 1 and max(g["holders"] for g in early) == 3
        assert sorted(g["joined"] for g in early) == [False, True, True]
        assert got["late"] == [] and demand(gw)["waiting"] == 1  # still behind the early group
        holder(gw, early[0]).delete(f"/v1/leases/{early[0]['lease_id']}", params={"all": "true"})
        late.join(30)
        assert got["late"][0]["sandbox"] == first["sandbox"]
        holder(gw, got["late"][0]).delete(f"/v1/leases/{got['late'][0]['lease_id']}")


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--members", "foo"], {}, "not a sandbox base URL"),
    ([], {}, "give --members"),
    (["--members", "http://127.0.0.1:9"], {"ASYNCGRPO_GATEWAY_TOKEN": ""}, "no token"),
])
def test_gateway_refuses_to_start_misconfigured(args, env, message):
    full = {**os.environ, "ASYNCGRPO_GATEWAY_TOKEN": "t", "ASYNCGRPO_SANDBOX_TOKEN": "s", **env}
    full.pop("KUBECONFIG", None)
    r = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "gateway", "--port", "1", *args], env=full,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and message in r.stderr


def test_a_leased_sandbox_that_is_only_slow_keeps_its_lease(tmp_path):
    busy_sb, idle_sb = start_sandbox(tmp_path, "slow-a"), start_sandbox(tmp_path, "slow-b")
    gw = start_gateway(tmp_path, [busy_sb.url, idle_sb.url], "--health-interval-seconds", "0.2",
                       "--health-timeout-seconds", "0.3", "--health-failures", "2")
    try:
        all_warm(gw, 2)
        with gw_client(gw) as c:
            lease = c.post("/v1/leases", json={"group_id": "g"}).json()
            busy, idle = (busy_sb, idle_sb) if busy_sb.url.endswith(lease["sandbox"]) else (idle_sb, busy_sb)
            result: dict = {}
            h = holder(gw, lease)
            t = threading.Thread(target=lambda: result.update(r=h.post(
                f"/v1/leases/{lease['lease_id']}/exec", json={"command": "touch started; sleep 2; echo done"})))
            t.start()
            wait_until(lambda: (busy.workspace / "main" / "started").exists(), 20, what="exec running")
            for p in (busy, idle):
                os.kill(p.pid, signal.SIGSTOP)  # both stop answering health checks
            idle_name = idle.url.split("//")[1]
            try:  # the idle one is taken out: proof that the checks ran and timed out
                wait_until(lambda: demand(gw)["members"][idle_name] == "unhealthy", 30, what="idle one out")
                assert demand(gw)["members"][lease["sandbox"]] == "busy"
            finally:
                for p in (busy, idle):
                    os.kill(p.pid, signal.SIGCONT)
            t.join(60)
            assert result["r"].status_code == 200 and result["r"].json()["stdout"] == "done\n"
            h.delete(f"/v1/leases/{lease['lease_id']}")
        all_warm(gw, 2)
    finally:
        gw.stop()
        busy_sb.stop()
        idle_sb.stop()


def test_batched_heartbeats_keep_leases_and_report_ended_ones(pool_of_three):
    """One `/v1/heartbeats` call beats many leases; a wrong secret beats nothing; an ended
    lease comes back with its reason (and the client forgets it)."""
    gw, _ = pool_of_three
    client = GatewayClient(gw.url, GW_TOKEN)
    a, b = client.lease("hb-a", wait_seconds=60), client.lease("hb-b", wait_seconds=60)
    with gw_client(gw) as c:
        forged = c.post("/v1/heartbeats", json={"leases": [{"lease_id": a.lease_id, "secret": "not-the-secret"}]})
        assert forged.json()["leases"][a.lease_id] == {"error": "unauthorized"}
        assert httpx.post(f"{gw.url}/v1/heartbeats", json={"leases": []}).status_code == 401  # run token needed
    assert client.heartbeat_many([a, b]) == {}
    client.release(b)
    assert client.heartbeat_many([a, b]) == {b.lease_id: "lease_released"}
    client.release(a)
    client.close()


def test_a_members_file_is_followed_and_its_members_retired_fresh(tmp_path):
    """`--members-file` (the local backend's pool keeps it): lifecycle fresh holds, since the
    writer replaces members; a member added to the file turns warm without waiting for a
    health round (startup probe); one dropped from it is removed, its lease ended
    sandbox_lost; an unreadable file keeps the members as they are."""
    a, b = start_sandbox(tmp_path, "fa"), start_sandbox(tmp_path, "fb")
    path = tmp_path / "members.json"

    def write(doc) -> None:
        (tmp_path / "m.tmp").write_text(doc if isinstance(doc, str) else json.dumps(doc))
        os.replace(tmp_path / "m.tmp", path)

    write({"box-a": a.url})
    # a health round far longer than the test: only the startup probe can make b warm
    gw = start_gateway(tmp_path, None, "--members-file", str(path), "--lifecycle", "fresh",
                       "--health-interval-seconds", "600")
    try:
        wait_until(lambda: demand(gw)["members"] == {"box-a": "warm"}, 30, what="box-a warm")
        assert demand(gw)["lifecycle"] == "fresh"
        with gw_client(gw) as c:
            first = c.post("/v1/leases", json={"group_id": "g1", "group_key": GROUP_KEY}).json()
            assert first["sandbox"] == "box-a"
            assert c.delete(f"/v1/leases/{first['lease_id']}",
                            headers={"authorization": f"Bearer {first['secret']}"}).status_code == 200
            wait_until(lambda: demand(gw)["members"] == {"box-a": "retired"}, 30, what="retired")
            write({"box-b": b.url})  # the writer replaces the retired member
            wait_until(lambda: demand(gw)["members"] == {"box-b": "warm"}, 30, what="box-b warm")
            second = c.post("/v1/leases", json={"group_id": "g2", "group_key": GROUP_KEY}).json()
            assert second["sandbox"] == "box-b"
            write("{not json")  # kept as they are
            wait_until(lambda: "members file" in gw.logs(), 10, what="the warning")
            assert demand(gw)["members"] == {"box-b": "busy"}
            write({})  # dropped while leased: the lease ends
            wait_until(lambda: demand(gw)["members"] == {}, 30, what="box-b removed")
            with holder(gw, second) as h:
                r = h.post(f"/v1/leases/{second['lease_id']}/heartbeat")
            assert r.status_code == 410 and r.json()["error"] == "sandbox_lost", r.text
    finally:
        gw.stop()
        a.stop()
        b.stop()
