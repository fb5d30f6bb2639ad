"""Sandbox pod scaling, the rule: how many pods to want, which to delete, and
create-expectations. Pure: `sandbox_io` reads the inputs and carries the plan out.

The operator sees pods through a watch-fed cache, which lags behind its own writes. Counting
only the cache, a scaler that just created 10 pods would see 0 and create 10 more on the next
tick. `Expectations` remembers the names the operator created (or deleted) until the cache
shows them (or stops showing them), the way controller-runtime's ReplicaSet expectations do,
and the scaler counts `cache + expected creations - expected deletions`. Entries expire
after `ttl` so a lost watch event cannot freeze a pool forever.

Pod names are `<run>-sandbox-<ordinal>`, the lowest ordinals no pod in the cache (nor an
expected creation) holds: a creation is then idempotent whoever sends it. Two actors that
see the same pods (an old leader's last tick and a new leader's first, or a cache that lost
the expectations of the process before) pick the same names, and the API server answers
the second with AlreadyExists instead of adding pods; a random suffix would add them.

Pods Kubernetes reports failed or unschedulable stay counted until the pool shrinks: they
are reported in the status and deleted first on scale-down, but never replaced in a
create/fail loop. Pods the gateway reports unhealthy (a sandbox server that stopped
answering) or retired (lifecycle FreshPerGroup: it served its one group) are deleted and
replaced in the same reconcile, as the sizing contract asks. The operator deletes them, not
the gateway: RBAC cannot narrow `delete` to the run's sandbox pods by label, so a gateway
allowed to delete could delete every pod of the namespace; it stays read-only.

With a sandbox image per row (`spec.sandboxes.imageColumn`) the pool is one pool per image in
use (`plan_images`): each is planned by the same rule from the gateway's demand for its image
(the run's own image keeps `minWarm`; a row image keeps `images.minWarmPerImage` while a
lease asked for it within `idleTtlSeconds`, else none, so its sandboxes start cold), and the
creations of all of them together stay within `max` and `hardCap`, the images with waiting
leases served first.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from asyncgrpo.api.v1alpha1 import SandboxSpec
from asyncgrpo.sandbox.operator.sizing import desired_pool_size
from asyncgrpo.wire import DEFAULT_SANDBOX_IMAGE_KEY

#: Gateway member states (asyncgrpo.sandbox.gateway.pool) a pod may be drained and deleted in.
DELETABLE_STATES = frozenset({"warm", "draining"})
#: Gateway member states whose pods are deleted at once and replaced: out of service, or
#: retired after serving their one group (lifecycle FreshPerGroup).
REPLACED_STATES = frozenset({"unhealthy", "retired"})


@dataclass(frozen=True)
class ImageDemand:
    """The demand for one image (`images` of the gateway's demand)."""

    busy: int = 0
    idle: int = 0
    waiting: int = 0
    starting: int = 0
    consumption_per_second: float = 0.0
    #: the reference leases named (None: the run's own image)
    image: str | None = None
    #: seconds since a lease last asked for the image (None: none since the gateway started)
    idle_seconds: float | None = None


@dataclass(frozen=True)
class Demand:
    """The gateway's demand signal (`GET /v1/demand`, asyncgrpo.sandbox.gateway.pool.Pool.demand)."""

    busy: int = 0
    idle: int = 0
    waiting: int = 0
    starting: int = 0
    members: dict[str, str] = field(default_factory=dict)   # pod name -> gateway state
    #: sandboxes retired per second lately (FreshPerGroup): what the pool must refill
    consumption_per_second: float = 0.0
    #: the same per image key (wire.sandbox_image_key); empty from a gateway that predates it
    images: dict[str, ImageDemand] = field(default_factory=dict)

    def of_image(self, key: str) -> Demand:
        """This demand restricted to one image's counts (members stay whole: the plan looks
        its own pods up by name)."""
        d = self.images.get(key)
        if d is None:
            if not self.images and key == DEFAULT_SANDBOX_IMAGE_KEY:
                return self   # a gateway without images: everything is the run's own image
            d = ImageDemand()
        return Demand(busy=d.busy, idle=d.idle, waiting=d.waiting, starting=d.starting,
                      members=self.members, consumption_per_second=d.consumption_per_second)

    @classmethod
    def from_json(cls, doc: dict) -> Demand:
        return cls(busy=int(doc.get("busy", 0)), idle=int(doc.get("idle", 0)),
                   waiting=int(doc.get("waiting", 0)), starting=int(doc.get("starting", 0)),
                   members={str(k): str(v) for k, v in (doc.get("members") or {}).items()},
                   consumption_per_second=float(doc.get("consumption_per_second", 0.0)))


#: a pod start assumed before any sandbox pod of the run has become Ready
DEFAULT_POD_START_SECONDS = 10.0
#: the longest pod start the horizon follows (a pod stuck for minutes is a problem of its
#: own, not a reason to keep hundreds warm)
MAX_POD_START_SECONDS = 120.0


def refill_horizon(pod_starts: Iterable[float], resync_seconds: float) -> float:
    """Seconds between a sandbox being consumed and its replacement serving: one operator
    resync (the retirement is seen, the pod created) plus a pod start, as this run's pods
    have started (their upper quartile: a node under load starts pods in 7 to 18 s, not
    the 5 s an idle one does; docs/benchmarks/sandbox-pool.md)."""
    starts = sorted(s for s in pod_starts if math.isfinite(s) and s >= 0.0)
    start = starts[(3 * len(starts)) // 4] if starts else DEFAULT_POD_START_SECONDS
    return max(0.0, resync_seconds) + min(start, MAX_POD_START_SECONDS)


def refill_warm(min_warm: int, consumption_per_second: float, horizon_s: float) -> int:
    """minWarm plus what the run consumes while a replacement is on its way, so a fresh
    sandbox per group still finds a warm pod at steady state."""
    rate = consumption_per_second if math.isfinite(consumption_per_second) else 0.0
    return min_warm + math.ceil(max(0.0, rate) * horizon_s)


@dataclass
class PodView:
    """What the scaler needs to know of one sandbox pod (from the operator's pod index)."""

    name: str
    phase: str = "Pending"
    ready: bool = False
    failed: bool = False
    unschedulable: bool = False
    deleting: bool = False
    outdated: bool = False
    #: creation to Ready, seconds (None until Ready): how fast this run's pods start
    start_seconds: float | None = None
    #: the image it runs: its key (wire.sandbox_image_key) and a row image's reference
    image_key: str = DEFAULT_SANDBOX_IMAGE_KEY
    image: str | None = None


class Expectations:
    """Creations and deletions the cache has not shown yet, per run. Thread-safe: kopf's
    workers reconcile runs in parallel, and the per-namespace cap reads every run's pending
    creations (`pending_creates`)."""

    def __init__(self, ttl: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._adds: dict[str, dict[str, float]] = {}
        self._dels: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def expect_create(self, key: str, name: str) -> None:
        with self._lock:
            self._adds.setdefault(key, {})[name] = self.clock()

    def expect_delete(self, key: str, name: str) -> None:
        with self._lock:
            self._dels.setdefault(key, {})[name] = self.clock()

    def observe(self, key: str, seen: Iterable[str]) -> tuple[set[str], set[str]]:
        """Settle against the cache; returns (pending creations, pending deletions)."""
        seen = set(seen)
        with self._lock:
            now = self.clock()
            adds = {n: t for n, t in self._adds.get(key, {}).items()
                    if n not in seen and now - t < self.ttl}
            dels = {n: t for n, t in self._dels.get(key, {}).items()
                    if n in seen and now - t < self.ttl}
            self._adds[key], self._dels[key] = adds, dels
        return set(adds), set(dels)

    def pending_creates(self, key: str) -> set[str]:
        """The creations of `key` not yet settled (and not expired), without settling."""
        with self._lock:
            now = self.clock()
            return {n for n, t in self._adds.get(key, {}).items() if now - t < self.ttl}

    def forget(self, key: str) -> None:
        with self._lock:
            self._adds.pop(key, None)
            self._dels.pop(key, None)


def free_names(prefix: str, taken: Collection[str], n: int) -> list[str]:
    """The `n` lowest free names `<prefix>-<ordinal>`: deterministic for a given view, so
    concurrent creators collide on AlreadyExists rather than over-create."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        name = f"{prefix}-{i}"
        if name not in taken:
            out.append(name)
        i += 1
    return out


@dataclass(frozen=True)
class Plan:
    create: int
    delete: list[str]       # pods to drain through the gateway, then delete
    replace: list[str]      # pods the gateway reports unhealthy: deleted now, replaced
    live: int
    target: int


def plan(spec: SandboxSpec, pods: list[PodView], pending_creates: set[str],
         pending_deletes: set[str], demand: Demand | None, excess_for: float,
         suspended: bool = False, max_step: int = 64, resync_seconds: float = 10.0) -> Plan:
    """Creations and deletions that move the pool toward `desired_pool_size`.

    Sizing is the sandbox gateway's rule (`asyncgrpo.sandbox.operator.sizing`); this adds what only
    the operator knows: in-flight creations and deletions (expectations), Kubernetes-level
    failures (kept and counted, so a pod that cannot run is not recreated in a loop), and
    `idleTtlSeconds`: idle pods are removed only after the pool has been above its target
    that long (`excess_for`), so a short lull does not churn the pool.
    """
    live_pods = [p for p in pods if not p.deleting and p.name not in pending_deletes]
    if suspended:
        return Plan(0, [], sorted(p.name for p in live_pods), len(live_pods), 0)
    members = demand.members if demand else {}
    replace = sorted(p.name for p in live_pods if members.get(p.name) in REPLACED_STATES
                     and not (p.failed or p.unschedulable))
    counted = [p for p in live_pods if p.name not in replace]
    current = len(counted) + len(pending_creates)
    # pods the gateway does not know yet are in-flight creations: never count them idle
    unknown = sum(1 for p in counted if p.name not in members and not p.failed
                  and not p.unschedulable) + len(pending_creates)
    if demand is None:
        # no signal yet: grow to minWarm, never shrink blind (it could hit a busy sandbox)
        floor = min(spec.min_warm, spec.max, spec.hard_cap)
        target = min(floor, current + max_step) if current < floor else current
    else:
        target = desired_pool_size(
            current=current, busy=min(demand.busy, current), waiting=demand.waiting,
            starting=min(demand.starting + unknown, current),
            min_warm=refill_warm(spec.min_warm, demand.consumption_per_second, refill_horizon(
                [p.start_seconds for p in pods if p.start_seconds is not None], resync_seconds)),
            max_size=spec.max, hard_cap=spec.hard_cap, max_step=max_step)
    if target > current:
        room = spec.hard_cap - current - len(replace)
        return Plan(max(0, min(target - current, room)), [], replace, current, target)
    if target < current and demand is not None and excess_for >= spec.idle_ttl_seconds:
        return Plan(0, _victims(counted, demand, current - target), replace, current, target)
    return Plan(0, [], replace, current, target)

def _victims(pods: list[PodView], demand: Demand, n: int) -> list[str]:
    """Failed first, then not-yet-ready, then idle (outdated template first); never busy."""
    def rank(p: PodView) -> tuple[int, int, str]:
        if p.failed or p.unschedulable:
            return (0, 0, p.name)
        state = demand.members.get(p.name)
        if state is None and not p.ready:
            return (1, 0, p.name)
        if state in DELETABLE_STATES:
            return (2, 0 if p.outdated else 1, p.name)
        return (9, 0, p.name)
    ranked = sorted((rank(p), p.name) for p in pods)
    return [name for r, name in ranked if r[0] < 9][:n]


@dataclass(frozen=True)
class ImagePlan:
    """The plan of one image's pool: `image` None is the run's own image."""

    key: str
    image: str | None
    plan: Plan


def plan_images(spec: SandboxSpec, pods: list[PodView], pending_creates: dict[str, str],
                pending_deletes: set[str], demand: Demand | None, excess_for: dict[str, float],
                suspended: bool = False, max_step: int = 64,
                resync_seconds: float = 10.0) -> list[ImagePlan]:
    """`plan` for each image in use, the creations of all within the run's max and hardCap;
    in the order the room went to them (`_within_caps`).

    `pending_creates`: pod name -> image key of the creations the cache does not show yet;
    `excess_for`: per image key, how long its pool has been above its target. A row image is
    in use while it has pods or pending creations, or its demand has a lease waiting or one
    within `idleTtlSeconds`. Its pods are made of the reference the gateway's demand or its
    own pods give; an image known by neither (a pod without its annotation) only shrinks.
    """
    refs: dict[str, str | None] = {DEFAULT_SANDBOX_IMAGE_KEY: None}
    for p in pods:
        refs.setdefault(p.image_key, p.image)
    for key in pending_creates.values():
        refs.setdefault(key, None)
    for key, d in (demand.images if demand else {}).items():
        if d.image is not None:
            refs[key] = d.image
    plans: list[ImagePlan] = []
    for key, ref in refs.items():
        row_image = key != DEFAULT_SANDBOX_IMAGE_KEY
        d = demand.images.get(key) if demand else None
        recent = d is not None and (d.waiting > 0 or (d.idle_seconds is not None
                                                      and d.idle_seconds < spec.idle_ttl_seconds))
        min_warm = (spec.images.min_warm_per_image if recent else 0) if row_image else spec.min_warm
        own = spec.model_copy(update={"min_warm": min(min_warm, spec.max)})
        p = plan(own, [v for v in pods if v.image_key == key],
                 {n for n, k in pending_creates.items() if k == key}, pending_deletes,
                 demand.of_image(key) if demand else None, excess_for.get(key, 0.0),
                 suspended=suspended, max_step=max_step, resync_seconds=resync_seconds)
        if row_image and ref is None:
            p = Plan(0, p.delete, p.replace, p.live, p.target)  # nothing to make its pods of
        plans.append(ImagePlan(key, ref if row_image else None, p))
    return _within_caps(spec, plans, demand)


def _within_caps(spec: SandboxSpec, plans: list[ImagePlan], demand: Demand | None) -> list[ImagePlan]:
    """Creations cut so that all pools together stay within max and hardCap: the images
    with the most waiting leases first, then the run's own, then the rest (the order of
    the result, which the creations follow)."""
    live = sum(ip.plan.live for ip in plans)
    replacing = sum(len(ip.plan.replace) for ip in plans)
    room = max(0, min(min(spec.max, spec.hard_cap) - live, spec.hard_cap - live - replacing))

    def waiting(ip: ImagePlan) -> int:
        d = demand.images.get(ip.key) if demand else None
        return d.waiting if d else 0
    out: list[ImagePlan] = []
    for ip in sorted(plans, key=lambda ip: (-waiting(ip), ip.key != DEFAULT_SANDBOX_IMAGE_KEY, ip.key)):
        n = min(ip.plan.create, room)
        room -= n
        out.append(ImagePlan(ip.key, ip.image, Plan(n, ip.plan.delete, ip.plan.replace,
                                                    ip.plan.live, ip.plan.target)))
    return out
