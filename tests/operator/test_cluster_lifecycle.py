"""Run lifecycle against the real API server and S3: suspend/resume, deletion with each
policy, TTL after finishing, bad input as conditions, and zero writes at steady state."""

from __future__ import annotations

import time

import pytest

from tests.operator.helpers import component, kubelet, make_run, reconcile_errors, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# events are counted apart: without a kubelet, the endpoints controllers keep reporting pods
# that have no node, which is the test harness talking, not the operator
RESOURCES = {"asyncgrporuns", "pods", "deployments", "statefulsets", "services", "configmaps",
             "secrets", "networkpolicies", "serviceaccounts", "roles", "rolebindings"}


def operator_events(api) -> int:
    return sum(e.get("count", 1) for e in api.call("GET", "/api/v1/events")["items"]
               if (e.get("source") or {}).get("component") == "asyncgrpo-operator"
               or e.get("reportingComponent") == "asyncgrpo-operator")


def bring_up(api, ns, name):
    """Play the kubelet until the run is Running."""
    def vllm_ready_and_trainer_up() -> bool:
        # keep marking vLLM pods ready: a Deployment's replicas appear one by one
        kubelet(api, ns, component(name, "vllm"))
        trainer = api.get("StatefulSet", ns, f"{name}-trainer")
        return bool(trainer) and trainer["spec"]["replicas"] > 0

    wait_for(vllm_ready_and_trainer_up, what="vLLM ready and trainer scaled up")
    wait_for(lambda: kubelet(api, ns, component(name, "trainer")), what="trainer pod")
    wait_for(lambda: api.run(ns, name)["status"]["phase"] == "Running", what="Running")


def test_suspend_scales_to_zero_keeps_the_bucket_and_resume_restarts(api, ns, s3_server):
    run = make_run(s3_server, ns, "pause", "multi-turn-sandboxes.yaml")
    run["spec"]["sandboxes"].pop("runtimeClassName")
    run["spec"]["sandboxes"]["network"].pop("allowedEgressHosts")
    run["spec"]["sandboxes"]["minWarm"] = 2
    run["spec"]["adapterStore"]["bucket"] = "suspend-bucket"
    api.create(run)
    wait_for(lambda: kubelet(api, ns, component("pause", "gateway")), what="gateway pod")
    bring_up(api, ns, "pause")
    wait_for(lambda: len(api.list("Pod", ns, component("pause", "sandbox"))) == 2, what="pool")
    s3_server.client().put_object(Bucket="suspend-bucket", Key="asyncgrpo/pause/ckpt/step-50",
                                  Body=b"x")

    api.merge_patch("AsyncGRPORun", ns, "pause", {"spec": {"suspend": True}})
    wait_for(lambda: api.run(ns, "pause")["status"]["phase"] == "Suspended", what="Suspended")
    wait_for(lambda: all(api.get(k, ns, n)["spec"]["replicas"] == 0 for k, n in (
        ("Deployment", "pause-vllm"), ("Deployment", "pause-gateway"),
        ("StatefulSet", "pause-trainer"))), what="workloads at zero")
    wait_for(lambda: not [p for p in api.list("Pod", ns, component("pause", "sandbox"))
                          if not p["metadata"].get("deletionTimestamp")], what="pool emptied")
    assert api.condition(ns, "pause", "Progressing")["reason"] == "Suspended"
    assert s3_server.client().get_object(Bucket="suspend-bucket",
                                         Key="asyncgrpo/pause/ckpt/step-50")["Body"].read()
    # the ConfigMap is not rewritten by suspending (it does not carry spec.suspend)
    assert "suspend:" not in api.get("ConfigMap", ns, "pause-config")["data"]["run.yaml"]

    api.merge_patch("AsyncGRPORun", ns, "pause", {"spec": {"suspend": False}})
    wait_for(lambda: api.get("Deployment", ns, "pause-vllm")["spec"]["replicas"] == 2,
             what="vLLM back")
    wait_for(lambda: len(api.list("Pod", ns, component("pause", "sandbox"))) >= 2,
             what="pool back")

    def dependencies_ready_and_trainer_back() -> bool:
        # new vLLM and gateway pods: play their kubelet until the trainer is started again
        # (it resumes from the newest complete checkpoint in the bucket)
        kubelet(api, ns, component("pause", "vllm"))
        kubelet(api, ns, component("pause", "gateway"))
        return api.get("StatefulSet", ns, "pause-trainer")["spec"]["replicas"] > 0

    wait_for(dependencies_ready_and_trainer_back, what="trainer back")


