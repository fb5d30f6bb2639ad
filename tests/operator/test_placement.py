"""Pod settings (issue 24): every field reaches every pod of its component, run-wide settings
merge under the component's, the operator's labels, volumes, variables and security settings
win, GPU pods tolerate the GPU pool's taint, the model cache is mounted at HF_HOME."""

from __future__ import annotations

import copy

import pytest

from asyncgrpo import wire
from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.api.validation import parse_run, validate_run
from asyncgrpo.controller import bucketjob, gateway, rbac, sandboxes, trainer, vllm
from asyncgrpo.controller.common import pod_security

from ..api.invalid_specs import base_run

JOBS = bucketjob.JobSettings(image="op:1")

SETTINGS = {
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                     "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "topology.kubernetes.io/zone", "operator": "In",
             "values": ["us-east-1a"]}]}]}}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "priorityClassName": "training",
    "schedulerName": "volcano",
    "imagePullSecrets": [{"name": "registry"}],
    "labels": {"kueue.x-k8s.io/queue-name": "team-a"},
    "annotations": {"example.com/owner": "ml"},
    "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
}

#: component -> where its settings go in the spec.
AT = {"trainer": ("trainer", "pod"), "vllm": ("rollout", "pod"),
      "sandbox": ("sandboxes", "pod"), "gateway": ("sandboxes", "gatewayPod"),
      "bucket": ("adapterStore", "bucketJobPod")}


def doc_with(**at) -> dict:
    doc = base_run()
    doc["metadata"]["namespace"] = "ns"
    doc["spec"].setdefault("sandboxes", {})
    for dotted, value in at.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = copy.deepcopy(value)
    return doc


def pods(run: AsyncGRPORun) -> dict[str, dict]:
    """Each component's pod (template): metadata and spec."""
    return {
        "trainer": trainer.build_statefulset(run)["spec"]["template"],
        "vllm": vllm.build_deployment(run)["spec"]["template"],
        "gateway": gateway.build_deployment(run)["spec"]["template"],
        "sandbox": sandboxes.build_pod(run, "0"),
        "bucket": bucketjob.build_job(run, bucketjob.SETUP, "uid", JOBS)["spec"]["template"],
    }


def assert_has_settings(pod: dict, s: dict) -> None:
    spec, main = pod["spec"], pod["spec"]["containers"][0]
    assert spec["nodeSelector"] == s["nodeSelector"]
    for t in s["tolerations"]:
        assert t in spec["tolerations"]
    assert spec["affinity"] == s["affinity"]
    assert spec["topologySpreadConstraints"] == s["topologySpreadConstraints"]
    assert spec["priorityClassName"] == s["priorityClassName"]
    assert spec["schedulerName"] == s["schedulerName"]
    assert spec["imagePullSecrets"] == s["imagePullSecrets"]
    assert pod["metadata"]["labels"].items() >= s["labels"].items()
    assert pod["metadata"]["annotations"].items() >= s["annotations"].items()
    for v in s["volumes"]:
        assert v in spec["volumes"]
    for m in s["volumeMounts"]:
        assert m in main["volumeMounts"]
    for e in s["env"]:
        assert e in main["env"]


@pytest.mark.parametrize("component", sorted(AT))
def test_component_settings_reach_every_pod_of_the_component(component):
    section, field = AT[component]
    run = parse_run(doc_with(**{f"{section}__{field}": SETTINGS}))
    built = pods(run)
    assert_has_settings(built[component], SETTINGS)
    for other, pod in built.items():   # and no other component's
        if other != component:
            assert "nodeSelector" not in pod["spec"], other


def test_run_wide_settings_reach_every_component():
    run = parse_run(doc_with(pod=SETTINGS))
    for pod in pods(run).values():
        assert_has_settings(pod, SETTINGS)
    cleanup = bucketjob.build_job(run, bucketjob.CLEANUP, "uid", JOBS)["spec"]["template"]
    assert_has_settings(cleanup, SETTINGS)


