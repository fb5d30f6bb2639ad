"""The gateway's pool: which sandboxes exist, which group holds which, who is waiting.

Invariants (all state lives in one asyncio loop, so no locks; every transition is a
method here and nothing else writes `state`):

- a member is in exactly one state: starting -> resetting -> warm -> busy, then with the
  default lifecycle `fresh` -> retired (it served its one group: never leased again, the
  operator deletes the pod and creates a new one), or with the opt-in `reuse` -> resetting
  -> warm ...; or unhealthy (taken out; probed until it answers again, then reset, or retired
  if it served a group under `fresh`), or draining (no new leases; the operator may delete
  it once it is not busy). Under `fresh` a member serves at most one lease, whatever path
  its lease ended by;
- a group is named by its id *and* the credential that made it (the digest of the
  request's `group_key`): a request naming the same id with another key (or none) is
  another group, so a group id alone joins nothing; a request without a key is a group of
  its own that nothing can join;
- a group has at most one live lease; every member of the group that asks gets the same
  lease (`holders` counts them) and the lease ends when the last holder releases it, when
  no holder has called or heartbeated for `ttl` while no call is in flight, or at
  `max_age`; a lease that ended is remembered for a while so late callers get a clear
  "expired"/"released"/"sandbox_lost" rather than "unknown";
- a sandbox is never handed out while dirty: every lease end goes through reset (or
  retirement), and every member's first appearance through a reset (a restarted gateway
  cannot know what ran before);
- a member runs one image (its pod's `asyncgrpo.dev/sandbox-image` label: the run's own
  image is `default`) and a lease names the image its group needs: a group is only ever
  granted a member of that image, and waits queue per image. At most `max_images` row
  images are in use at once (members, waits, leases, or a request within `image_idle`);
  a request for one more is `TooManyImages` (a 429), never a sandbox of another image;
- waiting requests queue per image and client (the caller's address): first come, first
  served within a client, round-robin across clients, so one client's thousands of waiters delay another
  client's group by at most one grant per waiting client; a client holds at most
  `max_waiters_per_client` waits (more is `TooManyWaiters`, a 429). Every queue operation is
  O(1) amortized (deques, lazy removal with compaction; counters instead of scans). The
  requests of one group that arrive while the group waits share that one wait, so a group
  never takes two sandboxes; a waiter that goes away (its client disconnected) leaves the
  queue, and a lease granted to it in that instant is released again;
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

from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics
from asyncgrpo.wire import DEFAULT_SANDBOX_IMAGE_KEY, sandbox_image_key

STARTING, RESETTING, WARM, BUSY, UNHEALTHY, DRAINING, RETIRED = (
    "starting", "resetting", "warm", "busy", "unhealthy", "draining", "retired",
)
STATES = (STARTING, RESETTING, WARM, BUSY, UNHEALTHY, DRAINING, RETIRED)
#: lease lifecycles: a sandbox per group (default), or reset and reused (trusted workloads)
FRESH, REUSE = "fresh", "reuse"
#: how far back retirements count toward the consumption rate the operator refills at
CONSUMPTION_WINDOW_SECONDS = 60.0
#: the shortest span the rate is averaged over (about one operator resync): retirements that
#: began less than a window ago are averaged over the time since the first, not over the
#: whole window, so a run that starts consuming is refilled at its rate, not at a fraction
CONSUMPTION_MIN_SPAN_SECONDS = 10.0


class LeaseGone(Exception):
    """The lease ended; `reason` is released, expired, sandbox_lost or unknown."""

    def __init__(self, lease_id: str, reason: str):
        super().__init__(f"lease {lease_id} {reason}")
        self.lease_id = lease_id
        self.reason = reason


class NoSandbox(Exception):
    pass


class TooManyImages(Exception):
    """`max_images` row images are in use: a lease for another one is refused."""

    def __init__(self, image: str, bound: int):
        super().__init__(f"{bound} sandbox images are in use (spec.sandboxes.images.maxDistinct); "
                         f"{image[:200]!r} is not one of them")
        self.image = image
        self.bound = bound


class TooManyWaiters(Exception):
    """This client already has `max_waiters_per_client` lease requests waiting."""

    def __init__(self, client: str, bound: int):
        super().__init__(f"client {client} has {bound} lease requests waiting already")
        self.client = client
        self.bound = bound


def group_scope(group_id: str, key: str | None) -> tuple[bytes, str]:
    """Where a group's lease is filed: the group id under the digest of its key.

    No key: a scope no other request can name, so the lease can be joined by nobody.
    """
    return (digest(key) if key else b"unkeyed:" + secrets.token_bytes(16), group_id)


@dataclass(eq=False)
class _Wait:
    """One group's place in its client's queue; `done` once granted or abandoned."""

    fut: asyncio.Future
    scope: tuple[bytes, str]
    client: str
    image: str = DEFAULT_SANDBOX_IMAGE_KEY
    done: bool = False


@dataclass(eq=False)
class _Image:
    """One image's waits (a FIFO per client, a ring of the clients that have one) and its
    retirements; `ref` is the reference leases named it by (None: the run's own image)."""

    key: str
    ref: str | None
    last_used: float
    queues: dict[str, collections.deque[_Wait]] = field(default_factory=dict)
    ring: collections.deque[str] = field(default_factory=collections.deque)
    waiting: int = 0
    retired_at: collections.deque[float] = field(default_factory=collections.deque)
    retired_total: int = 0


@dataclass
class Member:
    name: str
    url: str
    image: str = DEFAULT_SANDBOX_IMAGE_KEY  # its pod's image key (wire.sandbox_image_key)
    state: str = STARTING
    lease_id: str | None = None
    health_failures: int = 0
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    drain: bool = False
    served: bool = False  # held a lease once: under `fresh` it is never leased again
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
    scope: tuple[bytes, str] = field(default=(b"", ""), repr=False)

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
        lifecycle: str = FRESH,
        retire_fn: Callable[[Member], Awaitable[None]] | None = None,
        max_waiters_per_client: int = 1024,
        max_images: int = 8,
        image_idle_seconds: float = 600.0,
    ):
        if lifecycle not in (FRESH, REUSE):
            raise ValueError(f"lifecycle must be {FRESH!r} or {REUSE!r}, not {lifecycle!r}")
        self.members: dict[str, Member] = {}
        self.leases: dict[str, Lease] = {}
        self.by_group: dict[tuple[bytes, str], str] = {}
        # lease id -> (how it ended, digest of its secret): late callers holding the secret
        # learn why; anyone else learns nothing
        self.ended: collections.OrderedDict[str, tuple[str, bytes]] = collections.OrderedDict()
        # the lease queues, one per image: per client a FIFO of waits and a ring of clients
        self._images: dict[str, _Image] = {}
        self._live: dict[str, int] = {}          # waits not done, per client (all images)
        self._waiting = 0                        # waits not done, all clients and images
        self.max_images = max_images
        self.image_idle = image_idle_seconds
        self._group_waits: dict[tuple[bytes, str], _Wait] = {}
        self.max_waiters_per_client = max_waiters_per_client
        self.lifecycle = lifecycle
        self._retire_fn = retire_fn
        self.retired_total = 0
        self._reset_fn = reset_fn
        self._tasks: set[asyncio.Task] = set()
        self.metrics = metrics
        self.ttl = lease_ttl_seconds
        self.max_age = lease_max_seconds
        self.clock = clock
        self._images[DEFAULT_SANDBOX_IMAGE_KEY] = _Image(DEFAULT_SANDBOX_IMAGE_KEY, None, clock())

    # -- images -------------------------------------------------------------------
    def _image(self, ref: str | None) -> _Image:
        """The image a lease asks for, made known here; TooManyImages past `max_images`."""
        key = sandbox_image_key(ref)
        img = self._images.get(key)
        if img is None:
            in_use = {k for k in self._images if self._in_use(self._images[k])} | {
                m.image for m in self.members.values() if m.state != RETIRED}
            in_use.discard(DEFAULT_SANDBOX_IMAGE_KEY)
            if key not in in_use and len(in_use) >= self.max_images:
                self.metrics.rejected.labels(reason="too_many_images").inc()
                raise TooManyImages(ref or "", self.max_images)
            for k in [k for k in self._images if k != DEFAULT_SANDBOX_IMAGE_KEY and k not in in_use]:
                del self._images[k]  # out of use: forgotten, its slot free
            img = self._images[key] = _Image(key, ref, self.clock())
        img.last_used = self.clock()
        return img

    def _in_use(self, img: _Image) -> bool:
        """Waits or a request within `image_idle` (its sandboxes are counted by the caller)."""
        return img.waiting > 0 or self.clock() - img.last_used < self.image_idle

    # -- membership (from the member source and the health checker) ------------
    def upsert(self, name: str, url: str, image: str = DEFAULT_SANDBOX_IMAGE_KEY) -> None:
        """A member at `url` running the image of key `image` (its pod's label)."""
        m = self.members.get(name)
        if m is None:
            self.members[name] = Member(name, url, image)
            self.metrics.spawned.inc()
        elif m.url != url or m.image != image:  # same pod name, new address: a new sandbox
            self._take_out(m, "replaced")
            self.members[name] = Member(name, url, image)
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
            self._after_lease(m)

    def health_failed(self, name: str, reason: str, threshold: int) -> None:
        m = self.members.get(name)
        if m is None or m.state in (STARTING, UNHEALTHY, RETIRED):
            return  # starting pods are not failing yet; unhealthy and retired ones are out
        m.health_failures += 1
        if m.health_failures >= threshold:
            self.metrics.failures.labels(reason="health").inc()
            self._take_out(m, reason)

    def lost(self, name: str, reason: str) -> None:
        """A proxied call could not reach the sandbox: out now, no waiting for health."""
        m = self.members.get(name)
        if m is not None and m.state not in (UNHEALTHY, RETIRED):
            self.metrics.failures.labels(reason="lost").inc()
            self._take_out(m, reason)

    def drain(self, name: str) -> dict:
        m = self.members.get(name)
        if m is None:
            return {"name": name, "known": False, "safe_to_delete": True}
        m.drain = True
        if m.state in (WARM, STARTING, UNHEALTHY):  # a retired one stays retired: deletable
            m.state = DRAINING
        self._publish()
        return {"name": name, "known": True, "state": m.state,
                "safe_to_delete": m.state in (DRAINING, RETIRED)}

    def _take_out(self, m: Member, reason: str) -> None:
        if m.lease_id:
            self._end(m.lease_id, "sandbox_lost", reset=False)
        m.state = DRAINING if m.drain else UNHEALTHY
        m.reason = reason
        m.since = self.clock()
        self._publish()

    # -- leases -----------------------------------------------------------------
    async def acquire(self, group_id: str, wait_seconds: float, *, key: str | None = None,
                      client: str = "", scope: tuple[bytes, str] | None = None,
                      image: str | None = None) -> tuple[Lease, bool]:
        """Lease for the group (`group_id` under `key`) on a sandbox of `image` (None: the
        run's own); True in the tuple if this call joined an existing lease. `client` names
        the queue the wait goes in (the caller's address)."""
        scope = scope or group_scope(group_id, key)
        t0 = self.clock()
        deadline = t0 + wait_seconds
        while True:
            hit = self.try_acquire(group_id, t0, scope=scope, image=image)
            if hit is not None:
                return hit
            shared = self._group_waits.get(scope)
            if shared is None:
                break
            # another request of this group is waiting already: wait on its wait, then join
            try:
                await asyncio.wait_for(asyncio.shield(shared.fut), max(0.0, deadline - self.clock()))
            except TimeoutError:
                self.metrics.lease_timeouts.inc()
                raise NoSandbox(group_id) from None
            except asyncio.CancelledError:
                if not shared.fut.cancelled():
                    raise  # this request itself was cancelled
        w = self._enqueue(scope, client, self._image(image))
        try:
            await asyncio.wait_for(asyncio.shield(w.fut), max(0.0, deadline - self.clock()))
        except TimeoutError:
            if not w.fut.done():
                self.metrics.lease_timeouts.inc()
                raise NoSandbox(group_id) from None
        except asyncio.CancelledError:
            # the requester went away; if a sandbox was granted in that instant, give it back
            if w.fut.done() and not w.fut.cancelled():
                lease = self.leases.get(w.fut.result())
                if lease is not None:
                    self.release(lease.id)
            raise
        finally:
            if self._group_waits.get(scope) is w:
                del self._group_waits[scope]
            if not w.fut.done():
                w.fut.cancel()
            self._abandon(w)
        lease = self.leases.get(w.fut.result())
        if lease is None:
            raise NoSandbox(group_id)
        self.metrics.lease_wait.labels(start="cold").observe(self.clock() - t0)
        return lease, False

    def _enqueue(self, scope: tuple[bytes, str], client: str, img: _Image) -> _Wait:
        live = self._live.get(client, 0)
        if live >= self.max_waiters_per_client:
            self.metrics.rejected.labels(reason="too_many_waiters").inc()
            raise TooManyWaiters(client, self.max_waiters_per_client)
        w = _Wait(asyncio.get_running_loop().create_future(), scope, client, img.key)
        q = img.queues.get(client)
        if q is None:
            q = img.queues[client] = collections.deque()
            img.ring.append(client)
        q.append(w)
        self._live[client] = live + 1
        self._waiting += 1
        img.waiting += 1
        self._group_waits[scope] = w
        self._publish_waiting()
        return w

    def _settle(self, w: _Wait) -> None:
        """`w` leaves the live count (granted or abandoned); O(1)."""
        w.done = True
        left = self._live[w.client] - 1
        if left:
            self._live[w.client] = left
        else:
            del self._live[w.client]
        self._waiting -= 1
        self._images[w.image].waiting -= 1

    def _abandon(self, w: _Wait) -> None:
        """A wait that timed out or was cancelled: counted out now, removed from its deque
        lazily (skipped when reached), the deque compacted once mostly dead (amortized O(1))."""
        if w.done:
            return
        self._settle(w)
        img = self._images[w.image]
        q = img.queues.get(w.client)
        if q is not None and len(q) > 2 * self._live.get(w.client, 0) + 64:
            alive = collections.deque(x for x in q if not x.done)
            if alive:
                img.queues[w.client] = alive
            else:  # the ring entry of this client is dropped when the ring reaches it
                del img.queues[w.client]
        self._publish_waiting()

    def _next_waiter(self, image: str) -> _Wait | None:
        """The next live wait for `image`, round-robin across clients, FIFO within one."""
        img = self._images.get(image)
        if img is None:
            return None
        while img.ring:
            client = img.ring.popleft()
            q = img.queues.get(client)
            while q and q[0].done:
                q.popleft()
            if not q:
                img.queues.pop(client, None)
                continue
            w = q.popleft()
            while q and q[0].done:
                q.popleft()
            if q:
                img.ring.append(client)
            else:
                del img.queues[client]
            return w
        return None

    def try_acquire(self, group_id: str, t0: float | None = None, *, key: str | None = None,
                    scope: tuple[bytes, str] | None = None,
                    image: str | None = None) -> tuple[Lease, bool] | None:
        """`acquire` without waiting: join the group's lease, or take a warm sandbox of
        `image` (None: the run's own), or None.

        None as well while another request of the group waits (it must share that wait). A
        warm sandbox never jumps the queue: one that turns warm goes to the next waiter of
        its image at once (`_offer`), so while any request waits for an image none of that
        image is warm. A group's lease runs the image its first request named.
        """
        scope = scope or group_scope(group_id, key)
        t0 = self.clock() if t0 is None else t0
        lease = self._join(scope)
        if lease is not None:
            return lease, True
        if scope in self._group_waits:
            return None
        m = self._first_warm(self._image(image).key)
        if m is None:
            return None
        lease = self._grant(m, scope, t0)
        self.metrics.lease_wait.labels(start="warm").observe(self.clock() - t0)
        return lease, False

    def _join(self, scope: tuple[bytes, str]) -> Lease | None:
        lease_id = self.by_group.get(scope)
        if lease_id is None:
            return None
        lease = self.leases[lease_id]
        lease.holders += 1
        lease.last_seen = self.clock()
        return lease

    def _first_warm(self, image: str) -> Member | None:
        # the member idle the longest: spreads wear, keeps recently reset ones hot in cache
        warm = [m for m in self.members.values() if m.state == WARM and m.image == image]
        return min(warm, key=lambda m: m.since) if warm else None

    def _grant(self, m: Member, scope: tuple[bytes, str], t0: float) -> Lease:
        now = self.clock()
        if not m.next_secret:  # only a member whose reset installed a secret is ever warm
            raise RuntimeError(f"member {m.name} is warm without a lease secret")
        if self.lifecycle == FRESH and m.served:
            raise RuntimeError(f"member {m.name} served a group already")
        lease = Lease(secrets.token_urlsafe(12), scope[1], m.name, now, now, waited_seconds=now - t0,
                      secret=m.next_secret, scope=scope)
        m.next_secret = None  # one secret, one lease
        m.served = True
        self.leases[lease.id] = lease
        self.by_group[scope] = lease.id
        m.state, m.lease_id, m.since = BUSY, lease.id, now
        self._publish()
        return lease

    def _offer(self, m: Member) -> None:
        """A sandbox became warm: give it to the next waiter for its image still waiting."""
        w = self._next_waiter(m.image)
        if w is None:
            return
        lease = self._grant(m, w.scope, self.clock())
        self._settle(w)
        w.fut.set_result(lease.id)
        self._publish_waiting()

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
        if self.by_group.get(lease.scope) == lease_id:
            del self.by_group[lease.scope]
        self.ended[lease_id] = (how, digest(lease.secret))
        while len(self.ended) > 100_000:
            self.ended.popitem(last=False)
        self.metrics.leases_ended.labels(how=how if how != "sandbox_lost" else "broken").inc()
        m = self.members.get(lease.member)
        if m is not None and m.lease_id == lease_id:
            m.lease_id = None
            if reset:
                self._after_lease(m)
        self._publish()

    def _after_lease(self, m: Member) -> None:
        """A member whose lease ended, or a taken-out one that answers again: fresh retires
        what served a group, reuse resets it for the next."""
        if self.lifecycle == FRESH and m.served:
            self._retire(m)
        else:
            self._start_reset(m)

    def _retire(self, m: Member) -> None:
        """Never leased again; the operator deletes the pod (it lists `retired` members in the
        demand) and creates the replacement. `retire_fn` revokes the ended lease's secret in
        the sandbox and stops what still runs there, so nothing outlives the lease while
        the pod waits for its deletion."""
        m.state, m.since, m.next_secret = RETIRED, self.clock(), None
        self.retired_total += 1
        img = self._images.get(m.image)
        if img is None:  # a member of an image no lease named yet (or forgotten)
            img = self._images[m.image] = _Image(m.image, None, m.since)
        img.retired_at.append(m.since)
        img.retired_total += 1
        self.metrics.retired.inc()
        self._publish()
        if self._retire_fn is not None:
            task = asyncio.get_running_loop().create_task(self._retire_fn(m))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def consumption_per_second(self, image: str | None = None) -> float:
        """Sandboxes retired per second lately: the rate the operator must create pods at to
        keep the warm pool where it is. Retirements of the last `CONSUMPTION_WINDOW_SECONDS`,
        over the span since the oldest of them (at least `CONSUMPTION_MIN_SPAN_SECONDS`).

        Dividing by the whole window made a run that had just started consuming read a
        fraction of its rate (0.5 leases/s read 0.1/s after 12 s on the test node), so the
        operator kept the warm pool at minWarm while leases waited for pods
        (docs/benchmarks/sandbox-pool.md). `image`: of that image's key alone; None: all."""
        if image is None:
            return sum(self.consumption_per_second(k) for k in list(self._images))
        img = self._images.get(image)
        if img is None:
            return 0.0
        now = self.clock()
        horizon = now - CONSUMPTION_WINDOW_SECONDS
        retired = img.retired_at
        while retired and retired[0] < horizon:
            retired.popleft()
        if not retired:
            return 0.0
        span = min(CONSUMPTION_WINDOW_SECONDS, max(CONSUMPTION_MIN_SPAN_SECONDS, now - retired[0]))
        return len(retired) / span

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
        c = dict.fromkeys(STATES, 0)
        for m in self.members.values():
            c[m.state] += 1
        return c

    def demand(self) -> dict:
        c = self.counts()
        return {
            "busy": c[BUSY],
            # resetting sandboxes are idle within a second: counted idle so the scaler does
            # not create pods for a demand that is about to be met
            "idle": c[WARM] + c[RESETTING],
            "waiting": self._waiting,
            "starting": c[STARTING],
            "unhealthy": c[UNHEALTHY],
            "draining": c[DRAINING],
            # served their group (lifecycle fresh): the operator deletes and replaces them
            "retired": c[RETIRED],
            "retired_total": self.retired_total,
            "consumption_per_second": round(self.consumption_per_second(), 4),
            "lifecycle": self.lifecycle,
            "total": len(self.members),
            "leases_active": len(self.leases),
            "members": {m.name: m.state for m in self.members.values()},
            "unhealthy_members": sorted(m.name for m in self.members.values() if m.state == UNHEALTHY),
            "images": self._image_demand(),
        }

    def _image_demand(self) -> dict[str, dict]:
        """The demand of each image in use (the operator plans a pool per image): the same
        counts as the totals, the reference to make its pods of, and the seconds since a
        lease last asked for it (warm pods of a row image are kept only while it is used)."""
        now = self.clock()
        counts: dict[str, dict[str, int]] = {k: dict.fromkeys(STATES, 0) for k in self._images}
        for m in self.members.values():  # a member of an image no lease named since a restart too
            counts.setdefault(m.image, dict.fromkeys(STATES, 0))[m.state] += 1
        out: dict[str, dict] = {}
        for key, c in counts.items():
            img = self._images.get(key)
            out[key] = {
                "image": img.ref if img else None, "busy": c[BUSY], "idle": c[WARM] + c[RESETTING],
                "waiting": img.waiting if img else 0, "starting": c[STARTING], "retired": c[RETIRED],
                "retired_total": img.retired_total if img else 0,
                "consumption_per_second": round(self.consumption_per_second(key), 4),
                "idle_seconds": round(now - img.last_used, 3) if img else None}
        return out

    def _publish(self) -> None:
        for state, n in self.counts().items():
            self.metrics.sandboxes.labels(state=state).set(n)
        self.metrics.leases_active.set(len(self.leases))
        self._publish_waiting()

    def _publish_waiting(self) -> None:
        self.metrics.leases_waiting.set(self._waiting)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for img in self._images.values():
            for q in img.queues.values():
                for w in q:
                    if not w.fut.done():
                        w.fut.cancel()