@pytest.mark.parametrize("policy", ["Retain", "Delete"])
def test_delete_follows_the_deletion_policy(api, ns, s3_server, policy):
    name = f"del-{policy.lower()}"
    run = make_run(s3_server, ns, name)
    run["spec"]["adapterStore"].update({"bucket": "deletion-bucket", "deletionPolicy": policy})
    api.create(run)
    wait_for(lambda: api.get("Deployment", ns, f"{name}-vllm"), what="children")
    wait_for(lambda: api.condition(ns, name, "BucketReady").get("status") == "True",
             what="bucket")
    s3 = s3_server.client()
    mine = f"asyncgrpo/{ns}/{name}/adapters/v1/manifest.json"
    other = f"asyncgrpo/{ns}/{name}-other/adapters/v1/manifest.json"
    for key in (mine, other):
        s3.put_object(Bucket="deletion-bucket", Key=key, Body=b"{}")

    api.delete("AsyncGRPORun", ns, name)
    wait_for(lambda: api.get("AsyncGRPORun", ns, name) is None, what="run gone")
    # children go through their ownerReferences (the controller-manager's garbage collector)
    for kind, child in (("Deployment", f"{name}-vllm"), ("StatefulSet", f"{name}-trainer"),
                        ("ConfigMap", f"{name}-config"), ("NetworkPolicy", f"{name}-vllm")):
        wait_for(lambda k=kind, c=child: api.get(k, ns, c) is None,
                 what=f"{kind} {child} collected")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="deletion-bucket").get("Contents", [])}
    assert other in keys  # another run's objects are never touched
    assert (mine in keys) == (policy == "Retain")


def test_invalid_spec_is_a_condition_and_fixing_it_recovers(api, ns, s3_server):
    run = make_run(s3_server, ns, "bad")
    run["spec"]["model"]["lora"]["rank"] = 64   # above rollout.maxLoraRank 32
    run["spec"]["data"] = {"path": "/a", "bucketPath": "b"}
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "bad", "Degraded")).get("status") == "True"
                    and c, what="InvalidSpec")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.model.lora.rank" in cond["message"] and "spec.data" in cond["message"]
    assert api.condition(ns, "bad", "Progressing")["status"] == "False"
    assert api.get("Deployment", ns, "bad-vllm") is None
    assert "InvalidSpec" in {e["reason"] for e in api.events(ns, "bad")}

    api.merge_patch("AsyncGRPORun", ns, "bad", {"spec": {"model": {"lora": {"rank": 16}},
                                                   "data": {"path": None}}})
    wait_for(lambda: api.get("Deployment", ns, "bad-vllm"), what="children after the fix")
    wait_for(lambda: api.condition(ns, "bad", "Degraded").get("status") == "False",
             what="not Degraded")


def test_missing_secret_and_unreachable_store_are_conditions(api, ns, s3_server):
    run = make_run(s3_server, ns, "nosecret")
    run["spec"]["adapterStore"]["credentialsSecret"] = {"name": "later"}
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "nosecret", "BucketReady"))
                    .get("reason") == "SecretNotFound" and c, what="SecretNotFound")
    assert cond["status"] == "False" and "later" in cond["message"]
    assert api.run(ns, "nosecret")["status"]["phase"] == "Pending"
    assert api.condition(ns, "nosecret", "Degraded")["reason"] == "SecretNotFound"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "later", "namespace": ns,
                                                               "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
              "stringData": {"AWS_ACCESS_KEY_ID": s3_server.access_key,
                             "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}}
    api.create(secret)
    # failing checks back off (1 s doubling, at most 30 s)
    wait_for(lambda: api.condition(ns, "nosecret", "BucketReady").get("status") == "True",
             timeout=45, what="BucketReady once the Secret exists")

    from tests.conftest import free_port
    run = make_run(s3_server, ns, "nostore")
    run["spec"]["adapterStore"]["endpoint"] = f"http://127.0.0.1:{free_port()}"
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "nostore", "BucketReady"))
                    .get("reason") == "EndpointUnreachable" and c, what="EndpointUnreachable")
    assert "127.0.0.1" not in cond["message"]  # endpoint URLs stay out of status

    run = make_run(s3_server, ns, "nobucket")
    run["spec"]["adapterStore"].update({"bucket": "never-created", "createBucket": False})
    api.create(run)
    wait_for(lambda: api.condition(ns, "nobucket", "BucketReady").get("reason")
             == "BucketNotFound", what="BucketNotFound")


def test_ttl_after_finished_deletes_the_run(api, ns, s3_server):
    api.create(make_run(s3_server, ns, "short", ttlSecondsAfterFinished=2))
    bring_up(api, ns, "short")
    kubelet(api, ns, component("short", "trainer"), ready=False, terminated=0)
    wait_for(lambda: api.run(ns, "short").get("status", {}).get("phase") == "Succeeded",
             what="Succeeded")
    try:
        wait_for(lambda: api.get("AsyncGRPORun", ns, "short") is None, timeout=30,
                 what="deleted after its TTL")
    except AssertionError as e:   # say what the run looked like (a known flake: see report)
        obj = api.get("AsyncGRPORun", ns, "short") or {}
        raise AssertionError(f"{e}; run metadata {obj.get('metadata')}, status "
                             f"{(obj.get('status') or {}).get('phase')}") from None


