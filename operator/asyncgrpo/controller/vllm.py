"""vLLM rollout servers: a Deployment, its Service and, for routing, a headless Service.

LoRA runs load adapters by name through the asyncgrpo S3 resolver plugin
(`asyncgrpo.adapters.vllm_plugin`, configured by the ASYNCGRPO_ADAPTER_* variables), which
vLLM consults only with runtime LoRA updating on. One API-server process per pod: runtime LoRA
updating rules out several.

Full fine-tuning adds a sidecar, `asyncgrpo weights pull` (`asyncgrpo.weights.puller`), that
follows the run's weights/ folder in the bucket and swaps each version into the vLLM server
beside it through the dev-mode routes on loopback; an emptyDir holds its full copy, and the
pod is Ready only once the sidecar has loaded the newest version. No port from the trainer to
vLLM, no NCCL.

With `spec.rollout.routing: affine` (the default) the trainer sends each group's requests to
one replica itself (`asyncgrpo.trainer.routed_loop`); it finds the replicas through the
headless Service `<run>-vllm-replicas`, whose DNS records are the Ready pods' addresses (no
API access, so the trainer keeps running without a token).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import rbac
from asyncgrpo.controller.common import (
    bucket_env,
    container_security,
    gpu_resource,
    merge_env,
    metadata,
    model_cache,
    name,
    place,
    pod_labels,
    pod_security,
    resources,
    selector,
    service,
    stamp,
    tmp_volume,
)
from asyncgrpo.controller.metrics import scrape_annotations
from asyncgrpo.weights.guard import MIDDLEWARE
from asyncgrpo.weights.vllm_worker import EXTENSION as WORKER_EXTENSION
from asyncgrpo.wire import CACHE_DIR, PULLER_PORT, VLLM_PORT, WEIGHTS_DIR

COMPONENT = "vllm"
#: the weights puller sidecar's container name (full fine-tuning)
PULLER_CONTAINER = "weights-puller"
#: vLLM's extra arguments for full fine-tuning: the dev-mode routes (the puller's swap) answer
#: only to the pod itself; the generate route (`--enable-scale-out`) tells rollouts which
#: weight version sampled each token (asyncgrpo.trainer.served_versions); the worker extension
#: makes the swap exact for MoE experts on CPU (asyncgrpo.weights.vllm_worker).
FULL_FINETUNING_ARGS = ("--middleware", MIDDLEWARE, "--enable-scale-out",
                        "--worker-extension-cls", WORKER_EXTENSION)


def server_args(run: AsyncGRPORun, host: str = "0.0.0.0", port: int = VLLM_PORT,
                model: str | None = None) -> list[str]:
    """vLLM's arguments for a run; the local backend passes loopback and a local model path."""
    m, r = run.spec.model, run.spec.rollout
    args = [
        "--model", model or m.name,
        "--dtype", m.dtype,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(r.max_model_len),
        "--tensor-parallel-size", str(r.tensor_parallel_size),
        "--gpu-memory-utilization", str(r.gpu_memory_utilization),
    ]
    if m.finetuning == "lora":
        args += ["--enable-lora", "--max-lora-rank", str(r.max_lora_rank),
                 "--max-loras", str(r.max_loras)]
    else:
        args += FULL_FINETUNING_ARGS
    return args + list(r.extra_args)


def server_env(run: AsyncGRPORun) -> list[dict[str, Any]]:
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": wire.HF_HOME},
        {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "1"},
        {"name": wire.ADAPTER_CACHE_DIR_ENV, "value": wire.ADAPTER_CACHE_DIR},
    ]
    if run.spec.model.finetuning == "full":
        env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})
    return env + bucket_env(run)


