"""The test node itself: pods run from imported images, probes, Services, DNS, logs, exec.

Each check is what a cluster user relies on and what the e2e tests build on.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from asyncgrpo.testing.node import BUSYBOX_IMAGE, NODE_NAME
from asyncgrpo.testing.waiting import wait_for

#: a pod on the real node takes seconds to start: poll for up to this long
NODE_TIMEOUT = 120.0

pytestmark = [pytest.mark.cluster, pytest.mark.node]


def kubectl(whole, *args: str, check: bool = True, input: str | None = None) -> str:
    from asyncgrpo.testing.node import _kubectl

    out = subprocess.run([*_kubectl(whole.cluster), *args], capture_output=True, text=True, check=False,
                         input=input, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
    return out.stdout


def apply(whole, *objs: dict) -> None:
    kubectl(whole, "apply", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def pod(name: str, ns: str, command: list[str], **spec) -> dict:
    container = {"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                 "command": command,
                 "securityContext": {"allowPrivilegeEscalation": False,
                                     "readOnlyRootFilesystem": True,
                                     "runAsNonRoot": True, "runAsUser": 65532,
                                     "capabilities": {"drop": ["ALL"]}}}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
            "spec": {"containers": [container], "automountServiceAccountToken": False,
                     **spec}}


def phase(whole, ns: str, name: str) -> str:
    return kubectl(whole, "-n", ns, "get", "pod", name, "-o", "jsonpath={.status.phase}",
                   check=False)


def test_node_is_ready_and_has_no_gpu(kube_node):
    node = json.loads(kubectl(kube_node, "get", "node", NODE_NAME, "-o", "json"))
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert "nvidia.com/gpu" not in node["status"]["allocatable"]
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == "198.18.255.2"


def test_pod_serves_a_service_by_dns_name_and_logs_and_exec_work(kube_node):
    ns = "node-web"
    kubectl(kube_node, "create", "namespace", ns)
    web = pod("web", ns, ["/bin/busybox", "httpd", "-f", "-p", "8080", "-h", "/www"],
              container={"ports": [{"containerPort": 8080, "name": "http"}],
                         "readinessProbe": {"httpGet": {"path": "/index.html", "port": "http"},
                                            "periodSeconds": 1}})
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
           "spec": {"selector": {"app": "web"},
                    "ports": [{"port": 80, "targetPort": "http", "protocol": "TCP"}]}}
    apply(kube_node, web, svc)
    wait_for(lambda: kubectl(
        kube_node, "-n", ns, "get", "pod", "web", "-o",
        "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False) == "True",
        NODE_TIMEOUT, 0.5, "web Ready")

    # the pod's IP answers from the host, as on a node
    ip = kubectl(kube_node, "-n", ns, "get", "pod", "web", "-o", "jsonpath={.status.podIP}")
    import urllib.request

    assert urllib.request.urlopen(f"http://{ip}:8080/index.html", timeout=5).read() \
        == b"asyncgrpo node\n"

    # another pod reaches it through the Service, by short name and by full name
    for i, host in enumerate(["web", f"web.{ns}.svc.cluster.local"]):
        client = pod(f"client-{i}", ns, ["/bin/busybox", "wget", "-q", "-O-", f"http://{host}/"],
                     restartPolicy="Never")
        apply(kube_node, client)
        assert wait_for(lambda i=i: phase(kube_node, ns, f"client-{i}")
                        in ("Succeeded", "Failed") and phase(kube_node, ns, f"client-{i}"),
                        NODE_TIMEOUT, 0.5, f"client-{i} done")\
            == "Succeeded", kubectl(kube_node, "-n", ns, "logs", f"client-{i}", check=False)
        assert kubectl(kube_node, "-n", ns, "logs", f"client-{i}") == "asyncgrpo node\n"

    # exec runs in the container as its non-root user
    assert kubectl(kube_node, "-n", ns, "exec", "web", "--", "/bin/busybox", "id", "-u").strip() \
        == "65532"
    kubectl(kube_node, "delete", "namespace", ns, "--wait=false")


def test_pods_cannot_reach_outside_the_node(kube_node):
    """No default route in the node: traffic to any other address fails at once."""
    ns = "node-egress"
    kubectl(kube_node, "create", "namespace", ns)
    # TEST-NET-3 (RFC 5737): documentation space, never routed; no packet may leave anyway
    apply(kube_node, pod("egress", ns, ["/bin/busybox", "sh", "-c",
                                        "nc -w 3 203.0.113.7 80 </dev/null 2>&1; echo rc=$?"],
                         restartPolicy="Never"))
    wait_for(lambda: phase(kube_node, ns, "egress") in ("Succeeded", "Failed"), NODE_TIMEOUT, 0.5,
             "egress done")
    logs = kubectl(kube_node, "-n", ns, "logs", "egress")
    assert "rc=1" in logs and "network is unreachable" in logs.lower(), logs
    kubectl(kube_node, "delete", "namespace", ns, "--wait=false")


def test_a_pod_asking_for_a_gpu_stays_pending_with_the_schedulers_reason(kube_node):
    ns = "node-gpu"
    kubectl(kube_node, "create", "namespace", ns)
    apply(kube_node, pod("gpu", ns, ["/bin/busybox", "sleep", "60"], container={
        "resources": {"limits": {"nvidia.com/gpu": 1}}}))

    def unschedulable():
        p = json.loads(kubectl(kube_node, "-n", ns, "get", "pod", "gpu", "-o", "json"))
        for c in p["status"].get("conditions", []):
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                return c["message"]
        return None

    message = wait_for(unschedulable, NODE_TIMEOUT, 0.5, "PodScheduled=False")
    assert "nvidia.com/gpu" in message
    assert phase(kube_node, ns, "gpu") == "Pending"
    kubectl(kube_node, "delete", "namespace", ns, "--wait=false")
