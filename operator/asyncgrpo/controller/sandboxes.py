"""Sandbox pods: built one by one, because the operator is their controller (not a ReplicaSet).

A ReplicaSet would pick which pod to delete on scale-down; only the operator, through the
gateway's demand signal, knows which sandboxes are idle, so the pool is plain pods owned by
the run. Sandboxes run untrusted code: no service-account token, no service links, non-root,
no privilege escalation, optional RuntimeClass (gVisor, Kata), a bounded workspace.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller.common import (
    HASH_ANNOTATION,
    container_security,
    metadata,
    name,
    place,
    pod_labels,
    pod_security,
    resources,
    spec_hash,
    tmp_volume,
)
from asyncgrpo.controller.secret import SANDBOX_TOKEN_KEY, secret_name

COMPONENT = "sandbox"
#: Limits every sandbox pod gets unless the spec sets its own: a command's memory, CPU and
#: disk are bounded by its pod (the server's RLIMIT_NPROC bounds its processes).
DEFAULT_LIMITS = {"cpu": 1, "memory": "1Gi", "ephemeral-storage": "4Gi"}
WORKSPACE_SIZE = "2Gi"


def sandbox_resources(run: AsyncGRPORun) -> dict[str, Any]:
    """The spec's resources, with every limit it leaves out taken from DEFAULT_LIMITS."""
    out = resources(run.spec.sandboxes.resources)  # type: ignore[union-attr]
    out["limits"] = {**DEFAULT_LIMITS, **out.get("limits", {})}
    return out


def pod_prefix(run: AsyncGRPORun) -> str:
    """`<run>-sandbox`; the scaler appends the lowest free ordinal (`sandbox_scaling.free_names`)."""
    return name(run, COMPONENT)


def pod_name(run: AsyncGRPORun, suffix: str) -> str:
    return f"{pod_prefix(run)}-{suffix}"


def build_pod(run: AsyncGRPORun, suffix: str) -> dict[str, Any]:
    sb = run.spec.sandboxes
    assert sb is not None
    container = {
        "name": "sandbox",
        "image": sb.image,
        "command": ["asyncgrpo", "sandbox", "serve"],
        "env": [
            {"name": wire.SANDBOX_PORT_ENV, "value": str(wire.SANDBOX_PORT)},
            {"name": wire.SANDBOX_WORKSPACE_ENV, "value": wire.SANDBOX_WORKSPACE},
            {"name": wire.SANDBOX_DEFAULT_TIMEOUT_ENV, "value": str(sb.exec_timeout_seconds)},
            # the run's limit is the server's: its own default (600 s) would clamp silently
            {"name": wire.SANDBOX_MAX_TIMEOUT_ENV, "value": str(sb.exec_timeout_seconds)},
            {"name": wire.SANDBOX_TOKEN_ENV,
             "valueFrom": {"secretKeyRef": {"name": secret_name(run), "key": SANDBOX_TOKEN_KEY}}},
        ],
        "ports": [{"name": "http", "containerPort": wire.SANDBOX_PORT}],
        "resources": sandbox_resources(run),
        "securityContext": container_security(),
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2},
        "volumeMounts": [{"name": "workspace", "mountPath": wire.SANDBOX_WORKSPACE},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    spec: dict[str, Any] = {
        "serviceAccountName": name(run, COMPONENT),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "containers": [container],
        # the workspace quota: past it the kubelet evicts the pod, the gateway sees the
        # sandbox lost and the group leases a fresh one
        "volumes": [tmp_volume("workspace", size=WORKSPACE_SIZE), tmp_volume(size="1Gi")],
    }
    if sb.runtime_class_name:
        spec["runtimeClassName"] = sb.runtime_class_name
    meta = metadata(run, COMPONENT, pod_name(run, suffix))
    meta["labels"] = pod_labels(run, COMPONENT)
    place(run, COMPONENT, {"metadata": meta, "spec": spec})  # spec.pod, spec.sandboxes.pod
    # the hash covers the spec only, so every pod of one template shares it
    meta["annotations"] = {**meta.get("annotations", {}), HASH_ANNOTATION: template_hash(spec)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def template_hash(spec: dict[str, Any]) -> str:
    return spec_hash({"spec": spec})


def current_hash(run: AsyncGRPORun) -> str:
    """Hash of the pods the spec asks for now; pods with another hash are outdated."""
    return build_pod(run, "x")["metadata"]["annotations"][HASH_ANNOTATION]
