"""Placement on the test node (issue 24): the node is tainted and labelled as managed
clusters do a GPU pool; a run whose pods carry the toleration and nodeSelector trains to
Succeeded, with its pull secret and workload identity on the objects; the same run without
them reports why it waits (a condition with the scheduler's reason, and an event).

The placed run also reads its model from a model cache (spec.model.cache): a local
PersistentVolume on the node, bound to a claim, filled once by a Job (the first pod: it lays
the tiny model out as the hub's cache, models--<org>--<name>/{blobs,snapshots/<rev>,refs/main},
as `hf download` would), then mounted read-only at HF_HOME of vLLM and the trainer, whose
spec.model.name is a hub id. The pods run with HF_HUB_OFFLINE=1 on a node with no route out,
so the cache is the only place the model can come from. Then two pod starts load the same
hub id online from a stand-in hub (tests/e2e/hub.py): without the cache (an emptyDir HF_HOME)
the hub sends the whole model, with it none. The bytes are asserted; the times and what the
run's starts did not download are printed (docs/benchmarks/model-cache.md).

The tiny runs are CPU runs (no GPU request, so no automatic GPU toleration): the toleration
comes from spec.pod, as a platform team's run would carry a pool's taint. The taint is
removed whatever happens, so later tests schedule again.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

import pytest

from asyncgrpo import wire
from asyncgrpo.testing.node import HOST_IP

from .conftest import E2E_TRAINER_IMAGE, MODEL_PATH, model_folder, wait_for
from .hub import REVISION as HUB_REVISION
from .hub import HubServer
from .test_runs_on_the_node import status_of
from .test_tiny_lora_run import prompts_configmap, tiny_run

# one test walks four phases (cache fill, placed run, unplaced run, two pod starts); under
# load the placed run alone took 203 s, so the suite's 900 s per test is too short here
pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, pytest.mark.timeout(1800)]

TAINT = "nvidia.com/gpu=present:NoSchedule"
POOL = {"asyncgrpo.dev/e2e-pool": "gpu"}
TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ROLE = "arn:aws:iam::123456789012:role/e2e"
HUB_ID = "asyncgrpo-e2e/tiny-qwen3"
#: the revision the cache's refs/main names: the stand-in hub's, so online pods find it cached
REVISION = HUB_REVISION

#: lays a model folder out as huggingface_hub's cache does (content-addressed blobs, a
#: snapshot of relative symlinks, refs/main), under HF_HOME/hub on the claim
FILL_CACHE = """
import hashlib, json, os, shutil, sys, time
src, repo_id, rev, hub = sys.argv[1:5]
t0 = time.monotonic()
repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
snap = os.path.join(repo, "snapshots", rev)
os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
os.makedirs(snap, exist_ok=True)
size = 0
for name in sorted(os.listdir(src)):
    data = open(os.path.join(src, name), "rb").read()
    blob = hashlib.sha256(data).hexdigest()
    with open(os.path.join(repo, "blobs", blob), "wb") as f:
        f.write(data)
    link = os.path.join(snap, name)
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.join("..", "..", "blobs", blob), link)
    size += len(data)
with open(os.path.join(repo, "refs", "main"), "w") as f:
    f.write(rev)
print(json.dumps({"model_bytes": size, "files": len(os.listdir(snap)),
                  "fill_seconds": round(time.monotonic() - t0, 3)}))
