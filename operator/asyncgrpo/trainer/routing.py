"""Which vLLM replica a rollout request goes to: group-affine, bounded-load, version-aware.

Why: the G rollouts of a group share their prompt, and every turn of a multi-turn rollout
extends the previous one, so each request's prefix is already in the KV cache of the replica
that served its group before. Sent through the vLLM Service, kube-proxy spreads them at
random: with R replicas a continuation finds its history cached about 1/R of the time.

How (standard library only; the rollout loop's integration is `asyncgrpo.trainer.routed_loop`):

- **Consistent hashing** of the group key over the replicas (`HashRing`, 64 virtual nodes
  each): a replica added or removed moves only the groups that hashed to it.
- **Bounded load** (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
  2018): a group is placed on the first replica clockwise from its hash whose load (groups with
  a rollout in flight) is under the capacity ``max(ceil((m+1)/n), floor(c*(m+1)/n))`` for
  ``m`` groups in flight over ``n`` replicas, c = 1.25: no replica carries more than 1.25x the
  mean (or the mean rounded up, when 1.25x rounds below it), so a hot group cannot pin one.
- **Sticky pins**: a group keeps its replica for all its rollouts and every turn of them
  (an LRU of recent groups) while that replica is healthy and present; only new groups are
  placed. A request that fails on a replica marks it down for a cool-down and re-places the
  group (the conversation then pays one cache miss).
- **Version-aware** (full fine-tuning): new groups go only to replicas whose puller reports the
  newest served version and no swap in progress; existing pins stay (a paused replica's
  requests freeze and continue after its swap).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from asyncgrpo import wire

#: the bounded-load factor c: no replica above 1.25x the mean load
LOAD_FACTOR = 1.25
VIRTUAL_NODES = 64
#: seconds a replica that failed a request gets no new request (doubles per failure, to 60)
COOLDOWN_S = 5.0
MAX_COOLDOWN_S = 60.0
#: groups whose pin is remembered after their last rollout (TRL reuses a group id only while
#: its G rollouts are being started, so a few thousand is plenty)
PIN_MEMORY = 4096


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class RoutingConfig:
    """Picklable (it crosses to TRL's spawned rollout child with the loop's kwargs)."""

    replicas: str                       # a DNS name, or comma-separated http://host:port roots
    # (from the environment: NAME[:PORT], or the list)
    port: int = wire.VLLM_PORT          # the replicas' port, for a DNS name
    puller_port: int | None = None      # full fine-tuning: read served versions
    refresh_s: float = 2.0
    load_factor: float = LOAD_FACTOR

    @classmethod
    def from_env(cls, env: dict[str, str]) -> RoutingConfig | None:
        replicas = (env.get(wire.VLLM_REPLICAS_ENV) or "").strip()
        if not replicas:
            return None
        puller = (env.get(wire.VLLM_PULLER_PORT_ENV) or "").strip()
        puller_port = int(puller) if puller else None
        host, sep, port = replicas.rpartition(":")
        if "://" not in replicas and "," not in replicas and sep and port.isdigit():
            return cls(replicas=host, port=int(port), puller_port=puller_port)
        return cls(replicas=replicas, puller_port=puller_port)

    @property
    def static(self) -> list[str] | None:
        """The replicas as `host:port`, when given as a list rather than a DNS name."""
        if "://" not in self.replicas and "," not in self.replicas:
            return None
        out = []
        for root in (r.strip() for r in self.replicas.split(",")):
            if root:
                out.append(urlsplit(root if "://" in root else f"http://{root}").netloc)
        return out


class HashRing:
    """Replicas on a hash ring, `VIRTUAL_NODES` points each."""

    def __init__(self, replicas: list[str], vnodes: int = VIRTUAL_NODES):
        points = sorted((_hash(f"{r}#{i}"), r) for r in set(replicas) for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [r for _, r in points]
        self.replicas = sorted(set(replicas))

    def walk(self, key: Hashable) -> Iterator[str]:
        """Every replica once, clockwise from the key's point."""
        if not self._keys:
            return
        start = bisect.bisect(self._keys, _hash(repr(key)))
        seen: set[str] = set()
        n = len(self._keys)
        for i in range(n):
            r = self._owners[(start + i) % n]
            if r not in seen:
                seen.add(r)
                yield r
                if len(seen) == len(self.replicas):
                    return


def capacity(groups_after: int, replicas: int, c: float = LOAD_FACTOR) -> int:
    """Most groups one replica may hold once `groups_after` groups are in flight."""
    if replicas <= 0:
        return 0
    mean = groups_after / replicas
    return max(math.ceil(mean), math.floor(c * mean))


@dataclass
class ReplicaState:
    """What the router knows of one replica beyond its address."""

    served_version: int | None = None   # from its puller (full fine-tuning); None: unknown
    swapping: bool = False              # its puller is between /pause and /resume
    down_until: float = 0.0             # failed recently: no requests before this
    failures: int = 0                   # consecutive


