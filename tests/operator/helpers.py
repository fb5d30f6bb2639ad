"""Test-side helpers: play the kubelet, serve a gateway's demand and a trainer's metrics,
read the API server's own request counters, wait for conditions."""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.request
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.controller.kube import path, request

REPO = Path(__file__).resolve().parents[2]
LABEL_RUN = "asyncgrpo.dev/run"


def wait_for(fn, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    """Poll `fn` until it returns a truthy value; the last value or error goes in the failure."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (AssertionError, KeyError, TypeError) as e:   # not there yet
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


class Api:
    """Plain REST on dicts against the test cluster (admin)."""

    def __init__(self, api_client):
        self.api = api_client

    def call(self, method: str, url: str, body: Any = None, query: list | None = None,
             content_type: str = "application/json") -> Any:
        return request(self.api, method, url, body, content_type, query)

    def get(self, kind: str, ns: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException
        try:
            return self.call("GET", path(kind, ns, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict]:
        q = [("labelSelector", selector)] if selector else []
        return self.call("GET", path(kind, ns), query=q)["items"]

    def create(self, obj: dict) -> dict:
        return self.call("POST", path(obj["kind"], obj["metadata"]["namespace"]), body=obj)

    def patch(self, kind: str, ns: str, name: str, body: dict, sub: str = "") -> dict:
        return self.call("PATCH", path(kind, ns, name) + sub, body=body,
                         content_type="application/merge-patch+json")

    def delete(self, kind: str, ns: str, name: str) -> None:
        self.call("DELETE", path(kind, ns, name))

    def namespace(self, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.call("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": name}})
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


def reconcile_errors(metrics) -> dict[str, float]:
    """error -> count of the operator's reconcile errors, read through its registry."""
    return {s.labels["error"]: s.value for family in metrics.registry.collect()
            for s in family.samples if s.name == "asyncgrpo_operator_reconcile_errors_total"}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- playing the kubelet


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
        api.patch("Pod", ns, pod["metadata"]["name"], body, "/status")
        names.append(pod["metadata"]["name"])
    return names


def component(run: str, c: str) -> str:
    return f"asyncgrpo.dev/run={run},app.kubernetes.io/component={c}"


# ---------------------------------------------------------------- fake peers over real HTTP


class JsonServer:
    """A loopback HTTP server answering GET <path> from a dict the test changes."""

    def __init__(self):
        self.routes: dict[str, tuple[str, bytes]] = {}
        self.hits: dict[str, int] = {}
        self.auth: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                if self.path not in server.routes:
                    self.send_response(404)
                    self.end_headers()
                    return
                ctype, body = server.routes[self.path]
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                server.auth[self.path] = self.headers.get("Authorization", "")
                _, body = server.routes.get(self.path, ("", b'{"safe_to_delete": true}'))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_json(self, path_: str, doc: dict) -> None:
        self.routes[path_] = ("application/json", json.dumps(doc).encode())

    def set_text(self, path_: str, text: str) -> None:
        self.routes[path_] = ("text/plain; version=0.0.4", text.encode())

    def close(self) -> None:
        self.httpd.shutdown()


# ---------------------------------------------------------------- runs


def example(name: str) -> dict:
    docs = list(yaml.safe_load_all((REPO / "examples" / name).read_text()))
    return copy.deepcopy(next(d for d in docs if d.get("kind") == "AsyncGRPORun"))


def make_run(s3, ns: str, name: str, source: str = "lora-math.yaml", **spec_changes) -> dict:
    """An example run pointed at the test S3 server, with a credentials Secret in `ns`."""
    run = example(source)
    run["metadata"] = {"name": name, "namespace": ns}
    store = run["spec"]["adapterStore"]
    store["endpoint"] = s3.endpoint
    store["credentialsSecret"] = {"name": "s3-credentials"}
    for key, value in spec_changes.items():
        run["spec"][key] = value
    return run


def s3_secret(s3, ns: str, name: str = "s3-credentials") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
            "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key,
                           "AWS_SECRET_ACCESS_KEY": s3.secret_key}}


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
