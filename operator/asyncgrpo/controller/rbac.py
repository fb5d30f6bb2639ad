"""ServiceAccounts and Roles of a run's workloads: least privilege, tokens only where needed.

- `<run>-workload` (trainer, vLLM): no Role, no token mounted; they talk to S3 and each
  other, never to the Kubernetes API.
- `<run>-gateway`: a Role that can only read pods in the run's namespace (get, list, watch),
  which is how it finds the run's sandbox pods by label. RBAC cannot narrow list/watch to a
  label selector, so the gateway sees pod objects of its namespace, not their secrets and
  never a write.
- `<run>-sandbox`: no Role and `automountServiceAccountToken: false` on the account itself,
  so even a pod spec that asked for one would get no token.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import gateway, sandboxes
from asyncgrpo.controller.common import image_pull_secrets, metadata, name, stamp

WORKLOAD = "workload"
#: Holds `<run>-workload` until the bucket cleanup Job, which runs as it, is done: a
#: foreground deletion (`kubectl delete --cascade=foreground`, GitOps tools) deletes the run's
#: children before the run, and a Job whose ServiceAccount is gone never gets a pod. Only with
#: `deletionPolicy: Delete`; the delete handler removes it on every way out.
CLEANUP_FINALIZER = "asyncgrpo.dev/bucket-cleanup"


def _account(run: AsyncGRPORun, component: str, automount: bool,
             finalizers: list[str] | None = None,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """One ServiceAccount; every one carries the run-wide imagePullSecrets (spec.pod)."""
    meta = metadata(run, component)
    if finalizers is not None:
        meta["finalizers"] = finalizers
    if annotations:
        meta["annotations"] = {k: v for k, v in annotations.items()
                               if not k.startswith("asyncgrpo.dev/")}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta,
               "automountServiceAccountToken": automount}
    if secrets := image_pull_secrets(run):
        account["imagePullSecrets"] = secrets
    return stamp(account)


def build_rbac(run: AsyncGRPORun) -> list[dict[str, Any]]:
    # an empty list rather than none: the merge patch then drops it when the policy changes
    holds = [CLEANUP_FINALIZER] if run.spec.adapter_store.deletion_policy == "Delete" else []
    # spec.serviceAccount.annotations: cloud identity (IRSA, GKE workload identity)
    out = [_account(run, WORKLOAD, automount=False, finalizers=holds,
                    annotations=run.spec.service_account.annotations)]
    if run.spec.sandboxes is None:
        return out
    gw = name(run, gateway.COMPONENT)
    out += [
        _account(run, gateway.COMPONENT, automount=True),
        stamp({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(run, gateway.COMPONENT),
            "rules": [{"apiGroups": [""], "resources": ["pods"],
                       "verbs": ["get", "list", "watch"]}],
        }),
        stamp({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(run, gateway.COMPONENT),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": gw},
            "subjects": [{"kind": "ServiceAccount", "name": gw,
                          **({"namespace": run.metadata.namespace}
                             if run.metadata.namespace else {})}],
        }),
        _account(run, sandboxes.COMPONENT, automount=False),
    ]
    return out
