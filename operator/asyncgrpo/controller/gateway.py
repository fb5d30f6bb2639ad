"""The per-run sandbox gateway: a Deployment and its Service.

The gateway watches the run's sandbox pods (selector below) and leases them to rollout
groups; its tokens come from the run's token Secret through the environment, never argv.
It is the only workload with a Kubernetes token (see `rbac`).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import sandboxes
from asyncgrpo.controller.common import (
    GATEWAY_PORT,
    SANDBOX_PORT,
    container_security,
    metadata,
    name,
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


def label_selector(run: AsyncGRPORun) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(run, sandboxes.COMPONENT).items())


def build_service(run: AsyncGRPORun) -> dict[str, Any]:
    return service(run, COMPONENT, [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}])


def build_deployment(run: AsyncGRPORun, replicas: int = 1) -> dict[str, Any]:
    sb = run.spec.sandboxes
    assert sb is not None
    secret = secret_name(run)
    env = [
        {"name": "ASYNCGRPO_GATEWAY_PORT", "value": str(GATEWAY_PORT)},
        {"name": "ASYNCGRPO_GATEWAY_SELECTOR", "value": label_selector(run)},
        {"name": "ASYNCGRPO_GATEWAY_NAMESPACE",
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "ASYNCGRPO_GATEWAY_SANDBOX_PORT", "value": str(SANDBOX_PORT)},
        {"name": "ASYNCGRPO_GATEWAY_MAX_EXEC_SECONDS", "value": str(sb.exec_timeout_seconds)},
        {"name": "ASYNCGRPO_GATEWAY_TOKEN",
         "valueFrom": {"secretKeyRef": {"name": secret, "key": GATEWAY_TOKEN_KEY}}},
        {"name": "ASYNCGRPO_SANDBOX_TOKEN",
         "valueFrom": {"secretKeyRef": {"name": secret, "key": SANDBOX_TOKEN_KEY}}},
    ]
    container = {
        "name": "gateway",
        "image": sb.image,
        "command": ["asyncgrpo", "gateway"],
        "env": env,
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
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
            "template": {
                "metadata": {"labels": pod_labels(run, COMPONENT),
                             "annotations": scrape_annotations(GATEWAY_PORT)},
                "spec": {
                    "serviceAccountName": name(run, COMPONENT),
                    "automountServiceAccountToken": True,
                    "securityContext": pod_security(),
                    "containers": [container],
                    "volumes": [tmp_volume()],
                },
            },
        },
    })
