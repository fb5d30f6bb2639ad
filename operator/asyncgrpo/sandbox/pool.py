"""The gateway's pool: which sandboxes exist, which group holds which, who is waiting.

Invariants (all state lives in one asyncio loop, so no locks; every transition is a
method here and nothing else writes `state`):

- a member is in exactly one state: starting -> resetting -> warm <-> busy -> resetting
  -> warm ..., or unhealthy (taken out; probed until it answers again, then reset), or
  draining (no new leases; the operator may delete it once it is not busy);
- a group has at most one live lease; every member of the group that asks gets the same
  lease (`holders` counts them) and the lease ends when the last holder releases it, when
  no holder has called or heartbeated for `ttl` while no call is in flight, or at
  `max_age`; a lease that ended is remembered for a while so late callers get a clear
  "expired"/"released"/"sandbox_lost" rather than "unknown";
- a sandbox is never handed out while dirty: every lease end goes through reset, and so
  does every member's first appearance (a restarted gateway cannot know what ran before);
- waiting requests are served first come, first served; the requests of one group that
  arrive while the group waits share that one wait, so a group never takes two sandboxes;
  a waiter that goes away (its client disconnected) leaves the queue, and a lease granted
  to it in that instant is released again;
- a lease is a capability: its secret is made by the gateway when the member is reset and
  installed in the sandbox by that reset, handed to exactly one lease, and dies with it
  (the sandbox revokes it at the next reset, before anything else). The lease id alone
  opens nothing; listings never show a secret.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from asyncgrpo.sandbox.metrics import GatewayMetrics

STARTING, RESETTING, WARM, BUSY, UNHEALTHY, DRAINING = (
    "starting", "resetting", "warm", "busy", "unhealthy", "draining",
)


class LeaseGone(Exception):
    """The lease ended; `reason` is released, expired, sandbox_lost or unknown."""

    def __init__(self, lease_id: str, reason: str):
        super().__init__(f"lease {lease_id} {reason}")
        self.lease_id = lease_id
        self.reason = reason


class NoSandbox(Exception):
    pass


@dataclass
class Member:
    name: str
    url: str
    state: str = STARTING
    lease_id: str | None = None
    health_failures: int = 0
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    drain: bool = False
    # the secret the sandbox will accept for its next lease, set by the reset that installed it
    next_secret: str | None = field(default=None, repr=False)


@dataclass
class Lease:
    id: str
    group_id: str
    member: str
    created: float
    last_seen: float
    holders: int = 1
    in_flight: int = 0
    waited_seconds: float = 0.0
    secret: str = field(default="", repr=False)

    def opens(self, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(presented.encode(), self.secret.encode())


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class Pool:
    def __init__(
        self,
        *,
        reset_fn: Callable[[Member], Awaitable[bool]],
        metrics: GatewayMetrics,
        lease_ttl_seconds: float,
        lease_max_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.members: dict[str, Member] = {}
        self.leases: dict[str, Lease] = {}
        self.by_group: dict[str, str] = {}
        # lease id -> (how it ended, digest of its secret): late callers holding the secret
        # learn why; anyone else learns nothing
        self.ended: collections.OrderedDict[str, tuple[str, bytes]] = collections.OrderedDict()
        self._waiters: collections.deque[tuple[asyncio.Future, str]] = collections.deque()
        self._group_waits: dict[str, asyncio.Future] = {}
        self._reset_fn = reset_fn
        self._tasks: set[asyncio.Task] = set()
        self.metrics = metrics
        self.ttl = lease_ttl_seconds
        self.max_age = lease_max_seconds
        self.clock = clock

    # -- membership (from the member source and the health checker) ------------
    def upsert(self, name: str, url: str) -> None:
        m = self.members.get(name)
        if m is None:
            self.members[name] = Member(name, url)
            self.metrics.spawned.inc()
        elif m.url != url:  # same pod name, new address: a new sandbox
            self._take_out(m, "replaced")
            self.members[name] = Member(name, url)
            self.metrics.spawned.inc()
        self._publish()

    def remove(self, name: str) -> None:
        m = self.members.pop(name, None)
        if m is not None and m.lease_id:
            self._end(m.lease_id, "sandbox_lost", reset=False)
        self._publish()

    def health_ok(self, name: str) -> None:
        m = self.members.get(name)
        if m is None:
            return
        m.health_failures = 0
        if m.state in (STARTING, UNHEALTHY):
            self._start_reset(m)

    def health_failed(self, name: str, reason: str, threshold: int) -> None:
        m = self.members.get(name)
        if m is None or m.state in (STARTING, UNHEALTHY):
            return  # starting pods are not failing yet; unhealthy ones are already out
        m.health_failures += 1
        if m.health_failures >= threshold:
            self.metrics.failures.labels(reason="health").inc()
            self._take_out(m, reason)

    def lost(self, name: str, reason: str) -> None:
        """A proxied call could not reach the sandbox: out now, no waiting for health."""
        m = self.members.get(name)
        if m is not None and m.state != UNHEALTHY:
            self.metrics.failures.labels(reason="lost").inc()
            self._take_out(m, reason)

    def drain(self, name: str) -> dict:
        m = self.members.get(name)
        if m is None:
            return {"name": name, "known": False, "safe_to_delete": True}
        m.drain = True
        if m.state in (WARM, STARTING, UNHEALTHY):
            m.state = DRAINING
        self._publish()
        return {"name": name, "known": True, "state": m.state, "safe_to_delete": m.state == DRAINING}

    def _take_out(self, m: Member, reason: str) -> None:
        if m.lease_id:
            self._end(m.lease_id, "sandbox_lost", reset=False)
        m.state = DRAINING if m.drain else UNHEALTHY
        m.reason = reason
        m.since = self.clock()
        self._publish()

    # -- leases -----------------------------------------------------------------
    async def acquire(self, group_id: str, wait_seconds: float) -> tuple[Lease, bool]:
        """Lease for `group_id`; True in the tuple if this call joined an existing lease."""
        t0 = self.clock()
        deadline = t0 + wait_seconds
        while True:
            hit = self.try_acquire(group_id, t0)
            if hit is not None:
                return hit
            shared = self._group_waits.get(group_id)
            if shared is None:
                break
            # another request of this group is waiting already: wait on its wait, then join
            try:
                await asyncio.wait_for(asyncio.shield(shared), max(0.0, deadline - self.clock()))
            except TimeoutError:
                self.metrics.lease_timeouts.inc()
                raise NoSandbox(group_id) from None
            except asyncio.CancelledError:
                if not shared.cancelled():
                    raise  # this request itself was cancelled
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, group_id))
        self._group_waits[group_id] = fut
        self._publish()
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - self.clock()))
        except TimeoutError:
            if not fut.done():
                self.metrics.lease_timeouts.inc()
                raise NoSandbox(group_id) from None
        except asyncio.CancelledError:
            # the requester went away; if a sandbox was granted in that instant, give it back
            if fut.done() and not fut.cancelled():
                lease = self.leases.get(fut.result())
                if lease is not None:
                    self.release(lease.id)
            raise
        finally:
            if self._group_waits.get(group_id) is fut:
                del self._group_waits[group_id]
            if not fut.done():
                fut.cancel()
            self._waiters = collections.deque((f, g) for f, g in self._waiters if f is not fut)
            self._publish()
        lease = self.leases.get(fut.result())
        if lease is None:
            raise NoSandbox(group_id)
        self.metrics.lease_wait.labels(start="cold").observe(self.clock() - t0)
        return lease, False

    def try_acquire(self, group_id: str, t0: float | None = None) -> tuple[Lease, bool] | None:
        """`acquire` without waiting: join the group's lease, or take a warm sandbox, or None.

        None as well while another request of the group waits (it must share that wait). A
        warm sandbox never jumps the queue: one that turns warm goes to the oldest waiter at
        once (`_offer`), so while any request waits none is warm.
        """
        t0 = self.clock() if t0 is None else t0
        lease = self._join(group_id)
        if lease is not None:
            return lease, True
        if group_id in self._group_waits:
            return None
        m = self._first_warm()
        if m is None:
            return None
        lease = self._grant(m, group_id, t0)
        self.metrics.lease_wait.labels(start="warm").observe(self.clock() - t0)
        return lease, False

    def _join(self, group_id: str) -> Lease | None:
        lease_id = self.by_group.get(group_id)
        if lease_id is None:
            return None
        lease = self.leases[lease_id]
        lease.holders += 1
        lease.last_seen = self.clock()
        return lease

    def _first_warm(self) -> Member | None:
        # the member idle the longest: spreads wear, keeps recently reset ones hot in cache
        warm = [m for m in self.members.values() if m.state == WARM]
        return min(warm, key=lambda m: m.since) if warm else None

    def _grant(self, m: Member, group_id: str, t0: float) -> Lease:
        now = self.clock()
        if not m.next_secret:  # only a member whose reset installed a secret is ever warm
            raise RuntimeError(f"member {m.name} is warm without a lease secret")
        lease = Lease(secrets.token_urlsafe(12), group_id, m.name, now, now, waited_seconds=now - t0,
                      secret=m.next_secret)
        m.next_secret = None  # one secret, one lease
        self.leases[lease.id] = lease
        self.by_group[group_id] = lease.id
        m.state, m.lease_id, m.since = BUSY, lease.id, now
        self._publish()
        return lease

    def _offer(self, m: Member) -> None:
        """A sandbox became warm: give it to the oldest waiter still waiting."""
        while self._waiters:
            fut, group_id = self._waiters.popleft()
            if fut.done():
                continue
            lease = self._grant(m, group_id, self.clock())
            fut.set_result(lease.id)
            return

    def get(self, lease_id: str) -> tuple[Lease, Member]:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise LeaseGone(lease_id, self.ended.get(lease_id, ("unknown", b""))[0])
        return lease, self.members[lease.member]

    def check(self, lease_id: str, presented: str | None) -> str:
        """'ok' if `presented` is this live lease's secret, the end reason if it was the secret
        of an ended lease, 'unknown' for an id this gateway never granted (it restarted: the
        caller should lease again), else 'refused' (a wrong secret, or a lease id alone)."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            return "ok" if lease.opens(presented) else "refused"
        if lease_id not in self.ended:
            return "unknown"
        how, known = self.ended[lease_id]
        if presented and hmac.compare_digest(digest(presented), known):
            return how
        return "refused"

    def touch(self, lease_id: str) -> Lease:
        lease, _ = self.get(lease_id)
        lease.last_seen = self.clock()
        return lease

    def release(self, lease_id: str, all_holders: bool = False) -> dict:
        lease, _ = self.get(lease_id)
        lease.holders = 0 if all_holders else lease.holders - 1
        if lease.holders > 0:
            lease.last_seen = self.clock()
            return {"lease_id": lease_id, "ended": False, "holders": lease.holders}
        self._end(lease_id, "released", reset=True)
        return {"lease_id": lease_id, "ended": True, "holders": 0}

    def expire(self) -> int:
        """End leases whose holders went quiet (crashed rollouts) or that lived too long."""
        now = self.clock()
        gone = [
            lease.id
            for lease in self.leases.values()
            if (lease.in_flight == 0 and now - lease.last_seen > self.ttl) or now - lease.created > self.max_age
        ]
        for lease_id in gone:
            self._end(lease_id, "expired", reset=True)
        return len(gone)

    def _end(self, lease_id: str, how: str, reset: bool) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        if self.by_group.get(lease.group_id) == lease_id:
            del self.by_group[lease.group_id]
        self.ended[lease_id] = (how, digest(lease.secret))
        while len(self.ended) > 100_000:
            self.ended.popitem(last=False)
        self.metrics.leases_ended.labels(how=how if how != "sandbox_lost" else "broken").inc()
        m = self.members.get(lease.member)
        if m is not None and m.lease_id == lease_id:
            m.lease_id = None
            if reset:
                self._start_reset(m)
        self._publish()

    def _start_reset(self, m: Member) -> None:
        m.state, m.since = RESETTING, self.clock()
        self._publish()
        task = asyncio.get_running_loop().create_task(self._reset(m))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reset(self, m: Member) -> None:
        try:
            ok = await self._reset_fn(m)
        except Exception:  # noqa: BLE001 - any failure to reset takes the sandbox out
            ok = False
        if self.members.get(m.name) is not m or m.state != RESETTING:
            return  # removed or taken out meanwhile
        if not ok:
            self.metrics.failures.labels(reason="reset").inc()
            self._take_out(m, "reset failed")
            return
        m.since = self.clock()
        if m.drain:
            m.state = DRAINING
        else:
            m.state = WARM
            self._offer(m)
        self._publish()

    # -- the demand signal ------------------------------------------------------
    def counts(self) -> dict[str, int]:
        c = dict.fromkeys((STARTING, RESETTING, WARM, BUSY, UNHEALTHY, DRAINING), 0)
        for m in self.members.values():
            c[m.state] += 1
        return c

    def demand(self) -> dict:
        c = self.counts()
        waiting = sum(1 for f, _ in self._waiters if not f.done())
        return {
            "busy": c[BUSY],
            # resetting sandboxes are idle within a second: counted idle so the scaler does
            # not create pods for a demand that is about to be met
            "idle": c[WARM] + c[RESETTING],
            "waiting": waiting,
            "starting": c[STARTING],
            "unhealthy": c[UNHEALTHY],
            "draining": c[DRAINING],
            "total": len(self.members),
            "leases_active": len(self.leases),
            "members": {m.name: m.state for m in self.members.values()},
            "unhealthy_members": sorted(m.name for m in self.members.values() if m.state == UNHEALTHY),
        }

    def _publish(self) -> None:
        for state, n in self.counts().items():
            self.metrics.sandboxes.labels(state=state).set(n)
        self.metrics.leases_active.set(len(self.leases))
        self.metrics.leases_waiting.set(sum(1 for f, _ in self._waiters if not f.done()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for fut, _ in self._waiters:
            if not fut.done():
                fut.cancel()