def test_component_settings_merge_over_run_wide_ones():
    run = parse_run(doc_with(
        pod={"nodeSelector": {"pool": "cpu", "arch": "amd64"},
             "tolerations": [{"key": "a", "operator": "Exists"}],
             "labels": {"team": "a", "tier": "x"},
             "imagePullSecrets": [{"name": "one"}],
             "volumes": [{"name": "v", "emptyDir": {}}],
             "volumeMounts": [{"name": "v", "mountPath": "/v"}],
             "env": [{"name": "A", "value": "run"}, {"name": "B", "value": "run"}],
             "priorityClassName": "low",
             "affinity": SETTINGS["affinity"]},
        trainer__pod={"nodeSelector": {"pool": "gpu"},
                      "tolerations": [{"key": "b", "operator": "Exists"}],
                      "labels": {"tier": "y"},
                      "imagePullSecrets": [{"name": "one"}, {"name": "two"}],
                      "volumes": [{"name": "v", "hostPath": {"path": "/mnt"}}],
                      "env": [{"name": "B", "value": "trainer"}],
                      "priorityClassName": "high"}))
    pod = pods(run)["trainer"]
    spec, main = pod["spec"], pod["spec"]["containers"][0]
    assert spec["nodeSelector"] == {"pool": "gpu", "arch": "amd64"}       # by key
    assert [t["key"] for t in spec["tolerations"]][:2] == ["a", "b"]      # appended
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"]["tier"] == "y"
    assert spec["imagePullSecrets"] == [{"name": "one"}, {"name": "two"}]  # once each
    assert {"name": "v", "hostPath": {"path": "/mnt"}} in spec["volumes"]  # by name
    assert {"name": "v", "mountPath": "/v"} in main["volumeMounts"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["A"] == "run" and env["B"] == "trainer"
    assert spec["priorityClassName"] == "high"
    assert spec["affinity"] == SETTINGS["affinity"]                       # inherited
    # vLLM has no settings of its own: the run-wide ones as they are
    v = pods(run)["vllm"]["spec"]
    assert v["nodeSelector"] == {"pool": "cpu", "arch": "amd64"}
    assert v["priorityClassName"] == "low"


def _unchecked(doc: dict) -> AsyncGRPORun:
    """A run that skipped validation (the builders must still protect the pods)."""
    return AsyncGRPORun.model_validate(doc)


def test_operator_owned_entries_win_in_the_builders():
    hostile = {
        "labels": {"app.kubernetes.io/component": "evil", "asyncgrpo.dev/run": "other"},
        "annotations": {"asyncgrpo.dev/spec-hash": "x", "prometheus.io/port": "1"},
        "volumes": [{"name": "tmp", "hostPath": {"path": "/"}},
                    {"name": "cache", "hostPath": {"path": "/"}},
                    {"name": "workspace", "hostPath": {"path": "/"}}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/etc/asyncgrpo"}],
        "env": [{"name": "ASYNCGRPO_ADAPTER_BUCKET", "value": "other"},
                {"name": "HF_HOME", "value": "/elsewhere"},
                {"name": "ASYNCGRPO_SANDBOX_TOKEN", "value": "known"}],
    }
    doc = doc_with(pod=hostile)
    run, errors = validate_run(doc)
    assert run is not None and errors    # refused by validation...
    clean = pods(parse_run(doc_with()))
    for component, pod in pods(_unchecked(doc)).items():   # ...and harmless if it got past
        meta, spec = pod["metadata"], pod["spec"]
        want = clean[component]
        for key in ("app.kubernetes.io/component", "asyncgrpo.dev/run"):
            assert meta["labels"][key] == want["metadata"]["labels"][key], component
        assert "prometheus.io/port" not in meta.get("annotations", {}) or \
            meta["annotations"]["prometheus.io/port"] == \
            want["metadata"]["annotations"]["prometheus.io/port"]
        assert spec["volumes"] == want["spec"]["volumes"], component
        main, want_main = spec["containers"][0], want["spec"]["containers"][0]
        assert main["volumeMounts"] == want_main["volumeMounts"], component
        assert main["env"] == want_main["env"], component
        assert spec["securityContext"] == pod_security() == want["spec"]["securityContext"]
        assert main["securityContext"] == want_main["securityContext"]
        assert spec["serviceAccountName"] == want["spec"]["serviceAccountName"]
        assert spec["automountServiceAccountToken"] == \
            want["spec"]["automountServiceAccountToken"]


def test_every_conflict_is_refused_with_its_field_path():
    doc = doc_with(pod={"labels": {"app.kubernetes.io/name": "x"}},
                   sandboxes__pod={"env": [{"name": "AWS_ACCESS_KEY_ID", "value": "x"}]},
                   sandboxes__gatewayPod={"annotations": {"asyncgrpo.dev/x": "y"}})
    _, errors = validate_run(doc)
    paths = {e.path for e in errors}
    assert paths == {"spec.pod.labels.app.kubernetes.io/name",
                     "spec.sandboxes.pod.env[0].name",
                     "spec.sandboxes.gatewayPod.annotations.asyncgrpo.dev/x"}


def test_gpu_pods_tolerate_the_gpu_pool_taint_by_default():
    doc = doc_with(trainer__gpusPerReplica=2, rollout__gpusPerReplica=1)
    doc["spec"]["model"]["attention"] = "auto"
    built = pods(parse_run(doc))
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for component in ("trainer", "vllm"):
        spec = built[component]["spec"]
        assert spec["tolerations"] == [gpu], component
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] in (1, 2)
    for component in ("gateway", "sandbox", "bucket"):   # no GPUs: no toleration
        assert "tolerations" not in built[component]["spec"], component


def test_cpu_pods_get_no_gpu_toleration():
    built = pods(parse_run(doc_with(trainer__gpusPerReplica=0, rollout__gpusPerReplica=0)))
    assert "tolerations" not in built["trainer"]["spec"]
    assert "tolerations" not in built["vllm"]["spec"]


def test_gpu_resource_name_is_configurable_and_the_toleration_follows():
    doc = doc_with(trainer__gpusPerReplica=1, rollout__gpusPerReplica=1)
    doc["spec"]["gpuResourceName"] = "amd.com/gpu"
    built = pods(parse_run(doc))
    for component in ("trainer", "vllm"):
        spec = built[component]["spec"]
        res = spec["containers"][0]["resources"]
        assert res["limits"]["amd.com/gpu"] == 1 and res["requests"]["amd.com/gpu"] == 1
        assert "nvidia.com/gpu" not in res["limits"]
        assert spec["tolerations"] == [
            {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_gpu_toleration_can_be_turned_off_or_replaced():
    doc = doc_with(trainer__gpusPerReplica=1, rollout__gpusPerReplica=1,
                   pod={"gpuToleration": False},
                   rollout__pod={"tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal",
                                                  "value": "a100", "effect": "NoSchedule"}],
                                 "gpuToleration": True})
    built = pods(parse_run(doc))
    assert "tolerations" not in built["trainer"]["spec"]
    assert built["vllm"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "a100",
         "effect": "NoSchedule"}]


