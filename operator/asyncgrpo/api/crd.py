"""The CustomResourceDefinition, generated from the pydantic model (never hand-edited).

pydantic writes JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3 schema: no
$ref, no anyOf for optional fields, boolean exclusive bounds, int-or-string quantities, and
`x-kubernetes-preserve-unknown-fields` only where the model is free-form. This module does
that translation, so the API server enforces every single-field rule of `asyncgrpo.api`.
"""

from __future__ import annotations

from typing import Any

import yaml

from asyncgrpo import API_GROUP, API_VERSION, KIND, PLURAL
from asyncgrpo.api.v1alpha1 import MAX_RUN_NAME, RUN_NAME, AsyncGRPORunSpec, AsyncGRPORunStatus

SINGULAR = "asyncgrporun"
SHORT_NAMES = ["agr", "grporun"]
CRD_NAME = f"{PLURAL}.{API_GROUP}"

_DROP = {"title", "$defs", "additionalProperties"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _kube_marker(node: dict[str, Any]) -> str:
    """"(Kubernetes Toleration)" at the end of a Kubernetes type's description, or ""."""
    desc = str(node.get("description", ""))
    start = desc.rfind("(Kubernetes ")
    return desc[start:] if start >= 0 and desc.endswith(")") else ""


def _is_kube_type(node: dict[str, Any]) -> bool:
    return bool(_kube_marker(node))


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Translate one resolved JSON Schema node into a structural OpenAPI v3 node.

    Sections (objects) get no `default: {}`: several have defaults that only the model knows
    (default factories), and an empty section written by the API server would hide them. The
    operator always reads runs through the model, which fills every default.
    """
    node = dict(node)
    # Optional[X] is anyOf [X, null]: the field is simply optional in Kubernetes.
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if node.pop("x-kubernetes-int-or-string", False) or {o.get("type") for o in options} == {
            "integer", "string"
        }:
            node["x-kubernetes-int-or-string"] = True
        elif len(options) == 1:
            inner = _structural(options[0])
            desc = node.get("description")
            if desc and _is_kube_type(inner):   # keep saying which Kubernetes type it is
                node["description"] = f"{desc} {_kube_marker(inner)}"
            node = {**inner, **{k: v for k, v in node.items() if k not in ("default",)},
                    **({"default": node["default"]} if node.get("default") is not None else {})}
        else:
            raise ValueError(f"cannot express anyOf {options} structurally")
    if node.get("default", "absent") is None:
        del node["default"]
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], bool):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            node[bound] = node[key]
            node[key] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        node["type"] = "integer" if all(isinstance(v, int) for v in node["enum"]) else "string"

    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _DROP:
            continue
        if k == "properties":
            out[k] = {name: _structural(prop) for name, prop in v.items()}
        elif k == "items":
            out[k] = _structural(v)
        else:
            out[k] = v

    if node.get("type") == "object" and "properties" not in node:
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra)
        else:  # dict[str, Any]: free-form by design
            out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _brief(node: Any, depth: int | None = None) -> Any:
    """Kubernetes types keep the descriptions of their own fields only: their full
    documentation, repeated under every component's pod settings, would take the CRD past
    the API server's object size (1.5 MB); `kubectl explain pod.spec...` has the rest."""
    if isinstance(node, list):
        return [_brief(n, depth) for n in node]
    if not isinstance(node, dict):
        return node
    if depth is None and _is_kube_type(node):
        depth = 0
    out = {}
    for k, v in node.items():
        if k == "description" and depth is not None and depth > 1:
            continue
        if k == "properties":
            out[k] = {name: _brief(p, None if depth is None else depth + 1)
                      for name, p in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = _brief(v, depth)
        else:
            out[k] = v
    return out


def _schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve(raw, raw.get("$defs", {}))
    return _brief(_structural(resolved))


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def openapi_schema() -> dict[str, Any]:
    spec = _schema_of(AsyncGRPORunSpec)
    # Only the operator writes status, always through the model: defaults there are noise.
    status = _without_defaults(_schema_of(AsyncGRPORunStatus))
    return {
        "type": "object",
        "description": "An asynchronous GRPO training run.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # the only metadata a CRD schema may constrain: checked by the API server itself
            "metadata": {"type": "object", "properties": {"name": {
                "type": "string", "maxLength": MAX_RUN_NAME, "pattern": RUN_NAME}}},
            "spec": spec,
            "status": status,
        },
    }


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress",
     "description": "Optimizer steps done / total"},
    {"name": "Policy", "type": "integer", "jsonPath": ".status.policyVersion",
     "description": "Newest adapter version published"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.reward",
     "description": "Mean reward of the last step"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.throughput.rawTokensPerSecond",
     "description": "Rollout tokens trained per second"},
    {"name": "Sandboxes", "type": "string", "jsonPath": ".status.sandboxes.ready",
     "description": "Sandboxes ready (warm + busy) / wanted"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The CRD object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "asyncgrpo",
                       "app.kubernetes.io/part-of": "asyncgrpo"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["asyncgrpo"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `asyncgrpo crd` from asyncgrpo.api; do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)