class Router:
    """Group -> replica, with loads, pins, failures and versions. Not thread-safe: the rollout
    loop runs on one asyncio thread."""

    def __init__(self, replicas: list[str] = (), c: float = LOAD_FACTOR,
                 clock: Callable[[], float] = time.monotonic):
        self.c = c
        self._clock = clock
        self._ring = HashRing([])
        self._state: dict[str, ReplicaState] = {}
        self._pins: OrderedDict[Hashable, str] = OrderedDict()
        self._inflight: dict[Hashable, int] = {}    # group -> rollouts in flight
        self._load: dict[str, int] = {}             # replica -> groups in flight on it
        self._active: dict[Hashable, str] = {}      # group in flight -> replica it loads
        self.set_replicas(list(replicas))

    # -- the replica set -------------------------------------------------------------------

    @property
    def replicas(self) -> list[str]:
        return self._ring.replicas

    def set_replicas(self, replicas: list[str]) -> bool:
        """The replicas now present; pins to removed ones are dropped. True if it changed."""
        new = sorted(set(replicas))
        if new == self._ring.replicas:
            return False
        self._ring = HashRing(new)
        for r in new:
            self._state.setdefault(r, ReplicaState())
            self._load.setdefault(r, 0)
        for r in [r for r in self._state if r not in new]:
            del self._state[r]
            del self._load[r]
        for g in [g for g, r in self._pins.items() if r not in self._state]:
            del self._pins[g]
        for g in [g for g, r in self._active.items() if r not in self._state]:
            del self._active[g]
        return True

    def set_version(self, replica: str, served_version: int | None, swapping: bool) -> None:
        st = self._state.get(replica)
        if st is not None:
            st.served_version, st.swapping = served_version, swapping

    def state(self, replica: str) -> ReplicaState | None:
        return self._state.get(replica)

    def healthy(self, replica: str) -> bool:
        st = self._state.get(replica)
        return st is not None and st.down_until <= self._clock()

    def load(self, replica: str) -> int:
        return self._load.get(replica, 0)

    def newest_version(self) -> int | None:
        known = [s.served_version for s in self._state.values() if s.served_version is not None]
        return max(known) if known else None

    def eligible(self, replica: str) -> bool:
        """May take a new group: healthy, not swapping, serving the newest version (when any
        replica reports one)."""
        if not self.healthy(replica):
            return False
        st = self._state[replica]
        newest = self.newest_version()
        if newest is None:
            return True
        return not st.swapping and st.served_version == newest

    # -- placing ---------------------------------------------------------------------------

    def _place(self, group: Hashable, exclude: str | None = None) -> str | None:
        candidates = [r for r in self.replicas if r != exclude and self.healthy(r)]
        if not candidates:
            return None
        preferred = [r for r in candidates if self.eligible(r)] or candidates
        allowed = set(preferred)
        in_flight = sum(self._load[r] for r in allowed)
        cap = capacity(in_flight + 1, len(allowed), self.c)
        walk = [r for r in self._ring.walk(group) if r in allowed]
        for r in walk:
            if self._load[r] < cap:
                return r
        return min(walk, key=lambda r: self._load[r])  # unreachable when cap is right

    def _pin(self, group: Hashable, replica: str) -> None:
        self._pins[group] = replica
        self._pins.move_to_end(group)
        while len(self._pins) > PIN_MEMORY:
            old, _ = self._pins.popitem(last=False)
            if old in self._active:  # never forget a group in flight
                self._pins[old] = self._active[old]
                break

    def _move_load(self, group: Hashable, replica: str) -> None:
        old = self._active.get(group)
        if old == replica:
            return
        if old is not None and old in self._load:
            self._load[old] -= 1
        if group in self._inflight:
            self._active[group] = replica
            self._load[replica] += 1

    def route(self, group: Hashable) -> tuple[str | None, bool]:
        """(the replica for the group's next request, whether it was placed just now);
        (None, False) when no replica is healthy (the caller uses the Service)."""
        pinned = self._pins.get(group)
        if pinned is not None and self.healthy(pinned):
            self._pins.move_to_end(group)
            self._move_load(group, pinned)
            return pinned, False
        replica = self._place(group)
        if replica is None:
            return None, False
        self._pin(group, replica)
        self._move_load(group, replica)
        return replica, True

    # -- rollouts in flight ----------------------------------------------------------------

    def start(self, group: Hashable) -> None:
        """A rollout of the group starts (its load counts from its first request)."""
        self._inflight[group] = self._inflight.get(group, 0) + 1

    def finish(self, group: Hashable) -> None:
        n = self._inflight.get(group, 0) - 1
        if n > 0:
            self._inflight[group] = n
            return
        self._inflight.pop(group, None)
        replica = self._active.pop(group, None)
        if replica is not None and replica in self._load:
            self._load[replica] -= 1

    # -- outcomes --------------------------------------------------------------------------

    def failed(self, replica: str) -> None:
        """A request to the replica failed (connection, timeout, 5xx): no requests for a
        cool-down (doubling per consecutive failure), and its groups move on their next
        request."""
        st = self._state.get(replica)
        if st is None:
            return
        st.failures += 1
        st.down_until = self._clock() + min(COOLDOWN_S * 2 ** (st.failures - 1), MAX_COOLDOWN_S)

    def succeeded(self, replica: str) -> None:
        st = self._state.get(replica)
        if st is not None:
            st.failures = 0
