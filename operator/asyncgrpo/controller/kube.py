"""The few API calls the operator makes, on plain dict bodies, each write counted.

The typed client drops fields it does not model (and empty-string defaults); the dynamic
client runs discovery at start. Children are a fixed set of kinds, so their paths are a
table here and bodies go over `ApiClient.call_api` as JSON. Updates are JSON merge patches
of what the builder produced: fields the API server defaulted stay as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from asyncgrpo import API_GROUP, API_VERSION, KIND, PLURAL


def api_error(e: ApiException) -> tuple[str, str]:
    """(reason, message) of a refused write, from the API server's Status body."""
    try:
        doc = json.loads(e.body or "{}")
    except ValueError:
        doc = {}
    return doc.get("reason") or f"HTTP{e.status}", (doc.get("message") or str(e.reason))[:500]


@dataclass(frozen=True)
class Resource:
    """One kind the operator reads or writes."""

    group: str      # "" for the core group
    version: str
    plural: str
    #: watched through a kopf index of the run's children (`handlers.CHILD_RESOURCES`)
    watched: bool = False
    #: owned as a whole set: one the spec no longer implies is deleted (`reconcile`); the
    #: others are deleted by their own rules (sandbox pods by the pool, Jobs once read, the
    #: Secret with the run)
    pruned: bool = False

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


#: kind -> resource: the one table of the kinds the operator touches (the watched ones first,
#: in the order their indexes are read).
RESOURCES: dict[str, Resource] = {
    "Pod": Resource("", "v1", "pods", watched=True),
    "ConfigMap": Resource("", "v1", "configmaps", watched=True, pruned=True),
    "Service": Resource("", "v1", "services", watched=True, pruned=True),
    "ServiceAccount": Resource("", "v1", "serviceaccounts", watched=True, pruned=True),
    "Deployment": Resource("apps", "v1", "deployments", watched=True, pruned=True),
    "StatefulSet": Resource("apps", "v1", "statefulsets", watched=True, pruned=True),
    "NetworkPolicy": Resource("networking.k8s.io", "v1", "networkpolicies", watched=True,
                              pruned=True),
    "Role": Resource("rbac.authorization.k8s.io", "v1", "roles", watched=True, pruned=True),
    "RoleBinding": Resource("rbac.authorization.k8s.io", "v1", "rolebindings", watched=True,
                            pruned=True),
    "Job": Resource("batch", "v1", "jobs", watched=True),
    "Secret": Resource("", "v1", "secrets"),
    "Event": Resource("", "v1", "events"),
    KIND: Resource(API_GROUP, API_VERSION, PLURAL),
}
#: kinds of the run's children the operator watches, and those it prunes
WATCHED_KINDS = tuple(k for k, r in RESOURCES.items() if r.watched)
PRUNED_KINDS = frozenset(k for k, r in RESOURCES.items() if r.pruned)


def path(kind: str, namespace: str, name: str | None = None) -> str:
    r = RESOURCES[kind]
    p = f"{r.prefix}/namespaces/{namespace}/{r.plural}"
    return f"{p}/{name}" if name else p


def request(api: ApiClient, method: str, url: str, body: Any = None,
            content_type: str = "application/json", query: list | None = None,
            raw: bool = False, timeout: float = 30) -> Any:
    """One REST call; the decoded JSON answer (None if empty), or bytes with `raw`."""
    m, full, headers, data, post = api.param_serialize(
        method, url, query_params=query or [], body=body,
        header_params={"Content-Type": content_type, "Accept": "application/json"},
        auth_settings=["BearerToken"])
    resp = api.call_api(m, full, header_params=headers, body=data, post_params=post,
                        _request_timeout=timeout)
    resp.read()
    if not 200 <= resp.status < 300:
        raise ApiException(http_resp=resp)
    if raw:
        return resp.data
    return json.loads(resp.data) if resp.data else None


class Kube:
    """Create, patch, delete and get namespaced objects; `on_write(verb, kind)` counts writes.

    With a `fence` (leader election, `controller.leader.Fence`), every write passes through
    it: a replica that does not hold the Lease gets `NotLeader` instead of a request.
    """

    def __init__(self, api: ApiClient, on_write: Callable[[str, str], None] | None = None,
                 fence: Any = None):
        self.api = api
        self.on_write = on_write or (lambda verb, kind: None)
        self.fence = fence

    def _call(self, method: str, url: str, body: Any = None,
              content_type: str = "application/json", query: list | None = None) -> Any:
        if method == "GET" or self.fence is None:
            return request(self.api, method, url, body, content_type, query)
        with self.fence.write():
            return request(self.api, method, url, body, content_type, query)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", path(kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def secret_kind(self, namespace: str, name: str) -> tuple[str, dict[str, str]] | None:
        """A Secret's type and labels, None when there is none; never its data: the API
        server's Table view (columns and PartialObjectMetadata only)."""
        m, full, headers, data, post = self.api.param_serialize(
            "GET", path("Secret", namespace, name), query_params=[("includeObject", "Metadata")],
            header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
            auth_settings=["BearerToken"])
        resp = self.api.call_api(m, full, header_params=headers, body=data, post_params=post,
                                 _request_timeout=30)
        resp.read()
        if resp.status == 404:
            return None
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        table = json.loads(resp.data)
        columns = [c.get("name") for c in table.get("columnDefinitions") or []]
        row = (table.get("rows") or [{}])[0]
        cells = row.get("cells") or []
        type_ = str(cells[columns.index("Type")]) if "Type" in columns and \
            columns.index("Type") < len(cells) else ""
        labels = ((row.get("object") or {}).get("metadata") or {}).get("labels") or {}
        return type_, {str(k): str(v) for k, v in labels.items()}

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None if it already exists (a cache that lagged behind an earlier create)."""
        kind, ns = obj["kind"], obj["metadata"]["namespace"]
        self.on_write("create", kind)
        try:
            return self._call("POST", path(kind, ns), body=obj)
        except ApiException as e:
            if e.status == 409:
                return None
            raise

    def patch(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, meta = obj["kind"], obj["metadata"]
        self.on_write("patch", kind)
        return self._call("PATCH", path(kind, meta["namespace"], meta["name"]), body=obj,
                          content_type="application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str,
               propagation: str = "Background") -> bool:
        self.on_write("delete", kind)
        try:
            self._call("DELETE", path(kind, namespace, name),
                       body={"propagationPolicy": propagation})
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise
