"""Reads of tenant-controlled endpoints, off kopf's handler threads.

A run's trainer (`/metrics`), gateway (`/v1/demand`, `/v1/members/*/drain`) and weights
pullers (`/status`) run images the tenant chose, and `allowedEgressHosts` are names the
tenant chose: any of them can answer one byte a second, or never. So the reconcile never
waits on one for long:

- Every exchange runs on one asyncio loop in its own thread (`TenantIO`), with a deadline for
  the WHOLE exchange (connect, headers, body: aiohttp's `total` timeout) and a size cap on the
  body; a body over the cap is an error, not a truncated document.
- Fairness: at most `per_namespace` exchanges of one namespace run at once, and at most
  `total` over all namespaces; the rest queue on the loop (no thread held). A namespace full
  of dripping trainers fills its own slots, never another namespace's.
- The reconcile asks with `read(...)`: it gets the last finished reading at once, starts a new
  one when none is in flight, and waits up to `wait` seconds for it only when that endpoint
  answered in time last time and its namespace has a free slot (an exchange queued behind
  its neighbours' dripping ones would hold the caller's kopf worker for their deadline). A slow endpoint costs its own run a stale value and a condition
  (`Reading.problem`), never a kopf thread.
- DNS of tenant-chosen names (`resolve`) goes through dnspython's asyncio resolver on the same
  loop, with a lifetime deadline per name and a cache (answers kept for `ttl`, the last good
  answer kept when a later lookup fails); the reconcile only ever reads the cache.

Parsing is the caller's `parse(bytes)`: typed and bounded, it raises ValueError (or
TypeError) on a bad document, which becomes `Reading.problem` ("BadResponse").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: problem reasons (CamelCase, as conditions take them)
SLOW, TOO_LARGE, BAD, UNREACHABLE = ("EndpointSlow", "ResponseTooLarge", "BadResponse",
                                     "EndpointUnreachable")


@dataclass(frozen=True)
class Reading:
    """One finished exchange: the parsed value, or why there is none."""

    value: Any = None
    #: None, or (reason, message) of the failure; UNREACHABLE (nothing listens yet) is not
    #: worth a condition, the others are
    problem: tuple[str, str] | None = None
    at: float = 0.0           # monotonic time it finished
    seconds: float = 0.0      # how long it took

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass
class _Slot:
    reading: Reading | None = None
    good: Reading | None = None     # the last reading that had a value
    future: concurrent.futures.Future | None = None


@dataclass
class _Name:
    addresses: tuple[str, ...] = ()
    resolved_at: float = -1e18      # last successful lookup
    tried_at: float = -1e18         # last lookup started
    error: str = ""
    future: concurrent.futures.Future | None = None


@dataclass
class Limits:
    #: seconds one exchange (connect + request + whole body) may take
    deadline: float = 3.0
    #: exchanges of one namespace at once; the rest queue
    per_namespace: int = 4
    #: exchanges over all namespaces at once
    total: int = 64
    #: seconds one DNS name may take to resolve (all its servers and tries)
    dns_deadline: float = 2.0
    #: DNS servers ("ip" or "ip:port"); empty: the system's (/etc/resolv.conf)
    nameservers: list[str] = field(default_factory=list)


class Budget:
    """How long one reconcile may still wait on tenants' endpoints, over all its reads."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class TenantIO:
    """The operator's one place for talking to tenant-controlled endpoints (module doc)."""

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or Limits()
        self.clock = clock
        self._slots: dict[tuple, _Slot] = {}
        self._names: dict[str, _Name] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ns_sem: dict[str, asyncio.Semaphore] = {}
        #: exchanges and lookups of each namespace asked for and not finished (under _lock)
        self._pending: dict[str, int] = {}
        self._total: asyncio.Semaphore | None = None
        self._session = None
        self._resolver = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncgrpo-tenant-io",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ HTTP

    def read(self, key: tuple, namespace: str, url: str, parse: Callable[[bytes], Any], *,
             max_bytes: int, wait: float = 0.0, method: str = "GET",
             headers: dict[str, str] | None = None, refresh: float = 0.0) -> Reading | None:
        """The newest finished reading of `key` (None before the first), starting a new
        exchange unless one is in flight or the last finished less than `refresh` s ago."""
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
            fut = slot.future
            fresh = slot.reading is not None and self.clock() - slot.reading.at < refresh
            if (fut is None or fut.done()) and not fresh:
                self._pending[namespace] = self._pending.get(namespace, 0) + 1
                fut = slot.future = asyncio.run_coroutine_threadsafe(
                    self._exchange(key, namespace, method, url, headers or {}, parse,
                                   max_bytes), self._loop)
            last = slot.reading
            # more asked of this namespace than it has slots: this exchange may queue behind
            # its neighbours' (dripping ones hold theirs for the whole deadline)
            queued = self._pending.get(namespace, 0) > self.limits.per_namespace
        # wait only for an endpoint that answered in time before (or was never asked), and
        # not when the namespace's slots are taken: a kopf worker never waits out a queue
        if wait > 0 and fut is not None and not fut.done() and (last is None or last.ok) \
                and not queued:
            try:
                fut.result(timeout=wait)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass
        with self._lock:
            return self._slots[key].reading

    def latest(self, key: tuple, namespace: str, url: str, parse: Callable[[bytes], Any], *,
               max_bytes: int, budget: Budget, what: str, problems: list[tuple[str, str]],
               method: str = "GET", headers: dict[str, str] | None = None) -> Any:
        """The newest value read from a tenant's endpoint (`read`, waiting no longer than the
        budget), its last good one when the newest failed (GET only: an answer to a POST is
        never reused); a slow, oversized or malformed answer is also noted in `problems` as
        (reason, "<what> <message>") for the run's status."""
        reading = self.read(key, namespace, url, parse, max_bytes=max_bytes,
                            wait=budget.left(), method=method, headers=headers)
        if reading is None:
            return None
        if reading.problem is not None:
            reason, message = reading.problem
            if reason != "EndpointUnreachable":
                problems.append((reason, f"{what} {message}"))
            if method != "GET":
                return None
            good = self.last_good(key)
            return good.value if good is not None else None
        return reading.value

    def last_good(self, key: tuple) -> Reading | None:
        with self._lock:
            slot = self._slots.get(key)
            return slot.good if slot else None

    def forget(self, prefix: tuple) -> None:
        """Drop every reading whose key starts with `prefix` (a deleted run)."""
        n = len(prefix)
        with self._lock:
            for k in [k for k in self._slots if k[:n] == prefix]:
                del self._slots[k]

    def _sems(self, namespace: str) -> tuple[asyncio.Semaphore, asyncio.Semaphore]:
        if self._total is None:
            self._total = asyncio.Semaphore(self.limits.total)
        sem = self._ns_sem.get(namespace)
        if sem is None:
            sem = self._ns_sem[namespace] = asyncio.Semaphore(self.limits.per_namespace)
        return sem, self._total

    async def _http(self):
        if self._session is None:
            import aiohttp

            # no pooled connections (a tenant's server may hold one), no proxy from the env
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), trust_env=False)
        return self._session

    async def _exchange(self, key: tuple, namespace: str, method: str, url: str,
                        headers: dict[str, str], parse: Callable[[bytes], Any],
                        max_bytes: int) -> None:
        try:
            await self._exchange_in_turn(key, namespace, method, url, headers, parse,
                                         max_bytes)
        finally:
            self._done(namespace)

    def _done(self, namespace: str) -> None:
        with self._lock:
            left = self._pending.get(namespace, 0) - 1
            if left > 0:
                self._pending[namespace] = left
            else:
                self._pending.pop(namespace, None)

    async def _exchange_in_turn(self, key: tuple, namespace: str, method: str, url: str,
                                headers: dict[str, str], parse: Callable[[bytes], Any],
                                max_bytes: int) -> None:
        import aiohttp

        ns_sem, total = self._sems(namespace)
        async with ns_sem, total:
            t0 = self.clock()
            value, problem = None, None
            try:
                session = await self._http()
                timeout = aiohttp.ClientTimeout(total=self.limits.deadline)
                async with session.request(method, url, headers=headers, timeout=timeout,
                                           allow_redirects=False) as resp:
                    body = await _read_capped(resp, max_bytes)
                    if body is None:
                        problem = (TOO_LARGE, f"answered more than {max_bytes} bytes")
                    elif resp.status != 200:   # not serving yet: as if not listening
                        problem = (UNREACHABLE, f"answered HTTP {resp.status}")
                    else:
                        value = parse(body)
            except TimeoutError:
                problem = (SLOW, f"did not answer in full within {self.limits.deadline:g} s")
            except (aiohttp.ClientConnectionError, OSError) as e:
                problem = (UNREACHABLE, type(e).__name__)
            except (aiohttp.ClientError, ValueError, TypeError, ArithmeticError,
                    UnicodeError) as e:
                problem = (BAD, f"its answer is not valid ({type(e).__name__})")
            now = self.clock()
            reading = Reading(value, problem, now, now - t0)
            with self._lock:
                slot = self._slots.get(key)
                if slot is not None:
                    slot.reading = reading
                    if problem is None:
                        slot.good = reading

    # ------------------------------------------------------------------ DNS

    def resolve(self, namespace: str, hosts: list[str], ttl: float,
                negative_ttl: float | None = None) -> tuple[list[str], list[str]]:
        """(addresses known for `hosts`, hosts with no answer yet or whose last lookup
        failed), from the cache; starts lookups of names older than `ttl` (failed ones retried
        after `negative_ttl`, default ttl/4) without waiting for them."""
        now = self.clock()
        retry = ttl / 4 if negative_ttl is None else negative_ttl
        found: set[str] = set()
        missing: list[str] = []
        with self._lock:
            for host in hosts:
                literal = _literal(host)
                if literal is not None:
                    found.add(literal)
                    continue
                n = self._names.setdefault(host, _Name())
                busy = n.future is not None and not n.future.done()
                due = now - n.resolved_at >= ttl and now - n.tried_at >= (
                    retry if n.error else 0.0)
                if due and not busy:
                    n.tried_at = now
                    self._pending[namespace] = self._pending.get(namespace, 0) + 1
                    n.future = asyncio.run_coroutine_threadsafe(
                        self._lookup(namespace, host), self._loop)
                found.update(n.addresses)
                if not n.addresses or n.error:
                    missing.append(host)
        return sorted(found), missing

    async def _dns(self):
        if self._resolver is None:
            import dns.asyncresolver

            configure = not self.limits.nameservers
            r = dns.asyncresolver.Resolver(configure=configure)
            if not configure:
                servers = []
                for s in self.limits.nameservers:
                    host, _, port = s.rpartition(":") if s.count(":") == 1 else (s, "", "")
                    servers.append(host)
                    if port:
                        r.port = int(port)
                r.nameservers = servers
            r.lifetime = self.limits.dns_deadline
            r.timeout = min(r.timeout, self.limits.dns_deadline)
            self._resolver = r
        return self._resolver

    async def _lookup(self, namespace: str, host: str) -> None:
        try:
            await self._lookup_in_turn(namespace, host)
        finally:
            self._done(namespace)

    async def _lookup_in_turn(self, namespace: str, host: str) -> None:
        import dns.exception
        import dns.resolver

        ns_sem, total = self._sems(namespace)
        async with ns_sem, total:
            addrs: set[str] = set()
            error = ""
            try:
                r = await self._dns()

                async def one(rdtype: str) -> None:
                    try:
                        ans = await r.resolve(host, rdtype, search=False,
                                              lifetime=self.limits.dns_deadline)
                        addrs.update(str(a) for a in ans)
                    except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                        pass

                async with asyncio.timeout(self.limits.dns_deadline + 0.5):
                    try:
                        async with asyncio.TaskGroup() as group:
                            group.create_task(one("A"))
                            group.create_task(one("AAAA"))
                    except* (dns.exception.DNSException, ValueError, OSError) as eg:
                        error = type(eg.exceptions[0]).__name__
                if not addrs and not error:
                    error = "no address"
            except (TimeoutError, dns.exception.DNSException, ValueError, OSError) as e:
                error = type(e).__name__
            now = self.clock()
            with self._lock:
                n = self._names.setdefault(host, _Name())
                n.error = error
                if not error:
                    n.addresses, n.resolved_at = tuple(sorted(addrs)), now

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        async def shut() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._session is not None:
                await self._session.close()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


async def _read_capped(resp, max_bytes: int) -> bytes | None:
    """The whole body, or None when it is longer than `max_bytes`."""
    length = resp.content_length
    if length is not None and length > max_bytes:
        return None
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(65536):
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
