"""The gateway's Pool with a sandbox image per row: a group gets only a member of the image it
asked for, waits queue per image, the number of row images in use is bounded, and the demand
says per image what the operator must create. One event loop, no HTTP."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics
from asyncgrpo.sandbox.gateway.pool import FRESH, Pool, TooManyImages
from asyncgrpo.wire import DEFAULT_SANDBOX_IMAGE_KEY, sandbox_image_key

A, B, C = "registry.example/task-a:1", "registry.example/task-b:1", "registry.example/task-c:1"
KEY = "k" * 16


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _pool(clock=None, **kw) -> Pool:
    async def reset(m):
        m.next_secret = secrets.token_urlsafe(24)
        return True

    async def retire(_m):
        return None

    extra = {"clock": clock} if clock is not None else {}
    return Pool(reset_fn=reset, retire_fn=retire, metrics=GatewayMetrics(), lease_ttl_seconds=60,
                lease_max_seconds=3600, lifecycle=FRESH, **extra, **kw)


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def _warm(pool: Pool, name: str, image: str | None) -> None:
    pool.upsert(name, f"http://{name}", sandbox_image_key(image))
    pool.health_ok(name)
    await _settle()


def test_a_group_gets_only_a_sandbox_of_the_image_it_asked_for():
    async def scenario():
        pool = _pool()
        await _warm(pool, "default-0", None)
        await _warm(pool, "b-0", B)
        assert pool.try_acquire("g-a", key=KEY, image=A) is None  # warm ones are of other images
        waiting = asyncio.ensure_future(pool.acquire("g-a", 30, key=KEY, image=A, client="t"))
        await _settle()
        assert pool.demand()["images"][sandbox_image_key(A)]["waiting"] == 1
        # a default-image group arriving later is served at once by the default member
        lease_d, _ = pool.try_acquire("g-d", key=KEY)
        assert lease_d.member == "default-0"
        lease_b, _ = pool.try_acquire("g-b", key=KEY, image=B)
        assert lease_b.member == "b-0"
        await _warm(pool, "a-0", A)   # the image's pod became warm: it goes to its waiter
        lease_a, joined = await asyncio.wait_for(waiting, 5)
        assert lease_a.member == "a-0" and not joined
        assert pool.demand()["images"][sandbox_image_key(A)]["waiting"] == 0

    asyncio.run(scenario())


def test_a_warm_sandbox_of_one_image_never_serves_a_waiter_of_another():
    async def scenario():
        pool = _pool()
        waits = [asyncio.ensure_future(pool.acquire(f"g{i}", 30, key=KEY, client="t"))
                 for i in range(3)]   # the run's own image: nothing warm yet
        await _settle()
        await _warm(pool, "a-0", A)
        assert pool.members["a-0"].state == "warm"  # not handed to the default waiters
        assert pool.demand()["waiting"] == 3
        await _warm(pool, "default-0", None)
        lease, _ = await asyncio.wait_for(asyncio.shield(waits[0]), 5)
        assert lease.member == "default-0"
        for w in waits[1:]:
            w.cancel()
        await _settle()
        assert pool.demand()["waiting"] == 0

    asyncio.run(scenario())


def test_row_images_in_use_are_bounded_and_an_image_out_of_use_frees_its_slot():
    async def scenario():
        clock = Clock()
        pool = _pool(clock, max_images=2, image_idle_seconds=600)
        await _warm(pool, "default-0", None)
        wa = asyncio.ensure_future(pool.acquire("g-a", 30, key=KEY, image=A, client="t"))
        wb = asyncio.ensure_future(pool.acquire("g-b", 30, key=KEY, image=B, client="t"))
        await _settle()
        with pytest.raises(TooManyImages) as refused:
            pool.try_acquire("g-c", key=KEY, image=C)
        assert "maxDistinct" in str(refused.value) and refused.value.bound == 2
        # the run's own image is never counted against the bound
        lease, _ = pool.try_acquire("g-d", key=KEY)
        assert lease.member == "default-0"
        wa.cancel()
        wb.cancel()
        await _settle()
        with pytest.raises(TooManyImages):   # still in use: asked for within image_idle
            pool.try_acquire("g-c", key=KEY, image=C)
        clock.t += 601
        assert pool.try_acquire("g-c", key=KEY, image=C) is None   # admitted: waits for a pod
        assert set(pool.demand()["images"]) == {DEFAULT_SANDBOX_IMAGE_KEY, sandbox_image_key(C)}

    asyncio.run(scenario())


def test_the_demand_names_each_images_reference_counts_and_consumption():
    async def scenario():
        clock = Clock()
        pool = _pool(clock)
        await _warm(pool, "a-0", A)
        await _warm(pool, "a-1", A)
        await _warm(pool, "default-0", None)
        lease, _ = pool.try_acquire("g1", key=KEY, image=A)
        clock.t += 5
        pool.release(lease.id)
        await _settle()
        waiting = asyncio.ensure_future(pool.acquire("g2", 30, key=KEY, image=B, client="t"))
        await _settle()
        images = pool.demand()["images"]
        a, b, d = images[sandbox_image_key(A)], images[sandbox_image_key(B)], images["default"]
        assert a["image"] == A and a["retired"] == 1 and a["idle"] == 1 and a["busy"] == 0
        assert a["retired_total"] == 1 and d["retired_total"] == 0
        assert a["consumption_per_second"] > 0 and d["consumption_per_second"] == 0
        assert b == {"image": B, "busy": 0, "idle": 0, "waiting": 1, "starting": 0, "retired": 0,
                     "retired_total": 0,
                     "consumption_per_second": 0.0, "idle_seconds": 0.0}
        assert d["image"] is None and d["idle"] == 1
        # the totals are the sums of the images'
        total = pool.demand()
        assert total["waiting"] == 1 and total["retired"] == 1
        assert total["consumption_per_second"] == a["consumption_per_second"]
        waiting.cancel()
        await _settle()

    asyncio.run(scenario())


def test_a_member_whose_pod_changes_image_is_a_new_sandbox():
    async def scenario():
        pool = _pool()
        await _warm(pool, "p-0", A)
        pool.upsert("p-0", "http://p-0", sandbox_image_key(B))
        assert pool.members["p-0"].image == sandbox_image_key(B)
        assert pool.members["p-0"].state == "starting"  # reset before any lease of B

    asyncio.run(scenario())
