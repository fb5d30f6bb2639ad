"""Prometheus's Kubernetes pod discovery, served as HTTP service discovery, for tests.

Debian's Prometheus (2.42+ds, the one this machine has) is built without
`kubernetes_sd_configs`: its client-go is not packaged. It does have `http_sd_configs`. This
server lists pods through the real API server and answers Prometheus's HTTP SD requests with
the targets and `__meta_kubernetes_*` labels that `kubernetes_sd_configs: [{role: pod}]`
would produce (prometheus/discovery/kubernetes/pod.go: one target per container port, or one
per container without ports, pods without an IP left out). The chart's scrape job
(files/prometheus-scrape.yaml) then runs with its own relabel rules unchanged; only its
discovery block is swapped (`http_sd_job`). What is tested is what the chart ships: the
operator's annotations and labels, the relabelling, and that the pods answer on the
annotated ports. Prometheus's own client-go watch is not (an upstream binary named by
ASYNCGRPO_PROMETHEUS runs the real `kubernetes_sd_configs` instead).
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def _sanitize(name: str) -> str:
    """Prometheus's strutil.SanitizeLabelName."""
    return _INVALID.sub("_", name)


def _pod_labels(pod: dict[str, Any]) -> dict[str, str]:
    meta, status, spec = pod["metadata"], pod.get("status", {}), pod.get("spec", {})
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions", []))
    labels = {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": status.get("podIP", ""),
        "__meta_kubernetes_pod_ready": str(ready).lower(),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta.get("uid", ""),
    }
    for kind in ("label", "annotation"):
        for key, value in (meta.get(f"{kind}s") or {}).items():
            labels[f"__meta_kubernetes_pod_{kind}_{_sanitize(key)}"] = value
            labels[f"__meta_kubernetes_pod_{kind}present_{_sanitize(key)}"] = "true"
    for owner in meta.get("ownerReferences", []):
        if owner.get("controller"):
            labels["__meta_kubernetes_pod_controller_kind"] = owner["kind"]
            labels["__meta_kubernetes_pod_controller_name"] = owner["name"]
    return labels


def target_groups(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The target groups `role: pod` gives for these pods (one group per pod)."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            continue
        base = _pod_labels(pod)
        for init, key in ((False, "containers"), (True, "initContainers")):
            for c in pod.get("spec", {}).get(key) or []:
                clabels = {"__meta_kubernetes_pod_container_name": c["name"],
                           "__meta_kubernetes_pod_container_image": c.get("image", ""),
                           "__meta_kubernetes_pod_container_init": str(init).lower()}
                ports = c.get("ports") or []
                if not ports:
                    if not init:  # pod.go: a port-less init container gets no target
                        groups.append({"targets": [ip], "labels": base | clabels})
                    continue
                for p in ports:
                    groups.append({"targets": [f"{ip}:{p['containerPort']}"], "labels": base
                                   | clabels | {
                                       "__meta_kubernetes_pod_container_port_name":
                                           p.get("name", ""),
                                       "__meta_kubernetes_pod_container_port_number":
                                           str(p["containerPort"]),
                                       "__meta_kubernetes_pod_container_port_protocol":
                                           p.get("protocol", "TCP")}})
    return groups


class PodDiscovery:
    """An HTTP SD endpoint over the API server's pods in `namespaces` (all if None)."""

    def __init__(self, api_server: str, token: str, namespaces: list[str] | None = None):
        self.api_server = api_server.rstrip("/")
        self.token = token
        self.namespaces = namespaces
        self._tls = ssl.create_default_context()
        self._tls.check_hostname = False
        self._tls.verify_mode = ssl.CERT_NONE
        self._server: ThreadingHTTPServer | None = None

    def pods(self) -> list[dict[str, Any]]:
        paths = ([f"/api/v1/namespaces/{ns}/pods" for ns in self.namespaces]
                 if self.namespaces else ["/api/v1/pods"])
        out = []
        for path in paths:
            req = urllib.request.Request(self.api_server + path,
                                         headers={"Authorization": f"Bearer {self.token}"})
            with urllib.request.urlopen(req, context=self._tls, timeout=10) as resp:
                out += json.load(resp)["items"]
        return out

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/targets"

    def start(self, host: str = "127.0.0.1") -> Self:
        discovery = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                try:
                    body = json.dumps(target_groups(discovery.pods())).encode()
                    code = 200
                except (OSError, ValueError, KeyError) as err:  # Prometheus keeps its last list
                    body, code = str(err).encode(), 502
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="pod-discovery").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
