"""The gateway's Pool in one event loop: fresh-per-group retirement and reuse, no HTTP."""

from __future__ import annotations

import asyncio
import secrets

from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics
from asyncgrpo.sandbox.gateway.pool import FRESH, REUSE, Pool


def _pool(lifecycle: str, retired: list[str], clock=None) -> Pool:
    async def reset(m):
        m.next_secret = secrets.token_urlsafe(24)
        return True

    async def retire(m):
        retired.append(m.name)

    extra = {"clock": clock} if clock is not None else {}
    return Pool(reset_fn=reset, retire_fn=retire, metrics=GatewayMetrics(), lease_ttl_seconds=60,
                lease_max_seconds=3600, lifecycle=lifecycle, **extra)


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_fresh_a_sandbox_serves_one_group_then_is_retired_never_reused():
    async def scenario():
        retired: list[str] = []
        pool = _pool(FRESH, retired)
        pool.upsert("a", "http://a")
        pool.health_ok("a")
        await _settle()
        lease, _ = pool.try_acquire("g1", key="k" * 16)
        pool.release(lease.id)
        await _settle()
        assert pool.members["a"].state == "retired" and retired == ["a"]
        assert pool.try_acquire("g2", key="k" * 16) is None  # never leased again
        d = pool.demand()
        assert d["retired"] == 1 and d["retired_total"] == 1 and d["consumption_per_second"] > 0
        assert pool.drain("a")["safe_to_delete"] is True
        # a taken-out member that served a group and answers again is retired, not reset
        pool.upsert("b", "http://b")
        pool.health_ok("b")
        await _settle()
        lease, _ = pool.try_acquire("g3")
        pool.health_failed("b", "down", 1)
        pool.health_ok("b")
        await _settle()
        assert pool.members["b"].state == "retired"
        pool.remove("a")  # the operator deleted the pod
        assert "a" not in pool.demand()["members"]

    asyncio.run(scenario())


def test_consumption_reads_the_rate_a_run_that_just_started_consumes_at():
    """0.5 leases/s for 10 s retires 5 sandboxes: the operator must refill at 0.5/s, not at
    5/60 (the fixed 60 s window read a fraction of the rate until a minute had passed, and
    the warm pool ran dry on the node: docs/benchmarks/sandbox-pool.md)."""
    async def scenario():
        now = [1000.0]
        pool = _pool(FRESH, [], clock=lambda: now[0])
        assert pool.consumption_per_second() == 0.0
        for i in range(5):
            pool.upsert(f"m{i}", f"http://m{i}")
            pool.health_ok(f"m{i}")
        await _settle()
        for i in range(5):
            lease, _ = pool.try_acquire(f"g{i}", key="k" * 16)
            now[0] += 2.0
            pool.release(lease.id)
        await _settle()
        assert 0.45 <= pool.consumption_per_second() <= 0.55
        now[0] += 30.0  # no more leases: the rate falls as the window empties
        assert pool.consumption_per_second() < 0.2
        now[0] += 60.0
        assert pool.consumption_per_second() == 0.0

    asyncio.run(scenario())


def test_reuse_resets_the_sandbox_for_the_next_group():
    async def scenario():
        pool = _pool(REUSE, [])
        pool.upsert("a", "http://a")
        pool.health_ok("a")
        await _settle()
        first, _ = pool.try_acquire("g1")
        pool.release(first.id)
        await _settle()
        again, _ = pool.try_acquire("g2")
        assert again.member == "a" and again.secret != first.secret

    asyncio.run(scenario())


def test_10000_waiters_queue_and_leave_without_a_scan():
    """Waiters of many clients queue and cancel; counts stay exact (no timing asserted here:
    bench/lease_queue_bench.py measures the CPU)."""
    async def scenario():
        pool = _pool(REUSE, [])
        tasks = [asyncio.ensure_future(pool.acquire(f"g{i}", 60, client=f"c{i % 16}")) for i in range(10_000)]
        await _settle()
        assert pool.demand()["waiting"] == 10_000
        for t in tasks[::2]:
            t.cancel()
        await _settle()
        assert pool.demand()["waiting"] == 5_000
        pool.upsert("a", "http://a")
        pool.health_ok("a")
        await _settle()
        assert pool.demand()["waiting"] == 4_999  # one served, round-robin from the first client
        for t in tasks:
            t.cancel()
        await _settle()
        assert pool.demand()["waiting"] == 0

    asyncio.run(scenario())
