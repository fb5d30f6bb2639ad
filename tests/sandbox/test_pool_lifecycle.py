"""The gateway's Pool in one event loop: fresh-per-group retirement and reuse, no HTTP."""

from __future__ import annotations

import asyncio
import secrets

from asyncgrpo.sandbox.metrics import GatewayMetrics
from asyncgrpo.sandbox.pool import FRESH, REUSE, Pool


def _pool(lifecycle: str, retired: list[str]) -> Pool:
    async def reset(m):
        m.next_secret = secrets.token_urlsafe(24)
        return True

    async def retire(m):
        retired.append(m.name)

    return Pool(reset_fn=reset, retire_fn=retire, metrics=GatewayMetrics(), lease_ttl_seconds=60,
                lease_max_seconds=3600, lifecycle=lifecycle)


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
