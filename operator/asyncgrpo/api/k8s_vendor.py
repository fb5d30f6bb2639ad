"""Vendoring Kubernetes' OpenAPI definitions for `asyncgrpo.api.k8s`.

`python -m asyncgrpo.api.k8s_vendor DEFINITIONS.json > operator/asyncgrpo/api/k8s_openapi.json`
takes a release's swagger.json (api/openapi-spec/swagger.json of the Kubernetes tree) or
kubernetes-validate's `<version>-local/_definitions.json` and keeps the closure of `ROOTS`.
Kept apart from `k8s` so it runs before the vendored file exists.
"""

from __future__ import annotations

import json
import sys
from typing import Any

SOURCE_VERSION = "1.30"
_CORE = "io.k8s.api.core.v1."
#: The types a run's pod settings use; the vendored file holds these and what they reference.
ROOTS = tuple(_CORE + n for n in ("Toleration", "Affinity", "TopologySpreadConstraint",
                                  "Volume", "VolumeMount", "EnvVar", "LocalObjectReference"))
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def _normalize(node: Any) -> Any:
    """A definition in OpenAPI v2/v3 form: single types (JSON Schema 2020-12's
    ["string", "null"] unions dropped), refs to #/definitions/, no x-kubernetes list hints
    (they constrain merges the CRD does not need and some need fields 1.20 servers lack)."""
    if isinstance(node, list):
        return [_normalize(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k.startswith("x-kubernetes-") or k in ("format", "default"):
            continue
        if k == "type" and isinstance(v, list):
            v = next(t for t in v if t != "null")
        if k == "$ref":
            v = "#/definitions/" + v.rsplit("/", 1)[-1]
        if k == "oneOf":  # Quantity and IntOrString, mapped by name
            continue
        out[k] = _normalize(v)
    return out


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_refs, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].rsplit("/", 1)[-1]} if "$ref" in node else set()
    return found.union(*(_refs(v) for v in node.values()))


def vendor(document: dict[str, Any]) -> dict[str, Any]:
    """The closure of ROOTS in a swagger.json or JSON Schema `$defs` document."""
    defs = document.get("definitions") or document["$defs"]
    out: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = {} if name in (QUANTITY, INT_OR_STRING) else _normalize(defs[name])
        if name != OBJECT_META:
            todo += sorted(_refs(out[name]))
        else:
            out[name] = {"type": "object"}
    return {"source": f"Kubernetes {SOURCE_VERSION} OpenAPI", "definitions": dict(sorted(
        out.items()))}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(vendor(json.load(f)), indent=1, sort_keys=True))
