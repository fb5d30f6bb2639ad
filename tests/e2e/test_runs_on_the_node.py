"""More whole runs on the test node: two trainer pods, faults, a GPU ask, full fine-tuning.

Each is driven only through the API server (kubectl apply, get, delete), as a user or an
on-call engineer would; the pods run the project's images.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from asyncgrpo.testing.prometheus import missing_data, panel_queries, rule_queries

from .conftest import (
    MOE_MODEL_PATH,
    OPERATOR_DEPLOYMENT,
    OPERATOR_NAMESPACE,
    wait_for,
)
from .test_tiny_lora_run import prompts_configmap, tiny_run

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow]


def status_of(stack, name: str, ns: str) -> dict:
    return (stack.get("agr", name, ns) or {}).get("status", {})


def wait_step(stack, name: str, ns: str, step: int, timeout: float = 900) -> dict:
    return wait_for(f"{name} at step {step}", lambda: status_of(stack, name, ns)
                    if status_of(stack, name, ns).get("step", 0) >= step else None,
                    timeout=timeout, on_timeout=lambda: stack.describe(ns)
                    + stack.logs(ns, "app.kubernetes.io/component=trainer"))


def wait_phase(stack, name: str, ns: str, timeout: float = 900) -> dict:
    def terminal():
        s = status_of(stack, name, ns)
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    return wait_for(f"{name} finished", terminal, timeout=timeout,
                    on_timeout=lambda: stack.describe(ns)
                    + stack.logs(ns, "app.kubernetes.io/component=trainer"))


def published_versions(stack, bucket: str, kind: str = "adapters") -> list[int]:
    """Versions of `kind` (adapters, or weights for full fine-tuning) whose manifest is in
    the bucket (complete versions only)."""
    s3 = stack.s3.client()
    versions = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            parts = o["Key"].split("/")
            if kind in parts and parts[-1] == "manifest.json":
                versions.append(int(parts[parts.index(kind) + 1].lstrip("v")))
    return sorted(versions)


def last_scraped(prom, expr: str, within_s: float = 1800) -> float | None:
    """The last time `expr` had a sample (Prometheus's own record, to the second)."""
    now = time.time()
    times = [float(t) for series in prom.query_range(expr, now - within_s, now, 1)
             for t, _ in series["values"]]
    return max(times, default=None)


def test_two_trainer_pods_train_one_run_over_gloo(e2e_stack):
    stack, ns = e2e_stack, "team-two"
    stack.namespace(ns)
    stack.apply(prompts_configmap(ns), tiny_run("duo", ns, stack.s3.endpoint, steps=2,
                                                replicas=2))
    wait_for("both trainer pods Ready", lambda: (stack.get("sts", "duo-trainer", ns) or {})
             .get("status", {}).get("readyReplicas") == 2, timeout=900,
             on_timeout=lambda: stack.describe(ns)
             + stack.logs(ns, "app.kubernetes.io/component=trainer"))
    wait_for("TrainerReady=True", lambda: {c["type"]: c["status"] for c in status_of(
        stack, "duo", ns).get("conditions", [])}.get("TrainerReady") == "True", timeout=120)
    status = wait_phase(stack, "duo", ns)
    assert status["phase"] == "Succeeded" and status["step"] == 2, json.dumps(status, indent=1)


def test_faults_vllm_killed_trainer_deleted_operator_restarted(e2e_stack):
    """The run survives what a cluster does to pods, with no policy version lost or repeated."""
    stack, ns = e2e_stack, "team-faults"
    stack.namespace(ns)
    # enough steps that the run is still going when its trainer pod is deleted after step 3
    # (at 8 steps a fast node finished the run before the recreated pod started)
    run = tiny_run("sturdy", ns, stack.s3.endpoint, steps=16)
    run["spec"]["adapterStore"]["retention"] = 100  # keep every version: the test counts them
    stack.apply(prompts_configmap(ns), run)
    wait_step(stack, "sturdy", ns, 1)

    # 1. kill the vLLM server process: the kubelet restarts the container, training goes on
    vllm_pod = stack.kubectl("-n", ns, "get", "pods", "-l", "app.kubernetes.io/component=vllm",
                             "-o", "jsonpath={.items[0].metadata.name}")
    container = stack.kubectl("-n", ns, "get", "pod", vllm_pod, "-o",
                              "jsonpath={.status.containerStatuses[0].containerID}")
    stack.whole.node.ctr("tasks", "kill", "-s", "SIGKILL", container.split("://", 1)[1])
    at = status_of(stack, "sturdy", ns).get("step", 0)
    wait_for("the kubelet restarted vLLM", lambda: int(stack.kubectl(
        "-n", ns, "get", "pod", vllm_pod, "-o",
        "jsonpath={.status.containerStatuses[0].restartCount}") or 0) >= 1,
        timeout=300, on_timeout=lambda: stack.describe(ns))
    wait_step(stack, "sturdy", ns, at + 1)

    # 2. delete the trainer pod mid-run: the StatefulSet recreates it, it resumes from the
    #    bucket checkpoint; no policy version is skipped or published twice
    wait_step(stack, "sturdy", ns, 3)  # checkpointInterval 2: step 2 is in the bucket
    old_uid = stack.get("pod", "sturdy-trainer-0", ns)["metadata"]["uid"]
    stack.kubectl("-n", ns, "delete", "pod", "sturdy-trainer-0", "--wait=false")

    def resumed_log() -> str | None:
        pod = stack.get("pod", "sturdy-trainer-0", ns)
        if not pod or pod["metadata"]["uid"] == old_uid:
            return None
        out = stack.kubectl("-n", ns, "logs", "sturdy-trainer-0", check=False)
        return out if "resuming from checkpoint step" in out else None

    resumed = wait_for("the recreated trainer resumed from the bucket", resumed_log,
                       timeout=600, interval=5, on_timeout=lambda: stack.describe(ns))
    assert "resuming from checkpoint step 0" not in resumed

    # 3. restart the operator mid-run: nothing is created twice
    before = stack.kubectl("-n", ns, "get", "sts,deploy,svc,networkpolicy", "-o", "name")
    stack.kubectl("-n", OPERATOR_NAMESPACE, "rollout", "restart", f"deploy/{OPERATOR_DEPLOYMENT}")
    stack.kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", f"deploy/{OPERATOR_DEPLOYMENT}",
                  "--timeout=300s", timeout=320)
    status = wait_phase(stack, "sturdy", ns, timeout=1200)
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    after = stack.kubectl("-n", ns, "get", "sts,deploy,svc,networkpolicy", "-o", "name")
    assert sorted(before.split()) == sorted(after.split())
    # versions are named newest-in-bucket + 1 and a complete one is never overwritten, so
    # one run is one contiguous sequence from v1 whatever restarted in between
    versions = published_versions(stack, "e2e-sturdy")
    assert versions == list(range(1, len(versions) + 1)), f"skipped or repeated: {versions}"
    assert versions[-1] == status["policyVersion"], (versions, status)
    print(f"\nE2E faults: versions {versions}, status {json.dumps(status)[:400]}")


