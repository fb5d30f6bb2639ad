"""Gateway CPU per lease-queue operation with N waiters: the old queue (main's pool.py) and
this one side by side, in one event loop, no HTTP (the queue's own cost).

    PYTHONPATH=operator python bench/lease_queue_bench.py [--waiters 10000]

Per pool: N waiters enqueue (each a lease request that finds no sandbox), a bystander's
heartbeat (`touch`) is timed while they wait, then every waiter leaves (times out /
hangs up). Printed: CPU per enqueue+leave and the heartbeat's wall time.

    PYTHONPATH=operator python bench/lease_queue_bench.py --http [--waiters 10000]

Over HTTP, against a real gateway process with one real sandbox server: a bystander holds
the only sandbox; N lease requests wait (from 10 client addresses, 127.0.0.2-11, each
under the per-client bound); the bystander's heartbeats (`POST /v1/leases/{id}/heartbeat`,
one at a time over a kept-alive connection) are timed with 0 and with N waiting
(p50/p99), and the gateway's own CPU (from /proc) is read across the N enqueues and the N
leaves (the waiters hang up).

The waiters arrive in waves (`--wave`, 500): each wave's requests are queued at the gateway
before the next wave opens its connections. `--wave 0` opens all N at once from this one
process; on a busy machine some of its connections then send nothing for more than the
gateway's 10 s request-head timeout after their accept (this process has not written them
yet), and the gateway closes them as it closes any silent connection (counted in the last
row, `requests_rejected_total{reason="header_timeout"}`; see docs/benchmarks/lease-queue.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.sandbox.gateway import pool as new_pool
from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics


def _old_pool_module():
    src = subprocess.run(["git", "show", "main:operator/asyncgrpo/sandbox/gateway/pool.py"], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / "old_pool.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_pool", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_pool"] = mod
    spec.loader.exec_module(mod)
    return mod


async def _measure(mod, n: int, new: bool) -> tuple[float, float]:
    async def reset(m):
        m.next_secret = "s" * 32
        return True

    kw = {"max_waiters_per_client": n} if new else {}
    pool = mod.Pool(reset_fn=reset, metrics=GatewayMetrics(), lease_ttl_seconds=60,
                    lease_max_seconds=3600, **kw)
    pool.upsert("a", "http://a")
    pool.health_ok("a")
    await asyncio.sleep(0.01)
    held, _ = pool.try_acquire("bystander")  # the only sandbox: every other request waits
    c0 = time.process_time()
    kwargs = (lambda i: {"client": f"10.0.0.{i % 4}"}) if new else (lambda i: {})
    tasks = [asyncio.ensure_future(pool.acquire(f"g{i}", 600, **kwargs(i))) for i in range(n)]
    while (pool._waiting if new else len(pool._waiters)) < n:
        await asyncio.sleep(0)
    t0 = time.perf_counter()
    pool.touch(held.id)  # the bystander's heartbeat, then one loop turn
    await asyncio.sleep(0)
    beat = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cpu = time.process_time() - c0
    return cpu / n, beat


TICK = os.sysconf("SC_CLK_TCK")
GW_TOKEN = "bench-gateway-token-0123456789"
SB_TOKEN = "bench-sandbox-token-0123456789"
CLIENT_HOSTS = [f"127.0.0.{i}" for i in range(2, 12)]


def _cpu(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(n: int) -> tuple[list[subprocess.Popen], str]:
    """One sandbox server and a gateway on loopback; (processes, gateway URL)."""
    from asyncgrpo.testing.net import wait_for_port

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 2 fds per waiter (both ends), children inherit
    tmp = Path(tempfile.mkdtemp(prefix="asyncgrpo-lqb-"))
    tmp.chmod(0o711)
    env = {**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": SB_TOKEN, "ASYNCGRPO_GATEWAY_TOKEN": GW_TOKEN}
    cli = [sys.executable, "-m", "asyncgrpo.cli"]
    sb_port, gw_port = _free_port(), _free_port()
    procs = [subprocess.Popen([*cli, "sandbox", "serve", "--host", "127.0.0.1", "--port", str(sb_port),
                               "--workspace", str(tmp / "ws")], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    wait_for_port(sb_port)
    procs.append(subprocess.Popen(
        [*cli, "gateway", "--host", "127.0.0.1", "--port", str(gw_port), "--members", f"http://127.0.0.1:{sb_port}",
         "--max-wait-seconds", "900", "--max-waiters-per-client", str(max(1024, n // len(CLIENT_HOSTS) + 1)),
         "--health-interval-seconds", "5",
         # the bystander beats only while timed: its lease must outlive a slow enqueue phase
         # (60 s, the default TTL, was not enough on a busy machine: the lease expired and its
         # sandbox went to a waiter)
         "--lease-ttl-seconds", "3600"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_for_port(gw_port)
    return procs, f"http://127.0.0.1:{gw_port}"


async def _http(url: str, gw_pid: int, n: int, beats: int, wave: int) -> dict:
    import aiohttp
    import httpx

    out: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        control = {"authorization": f"Bearer {GW_TOKEN}"}
        while (await c.get("/v1/demand")).json()["idle"] < 1:
            await asyncio.sleep(0.1)
        held = (await c.post("/v1/leases", json={"group_id": "bystander"}, headers=control)).json()
        beat_url = f"/v1/leases/{held['lease_id']}/heartbeat"
        mine = {"authorization": f"Bearer {held['secret']}"}

        async def heartbeats() -> list[float]:
            lat = []
            for _ in range(beats):
                t0 = time.perf_counter()
                r = await c.post(beat_url, headers=mine)
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                await asyncio.sleep(0.02)
            return lat

        out["idle"] = await heartbeats()
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, local_addr=(host, 0), force_close=True)) for host in CLIENT_HOSTS]

        async def wait_one(i: int) -> str:
            s = sessions[i % len(sessions)]
            async with s.post(f"{url}/v1/leases", json={"group_id": f"g{i}", "wait_seconds": 900},
                              headers=control, timeout=aiohttp.ClientTimeout(total=None)) as r:
                return f"answered {r.status}: {(await r.read())[:200]!r}"

        async def head_timeouts() -> int:
            for line in (await c.get("/metrics")).text.splitlines():
                if line.startswith('asyncgrpo_gateway_requests_rejected_total{reason="header_timeout"}'):
                    return int(float(line.split()[-1]))
            return 0

        c0, t0 = _cpu(gw_pid), time.perf_counter()
        waiters: list[asyncio.Future] = []
        step = wave or n
        while len(waiters) < n:
            # a wave of lease requests, all counted waiting by the gateway before the next
            # (wave 0: all n at once, one client process opening n connections in one burst)
            waiters += [asyncio.ensure_future(wait_one(i)) for i in range(len(waiters), min(n, len(waiters) + step))]
            while (await c.get("/v1/demand")).json()["waiting"] < len(waiters):
                if any(w.done() for w in waiters):
                    bad = [w for w in waiters if w.done()]
                    await asyncio.sleep(1)
                    raise RuntimeError(f"{sum(w.done() for w in waiters)} of {len(waiters)} waiters ended "
                                       f"early, the first: {bad[0].exception() or bad[0].result()!r}; connections closed by the "
                                       f"gateway's request-head timeout: {await head_timeouts()}")
                await asyncio.sleep(0.05)
        out["enqueue_cpu"], out["enqueue_wall"] = _cpu(gw_pid) - c0, time.perf_counter() - t0
        c1 = _cpu(gw_pid)
        out["loaded"] = await heartbeats()
        out["beat_cpu"] = (_cpu(gw_pid) - c1) / beats
        c2, t2 = _cpu(gw_pid), time.perf_counter()
        for w in waiters:
            w.cancel()  # each waiter hangs up: the gateway takes it out of the queue
        await asyncio.gather(*waiters, return_exceptions=True)
        for s in sessions:
            await s.close()
        while (await c.get("/v1/demand")).json()["waiting"] > 0:
            await asyncio.sleep(0.2)
        out["leave_cpu"], out["leave_wall"] = _cpu(gw_pid) - c2, time.perf_counter() - t2
        await c.delete(f"/v1/leases/{held['lease_id']}", headers=mine)
        out["head_timeouts"] = await head_timeouts()
    return out


def http_main(n: int, beats: int, wave: int) -> None:
    procs, url = _start(n)
    try:
        r = asyncio.run(_http(url, procs[1].pid, n, beats, wave))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    ms = lambda xs, q: _pct(xs, q) * 1e3
    print(f"over HTTP, real gateway + 1 sandbox       0 waiting   {n} waiting   goal")
    print(f"bystander heartbeat p50 (ms)          {ms(r['idle'], 0.5):12.2f} {ms(r['loaded'], 0.5):14.2f}")
    print(f"bystander heartbeat p99 (ms)          {ms(r['idle'], 0.99):12.2f} {ms(r['loaded'], 0.99):14.2f}   < 100")
    print(f"bystander heartbeat max (ms)          {max(r['idle']) * 1e3:12.2f} {max(r['loaded']) * 1e3:14.2f}")
    print(f"gateway CPU per heartbeat (us)        {'':12} {r['beat_cpu'] * 1e6:14.0f}")
    print(f"gateway CPU per enqueue, HTTP (us)    {'':12} {r['enqueue_cpu'] / n * 1e6:14.0f}"
          f"   ({n} in {r['enqueue_wall']:.1f} s)")
    print(f"gateway CPU per leave, HTTP (us)      {'':12} {r['leave_cpu'] / n * 1e6:14.0f}"
          f"   ({n} in {r['leave_wall']:.1f} s)")
    print(f"heartbeat samples                     {len(r['idle']):12d} {len(r['loaded']):14d}"
          f"   (mean {statistics.mean(r['loaded']) * 1e3:.2f} ms)")
    print(f"closed by the request-head timeout    {'':12} {r['head_timeouts']:14d}"
          f"   (waves of {wave or n})")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waiters", type=int, default=10_000)
    ap.add_argument("--http", action="store_true", help="against a real gateway over HTTP")
    ap.add_argument("--beats", type=int, default=200, help="heartbeats timed per phase (--http)")
    ap.add_argument("--wave", type=int, default=500,
                    help="lease requests opened at a time (--http), each wave queued before the next; "
                         "0: all at once")
    args = ap.parse_args()
    n = args.waiters
    if args.http:
        http_main(n, args.beats, args.wave)
        return
    old = _old_pool_module()
    o_cpu, o_beat = asyncio.run(_measure(old, n, new=False))
    n_cpu, n_beat = asyncio.run(_measure(new_pool, n, new=True))
    print(f"lease queue with {n} waiters            before (main)   after     ratio")
    print(f"gateway CPU per enqueue+leave (us)      {o_cpu * 1e6:12.1f} {n_cpu * 1e6:9.1f} {o_cpu / n_cpu:8.1f}x")
    print(f"bystander heartbeat + loop turn (ms)    {o_beat * 1e3:12.2f} {n_beat * 1e3:9.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
