"""The trainer: a StatefulSet of torchrun nodes and the headless Service that names them.

A StatefulSet gives each node a stable host name (`<run>-trainer-<i>.<run>-trainer`), so node
0 is the static rendezvous point and a node's rank is its ordinal, read from the host name
because Kubernetes 1.20 has no pod-index label. Pods start in parallel: torchrun waits for
all of them anyway. The pod template carries a hash of the part of the run the trainer reads
(`asyncgrpo.trainer.main.run_view`, an allowlist the trainer owns), so a change to, say,
sandbox settings or vLLM's LoRA slots does not restart training.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import configmap, gateway, rbac, vllm
from asyncgrpo.controller.common import (
    bucket_env,
    child_name,
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
    spec_hash,
    stamp,
    tmp_volume,
)
from asyncgrpo.controller.metrics import scrape_annotations
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, secret_name
from asyncgrpo.trainer.main import logger_env, run_view
from asyncgrpo.wire import (
    CONFIG_KEY,
    CONFIG_MOUNT,
    DATA_DIR,
    GATEWAY_PORT,
    HF_HOME,
    VLLM_PORT,
)

COMPONENT = "trainer"
CONFIG_HASH_ANNOTATION = "asyncgrpo.dev/config-hash"


def rank0_host(run_name: str) -> str:
    """Rank 0's stable name: pod 0 of the StatefulSet under its headless Service (both named
    `<run>-trainer`), the torchrun rendezvous and the metrics endpoint the operator reads."""
    sts = child_name(run_name, COMPONENT)
    return f"{sts}-0.{sts}"


#: Rank 0's metrics endpoint (`Settings.trainer_metrics_url`); {name}, {namespace} and {port}
#: are filled in.
METRICS_URL = f"http://{rank0_host('{name}')}.{{namespace}}.svc:{{port}}/metrics"


def torchrun_command(run: AsyncGRPORun) -> list[str]:
    # the node rank is the StatefulSet ordinal, the suffix of the host name
    script = (
        f'exec torchrun --nnodes="${wire.NNODES_ENV}" --nproc-per-node="${wire.NPROC_ENV}" '
        f'--node-rank="${{HOSTNAME##*-}}" --master-addr="${wire.MASTER_ADDR_ENV}" '
        f'--master-port="${wire.MASTER_PORT_ENV}" -m asyncgrpo.cli trainer '
        f'--config "{CONFIG_MOUNT}/{CONFIG_KEY}"'
    )
    return ["/bin/sh", "-c", script]


def trainer_env(run: AsyncGRPORun) -> list[dict[str, Any]]:
    t = run.spec.trainer
    env = [
        {"name": wire.NNODES_ENV, "value": str(t.replicas)},
        {"name": wire.NPROC_ENV, "value": str(max(t.gpus_per_replica, 1))},
        {"name": wire.MASTER_ADDR_ENV, "value": rank0_host(run.metadata.name)},
        {"name": wire.MASTER_PORT_ENV, "value": str(wire.TRAINER_RENDEZVOUS_PORT)},
        {"name": wire.VLLM_URL_ENV, "value": f"http://{name(run, vllm.COMPONENT)}:{VLLM_PORT}"},
        {"name": wire.METRICS_PORT_ENV, "value": str(t.metrics_port)},
        # the root filesystem is read-only: every path the trainer writes is an emptyDir
        # (the work dir: TRL's output dir, checkpoint staging, status.json; HF_HOME: the cache)
        {"name": wire.WORK_DIR_ENV, "value": wire.TRAINER_WORK_DIR},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HOME", "value": "/tmp"},
        # the offline loggers' files, in the work emptyDir; spec.trainer.env overrides them
        # (a variable from reportToSecret does not: a pod's env wins over its envFrom)
        *({"name": k, "value": v} for k, v in logger_env(run).items()),
    ]
    if run.spec.rollout.routing == "affine":
        # set whatever the replica count, so scaling vLLM never rolls the trainer
        env.append({"name": wire.VLLM_REPLICAS_ENV,
                    "value": f"{name(run, 'vllm-replicas')}:{VLLM_PORT}"})
        if run.spec.model.finetuning == "full":
            env.append({"name": wire.VLLM_PULLER_PORT_ENV, "value": str(wire.PULLER_PORT)})
    if run.spec.sandboxes is not None:
        env += [
            {"name": wire.GATEWAY_URL_ENV,
             "value": f"http://{name(run, gateway.COMPONENT)}:{GATEWAY_PORT}"},
            {"name": wire.GATEWAY_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": secret_name(run), "key": GATEWAY_TOKEN_KEY}}},
        ]
    return env + bucket_env(run)


def build_service(run: AsyncGRPORun) -> dict[str, Any]:
    return service(run, COMPONENT, [
        {"name": "rendezvous", "port": wire.TRAINER_RENDEZVOUS_PORT,
         "targetPort": wire.TRAINER_RENDEZVOUS_PORT},
        {"name": "metrics", "port": run.spec.trainer.metrics_port,
         "targetPort": run.spec.trainer.metrics_port},
    ], headless=True)


def data_config_maps_volume(run: AsyncGRPORun) -> dict[str, Any] | None:
    """The `data` volume when the training or eval data is a ConfigMap key: the trainer
    reads <DATA_DIR>/<key> and <DATA_DIR>/eval/<key> (one projected volume, so two
    ConfigMaps share the mount). A Parquet key lives in the ConfigMap's binaryData."""
    from asyncgrpo.trainer.data import EVAL_SUBDIR

    d = run.spec.data
    sources = []
    if d.config_map is not None:
        sources.append({"configMap": {"name": d.config_map.name, "items": [
            {"key": d.config_map.key, "path": d.config_map.key}]}})
    if d.eval is not None and d.eval.config_map is not None:
        cm = d.eval.config_map
        sources.append({"configMap": {"name": cm.name, "items": [
            {"key": cm.key, "path": f"{EVAL_SUBDIR}/{cm.key}"}]}})
    if not sources:
        return None
    return {"name": "data", "projected": {"sources": sources}}


