"""The operator's Prometheus metrics (`asyncgrpo_operator_*`), in their own registry.

Run-level gauges mirror the trainer's numbers so one dashboard can show every run without
scraping every trainer; their series are removed when a run is deleted, so the operator's
endpoint does not grow with the history of the cluster.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: The annotations plain Prometheus keeps pods by (charts/asyncgrpo/files/prometheus-scrape.yaml)
SCRAPE_ANNOTATION = "prometheus.io/scrape"
PORT_ANNOTATION = "prometheus.io/port"
PATH_ANNOTATION = "prometheus.io/path"


def scrape_annotations(port: int, path: str = "/metrics") -> dict[str, str]:
    """Pod annotations that tell a `kubernetes_sd_configs` job (role: pod) to scrape `path`
    on `port`: the convention of Prometheus's example configuration, which the chart's
    scrape job and most Prometheus installs follow. Prometheus Operator users select the
    same pods with the chart's PodMonitor instead."""
    return {SCRAPE_ANNOTATION: "true", PORT_ANNOTATION: str(port), PATH_ANNOTATION: path}


PHASES = ("Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed")
SANDBOX_STATES = ("warm", "busy", "starting", "failed")


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        run = ["namespace", "run"]
        self.runs = Gauge("asyncgrpo_operator_runs", "Runs by phase.", ["phase"], registry=r)
        self.sandboxes = Gauge("asyncgrpo_operator_sandboxes", "Sandbox pods by state.",
                               [*run, "state"], registry=r)
        self.spawned = Counter("asyncgrpo_operator_sandboxes_spawned_total",
                               "Sandbox pods created.", run, registry=r)
        self.reconcile_seconds = Histogram(
            "asyncgrpo_operator_reconcile_seconds", "Time of one reconcile of one run.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        # by result, both exported from the start: rate() sees the first error (a series
        # born with it would hide that increase); the alert reads this one
        self.reconciles = Counter("asyncgrpo_operator_reconciles_total",
                                  "Reconciles of one run, by result (ok, error).", ["result"],
                                  registry=r)
        for result in ("ok", "error"):
            self.reconciles.labels(result)
        self.reconcile_errors = Counter("asyncgrpo_operator_reconcile_errors_total",
                                        "Reconciles that raised, by exception type.",
                                        ["error"], registry=r)
        self.api_writes = Counter("asyncgrpo_operator_api_writes_total",
                                  "Kubernetes API writes made by the reconcile.",
                                  ["verb", "kind"], registry=r)
        self.policy_version = Gauge("asyncgrpo_operator_run_policy_version",
                                    "Newest adapter version the trainer published.", run,
                                    registry=r)
        self.step = Gauge("asyncgrpo_operator_run_step", "Optimizer steps done.", run,
                          registry=r)
        self.tokens_per_second = Gauge("asyncgrpo_operator_run_tokens_per_second",
                                       "Training throughput (raw: rollout tokens; unique: "
                                       "tokens forwarded after tree packing).",
                                       [*run, "kind"], registry=r)
        self.compression = Gauge("asyncgrpo_operator_run_tree_compression_ratio",
                                 "Raw / forwarded tokens of tree packing.", run, registry=r)
        self.served_weights = Gauge("asyncgrpo_operator_run_served_weights_version",
                                    "Full fine-tuning: weights version served by the oldest "
                                    "and the newest vLLM replica.", [*run, "replica"],
                                    registry=r)
        self._phases: dict[tuple[str, str], str] = {}
        for p in PHASES:
            self.runs.labels(p).set(0)

    def set_phase(self, ns: str, name: str, phase: str | None) -> None:
        if phase is None:
            self._phases.pop((ns, name), None)
        else:
            self._phases[(ns, name)] = phase
        for p in PHASES:
            self.runs.labels(p).set(sum(1 for v in self._phases.values() if v == p))

    def set_status(self, ns: str, name: str, status: dict) -> None:
        for state in SANDBOX_STATES:
            self.sandboxes.labels(ns, name, state).set(
                (status.get("sandboxes") or {}).get(state, 0))
        if "policyVersion" in status:
            self.policy_version.labels(ns, name).set(status["policyVersion"])
        if "step" in status:
            self.step.labels(ns, name).set(status["step"])
        tp = status.get("throughput") or {}
        if "rawTokensPerSecond" in tp:
            self.tokens_per_second.labels(ns, name, "raw").set(tp["rawTokensPerSecond"])
        if "uniqueTokensPerSecond" in tp:
            self.tokens_per_second.labels(ns, name, "unique").set(tp["uniqueTokensPerSecond"])
        if "treeCompressionRatio" in tp:
            self.compression.labels(ns, name).set(tp["treeCompressionRatio"])
        for end, version in (status.get("servedWeights") or {}).items():
            if end in ("oldest", "newest"):
                self.served_weights.labels(ns, name, end).set(version)

    def forget(self, ns: str, name: str) -> None:
        self.set_phase(ns, name, None)
        for g in (self.spawned, self.policy_version, self.step, self.compression):
            try:
                g.remove(ns, name)
            except KeyError:
                pass
        for state in SANDBOX_STATES:
            try:
                self.sandboxes.remove(ns, name, state)
            except KeyError:
                pass
        for end in ("oldest", "newest"):
            try:
                self.served_weights.remove(ns, name, end)
            except KeyError:
                pass
        for kind in ("raw", "unique"):
            try:
                self.tokens_per_second.remove(ns, name, kind)
            except KeyError:
                pass
