"""The trainer: a StatefulSet of torchrun nodes and the headless Service that names them.

A StatefulSet gives each node a stable host name (`<run>-trainer-<i>.<run>-trainer`), so node
0 is the static rendezvous point and a node's rank is its ordinal, read from the host name
because Kubernetes 1.20 has no pod-index label. Pods start in parallel: torchrun waits for
all of them anyway. The pod template hashes only the spec fields the trainer reads, so a
change to, say, sandbox settings does not restart training.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import configmap
from asyncgrpo.controller.common import (
    CONFIG_KEY,
    CONFIG_MOUNT,
    GATEWAY_PORT,
    RENDEZVOUS_PORT,
    VLLM_PORT,
    bucket_env,
    container_security,
    merge_env,
    metadata,
    name,
    pod_labels,
    pod_security,
    resources,
    selector,
    service,
    spec_hash,
    stamp,
    tmp_volume,
)
from asyncgrpo.controller.metrics import scrape_annotations
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, secret_name
from asyncgrpo.trainer.data import DEFAULT_CONFIGMAP_DIR

COMPONENT = "trainer"
CONFIG_HASH_ANNOTATION = "asyncgrpo.dev/config-hash"
#: scratch (TRL's output dir, checkpoint staging, status.json) and the Hugging Face cache,
#: both emptyDirs: the image's defaults are on its read-only root
WORK_DIR = "/var/lib/asyncgrpo"
HF_HOME = "/var/cache/asyncgrpo/hf"


def torchrun_command(run: AsyncGRPORun) -> list[str]:
    # the node rank is the StatefulSet ordinal, the suffix of the host name
    script = (
        'exec torchrun --nnodes="$ASYNCGRPO_NNODES" --nproc-per-node="$ASYNCGRPO_NPROC" '
        '--node-rank="${HOSTNAME##*-}" --master-addr="$ASYNCGRPO_MASTER_ADDR" '
        '--master-port="$ASYNCGRPO_MASTER_PORT" -m asyncgrpo.cli trainer '
        f'--config "{CONFIG_MOUNT}/{CONFIG_KEY}"'
    )
    return ["/bin/sh", "-c", script]


def trainer_env(run: AsyncGRPORun) -> list[dict[str, Any]]:
    t = run.spec.trainer
    env = [
        {"name": "ASYNCGRPO_NNODES", "value": str(t.replicas)},
        {"name": "ASYNCGRPO_NPROC", "value": str(max(t.gpus_per_replica, 1))},
        {"name": "ASYNCGRPO_MASTER_ADDR",
         "value": f"{name(run, COMPONENT)}-0.{name(run, COMPONENT)}"},
        {"name": "ASYNCGRPO_MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "ASYNCGRPO_VLLM_URL", "value": f"http://{name(run, 'vllm')}:{VLLM_PORT}"},
        {"name": "ASYNCGRPO_METRICS_PORT", "value": str(t.metrics_port)},
        # the root filesystem is read-only: every path the trainer writes is an emptyDir
        {"name": "ASYNCGRPO_WORK_DIR", "value": WORK_DIR},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HOME", "value": "/tmp"},
    ]
    if run.spec.sandboxes is not None:
        env += [
            {"name": "ASYNCGRPO_GATEWAY_URL",
             "value": f"http://{name(run, 'gateway')}:{GATEWAY_PORT}"},
            {"name": "ASYNCGRPO_GATEWAY_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": secret_name(run), "key": GATEWAY_TOKEN_KEY}}},
        ]
    return env + bucket_env(run)


#: Spec fields the trainer process never reads: changing them must not restart training.
_NOT_READ_BY_TRAINER = {
    "rollout": {"image", "replicas", "tensorParallelSize", "gpuMemoryUtilization", "resources",
                "extraArgs", "env"},
    "sandboxes": {"image", "minWarm", "max", "hardCap", "resources", "runtimeClassName",
                  "idleTtlSeconds", "network"},
}


def trainer_view(run: AsyncGRPORun) -> dict[str, Any]:
    """The part of the run document the trainer reads; its hash rolls the trainer pods."""
    spec = configmap.run_document(run)["spec"]
    for section, fields in _NOT_READ_BY_TRAINER.items():
        if isinstance(spec.get(section), dict):
            spec[section] = {k: v for k, v in spec[section].items() if k not in fields}
    return spec


def build_service(run: AsyncGRPORun) -> dict[str, Any]:
    return service(run, COMPONENT, [
        {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
        {"name": "metrics", "port": run.spec.trainer.metrics_port,
         "targetPort": run.spec.trainer.metrics_port},
    ], headless=True)


def build_statefulset(run: AsyncGRPORun, replicas: int | None = None) -> dict[str, Any]:
    """`replicas` overrides the spec: 0 while suspended or while vLLM is not ready yet."""
    t = run.spec.trainer
    config_hash = spec_hash({"spec": trainer_view(run)})
    volume_mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "work", "mountPath": WORK_DIR},
        {"name": "cache", "mountPath": "/var/cache/asyncgrpo"},
    ]
    volumes = [
        {"name": "config", "configMap": {"name": name(run, configmap.COMPONENT)}},
        tmp_volume(),
        tmp_volume("dshm", medium="Memory"),
        tmp_volume("work"),
        tmp_volume("cache"),
    ]
    data_cm = run.spec.data.config_map
    if data_cm is not None:  # the trainer reads <DEFAULT_CONFIGMAP_DIR>/<key>
        volume_mounts.append({"name": "data", "mountPath": DEFAULT_CONFIGMAP_DIR,
                              "readOnly": True})
        volumes.append({"name": "data", "configMap": {
            "name": data_cm.name, "items": [{"key": data_cm.key, "path": data_cm.key}]}})
    container = {
        "name": "trainer",
        "image": t.image,
        "command": torchrun_command(run),
        "env": merge_env(trainer_env(run), t.env),
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
                  {"name": "metrics", "containerPort": t.metrics_port}],
        "resources": resources(t.resources, t.gpus_per_replica),
        "securityContext": container_security(),
        "volumeMounts": volume_mounts,
        # the loggers' settings and credentials (spec.trainer.reportToSecret) reach the
        # process as environment, never through the run's ConfigMap or argv
        **({"envFrom": [{"secretRef": {"name": t.report_to_secret}}]}
           if t.report_to_secret else {}),
        # every pod's local rank 0 serves it (asyncgrpo.trainer.metrics), not only rank 0's
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"},
                           "periodSeconds": 5},
    }
    pod = {
        "metadata": {"labels": pod_labels(run, COMPONENT),
                     # every rank's pod is scraped: rank 0 reports training, the others
                     # asyncgrpo_trainer_node_info (asyncgrpo.trainer.metrics)
                     "annotations": {CONFIG_HASH_ANNOTATION: config_hash,
                                     **scrape_annotations(t.metrics_port)}},
        "spec": {
            "serviceAccountName": name(run, "workload"),
            "automountServiceAccountToken": False,
            "securityContext": pod_security(),
            "containers": [container],
            "volumes": volumes,
        },
    }
    return stamp({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(run, COMPONENT),
        "spec": {
            "replicas": t.replicas if replicas is None else replicas,
            "serviceName": name(run, COMPONENT),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(run, COMPONENT)},
            "template": pod,
        },
    })
