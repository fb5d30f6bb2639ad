"""Sandbox gateway benchmark: G concurrent groups x N execs over S sandbox servers.

Starts S real sandbox servers and one gateway on loopback (the `asyncgrpo` CLI), then runs
the same workload three ways and prints one table:

- gateway:          each group leases a sandbox, runs its N execs through the gateway,
                    releases (the gateway resets the sandbox); S groups run at a time.
- direct exclusive: the same exclusivity without the gateway: S workers each own one
                    server and take groups from a queue; exec then reset, straight to it.
- direct shared:    no exclusivity at all: every group at once, group i on server i % S
                    (what you would get without leases; not safe for real rollouts).

Per-exec latency is measured at the client; the gateway's overhead is its p50/p99 minus
those of "direct exclusive". The modes run in interleaved rounds, and the CPU time of the
gateway and sandbox processes (from /proc) is reported per exec: on a shared machine wall
times drift with other load, CPU per exec does not. Afterwards the gateway must show zero
active leases, zero expired or broken ones, every group served, every sandbox warm again.

    .venv/bin/python bench/sandbox_gateway_bench.py --groups 64 --execs 20 --sandboxes 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from asyncgrpo.testing.net import free_port, wait_for_port

TOKEN = "bench-sandbox-token"
GW_TOKEN = "bench-gateway-token"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def run_gateway(url: str, groups: int, execs: int, command: str) -> dict:
    lat: list[float] = []
    waits: list[float] = []
    failures = 0
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {GW_TOKEN}"}, timeout=600,
                                 limits=httpx.Limits(max_connections=groups * 2)) as c:
        async def group(g: int) -> None:
            nonlocal failures
            t0 = time.perf_counter()
            r = await c.post("/v1/leases", json={"group_id": f"bench-{g}", "wait_seconds": 600})
            if r.status_code != 200:
                failures += 1
                return
            waits.append(time.perf_counter() - t0)
            lid = r.json()["lease_id"]
            for _ in range(execs):
                t = time.perf_counter()
                e = await c.post(f"/v1/leases/{lid}/exec", json={"command": command})
                lat.append(time.perf_counter() - t)
                if e.status_code != 200 or e.json()["exit_code"] != 0:
                    failures += 1
            await c.delete(f"/v1/leases/{lid}")

        t0 = time.perf_counter()
        await asyncio.gather(*(group(g) for g in range(groups)))
        wall = time.perf_counter() - t0
    return {"lat": lat, "wall": wall, "failures": failures, "lease_wait": waits}


async def run_direct_exclusive(urls: list[str], groups: int, execs: int, command: str) -> dict:
    lat: list[float] = []
    failures = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for g in range(groups):
        queue.put_nowait(g)
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}, timeout=600,
                                 limits=httpx.Limits(max_connections=len(urls) * 2)) as c:
        async def worker(url: str) -> None:
            nonlocal failures
            while not queue.empty():
                queue.get_nowait()
                for _ in range(execs):
                    t = time.perf_counter()
                    e = await c.post(f"{url}/v1/exec", json={"command": command})
                    lat.append(time.perf_counter() - t)
                    if e.status_code != 200 or e.json()["exit_code"] != 0:
                        failures += 1
                await c.post(f"{url}/v1/reset")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(u) for u in urls))
        wall = time.perf_counter() - t0
    return {"lat": lat, "wall": wall, "failures": failures}


async def run_direct_shared(urls: list[str], groups: int, execs: int, command: str) -> dict:
    lat: list[float] = []
    failures = 0
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}, timeout=600,
                                 limits=httpx.Limits(max_connections=groups * 2)) as c:
        async def group(g: int) -> None:
            nonlocal failures
            url = urls[g % len(urls)]
            for _ in range(execs):
                t = time.perf_counter()
                e = await c.post(f"{url}/v1/exec", json={"command": command, "session": f"g{g}"})
                lat.append(time.perf_counter() - t)
                if e.status_code != 200 or e.json()["exit_code"] != 0:
                    failures += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(group(g) for g in range(groups)))
        wall = time.perf_counter() - t0
    return {"lat": lat, "wall": wall, "failures": failures}


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--execs", type=int, default=20)
    ap.add_argument("--sandboxes", type=int, default=8)
    ap.add_argument("--command", default="echo hi")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode, interleaved")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="asyncgrpo-bench-"))
    base.chmod(0o711)
    procs: list[subprocess.Popen] = []
    cli = [sys.executable, "-m", "asyncgrpo.cli"]
    env = {**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, "ASYNCGRPO_GATEWAY_TOKEN": GW_TOKEN}
    try:
        urls = []
        for i in range(args.sandboxes):
            port = free_port()
            p = subprocess.Popen([*cli, "sandbox", "serve", "--host", "127.0.0.1", "--port", str(port),
                                  "--workspace", str(base / f"ws{i}")], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(p)
            wait_for_port(port, timeout=60.0, proc=p)
            urls.append(f"http://127.0.0.1:{port}")
        gport = free_port()
        gw = subprocess.Popen([*cli, "gateway", "--host", "127.0.0.1", "--port", str(gport), "--members",
                               ",".join(urls), "--health-interval-seconds", "1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        wait_for_port(gport, timeout=60.0, proc=gw)
        gurl = f"http://127.0.0.1:{gport}"
        deadline = time.monotonic() + 60
        while httpx.get(f"{gurl}/v1/demand").json()["idle"] < args.sandboxes:
            if time.monotonic() > deadline:
                raise TimeoutError("pool did not become warm")
            time.sleep(0.2)

        tick = os.sysconf("SC_CLK_TCK")

        def cpu(pids: list[int]) -> float:
            total = 0
            for pid in pids:
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rfind(")") + 2 :].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime
            return total / tick

        sandbox_pids = [p.pid for p in procs[:-1]]
        modes = {
            "direct shared": lambda: run_direct_shared(urls, args.groups, args.execs, args.command),
            "direct exclusive": lambda: run_direct_exclusive(urls, args.groups, args.execs, args.command),
            "gateway": lambda: run_gateway(gurl, args.groups, args.execs, args.command),
        }
        rounds: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.rounds):  # modes interleaved, so drifting load hits all of them
            for mode, make in modes.items():
                c0 = (cpu([gw.pid]), cpu(sandbox_pids))
                r = asyncio.run(make())
                r["gw_cpu"], r["sb_cpu"] = cpu([gw.pid]) - c0[0], cpu(sandbox_pids) - c0[1]
                rounds[mode].append(r)
                deadline = time.monotonic() + 60
                while httpx.get(f"{gurl}/v1/demand").json()["idle"] < args.sandboxes:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
        d = httpx.get(f"{gurl}/v1/demand").json()
        m = httpx.get(f"{gurl}/metrics").text
        released = metric(m, 'asyncgrpo_gateway_leases_ended_total{how="released"}')
        expired = metric(m, 'asyncgrpo_gateway_leases_ended_total{how="expired"}')
        broken = metric(m, 'asyncgrpo_gateway_leases_ended_total{how="broken"}')
        cold = metric(m, 'asyncgrpo_gateway_lease_wait_seconds_count{start="cold"}')
        warm = metric(m, 'asyncgrpo_gateway_lease_wait_seconds_count{start="warm"}')

        n = args.groups * args.execs
        print(f"\n{args.groups} groups x {args.execs} execs of {args.command!r} over {args.sandboxes} sandbox "
              f"servers, {args.rounds} interleaved rounds per mode ({os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at the end)\n")
        print(f"{'mode':<18}{'execs/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'failed':>8}{'sandbox CPU ms/exec':>21}"
              f"{'gateway CPU ms/exec':>21}")
        summary = {}
        for mode, rs in rounds.items():
            lat = [x for r in rs for x in r["lat"]]
            rate = statistics.median(len(r["lat"]) / r["wall"] for r in rs)
            total = len(lat)
            sb_ms = sum(r["sb_cpu"] for r in rs) / total * 1e3
            gw_ms = sum(r["gw_cpu"] for r in rs) / total * 1e3
            summary[mode] = (rate, pct(lat, .5), pct(lat, .99), gw_ms)
            print(f"{mode:<18}{rate:>9.1f}{pct(lat, .5) * 1e3:>9.2f}{pct(lat, .99) * 1e3:>9.2f}"
                  f"{sum(r['failures'] for r in rs):>8}{sb_ms:>21.2f}{gw_ms:>21.2f}")
        g, x = summary["gateway"], summary["direct exclusive"]
        print(f"\ngateway vs direct exclusive: p50 {(g[1] - x[1]) * 1e3:+.2f} ms, p99 {(g[2] - x[2]) * 1e3:+.2f} ms, "
              f"throughput x{g[0] / x[0]:.2f}; the gateway process spends {g[3]:.2f} ms CPU per exec")
        lw = [x for r in rounds["gateway"] for x in r["lease_wait"]]
        print(f"lease wait: p50 {pct(lw, .5) * 1e3:.1f} ms, p99 {pct(lw, .99) * 1e3:.1f} ms "
              f"({warm:.0f} warm, {cold:.0f} cold)")
        groups_total = args.groups * args.rounds
        served = sum(len(r["lat"]) for r in rounds["gateway"])
        ok = (served == n * args.rounds and released == groups_total and expired == 0 and broken == 0
              and d["leases_active"] == 0 and d["busy"] == 0 and d["idle"] == args.sandboxes)
        print(f"leases: {released:.0f} released of {groups_total} groups, {expired:.0f} expired, {broken:.0f} broken; "
              f"after: {d['leases_active']} active, {d['busy']} busy, {d['idle']} idle -> "
              f"{'no lost or leaked leases' if ok else 'LOST OR LEAKED LEASES'}")
        return 0 if ok else 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
