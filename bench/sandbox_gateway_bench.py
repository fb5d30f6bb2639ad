"""Sandbox data paths side by side: direct, lease + direct, proxied; 1 and 16 clients.

Starts real sandbox servers and one gateway on loopback (the `asyncgrpo` CLI) and runs, for
each client count C, C concurrent clients each doing rounds of `--execs` trivial execs:

- direct:          no gateway at all: each client owns one sandbox server (the bench installs
                   a lease secret on it with a reset) and sends its execs straight there;
- lease + direct:  each client leases a sandbox from the gateway per group, sends the group's
                   execs straight to the address the lease gave, releases (the gateway
                   resets the sandbox): the default data path;
- proxied:         the same, but the execs go through the gateway (`data_path=proxied`).

Per-exec latency is measured at the client (p50, p99); CPU per exec of the gateway and of
the sandbox servers comes from /proc. The modes run interleaved, round after round, so load
that drifts on a shared machine hits all of them alike. Last, the gateway's own rate for
lease operations (join, heartbeat, release of one holder: no sandbox call) per CPU second,
one per request and as batched heartbeats (`/v1/heartbeats`, every lease of a process per
call). CPU per operation is the figure to read on a shared machine; wall-clock rates and
latencies move with whatever else runs.

    .venv/bin/python bench/sandbox_gateway_bench.py --execs 20 --groups 10 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from asyncgrpo.sandbox.common.challenge import reset_call
from asyncgrpo.testing.net import free_port, wait_for_port

TOKEN = "bench-sandbox-token"
GW_TOKEN = "bench-gateway-token"
SECRET = "bench-direct-lease-secret-0123456789"
TICK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def cpu(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rfind(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICK


def auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


async def execs(c: httpx.AsyncClient, url: str, secret: str, n: int, command: str, lat: list[float]) -> int:
    failed = 0
    for _ in range(n):
        t = time.perf_counter()
        r = await c.post(url, json={"command": command}, headers=auth(secret))
        lat.append(time.perf_counter() - t)
        failed += r.status_code != 200 or r.json()["exit_code"] != 0
    return failed


async def run_direct(urls: list[str], groups: int, n: int, command: str) -> dict:
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(urls) * 2)) as c:
        async def client(url: str) -> int:
            failed = 0
            for _ in range(groups):
                failed += await execs(c, f"{url}/v1/exec", SECRET, n, command, lat)
                call = reset_call(TOKEN, url, SECRET)
                await c.post(f"{url}/v1/reset", content=call.body, headers=call.headers)
            return failed

        failed = sum(await asyncio.gather(*(client(u) for u in urls)))
    return {"lat": lat, "failed": failed}


async def run_leased(gw: str, clients: int, groups: int, n: int, command: str, proxied: bool) -> dict:
    lat: list[float] = []
    lease_lat: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients * 2)) as c:
        async def client(i: int) -> int:
            failed = 0
            for g in range(groups):
                t = time.perf_counter()
                r = await c.post(f"{gw}/v1/leases", json={"group_id": f"c{i}-g{g}-{time.time_ns()}",
                                                          "wait_seconds": 120}, headers=auth(GW_TOKEN))
                lease_lat.append(time.perf_counter() - t)
                if r.status_code != 200:
                    failed += n
                    continue
                lease = r.json()
                url = (f"{gw}/v1/leases/{lease['lease_id']}/exec" if proxied
                       else f"{lease['sandbox_url']}/v1/exec")
                failed += await execs(c, url, lease["secret"], n, command, lat)
                await c.delete(f"{gw}/v1/leases/{lease['lease_id']}", headers=auth(lease["secret"]))
            return failed

        failed = sum(await asyncio.gather(*(client(i) for i in range(clients))))
    return {"lat": lat, "failed": failed, "lease_lat": lease_lat}


async def run_lease_ops(gw: str, clients: int, seconds: float) -> int:
    """Lease operations that never touch a sandbox: join a held lease, heartbeat, leave.

    The load comes from aiohttp (about a sixth of httpx's CPU per request), so on a small
    machine the gateway, not the load generator, is what runs out of CPU.
    """
    ops = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients * 2)) as c:
        async def client(i: int) -> None:
            nonlocal ops
            group = f"ops-{i}-{time.time_ns()}"
            body = {"group_id": group, "wait_seconds": 120}
            async with c.post(f"{gw}/v1/leases", json=body, headers=auth(GW_TOKEN)) as r:
                first = await r.json()
            lid, secret = first["lease_id"], first["secret"]
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                for method, url, kw in (("POST", f"{gw}/v1/leases", {"json": {"group_id": group},
                                                                      "headers": auth(GW_TOKEN)}),
                                        ("POST", f"{gw}/v1/leases/{lid}/heartbeat", {"headers": auth(secret)}),
                                        ("DELETE", f"{gw}/v1/leases/{lid}", {"headers": auth(secret)})):
                    async with c.request(method, url, **kw) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                ops += 3
            async with c.delete(f"{gw}/v1/leases/{lid}", headers=auth(secret)) as r:
                await r.read()

        await asyncio.gather(*(client(i) for i in range(clients)))
    return ops


async def run_batched_heartbeats(gw: str, clients: int, seconds: float) -> tuple[int, int] | None:
    """Every client leases one sandbox; one caller beats all of them per `/v1/heartbeats` call,
    as `client.Heartbeats` does for the leases of one process. Returns (leases beaten, calls),
    or None where the gateway has no batched route (an older version, for before/after)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients * 2)) as c:
        leases = []
        for i in range(clients):
            body = {"group_id": f"hb-{i}-{time.time_ns()}", "wait_seconds": 120}
            async with c.post(f"{gw}/v1/leases", json=body, headers=auth(GW_TOKEN)) as r:
                leases.append(await r.json())
        body = {"leases": [{"lease_id": x["lease_id"], "secret": x["secret"]} for x in leases]}
        beats = calls = 0

        async def beater() -> bool:
            nonlocal beats, calls
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                async with c.post(f"{gw}/v1/heartbeats", json=body, headers=auth(GW_TOKEN)) as r:
                    if r.status == 404:
                        return False
                    answer = await r.json()
                assert all("holders" in v for v in answer["leases"].values()), answer
                beats += len(leases)
                calls += 1
            return True

        served = all(await asyncio.gather(*(beater() for _ in range(4))))
        for x in leases:
            async with c.delete(f"{gw}/v1/leases/{x['lease_id']}", headers=auth(x["secret"])) as r:
                await r.read()
    return (beats, calls) if served else None


