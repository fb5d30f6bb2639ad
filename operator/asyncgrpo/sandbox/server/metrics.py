"""Prometheus metrics of the sandbox server (the gateway's: `gateway.metrics`).

Each app gets its own registry so several apps can live in one process (tests, bench) and
each scrape shows only its own series. Names carry their unit (`_seconds`, `_bytes`,
`_total`) as Prometheus naming asks; docs/sandboxes.md lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# exec latencies run from a millisecond `true` to minutes-long test suites
_EXEC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class SandboxMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.execs = Counter(
            "asyncgrpo_sandbox_execs_total", "Execs by outcome (ok, nonzero, timeout, error).",
            ["outcome"], registry=r,
        )
        self.exec_seconds = Histogram(
            "asyncgrpo_sandbox_exec_seconds", "Wall time of one exec.", buckets=_EXEC_BUCKETS, registry=r
        )
        self.in_flight = Gauge("asyncgrpo_sandbox_execs_in_flight", "Execs running or queued.", registry=r)
        self.output_bytes = Counter(
            "asyncgrpo_sandbox_output_bytes_total", "Bytes commands wrote (before truncation).",
            ["stream"], registry=r,
        )
        self.truncated = Counter(
            "asyncgrpo_sandbox_output_truncated_total", "Exec outputs cut to the cap.", ["stream"], registry=r
        )
        self.resets = Counter("asyncgrpo_sandbox_resets_total", "Workspace resets.", registry=r)
        self.reset_seconds = Histogram(
            "asyncgrpo_sandbox_reset_seconds", "Time to kill leftovers and restore the workspace.",
            buckets=_EXEC_BUCKETS, registry=r,
        )
        self.workspace_bytes = Gauge(
            "asyncgrpo_sandbox_workspace_bytes", "Disk the workspace used at its last measurement.", registry=r
        )
        self.quota_wipes = Counter(
            "asyncgrpo_sandbox_quota_wipes_total",
            "Workspaces wiped because commands took them over the quota.", registry=r,
        )
        self.path_refused = Counter(
            "asyncgrpo_sandbox_path_refused_total", "File requests refused for leaving the workspace.",
            registry=r,
        )
        self.rejected = Counter(
            "asyncgrpo_sandbox_requests_rejected_total",
            "Requests refused (unauthorized, too_large, bad_length, body_timeout, header_timeout, "
            "too_many_waiters).", ["reason"], registry=r,
        )
