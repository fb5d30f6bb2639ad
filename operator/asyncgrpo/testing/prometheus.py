"""A real Prometheus for tests and benchmarks, and the checks of the chart's dashboard and rules.

Starts Debian's `/usr/bin/prometheus` (package prometheus; 2.42 here) as a process with a
generated configuration: static targets, or the chart's own pod-discovery job
(charts/asyncgrpo/files/prometheus-scrape.yaml) pointed at an API server. Everything is read
back through Prometheus's HTTP API (`query`, `query_range`, `targets`, `rules`, `alerts`), so a
test proves what a user's Prometheus would see, not what a string in a file says.

`panel_queries` and `rule_queries` list every query of charts/asyncgrpo/files/dashboard.json
and every rule of files/alerts.yaml with the components whose metrics it reads
(`components_of`); `missing_data` says which of them return nothing, given the components a
test ran. The node e2e uses the same helpers with every component running.

    with PrometheusServer(tmp, [static_job("trainer", ["127.0.0.1:9400"])]) as prom:
        prom.wait_for_targets_up()
        prom.query("asyncgrpo_trainer_step")
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

from asyncgrpo.testing.net import free_port

PROMETHEUS = os.environ.get("ASYNCGRPO_PROMETHEUS", "/usr/bin/prometheus")
REPO = Path(__file__).resolve().parents[3]
CHART_FILES = REPO / "charts" / "asyncgrpo" / "files"
DASHBOARD = CHART_FILES / "dashboard.json"
RULES = CHART_FILES / "alerts.yaml"
SCRAPE_JOB = CHART_FILES / "prometheus-scrape.yaml"

#: metric name prefix -> the component that exports it (the operator, each trainer pod,
#: vLLM, the gateway, a sandbox pod; "weights": a full fine-tuning run's pullers)
COMPONENTS = {
    "asyncgrpo_operator_": "operator",
    # full fine-tuning only: the operator reads it from each vLLM replica's weights puller
    "asyncgrpo_operator_run_served_weights": "weights",
    "asyncgrpo_trainer_": "trainer",
    "asyncgrpo_gateway_": "gateway",
    "asyncgrpo_sandbox_": "sandbox",
    "vllm:": "vllm",
}
#: vLLM's metrics the dashboard and rules read, as vLLM 0.32 names them
#: (vllm/v1/metrics/loggers.py; counters gain `_total` in the exposition)
VLLM_METRICS = {"vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                "vllm:generation_tokens"}
#: what the dashboard's template variables stand for when a query is sent as is
VARIABLES = {"$namespace": ".*", "$run": ".*"}

_METRIC = re.compile(r"(?<![\w:])(asyncgrpo_[a-z0-9_]+|vllm:[a-z0-9_]+)")


def available() -> bool:
    return Path(PROMETHEUS).exists() or shutil.which(PROMETHEUS) is not None


def supports_kubernetes_sd() -> bool:
    """Whether this Prometheus has Kubernetes service discovery. Debian's build (2.42+ds)
    leaves it out (its client-go is not packaged): its config loader refuses
    `kubernetes_sd_configs`. An upstream build, named by ASYNCGRPO_PROMETHEUS, has it."""
    import tempfile

    if not available():
        return False
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "p.yml"
        cfg.write_text(yaml.safe_dump({"scrape_configs": [
            {"job_name": "k", "kubernetes_sd_configs": [{"role": "pod"}]}]}))
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}",
                                 f"--storage.tsdb.path={d}/data",
                                 f"--web.listen-address=127.0.0.1:{free_port()}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:   # a refused config exits at once; an accepted one keeps serving
            out, _ = proc.communicate(timeout=5)
            return b"kubernetes_sd_configs not found" not in out and proc.returncode == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True


# ---------------------------------------------------------------- configuration


def static_job(name: str, targets: list[str], labels: dict[str, str] | None = None,
               metrics_path: str = "/metrics", honor_labels: bool = True) -> dict[str, Any]:
    """A job scraping fixed host:port targets; `labels` play the part of the pod
    discovery's target labels (namespace, run, pod, component)."""
    return {"job_name": name, "honor_labels": honor_labels, "metrics_path": metrics_path,
            "static_configs": [{"targets": list(targets), "labels": dict(labels or {})}]}


