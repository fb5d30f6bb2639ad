"""The gateway finds the run's sandbox pods on a real kube-apiserver by label, from a watch.

There is no kubelet: the test plays it, setting each pod's status (Running, podIP) the way a
kubelet would, and runs each pod's sandbox server on its own loopback address 127.0.0.x.
"""

from __future__ import annotations

import httpx
import pytest
from kubernetes import client as k8s

from asyncgrpo.sandbox.gateway.members import pod_member
from asyncgrpo.testing.kube import Api
from tests.conftest import free_port
from tests.sandbox.conftest import gw_client, holder, start_gateway, start_sandbox, wait_until

SELECTOR = {"app.kubernetes.io/component": "sandbox", "asyncgrpo.dev/run": "demo"}


def _pod(name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "sandbox", "image": "sandbox:test"}]}}


def test_pod_member_reads_only_running_pods_with_an_ip():
    def pod(phase, ip, deleting=False):
        return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p", deletion_timestamp="2026-01-01T00:00:00Z"
                                                   if deleting else None),
                         status=k8s.V1PodStatus(phase=phase, pod_ip=ip))
    assert pod_member(pod("Running", "10.0.0.7"), 8000) == ("p", "http://10.0.0.7:8000")
    assert pod_member(pod("Running", "fd00::7"), 8000) == ("p", "http://[fd00::7]:8000")
    assert pod_member(pod("Pending", None), 8000) == ("p", None)
    assert pod_member(pod("Running", "10.0.0.7", deleting=True), 8000) == ("p", None)
    assert pod_member(pod("Succeeded", "10.0.0.7"), 8000) == ("p", None)


@pytest.mark.cluster
def test_gateway_follows_the_runs_sandbox_pods(kube_cluster, kube_client, tmp_path):
    core = k8s.CoreV1Api(kube_client)
    ns = Api(kube_client).namespace("sbx")  # with its default ServiceAccount, which pods use
    port = free_port()
    sandboxes = [start_sandbox(tmp_path, f"pod{i}", host=f"127.0.0.{i + 2}", port=port) for i in range(3)]
    labels_other_run = {**SELECTOR, "asyncgrpo.dev/run": "other"}
    try:
        for i in range(3):
            core.create_namespaced_pod(ns, _pod(f"sandbox-{i}", SELECTOR))
        core.create_namespaced_pod(ns, _pod("not-ours", labels_other_run))
        selector = ",".join(f"{k}={v}" for k, v in SELECTOR.items())
        gw = start_gateway(tmp_path, None, "--namespace", ns, "--selector", selector, "--sandbox-port", str(port),
                           "--health-interval-seconds", "0.3", env={"KUBECONFIG": str(kube_cluster.kubeconfig)})
        try:
            demand = lambda: httpx.get(f"{gw.url}/v1/demand").json()
            assert demand()["total"] == 0  # pending pods are not members
            for i, name in enumerate(["sandbox-0", "sandbox-1", "sandbox-2", "not-ours"]):
                core.patch_namespaced_pod_status(name, ns, {"status": {
                    "phase": "Running", "podIP": f"127.0.0.{min(i, 2) + 2}"}})
            wait_until(lambda: demand()["members"] == {f"sandbox-{i}": "warm" for i in range(3)}, 60,
                       what="three pods warm")
            with gw_client(gw) as c:
                lease = c.post("/v1/leases", json={"group_id": "g"}).json()
                h = holder(gw, lease)
                ran = h.post(f"/v1/leases/{lease['lease_id']}/exec", json={"command": "pwd"}).json()
                index = int(lease["sandbox"].split("-")[1])
                assert ran["stdout"].startswith(str(sandboxes[index].workspace))
                # the leased pod is deleted: its lease breaks with a clear error, the member goes
                core.delete_namespaced_pod(lease["sandbox"], ns, grace_period_seconds=0)
                wait_until(lambda: lease["sandbox"] not in demand()["members"], 30, what="deleted pod removed")
                gone = h.post(f"/v1/leases/{lease['lease_id']}/exec", json={"command": "true"})
                assert gone.status_code == 410 and gone.json()["error"] == "sandbox_lost"
            assert sorted(demand()["members"]) == sorted({f"sandbox-{i}" for i in range(3)} - {lease["sandbox"]})
        finally:
            gw.stop()
    finally:
        for s in sandboxes:
            s.stop()
        core.delete_namespace(ns)
