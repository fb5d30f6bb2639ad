"""Noisy tenants: do runs with silent S3 endpoints slow down everybody else's status?

Starts the test control plane (no kubelet: this script plays it for the healthy runs), a real
S3 server (moto), a loopback "trainer metrics" server whose step counter advances once a
second for every healthy run, and `asyncgrpo operator --all-namespaces` as a subprocess.

Phase A: 5 healthy runs (one namespace each), brought to Running. Phase B: 20 more runs in
another namespace whose endpoint accepts connections and never answers, each with a
credentials Secret. Phase C (issue 28), beside those: 16 runs whose trainer's metrics
endpoint answers one byte every 0.5 s for ever, 16 sandbox runs whose gateway's
`/v1/demand` does the same, and 16 sandbox runs whose 20 `allowedEgressHosts` each never
resolve (the operator's DNS server for tenant names is a loopback server that reads every
query and answers none; `--dns-nameservers`). All hostile servers are on loopback. In each
phase the script samples, every 0.5 s over a window, how far each healthy run's
`status.step` lags behind the step its trainer serves (the status age, in seconds), and the
operator's thread count; in phases A and C it creates one more run in a new namespace and
times its first status (`status.phase` set).

Bucket setup runs as a Job in each run's namespace (controller.bucketjob): the operator never
talks to an endpoint, so a silent one costs it nothing but its Jobs' failures and re-runs.
The script plays the kubelet for those Jobs too (asyncgrpo.testing.jobs: each pod is a local
`asyncgrpo bucket setup` process, which the silent endpoint holds for its 3 s timeout), so
the machine carries their load as a node would. (Before, the operator's own bucket calls ran
inline or on bucket worker threads; docs/benchmarks/noisy-tenants.md keeps those figures.)

    .venv/bin/python bench/noisy_tenants.py --resync 5 --window 40

Goal (issue 9): the healthy runs' status age stays below two resync intervals with the 20
silent runs present; (issue 28) also with the 48 hostile runs, and the new run gets its first
status within two resync intervals. Printed as a table, A and B side by side; --json writes the numbers.
On 2 shared cores the API server, etcd, the controller-manager and the operator compete.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO))

from asyncgrpo.controller.kube import path, request
from asyncgrpo.testing.cluster import TestCluster
from asyncgrpo.testing.kube import Api, component, kubelet
from asyncgrpo.testing.net import free_port
from asyncgrpo.testing.s3 import S3Server

HEALTHY, SILENT = 5, 20
#: dripping trainers, dripping gateways, runs whose egress hosts never resolve (issue 28)
DRIP_TRAINERS = DRIP_GATEWAYS = STALLED_DNS = 16
STALLED_HOSTS = 20


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class Trainers:
    """Serves /tr/<ns>/<name>/metrics with asyncgrpo_trainer_step = seconds since start, and
    /gw/<ns>/<name>/v1/demand with an idle pool; for a namespace in `drips`, either answers
    `200 OK` and then one byte every 0.5 s for ever (a hostile tenant's trainer or gateway)."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.drips: set[str] = set()     # "/tr/<ns>/" or "/gw/<ns>/" prefixes
        self.dripping = 0                # connections being dripped to now
        self.closed = False
        trainers = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def drip(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                trainers.dripping += 1
                try:
                    while not trainers.closed:
                        self.wfile.write(b"#")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    pass
                finally:
                    trainers.dripping -= 1

            def do_GET(self):
                if any(self.path.startswith(d) for d in trainers.drips):
                    return self.drip()
                if self.path.startswith("/gw/"):
                    body = b'{"busy": 0, "idle": 1, "waiting": 0, "starting": 0, "members": {}}'
                    ctype = "application/json"
                else:
                    body = f"asyncgrpo_trainer_step {trainers.step()}\n".encode()
                    ctype = "text/plain; version=0.0.4"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def step(self) -> int:
        return int(time.monotonic() - self.t0)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def url(self) -> str:
        return self.base + "/tr/{namespace}/{name}/metrics"


class Silent:
    """Accepts connections, reads, never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn):
        with conn:
            while conn.recv(65536):
                pass

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reconcile_counters(port: int) -> tuple[float, float]:
    """(reconciles, seconds spent in them) from the operator's own metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("asyncgrpo_operator_reconcile_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith("asyncgrpo_operator_reconcile_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
    return count, total


def sample(api: Api, trainers: Trainers, healthy: list[tuple[str, str]], op_pid: int,
           window: float, metrics_port: int) -> dict[str, float]:
    """Status ages of the healthy runs over `window`, and what the operator did meanwhile:
    reconciles per second (all runs), their mean time, its CPU, the machine's load."""
    ages, threads = [], []
    c0, (n0, s0), t0 = cpu_seconds(op_pid), reconcile_counters(metrics_port), time.monotonic()
    end = time.monotonic() + window
    while time.monotonic() < end:
        served = trainers.step()
        for ns, name in healthy:
            step = (api.run(ns, name).get("status") or {}).get("step", 0)
            ages.append(max(0, served - step))
        threads.append(threads_of(op_pid))
        time.sleep(0.5)
    c1, (n1, s1), t1 = cpu_seconds(op_pid), reconcile_counters(metrics_port), time.monotonic()
    ages.sort()
    return {"status_age_p50_s": statistics.median(ages),
            "status_age_p95_s": ages[int(0.95 * (len(ages) - 1))],
            "status_age_max_s": ages[-1], "operator_threads_max": max(threads),
            "samples": len(ages),
            "reconciles_per_s": round((n1 - n0) / (t1 - t0), 1),
            "reconcile_ms_mean": round(1000 * (s1 - s0) / (n1 - n0), 1) if n1 > n0 else None,
            "operator_cpu_percent": round(100 * (c1 - c0) / (t1 - t0), 1),
            "load_average_1m": round(os.getloadavg()[0], 1)}


class HostileKubelet:
    """Plays the kubelet for the hostile runs' namespaces: every pod not yet Running is set
    Running and Ready, every 2 s, so their trainers and gateways are up and scraped."""

    COMPONENTS = ("vllm", "trainer", "gateway", "sandbox")

    def __init__(self, api: Api, namespaces: list[str]):
        self.api, self.namespaces = api, namespaces
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        from asyncgrpo.testing.kube import pod_status

        while not self._stop.wait(2.0):
            for ns in self.namespaces:
                for c in self.COMPONENTS:
                    try:
                        pods = self.api.list("Pod", ns, f"app.kubernetes.io/component={c}")
                        for pod in pods:
                            if (pod.get("status") or {}).get("phase") == "Running":
                                continue
                            body = pod_status()
                            for cs in body["status"].get("containerStatuses", []):
                                cs["name"] = pod["spec"]["containers"][0]["name"]
                            self.api.merge_patch("Pod", ns, pod["metadata"]["name"], body,
                                                 "/status")
                    except Exception:  # noqa: BLE001, S112 (a pod gone meanwhile)
                        continue

    def stop(self):
        self._stop.set()
        self._thread.join()


def first_status(api: Api, ns: str, name: str, timeout: float = 120.0) -> float | None:
    """Seconds from now (the run just created) until it has a `status.phase`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (api.run(ns, name).get("status") or {}).get("phase"):
            return round(time.monotonic() - t0, 1)
        time.sleep(0.25)
    return None


def degraded_reasons(api: Api, ns: str, names: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        reason = api.condition(ns, name, "Degraded").get("reason") or "none"
        out[reason] = out.get(reason, 0) + 1
    return out


def phase_pair(client, api: Api, trainers: Trainers, silent: Silent, s3: str,
               tag: str, args, work: Path, kubeconfig: Path, dns) -> dict:
    """Healthy runs alone, then beside the silent ones, then beside the hostile ones too,
    under one operator."""
    healthy = [(f"{tag}-team-{i}", "healthy") for i in range(HEALTHY)]
    noisy_ns = f"{tag}-noisy"
    hostile_ns = {"drip_trainers": f"{tag}-driptr", "drip_gateways": f"{tag}-dripgw",
                  "stalled_dns": f"{tag}-dns"}
    late_ns = [f"{tag}-late-a", f"{tag}-late-c"]
    metrics_port = free_port()
    argv = [sys.executable, "-m", "asyncgrpo.cli", "operator", "--metrics-address",
            "127.0.0.1", "--metrics-port", str(metrics_port),
            "--health-port", "0", "--resync-seconds", str(args.resync),
            "--gateway-url", trainers.base + "/gw/{namespace}/{name}",
            "--trainer-metrics-url", trainers.url, "--dns-nameservers", dns.server]
    for ns in [ns for ns, _ in healthy] + [noisy_ns, *hostile_ns.values(), *late_ns]:
        argv += ["--namespace", ns]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig),
           "PYTHONPATH": str(REPO / "operator")}
    log = open(work / f"operator-{tag}.log", "w")  # noqa: SIM115 (closed with the process)
    op = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    hostile_kubelet = None
    try:
        docs = list(yaml.safe_load_all((REPO / "examples/lora-math.yaml").read_text()))
        base = next(d for d in docs if d["kind"] == "AsyncGRPORun")
        base["spec"]["trainer"]["totalSteps"] = 1_000_000
        docs = list(yaml.safe_load_all((REPO / "examples/multi-turn-sandboxes.yaml")
                                       .read_text()))
        pool_base = next(d for d in docs if d["kind"] == "AsyncGRPORun")
        pool_base["spec"]["trainer"]["totalSteps"] = 1_000_000
        sb = pool_base["spec"]["sandboxes"]
        sb.pop("runtimeClassName", None)
        sb["network"].pop("allowedEgressHosts", None)
        sb.update({"minWarm": 1, "max": 1, "hardCap": 1})

        def add_run(ns: str, name: str, endpoint: str, template: dict = base,
                    hosts: list[str] | None = None) -> None:
            run = copy.deepcopy(template)
            run["metadata"] = {"name": name, "namespace": ns}
            run["spec"]["adapterStore"].update({"endpoint": endpoint, "bucket": "noisy",
                                                "credentialsSecret": {"name": "s3"}})
            if hosts:
                run["spec"]["sandboxes"]["network"]["allowedEgressHosts"] = hosts
            request(client, "POST", path("AsyncGRPORun", ns), run)

        def namespace(ns: str) -> None:
            request(client, "POST", "/api/v1/namespaces",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            request(client, "POST", path("Secret", ns), {
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3", "namespace": ns,
                                                             "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
                "stringData": {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}})


        def late_run(ns: str) -> float | None:
            namespace(ns)
            add_run(ns, "late", s3)
            return first_status(api, ns, "late")

        for ns, name in healthy:
            namespace(ns)
            add_run(ns, name, s3)
        deadline = time.monotonic() + 300
        while True:   # play the kubelet until every healthy run is Running
            phases = []
            for ns, name in healthy:
                kubelet(api, ns, component(name, "vllm"))
                kubelet(api, ns, component(name, "trainer"))
                phases.append((api.run(ns, name).get("status") or {}).get("phase"))
            if all(ph == "Running" for ph in phases):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"healthy runs not Running: {phases}; see {work}")
            time.sleep(1)
        time.sleep(2 * args.resync)
        alone = sample(api, trainers, healthy, op.pid, args.window, metrics_port)
        alone["new_run_first_status_s"] = late_run(late_ns[0])

        namespace(noisy_ns)
        for i in range(SILENT):
            add_run(noisy_ns, f"silent-{i:02d}", silent.endpoint)
        # past the burst of creating their children: the steady state with noisy neighbours
        time.sleep(max(30.0, 4 * args.resync))
        noisy = sample(api, trainers, healthy, op.pid, args.window, metrics_port)
        reasons = {(api.condition(noisy_ns, f"silent-{i:02d}", "BucketReady") or {})
                   .get("reason") or "none" for i in range(SILENT)}
        result = {"alone": alone, "with_silent": noisy, "silent_bucket_reasons": sorted(reasons)}
        if args.no_hostile:
            return result

        # phase C: the hostile tenants of issue 28, beside the silent ones
        trainers.drips |= {f"/tr/{hostile_ns['drip_trainers']}/",
                           f"/gw/{hostile_ns['drip_gateways']}/"}
        for ns in hostile_ns.values():
            namespace(ns)
        hostile_kubelet = HostileKubelet(api, list(hostile_ns.values()))
        names = {"drip_trainers": [f"tr-{i:02d}" for i in range(DRIP_TRAINERS)],
                 "drip_gateways": [f"gw-{i:02d}" for i in range(DRIP_GATEWAYS)],
                 "stalled_dns": [f"dns-{i:02d}" for i in range(STALLED_DNS)]}
        t_hostile = time.monotonic()
        for n in names["drip_trainers"]:
            add_run(hostile_ns["drip_trainers"], n, s3)
        for n in names["drip_gateways"]:
            add_run(hostile_ns["drip_gateways"], n, s3, pool_base)
        for j, n in enumerate(names["stalled_dns"]):
            add_run(hostile_ns["stalled_dns"], n, s3, pool_base,
                    hosts=[f"stall-{j}-{i}.test" for i in range(STALLED_HOSTS)])
        want = {"drip_trainers": "EndpointSlow", "drip_gateways": "EndpointSlow",
                "stalled_dns": "EgressHostsUnresolved"}
        deadline = time.monotonic() + args.hostile_timeout
        while time.monotonic() < deadline:   # every hostile run reached by its hostile part
            got = {k: degraded_reasons(api, hostile_ns[k], names[k]).get(want[k], 0)
                   for k in names}
            if all(got[k] == len(names[k]) for k in names):
                break
            time.sleep(2)
        hostile_ready_s = round(time.monotonic() - t_hostile, 1)
        time.sleep(2 * args.resync)
        hostile = sample(api, trainers, healthy, op.pid, args.window, metrics_port)
        hostile["new_run_first_status_s"] = late_run(late_ns[1])
        hostile["dripping_connections_end"] = trainers.dripping
        result.update({
            "with_hostile": hostile,
            "hostile_reached_seconds": hostile_ready_s,
            "hostile_degraded_reasons": {k: degraded_reasons(api, hostile_ns[k], names[k])
                                         for k in names},
            "dns_queries": sum(dns.queries.values()),
        })
        return result
    finally:
        if hostile_kubelet is not None:
            hostile_kubelet.stop()
        op.terminate()
        try:
            op.wait(timeout=20)
        except subprocess.TimeoutExpired:
            op.kill()
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resync", type=float, default=5.0, help="operator resync seconds")
    p.add_argument("--window", type=float, default=40.0, help="sampling window per phase")
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--no-hostile", action="store_true", help="skip phase C (issue 28)")
    p.add_argument("--hostile-timeout", type=float, default=300.0,
                   help="longest wait for every hostile run to show its condition")
    args = p.parse_args()

    import urllib3
    from kubernetes import config

    urllib3.disable_warnings()
    work = Path(tempfile.mkdtemp(prefix="noisy-tenants-"))
    cluster = TestCluster(work / "kube")
    cluster.start()
    s3 = None
    from tests.operator.peers import Dns

    trainers, silent, dns = Trainers(), Silent(), Dns()
    try:
        client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api = Api(client)
        crd = yaml.safe_load((REPO / "crds/asyncgrpo.dev_asyncgrporuns.yaml").read_text())
        request(client, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(2)
        s3 = S3Server.start(work / "s3.log")
        from asyncgrpo.testing.jobs import BucketJobKubelet

        jobs = BucketJobKubelet(client).start()
        try:
            results = {"jobs": phase_pair(client, api, trainers, silent, s3.endpoint, "b", args,
                                          work, cluster.kubeconfig, dns)}
        finally:
            jobs.stop()
        r = results["jobs"]
        result = {"resync_seconds": args.resync, "window_seconds": args.window,
                  "healthy_runs": HEALTHY, "silent_runs": SILENT,
                  "drip_trainers": DRIP_TRAINERS, "drip_gateways": DRIP_GATEWAYS,
                  "stalled_dns_runs": STALLED_DNS, "stalled_hosts_per_run": STALLED_HOSTS,
                  "modes": results, "bucket_jobs_run": len(jobs.ran), "cpus": os.cpu_count(),
                  "load_average": os.getloadavg()}
        cols = [("alone", "alone"), ("with_silent", "+20 silent")]
        if "with_hostile" in r:
            cols.append(("with_hostile", "+20 silent +48 hostile"))
        print(f"{'':26}" + "".join(f"{label:>26}" for _, label in cols))
        for key in ("status_age_p50_s", "status_age_p95_s", "status_age_max_s",
                    "operator_threads_max", "new_run_first_status_s", "reconciles_per_s",
                    "reconcile_ms_mean", "operator_cpu_percent", "load_average_1m"):
            print(f"{key:26}" + "".join(f"{r[c].get(key, '-')!s:>26}" for c, _ in cols))
        print(f"goal: status age and a new run's first status below 2 x resync = "
              f"{2 * args.resync:.0f} s")
        print(f"silent runs' BucketReady reasons {r['silent_bucket_reasons']}")
        if "with_hostile" in r:
            print(f"hostile runs' Degraded reasons {r['hostile_degraded_reasons']} "
                  f"(all reached in {r['hostile_reached_seconds']} s); DNS queries "
                  f"{r['dns_queries']}; dripping connections at the end "
                  f"{r['with_hostile']['dripping_connections_end']}")
        print(f"bucket Job pods run: {len(jobs.ran)}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if s3 is not None:
            s3.stop()
        silent.sock.close()
        trainers.closed = True
        trainers.httpd.shutdown()
        dns.close()
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
