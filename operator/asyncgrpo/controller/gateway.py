"""The per-run sandbox gateway: a Deployment and its Service.

The gateway watches the run's sandbox pods (selector below) and leases them to rollout
groups; its tokens come from the run's token Secret through the environment, never argv.
It is the only workload with a Kubernetes token (see `rbac`).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import sandboxes
from asyncgrpo.controller.common import (
    child_name,
    container_security,
    metadata,
    name,
    place,
    pod_labels,
    pod_security,
    selector,
    service,
    stamp,
    tmp_volume,
)
from asyncgrpo.controller.metrics import scrape_annotations
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, SANDBOX_TOKEN_KEY, secret_name

COMPONENT = "gateway"
#: Where a run's gateway answers the operator (`Settings.gateway_url`); {name} and
#: {namespace} are filled in.
URL = f"http://{child_name('{name}', COMPONENT)}.{{namespace}}.svc:{wire.GATEWAY_PORT}"


def label_selector(run: AsyncGRPORun) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(run, sandboxes.COMPONENT).items())


def build_service(run: AsyncGRPORun) -> dict[str, Any]:
    return service(run, COMPONENT, [{"name": "http", "port": wire.GATEWAY_PORT, "targetPort": "http"}])


def build_deployment(run: AsyncGRPORun, replicas: int = 1) -> dict[str, Any]:
    sb = run.spec.sandboxes
    assert sb is not None
    secret = secret_name(run)
    env = [
        {"name": wire.GATEWAY_PORT_ENV, "value": str(wire.GATEWAY_PORT)},
        {"name": wire.GATEWAY_SELECTOR_ENV, "value": label_selector(run)},
        {"name": wire.GATEWAY_NAMESPACE_ENV,
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": wire.GATEWAY_SANDBOX_PORT_ENV, "value": str(wire.SANDBOX_PORT)},
        {"name": wire.GATEWAY_MAX_EXEC_ENV, "value": str(sb.exec_timeout_seconds)},
        {"name": wire.GATEWAY_MAX_IMAGES_ENV, "value": str(sb.images.max_distinct)},
        {"name": wire.GATEWAY_IMAGE_IDLE_ENV, "value": str(sb.idle_ttl_seconds)},
        {"name": wire.GATEWAY_LIFECYCLE_ENV,
         "value": "reuse" if sb.lifecycle == "Reuse" else "fresh"},
        {"name": wire.GATEWAY_TOKEN_ENV,
         "valueFrom": {"secretKeyRef": {"name": secret, "key": GATEWAY_TOKEN_KEY}}},
        {"name": wire.SANDBOX_TOKEN_ENV,
         "valueFrom": {"secretKeyRef": {"name": secret, "key": SANDBOX_TOKEN_KEY}}},
    ]
    container = {
        "name": "gateway",
        "image": sb.image,
        "command": ["asyncgrpo", "gateway"],
        "env": env,
        "ports": [{"name": "http", "containerPort": wire.GATEWAY_PORT}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"cpu": "1", "memory": "512Mi"}},
        "securityContext": container_security(),
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 15},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(run, COMPONENT),
        "spec": {
            "replicas": replicas,  # leases live in memory: one gateway per run
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(run, COMPONENT)},
            "template": place(run, COMPONENT, {
                "metadata": {"labels": pod_labels(run, COMPONENT),
                             "annotations": scrape_annotations(wire.GATEWAY_PORT)},
                "spec": {
                    "serviceAccountName": name(run, COMPONENT),
                    "automountServiceAccountToken": True,
                    "securityContext": pod_security(),
                    "containers": [container],
                    "volumes": [tmp_volume()],
                },
            }),
        },
    })