def test_a_run_asking_for_a_gpu_says_why_it_waits(e2e_stack):
    stack, ns = e2e_stack, "team-gpu"
    stack.namespace(ns)
    run = tiny_run("wants-gpu", ns, stack.s3.endpoint, steps=2)
    run["spec"]["rollout"]["gpusPerReplica"] = 1
    stack.apply(prompts_configmap(ns), run)

    def waiting_reason():
        for c in status_of(stack, "wants-gpu", ns).get("conditions", []):
            if c["type"] == "RolloutReady" and c["status"] == "False" \
                    and "nvidia.com/gpu" in c.get("message", ""):
                return c
        return None

    cond = wait_for("RolloutReady=False naming the GPU", waiting_reason, timeout=300,
                    on_timeout=lambda: stack.describe(ns))
    assert cond["reason"] == "Unschedulable", cond
    events = stack.kubectl("-n", ns, "get", "events", "--field-selector",
                           "involvedObject.kind=AsyncGRPORun", "-o", "json")
    messages = [e["message"] for e in json.loads(events)["items"]]
    assert any("nvidia.com/gpu" in m for m in messages), messages
    stack.kubectl("-n", ns, "delete", "agr", "wants-gpu", "--wait=true", timeout=180)


def test_full_fine_tuning_reaches_two_vllm_replicas_through_the_bucket(e2e_stack):
    """Weights, not adapters: anchors and deltas through the bucket, a puller sidecar in each
    of two vLLM pods swaps versions in; the run's status shows what the replicas serve.

    The run is long (40 steps) and the test ends it by deleting it: replicas catch up on
    their own every few seconds, so a short run could end before they moved, on a fast
    machine as on a slow one."""
    stack, ns = e2e_stack, "team-full"
    stack.namespace(ns)
    run = tiny_run("whole", ns, stack.s3.endpoint, steps=40)
    model = run["spec"]["model"]
    del model["lora"]
    model |= {"finetuning": "full", "full": {"anchorInterval": 2, "localDisk": "1Gi"}}
    run["spec"]["adapterStore"]["retention"] = 100  # keep every version: the test counts them
    rollout = run["spec"]["rollout"]
    rollout["replicas"] = 2
    for key in ("maxLoras", "maxLoraRank"):
        del rollout[key]
    # a shared system prompt several KV blocks long: the G rollouts of a group share it and
    # the prompt, so a group's replica has them cached after its first rollout (issue 26)
    run["spec"]["data"]["systemPrompt"] = " ".join(
        f"Rule {i}: answer briefly, with digits where a number is asked." for i in range(8))
    stack.apply(prompts_configmap(ns), run)

    seen: list[dict] = []       # status.servedWeights over the run

    def both_replicas_past_v1():
        s = status_of(stack, "whole", ns)
        assert s.get("phase") not in ("Succeeded", "Failed"), f"ended first: {s}, seen {seen}"
        served = s.get("servedWeights")
        if served and s.get("phase") == "Running":
            seen.append(served)
            return served["replicas"] == 2 and served["oldest"] >= 2
        return False

    wait_for("both vLLM replicas serving a version past v1", both_replicas_past_v1,
             timeout=900, interval=1, on_timeout=lambda: stack.describe(ns)
             + stack.logs(ns, "app.kubernetes.io/component=vllm"))
    moment = time.time()
    print(f"\nE2E full fine-tuning: servedWeights seen {seen[-5:]}, step "
          f"{status_of(stack, 'whole', ns).get('step')}")
    assert all(s["oldest"] <= s["newest"] for s in seen), seen
    versions = published_versions(stack, "e2e-whole", "weights")
    assert versions == list(range(1, len(versions) + 1)), versions
    assert versions[-1] >= seen[-1]["newest"] >= 2, (versions, seen[-1])
    # and Prometheus saw it: the served-weights panel and gauges have data
    weights_checks = [c for c in panel_queries() + rule_queries() if "weights" in c.components]
    assert weights_checks
    empty: list = []

    def weights_panels_have_data():
        empty[:] = missing_data(stack.prometheus, {"operator", "weights"}, weights_checks,
                                since=moment - 300)[0]
        return not empty

    wait_for("the served-weights panels' data", weights_panels_have_data, timeout=60,
             on_timeout=lambda: str([c.source for c in empty]))
    routed_to_both_replicas(stack, ns, "whole")
    # deleting the run mid-way stops it, and the cleanup Job empties its bucket folder; in
    # the foreground, as GitOps tools delete: the run's children (its ServiceAccount, which
    # the cleanup Job runs as, among them) go first
    stack.kubectl("-n", ns, "delete", "agr", "whole", "--cascade=foreground", "--wait=true",
                  timeout=300)
    left = [o["Key"] for o in stack.s3.client().list_objects_v2(
        Bucket="e2e-whole").get("Contents", [])]
    assert not [k for k in left if k.startswith(f"asyncgrpo/{ns}/whole/")], left