def asgi_heartbeat_cost(n: int = 5000) -> float:
    """CPU seconds per heartbeat through the gateway's ASGI app alone (no HTTP server, no socket):
    the gateway's own share of a lease operation."""
    from asyncgrpo.sandbox.gateway.app import GatewaySettings, create_gateway
    from asyncgrpo.sandbox.gateway.members import StaticMembers
    from asyncgrpo.sandbox.gateway.pool import BUSY, Lease, Member

    app = create_gateway(GatewaySettings(token="t", sandbox_token="s"), StaticMembers([]))
    pool = app.app.state.pool
    pool.members["m"] = Member("m", "http://127.0.0.1:1", state=BUSY, lease_id="L")
    pool.leases["L"] = Lease("L", "g", "m", time.monotonic(), time.monotonic(), secret="bench-secret")
    scope = {"type": "http", "method": "POST", "path": "/v1/leases/L/heartbeat", "raw_path": b"/v1/leases/L/heartbeat",
             "query_string": b"", "headers": [(b"authorization", b"Bearer bench-secret")], "http_version": "1.1",
             "scheme": "http", "server": ("x", 1), "client": ("y", 2), "root_path": "", "asgi": {"version": "3.0"}}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message):
        pass

    async def loop() -> float:
        t0 = time.process_time()
        for _ in range(n):
            await app(dict(scope), receive, send)
        return (time.process_time() - t0) / n

    return asyncio.run(loop())


_FLOOR_SERVER = r"""
import sys, uvicorn
from asyncgrpo.sandbox.common.http_guard import header_timeout_protocol
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})
http = header_timeout_protocol() if sys.argv[2] == "project" else sys.argv[2]
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False, http=http)
"""


