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
from asyncgrpo.api.v1alpha1 import AsyncGRPORun, EnvVar, ResourceRequirements

MANAGED_BY = "asyncgrpo-operator"
RUN_LABEL = f"{API_GROUP}/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
HASH_ANNOTATION = f"{API_GROUP}/spec-hash"

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


def resources(req: ResourceRequirements, gpus: int = 0) -> dict[str, Any]:
    """A container's resources; GPUs go to limits (and requests, as Kubernetes requires)."""
    out: dict[str, Any] = {}
    requests = {k: v for k, v in req.requests.items()}
    limits = {k: v for k, v in req.limits.items()}
    if gpus and "nvidia.com/gpu" not in limits:
        limits["nvidia.com/gpu"] = gpus
    if "nvidia.com/gpu" in limits:
        requests.setdefault("nvidia.com/gpu", limits["nvidia.com/gpu"])
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def env_list(extra: list[EnvVar]) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in extra]


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