def routed_to_both_replicas(stack, ns: str, run: str) -> None:
    """Issue 26 on the node: with two vLLM replicas the trainer routes rollouts by group (on
    by default), and that is seen, not assumed: the run's status names both replicas with
    the requests the router sent each and vLLM's own prefix-cache counters, and a real
    Prometheus has the per-replica series the dashboard draws (routed requests by replica,
    prefix-cache hits by pod)."""
    replicas: list[dict] = []

    def both_routed():
        replicas[:] = status_of(stack, run, ns).get("rolloutReplicas") or []
        return sum(1 for r in replicas if r.get("requestsRouted", 0) > 0
                   and r.get("prefixCacheQueries", 0) > 0 and r.get("pod")) == 2

    wait_for("status.rolloutReplicas: both replicas routed to, their caches queried",
             both_routed, timeout=180, interval=2, on_timeout=lambda: str(replicas))
    print(f"E2E routing: status.rolloutReplicas {replicas}")
    assert sum(r.get("prefixCacheHits", 0) for r in replicas) > 0, replicas

    prom, sel = stack.prometheus, f'namespace="{ns}", run="{run}"'
    found: dict = {}

    def per_replica_series():
        found["routed"] = {s["metric"].get("replica"): float(s["value"][1]) for s in prom.query(
            f"sum by (replica) (asyncgrpo_trainer_rollout_routed_requests_total{{{sel}}})")}
        found["hits"] = {s["metric"].get("pod"): float(s["value"][1]) for s in prom.query(
            f"sum by (pod) (vllm:prefix_cache_hits_total{{{sel}}})")}
        found["failovers"] = [float(s["value"][1]) for s in prom.query(
            f"sum(asyncgrpo_trainer_rollout_route_failovers_total{{{sel}}})")]
        return (len([v for v in found["routed"].values() if v > 0]) == 2
                and len(found["hits"]) == 2 and sum(found["hits"].values()) > 0)

    wait_for("Prometheus: routed requests per replica and prefix-cache hits per pod",
             per_replica_series, timeout=120, interval=2, on_timeout=lambda: str(found))
    print(f"E2E routing in Prometheus: {found}")


