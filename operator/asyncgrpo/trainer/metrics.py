"""Prometheus metrics `asyncgrpo_trainer_*` and the status hints, on one port (rank 0).

`GET /metrics` is the Prometheus exposition, and what the operator scrapes
(`controller.progress` reads the metric names below from rank 0's `/metrics`, at
`Settings.trainer_metrics_url`) to fill the run's status and raise its conditions.
`GET /status` is a small JSON document for a person with curl: step, policy version and
hints such as `ServedPolicyMatches=False` with a reason; no controller reads it. The hints
are not the run status themselves: only the operator writes the AsyncGRPORun; the trainer
says what it saw.

Units are in the names. Names are part of the API (dashboards, alerts): see docs/trainer.md.
Each trainer process has its own registry so tests can run several in one interpreter.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from asyncgrpo.wire import BIND_HOST_ENV

PREFIX = "asyncgrpo_trainer_"

#: name -> (kind, help, labels); the documented list (a test keeps docs/trainer.md equal).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "step": ("gauge", "Optimizer steps done.", ()),
    "policy_version": ("gauge", "Newest policy version published (served as policy-v<N>).", ()),
    "raw_tokens_per_second": (
        "gauge", "Rollout tokens trained per second of wall clock (full lengths).", ()),
    "forwarded_tokens_per_second": (
        "gauge", "Unique tokens forwarded per second of wall clock after tree packing.", ()),
    "tree_compression_ratio": ("gauge", "Raw tokens / forwarded tokens of the last step.", ()),
    "step_seconds": (
        "histogram", "Wall-clock seconds of one optimizer step (rollout waits included).", ()),
    "rollout_wait_seconds": (
        "histogram", "Seconds of one step the trainer sat waiting for rollouts (empty queue).",
        ()),
    "train_seconds": (
        "histogram", "Seconds of one step spent training: forward, backward and optimizer.", ()),
    "weight_sync_seconds": (
        "histogram", "Seconds of one step spent publishing the policy to vLLM.", ()),
    "sample_staleness_steps": (
        "gauge", "Mean policy versions between generating and training a sample.", ()),
    "sample_staleness_max_steps": (
        "gauge", "Most policy versions between generating and training a sample, last step.",
        ()),
    "rollout_mixed_versions_ratio": (
        "gauge", ("Fraction of the last window's rollouts sampled by more than one weight "
                  "version (a replica swapped mid-rollout); full fine-tuning."), ()),
    "dropped_stale_samples_total": ("counter", "Samples dropped as older than maxStaleness.", ()),
    "adapter_publish_seconds": (
        "histogram", "Seconds from the end of a step to the adapter's manifest in the bucket.", ()),
    "adapter_publish_bytes": ("gauge", "Bytes of the last published adapter.", ()),
    "adapter_published_bytes_total": ("counter", "Bytes of adapters uploaded.", ()),
    "served_logprob_diff": (
        "gauge", "Max |served - trained| log-prob (nats) over the probe, newest version.", ()),
    "served_logprob_probe_failures_total": (
        "counter", "Probes vLLM did not answer (adapter refused or unreachable).", ()),
    "reward_mean": ("gauge", "Mean reward of the samples of the last step.", ()),
    "reward_std": ("gauge", "Within-group reward standard deviation, last step.", ()),
    "eval_reward_mean": ("gauge", "Mean reward of the eval split's rollouts, last eval.", ()),
    "eval_reward_std": ("gauge", "Standard deviation of the eval rollouts' rewards, last eval.",
                        ()),
    "eval_step": ("gauge", "Step of the last eval.", ()),
    "rollout_queue_depth": ("gauge", "Scored samples waiting for the trainer.", ()),
    "retries_total": (
        "counter", "Calls retried because a dependency was unreachable.", ("target",)),
    "rollout_routed_requests_total": (
        "counter", "Requests the rollout worker sent to each vLLM replica (affine routing).",
        ("replica",)),
    "rollout_routed_groups_total": (
        "counter", "Groups placed on each vLLM replica (first placement or a move).",
        ("replica",)),
    "rollout_route_failovers_total": (
        "counter", "Requests that failed on a replica and moved to the next one.",
        ("replica",)),
    "rollout_replica_groups_in_flight": (
        "gauge", "Groups with a rollout in flight on each vLLM replica.", ("replica",)),
    "rollout_replica_served_version": (
        "gauge", "Weights version each replica's puller reports serving (full fine-tuning).",
        ("replica",)),
    "checkpoint_step": ("gauge", "Step of the newest complete checkpoint in the bucket.", ()),
    "checkpoint_seconds": ("histogram", "Seconds to write one checkpoint to the bucket.", ()),
}

#: the rollout worker's `routing/<replica>/<key>` (asyncgrpo.trainer.routed_loop)
_ROUTING = {"requests_total": "rollout_routed_requests_total",
            "groups_total": "rollout_routed_groups_total",
            "failovers_total": "rollout_route_failovers_total",
            "groups_in_flight": "rollout_replica_groups_in_flight",
            "served_version": "rollout_replica_served_version"}

_TIME_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class Hint:
    """A condition the operator may raise on the run: type, "True"/"False", reason, message."""

    type: str
    status: str
    reason: str
    message: str = ""
    since: float = field(default_factory=time.time)


class TrainerMetrics:
    """The registry, the instruments and the status hints of one trainer process."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self._m: dict[str, Any] = {}
        for name, (kind, doc, labels) in METRICS.items():
            full = PREFIX + name
            if kind == "gauge":
                self._m[name] = Gauge(full, doc, labels, registry=self.registry)
            elif kind == "counter":
                self._m[name] = Counter(full.removesuffix("_total"), doc, labels,
                                        registry=self.registry)
            else:
                self._m[name] = Histogram(full, doc, labels, buckets=_TIME_BUCKETS,
                                          registry=self.registry)
        self._lock = threading.Lock()
        self._hints: dict[str, Hint] = {}
        self._state: dict[str, Any] = {"step": 0, "policy_version": 0}
        self._server: ThreadingHTTPServer | None = None

    def __getitem__(self, name: str):
        return self._m[name]

    # -- values ----------------------------------------------------------------------------

    def set(self, name: str, value: float) -> None:
        self._m[name].set(float(value))
        if name in ("step", "policy_version", "checkpoint_step"):
            with self._lock:
                self._state[name] = int(value)

    def observe(self, name: str, value: float) -> None:
        self._m[name].observe(float(value))

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        m = self._m[name].labels(**labels) if labels else self._m[name]
        m.inc(value)

    def hint(self, type_: str, ok: bool, reason: str, message: str = "") -> None:
        """Record a condition; `since` changes only when the status flips (as in Kubernetes)."""
        status = "True" if ok else "False"
        with self._lock:
            old = self._hints.get(type_)
            since = old.since if old is not None and old.status == status else time.time()
            self._hints[type_] = Hint(type_, status, reason, message, since)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {**self._state,
                    "conditions": [vars(h).copy() for h in self._hints.values()]}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # -- endpoint --------------------------------------------------------------------------

    def serve(self, port: int, host: str | None = None) -> int:
        """Serve /metrics and /status in a daemon thread; returns the bound port. The host
        defaults to `wire.BIND_HOST_ENV` (the local backend's pod address), else all
        interfaces."""
        host = host or os.environ.get(BIND_HOST_ENV) or "0.0.0.0"
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype = metrics.exposition(), CONTENT_TYPE_LATEST
                elif path == "/status":
                    body, ctype = json.dumps(metrics.status()).encode(), "application/json"
                elif path in ("/healthz", "/"):
                    body, ctype = b"ok\n", "text/plain"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not news
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._server.serve_forever, name="trainer-metrics",
                         daemon=True).start()
        return self._server.server_address[1]

    @classmethod
    def for_node(cls, rank: int) -> TrainerMetrics:
        """The endpoint of a trainer pod other than global rank 0's: /healthz for its
        readiness probe and /metrics with only `asyncgrpo_trainer_node_info`, so every pod a
        StatefulSet runs answers its probe and a scrape, and no pod but rank 0 reports
        training numbers (a sum or max over pods stays right)."""
        node = cls.__new__(cls)
        node.registry = CollectorRegistry(auto_describe=True)
        node._m = {}
        Gauge(PREFIX + "node_info", "A trainer pod that is not global rank 0 (value 1).",
              ("rank",), registry=node.registry).labels(rank=str(rank)).set(1)
        node._lock = threading.Lock()
        node._hints = {}
        node._state = {"rank": rank}
        node._server = None
        return node

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- from TRL's logs -------------------------------------------------------------------

    def update_from_logs(self, logs: dict[str, float]) -> None:
        """Map one TRL logging window (already reduced per key) onto the instruments.

        Packing numbers come from the tree engine's keys (`tree/...`) when its collator is in
        place, else from TRL's own (`batch/packing_ratio`, raw/unique tokens).
        """
        def get(*keys):
            for k in keys:
                v = logs.get(k)
                if isinstance(v, (int, float)) and not math.isnan(v):
                    return float(v)
            return None

        if (v := get("reward")) is not None:
            self.set("reward_mean", v)
        if (v := get("reward_std")) is not None:
            self.set("reward_std", v)
        if (v := get("eval_reward")) is not None:
            self.set("eval_reward_mean", v)
            if (w := get("eval_reward_std")) is not None:
                self.set("eval_reward_std", w)
        if (v := get("sample/staleness_mean")) is not None:
            self.set("sample_staleness_steps", v)
        if (v := get("sample/staleness_max")) is not None:
            self.set("sample_staleness_max_steps", v)
        if (v := get("rollout/mixed_versions_ratio")) is not None:
            self.set("rollout_mixed_versions_ratio", v)
        if (v := get("sample/dropped_stale_total")) is not None:
            self.inc("dropped_stale_samples_total", v)
        if (v := get("sample/rollout_queue_size")) is not None:
            self.set("rollout_queue_depth", v)
        ratio = get("tree/compression_ratio", "batch/packing_ratio")
        if ratio is not None:
            self.set("tree_compression_ratio", ratio)
        step_s = get("perf/step_s")
        if step_s is not None:
            self.observe("step_seconds", step_s)
        # the step split: waiting for rollouts (generation-bound) vs training (trainer-bound)
        if (v := get("perf/rollout_wait_s")) is not None:
            self.observe("rollout_wait_seconds", v)
        fwd_bwd, opt = get("perf/fwd_bwd_s"), get("perf/optimizer_s")
        if fwd_bwd is not None:
            self.observe("train_seconds", fwd_bwd + (opt or 0.0))
        if (v := get("perf/weight_sync_s")) is not None:
            self.observe("weight_sync_seconds", v)
        self._routing_from_logs(logs)
        fwd_s = get("perf/forwarded_tok_s_wall_clock")
        if fwd_s is not None:
            self.set("forwarded_tokens_per_second", fwd_s)
            self.set("raw_tokens_per_second", fwd_s * (ratio or 1.0))

    def _routing_from_logs(self, logs: dict[str, float]) -> None:
        """Per-replica routing numbers; a replica gone from the window's gauges loses its
        gauge series (it left the replica set)."""
        seen: dict[str, set[str]] = {}
        for key, v in logs.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "routing" or parts[2] not in _ROUTING:
                continue
            if not isinstance(v, (int, float)) or math.isnan(v):
                continue
            name, replica = _ROUTING[parts[2]], parts[1]
            if METRICS[name][0] == "counter":
                # born at 0 for every replica seen: a counter born at its first increment is
                # invisible to rate() (the failovers panel would show nothing, not 0)
                self._m[name].labels(replica=replica)
                if v:
                    self.inc(name, v, replica=replica)
            else:
                self._m[name].labels(replica=replica).set(float(v))
                seen.setdefault(name, set()).add(replica)
        if "rollout_replica_groups_in_flight" not in seen:
            return  # no push in this window: nothing known about the set
        current = seen["rollout_replica_groups_in_flight"]
        for name in ("rollout_replica_groups_in_flight", "rollout_replica_served_version"):
            gauge = self._m[name]
            for (replica,) in [k for k in list(gauge._metrics) if k[0] not in current]:
                gauge.remove(replica)
