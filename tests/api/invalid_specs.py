"""Invalid runs, each with the field the error must name. Shared by the model tests and the
API-server tests, so both layers are held to the same cases."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def base_run() -> dict:
    """A small valid run (the CPU-friendly shape of examples/lora-math.yaml)."""
    docs = yaml.safe_load_all((REPO / "examples" / "lora-math.yaml").read_text())
    return copy.deepcopy(next(d for d in docs if d["kind"] == "AsyncGRPORun"))


def _set(doc: dict, path: str, value) -> dict:
    node = doc
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return doc


def _mutate(*changes):
    def make() -> dict:
        doc = base_run()
        for path, value in changes:
            _set(doc, path, value)
        return doc

    return make


#: Rejected by the CRD schema (so by the API server) and by the model: (id, make, field).
SCHEMA_INVALID = [
    ("negative-learning-rate", _mutate(("spec.trainer.learningRate", -1e-5)),
     "spec.trainer.learningRate"),
    ("one-generation", _mutate(("spec.trainer.numGenerations", 1)), "spec.trainer.numGenerations"),
    ("negative-staleness", _mutate(("spec.trainer.maxStaleness", -1)), "spec.trainer.maxStaleness"),
    ("zero-replicas", _mutate(("spec.rollout.replicas", 0)), "spec.rollout.replicas"),
    ("top-p-above-one", _mutate(("spec.rollout.sampling.topP", 1.5)),
     "spec.rollout.sampling.topP"),
    ("unknown-dtype", _mutate(("spec.model.dtype", "int3")), "spec.model.dtype"),
    ("unknown-attention", _mutate(("spec.model.attention", "flash-tree")), "spec.model.attention"),
    ("unknown-reward", _mutate(("spec.reward.functions", [{"name": "vibes"}])),
     "spec.reward.functions"),
    ("bad-lora-rank-for-vllm", _mutate(("spec.rollout.maxLoraRank", 24)),
     "spec.rollout.maxLoraRank"),
    ("bad-deletion-policy", _mutate(("spec.adapterStore.deletionPolicy", "Orphan")),
     "spec.adapterStore.deletionPolicy"),
    ("bucket-name-uppercase", _mutate(("spec.adapterStore.bucket", "My_Bucket")),
     "spec.adapterStore.bucket"),
    ("missing-model-name", _mutate(("spec.model", {"dtype": "bfloat16"})), "spec.model.name"),
    ("negative-sandbox-pool", _mutate(("spec.sandboxes", {"minWarm": -1})),
     "spec.sandboxes.minWarm"),
    ("no-reward-functions", _mutate(("spec.reward.functions", [])), "spec.reward.functions"),
    ("string-for-int", _mutate(("spec.trainer.totalSteps", "many")), "spec.trainer.totalSteps"),
    ("bad-harness", _mutate(("spec.harness", {"type": "three-turn"})), "spec.harness.type"),
    ("endpoint-not-url", _mutate(("spec.adapterStore.endpoint", "minio:9000")),
     "spec.adapterStore.endpoint"),
    ("anchor-interval-zero", _mutate(("spec.model.full", {"anchorInterval": 0})),
     "spec.model.full.anchorInterval"),
    # issue 9: the CLI must refuse what the API server refuses (strict types)
    ("quoted-int", _mutate(("spec.trainer.numGenerations", "8")), "spec.trainer.numGenerations"),
    ("quoted-bool", _mutate(("spec.suspend", "true")), "spec.suspend"),
    # tenancy: prefixes that could escape or alias the run folder
    ("prefix-root", _mutate(("spec.adapterStore.prefix", "/")), "spec.adapterStore.prefix"),
    ("prefix-empty", _mutate(("spec.adapterStore.prefix", "")), "spec.adapterStore.prefix"),
    ("prefix-dotdot", _mutate(("spec.adapterStore.prefix", "a/../b")),
     "spec.adapterStore.prefix"),
    ("prefix-empty-segment", _mutate(("spec.adapterStore.prefix", "a//b")),
     "spec.adapterStore.prefix"),
    ("prefix-leading-slash", _mutate(("spec.adapterStore.prefix", "/asyncgrpo")),
     "spec.adapterStore.prefix"),
    ("endpoint-without-host", _mutate(("spec.adapterStore.endpoint", "http://")),
     "spec.adapterStore.endpoint"),
    ("endpoint-with-userinfo", _mutate(("spec.adapterStore.endpoint", "http://u:p@h:9000")),
     "spec.adapterStore.endpoint"),
    ("region-with-space", _mutate(("spec.adapterStore.region", "us east")),
     "spec.adapterStore.region"),
    # placement (issue 24): Kubernetes' own schemas, enforced by the API server too
    ("toleration-seconds-string", _mutate(("spec.pod.tolerations", [
        {"key": "a", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": "60"}])),
     "spec.pod.tolerations[0].tolerationSeconds"),
    ("volume-without-name", _mutate(("spec.trainer.pod", {"volumes": [
        {"persistentVolumeClaim": {"claimName": "c"}}]})), "spec.trainer.pod.volumes[0].name"),
    ("mount-without-path", _mutate(("spec.rollout.pod", {"volumeMounts": [{"name": "x"}]})),
     "spec.rollout.pod.volumeMounts[0].mountPath"),
    ("node-selector-int", _mutate(("spec.pod.nodeSelector", {"pool": 1})),
     "spec.pod.nodeSelector.pool"),
    ("affinity-terms-not-list", _mutate(("spec.pod.affinity", {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "gpu"}}})),
     ("spec.pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
      ".nodeSelectorTerms")),
    ("spread-without-max-skew", _mutate(("spec.pod.topologySpreadConstraints", [
        {"topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}])),
     "spec.pod.topologySpreadConstraints[0].maxSkew"),
    ("gpu-resource-with-space", _mutate(("spec.gpuResourceName", "nvidia gpu")),
     "spec.gpuResourceName"),
    ("priority-class-uppercase", _mutate(("spec.pod.priorityClassName", "High")),
     "spec.pod.priorityClassName"),
]

#: Run names the API server refuses through the CRD's metadata schema and the model through
#: its rules (the longest derived label value is the name + 19 characters; DNS-1035).
NAME_INVALID = [
    ("run-name-45", _mutate(("metadata.name", "r" * 45)), "metadata.name"),
    ("run-name-digit-first", _mutate(("metadata.name", "1run")), "metadata.name"),
]

#: Valid to the schema, refused by the cross-field rules (asyncgrpo validate, the operator).
SEMANTIC_INVALID = [
    ("fsdp-not-dividing-world", _mutate(("spec.trainer.gpusPerReplica", 4),
                                        ("spec.trainer.fsdpSize", 3)), "spec.trainer.fsdpSize"),
    ("ep-without-moe", _mutate(("spec.trainer.expertParallelSize", 2)),
     "spec.trainer.expertParallelSize"),
    ("ep-not-dividing-fsdp", _mutate(("spec.model.moe", True), ("spec.trainer.fsdpSize", 4),
                                     ("spec.trainer.expertParallelSize", 3)),
     "spec.trainer.expertParallelSize"),
    ("lora-rank-above-vllm-max", _mutate(("spec.model.lora.rank", 64),
                                         ("spec.rollout.maxLoraRank", 32)), "spec.model.lora.rank"),
    ("min-pool-above-max", _mutate(("spec.sandboxes", {"minWarm": 10, "max": 4})),
     "spec.sandboxes.minWarm"),
    ("max-pool-above-cap", _mutate(("spec.sandboxes", {"max": 500, "hardCap": 100})),
     "spec.sandboxes.max"),
    ("retention-below-staleness", _mutate(("spec.adapterStore.retention", 3)),
     "spec.adapterStore.retention"),
    ("two-data-sources", _mutate(("spec.data.path", "/data/x.jsonl")), "spec.data"),
    ("python-reward-without-module", _mutate(("spec.reward.functions", [{"name": "python"}])),
     "spec.reward.functions[0].module"),
    ("sandbox-reward-without-sandboxes", _mutate(("spec.reward.functions",
                                                  [{"name": "sandbox_tests"}])),
     "spec.reward.functions[0].name"),
    ("tools-single-turn", _mutate(("spec.harness", {"tools": ["shell"]}),
                                  ("spec.sandboxes", {})), "spec.harness.tools"),
    ("budget-below-model-len", _mutate(("spec.trainer.tokenBudgetPerRank", 1024)),
     "spec.trainer.tokenBudgetPerRank"),
    ("completion-fills-context", _mutate(("spec.rollout.sampling.maxCompletionTokens", 8192)),
     "spec.rollout.sampling.maxCompletionTokens"),
    ("full-without-local-disk", _mutate(("spec.model.finetuning", "full")),
     "spec.model.full.localDisk"),
    ("flex-on-cpu", _mutate(("spec.model.attention", "tree-flex"),
                            ("spec.trainer.gpusPerReplica", 0)), "spec.model.attention"),
    ("bad-regex", _mutate(("spec.reward.functions", [{"name": "regex_match",
                                                      "args": {"pattern": "(["}}])),
     "spec.reward.functions[0].args.pattern"),
    ("bad-egress-cidr", _mutate(("spec.sandboxes", {"network": {"allowedEgressCidrs":
                                                                ["10.0.0.0/33"]}})),
     "spec.sandboxes.network.allowedEgressCidrs[0]"),
    ("run-name-too-long", _mutate(("metadata.name", "r" * 60)), "metadata.name"),
    # unknown args of a built-in reward would arrive as data columns and be ignored. The
    # CRD's CEL rule refuses them on API servers >= 1.25 (tests/api/test_crd.py evaluates
    # it); the test API server (1.20) predates CEL, so here they are validation's cases.
    ("reward-unknown-arg", _mutate(("spec.reward.functions", [
        {"name": "numeric_match", "args": {"answer_field": "answer"}}])),
     "spec.reward.functions[0].args"),
    ("sandbox-reward-command-not-test-command", _mutate(
        ("spec.sandboxes", {}),
        ("spec.reward.functions", [{"name": "sandbox_tests", "args": {"command": "pytest"}}])),
     "spec.reward.functions[0].args"),
    # a built-in reward's args are typed (asyncgrpo.rewards.args): validation checks them
    ("reward-arg-wrong-type", _mutate(("spec.reward.functions", [
        {"name": "numeric_match", "args": {"tolerance": "0.1"}}])),
     "spec.reward.functions[0].args.tolerance"),
    ("regex-reward-without-pattern", _mutate(("spec.reward.functions", [
        {"name": "regex_match", "args": {"flags": "i"}}])),
     "spec.reward.functions[0].args.pattern"),
    ("vllm-gpus-below-tp", _mutate(("spec.rollout.tensorParallelSize", 2),
                                   ("spec.rollout.gpusPerReplica", 1)),
     "spec.rollout.gpusPerReplica"),
    ("metrics-port-is-rendezvous", _mutate(("spec.trainer.metricsPort", 29500)),
     "spec.trainer.metricsPort"),
    # placement (issue 24): what the operator owns cannot be replaced by pod settings
    ("pod-label-owned", _mutate(("spec.trainer.pod", {"labels": {
        "app.kubernetes.io/component": "x"}})),
     "spec.trainer.pod.labels.app.kubernetes.io/component"),
    ("pod-annotation-owned", _mutate(("spec.pod.annotations", {"asyncgrpo.dev/spec-hash": "x"})),
     "spec.pod.annotations.asyncgrpo.dev/spec-hash"),
    ("pod-volume-owned", _mutate(("spec.rollout.pod", {"volumes": [
        {"name": "cache", "emptyDir": {}}]})), "spec.rollout.pod.volumes[0].name"),
    ("pod-mount-shadows-tmp", _mutate(("spec.pod", {
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]})),
     "spec.pod.volumeMounts[0].mountPath"),
    ("pod-mount-above-cache", _mutate(("spec.pod", {
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/var/cache"}]})),
     "spec.pod.volumeMounts[0].mountPath"),
    ("pod-mount-unknown-volume", _mutate(("spec.trainer.pod", {
        "volumeMounts": [{"name": "nowhere", "mountPath": "/data"}]})),
     "spec.trainer.pod.volumeMounts[0].name"),
    ("pod-env-owned", _mutate(("spec.pod.env", [{"name": "ASYNCGRPO_ADAPTER_BUCKET",
                                                "value": "other"}])), "spec.pod.env[0].name"),
    ("pod-env-bucket-key", _mutate(("spec.trainer.pod", {"env": [
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}]})), "spec.trainer.pod.env[0].name"),
    ("bucket-job-label-owned", _mutate(("spec.adapterStore.bucketJobPod", {"labels": {
        "asyncgrpo.dev/run": "other"}})),
     "spec.adapterStore.bucketJobPod.labels.asyncgrpo.dev/run"),
    ("gateway-volume-owned", _mutate(("spec.sandboxes", {"gatewayPod": {"volumes": [
        {"name": "tmp", "emptyDir": {}}]}})), "spec.sandboxes.gatewayPod.volumes[0].name"),
    ("workload-annotation-owned", _mutate(("spec.serviceAccount", {"annotations": {
        "asyncgrpo.dev/x": "y"}})), "spec.serviceAccount.annotations.asyncgrpo.dev/x"),
    ("model-cache-two-sources", _mutate(("spec.model.cache", {
        "claimName": "c", "volume": {"name": "v", "emptyDir": {}}})), "spec.model.cache"),
    ("model-cache-no-source", _mutate(("spec.model.cache", {"readOnly": True})),
     "spec.model.cache"),
]