def puller_histories(stack, ns: str) -> dict[str, list[dict]]:
    """Each vLLM pod's swaps as its weights puller reports them (pod IP, from the host)."""
    import urllib.request

    from asyncgrpo.wire import PULLER_PORT

    pods = json.loads(stack.kubectl("-n", ns, "get", "pods", "-l",
                                    "app.kubernetes.io/component=vllm", "-o", "json"))
    out = {}
    for pod in pods["items"]:
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            continue
        try:
            with urllib.request.urlopen(f"http://{ip}:{PULLER_PORT}/status", timeout=5) as r:
                out[pod["metadata"]["name"]] = json.loads(r.read()).get("history", [])
        except OSError:
            continue
    return out


def trainer_published(stack, ns: str, run: str) -> list[dict]:
    """Rank 0's publish records (its status.json in the trainer's work dir); [] when the pod
    is not there to ask."""
    from asyncgrpo.wire import TRAINER_WORK_DIR

    out = stack.kubectl("-n", ns, "exec", f"{run}-trainer-0", "-c", "trainer", "--", "python3",
                        "-c", f"import sys;sys.stdout.write(open('{TRAINER_WORK_DIR}"
                        "/status.json').read())", check=False)
    try:
        return json.loads(out).get("published", [])
    except ValueError:
        return []


def manifest_times(stack, bucket: str) -> dict[int, dict]:
    """Each complete weights version's manifest: its kind, bytes and format, and when the
    bucket took it (the manifest is written last, so its LastModified is "publish done";
    the S3 server stamps it in milliseconds, on the same host clock the pods read)."""
    s3 = stack.s3.client()
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            parts = o["Key"].split("/")
            if "weights" in parts and parts[-1] == "manifest.json":
                doc = json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
                out[int(doc["version"])] = {
                    "version": int(doc["version"]), "kind": doc["kind"],
                    "format": doc["format"], "published_at": o["LastModified"].timestamp(),
                    "bytes": sum(f["size"] for f in doc["files"].values()),
                    "rank_bytes": {r: sum(doc["files"][f]["size"] for f in fs) for r, fs in
                                   (doc.get("shards") or {}).get("ranks", {}).items()}}
    return out


# The reference workload's shape, and its dense sibling, through the same sharded path.
TWO_POD_FULL_RUNS = [
    pytest.param("flagship", {"name": MOE_MODEL_PATH, "moe": True}, {"expertParallelSize": 2},
                 id="moe-expert-parallel"),
    pytest.param("dense", {}, {}, id="dense"),
]


