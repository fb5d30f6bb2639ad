"""Noisy tenants: do runs with silent S3 endpoints slow down everybody else's status?

Starts the test control plane (no kubelet: this script plays it for the healthy runs), a real
S3 server (moto), a loopback "trainer metrics" server whose step counter advances once a
second for every healthy run, and `asyncgrpo operator --all-namespaces` as a subprocess.

Phase A: 5 healthy runs (one namespace each), brought to Running. Phase B: 20 more runs in
another namespace whose endpoint accepts connections and never answers, each with a
credentials Secret. In each phase the script samples, every 0.5 s over a window, how far each
healthy run's `status.step` lags behind the step its trainer serves (the status age, in
seconds), and the operator's thread count.

Bucket setup runs as a Job in each run's namespace (controller.bucketjob): the operator never
talks to an endpoint, so a silent one costs it nothing but its Jobs' failures and re-runs.
The script plays the kubelet for those Jobs too (asyncgrpo.testing.jobs: each pod is a local
`asyncgrpo bucket setup` process, which the silent endpoint holds for its 3 s timeout), so
the machine carries their load as a node would. (Before, the operator's own bucket calls ran
inline or on bucket worker threads; docs/benchmarks/noisy-tenants.md keeps those figures.)

    .venv/bin/python bench/noisy_tenants.py --resync 5 --window 40

Goal (issue 9): the healthy runs' status age stays below two resync intervals with the 20
silent runs present. Printed as a table, A and B side by side; --json writes the numbers.
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

from asyncgrpo.controller.kube import path, request
from asyncgrpo.testing.cluster import TestCluster
from asyncgrpo.testing.kube import Api, component, kubelet
from asyncgrpo.testing.net import free_port

HEALTHY, SILENT = 5, 20


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class Trainers:
    """Serves /tr/<ns>/<name>/metrics with asyncgrpo_trainer_step = seconds since start."""

    def __init__(self):
        self.t0 = time.monotonic()
        trainers = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = f"asyncgrpo_trainer_step {trainers.step()}\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def step(self) -> int:
        return int(time.monotonic() - self.t0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}" + \
            "/tr/{namespace}/{name}/metrics"


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


def sample(api: Api, trainers: Trainers, healthy: list[tuple[str, str]], op_pid: int,
           window: float) -> dict[str, float]:
    ages, threads = [], []
    end = time.monotonic() + window
    while time.monotonic() < end:
        served = trainers.step()
        for ns, name in healthy:
            step = (api.run(ns, name).get("status") or {}).get("step", 0)
            ages.append(max(0, served - step))
        threads.append(threads_of(op_pid))
        time.sleep(0.5)
    ages.sort()
    return {"status_age_p50_s": statistics.median(ages),
            "status_age_p95_s": ages[int(0.95 * (len(ages) - 1))],
            "status_age_max_s": ages[-1], "operator_threads_max": max(threads),
            "samples": len(ages)}


def phase_pair(client, api: Api, trainers: Trainers, silent: Silent, s3_port: int,
               tag: str, args, work: Path, kubeconfig: Path) -> dict:
    """Healthy runs alone, then beside the silent ones, under one operator."""
    healthy = [(f"{tag}-team-{i}", "healthy") for i in range(HEALTHY)]
    noisy_ns = f"{tag}-noisy"
    argv = [sys.executable, "-m", "asyncgrpo.cli", "operator", "--metrics-port", "0",
            "--health-port", "0", "--resync-seconds", str(args.resync),
            "--gateway-url", "http://127.0.0.1:1", "--trainer-metrics-url", trainers.url]
    for ns, _ in healthy:
        argv += ["--namespace", ns]
    argv += ["--namespace", noisy_ns]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig),
           "PYTHONPATH": str(REPO / "operator")}
    log = open(work / f"operator-{tag}.log", "w")  # noqa: SIM115 (closed with the process)
    op = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        docs = list(yaml.safe_load_all((REPO / "examples/lora-math.yaml").read_text()))
        base = next(d for d in docs if d["kind"] == "AsyncGRPORun")
        base["spec"]["trainer"]["totalSteps"] = 1_000_000

        def add_run(ns: str, name: str, endpoint: str) -> None:
            run = copy.deepcopy(base)
            run["metadata"] = {"name": name, "namespace": ns}
            run["spec"]["adapterStore"].update({"endpoint": endpoint, "bucket": "noisy",
                                                "credentialsSecret": {"name": "s3"}})
            request(client, "POST", path("AsyncGRPORun", ns), run)

        def namespace(ns: str) -> None:
            request(client, "POST", "/api/v1/namespaces",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            request(client, "POST", path("Secret", ns), {
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3", "namespace": ns,
                                                             "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
                "stringData": {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}})

        for ns, name in healthy:
            namespace(ns)
            add_run(ns, name, f"http://127.0.0.1:{s3_port}")
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
        alone = sample(api, trainers, healthy, op.pid, args.window)

        namespace(noisy_ns)
        for i in range(SILENT):
            add_run(noisy_ns, f"silent-{i:02d}", silent.endpoint)
        # past the burst of creating their children: the steady state with noisy neighbours
        time.sleep(max(30.0, 4 * args.resync))
        noisy = sample(api, trainers, healthy, op.pid, args.window)
        reasons = {(api.condition(noisy_ns, f"silent-{i:02d}", "BucketReady") or {})
                   .get("reason") or "none" for i in range(SILENT)}
        return {"alone": alone, "with_silent": noisy, "silent_bucket_reasons": sorted(reasons)}
    finally:
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
    args = p.parse_args()

    import urllib3
    from kubernetes import config

    urllib3.disable_warnings()
    work = Path(tempfile.mkdtemp(prefix="noisy-tenants-"))
    cluster = TestCluster(work / "kube")
    cluster.start()
    s3 = None
    trainers, silent = Trainers(), Silent()
    try:
        client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api = Api(client)
        crd = yaml.safe_load((REPO / "crds/asyncgrpo.dev_asyncgrporuns.yaml").read_text())
        request(client, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(2)
        s3_port = free_port()
        s3 = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p",
             str(s3_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from asyncgrpo.testing.jobs import BucketJobKubelet

        jobs = BucketJobKubelet(client).start()
        try:
            results = {"jobs": phase_pair(client, api, trainers, silent, s3_port, "b", args,
                                          work, cluster.kubeconfig)}
        finally:
            jobs.stop()
        modes = list(results)
        result = {"resync_seconds": args.resync, "window_seconds": args.window,
                  "healthy_runs": HEALTHY, "silent_runs": SILENT, "modes": results,
                  "bucket_jobs_run": len(jobs.ran), "cpus": os.cpu_count()}
        head = "".join(f"{m + ' alone':>18}{m + ' +20 silent':>22}" for m in modes)
        print(f"{'':24}{head}")
        for key in ("status_age_p50_s", "status_age_p95_s", "status_age_max_s",
                    "operator_threads_max"):
            row = "".join(f"{results[m]['alone'][key]:>18}{results[m]['with_silent'][key]:>22}"
                          for m in modes)
            print(f"{key:24}{row}")
        print(f"goal: status age below 2 x resync = {2 * args.resync:.0f} s")
        for m in modes:
            print(f"{m}: silent runs' BucketReady reasons {results[m]['silent_bucket_reasons']}")
        print(f"bucket Job pods run: {len(jobs.ran)}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if s3 is not None:
            s3.terminate()
        silent.sock.close()
        trainers.httpd.shutdown()
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