def build_statefulset(run: AsyncGRPORun, replicas: int | None = None) -> dict[str, Any]:
    """`replicas` overrides the spec: 0 while suspended or while vLLM is not ready yet."""
    t = run.spec.trainer
    # what the trainer reads from its run file; the rest of the pod rolls it by itself
    config_hash = spec_hash({"spec": run_view(run)})
    volume_mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "work", "mountPath": wire.TRAINER_WORK_DIR},
        {"name": "cache", "mountPath": wire.CACHE_DIR},
    ]
    volumes = [
        {"name": "config", "configMap": {"name": name(run, configmap.COMPONENT)}},
        tmp_volume(),
        tmp_volume("dshm", medium="Memory"),
        tmp_volume("work"),
        tmp_volume("cache"),
    ]
    data_volume = data_config_maps_volume(run)
    if data_volume is not None:
        volume_mounts.append({"name": "data", "mountPath": DATA_DIR, "readOnly": True})
        volumes.append(data_volume)
    container = {
        "name": "trainer",
        "image": t.image,
        "command": torchrun_command(run),
        "env": merge_env(trainer_env(run), t.env),
        "ports": [{"name": "rendezvous", "containerPort": wire.TRAINER_RENDEZVOUS_PORT},
                  {"name": "metrics", "containerPort": t.metrics_port}],
        "resources": resources(t.resources, t.gpus_per_replica, gpu_resource(run)),
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
    if (cache := model_cache(run)) is not None:
        volume, mount, env = cache
        volumes.append(volume)
        volume_mounts.append(mount)
        container["env"] = container["env"] + env
    pod = {
        "metadata": {"labels": pod_labels(run, COMPONENT),
                     # every rank's pod is scraped: rank 0 reports training, the others
                     # asyncgrpo_trainer_node_info (asyncgrpo.trainer.metrics)
                     "annotations": {CONFIG_HASH_ANNOTATION: config_hash,
                                     **scrape_annotations(t.metrics_port)}},
        "spec": {
            "serviceAccountName": name(run, rbac.WORKLOAD),
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
            "template": place(run, COMPONENT, pod),
        },
    })