@pytest.mark.parametrize(("name", "model_fields", "trainer_fields"), TWO_POD_FULL_RUNS)
def test_full_fine_tuning_two_trainer_pods_sharded_to_two_replicas(e2e_stack, name,
                                                                   model_fields, trainer_fields):
    """Full fine-tuning by two trainer pods (world 2, FSDP 2, gloo), each publishing its own
    shard of every version (asyncgrpo.weights/v2), two vLLM replicas swapping each version in
    from the bucket. moe-expert-parallel is the reference workload's shape, tiny: a
    Qwen3-MoE with expert parallel 2; dense is the tiny dense Qwen3 on the same path. Every
    replica's served log-probs must equal the trainer's probe of the same version (1e-4) at
    several versions, status.servedWeights shows both replicas, and the run trains to
    Succeeded."""
    stack, ns = e2e_stack, f"team-{name}"
    stack.namespace(ns)
    run = tiny_run(name, ns, stack.s3.endpoint, steps=8, replicas=2,
                   extra_trainer={"checkpointInterval": 100, **trainer_fields})
    model = run["spec"]["model"]
    del model["lora"]
    model |= {**model_fields, "finetuning": "full",
              "full": {"anchorInterval": 2, "localDisk": "1Gi"}}
    run["spec"]["adapterStore"]["retention"] = 100
    rollout = run["spec"]["rollout"]
    rollout["replicas"] = 2
    for key in ("maxLoras", "maxLoraRank"):
        del rollout[key]
    stack.apply(prompts_configmap(ns), run)

    swaps: dict[str, dict[int, dict]] = {}   # pod -> version -> the puller's record
    trainer: dict[int, dict] = {}            # version -> rank 0's publish record

    def finished():
        for pod, history in puller_histories(stack, ns).items():
            swaps.setdefault(pod, {}).update({h["version"]: h for h in history})
        s = status_of(stack, name, ns)
        if s.get("servedWeights"):
            served.append(s["servedWeights"])
        if s.get("phase") == "Running":  # the trainer's own clock: when each publish was done
            trainer.update({p["version"]: p for p in trainer_published(stack, ns, name)})
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    served: list[dict] = []                  # status.servedWeights over the run
    status = wait_for(f"the {name} run finished", finished, timeout=1200, interval=2,
                      on_timeout=lambda: stack.describe(ns)
                      + stack.logs(ns, "app.kubernetes.io/component=trainer"))
    diffs = {pod: {v: h.get("probe_max_diff") for v, h in sorted(by.items())}
             for pod, by in swaps.items()}
    print(f"\nE2E {name}: status {json.dumps({k: status.get(k) for k in ('phase', 'step')})}"
          f", probe max diff per replica and version {diffs}")
    assert status["phase"] == "Succeeded" and status["step"] == 8, json.dumps(status, indent=1)
    assert len(swaps) == 2, swaps
    assert any(w["replicas"] == 2 and w["oldest"] >= 1 for w in served), served
    for pod, by_version in swaps.items():
        probed = {v: h for v, h in by_version.items() if "probe_max_diff" in h}
        assert not [h for h in by_version.values() if "probe_error" in h], by_version
        assert len(probed) >= 2, (pod, by_version)  # several versions checked on each replica
        worst = max(h["probe_max_diff"] for h in probed.values())
        assert worst <= 1e-4, (pod, {v: h["probe_max_diff"] for v, h in probed.items()})
    versions = published_versions(stack, f"e2e-{name}", "weights")
    assert versions == list(range(1, len(versions) + 1)), versions
    published = manifest_times(stack, f"e2e-{name}")
    # every version went out sharded: one object per trainer rank, both ranks uploading
    assert {p["format"] for p in published.values()} == {"asyncgrpo.weights/v2"}, published
    anchors = [p for p in published.values() if p["kind"] == "anchor"]
    assert anchors and all(set(p["rank_bytes"]) == {"0", "1"} for p in anchors), anchors
    # publish done -> both replicas serving it, for bench/weights_bench.py (--e2e FILE): the
    # trainer's record where it was read (its clock, to the microsecond), else the manifest's
    # LastModified (to the second)
    for v, p in published.items():
        if v in trainer:
            p |= {"published_at": trainer[v]["published_at"], "clock": "trainer",
                  "publish_s_rank0": trainer[v].get("publish_s")}
    report = {"run": name, "where": "test node, operator's pods", "published": [
        published[v] for v in sorted(published)],
        "served": [sorted(by.values(), key=lambda h: h["version"]) for by in swaps.values()]}
    if out := os.environ.get("ASYNCGRPO_BENCH_OUT"):
        (Path(out) / f"sharded_e2e_{name}.json").write_text(json.dumps(report, indent=1))


def test_a_failing_sandbox_pool_fires_its_alert(e2e_stack):
    """A forced fault seen the way on-call sees it: sandbox pods that cannot start are
    counted failed by the operator, and Prometheus fires AsyncGRPOSandboxesFailing for that
    run (the e2e loads the chart's rules with their `for:` hold at 0)."""
    stack, ns = e2e_stack, "team-broken"
    stack.namespace(ns)
    run = tiny_run("broken", ns, stack.s3.endpoint, steps=2)
    run["spec"]["rollout"]["gpusPerReplica"] = 1   # vLLM waits for a GPU: nothing else runs
    run["spec"]["sandboxes"] = {"image": "asyncgrpo.local/no-such-sandbox:1", "minWarm": 1,
                                "max": 1, "hardCap": 2}
    stack.apply(prompts_configmap(ns), run)

    def firing():
        return [a for a in stack.prometheus.alerts()
                if a["labels"].get("alertname") == "AsyncGRPOSandboxesFailing"
                and a["labels"].get("run") == "broken" and a["state"] == "firing"]

    alerts = wait_for("AsyncGRPOSandboxesFailing firing for the run", firing, timeout=300,
                      on_timeout=lambda: stack.describe(ns))
    assert alerts[0]["labels"]["namespace"] == ns, alerts
    assert not [a for a in stack.prometheus.alerts()
                if a["labels"].get("alertname") == "AsyncGRPOSandboxesFailing"
                and a["labels"].get("run") not in ("broken", None)], "another run blamed"
    stack.kubectl("-n", ns, "delete", "agr", "broken", "--wait=true", timeout=180)
