"""A tiny LoRA run trained to its last step through the operator's own pods.

Driven only through the API server, as a user would: `kubectl apply -f`, `kubectl get agr`.
The trainer StatefulSet, the vLLM Deployment and the bucket are the operator's; the pods run
the project's images on the test node; adapters go trainer -> S3 -> vLLM's resolver.
"""

from __future__ import annotations

import json
import time

import pytest

from .conftest import E2E_TRAINER_IMAGE, E2E_VLLM_IMAGE, MODEL_PATH, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow]

PROMPTS = "".join(json.dumps({"prompt": p}) + "\n" for p in (
    "Say something.", "Tell me a number.", "Write a short answer.", "Give me a code."))


def tiny_run(name: str, ns: str, endpoint: str, *, steps: int, replicas: int = 1,
             ttl: int | None = None, extra_trainer: dict | None = None) -> dict:
    """The local-tiny example's run, for pods: the model is a path in the e2e images,
    prompts come from a ConfigMap, both vLLM and the trainer run on CPU, one thread each."""
    one_thread = [{"name": "OMP_NUM_THREADS", "value": "1"},
                  {"name": "MKL_NUM_THREADS", "value": "1"}]
    spec = {
        "model": {"name": MODEL_PATH, "dtype": "float32", "attention": "tree-sdpa",
                  "lora": {"rank": 8, "alpha": 16,
                           "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
        "trainer": {"image": E2E_TRAINER_IMAGE, "replicas": replicas, "gpusPerReplica": 0,
                    "learningRate": 2.0e-2, "numGenerations": 4, "promptsPerStep": 2,
                    "tokenBudgetPerRank": 1024, "maxStaleness": 1, "totalSteps": steps,
                    "checkpointInterval": 2, "env": one_thread, **(extra_trainer or {})},
        "rollout": {"image": E2E_VLLM_IMAGE, "gpusPerReplica": 0, "maxLoras": 2,
                    "maxLoraRank": 8, "maxModelLen": 512,
                    "sampling": {"temperature": 1.0, "maxCompletionTokens": 12},
                    "extraArgs": ["--max-num-seqs", "8"],
                    "env": [*one_thread, {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                            {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]},
        "adapterStore": {"endpoint": endpoint, "bucket": f"e2e-{name}",
                         "credentialsSecret": {"name": "s3"}, "retention": 4,
                         "deletionPolicy": "Delete"},
        "data": {"configMap": {"name": "prompts", "key": "prompts.jsonl"}},
        "reward": {"functions": [{"name": "python",
                                  "module": "asyncgrpo.local.demo:digit_fraction"}]},
    }
    if ttl is not None:
        spec["ttlSecondsAfterFinished"] = ttl
    return {"apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def prompts_configmap(ns: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "prompts", "namespace": ns},
            "data": {"prompts.jsonl": PROMPTS}}


def get_agr(stack, ns: str) -> list[list[str]]:
    """`kubectl get agr` as a user reads it: the printer columns, row by row."""
    out = stack.kubectl("-n", ns, "get", "agr", "--no-headers", check=False)
    return [line.split() for line in out.splitlines() if line.strip()]


def test_tiny_lora_run_trains_to_the_end_through_the_operators_pods(e2e_stack):
    stack, ns = e2e_stack, "team-tiny"
    stack.namespace(ns)
    started = time.monotonic()
    stack.apply(prompts_configmap(ns), tiny_run("tiny", ns, stack.s3.endpoint, steps=4, ttl=20))

    def run():
        return stack.get("agr", "tiny", ns) or {}

    # the operator's children: a trainer StatefulSet and a vLLM Deployment, running for real
    wait_for("vLLM Ready", lambda: (stack.get("deploy", "tiny-vllm", ns) or {})
             .get("status", {}).get("readyReplicas") == 1, timeout=600,
             on_timeout=lambda: stack.describe(ns) + stack.logs(ns, "app.kubernetes.io/component=vllm"))
    seen_columns = []

    def progressing():
        rows = get_agr(stack, ns)
        if rows:
            seen_columns.append(rows[0])
        return run().get("status", {}).get("step", 0) >= 1

    wait_for("the first step", progressing, timeout=600,
             on_timeout=lambda: stack.describe(ns)
             + stack.logs(ns, "app.kubernetes.io/component=trainer"))
    first_step_s = time.monotonic() - started
    wait_for("Succeeded", lambda: run().get("status", {}).get("phase") == "Succeeded"
             or run().get("status", {}).get("phase") == "Failed", timeout=900,
             on_timeout=lambda: stack.describe(ns)
             + stack.logs(ns, "app.kubernetes.io/component=trainer"))
    status = run()["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["step"] == 4
    assert status["policyVersion"] >= 4
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["AdapterInSync"]["status"] == "True", conditions
    # the bucket was set up by a Job in the run's namespace, not by the operator
    assert conditions["BucketReady"]["status"] == "True", conditions
    setup = stack.get("job", "tiny-bucket-setup", ns)
    assert setup and setup["status"].get("succeeded") == 1, setup

    # the adapters reached the bucket, versioned, and vLLM served them from there
    keys = [o["Key"] for o in stack.s3.client().list_objects_v2(
        Bucket="e2e-tiny").get("Contents", [])]
    assert any("/adapters/v4/" in k for k in keys), keys
    vllm_log = stack.logs(ns, "app.kubernetes.io/component=vllm")
    # `kubectl get agr` showed the run moving: phase, step, version columns
    assert any("Running" in row for row in seen_columns), seen_columns

    # ttlSecondsAfterFinished: the run goes, and its children with it (garbage collection)
    wait_for("the run deleted by its TTL", lambda: stack.get("agr", "tiny", ns) is None,
             timeout=180)
    wait_for("children gone", lambda: not stack.kubectl(
        "-n", ns, "get", "statefulset,deployment,pods,jobs", "-o", "name", check=False).strip(),
        timeout=180)
    # deletionPolicy Delete: the cleanup Job emptied the run's folder, and only that
    left = [o["Key"] for o in stack.s3.client().list_objects_v2(
        Bucket="e2e-tiny").get("Contents", [])]
    assert not [k for k in left if k.startswith(f"asyncgrpo/{ns}/tiny/")], left
    total_s = time.monotonic() - started
    print(f"\nE2E tiny LoRA: first step after {first_step_s:.0f} s, 4 steps and TTL deletion "
          f"in {total_s:.0f} s; throughput {status.get('throughput')}; "
          f"vLLM log lines {len(vllm_log.splitlines())}")
