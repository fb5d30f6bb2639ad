"""Prometheus metrics of the gateway (the sandbox server's: `server.metrics`).

Each app gets its own registry so several apps can live in one process (tests, bench) and
each scrape shows only its own series. Names carry their unit (`_seconds`, `_bytes`,
`_total`) as Prometheus naming asks; docs/sandboxes.md lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# exec latencies run from a millisecond `true` to minutes-long test suites (as the server's)
_EXEC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    STATES = ("starting", "warm", "busy", "resetting", "unhealthy", "draining", "retired")

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sandboxes = Gauge(
            "asyncgrpo_gateway_sandboxes", "Pool members by state.", ["state"], registry=r
        )
        for s in self.STATES:
            self.sandboxes.labels(state=s).set(0)
        self.spawned = Counter(
            "asyncgrpo_gateway_sandboxes_spawned_total", "Sandboxes that joined the pool.", registry=r
        )
        self.failures = Counter(
            "asyncgrpo_gateway_sandbox_failures_total",
            "Sandboxes taken out of service, by reason (health, lost, reset).", ["reason"], registry=r,
        )
        # every reason exported from the start at 0: a first failure is then an increase that
        # rate() and the chart's alert see, not a series appearing at 1
        for reason in ("health", "lost", "reset"):
            self.failures.labels(reason=reason)
        self.lease_wait = Histogram(
            "asyncgrpo_gateway_lease_wait_seconds",
            "Time from lease request to lease; start=warm if a sandbox was idle, cold if it waited.",
            ["start"], buckets=_WAIT_BUCKETS, registry=r,
        )
        for start in ("warm", "cold"):
            self.lease_wait.labels(start=start)
        self.retired = Counter(
            "asyncgrpo_gateway_sandboxes_retired_total",
            "Sandboxes that served their one group and wait for the operator to delete them "
            "(lifecycle fresh): the rate the pool must be refilled at.", registry=r,
        )
        self.leases_active = Gauge("asyncgrpo_gateway_leases_active", "Leases held now.", registry=r)
        self.leases_waiting = Gauge(
            "asyncgrpo_gateway_leases_waiting", "Lease requests waiting for a sandbox.", registry=r
        )
        self.leases_ended = Counter(
            "asyncgrpo_gateway_leases_ended_total",
            "Leases ended, by how (released, expired, broken).", ["how"], registry=r,
        )
        self.lease_timeouts = Counter(
            "asyncgrpo_gateway_lease_wait_timeouts_total", "Lease requests that got no sandbox in time.",
            registry=r,
        )
        self.exec_seconds = Histogram(
            "asyncgrpo_gateway_exec_seconds", "Wall time of one proxied exec, gateway included.",
            buckets=_EXEC_BUCKETS, registry=r,
        )
        self.proxy_errors = Counter(
            "asyncgrpo_gateway_proxy_errors_total", "Proxied calls that failed to reach a sandbox.",
            registry=r,
        )
        self.rejected = Counter(
            "asyncgrpo_gateway_requests_rejected_total",
            "Requests refused (unauthorized, too_large, bad_length, body_timeout, header_timeout, "
            "too_many_waiters).", ["reason"], registry=r,
        )
