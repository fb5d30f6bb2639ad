"""Failover benchmark: two elected operator replicas, the leader stopped N times.

Starts the test control plane (etcd + kube-apiserver + kube-controller-manager, no kubelet),
a real S3 server, and two `asyncgrpo operator --leader-election` processes (as two pods of
the chart's Deployment). One multi-turn run holds a sandbox pool. Each round stops the
leader, SIGTERM (it releases the Lease) or SIGKILL (the Lease must expire), grows the pool
by 2 at the same instant, and measures:

- lease handover: from the stop until the Lease names the standby;
- takeover: from the stop until the pool has its new size (the new leader acted);
- pods over the desired size (the most sampled every 0.1 s across the round) and under it
  once the round settled.
The stopped replica is started again as the next standby. Rounds alternate SIGTERM and
SIGKILL.

    .venv/bin/python bench/failover_bench.py --rounds 20

The bound printed is lease_duration + retry_period + 10 s (the new leader's kopf start and
one reconcile on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "operator"))

from asyncgrpo.controller.kube import path, request
from asyncgrpo.testing.cluster import TestCluster
from asyncgrpo.testing.net import free_port
from asyncgrpo.testing.s3 import S3Server
from asyncgrpo.testing.waiting import wait_for

NS = "bench"
RUN = "failover"
SELECTOR = f"asyncgrpo.dev/run={RUN},app.kubernetes.io/component=sandbox"


class Replica:
    def __init__(self, name: str, kubeconfig: Path, args: argparse.Namespace, log: Path):
        self.name = name
        self.port = free_port()
        self.log = open(log, "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgrpo.cli", "operator", "--namespace", NS,
             "--leader-election", "bench", "--leader-election-namespace", NS,
             "--lease-duration", str(args.lease_duration),
             "--renew-deadline", str(args.renew_deadline),
             "--retry-period", str(args.retry_period),
             "--metrics-address", "127.0.0.1", "--metrics-port", str(self.port),
             "--health-port", "0", "--resync-seconds", str(args.resync),
             "--gateway-url", "http://127.0.0.1:1/{namespace}/{name}"],
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": name},
            stdout=self.log, stderr=subprocess.STDOUT)

    def up(self) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2).read()
            return True
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)
        self.log.close()


def sample(pods, most: list[int], done: threading.Event) -> None:
    """The most pods seen, every 0.1 s, until `done`."""
    while not done.is_set():
        most[0] = max(most[0], pods())
        done.wait(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="rounds per stop mode")
    p.add_argument("--lease-duration", type=int, default=15)
    p.add_argument("--renew-deadline", type=float, default=10.0)
    p.add_argument("--retry-period", type=float, default=2.0)
    p.add_argument("--resync", type=float, default=2.0, help="operator resync seconds")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()

    import urllib3
    from kubernetes import config

    urllib3.disable_warnings()
    work = Path(tempfile.mkdtemp(prefix="failover-bench-"))
    cluster = TestCluster(work / "kube")
    cluster.start()
    replicas: dict[str, Replica] = {}
    s3 = None
    try:
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        crd = yaml.safe_load((REPO / "crds/asyncgrpo.dev_asyncgrporuns.yaml").read_text())
        request(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(2)
        request(api, "POST", "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        s3 = S3Server.start(work / "s3.log")
        request(api, "POST", path("Secret", NS), {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3", "namespace": NS,
                                                         "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
            "stringData": {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}})

        def holder() -> str:
            try:
                lease = request(api, "GET",
                                f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/bench")
            except Exception:  # noqa: BLE001 (not created yet)
                return ""
            return ((lease.get("spec") or {}).get("holderIdentity") or "").split("_")[0]

        def pods() -> int:
            return len(request(api, "GET", path("Pod", NS),
                               query=[("labelSelector", SELECTOR)])["items"])

        log = work / "operators.log"
        replicas["a"] = Replica("a", cluster.kubeconfig, args, log)
        wait_for(lambda: holder() == "a", 60, 0.05, "a leads")
        replicas["b"] = Replica("b", cluster.kubeconfig, args, log)
        wait_for(replicas["b"].up, 60, 0.05, "b up")

        docs = list(yaml.safe_load_all((REPO / "examples/multi-turn-sandboxes.yaml").read_text()))
        run = next(d for d in docs if d["kind"] == "AsyncGRPORun")
        run["metadata"] = {"name": RUN, "namespace": NS}
        sb = run["spec"]["sandboxes"]
        sb.pop("runtimeClassName", None)
        sb["network"].pop("allowedEgressHosts", None)
        desired = 3
        sb.update({"minWarm": desired, "max": 1000, "hardCap": 1000})
        run["spec"]["adapterStore"].update({"endpoint": s3.endpoint,
                                            "credentialsSecret": {"name": "s3"}})
        request(api, "POST", path("AsyncGRPORun", NS), run)
        wait_for(lambda: pods() == desired, 120, 0.05, "the first pool")

        bound = args.lease_duration + args.retry_period + 10
        rounds: list[dict] = []
        for i in range(2 * args.rounds):
            graceful = i % 2 == 0
            leader = holder()
            standby = "b" if leader == "a" else "a"
            most, done = [pods()], threading.Event()
            sampler = threading.Thread(target=sample, args=(pods, most, done), daemon=True)
            sampler.start()
            t0 = time.monotonic()
            replicas[leader].stop(signal.SIGTERM if graceful else signal.SIGKILL)
            desired += 2
            request(api, "PATCH", path("AsyncGRPORun", NS, RUN),
                    {"spec": {"sandboxes": {"minWarm": desired}}},
                    content_type="application/merge-patch+json")
            wait_for(lambda s=standby: holder() == s, 120, 0.05, "lease handover")
            handover = time.monotonic() - t0
            wait_for(lambda d=desired: pods() >= d, 120, 0.05, "the new pool")
            takeover = time.monotonic() - t0
            time.sleep(3 * args.resync)           # settle: would anything more appear?
            done.set()
            sampler.join(5)
            final = pods()
            rounds.append({"mode": "SIGTERM" if graceful else "SIGKILL",
                           "handover_s": round(handover, 2), "takeover_s": round(takeover, 2),
                           "over": max(0, most[0] - desired), "under": max(0, desired - final)})
            print(json.dumps(rounds[-1]), flush=True)
            replicas[leader] = Replica(leader, cluster.kubeconfig, args, log)
            wait_for(replicas[leader].up, 60, 0.05, f"{leader} back as standby")
            time.sleep(args.retry_period)

        print(f"\nlease {args.lease_duration}s / renew {args.renew_deadline}s / retry "
              f"{args.retry_period}s, resync {args.resync}s, bound {bound:.0f}s, "
              f"{os.cpu_count()} CPUs")
        print(f"{'mode':8} {'rounds':>6} {'handover p50':>12} {'max':>6} {'takeover p50':>12} "
              f"{'max':>6} {'in bound':>8} {'over':>5} {'under':>5}")
        summary = {}
        for mode in ("SIGTERM", "SIGKILL"):
            rs = [r for r in rounds if r["mode"] == mode]
            h = [r["handover_s"] for r in rs]
            t = [r["takeover_s"] for r in rs]
            row = {"rounds": len(rs), "handover_p50": statistics.median(h),
                   "handover_max": max(h), "takeover_p50": statistics.median(t),
                   "takeover_max": max(t), "within_bound": sum(x <= bound for x in t),
                   "over_total": sum(r["over"] for r in rs),
                   "under_total": sum(r["under"] for r in rs)}
            summary[mode] = row
            print(f"{mode:8} {row['rounds']:>6} {row['handover_p50']:>11.1f}s "
                  f"{row['handover_max']:>5.1f}s {row['takeover_p50']:>11.1f}s "
                  f"{row['takeover_max']:>5.1f}s {row['within_bound']:>5}/{len(rs):<2} "
                  f"{row['over_total']:>5} {row['under_total']:>5}")
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                             "bound_s": bound, "summary": summary,
                                             "rounds": rounds}, indent=2) + "\n")
        return 0
    finally:
        for r in replicas.values():
            r.stop()
        if s3 is not None:
            s3.stop()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