def http_floor(protocol: str, clients: int = 16, n: int = 1000) -> float:
    """Server CPU seconds per request of uvicorn serving an empty ASGI app: what any route
    costs before the app runs. `protocol`: uvicorn's `h11`, or `project` (the servers' own:
    h11 with the request-head timeout and one write per response)."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", _FLOOR_SERVER, str(port), protocol])
    try:
        wait_for_port(port, timeout=60, proc=p)

        async def load(k: int) -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients * 2)) as c:
                async def one() -> None:
                    for _ in range(k):
                        async with c.post(f"http://127.0.0.1:{port}/") as r:
                            await r.read()

                await asyncio.gather(*(one() for _ in range(clients)))

        asyncio.run(load(20))
        c0 = cpu([p.pid])
        asyncio.run(load(n))
        return (cpu([p.pid]) - c0) / (clients * n)
    finally:
        p.terminate()
        p.wait()


class Servers:
    def __init__(self, base: Path, env: dict):
        self.base, self.env, self.procs = base, env, []
        self.cli = [sys.executable, "-m", "asyncgrpo.cli"]

    def sandbox(self) -> tuple[str, int]:
        port = free_port()
        p = subprocess.Popen([*self.cli, "sandbox", "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--workspace", str(self.base / f"ws{port}")], env=self.env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        wait_for_port(port, timeout=60.0, proc=p)
        return f"http://127.0.0.1:{port}", p.pid

    def gateway(self, members: list[str]) -> tuple[str, int]:
        port = free_port()
        p = subprocess.Popen([*self.cli, "gateway", "--host", "127.0.0.1", "--port", str(port), "--members",
                              ",".join(members), "--health-interval-seconds", "1"], env=self.env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        wait_for_port(port, timeout=60.0, proc=p)
        return f"http://127.0.0.1:{port}", p.pid

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_warm(gw: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{gw}/v1/demand").json()["idle"] < n:
        if time.monotonic() > deadline:
            raise TimeoutError("pool did not become warm")
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,16", help="comma-separated client counts")
    ap.add_argument("--execs", type=int, default=20, help="execs per group")
    ap.add_argument("--groups", type=int, default=10, help="groups per client per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode, interleaved")
    ap.add_argument("--command", default="true")
    ap.add_argument("--lease-ops-seconds", type=float, default=5.0)
    ap.add_argument("--lease-ops-only", action="store_true",
                    help="only the lease operations (e.g. before/after a gateway change: run with "
                         "PYTHONPATH pointing at each checkout)")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="asyncgrpo-bench-"))
    base.chmod(0o711)
    servers = Servers(base, {**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, "ASYNCGRPO_GATEWAY_TOKEN": GW_TOKEN})
    failed_total = 0
    try:
        counts = [int(x) for x in args.clients.split(",")]
        most = max(counts)
        direct = [] if args.lease_ops_only else [servers.sandbox() for _ in range(most)]
        for url, _ in direct:
            call = reset_call(TOKEN, url, SECRET)
            httpx.post(f"{url}/v1/reset", content=call.body, headers=call.headers).raise_for_status()
        pooled = [servers.sandbox() for _ in range(most)]
        gw, gw_pid = servers.gateway([u for u, _ in pooled])
        wait_warm(gw, most)
        print(f"\n{args.groups} groups x {args.execs} execs of {args.command!r} per client, {args.rounds} interleaved "
              f"rounds per mode ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start; "
              "servers as uid " + str(os.geteuid()) + ")\n")
        print(f"{'clients':>7}  {'mode':<15}{'execs/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'failed':>7}"
              f"{'sandbox CPU ms/exec':>21}{'gateway CPU ms/exec':>21}{'lease p50 ms':>14}")
        for n_clients in [] if args.lease_ops_only else counts:
            modes = {
                "direct": (lambda n=n_clients: run_direct([u for u, _ in direct[:n]], args.groups, args.execs,
                                                          args.command), [p for _, p in direct[:n_clients]]),
                "lease + direct": (lambda n=n_clients: run_leased(gw, n, args.groups, args.execs, args.command,
                                                                  False), [p for _, p in pooled]),
                "proxied": (lambda n=n_clients: run_leased(gw, n, args.groups, args.execs, args.command, True),
                            [p for _, p in pooled]),
            }
            results: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for mode, (make, sb_pids) in modes.items():
                    c0 = (cpu([gw_pid]), cpu(sb_pids))
                    t0 = time.perf_counter()
                    r = asyncio.run(make())
                    r["wall"] = time.perf_counter() - t0
                    r["gw_cpu"], r["sb_cpu"] = cpu([gw_pid]) - c0[0], cpu(sb_pids) - c0[1]
                    results[mode].append(r)
                    wait_warm(gw, most)
            summary = {}
            for mode, rs in results.items():
                lat = [x for r in rs for x in r["lat"]]
                rate = statistics.median(len(r["lat"]) / r["wall"] for r in rs)
                sb_ms = sum(r["sb_cpu"] for r in rs) / len(lat) * 1e3
                gw_ms = sum(r["gw_cpu"] for r in rs) / len(lat) * 1e3
                leases = [x for r in rs for x in r.get("lease_lat", [])]
                failed = sum(r["failed"] for r in rs)
                failed_total += failed
                summary[mode] = (rate, pct(lat, .5), pct(lat, .99))
                lease_col = f"{pct(leases, .5) * 1e3:>14.2f}" if leases else f"{'-':>14}"
                print(f"{n_clients:>7}  {mode:<15}{rate:>9.1f}{pct(lat, .5) * 1e3:>9.2f}{pct(lat, .99) * 1e3:>9.2f}"
                      f"{failed:>7}{sb_ms:>21.2f}{gw_ms:>21.2f}{lease_col}")
            d, ld, px = summary["direct"], summary["lease + direct"], summary["proxied"]
            print(f"{'':>9}lease + direct vs direct: p50 {(ld[1] - d[1]) * 1e3:+.2f} ms, p99 {(ld[2] - d[2]) * 1e3:+.2f} ms, "
                  f"throughput x{ld[0] / d[0]:.2f}; proxied vs direct: p50 {(px[1] - d[1]) * 1e3:+.2f} ms, "
                  f"p99 {(px[2] - d[2]) * 1e3:+.2f} ms, throughput x{px[0] / d[0]:.2f}")
        c0 = cpu([gw_pid])
        t0 = time.perf_counter()
        ops = asyncio.run(run_lease_ops(gw, most, args.lease_ops_seconds))
        wall, gw_cpu = time.perf_counter() - t0, cpu([gw_pid]) - c0
        print(f"\nlease operations (join, heartbeat, release; {most} clients): {ops / wall:.0f}/s wall, "
              f"gateway CPU {gw_cpu / ops * 1e3:.3f} ms/op -> {ops / max(gw_cpu, 1e-9):.0f} ops per gateway CPU second")
        wait_warm(gw, most)
        c0 = cpu([gw_pid])
        batched = asyncio.run(run_batched_heartbeats(gw, most, args.lease_ops_seconds))
        gw_cpu = cpu([gw_pid]) - c0
        if batched is None:
            print("batched heartbeats: not served by this gateway")
        else:
            beats, calls = batched
            print(f"batched heartbeats ({most} leases per /v1/heartbeats call, {calls} calls): gateway CPU "
                  f"{gw_cpu / beats * 1e3:.3f} ms per lease beaten -> {beats / max(gw_cpu, 1e-9):.0f} per gateway "
                  f"CPU second ({gw_cpu / calls * 1e3:.2f} ms per call)")
        wait_warm(gw, most)
        for protocol in ("h11", "project", "h11", "project"):
            floor = http_floor(protocol)
            print(f"uvicorn with an empty app ({protocol}): {floor * 1e6:.0f} us server CPU per request -> "
                  f"{1 / floor:.0f} per CPU second")
        per_op = asgi_heartbeat_cost()
        print(f"the gateway's ASGI app alone (no HTTP server): {per_op * 1e6:.0f} us CPU per heartbeat -> "
              f"{1 / per_op:.0f} per CPU second")
        d = httpx.get(f"{gw}/v1/demand").json()
        ok = failed_total == 0 and d["leases_active"] == 0 and d["idle"] == most
        print(f"after: {d['leases_active']} leases active, {d['idle']} of {most} sandboxes idle, "
              f"{failed_total} failed execs -> {'ok' if ok else 'LOST OR LEAKED LEASES / FAILURES'}")
        return 0 if ok else 1
    finally:
        servers.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
