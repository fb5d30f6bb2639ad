"""Sandbox pool scaling: how many pods to want, which to delete, and create-expectations.

The operator sees pods through a watch-fed cache, which lags behind its own writes. Counting
only the cache, a scaler that just created 10 pods would see 0 and create 10 more on the next
tick. `Expectations` remembers the names the operator created (or deleted) until the cache
shows them (or stops showing them), the way controller-runtime's ReplicaSet expectations do,
and the scaler counts `cache + expected creations - expected deletions`. Entries expire
after `ttl` so a lost watch event cannot freeze a pool forever.

Failed and unschedulable pods stay counted until the pool shrinks: they are reported in the
status, and deleted first on scale-down, but never replaced in a create/fail loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from asyncgrpo.api.v1alpha1 import SandboxSpec

#: Gateway member states (asyncgrpo.sandbox.pool) a pod may be deleted in.
DELETABLE_STATES = frozenset({"warm", "draining", "unhealthy"})


@dataclass(frozen=True)
class Demand:
    """The gateway's demand signal (GET /v1/demand); `members` maps pod name -> state."""

    busy: int = 0
    idle: int = 0
    waiting: int = 0
    members: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: dict) -> Demand:
        return cls(busy=int(doc.get("busy", 0)), idle=int(doc.get("idle", 0)),
                   waiting=int(doc.get("waiting", 0)),
                   members={str(k): str(v) for k, v in (doc.get("members") or {}).items()})


def desired_size(spec: SandboxSpec, demand: Demand | None, current: int) -> int:
    """Pods the pool should have: everything leased or waited for, plus minWarm idle.

    Without a demand signal (gateway not up yet, unreachable) the pool holds its size and
    only grows to minWarm: scaling down blind could delete a busy sandbox.
    """
    if demand is None:
        want = max(current, spec.min_warm)
    else:
        want = demand.busy + demand.waiting + spec.min_warm
    return max(0, min(want, spec.max, spec.hard_cap))


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


class Expectations:
    """Creations and deletions the cache has not shown yet, per run."""

    def __init__(self, ttl: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._adds: dict[str, dict[str, float]] = {}
        self._dels: dict[str, dict[str, float]] = {}

    def expect_create(self, key: str, name: str) -> None:
        self._adds.setdefault(key, {})[name] = self.clock()

    def expect_delete(self, key: str, name: str) -> None:
        self._dels.setdefault(key, {})[name] = self.clock()

    def observe(self, key: str, seen: Iterable[str]) -> tuple[set[str], set[str]]:
        """Settle against the cache; returns (pending creations, pending deletions)."""
        seen = set(seen)
        now = self.clock()
        adds = {n: t for n, t in self._adds.get(key, {}).items()
                if n not in seen and now - t < self.ttl}
        dels = {n: t for n, t in self._dels.get(key, {}).items()
                if n in seen and now - t < self.ttl}
        self._adds[key], self._dels[key] = adds, dels
        return set(adds), set(dels)

    def forget(self, key: str) -> None:
        self._adds.pop(key, None)
        self._dels.pop(key, None)


@dataclass(frozen=True)
class Plan:
    create: int
    delete: list[str]
    live: int


def plan(spec: SandboxSpec, pods: list[PodView], pending_creates: set[str],
         pending_deletes: set[str], demand: Demand | None, excess_for: float,
         suspended: bool = False) -> Plan:
    """Creations and deletions that move the pool toward its desired size.

    `excess_for` is how long (s) the pool has been above its desired size; pods are only
    removed once that exceeds `idleTtlSeconds`, so a short lull does not thrash the pool.
    """
    live_pods = [p for p in pods if not p.deleting and p.name not in pending_deletes]
    live = len(live_pods) + len(pending_creates)
    if suspended:
        return Plan(0, sorted(p.name for p in live_pods), live)
    want = desired_size(spec, demand, live)
    if live < want:
        return Plan(min(want - live, spec.hard_cap - live), [], live)
    if live > want and demand is not None and excess_for >= spec.idle_ttl_seconds:
        return Plan(0, _victims(live_pods, demand, live - want), live)
    if live > spec.hard_cap:  # hardCap lowered below the pool: shrink even without a signal
        return Plan(0, _victims(live_pods, demand or Demand(), live - spec.hard_cap), live)
    return Plan(0, [], live)


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
