"""The validating admission webhook: kopf's webhook server, addressed through a Service.

kopf's servers report a URL client config, which an API server can only use when it can
reach the operator by that host name; inside a cluster the API server reaches webhooks
through a Service reference. `ServiceWebhookServer` serves exactly like kopf's server and
rewrites the reported config to point at the Service. Certificates come from files (a
cert-manager Secret mounted in the pod); kopf reloads them when they change.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import AsyncIterator

import kopf

from asyncgrpo.controller.runtime import WebhookSettings


class ServiceWebhookServer(kopf.WebhookServer):
    def __init__(self, *, service_namespace: str, service_name: str, **kwargs):
        super().__init__(**kwargs)
        self.service_namespace = service_namespace
        self.service_name = service_name

    async def __call__(self, fn) -> AsyncIterator[dict]:
        async for config in super().__call__(fn):
            url = urllib.parse.urlsplit(config["url"])
            out = {k: v for k, v in config.items() if k != "url"}
            out["service"] = {"namespace": self.service_namespace, "name": self.service_name,
                              "port": self.port or url.port, "path": url.path}
            yield out


def server(ws: WebhookSettings) -> kopf.WebhookServer:
    files = {"certfile": os.path.join(ws.cert_dir, "tls.crt"),
             "pkeyfile": os.path.join(ws.cert_dir, "tls.key")}
    ca = os.path.join(ws.cert_dir, "ca.crt")
    files["cafile"] = ca if os.path.exists(ca) else files["certfile"]
    if ws.service:
        namespace, _, name = ws.service.partition("/")
        return ServiceWebhookServer(service_namespace=namespace, service_name=name,
                                    addr=ws.addr, port=ws.port, **files)
    return kopf.WebhookServer(addr=ws.addr, port=ws.port, host=ws.host, **files)
