"""Placement on the test node (issue 24): the node is tainted and labelled as managed
clusters do a GPU pool; a run whose pods carry the toleration and nodeSelector trains to
Succeeded, with its pull secret and workload identity on the objects; the same run without
them reports why it waits (a condition with the scheduler's reason, and an event).

The tiny runs are CPU runs (no GPU request, so no automatic GPU toleration): the toleration
comes from spec.pod, as a platform team's run would carry a pool's taint. The taint is
removed whatever happens, so later tests schedule again.
"""

from __future__ import annotations

import json

import pytest

from .conftest import wait_for
from .test_runs_on_the_node import status_of
from .test_tiny_lora_run import prompts_configmap, tiny_run

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow]

TAINT = "nvidia.com/gpu=present:NoSchedule"
POOL = {"asyncgrpo.dev/e2e-pool": "gpu"}
TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ROLE = "arn:aws:iam::123456789012:role/e2e"


@pytest.fixture
def gpu_pool_node(e2e_stack):
    """The node, tainted and labelled as a GPU pool for the length of one test."""
    stack = e2e_stack
    node = stack.kubectl("get", "nodes", "-o", "jsonpath={.items[0].metadata.name}").strip()
    label = ",".join(f"{k}={v}" for k, v in POOL.items())
    stack.kubectl("taint", "nodes", node, TAINT, "--overwrite")
    stack.kubectl("label", "nodes", node, label, "--overwrite")
    try:
        yield node
    finally:
        stack.kubectl("taint", "nodes", node, TAINT + "-", check=False)
        stack.kubectl("label", "nodes", node, *(f"{k}-" for k in POOL), check=False)


def test_a_run_placed_on_a_tainted_pool_trains_and_one_without_says_why(e2e_stack,
                                                                        gpu_pool_node):
    stack, ns = e2e_stack, "team-placed"
    stack.namespace(ns)
    stack.kubectl("-n", ns, "create", "secret", "docker-registry", "registry",
                  "--docker-server=registry.example.com", "--docker-username=u",
                  "--docker-password=p")
    placed = tiny_run("placed", ns, stack.s3.endpoint, steps=2)
    placed["spec"]["pod"] = {"tolerations": [TOLERATION], "nodeSelector": POOL,
                             "imagePullSecrets": [{"name": "registry"}],
                             "labels": {"kueue.x-k8s.io/queue-name": "team-a"}}
    placed["spec"]["serviceAccount"] = {"annotations": {"eks.amazonaws.com/role-arn": ROLE}}
    stack.apply(prompts_configmap(ns), placed)
    # the run's pods as they ran: a finished run's workloads are scaled to zero, so they are
    # looked at while it runs
    seen: dict[str, dict] = {}

    def finished():
        for p in json.loads(stack.kubectl("-n", ns, "get", "pods", "-l",
                                          "asyncgrpo.dev/run=placed", "-o", "json"))["items"]:
            if p["spec"].get("nodeName"):
                seen[p["metadata"]["name"]] = p
        s = status_of(stack, "placed", ns)
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    status = wait_for("the placed run finished", finished, timeout=1200, interval=2,
                      on_timeout=lambda: stack.describe(ns)
                      + stack.logs(ns, "app.kubernetes.io/component=trainer"))
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)

    account = stack.get("serviceaccount", "placed-workload", ns)
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == ROLE
    assert {"name": "registry"} in account["imagePullSecrets"]
    pods = list(seen.values())
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods} >= {
        "trainer", "vllm"}
    for p in pods:
        assert TOLERATION in p["spec"]["tolerations"], p["metadata"]["name"]
        assert p["spec"]["nodeSelector"] == POOL
        assert p["spec"]["imagePullSecrets"] == [{"name": "registry"}]
        assert p["spec"]["nodeName"] == gpu_pool_node
        assert p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"

    # the same run without the placement: its pods wait, and the run says why
    unplaced = tiny_run("unplaced", ns, stack.s3.endpoint, steps=2)
    unplaced["spec"]["adapterStore"]["deletionPolicy"] = "Retain"   # no cleanup Job to wait for
    stack.apply(unplaced)

    def waiting():
        conds = [c for c in status_of(stack, "unplaced", ns).get("conditions", [])
                 if c.get("reason") == "Unschedulable"]
        return conds or None

    conds = wait_for("a condition saying Unschedulable", waiting, timeout=300,
                     on_timeout=lambda: stack.describe(ns))
    assert all("nvidia.com/gpu" in c["message"] for c in conds), conds   # the taint
    assert status_of(stack, "unplaced", ns)["phase"] == "Pending"
    events = json.loads(stack.kubectl("-n", ns, "get", "events", "-o", "json"))["items"]
    on_run = [e for e in events if e["involvedObject"]["kind"] == "AsyncGRPORun"
              and e["involvedObject"]["name"] == "unplaced"]
    assert any(e["type"] == "Warning" and e["reason"] == "Unschedulable"
               and "nvidia.com/gpu" in e["message"] for e in on_run), on_run
    assert any(e["reason"] == "FailedScheduling" and e["involvedObject"]["kind"] == "Pod"
               for e in events)
    stack.kubectl("-n", ns, "delete", "agr", "unplaced", "--wait=true", timeout=180)
