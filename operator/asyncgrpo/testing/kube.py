"""Small helpers for tests and benchmarks that talk to the test cluster: the admin's client
(the operator's own `controller.kube.Kube` plus what tests read besides), the CRD, and the
kubelet's part for pods no node runs."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.controller.kube import Kube, path, request


class Api(Kube):
    """The operator's client (`controller.kube.Kube`: paths, requests, `get`, `delete`) as
    the test cluster's admin, with what tests need besides: any URL, lists, merge patches
    of subresources, namespaces, conditions, events, the API server's request counters.
    `create` raises on a conflict (a test's object that already exists is a test bug)."""

    def call(self, method: str, url: str, body: Any = None, query: list | None = None,
             content_type: str = "application/json") -> Any:
        return self._call(method, url, body, content_type, query)

    def create(self, obj: dict) -> dict:
        return self.call("POST", path(obj["kind"], obj["metadata"]["namespace"]), body=obj)

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict]:
        q = [("labelSelector", selector)] if selector else []
        return self.call("GET", path(kind, ns), query=q)["items"]

    def merge_patch(self, kind: str, ns: str, name: str, body: dict, sub: str = "") -> dict:
        """A JSON merge patch of `body` on the object or its subresource `sub` ("/status")."""
        return self.call("PATCH", path(kind, ns, name) + sub, body=body,
                         content_type="application/merge-patch+json")

    def namespace(self, prefix: str = "t") -> str:
        """A new namespace, once its `default` ServiceAccount exists (the controller-manager
        makes it; until then the ServiceAccount admission plugin refuses pods that use it)."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.call("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": name}})
        deadline = time.monotonic() + 30
        while self.get("ServiceAccount", name, "default") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return name

    def run(self, ns: str, name: str) -> dict:
        return self.get("AsyncGRPORun", ns, name) or {}

    def condition(self, ns: str, name: str, type_: str) -> dict:
        for c in (self.run(ns, name).get("status") or {}).get("conditions") or []:
            if c["type"] == type_:
                return c
        return {}

    def events(self, ns: str, name: str) -> list[dict]:
        return [e for e in self.call("GET", f"/api/v1/namespaces/{ns}/events")["items"]
                if e["involvedObject"].get("name") == name]

    def write_requests(self, resources: set[str]) -> dict[tuple[str, str], int]:
        """The API server's own count of write requests on `resources` (all clients), by
        (verb, resource)."""
        text = self.call_text("/metrics")
        total: dict[tuple[str, str], int] = {}
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(kv.split("=", 1) for kv in
                          line[line.index("{") + 1:line.index("}")].replace('"', "").split(","))
            if labels.get("verb") in ("POST", "PUT", "PATCH", "DELETE", "APPLY") \
                    and labels.get("resource") in resources:
                k = (labels["verb"], labels["resource"])
                total[k] = total.get(k, 0) + int(float(line.rsplit(" ", 1)[1]))
        return total

    def call_text(self, url: str) -> str:
        return request(self.api, "GET", url, raw=True).decode()


def install_crd(dynamic_client, path: Path, timeout: float = 30.0) -> None:
    """Create or replace the CRD in `path` and wait until it is Established."""
    from kubernetes.dynamic.exceptions import ConflictError

    crds = dynamic_client.resources.get(api_version="apiextensions.k8s.io/v1",
                                        kind="CustomResourceDefinition")
    body = yaml.safe_load(Path(path).read_text())
    name = body["metadata"]["name"]
    try:
        crds.create(body=body)
    except ConflictError:
        current = crds.get(name=name)
        body["metadata"]["resourceVersion"] = current.metadata.resourceVersion
        crds.replace(body=body)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conditions = crds.get(name=name).status.conditions or []
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            # Discovery caches lag a moment behind Established.
            dynamic_client.resources.invalidate_cache()
            return
        time.sleep(0.2)
    raise TimeoutError(f"CRD {name} not Established after {timeout}s")


def wait_garbage_collected_owner(dynamic_client, owner: dict, timeout: float = 180.0) -> float:
    """Create `owner` (a custom object) with a ConfigMap it owns, delete the owner and wait until
    the controller-manager's garbage collector has collected the ConfigMap; returns the seconds.

    The collector learns a new kind from discovery on its own resync (every 30 s) and only then
    collects that kind's dependents; a large CRD takes longer to reach it. Tests that wait for
    collection with their own short deadlines start once this has passed, instead of racing it.
    """
    api_version, kind = owner["apiVersion"], owner["kind"]
    ns = owner["metadata"]["namespace"]
    owners = dynamic_client.resources.get(api_version=api_version, kind=kind)
    cms = dynamic_client.resources.get(api_version="v1", kind="ConfigMap")
    t0 = time.monotonic()
    created = owners.create(body=owner, namespace=ns)
    name = f"{owner['metadata']['name']}-dependent"
    cms.create(namespace=ns, body={
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "ownerReferences": [{
            "apiVersion": api_version, "kind": kind, "name": created.metadata.name,
            "uid": created.metadata.uid}]}})
    owners.delete(name=created.metadata.name, namespace=ns)
    deadline = t0 + timeout
    from kubernetes.dynamic.exceptions import NotFoundError

    while time.monotonic() < deadline:
        try:
            cms.get(name=name, namespace=ns)
        except NotFoundError:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"the garbage collector did not collect a {kind}'s dependent "
                       f"within {timeout}s")


# ---------------------------------------------------------------- playing the kubelet


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_status(phase: str = "Running", ready: bool = True, waiting: str | None = None,
               terminated: int | None = None, restarts: int = 0,
               unschedulable: bool = False) -> dict:
    t = now()
    if unschedulable:
        return {"status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
             "lastTransitionTime": t}]}}
    state: dict = {"running": {"startedAt": t}}
    if waiting:
        state = {"waiting": {"reason": waiting, "message": f"{waiting}: test"}}
    if terminated is not None:
        state = {"terminated": {"exitCode": terminated, "reason": "Completed"
                                if terminated == 0 else "Error", "startedAt": t, "finishedAt": t}}
    return {"status": {
        "phase": phase,
        "podIP": "10.0.0.1",
        "startTime": t,
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                       {"type": "Ready", "status": "True" if ready else "False",
                        "lastTransitionTime": t},
                       {"type": "ContainersReady", "status": "True" if ready else "False",
                        "lastTransitionTime": t}],
        "containerStatuses": [{"name": "c", "ready": ready, "restartCount": restarts,
                               "image": "x", "imageID": "", "state": state}],
    }}


def kubelet(api: Api, ns: str, selector: str, **status: Any) -> list[str]:
    """Set the status of every pod matching `selector`, as a kubelet would; returns names."""
    names = []
    for pod in api.list("Pod", ns, selector):
        body = pod_status(**status)
        for cs in body["status"].get("containerStatuses", []):
            cs["name"] = pod["spec"]["containers"][0]["name"]
        api.merge_patch("Pod", ns, pod["metadata"]["name"], body, "/status")
        names.append(pod["metadata"]["name"])
    return names


def component(run: str, c: str) -> str:
    return f"asyncgrpo.dev/run={run},app.kubernetes.io/component={c}"