def test_no_api_writes_at_steady_state(api, ns, s3_server, peers):
    run = make_run(s3_server, ns, "steady", "multi-turn-sandboxes.yaml")
    run["spec"]["sandboxes"].pop("runtimeClassName")
    run["spec"]["sandboxes"]["network"].pop("allowedEgressHosts")
    run["spec"]["sandboxes"]["minWarm"] = 3
    api.create(run)
    wait_for(lambda: kubelet(api, ns, component("steady", "gateway")), what="gateway pod")
    bring_up(api, ns, "steady")
    wait_for(lambda: len(kubelet(api, ns, component("steady", "sandbox"))) == 3, what="pool")
    names = [p["metadata"]["name"] for p in api.list("Pod", ns, component("steady", "sandbox"))]
    peers.set_json(f"/gw/{ns}/steady/v1/demand", {"busy": 1, "idle": 2, "waiting": 0,
                                                  "starting": 0,
                                                  "members": {n: "warm" for n in names}})
    peers.set_text(f"/tr/{ns}/steady/metrics",
                   "asyncgrpo_trainer_step 7\nasyncgrpo_trainer_policy_version 3\n"
                   "asyncgrpo_trainer_raw_tokens_per_second 1234.5\n"
                   "asyncgrpo_trainer_tree_compression_ratio 2.5\n")
    wait_for(lambda: api.run(ns, "steady")["status"].get("step") == 7, what="progress mirrored")
    status = api.run(ns, "steady")["status"]
    assert status["policyVersion"] == 3 and status["throughput"]["treeCompressionRatio"] == 2.5

    # earlier tests' namespaces are being torn down by the namespace controller (deletes
    # from every client are counted): measure once they are gone
    wait_for(lambda: not [n for n in api.call("GET", "/api/v1/namespaces")["items"]
                          if n["status"].get("phase") == "Terminating"],
             timeout=120, what="earlier namespaces gone")
    time.sleep(3)   # let events and the last status patch land
    before, events_before = api.write_requests(RESOURCES), operator_events(api)
    time.sleep(6)   # six resync periods of every run the shared operator holds
    after, events_after = api.write_requests(RESOURCES), operator_events(api)
    assert events_after == events_before
    writes = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert writes == {}, f"writes at steady state: {writes}"


def test_hostile_spec_values_are_refused_children_not_a_crash(api, ns, s3_server, operator):
    """Values the schema lets through but the API server refuses (a malformed valueFrom) become
    an ApplyFailed condition; the rest of the run (with the longest name) still exists."""
    name = "h" * 44
    run = make_run(s3_server, ns, name)
    run["spec"]["rollout"]["env"] = [{"name": "X", "valueFrom": {"bogus": {"a": 1}}}]
    run["spec"]["rollout"]["extraArgs"] = ["--x=" + "y" * 5000]
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, name, "Degraded")).get("reason")
                    == "ApplyFailed" and c, what="ApplyFailed")
    assert f"{name}-vllm" in cond["message"] and cond["status"] == "True"
    assert api.get("StatefulSet", ns, f"{name}-trainer") is not None
    assert api.get("Deployment", ns, f"{name}-vllm") is None
    before = reconcile_errors(operator.runtime.metrics)
    time.sleep(2)
    assert reconcile_errors(operator.runtime.metrics) == before


def test_removing_the_sandboxes_prunes_the_pool_and_its_children(api, ns, s3_server):
    run = make_run(s3_server, ns, "prune")
    run["spec"]["sandboxes"] = {"minWarm": 2, "max": 4}
    api.create(run)
    wait_for(lambda: len(api.list("Pod", ns, component("prune", "sandbox"))) == 2, what="pool")
    wait_for(lambda: api.get("Role", ns, "prune-gateway"), what="gateway role")
    api.merge_patch("AsyncGRPORun", ns, "prune", {"spec": {"sandboxes": None}})
    wait_for(lambda: not [p for p in api.list("Pod", ns, component("prune", "sandbox"))
                          if not p["metadata"].get("deletionTimestamp")], what="pool gone")
    for kind, child in (("Deployment", "prune-gateway"), ("Service", "prune-gateway"),
                        ("Role", "prune-gateway"), ("RoleBinding", "prune-gateway"),
                        ("ServiceAccount", "prune-sandbox"), ("NetworkPolicy", "prune-sandbox")):
        wait_for(lambda k=kind, c=child: api.get(k, ns, c) is None, what=f"{kind} {child} pruned")
    assert api.get("Deployment", ns, "prune-vllm") is not None
