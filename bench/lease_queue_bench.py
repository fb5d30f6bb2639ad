"""Gateway CPU per lease-queue operation with N waiters: the old queue (main's pool.py) and
this one side by side, in one event loop, no HTTP (the queue's own cost).

    PYTHONPATH=operator python bench/lease_queue_bench.py [--waiters 10000]

Per pool: N waiters enqueue (each a lease request that finds no sandbox), a bystander's
heartbeat (`touch`) is timed while they wait, then every waiter leaves (times out /
hangs up). Printed: CPU per enqueue+leave and the heartbeat's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.sandbox import pool as new_pool
from asyncgrpo.sandbox.metrics import GatewayMetrics


def _old_pool_module():
    src = subprocess.run(["git", "show", "main:operator/asyncgrpo/sandbox/pool.py"], capture_output=True,
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waiters", type=int, default=10_000)
    n = ap.parse_args().waiters
    old = _old_pool_module()
    o_cpu, o_beat = asyncio.run(_measure(old, n, new=False))
    n_cpu, n_beat = asyncio.run(_measure(new_pool, n, new=True))
    print(f"lease queue with {n} waiters            before (main)   after     ratio")
    print(f"gateway CPU per enqueue+leave (us)      {o_cpu * 1e6:12.1f} {n_cpu * 1e6:9.1f} {o_cpu / n_cpu:8.1f}x")
    print(f"bystander heartbeat + loop turn (ms)    {o_beat * 1e3:12.2f} {n_beat * 1e3:9.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
