"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go and controller-runtime do.

Why not kopf's peering: it pauses the standby's watches and resumes them on the peering
object's events, and that is not exact (docs/operator.md, "High availability"): a paused
operator keeps index entries of objects deleted meanwhile, a resumed one may run handlers
before its indexes re-list (kopf gates handlers on the first listing only), a pausing
leader finishes the handler it is in, a leader whose keepalive fails never pauses itself,
and replicas of equal priority (the chart's Deployment) pause each other for good.

Why not `kubernetes.leaderelection`: it cannot be stopped or release the lease on a
graceful exit, and binds to the client's global configuration.

The rules (client-go's `leaderelection.go`):
- a candidate takes the Lease when it has no holder, or when the record it last observed
  has not changed for `lease_duration` seconds of its own monotonic clock (no clock is
  compared across machines); every write is a PUT guarded by resourceVersion, so two
  candidates never both win;
- the leader renews every `retry_period`; when no renewal succeeded for `renew_deadline`
  (< lease_duration) it stops acting: its `Fence` refuses writes from that instant, and
  the operator process exits (`lost` in `run_elected`), as controller-runtime does;
- a graceful stop (SIGTERM) stops the handlers first, then releases the Lease (empty
  holder), so the standby takes over within one `retry_period`;
- a leader that dies without a word (SIGKILL, node loss) is replaced `lease_duration`
  (+ one `retry_period`) after the standby last saw it renew.
The leader stops writing `renew_deadline` after the start of its last successful renewal,
a standby starts `lease_duration` after it observed that renewal: the two never overlap.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

#: What a failed round may raise: refused (ApiException), unreachable or timed out.
FAILED = (ApiException, OSError, HTTPError)

log = logging.getLogger("asyncgrpo.operator.leader")


@dataclass(frozen=True)
class ElectionConfig:
    """Timing of the election; the defaults are client-go's (15 s, 10 s, 2 s)."""

    #: Name of the Lease (in `namespace`) the replicas share.
    name: str = "asyncgrpo-operator"
    namespace: str = "default"
    #: A standby takes over this long after the leader's last renewal it saw.
    lease_duration: int = 15
    #: The leader stops acting when no renewal succeeded for this long.
    renew_deadline: float = 10.0
    #: Seconds between two tries to acquire or renew.
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0, got "
                             f"{self.lease_duration}, {self.renew_deadline}, {self.retry_period}")


def default_identity() -> str:
    """`<pod name>_<random>`: unique per process, readable in `kubectl get lease -o yaml`."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class NotLeader(RuntimeError):
    """A write was refused because this replica does not hold the Lease (any more)."""


class Fence:
    """Lets writes through only while the Lease is held, and knows which are in flight.

    `Kube` wraps every write in `write()`. The fence opens until a deadline that each
    renewal extends (its start + renew_deadline), so a leader whose renewals hang stops
    writing at the deadline even before its renew loop notices; `close()` waits for the
    writes already sent, so the Lease is released only after the last one landed.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_expired: Callable[[], None] | None = None):
        self.clock = clock
        #: called when a write (or a status patch) meets a deadline that passed while the
        #: Lease was believed held: a frozen or cut-off leader; the CLI exits the process
        self.on_expired = on_expired
        self._cond = threading.Condition()
        self._until = float("-inf")
        self._closed = True
        self._inflight = 0

    def open_until(self, deadline: float) -> None:
        with self._cond:
            self._until, self._closed = deadline, False

    def is_open(self) -> bool:
        with self._cond:
            return self.clock() < self._until

    def allows(self) -> bool:
        """`is_open()`, and on a deadline that expired (not a `close()`) call `on_expired`."""
        with self._cond:
            if self.clock() < self._until:
                return True
            expired = not self._closed
        if expired and self.on_expired is not None:
            self.on_expired()
        return False

    def close(self, timeout: float | None = 30.0) -> bool:
        """Refuse new writes; True once no write is in flight (within `timeout`)."""
        with self._cond:
            self._until, self._closed = float("-inf"), True
            return self._cond.wait_for(lambda: self._inflight == 0, timeout)

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            ok = self.clock() < self._until
            if ok:
                self._inflight += 1
        if not ok:
            self.allows()
            raise NotLeader("this operator replica does not hold the leader Lease")
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Acquire, renew and release one Lease; the timing rules are in the module docstring."""

    def __init__(self, api: ApiClient, config: ElectionConfig, identity: str | None = None,
                 fence: Fence | None = None, clock: Callable[[], float] = time.monotonic):
        self.api = api
        self.config = config
        self.identity = identity or default_identity()
        self.fence = fence or Fence(clock)
        self.clock = clock
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._last_round = clock()

    @property
    def path(self) -> str:
        c = self.config
        return f"/apis/coordination.k8s.io/v1/namespaces/{c.namespace}/leases/{c.name}"

    def _call(self, method: str, url: str, body: Any = None) -> Any:
        from asyncgrpo.controller.kube import request

        # a hung request must not outlive the deadline it is racing against
        return request(self.api, method, url, body, timeout=self.config.retry_period)

    def try_acquire_or_renew(self) -> bool:
        """One round of client-go's tryAcquireOrRenew; True if we hold the Lease after it."""
        c = self.config
        started = self._last_round = self.clock()
        try:
            lease = self._call("GET", self.path)
        except ApiException as e:
            if e.status != 404:
                return False
            lease = None
        except FAILED:
            return False
        now = _now_micro()
        mine = {"holderIdentity": self.identity, "leaseDurationSeconds": c.lease_duration,
                "acquireTime": now, "renewTime": now, "leaseTransitions": 0}
        try:
            if lease is None:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": c.name, "namespace": c.namespace}, "spec": mine}
                self._call("POST", self.path.rsplit("/", 1)[0], body)
                return self._won(started)
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime"), spec.get("acquireTime"),
                      spec.get("leaseTransitions"))
            if record != self._observed:
                # seen now, after the GET (client-go too): a late answer delays a takeover,
                # never hastens it
                self._observed, self._observed_at = record, self.clock()
            if holder and holder != self.identity \
                    and self.clock() < self._observed_at + c.lease_duration:
                return False   # held by someone else, and we saw it renewed recently
            if holder == self.identity:
                mine["acquireTime"] = spec.get("acquireTime") or now
                mine["leaseTransitions"] = int(spec.get("leaseTransitions") or 0)
            else:
                mine["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            lease["spec"] = mine   # metadata keeps resourceVersion: a lost race is a 409
            self._call("PUT", self.path, lease)
            return self._won(started)
        except FAILED:
            return False

    def _won(self, started: float) -> bool:
        # the renewal counts from when it was sent: the server committed it after that
        self.fence.open_until(started + self.config.renew_deadline)
        return True

    def healthy(self) -> bool:
        """The election loop is turning (for /healthz: a standby is healthy too)."""
        return self.clock() - self._last_round < self.config.lease_duration

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this replica leads (True) or `stop` is set (False)."""
        while not stop.is_set():
            if self.try_acquire_or_renew():
                log.info("%s acquired the lease %s/%s", self.identity, self.config.namespace,
                         self.config.name)
                return True
            stop.wait(self.config.retry_period)
        return False

    def hold(self, stop: threading.Event, alive: Callable[[], bool] = lambda: True) -> bool:
        """Renew until `stop` is set (False), or until renewals failed for renew_deadline
        or the work the Lease protects died (`alive()` false): True, leadership is over."""
        while not stop.wait(self.config.retry_period):
            if not alive():
                log.error("%s: the operator stopped while leading: giving the lease up",
                          self.identity)
                return True
            if not self.fence.is_open():
                # the deadline passed before this round even began (the process was frozen,
                # or a renewal hung): the standby may act already, trying would be too late
                log.error("%s: the lease deadline passed: stopping", self.identity)
                return True
            if not self.try_acquire_or_renew() and not self.fence.is_open():
                log.error("%s could not renew the lease for %.1fs: stopping", self.identity,
                          self.config.renew_deadline)
                return True
        return False

    def release(self) -> None:
        """Hand the Lease over at once (empty holder), if we still hold it."""
        try:
            lease = self._call("GET", self.path)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=_now_micro())
            self._call("PUT", self.path, lease)
            log.info("%s released the lease", self.identity)
        except FAILED as e:
            log.warning("could not release the lease (the standby waits for it to expire): %s",
                        e)


def run_elected(elector: LeaseElector, start: Callable[[], Any],
                stop_operator: Callable[[Any], None], stop: threading.Event,
                on_lost: Callable[[], None],
                alive: Callable[[Any], bool] = lambda op: True) -> None:
    """Lead when elected: `start()` the operator once the Lease is ours, renew it while it
    runs, `stop_operator(op)` then release on `stop`. Losing the Lease closes the fence
    (no write of ours leaves after that) and calls `on_lost` (the CLI exits the process:
    kopf's own writes and handlers still in flight go with it)."""
    while not stop.is_set():
        if not elector.acquire(stop):
            return
        op = start()
        if elector.hold(stop, alive=lambda op=op: alive(op)):
            elector.fence.close(timeout=0)
            on_lost()
            stop_operator(op)
            continue
        stop_operator(op)            # handlers finish (kopf's graceful stop) ...
        elector.fence.close()        # ... the last write lands ...
        elector.release()            # ... and only then the standby may act


def serve_health(port: int, check: Callable[[], bool], addr: str = "0.0.0.0") -> None:
    """/healthz for the kubelet: 200 while `check()` holds, 500 otherwise (kopf's own
    liveness endpoint runs only inside the leader's operator)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == "/healthz" and check()
            self.send_response(200 if ok else 500)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"unhealthy")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
