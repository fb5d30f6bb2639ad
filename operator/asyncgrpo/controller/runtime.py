"""What the operator keeps in memory: settings, the API client, metrics, expectations, and a
little per-run state. Lives in kopf's memo; losing it (a restart, or a new leadership term:
each term starts a fresh Runtime) costs a few reads, never a duplicate: children are found
again through the indexes, which kopf fills from a full list before any handler runs, so
create-expectations are rebuilt from the API server's state, not carried over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo import default_image
from asyncgrpo.controller import gateway, trainer
from asyncgrpo.controller.metrics import OperatorMetrics
from asyncgrpo.controller.progress import Progress
from asyncgrpo.controller.sandbox_scaling import Expectations


@dataclass
class WebhookSettings:
    """The validating admission webhook (`asyncgrpo operator --webhook-port`)."""

    port: int = 9443
    #: Address to listen on.
    addr: str = "0.0.0.0"
    #: Directory with tls.crt, tls.key and ca.crt (a cert-manager Secret, mounted).
    cert_dir: str = "/etc/asyncgrpo/webhook"
    #: "namespace/name" of the Service in front of the operator: the API server calls it;
    #: empty: the API server calls https://<host>:<port> directly (out-of-cluster, tests).
    service: str | None = None
    host: str | None = None


@dataclass
class Caps:
    """Operator-wide limits on what one run (or one namespace) may ask for."""

    #: Most sandbox pods of one run (spec.sandboxes.hardCap may not exceed it).
    sandboxes_per_run: int = 256
    #: Most sandbox pods of all runs of one namespace together.
    sandboxes_per_namespace: int = 512
    #: Most vLLM replicas of one run.
    vllm_replicas: int = 64
    #: Most trainer replicas (nodes) of one run.
    trainer_replicas: int = 64


@dataclass
class Settings:
    """Operator settings (`asyncgrpo operator --help`)."""

    #: Seconds between timer reconciles of one run (status, pool, progress).
    resync_seconds: float = 10.0
    #: The validating admission webhook; None: off.
    webhook: WebhookSettings | None = None

    #: Where a run's gateway answers; {name} and {namespace} are filled in.
    gateway_url: str = gateway.URL
    #: Rank 0's metrics endpoint; {name}, {namespace} and {port} are filled in.
    trainer_metrics_url: str = trainer.METRICS_URL
    #: NetworkPolicy peers allowed to scrape metrics; None: Prometheus and this operator.
    scrapers: list[dict[str, Any]] | None = None
    #: Forget a creation or deletion the watch never showed after this long.
    expectations_ttl_seconds: float = 300.0
    #: Seconds between DNS lookups of allowedEgressHosts.
    dns_refresh_seconds: float = 60.0
    #: Seconds one lookup of a tenant-chosen name may take (controller.tenant_io).
    dns_deadline_seconds: float = 2.0
    #: DNS servers for tenant-chosen names ("ip" or "ip:port"); empty: the system's.
    dns_nameservers: list[str] = field(default_factory=list)
    #: Seconds one exchange with a tenant's endpoint (trainer metrics, gateway demand and
    #: drain, weights pullers) may take, connect to last byte; past it: EndpointSlow.
    endpoint_deadline_seconds: float = 3.0
    #: Seconds one reconcile waits, over all its reads, for endpoints that answered in time
    #: before; a slow endpoint is not waited for (its run shows its last reading).
    endpoint_wait_seconds: float = 1.0
    #: Exchanges with tenants' endpoints at once, per namespace and over all.
    endpoint_reads_per_namespace: int = 4
    endpoint_reads_total: int = 64
    #: Most sandbox pods created or deleted per run in one reconcile.
    pool_max_step: int = 64
    #: Kubeconfig to use instead of the pod's service account or $KUBECONFIG (tests run the
    #: operator as the chart's service account this way).
    kubeconfig: str | None = None
    #: Test hook: delay every pod event this long before the operator sees it.
    pod_watch_delay_seconds: float = 0.0
    #: S3 endpoints (URLs or host names) runs may use; empty: any host except link-local and
    #: metadata addresses (Helm value adapterStore.allowedEndpoints).
    allowed_endpoints: list[str] = field(default_factory=list)
    #: Image of the bucket setup and cleanup Jobs (`asyncgrpo bucket ...`): the operator's own
    #: (Helm: image.*, or adapterStore.jobImage), the smallest image with boto3.
    bucket_job_image: str = default_image("operator")
    bucket_job_pull_policy: str = "IfNotPresent"
    #: A bucket Job's pod is stopped after this long (activeDeadlineSeconds).
    bucket_job_deadline_seconds: int = 300
    #: Seconds between re-runs of a setup Job that succeeded (a deleted Secret, a revoked key,
    #: a lost marker become BucketReady=False); each re-run is one short pod.
    bucket_recheck_seconds: float = 600.0
    #: A deleted run's bucket cleanup gives up after this long (Warning event CleanupAbandoned);
    #: the annotation asyncgrpo.dev/skip-bucket-cleanup: "true" gives up at once.
    cleanup_timeout_seconds: float = 600.0
    #: Operator-wide limits a run may not exceed (Helm values caps.*): checked by validation
    #: (webhook and reconcile, reported as OverCap), and the pool never creates past them.
    caps: Caps = field(default_factory=Caps)
    #: GPU resource of runs that name none (spec.gpuResourceName; Helm value gpuResourceName).
    gpu_resource_name: str = "nvidia.com/gpu"
    #: Run `asyncgrpo preflight` as a Job (the trainer image) before vLLM and the trainer
    #: scale up, reported as the Preflight condition (controller.preflightjob).
    preflight: bool = True


@dataclass
class BucketState:
    """What one run's bucket setup Jobs found (`reconcile._check_bucket`): the last finding
    per spec of the Job (its hash), and the backoff of a failing one."""

    ok_for: str | None = None       # setup Job (its spec hash) last succeeded
    error: Any = None               # its last failure (`bucket.BucketError`)
    failed_for: str | None = None   # setup Job (its spec hash) last failed
    failures: int = 0               # failures in a row of that spec
    retry_at: float = 0.0           # no new Job of the failed spec before (monotonic)
    checked_at: float = 0.0         # when the last check succeeded (monotonic)
    seen_job: str = ""              # uid of the last setup Job whose outcome counted


@dataclass
class RunState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    bucket: BucketState = field(default_factory=BucketState)
    secret_ready: bool = False
    gateway_token: str | None = None
    #: per image key: since when its sandbox pool has been above its target
    excess_since: dict[str, float] = field(default_factory=dict)
    #: the image key of each sandbox pod this operator created (until the cache shows it)
    sandbox_image_of: dict[str, str] = field(default_factory=dict)
    spawned_total: int = 0
    #: sandbox pods this run may create in the reconcile under way (the per-namespace cap)
    sandbox_reserved: int = 0
    finished: dict[str, str] | None = None   # terminal phase and completionTime, once reached
    last_status: tuple[str | None, dict[str, Any]] | None = None   # (body rv, status computed)
    #: a refused sandbox creation: (retry after, (reason, message), pod template hash)
    pool_error: tuple[float, tuple[str, str], str] | None = None
    progress: Progress | None = None
    #: children found that this run does not own: (kind, name) -> retry creating after
    conflicts: dict[tuple[str, str], float] = field(default_factory=dict)
    #: the preflight Job's last outcome (controller.preflightjob.State)
    preflight: Any = None


@dataclass
class Runtime:
    settings: Settings
    kube: Any = None
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    expectations: Expectations = field(default_factory=Expectations)
    #: leader election's write fence (`controller.leader.Fence`); None: standalone
    fence: Any = None
    runs: dict[tuple[str, str], RunState] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tenant_io: Any = None

    @property
    def tenant_io(self):
        """The reads of tenants' endpoints and names (`controller.tenant_io`), started on
        first use."""
        from asyncgrpo.controller.tenant_io import Limits, TenantIO

        with self._lock:
            if self._tenant_io is None:
                s = self.settings
                self._tenant_io = TenantIO(Limits(
                    deadline=s.endpoint_deadline_seconds,
                    per_namespace=s.endpoint_reads_per_namespace,
                    total=s.endpoint_reads_total, dns_deadline=s.dns_deadline_seconds,
                    nameservers=list(s.dns_nameservers)))
            return self._tenant_io

    def close(self) -> None:
        with self._lock:
            io, self._tenant_io = self._tenant_io, None
        if io is not None:
            io.close()

    def reserve_sandboxes(self, state: RunState, ns: str, wanted: int,
                          held: Callable[[], set[str]]) -> int:
        """How many of `wanted` new sandbox pods the run of `state` may create under the
        per-namespace cap (`Caps.sandboxes_per_namespace`), reserved at once for it.

        What the namespace holds is counted from the API server's state, never from what this
        process remembers of earlier reconciles (a restart, or a new leadership term, starts
        with none of it): every sandbox pod object the pod index shows in the namespace
        (`held`: every run's, terminating ones too), plus the creations it has not shown yet
        (every run's create-expectations), plus what runs reconciled at this moment reserved
        and have not created yet. Counting and reserving happen under one lock, so two runs
        never both take the last room; a pod is counted twice for a moment (expected and still
        reserved: `release_sandbox` after `expect_create`), never zero times.
        """
        cap = self.settings.caps.sandboxes_per_namespace
        if wanted <= 0:   # the steady state: nothing to count
            return 0
        with self._lock:
            others = [(f"{n}/{r}", st) for (n, r), st in self.runs.items() if n == ns]
            names = held() | set().union(*(self.expectations.pending_creates(k)
                                           for k, _ in others))
            reserved = sum(st.sandbox_reserved for _, st in others if st is not state)
            granted = max(0, min(wanted, cap - len(names) - reserved))
            state.sandbox_reserved = granted
        return granted

    def release_sandbox(self, state: RunState) -> None:
        """One reserved pod is an expected creation now (counted there)."""
        with self._lock:
            state.sandbox_reserved = max(0, state.sandbox_reserved - 1)

    def end_reservation(self, state: RunState) -> None:
        """The unused part of the run's reservation goes back (its reconcile's creations are
        over)."""
        with self._lock:
            state.sandbox_reserved = 0

    def run(self, key: tuple[str, str]) -> RunState:
        with self._lock:
            return self.runs.setdefault(key, RunState())

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self.runs.pop(key, None)
        self.expectations.forget("/".join(key))
        self.metrics.forget(*key)
        if self._tenant_io is not None:
            self._tenant_io.forget(key)
