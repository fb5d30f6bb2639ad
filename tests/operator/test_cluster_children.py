"""The operator against a real kube-apiserver: children, their specs and owners, RBAC and
NetworkPolicies, the bucket, and phases driven by pod statuses (the test is the kubelet)."""

from __future__ import annotations

import pytest

from tests.operator.helpers import component, kubelet, make_run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CHILDREN = {
    ("ServiceAccount", "{r}-workload"), ("ServiceAccount", "{r}-gateway"),
    ("ServiceAccount", "{r}-sandbox"), ("Role", "{r}-gateway"), ("RoleBinding", "{r}-gateway"),
    ("ConfigMap", "{r}-config"), ("Secret", "{r}-tokens"),
    ("NetworkPolicy", "{r}-trainer"), ("NetworkPolicy", "{r}-vllm"),
    ("NetworkPolicy", "{r}-gateway"), ("NetworkPolicy", "{r}-sandbox"),
    ("NetworkPolicy", "{r}-bucket"), ("NetworkPolicy", "{r}-preflight"),
    ("Service", "{r}-vllm"), ("Deployment", "{r}-vllm"), ("Service", "{r}-gateway"),
    ("Deployment", "{r}-gateway"), ("Service", "{r}-trainer"), ("StatefulSet", "{r}-trainer"),
}


@pytest.fixture(scope="module")
def gvisor(api):
    """The RuntimeClass the multi-turn example names; without it the API server refuses pods."""
    from kubernetes.client.exceptions import ApiException
    try:
        api.call("POST", "/apis/node.k8s.io/v1/runtimeclasses", body={
            "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": "gvisor"}, "handler": "runsc"})
    except ApiException as e:
        assert e.status == 409


def test_multi_turn_run_gets_every_child_owned_by_it(api, ns, s3_server, gvisor):
    run = make_run(s3_server, ns, "agent", "multi-turn-sandboxes.yaml")
    run["spec"]["sandboxes"]["minWarm"] = 3
    run["spec"]["sandboxes"]["network"]["allowedEgressHosts"] = ["localhost"]
    created = api.create(run)
    uid = created["metadata"]["uid"]

    for kind, name in CHILDREN:
        obj = wait_for(lambda k=kind, n=name: api.get(k, ns, n.format(r="agent")),
                       what=f"{kind} {name}")
        refs = obj["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
                         "name": "agent", "uid": uid, "controller": True,
                         "blockOwnerDeletion": True}], (kind, name)
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "asyncgrpo-operator"
        assert labels["app.kubernetes.io/instance"] == "agent"
        assert labels["asyncgrpo.dev/run"] == "agent"

    pods = wait_for(lambda: len(api.list("Pod", ns, component("agent", "sandbox"))) == 3
                    and api.list("Pod", ns, component("agent", "sandbox")), what="3 sandboxes")
    for pod in pods:
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["serviceAccountName"] == "agent-sandbox"
        assert spec["runtimeClassName"] == "gvisor"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid

    # the setup Job makes the bucket in the real S3 server
    wait_for(lambda: "rl-runs" in {b["Name"] for b in
                                   s3_server.client().list_buckets()["Buckets"]}, what="bucket")

    # RBAC: the gateway can only read pods, nothing else; sandboxes get no token at all
    role = api.get("Role", ns, "agent-gateway")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert api.get("ServiceAccount", ns, "agent-sandbox")["automountServiceAccountToken"] is False
    binding = api.get("RoleBinding", ns, "agent-gateway")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "agent-gateway",
                                    "namespace": ns}]

    # NetworkPolicies: sandboxes reachable only from the gateway and the run's trainer (the
    # lease's direct data path); egress only to the list
    sb = api.get("NetworkPolicy", ns, "agent-sandbox")["spec"]
    assert sb["policyTypes"] == ["Ingress", "Egress"]
    assert sorted(sb["ingress"][0]["from"], key=str) == sorted([
        {"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "asyncgrpo", "app.kubernetes.io/instance": "agent",
            "app.kubernetes.io/component": component}}} for component in ("gateway", "trainer")],
        key=str)
    # (names are resolved through DNS, not /etc/hosts: test_cluster_hostile resolves them
    # with a DNS server of its own)
    cidrs = {p["ipBlock"]["cidr"] for p in sb["egress"][0]["to"]}
    assert "10.20.0.0/16" in cidrs
    vllm_np = api.get("NetworkPolicy", ns, "agent-vllm")["spec"]
    assert vllm_np["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "trainer"

    # workloads: vLLM with the resolver plugin env; the trainer held at 0 until vLLM is up
    vllm = api.get("Deployment", ns, "agent-vllm")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert env["ASYNCGRPO_ADAPTER_BUCKET"] == "rl-runs"
    assert env["ASYNCGRPO_ADAPTER_RUN"] == "agent"
    assert "--max-lora-rank" in vllm["args"] and "--enable-lora" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
    sts = api.get("StatefulSet", ns, "agent-trainer")
    assert sts["spec"]["replicas"] == 0
    assert api.condition(ns, "agent", "TrainerReady")["reason"] == "WaitingForRollout"


def test_missing_runtime_class_is_a_condition_not_a_crash(api, ns, s3_server):
    run = make_run(s3_server, ns, "boxed", "multi-turn-sandboxes.yaml")
    run["spec"]["sandboxes"]["runtimeClassName"] = "kata-missing"
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "boxed", "SandboxesReady"))
                    .get("reason") == "SandboxCreateFailed" and c, what="SandboxCreateFailed")
    assert "kata-missing" in cond["message"]
    assert api.list("Pod", ns, component("boxed", "sandbox")) == []
    # the rest of the run is there all the same
    assert api.get("Deployment", ns, "boxed-vllm") is not None


