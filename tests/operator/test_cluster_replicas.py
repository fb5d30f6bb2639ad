"""Operator restarts and replicas: a restart mid-run creates no duplicates and loses no state;
two peered replicas never both act. Each test runs its own operators on its own namespace."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.operator.conftest import operator_settings
from tests.operator.helpers import component, kubelet, make_run, s3_secret, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
KINDS = ("ConfigMap", "Secret", "Service", "ServiceAccount", "Deployment", "StatefulSet",
         "NetworkPolicy", "Role", "RoleBinding", "Pod")


def watch_pods(api, ns, run, seconds):
    most, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        most = max(most, len(api.list("Pod", ns, component(run, "sandbox"))))
        time.sleep(0.2)
    return most


def own_namespace(api, s3):
    ns = api.namespace("own")
    api.create(s3_secret(s3, ns))
    return ns


def uids(api, ns, run):
    out = {}
    for kind in KINDS:
        for obj in api.list(kind, ns, f"asyncgrpo.dev/run={run}"):
            if not obj["metadata"].get("deletionTimestamp"):
                out[(kind, obj["metadata"]["name"])] = obj["metadata"]["uid"]
    return out


def writes(op) -> float:
    return sum(s.value for m in op.runtime.metrics.api_writes.collect() for s in m.samples
               if s.name.endswith("_total"))


def pool_run(s3, ns, name, min_warm=4):
    run = make_run(s3, ns, name, "multi-turn-sandboxes.yaml")
    sb = run["spec"]["sandboxes"]
    sb.pop("runtimeClassName")
    sb["network"].pop("allowedEgressHosts")
    sb["minWarm"] = min_warm
    return run


def test_restart_mid_run_creates_nothing_twice_and_keeps_status(api, crd_installed, peers,
                                                                  s3_server):
    from asyncgrpo.controller.embedded import EmbeddedOperator

    ns = own_namespace(api, s3_server)
    first = EmbeddedOperator([ns], operator_settings(peers)).start()
    try:
        api.create(pool_run(s3_server, ns, "keep"))
        wait_for(lambda: kubelet(api, ns, component("keep", "gateway")), what="gateway pod")
        wait_for(lambda: len(kubelet(api, ns, component("keep", "sandbox"))) == 4, what="pool")
        wait_for(lambda: kubelet(api, ns, component("keep", "vllm")), what="vllm pods")
        # the loaded 2-core CI machine once took over 120 s here (with a preflight Job)
        wait_for(lambda: api.get("StatefulSet", ns, "keep-trainer")["spec"]["replicas"] == 1,
                 timeout=300, what="trainer up")
        wait_for(lambda: kubelet(api, ns, component("keep", "trainer")), what="trainer pod")
        wait_for(lambda: api.run(ns, "keep")["status"]["phase"] == "Running", what="Running")
        wait_for(lambda: api.run(ns, "keep")["status"]["sandboxes"]["warm"] == 4, what="warm")
    finally:
        first.stop()
    before = uids(api, ns, "keep")
    status_before = api.run(ns, "keep")["status"]

    second = EmbeddedOperator([ns], operator_settings(peers)).start()
    try:
        time.sleep(4)  # four resync periods
        assert uids(api, ns, "keep") == before
        assert writes(second) == 0
        status = api.run(ns, "keep")["status"]
        assert status["phase"] == "Running"
        assert status["sandboxes"] == status_before["sandboxes"]
        assert status["startTime"] == status_before["startTime"]
        assert status["conditions"] == status_before["conditions"]
    finally:
        second.stop()


#: Election timing of the replica tests (seconds): short, so the SIGKILL case stays quick.
LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 4, 2.5, 0.5
#: The stated bound: a standby has the pool at its new size this long after the leader
#: stopped at the latest. The election takes at most LEASE_DURATION + RETRY_PERIOD (after
#: SIGKILL; one RETRY_PERIOD after a graceful stop); the rest is the new leader's kopf
#: start (a full list of 10 kinds) and one reconcile on 2 shared, loaded cores.
TAKEOVER_BOUND = 30.0


class OperatorProcess:
    """`asyncgrpo operator --leader-election` as its own process, as each replica of the
    Deployment runs."""

    def __init__(self, kubeconfig, ns, peers, name, log_path):
        import subprocess
        import sys

        from tests.conftest import free_port

        self.name = name
        self.port = free_port()
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgrpo.cli", "operator", "--namespace", ns,
             "--leader-election", "asyncgrpo", "--leader-election-namespace", ns,
             "--lease-duration", str(LEASE_DURATION), "--renew-deadline", str(RENEW_DEADLINE),
             "--retry-period", str(RETRY_PERIOD),
             "--metrics-address", "127.0.0.1", "--metrics-port", str(self.port),
             "--health-port", "0", "--resync-seconds", "1",
             "--gateway-url", peers.base + "/gw/{namespace}/{name}"],
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": name},
            stdout=self.log, stderr=subprocess.STDOUT)

    def writes(self) -> float:
        import urllib.request
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                          timeout=5).read().decode()
        except OSError:
            return -1.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("asyncgrpo_operator_api_writes_total{"))

    def stop(self, graceful: bool = True) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # in case a test froze it
            if graceful:
                self.proc.terminate()   # SIGTERM, as the kubelet stops a pod
            else:
                self.proc.kill()        # SIGKILL: no goodbye, the Lease must expire
            self.proc.wait(timeout=60)
        if not self.log.closed:
            self.log.close()


def holder(api, ns) -> str:
    from kubernetes.client.exceptions import ApiException
    try:
        lease = api.call("GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/asyncgrpo")
    except ApiException as e:
        if e.status == 404:   # not created yet
            return ""
        raise
    return (lease.get("spec") or {}).get("holderIdentity") or ""


class PoolWatch:
    """Samples the pool size in the background: the most pods it ever had, at any moment."""

    def __init__(self, api, ns, run):
        import threading

        self.most = 0
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                n = len([p for p in api.list("Pod", ns, component(run, "sandbox"))])
                self.most = max(self.most, n)
                self._stop.wait(0.1)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.most


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "sigstop"])
def test_two_elected_replicas_never_both_act_and_the_standby_takes_over(
        api, kube_cluster, crd_installed, peers, s3_server, tmp_path, how):
    """Two operator processes elect a leader on a Lease: only the leader writes; when it
    stops (SIGTERM: it releases the Lease; SIGKILL: the Lease expires; SIGSTOP: it is frozen,
    as in a long GC pause or a partition, and wakes up after the standby took over) the
    standby has the pool at its new size within TAKEOVER_BOUND, the pool never holds one
    pod more, and a leader that wakes up past its deadline exits without acting."""
    ns = own_namespace(api, s3_server)
    first = OperatorProcess(kube_cluster.kubeconfig, ns, peers, "replica-a",
                            tmp_path / "a.log")
    second = None
    try:
        wait_for(lambda: holder(api, ns).startswith("replica-a_"), what="replica-a leads")
        second = OperatorProcess(kube_cluster.kubeconfig, ns, peers, "replica-b",
                                 tmp_path / "b.log")
        wait_for(lambda: second.writes() >= 0, what="replica-b up")
        api.create(pool_run(s3_server, ns, "solo", min_warm=3))
        wait_for(lambda: len(api.list("Pod", ns, component("solo", "sandbox"))) == 3,
                 what="pool")
        time.sleep(2)   # a few resync periods of both
        assert first.writes() > 0
        assert second.writes() == 0   # the standby never wrote while the leader lived
        assert holder(api, ns).startswith("replica-a_")
        assert sorted(p["metadata"]["name"] for p in api.list(
            "Pod", ns, component("solo", "sandbox"))) == [f"solo-sandbox-{i}" for i in range(3)]

        watch = PoolWatch(api, ns, "solo")
        stopped = time.monotonic()   # the signal is sent now
        if how == "sigstop":
            first.proc.send_signal(signal.SIGSTOP)
        else:
            first.stop(graceful=how == "sigterm")
        api.merge_patch("AsyncGRPORun", ns, "solo", {"spec": {"sandboxes": {"minWarm": 5}}})
        wait_for(lambda: len(api.list("Pod", ns, component("solo", "sandbox"))) == 5,
                 timeout=TAKEOVER_BOUND, what=f"replica-b acting within {TAKEOVER_BOUND}s")
        took = time.monotonic() - stopped
        if how == "sigstop":
            first.proc.send_signal(signal.SIGCONT)   # it wakes up, its deadline long gone
            wait_for(lambda: first.proc.poll() is not None, what="the old leader exits")
            assert first.proc.returncode == 1
        time.sleep(3)
        assert watch.stop() == 5, "over-created across the failover"
        assert holder(api, ns).startswith("replica-b_")
        assert second.writes() > 0
        print(f"takeover ({how}): pool at 5 after {took:.1f}s")
    finally:
        if second is not None:
            second.stop()
        first.stop()
