"""Names, labels and pod-spec pieces every child builder shares.

Every child carries the `app.kubernetes.io/*` labels plus `asyncgrpo.dev/run`, so one label
selector finds a run's children (the operator's indexes, `kubectl get all -l ...`) and
`asyncgrpo.dev/spec-hash`, a hash of what the builder produced: the reconcile compares
hashes instead of whole objects, so defaults the API server fills in never look like drift
and an unchanged run costs no API write.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from asyncgrpo import API_GROUP, __version__, wire
from asyncgrpo.api import k8s, placement
from asyncgrpo.api.v1alpha1 import (
    DEFAULT_GPU_RESOURCE,
    AsyncGRPORun,
    EnvVar,
    PodSettings,
    ResourceRequirements,
)

MANAGED_BY = "asyncgrpo-operator"
RUN_LABEL = f"{API_GROUP}/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
HASH_ANNOTATION = f"{API_GROUP}/spec-hash"
#: on a sandbox pod of a row's image: the image's full reference (its label holds the key)
SANDBOX_IMAGE_ANNOTATION = f"{API_GROUP}/sandbox-image-ref"

# uid/gid of the `asyncgrpo` user in every image (images/*/Dockerfile)
RUN_AS_USER = 65532


def name(run: AsyncGRPORun, component: str) -> str:
    """`<run>-<component>`; validation keeps run names short enough for every suffix."""
    return child_name(run.metadata.name, component)


def child_name(run_name: str, component: str) -> str:
    """`name` from the run's name alone (a run being deleted may not parse)."""
    return f"{run_name}-{component}"


def selector(run: AsyncGRPORun, component: str) -> dict[str, str]:
    """Labels that select one component's pods; never changes for a run (selectors are immutable)."""
    return {
        "app.kubernetes.io/name": "asyncgrpo",
        "app.kubernetes.io/instance": run.metadata.name,
        COMPONENT_LABEL: component,
    }


def labels(run: AsyncGRPORun, component: str) -> dict[str, str]:
    return {
        **selector(run, component),
        "app.kubernetes.io/part-of": "asyncgrpo",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/version": __version__,
        RUN_LABEL: run.metadata.name,
    }


def pod_labels(run: AsyncGRPORun, component: str) -> dict[str, str]:
    """Pod template labels: no version label, so upgrading the operator never rolls pods."""
    return {k: v for k, v in labels(run, component).items() if k != "app.kubernetes.io/version"}


def metadata(run: AsyncGRPORun, component: str, child_name: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": child_name or name(run, component),
                            "labels": labels(run, component)}
    if run.metadata.namespace:
        meta["namespace"] = run.metadata.namespace
    return meta


def spec_hash(obj: dict[str, Any]) -> str:
    """Stable hash of a built object, ignoring the hash annotation itself."""
    body = json.loads(json.dumps(obj, sort_keys=True, default=str))
    body.get("metadata", {}).get("annotations", {}).pop(HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Put the spec hash on a built object (the last step of every builder)."""
    obj.setdefault("metadata", {}).setdefault("annotations", {})[HASH_ANNOTATION] = spec_hash(obj)
    return obj


def gpu_resource(run: AsyncGRPORun) -> str:
    """The extended resource GPUs are requested as (the operator fills its default in)."""
    return run.spec.gpu_resource_name or DEFAULT_GPU_RESOURCE


def operator_defaults(run: AsyncGRPORun, gpu_resource_name: str) -> AsyncGRPORun:
    """The run with the operator's defaults for what it leaves unset (the chart's
    gpuResourceName), so every builder reads one value."""
    if run.spec.gpu_resource_name is not None or gpu_resource_name == DEFAULT_GPU_RESOURCE:
        return run
    run = run.model_copy(deep=True)
    run.spec.gpu_resource_name = gpu_resource_name
    return run


def resources(req: ResourceRequirements, gpus: int = 0,
              gpu: str = DEFAULT_GPU_RESOURCE) -> dict[str, Any]:
    """A container's resources; GPUs (as resource `gpu`) go to limits (and requests, as
    Kubernetes requires)."""
    out: dict[str, Any] = {}
    requests = {k: v for k, v in req.requests.items()}
    limits = {k: v for k, v in req.limits.items()}
    if gpus and gpu not in limits:
        limits[gpu] = gpus
    if gpu in limits:
        requests.setdefault(gpu, limits[gpu])
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def env_list(extra: list[EnvVar]) -> list[dict[str, Any]]:
    return [k8s.dump(e) for e in extra]


def merge_env(base: list[dict[str, Any]], extra: list[EnvVar]) -> list[dict[str, Any]]:
    """Operator env first, then the user's; a user variable with the same name wins."""
    user = env_list(extra)
    names = {e["name"] for e in user}
    return [e for e in base if e["name"] not in names] + user


def bucket_env(run: AsyncGRPORun) -> list[dict[str, Any]]:
    """Where the run's bucket is: read by vLLM's resolver plugin and the weights puller
    (`AdapterStore.from_env`) and by the trainer (endpoint and region through boto3's
    AWS_* variables; bucket, prefix and run come from its run file)."""
    store = run.spec.adapter_store
    env = [
        {"name": wire.ADAPTER_BUCKET_ENV, "value": store.bucket},
        {"name": wire.ADAPTER_RUN_ENV, "value": run.metadata.name},
        {"name": wire.ADAPTER_PREFIX_ENV, "value": store.prefix},
        {"name": wire.ADAPTER_NAMESPACE_ENV, "value": run.metadata.namespace or "default"},
        {"name": wire.ADAPTER_REGION_ENV, "value": store.region},
        {"name": "AWS_DEFAULT_REGION", "value": store.region},
    ]
    if store.endpoint:
        env += [{"name": wire.ADAPTER_ENDPOINT_ENV, "value": store.endpoint},
                {"name": "AWS_ENDPOINT_URL_S3", "value": store.endpoint}]
    ref = store.credentials_secret
    if ref is not None:
        env += [
            {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {
                "name": ref.name, "key": ref.access_key_id_key}}},
            {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {
                "name": ref.name, "key": ref.secret_access_key_key}}},
        ]
    return env


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def tmp_volume(name: str = "tmp", medium: str | None = None,
               size: str | None = None) -> dict[str, Any]:
    empty: dict[str, Any] = {}
    if medium:
        empty["medium"] = medium
    if size:
        empty["sizeLimit"] = size
    return {"name": name, "emptyDir": empty}


