"""Sandbox pods: built one by one, because the operator is their controller (not a ReplicaSet).

A ReplicaSet would pick which pod to delete on scale-down; only the operator, through the
gateway's demand signal, knows which sandboxes are idle, so the pool is plain pods owned by
the run. Sandboxes run untrusted code: no service-account token, no service links, non-root,
no privilege escalation, optional RuntimeClass (gVisor, Kata), a bounded workspace.

A row may name the image its sandbox runs (`spec.sandboxes.imageColumn`): such a pod runs
that image with the image's own `python3`, and an init container from the run's sandbox image
first writes the self-contained server there (`asyncgrpo sandbox bundle`, an emptyDir mounted
read-only in the sandbox container), so a task image needs nothing of the project's. Every
pod is labelled with its image's key (`wire.SANDBOX_IMAGE_LABEL`), which the gateway leases by.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller.common import (
    HASH_ANNOTATION,
    SANDBOX_IMAGE_ANNOTATION,
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
#: the init container writing the server bundle: a second of CPU, a few MB written
BUNDLE_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"},
                    "limits": {"cpu": "1", "memory": "256Mi", "ephemeral-storage": "256Mi"}}


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


def build_pod(run: AsyncGRPORun, suffix: str, image: str | None = None) -> dict[str, Any]:
    """The sandbox pod `<run>-sandbox-<suffix>`, of the run's image or of a row's `image`."""
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
    meta["labels"] = {**pod_labels(run, COMPONENT), wire.SANDBOX_IMAGE_LABEL: wire.sandbox_image_key(image)}
    place(run, COMPONENT, {"metadata": meta, "spec": spec})  # spec.pod, spec.sandboxes.pod
    # the hash covers the run's template only, so every pod of one template shares it,
    # whichever image it runs
    meta["annotations"] = {**meta.get("annotations", {}), HASH_ANNOTATION: template_hash(spec)}
    if image:
        meta["annotations"][SANDBOX_IMAGE_ANNOTATION] = image
        _run_row_image(spec, container, sb.image, image)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _run_row_image(spec: dict[str, Any], container: dict[str, Any], sandbox_image: str,
                   image: str) -> None:
    """The sandbox container runs `image` with its own python3 and the server the init
    container (the run's sandbox image) writes into the `server` emptyDir."""
    mount = {"name": "server", "mountPath": wire.SANDBOX_SERVER_BUNDLE_DIR}
    spec["initContainers"] = [{
        "name": "sandbox-server",
        "image": sandbox_image,
        "command": ["asyncgrpo", "sandbox", "bundle", wire.SANDBOX_SERVER_BUNDLE_DIR],
        "resources": BUNDLE_RESOURCES,
        "securityContext": container_security(),
        "volumeMounts": [mount],
    }]
    container["image"] = image
    # -I -S: none of the image's site-packages nor PYTHON* variables reach the server
    container["command"] = ["python3", "-I", "-S", wire.SANDBOX_SERVER_BUNDLE_ENTRY, "serve"]
    # the entry's one line on a python3 too old (or the runtime's "python3 not found") is
    # what the status reports (SandboxImageRefused)
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    container["volumeMounts"].append({**mount, "readOnly": True})
    spec["volumes"].append(tmp_volume("server", size="128Mi"))


def template_hash(spec: dict[str, Any]) -> str:
    return spec_hash({"spec": spec})


def current_hash(run: AsyncGRPORun) -> str:
    """Hash of the pods the spec asks for now; pods with another hash are outdated."""
    return build_pod(run, "x")["metadata"]["annotations"][HASH_ANNOTATION]