"""


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


def model_cache_on_the_node(stack, ns: str, node: str) -> dict:
    """A local PersistentVolume on the node (a folder of the host, which is the node's disk),
    its claim `hf-cache`, and a Job that fills it with the tiny model in the hub's layout.
    Returns what the Job printed (model bytes, fill time)."""
    path = stack.workdir / "hf-cache-pv"
    path.mkdir(exist_ok=True)
    path.chmod(0o777)       # the pods run as 65532
    hostname = json.loads(stack.kubectl("get", "node", node, "-o", "json"))[
        "metadata"]["labels"]["kubernetes.io/hostname"]
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "e2e-hf-cache"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "e2e-local",
                   "local": {"path": str(path)},
                   "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                       {"key": "kubernetes.io/hostname", "operator": "In",
                        "values": [hostname]}]}]}}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": "hf-cache", "namespace": ns},
           "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "e2e-local",
                    "volumeName": "e2e-hf-cache", "resources": {"requests": {"storage": "1Gi"}}}}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "fill-hf-cache", "namespace": ns},
           "spec": {"backoffLimit": 0, "template": {"spec": {
               "restartPolicy": "Never", "tolerations": [TOLERATION], "nodeSelector": POOL,
               "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
               "containers": [{
                   "name": "fill", "image": E2E_TRAINER_IMAGE, "imagePullPolicy": "Never",
                   "command": ["python", "-c", FILL_CACHE, MODEL_PATH, HUB_ID, REVISION,
                               "/cache/hub"],
                   "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}],
               "volumes": [{"name": "cache",
                            "persistentVolumeClaim": {"claimName": "hf-cache"}}]}}}}
    stack.apply(pv, pvc, job)
    wait_for("the cache Job complete", lambda: any(
        c["type"] == "Complete" and c["status"] == "True"
        for c in (stack.get("job", "fill-hf-cache", ns) or {}).get("status", {})
        .get("conditions", [])), timeout=300,
        on_timeout=lambda: stack.describe(ns) + stack.logs(ns, "job-name=fill-hf-cache"))
    assert stack.get("pvc", "hf-cache", ns)["status"]["phase"] == "Bound"
    filled = json.loads(stack.kubectl("-n", ns, "logs", "job/fill-hf-cache").splitlines()[-1])
    snapshot = path / "hub" / "models--asyncgrpo-e2e--tiny-qwen3" / "snapshots" / REVISION
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()
    return filled


#: what a trainer pod does at start with spec.model.name (transformers from the hub or its
#: cache), timed without the imports; the hub's bytes are counted by the stand-in hub
LOAD_MODEL = """
import json, sys, time
from transformers import AutoModelForCausalLM, AutoTokenizer
t0 = time.monotonic()
AutoTokenizer.from_pretrained(sys.argv[1])
AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(json.dumps({"load_seconds": round(time.monotonic() - t0, 3)}))
"""


def load_in_a_pod(stack, ns: str, name: str, hub, volume: dict) -> dict:
    """One pod start that loads HUB_ID with HF_HOME on `volume`, online against `hub`:
    its load time and the bytes the hub sent it."""
    before = hub.bytes_sent
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
           "spec": {"restartPolicy": "Never", "tolerations": [TOLERATION], "nodeSelector": POOL,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                    "containers": [{
                        "name": "load", "image": E2E_TRAINER_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["python", "-c", LOAD_MODEL, HUB_ID],
                        "env": [{"name": "HF_HOME", "value": "/cache"},
                                {"name": "HF_ENDPOINT", "value": hub.endpoint},
                                {"name": "HF_HUB_DISABLE_XET", "value": "1"},
                                {"name": "OMP_NUM_THREADS", "value": "1"}],
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}],
                    "volumes": [{"name": "cache", **volume}]}}
    stack.apply(pod)
    wait_for(f"pod {name} Succeeded", lambda: (stack.get("pod", name, ns) or {}).get(
        "status", {}).get("phase") in ("Succeeded", "Failed"), timeout=300,
        on_timeout=lambda: stack.describe(ns))
    log = stack.kubectl("-n", ns, "logs", name)
    assert stack.get("pod", name, ns)["status"]["phase"] == "Succeeded", log
    return {**json.loads(log.splitlines()[-1]), "hub_bytes": hub.bytes_sent - before}


def _seconds(a: str, b: str) -> float:
    def at(t):
        return datetime.fromisoformat(t).timestamp()
    return at(b) - at(a)


def start_to_ready(pod: dict) -> float | None:
    """Seconds from the main container's start to the pod's Ready (the model loaded)."""
    started = [c["state"]["running"]["startedAt"]
               for c in pod["status"].get("containerStatuses", [])
               if "running" in c.get("state", {})]
    ready = [c["lastTransitionTime"] for c in pod["status"].get("conditions", [])
             if c["type"] == "Ready" and c["status"] == "True"]
    return _seconds(min(started), ready[0]) if started and ready else None


def test_a_run_placed_on_a_tainted_pool_trains_and_one_without_says_why(e2e_stack,
                                                                        gpu_pool_node):
    stack, ns = e2e_stack, "team-placed"
    stack.namespace(ns)
    filled = model_cache_on_the_node(stack, ns, gpu_pool_node)
    stack.kubectl("-n", ns, "create", "secret", "docker-registry", "registry",
                  "--docker-server=registry.example.com", "--docker-username=u",
                  "--docker-password=p")
    placed = tiny_run("placed", ns, stack.s3.endpoint, steps=2)
    placed["spec"]["pod"] = {"tolerations": [TOLERATION], "nodeSelector": POOL,
                             "imagePullSecrets": [{"name": "registry"}],
                             "labels": {"kueue.x-k8s.io/queue-name": "team-a"}}
    placed["spec"]["serviceAccount"] = {"annotations": {"eks.amazonaws.com/role-arn": ROLE}}
    # the model by its hub id, from the cache only (read-only: HF_HUB_OFFLINE=1)
    placed["spec"]["model"]["name"] = HUB_ID
    placed["spec"]["model"]["cache"] = {"claimName": "hf-cache", "readOnly": True}
    applied = time.monotonic()
    stack.apply(prompts_configmap(ns), placed)
    # the run's pods as they ran: a finished run's workloads are scaled to zero, so they are
    # looked at while it runs
    seen: dict[str, dict] = {}
    vllm_logs: dict[str, str] = {}

    def finished():
        for p in json.loads(stack.kubectl("-n", ns, "get", "pods", "-l",
                                          "asyncgrpo.dev/run=placed", "-o", "json"))["items"]:
            name = p["metadata"]["name"]
            # the last look at a pod, but never one that lost its Ready measurement: a pod
            # whose container has terminated no longer shows when it started
            if p["spec"].get("nodeName") and (name not in seen
                                              or start_to_ready(seen[name]) is None):
                seen[name] = p
            if (p["metadata"]["labels"].get("app.kubernetes.io/component") == "vllm"
                    and name not in vllm_logs and start_to_ready(p) is not None):
                vllm_logs[name] = stack.kubectl("-n", ns, "logs", name, "-c", "vllm",
                                                check=False)
        s = status_of(stack, "placed", ns)
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    status = wait_for("the placed run finished", finished, timeout=1200, interval=2,
                      on_timeout=lambda: stack.describe(ns)
                      + stack.logs(ns, "app.kubernetes.io/component=trainer"))
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    succeeded_after = round(time.monotonic() - applied, 1)

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

    # the model cache: both components mounted the claim read-only at HF_HOME and ran offline
    model_pods = [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"]
                  in ("trainer", "vllm")]
    for p in model_pods:
        volumes = {v["name"]: v for v in p["spec"]["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"] == {
            "claimName": "hf-cache", "readOnly": True}, p["metadata"]["name"]
        main = p["spec"]["containers"][0]
        assert {"name": "model-cache", "mountPath": wire.HF_HOME, "readOnly": True} in [
            {k: m[k] for k in ("name", "mountPath", "readOnly") if k in m}
            for m in main["volumeMounts"]], main["volumeMounts"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in main["env"]
    # what the later pod starts did not download: the model, once per start
    ready = {p["metadata"]["name"]: start_to_ready(p) for p in model_pods}
    loads = [line.strip() for log in vllm_logs.values() for line in log.splitlines()
             if "Loading weights took" in line or "Model loading took" in line]
    # the same model, online against a stand-in hub: a pod start without a cache (HF_HOME
    # an emptyDir, as runs without spec.model.cache have) downloads it; one with the cache
    # only asks the hub for its metadata
    with HubServer({HUB_ID: model_folder()}, host=HOST_IP) as hub:
        without = load_in_a_pod(stack, ns, "load-without-cache", hub, {"emptyDir": {}})
        with_cache = load_in_a_pod(stack, ns, "load-with-cache", hub, {
            "persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": True}})
    assert without["hub_bytes"] == filled["model_bytes"], without
    assert with_cache["hub_bytes"] == 0, with_cache
    measured = json.dumps({
        **filled, "one_pod_start_without_cache": without, "one_pod_start_with_cache": with_cache,
        "pod_starts_reading_the_cache": len(model_pods),
        "bytes_not_downloaded": filled["model_bytes"] * len(model_pods),
        "start_to_ready_seconds": ready, "vllm_model_load": loads,
        "apply_to_succeeded_seconds": succeeded_after})
    print("model cache:", measured)
    if out := os.environ.get("ASYNCGRPO_BENCH_OUT"):   # docs/benchmarks/model-cache.md
        (Path(out) / "model_cache_e2e.json").write_text(measured)
    assert all(v is not None for v in ready.values()), ready

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