def kubernetes_job(api_server: str, token_file: Path, namespaces: list[str] | None = None,
                   name: str = "asyncgrpo") -> dict[str, Any]:
    """The chart's plain-Prometheus job (files/prometheus-scrape.yaml) as it is shipped, with
    the API server and credentials a Prometheus outside the cluster needs."""
    job = yaml.safe_load(SCRAPE_JOB.read_text())
    job["job_name"] = name
    sd: dict[str, Any] = {"role": "pod", "api_server": api_server,
                          "authorization": {"credentials_file": str(token_file)},
                          "tls_config": {"insecure_skip_verify": True}}
    if namespaces:
        sd["namespaces"] = {"names": list(namespaces)}
    job["kubernetes_sd_configs"] = [sd]
    return job


def http_sd_job(discovery_url: str, name: str = "asyncgrpo",
                refresh: str = "2s") -> dict[str, Any]:
    """The chart's plain-Prometheus job with its discovery served over HTTP SD by
    `asyncgrpo.testing.pod_discovery` (same targets and __meta_kubernetes_* labels), for a
    Prometheus built without Kubernetes discovery. The relabel rules are the chart's."""
    job = yaml.safe_load(SCRAPE_JOB.read_text())
    job["job_name"] = name
    del job["kubernetes_sd_configs"]
    job["http_sd_configs"] = [{"url": discovery_url, "refresh_interval": refresh}]
    return job