@pytest.mark.parametrize("read_only", [False, True])
def test_model_cache_is_mounted_at_hf_home_of_trainer_and_vllm(read_only):
    run = parse_run(doc_with(model__cache={"claimName": "hf-cache", "readOnly": read_only,
                                           "subPath": "hub"}))
    built = pods(run)
    for component in ("trainer", "vllm"):
        spec = built[component]["spec"]
        main = spec["containers"][0]
        claim = {"claimName": "hf-cache", **({"readOnly": True} if read_only else {})}
        assert {"name": "model-cache", "persistentVolumeClaim": claim} in spec["volumes"]
        mount = next(m for m in main["volumeMounts"] if m["name"] == "model-cache")
        assert mount["mountPath"] == wire.HF_HOME and mount["subPath"] == "hub"
        assert mount.get("readOnly", False) is read_only
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert env["HF_HOME"] == wire.HF_HOME
        assert ("HF_HUB_OFFLINE" in env) is read_only
    for component in ("gateway", "sandbox", "bucket"):
        assert all(v["name"] != "model-cache" for v in built[component]["spec"]["volumes"])


def test_model_cache_takes_any_volume():
    run = parse_run(doc_with(model__cache={"volume": {
        "name": "hf", "nfs": {"server": "nfs.local", "path": "/hf"}}}))
    spec = pods(run)["vllm"]["spec"]
    assert {"name": "hf", "nfs": {"server": "nfs.local", "path": "/hf"}} in spec["volumes"]
    assert any(m["name"] == "hf" and m["mountPath"] == wire.HF_HOME
               for m in spec["containers"][0]["volumeMounts"])


def test_service_accounts_carry_pull_secrets_and_the_workload_identity():
    run = parse_run(doc_with(
        pod={"imagePullSecrets": [{"name": "registry"}]},
        serviceAccount={"annotations": {
            "eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r",
            "iam.gke.io/gcp-service-account": "t@p.iam.gserviceaccount.com"}}))
    accounts = [o for o in rbac.build_rbac(run) if o["kind"] == "ServiceAccount"]
    assert len(accounts) == 3
    for sa in accounts:
        assert sa["imagePullSecrets"] == [{"name": "registry"}]
    workload = next(a for a in accounts if a["metadata"]["name"].endswith("-workload"))
    notes = workload["metadata"]["annotations"]
    assert notes["eks.amazonaws.com/role-arn"] == "arn:aws:iam::1:role/r"
    assert notes["iam.gke.io/gcp-service-account"] == "t@p.iam.gserviceaccount.com"
    others = [a for a in accounts if a is not workload]
    assert all("eks.amazonaws.com/role-arn" not in a["metadata"]["annotations"] for a in others)


def test_settings_move_the_pod_hashes():
    before = parse_run(doc_with())
    after = parse_run(doc_with(pod={"nodeSelector": {"pool": "gpu"}}))
    assert sandboxes.current_hash(before) != sandboxes.current_hash(after)
    for build in (trainer.build_statefulset, vllm.build_deployment):
        assert build(before)["metadata"]["annotations"] != build(after)["metadata"][
            "annotations"]


