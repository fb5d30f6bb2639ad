"""Sandbox pool scaling against the real API server, from a demand signal served over HTTP
the way the gateway serves it (`GET /v1/demand`, `POST /v1/members/<pod>/drain`)."""

from __future__ import annotations

import base64
import time

import pytest

from tests.operator.helpers import component, kubelet, make_run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def pool_run(s3, ns, name, **sandboxes):
    run = make_run(s3, ns, name, "multi-turn-sandboxes.yaml")
    sb = run["spec"]["sandboxes"]
    sb.pop("runtimeClassName")
    sb["network"].pop("allowedEgressHosts")
    sb.update({"minWarm": 2, "max": 20, "hardCap": 25, "idleTtlSeconds": 0})
    sb.update(sandboxes)
    return run


def sandbox_pods(api, ns, run):
    return [p for p in api.list("Pod", ns, component(run, "sandbox"))
            if not p["metadata"].get("deletionTimestamp")]


def watch_count(api, ns, run, seconds: float) -> int:
    """Most sandbox pods that existed at once while sampling for `seconds`."""
    most, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        most = max(most, len(sandbox_pods(api, ns, run)))
        time.sleep(0.1)
    return most


def start_gateway(api, ns, run):
    wait_for(lambda: kubelet(api, ns, component(run, "gateway")), what="gateway pod")
    wait_for(lambda: api.condition(ns, run, "SandboxesReady").get("reason") != "Starting"
             and api.get("Deployment", ns, f"{run}-gateway")["status"].get("readyReplicas"),
             what="gateway ready")


def test_pool_scales_up_and_down_from_the_demand_signal(api, ns, s3_server, peers):
    api.create(pool_run(s3_server, ns, "pool"))
    demand_path = f"/gw/{ns}/pool/v1/demand"
    # no demand signal yet: the pool grows to minWarm and holds there
    wait_for(lambda: len(sandbox_pods(api, ns, "pool")) == 2, what="minWarm pods")
    start_gateway(api, ns, "pool")
    assert watch_count(api, ns, "pool", 2.5) == 2

    # 2 busy + 8 waiting + minWarm 2 -> 12 pods, and never more
    names = [p["metadata"]["name"] for p in sandbox_pods(api, ns, "pool")]
    peers.set_json(demand_path, {"busy": 2, "idle": 0, "waiting": 8, "starting": 0,
                                 "members": {n: "busy" for n in names}})
    wait_for(lambda: len(sandbox_pods(api, ns, "pool")) == 12, what="12 pods")
    assert watch_count(api, ns, "pool", 3) == 12
    kubelet(api, ns, component("pool", "sandbox"))
    wait_for(lambda: api.run(ns, "pool")["status"]["sandboxes"]["warm"] == 10,
             what="status counts")
    status = api.run(ns, "pool")["status"]["sandboxes"]
    assert status["busy"] == 2 and status["spawnedTotal"] == 12 and status["failed"] == 0

    # demand gone: idle pods are drained through the gateway, then deleted; busy ones stay
    pods = [p["metadata"]["name"] for p in sandbox_pods(api, ns, "pool")]
    busy = set(names)
    peers.set_json(demand_path, {"busy": 2, "idle": 10, "waiting": 0, "starting": 0,
                                 "members": {n: "busy" if n in busy else "warm" for n in pods}})
    wait_for(lambda: len(sandbox_pods(api, ns, "pool")) == 4, what="shrink to busy + minWarm")
    left = {p["metadata"]["name"] for p in sandbox_pods(api, ns, "pool")}
    assert busy <= left
    drained = [p for p in peers.hits if p.startswith(f"/gw/{ns}/pool/v1/members/")]
    assert len(drained) == 8
    # the drain call carries the run's gateway token, read from the Secret it made
    token = base64.b64decode(api.get("Secret", ns, "pool-tokens")["data"]["gateway-token"])
    assert peers.auth[drained[0]] == f"Bearer {token.decode()}"


def test_delayed_watch_never_over_creates(api, ns, s3_server, peers, operator):
    """The operator's pod cache lags 3 s behind (resync is 1 s): expectations hold the count."""
    api.create(pool_run(s3_server, ns, "slow", minWarm=6))
    operator.runtime.settings.pod_watch_delay_seconds = 3.0
    try:
        assert watch_count(api, ns, "slow", 8) == 6
        wait_for(lambda: len(sandbox_pods(api, ns, "slow")) == 6, what="6 pods")
        assert watch_count(api, ns, "slow", 4) == 6
    finally:
        operator.runtime.settings.pod_watch_delay_seconds = 0.0
    spawned = operator.runtime.metrics.registry.get_sample_value(
        "asyncgrpo_operator_sandboxes_spawned_total", {"namespace": ns, "run": "slow"})
    assert spawned == 6


def test_failed_and_unschedulable_sandboxes_are_reported_not_recreated(api, ns, s3_server):
    api.create(pool_run(s3_server, ns, "sick", minWarm=3))
    wait_for(lambda: len(sandbox_pods(api, ns, "sick")) == 3, what="3 pods")
    pods = [p["metadata"]["name"] for p in sandbox_pods(api, ns, "sick")]
    api.merge_patch("Pod", ns, pods[0], {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/1 nodes are available: 1 Insufficient memory."}]}}, "/status")
    cond = wait_for(lambda: (c := api.condition(ns, "sick", "SandboxesReady"))
                    .get("reason") == "SandboxesUnschedulable" and c, what="Unschedulable")
    assert "Insufficient memory" in cond["message"]
    assert api.condition(ns, "sick", "SandboxesReady")["status"] == "False"
    assert watch_count(api, ns, "sick", 3) == 3  # not replaced, not deleted
    assert api.run(ns, "sick")["status"]["sandboxes"]["failed"] == 1


def test_retired_sandboxes_are_deleted_and_replaced(api, ns, s3_server, peers):
    """FreshPerGroup: the gateway reports the pods that served their group as `retired`; the
    operator deletes them and creates replacements (new names), keeping busy + minWarm."""
    api.create(pool_run(s3_server, ns, "fresh"))
    wait_for(lambda: len(sandbox_pods(api, ns, "fresh")) == 2, what="minWarm pods")
    start_gateway(api, ns, "fresh")
    served = sorted(p["metadata"]["name"] for p in sandbox_pods(api, ns, "fresh"))
    peers.set_json(f"/gw/{ns}/fresh/v1/demand", {
        "busy": 0, "idle": 0, "waiting": 0, "starting": 0, "retired": 2,
        "members": {n: "retired" for n in served}})
    wait_for(lambda: not {p["metadata"]["name"] for p in sandbox_pods(api, ns, "fresh")} & set(served)
             and len(sandbox_pods(api, ns, "fresh")) == 2, what="retired pods replaced")
    assert watch_count(api, ns, "fresh", 2) == 2  # replaced, not piled up
