"""Operator benchmark: R runs with P-sandbox pools on a real kube-apiserver.

Starts the test control plane (etcd + kube-apiserver + kube-controller-manager, no kubelet),
installs the CRD, runs `asyncgrpo operator --all-namespaces` as a subprocess (the CLI the
image runs), applies R multi-turn runs (pool fixed at P warm sandboxes, no demand signal)
in one namespace, and measures:

- time until every run has all its children (16 objects) and P sandbox pods;
- API writes at steady state, from the API server's own request counters (every client,
  every resource the operator touches, events apart), per run reconcile;
- the operator process's resident memory before and after;
- the operator's own counters: writes, reconciles, reconcile seconds.

    .venv/bin/python bench/operator_bench.py --runs 50 --sandboxes 200

With `--cap-per-namespace N` (issue 28: 100 runs of 100 sandboxes against a cap of 512) the
operator runs with `--cap-sandboxes-per-namespace N`; the script waits for the namespace to
hold N sandbox pods, fails on any sample above N (every sandbox pod object counts,
terminating ones too), then restarts the operator and samples until the fresh process has
reconciled every run twice and `--restart-watch` seconds more: it must count the pods from
the API server, not from what it remembers.

On 2 shared cores the API server, etcd, the controller-manager and the operator compete;
the numbers are for that machine and say so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "operator"))

from asyncgrpo.controller.kube import path, request
from asyncgrpo.testing.cluster import TestCluster
from asyncgrpo.testing.s3 import S3Server

WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY"}
RESOURCES = {"asyncgrporuns", "pods", "deployments", "statefulsets", "services", "configmaps",
             "secrets", "networkpolicies", "serviceaccounts", "roles", "rolebindings"}
CHILDREN_PER_RUN = 16  # 3 SAs, Role, RoleBinding, ConfigMap, Secret, 4 NPs, 3 Services, 2 Deps, 1 STS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def apiserver_writes(api) -> int:
    text = request(api, "GET", "/metrics", raw=True).decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(kv.split("=", 1) for kv in
                          line[line.index("{") + 1:line.index("}")].replace('"', "").split(","))
            if labels.get("verb") in WRITE_VERBS and labels.get("resource") in RESOURCES:
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def operator_metrics(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("asyncgrpo_operator_api_writes_total"):
            out["writes"] = out.get("writes", 0) + float(line.rsplit(" ", 1)[1])
            out[f"writes {line[line.index('{') + 1:line.index('}')]}"] = \
                float(line.rsplit(" ", 1)[1])
        elif line.startswith("asyncgrpo_operator_reconcile_seconds_count"):
            out["reconciles"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("asyncgrpo_operator_reconcile_seconds_sum"):
            out["reconcile_seconds"] = float(line.rsplit(" ", 1)[1])
    return out


def count(api, kind: str, ns: str, selector: str | None = None) -> int:
    q = [("labelSelector", selector)] if selector else []
    return len(request(api, "GET", path(kind, ns), query=q)["items"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--sandboxes", type=int, default=200)
    p.add_argument("--resync", type=float, default=5.0, help="operator resync seconds")
    p.add_argument("--window", type=float, default=30.0, help="steady-state window seconds")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--cap-per-namespace", type=int, default=0,
                   help="the operator's per-namespace sandbox cap; 0: its default, unchecked")
    p.add_argument("--restart-watch", type=float, default=60.0,
                   help="with --cap-per-namespace: seconds watched after the restarted "
                   "operator reconciled every run twice")
    args = p.parse_args()

    import urllib3
    from kubernetes import config

    urllib3.disable_warnings()
    work = Path(tempfile.mkdtemp(prefix="operator-bench-"))
    cluster = TestCluster(work / "kube")
    cluster.start()
    op = None
    procs: list[subprocess.Popen] = []
    servers: list[S3Server] = []
    try:
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        crd = yaml.safe_load((REPO / "crds/asyncgrpo.dev_asyncgrporuns.yaml").read_text())
        request(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(2)
        ns = "bench"
        request(api, "POST", "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        cap_args = ["--cap-sandboxes-per-namespace", str(args.cap_per_namespace)] \
            if args.cap_per_namespace else []

        def start_operator(tag: str) -> subprocess.Popen:
            log = open(work / f"operator{tag}.log", "w")  # noqa: SIM115 (closed with it)
            proc = subprocess.Popen(
                [sys.executable, "-m", "asyncgrpo.cli", "operator", "--all-namespaces",
                 "--metrics-address", "127.0.0.1", "--metrics-port", str(port),
                 "--health-port", "0", "--resync-seconds", str(args.resync),
                 "--gateway-url", "http://127.0.0.1:1", *cap_args],
                env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while True:
                try:
                    operator_metrics(port)
                    return proc
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"operator did not start; see {work}") from None
                    time.sleep(0.5)

        op = start_operator("")
        time.sleep(3)
        rss_idle = rss_mb(op.pid)

        docs = list(yaml.safe_load_all((REPO / "examples/multi-turn-sandboxes.yaml").read_text()))
        base = next(d for d in docs if d["kind"] == "AsyncGRPORun")
        base["spec"]["sandboxes"].pop("runtimeClassName", None)
        base["spec"]["sandboxes"]["network"].pop("allowedEgressHosts", None)
        base["spec"]["sandboxes"].update({"minWarm": args.sandboxes, "max": args.sandboxes,
                                          "hardCap": max(args.sandboxes, 1)})
        # a real S3 server (moto) for the bucket check; credentials from a Secret
        s3 = S3Server.start(work / "s3.log")
        servers.append(s3)
        request(api, "POST", path("Secret", ns), {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3", "namespace": ns,
                                                         "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
            "stringData": {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}})
        base["spec"]["adapterStore"].update({"endpoint": s3.endpoint,
                                             "credentialsSecret": {"name": "s3"}})

        t0 = time.monotonic()
        for i in range(args.runs):
            run = copy.deepcopy(base)
            run["metadata"] = {"name": f"run-{i:03d}", "namespace": ns}
            request(api, "POST", path("AsyncGRPORun", ns), run)
        applied = time.monotonic() - t0

        want_pods = args.runs * args.sandboxes
        if args.cap_per_namespace:
            want_pods = min(want_pods, args.cap_per_namespace)
        most = 0
        selector = "app.kubernetes.io/component=sandbox"
        t_children = t_pods = None
        while time.monotonic() - t0 < args.timeout:
            if t_children is None:
                n = sum(count(api, k, ns, "app.kubernetes.io/managed-by=asyncgrpo-operator")
                        for k in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                  "NetworkPolicy", "Service", "Deployment", "StatefulSet"))
                n += count(api, "Secret", ns, "app.kubernetes.io/managed-by=asyncgrpo-operator")
                if n >= args.runs * CHILDREN_PER_RUN:
                    t_children = time.monotonic() - t0
            pods = count(api, "Pod", ns, selector)
            most = max(most, pods)
            if pods > want_pods:
                raise SystemExit(f"over-created: {pods} sandbox pods > {want_pods}")
            if pods == want_pods and t_pods is None:
                t_pods = time.monotonic() - t0
            if t_children is not None and t_pods is not None:
                break
            time.sleep(1.0)
        if t_children is None or t_pods is None:
            raise SystemExit(f"timed out: children at {t_children}, pods at {t_pods}")

        # settle, then measure a quiet window
        settle_end = time.monotonic() + max(3 * args.resync, 10)
        while time.monotonic() < settle_end:
            most = max(most, count(api, "Pod", ns, selector))
            time.sleep(0.5)
        w0, m0, c0 = apiserver_writes(api), operator_metrics(port), cpu_seconds(op.pid)
        time.sleep(args.window)
        w1, m1, c1 = apiserver_writes(api), operator_metrics(port), cpu_seconds(op.pid)
        reconciles = m1["reconciles"] - m0["reconciles"]
        pods_final = count(api, "Pod", ns, selector)
        rss_loaded = rss_mb(op.pid)
        restart = None
        if args.cap_per_namespace:
            # a fresh operator process: it knows the pods only from its own full list
            op.terminate()
            op.wait(timeout=30)
            t_restart = time.monotonic()
            op = start_operator("-restarted")
            most_after = 0
            # until the fresh process reconciled every run twice (its full list of every
            # child first: minutes on a loaded machine), then `--restart-watch` more
            t_reconciled = None
            while True:
                most_after = max(most_after, count(api, "Pod", ns, selector))
                if t_reconciled is None and \
                        operator_metrics(port).get("reconciles", 0) >= 2 * args.runs:
                    t_reconciled = time.monotonic()
                if t_reconciled is not None and \
                        time.monotonic() - t_reconciled >= args.restart_watch:
                    break
                if time.monotonic() - t_restart > args.timeout:
                    raise SystemExit("the restarted operator did not reconcile every run")
                time.sleep(0.5)
            capped = sum(1 for i in range(args.runs) if any(
                c.get("reason") == "NamespaceSandboxCap" for c in
                (request(api, "GET", path("AsyncGRPORun", ns, f"run-{i:03d}")).get("status")
                 or {}).get("conditions") or []))
            restart = {"every_run_reconciled_twice_after_s": round(t_reconciled - t_restart, 1),
                       "watch_seconds": args.restart_watch,
                       "sandbox_pods_max_after_restart": most_after,
                       "runs_reporting_NamespaceSandboxCap": capped}
        result = {
            "runs": args.runs,
            "sandboxes_per_run": args.sandboxes,
            "resync_seconds": args.resync,
            "apply_seconds": round(applied, 1),
            "all_children_seconds": round(t_children, 1),
            "all_sandbox_pods_seconds": round(t_pods, 1),
            "sandbox_pods": pods_final,
            "cap_per_namespace": args.cap_per_namespace or None,
            "sandbox_pods_max_seen": most,
            "restart": restart,
            "steady_window_seconds": args.window,
            "steady_reconciles": int(reconciles),
            "steady_api_writes_all_clients": w1 - w0,
            "steady_operator_writes": m1.get("writes", 0) - m0.get("writes", 0),
            "steady_operator_writes_by_kind": {
                k.removeprefix("writes "): m1[k] - m0.get(k, 0) for k in m1
                if k.startswith("writes ") and m1[k] - m0.get(k, 0)},
            "writes_per_reconcile": round((w1 - w0) / reconciles, 4) if reconciles else None,
            "reconcile_ms_mean": round(1000 * (m1["reconcile_seconds"] - m0["reconcile_seconds"])
                                       / reconciles, 2) if reconciles else None,
            "operator_cpu_percent_steady": round(100 * (c1 - c0) / args.window, 1),
            "operator_rss_mb_idle": round(rss_idle, 1),
            "operator_rss_mb_loaded": round(rss_loaded, 1),
            "cpus": os.cpu_count(),
        }
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        if restart and restart["sandbox_pods_max_after_restart"] > args.cap_per_namespace:
            print(f"over the cap after the restart: {restart}", file=sys.stderr)
            return 1
        return 0
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                op.kill()
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        for server in servers:
            server.stop()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