def test_the_operators_gpu_resource_is_the_default_of_runs_that_name_none():
    from asyncgrpo.controller.common import operator_defaults

    doc = doc_with(trainer__gpusPerReplica=1)
    amd = operator_defaults(parse_run(doc), "amd.com/gpu")
    limits = pods(amd)["trainer"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["amd.com/gpu"] == 1 and "nvidia.com/gpu" not in limits
    doc["spec"]["gpuResourceName"] = "example.com/npu"   # the run's own choice wins
    own = operator_defaults(parse_run(doc), "amd.com/gpu")
    assert own.spec.gpu_resource_name == "example.com/npu"


def test_the_gpu_cluster_example_places_every_pod_as_it_says():
    from pathlib import Path

    from asyncgrpo.api import load_run

    run = load_run(Path(__file__).resolve().parents[2] / "examples" / "gpu-cluster.yaml")
    run.metadata.namespace = "ns"
    built = pods(run)
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for component, pod in built.items():
        spec = pod["spec"]
        assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}], component
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert spec["priorityClassName"] == "training"
        on_gpus = component in ("trainer", "vllm")
        assert (gpu in spec.get("tolerations", [])) is on_gpus, component
        if on_gpus:
            assert spec["nodeSelector"] == {"pool": "gpu"}
            assert any(m["mountPath"] == wire.HF_HOME
                       for m in spec["containers"][0]["volumeMounts"])
    assert built["sandbox"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    workload = next(a for a in rbac.build_rbac(run) if a["metadata"]["name"].endswith(
        "-workload"))
    assert "eks.amazonaws.com/role-arn" in workload["metadata"]["annotations"]


def test_an_unschedulable_bucket_setup_pod_says_why_the_run_waits():
    from asyncgrpo.controller.observe import summarize
    from asyncgrpo.controller.status import Observation, compute

    pod = summarize({"kind": "Pod", "metadata": {"name": "r-bucket-setup-x", "labels": {
        "app.kubernetes.io/component": "bucket-setup"}}, "status": {"phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/1 nodes are available: 1 node(s) had untolerated "
                                   "taint {nvidia.com/gpu: present}."}]}})
    spec = parse_run(doc_with()).spec
    status, events = compute(spec, Observation(generation=1, children=[pod]), {}, "T")
    c = {x["type"]: x for x in status["conditions"]}
    assert status["phase"] == "Pending"
    assert c["BucketReady"]["status"] == "False"
    assert c["BucketReady"]["reason"] == "Unschedulable"
    assert "untolerated taint {nvidia.com/gpu: present}" in c["BucketReady"]["message"]
    assert c["Degraded"]["reason"] == "Unschedulable"
    assert any(e.type == "Warning" and e.reason == "Unschedulable" for e in events)


def test_the_setup_pod_turning_unschedulable_after_a_first_check_still_says_why():
    """The run's second reconcile, when the Job's pod exists: the BucketReady it wrote at
    the first one ("Checking", this generation) is no finding to keep, so the scheduler's
    reason shows (it stayed "Checking" on the test node, under a taint)."""
    from asyncgrpo.controller.observe import summarize
    from asyncgrpo.controller.status import Observation, compute

    spec = parse_run(doc_with()).spec
    first, _ = compute(spec, Observation(generation=1, children=[]), {}, "T")
    assert {x["type"]: x for x in first["conditions"]}["BucketReady"]["reason"] == "Checking"
    pod = summarize({"kind": "Pod", "metadata": {"name": "r-bucket-setup-x", "labels": {
        "app.kubernetes.io/component": "bucket-setup"}}, "status": {"phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/1 nodes are available: 1 node(s) had taint "
                                   "{nvidia.com/gpu: present}, that the pod didn't "
                                   "tolerate."}]}})
    status, _ = compute(spec, Observation(generation=1, children=[pod]), first, "T")
    c = {x["type"]: x for x in status["conditions"]}
    assert c["BucketReady"]["reason"] == "Unschedulable", c["BucketReady"]
    assert "nvidia.com/gpu" in c["BucketReady"]["message"]
    # and once it is scheduled, the condition goes back to waiting for the Job
    scheduled = summarize({"kind": "Pod", "metadata": {"name": "r-bucket-setup-x", "labels": {
        "app.kubernetes.io/component": "bucket-setup"}}, "status": {"phase": "Running"}})
    later, _ = compute(spec, Observation(generation=1, children=[scheduled]), status, "T")
    assert {x["type"]: x for x in later["conditions"]}["BucketReady"]["reason"] == "Checking"