def test_phases_follow_pod_statuses(api, ns, s3_server):
    api.create(make_run(s3_server, ns, "math"))
    wait_for(lambda: api.condition(ns, "math", "BucketReady").get("status") == "True",
             what="BucketReady")
    wait_for(lambda: api.run(ns, "math")["status"]["phase"] == "Starting", what="Starting")
    trainer = api.condition(ns, "math", "TrainerReady")
    assert trainer["reason"] == "WaitingForRollout"
    assert api.get("StatefulSet", ns, "math-trainer")["spec"]["replicas"] == 0

    # vLLM pods come up (the ReplicaSet controller made them; we are their kubelet)
    wait_for(lambda: len(kubelet(api, ns, component("math", "vllm"))) == 2, what="vllm pods")
    wait_for(lambda: api.condition(ns, "math", "RolloutReady").get("status") == "True",
             what="RolloutReady")
    # ordered start: now the trainer scales up
    wait_for(lambda: api.get("StatefulSet", ns, "math-trainer")["spec"]["replicas"] == 1,
             what="trainer scaled up")
    wait_for(lambda: kubelet(api, ns, component("math", "trainer")), what="trainer pod")
    wait_for(lambda: api.run(ns, "math")["status"]["phase"] == "Running", what="Running")
    status = api.run(ns, "math")["status"]
    assert status["startTime"]
    assert status["observedGeneration"] == api.run(ns, "math")["metadata"]["generation"]
    assert all(c["observedGeneration"] == status["observedGeneration"]
               for c in status["conditions"])
    assert api.condition(ns, "math", "Degraded")["status"] == "False"

    # an image pull failure on a vLLM pod is a condition a user can act on
    kubelet(api, ns, component("math", "vllm"), phase="Pending", ready=False,
            waiting="ImagePullBackOff")
    cond = wait_for(lambda: (c := api.condition(ns, "math", "RolloutReady"))
                    .get("reason") == "ImagePullBackOff" and c, what="ImagePullBackOff")
    assert cond["status"] == "False"
    assert api.condition(ns, "math", "Degraded")["reason"] == "ImagePullBackOff"
    reasons = {e["reason"] for e in api.events(ns, "math")}
    assert {"Starting", "Running", "ImagePullBackOff"} <= reasons

    # the trainer finishes: exit 0 -> Succeeded, everything scaled to zero, bucket kept
    kubelet(api, ns, component("math", "vllm"))
    kubelet(api, ns, component("math", "trainer"), phase="Running", ready=False, terminated=0)
    wait_for(lambda: api.run(ns, "math")["status"]["phase"] == "Succeeded", what="Succeeded")
    wait_for(lambda: api.get("Deployment", ns, "math-vllm")["spec"]["replicas"] == 0
             and api.get("StatefulSet", ns, "math-trainer")["spec"]["replicas"] == 0,
             what="scaled to zero")
    assert api.run(ns, "math")["status"]["completionTime"]