def puller_container(run: AsyncGRPORun) -> dict[str, Any]:
    """The weights puller sidecar (full fine-tuning): same image, the `asyncgrpo` command."""
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": wire.WEIGHTS_DIR_ENV, "value": WEIGHTS_DIR},
        {"name": wire.WEIGHTS_VLLM_URL_ENV, "value": f"http://127.0.0.1:{VLLM_PORT}"},
        {"name": wire.WEIGHTS_PORT_ENV, "value": str(PULLER_PORT)},
    ]
    return {
        "name": PULLER_CONTAINER,
        "image": run.spec.rollout.image,
        "command": ["asyncgrpo", "weights", "pull"],
        "env": env + bucket_env(run),
        "ports": [{"name": "weights", "containerPort": PULLER_PORT}],
        "securityContext": container_security(),
        # Ready once the newest version is served: a fresh replica gets no rollouts before.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "weights"}, "periodSeconds": 5},
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


#: the headless Service's name suffix (`<run>-vllm-replicas`)
REPLICAS_SERVICE = "vllm-replicas"


def build_service(run: AsyncGRPORun) -> dict[str, Any]:
    return service(run, COMPONENT, [{"name": "http", "port": VLLM_PORT, "targetPort": "http"}])


def build_replicas_service(run: AsyncGRPORun) -> dict[str, Any] | None:
    """Headless: one DNS record per Ready replica (not-ready ones are left out, so a replica
    still loading, or whose puller has not caught up, gets no rollouts). None without
    affine routing."""
    if run.spec.rollout.routing != "affine":
        return None
    svc = service(run, COMPONENT, [{"name": "http", "port": VLLM_PORT, "targetPort": "http"}])
    svc["metadata"] = metadata(run, COMPONENT, name(run, REPLICAS_SERVICE))
    svc["spec"] |= {"clusterIP": "None", "publishNotReadyAddresses": False}
    return stamp(svc)


def build_deployment(run: AsyncGRPORun, replicas: int | None = None) -> dict[str, Any]:
    r = run.spec.rollout
    container = {
        "name": "vllm",
        "image": r.image,
        # the module, not the `vllm` script (whose metadata lookup fails in some builds);
        # python3 is the name every vLLM image has
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": server_args(run),
        "env": merge_env(server_env(run), r.env),
        "ports": [{"name": "http", "containerPort": VLLM_PORT}],
        "resources": resources(r.resources, r.tensor_parallel_size
                               if r.gpus_per_replica is None else r.gpus_per_replica,
                               gpu_resource(run)),
        "securityContext": container_security(),
        # model loading takes minutes; the startup probe keeps liveness out of the way
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"},
                         "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                          "periodSeconds": 15, "failureThreshold": 4},
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    containers = [container]
    volumes = [tmp_volume("cache"), tmp_volume(), tmp_volume("dshm", medium="Memory")]
    full = run.spec.model.full
    if run.spec.model.finetuning == "full":
        # vLLM reads the puller's copy at reload time: the same emptyDir, read-only here.
        container["volumeMounts"].append({"name": "weights", "mountPath": WEIGHTS_DIR,
                                          "readOnly": True})
        containers.append(puller_container(run))
        size = None if full.local_disk is None else str(full.local_disk)
        volumes.append(tmp_volume("weights", size=size))
    if (cache := model_cache(run)) is not None:
        volume, mount, env = cache
        volumes.append(volume)
        container["volumeMounts"].append(mount)
        container["env"] = container["env"] + env
    return stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(run, COMPONENT),
        "spec": {
            "replicas": r.replicas if replicas is None else replicas,
            "selector": {"matchLabels": selector(run, COMPONENT)},
            "template": place(run, COMPONENT, {
                # vLLM's own /metrics (vllm:*) on its API port
                "metadata": {"labels": pod_labels(run, COMPONENT),
                             "annotations": scrape_annotations(VLLM_PORT)},
                "spec": {
                    "serviceAccountName": name(run, rbac.WORKLOAD),
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security(),
                    "containers": containers,
                    "volumes": volumes,
                },
            }),
        },
    })
