"""Small helpers for tests and benchmarks that talk to the test cluster."""

from __future__ import annotations

import time
from pathlib import Path

import yaml


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