def service(run: AsyncGRPORun, component: str, ports: list[dict[str, Any]],
            headless: bool = False) -> dict[str, Any]:
    # protocol spelled out: server-side apply on 1.20 needs every key of the port list
    ports = [{"protocol": "TCP", **p} for p in ports]
    spec: dict[str, Any] = {"selector": selector(run, component), "ports": ports}
    if headless:
        # torchrun's rendezvous resolves peers before they are Ready
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
    return stamp({"apiVersion": "v1", "kind": "Service",
                  "metadata": metadata(run, component), "spec": spec})


# ---------------------------------------------------------------- pod settings (placement)


def gpu_toleration(resource: str) -> dict[str, Any]:
    """What managed clusters taint GPU pools with (`<resource>=present:NoSchedule` on GKE and
    EKS): tolerated with Exists, whatever the value."""
    return {"key": resource, "operator": "Exists", "effect": "NoSchedule"}


def _requests_gpu(pod_spec: dict[str, Any], resource: str) -> bool:
    return any(resource in (c.get("resources", {}).get("limits") or {})
               for c in pod_spec.get("containers", []))


def place(run: AsyncGRPORun, component: str, pod: dict[str, Any]) -> dict[str, Any]:
    """Apply the run's merged pod settings for `component` to a pod (template) in place:
    `{"metadata": ..., "spec": ...}`, main container first. The operator's labels,
    annotations, volumes, mounts and variables win over the user's (validation refuses the
    conflict first, `asyncgrpo.api.placement.conflicts`); security settings are untouched."""
    ps: PodSettings = placement.merged(run.spec, component)
    meta, spec = pod.setdefault("metadata", {}), pod["spec"]
    labels = {k: v for k, v in ps.labels.items() if not placement.owned_label(k)}
    meta["labels"] = {**labels, **meta.get("labels", {})}
    notes = {k: v for k, v in ps.annotations.items() if not placement.owned_annotation(k)}
    if notes or meta.get("annotations"):
        meta["annotations"] = {**notes, **meta.get("annotations", {})}
    if ps.node_selector:
        spec["nodeSelector"] = dict(ps.node_selector)
    tolerations = [k8s.dump(t) for t in ps.tolerations]
    gpu = gpu_resource(run)
    if (ps.gpu_toleration is not False and _requests_gpu(spec, gpu)
            and not any(t.get("key") == gpu for t in tolerations)):
        tolerations.append(gpu_toleration(gpu))
    if tolerations:
        spec["tolerations"] = tolerations
    if ps.affinity is not None:
        spec["affinity"] = k8s.dump(ps.affinity)
    if ps.topology_spread_constraints:
        spec["topologySpreadConstraints"] = [k8s.dump(t)
                                             for t in ps.topology_spread_constraints]
    if ps.priority_class_name:
        spec["priorityClassName"] = ps.priority_class_name
    if ps.scheduler_name:
        spec["schedulerName"] = ps.scheduler_name
    if ps.image_pull_secrets:
        spec["imagePullSecrets"] = [k8s.dump(s) for s in ps.image_pull_secrets]
    own_volumes = {v["name"] for v in spec.get("volumes", [])} | placement.OWNED_VOLUMES
    spec["volumes"] = spec.get("volumes", []) + [
        k8s.dump(v) for v in ps.volumes if v.name not in own_volumes]
    main = spec["containers"][0]
    mounts = main.get("volumeMounts", [])
    main["volumeMounts"] = mounts + [
        k8s.dump(m) for m in ps.volume_mounts
        if not placement.owned_mount(m.mountPath) and m.name not in own_volumes]
    names = {e["name"] for e in main.get("env", [])}
    main["env"] = main.get("env", []) + [
        k8s.dump(e) for e in ps.env if e.name not in names and not placement.owned_env(e.name)]
    return pod


def image_pull_secrets(run: AsyncGRPORun) -> list[dict[str, Any]]:
    """The run-wide pull secrets, for the ServiceAccounts the operator makes."""
    return [k8s.dump(s) for s in run.spec.pod.image_pull_secrets]


def model_cache(run: AsyncGRPORun) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]
                                            ] | None:
    """spec.model.cache as (volume, mount at HF_HOME, extra env), or None."""
    cache = run.spec.model.cache
    if cache is None:
        return None
    if cache.volume is not None:
        volume = k8s.dump(cache.volume)
    else:
        volume = {"name": "model-cache", "persistentVolumeClaim": {
            "claimName": cache.claim_name, **({"readOnly": True} if cache.read_only else {})}}
    mount = {"name": volume["name"], "mountPath": wire.HF_HOME,
             **({"readOnly": True} if cache.read_only else {}),
             **({"subPath": cache.sub_path} if cache.sub_path else {})}
    # read-only: never try to download (or to write the hub's lock files) into it
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}] if cache.read_only else []
    return volume, mount, env
