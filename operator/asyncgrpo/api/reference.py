"""The field reference in docs/api-reference.md, generated from the CRD schema so the docs
can never disagree with what the API server enforces (a test compares them)."""

from __future__ import annotations

import json
from typing import Any

from asyncgrpo.api.crd import _is_kube_type, _kube_marker, openapi_schema


def _type_of(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    t = node.get("type", "")
    if t == "object" and _is_kube_type(node):   # "(Kubernetes Toleration)"
        return "core/v1." + _kube_marker(node)[len("(Kubernetes "):-1]
    if t == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if t == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type_of(node['additionalProperties'])}"
    return t


def _rules(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, sym in (("minimum", ">"), ("maximum", "<")):
        if key in node:
            exclusive = node.get("exclusiveMinimum" if sym == ">" else "exclusiveMaximum")
            parts.append(f"{sym}{'' if exclusive else '='} {node[key]}")
    for key, label in (("minLength", "min length"), ("maxLength", "max length"),
                       ("minItems", "min items"), ("pattern", "pattern")):
        if key in node:
            value = f"`{node[key]}`" if key == "pattern" else node[key]
            parts.append(f"{label} {value}")
    return "; ".join(parts)


def _rows(node: dict[str, Any], path: str, required: set[str]) -> list[str]:
    rows = []
    for name, prop in node.get("properties", {}).items():
        here = f"{path}.{name}"
        default = prop.get("default")
        default_s = "" if default is None else f"`{json.dumps(default)}`".replace("|", "\\|")
        desc = (prop.get("description", "") + (" **Required.**" if name in required else ""))
        rows.append(f"| `{here}` | {_type_of(prop)} | {default_s} | "
                    f"{_rules(prop).replace('|', chr(92) + '|')} | {desc} |")
        target = prop.get("items", prop) if prop.get("type") == "array" else prop
        # Kubernetes' own types (Toleration, Volume...) are documented by Kubernetes
        if target.get("properties") and not _is_kube_type(target):
            suffix = "[]" if prop.get("type") == "array" else ""
            rows += _rows(target, here + suffix, set(target.get("required", [])))
    return rows


def reference_markdown() -> str:
    schema = openapi_schema()
    out = [
        "# AsyncGRPORun field reference",
        "",
        ("Generated from `asyncgrpo.api` (`python -m asyncgrpo.api.reference > "
         "docs/api-reference.md`); do not edit. Cross-field rules are listed in "
         "[api.md](api.md)."),
        "",
    ]
    for section in ("spec", "status"):
        node = schema["properties"][section]
        out += [f"## {section}", "", "| field | type | default | rules | description |",
                "|---|---|---|---|---|"]
        out += _rows(node, section, set(node.get("required", [])))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