def rules_file(dest: Path, *, hold: str | None = None) -> Path:
    """The chart's rules file copied to `dest`; `hold` replaces every alert's `for:` (e.g.
    "0s" so a test sees an alert fire at once; the expressions stay the chart's)."""
    doc = yaml.safe_load(RULES.read_text())
    if hold is not None:
        for group in doc["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    rule["for"] = hold
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


# ---------------------------------------------------------------- the server


class PrometheusError(RuntimeError):
    pass


@dataclass
class PrometheusServer:
    """One Prometheus process on loopback; ended by its PID (its own session) on stop()."""

    workdir: Path
    scrape_configs: list[dict[str, Any]]
    rule_files: list[Path] = field(default_factory=list)
    scrape_interval: str = "1s"
    evaluation_interval: str = "1s"
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def config(self) -> dict[str, Any]:
        return {"global": {"scrape_interval": self.scrape_interval,
                           "scrape_timeout": self.scrape_interval,
                           "evaluation_interval": self.evaluation_interval},
                "rule_files": [str(p) for p in self.rule_files],
                "scrape_configs": self.scrape_configs}

    def start(self, timeout: float = 60.0) -> Self:
        if not available():
            raise FileNotFoundError(f"{PROMETHEUS} not found (Debian package prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.port = self.port or free_port()
        log = open(self.workdir / "prometheus.log", "ab")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (self.workdir / "prometheus.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}: "
                                      f"{self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.proc = None
        (self.workdir / "prometheus.pid").unlink(missing_ok=True)
        shutil.rmtree(self.workdir / "data", ignore_errors=True)

    def log(self) -> str:
        p = self.workdir / "prometheus.log"
        return p.read_text(errors="replace") if p.exists() else ""

    # ------------------------------------------------------------ HTTP API

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the `data` member, or PrometheusError with Prometheus's error."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            doc = json.loads(e.read() or b"{}")
        if doc.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector's samples ([] when the query has no data)."""
        data = self.api("query", query=promql, time=at)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [
            {"metric": {}, "value": data["result"]}]

    def query_range(self, promql: str, start: float, end: float, step: float
                    ) -> list[dict[str, Any]]:
        return self.api("query_range", query=promql, start=start, end=end, step=step)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def rules(self) -> list[dict[str, Any]]:
        return self.api("rules")["groups"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.alerts() if a["state"] == "firing"}

    def wait(self, predicate, timeout: float = 60.0, what: Any = "condition"):
        """Poll until `predicate()` is truthy; the deadline only bounds a hang. `what` (or
        what(), evaluated at the deadline) says what was awaited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        what = what() if callable(what) else what
        raise AssertionError(f"{what} not reached within {timeout}s; prometheus log:\n"
                             f"{self.log()[-2000:]}")

    def wait_for_targets_up(self, n: int | None = None, timeout: float = 60.0
                            ) -> list[dict[str, Any]]:
        """Wait until every active target (at least `n`) was scraped successfully."""
        def up():
            ts = self.targets()
            ok = ts and all(t["health"] == "up" for t in ts) and (n is None or len(ts) >= n)
            return ts if ok else None
        return self.wait(up, timeout, what=f"{n or 'all'} targets up "
                         f"({[(t['scrapeUrl'], t['health'], t['lastError']) for t in self.targets()]})")


# ---------------------------------------------------------------- dashboard and rules


@dataclass(frozen=True)
class Check:
    """One query of the chart: where it comes from, the PromQL sent, what feeds it."""

    source: str          # "panel: <title> [A]", "record: <name>", "alert: <name>"
    expr: str
    components: frozenset[str]


def metrics_of(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def components_of(expr: str) -> frozenset[str]:
    out = set()
    for name in metrics_of(expr):
        out |= {c for prefix, c in COMPONENTS.items() if name.startswith(prefix)}
    return frozenset(out)


def _fill(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def panel_queries(dashboard: Path = DASHBOARD) -> list[Check]:
    out = []
    for p in json.loads(dashboard.read_text())["panels"]:
        for t in p.get("targets", []):
            expr = _fill(t["expr"])
            out.append(Check(f"panel: {p['title']} [{t.get('refId', '')}]", expr,
                             components_of(expr)))
    return out


def rule_queries(rules: Path = RULES) -> list[Check]:
    """Recording rules: the recorded series must exist. Alerts: every metric the expression
    reads must have data (whether it fires is the forced-fault tests' business)."""
    out = []
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                out.append(Check(f"record: {rule['record']}", rule["record"],
                                 components_of(rule["expr"])))
            else:
                for name in sorted(metrics_of(rule["expr"])):
                    out.append(Check(f"alert: {rule['alert']} reads {name}",
                                     f'count({{__name__="{name}"}})', components_of(name)))
    return out


def missing_data(prom: PrometheusServer, running: set[str],
                 checks: list[Check] | None = None, at: float | None = None,
                 since: float | None = None) -> tuple[list[Check], list[Check]]:
    """(checks that return nothing although every component they read runs, checks left
    out because a component they read is not running). An empty first list is the pass.
    `at` evaluates them at a past moment (a run's pods are gone once it ended, and their
    series end with them); with `since`, over the range since..at, as a dashboard panel
    draws it (one scrape a loaded pod missed does not blank a gauge's whole panel)."""
    checks = panel_queries() + rule_queries() if checks is None else checks
    empty, skipped = [], []
    for c in checks:
        if not c.components <= running:
            skipped.append(c)
        elif since is not None:
            end = time.time() if at is None else at
            series = prom.query_range(c.expr, since, end, max(1.0, (end - since) / 200))
            if not any(_number({"value": v}) for s in series for v in s["values"]):
                empty.append(c)
        elif not any(_number(r) for r in prom.query(c.expr, at)):
            empty.append(c)
    return empty, skipped


def _number(sample: dict[str, Any]) -> bool:
    """A sample that says something: NaN (a rate of nothing over nothing, a quantile of an
    empty histogram) is no data."""
    value = sample.get("value", [0, "NaN"])[1]
    return value not in ("NaN", "+Inf", "-Inf")
