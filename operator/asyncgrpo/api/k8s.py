"""Kubernetes' own pod-spec types (Toleration, Affinity, Volume...), as pydantic models.

A run places its pods with the same objects a Pod spec takes, so a user copies them from any
manifest and the CRD carries their real schema, as KubeRay's and Kubeflow's CRDs do (there
through controller-gen), not a weaker hand-written copy. The definitions come from the
Kubernetes OpenAPI document, vendored as the closure of the types below in
`k8s_openapi.json` (Kubernetes `SOURCE_VERSION`); `python -m asyncgrpo.api.k8s_vendor DEFS.json`
(`asyncgrpo.api.k8s_vendor`) rewrites it from a swagger.json or from kubernetes-validate's `_definitions.json` of a release.

Every definition becomes a strict pydantic model with the Kubernetes field names (camelCase)
and descriptions and `extra="forbid"`: `asyncgrpo validate` refuses a typo'd or mistyped
field with its path, where the API server would silently prune it. The generated JSON schema
goes into the CRD through `asyncgrpo.api.crd` like every other model. Two definitions are
mapped, not copied: Quantity and IntOrString become int-or-string, and an embedded
ObjectMeta (in an ephemeral volume's claim template) keeps labels and annotations only, as
controller-gen's `generateEmbeddedObjectMeta` does.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from asyncgrpo.api.k8s_vendor import (
    _CORE,
    INT_OR_STRING,
    OBJECT_META,
    QUANTITY,
)

#: Marker that ends the description of every Kubernetes type (the field reference stops there).
KUBE_TYPE = "(Kubernetes {})"

IntOrString = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


class KubeModel(BaseModel):
    """Base of the generated models: Kubernetes' names as they are, nothing unknown, strict."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class EmbeddedObjectMeta(KubeModel):
    """Metadata of an embedded object (a claim template): labels and annotations."""

    labels: dict[str, str] | None = Field(default=None, description="Labels.")
    annotations: dict[str, str] | None = Field(default=None, description="Annotations.")


@cache
def definitions() -> dict[str, Any]:
    text = resources.files("asyncgrpo.api").joinpath("k8s_openapi.json").read_text()
    return json.loads(text)["definitions"]


# ---------------------------------------------------------------- models


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _type_of(node: dict[str, Any]) -> Any:
    if "$ref" in node:
        return model(node["$ref"].rsplit("/", 1)[-1])
    t = node.get("type")
    if t == "string":
        return str
    if t == "integer":
        return int
    if t == "number":
        return float
    if t == "boolean":
        return bool
    if t == "array":
        return list[_type_of(node.get("items", {}))]  # type: ignore[misc]
    if t == "object" and isinstance(node.get("additionalProperties"), dict):
        return dict[str, _type_of(node["additionalProperties"])]  # type: ignore[misc]
    return dict[str, Any]


@cache
def model(name: str) -> Any:
    """The pydantic model (or type) of one vendored definition, by its full name."""
    if name in (QUANTITY, INT_OR_STRING):
        return IntOrString
    if name == OBJECT_META:
        return EmbeddedObjectMeta
    node = definitions()[name]
    required = set(node.get("required", []))
    fields: dict[str, Any] = {}
    for prop, spec in node.get("properties", {}).items():
        typ = _type_of(spec)
        desc = spec.get("description") or None
        if prop in required:
            fields[prop] = (typ, Field(description=desc))
        else:
            fields[prop] = (typ | None, Field(default=None, description=desc))
    doc = (node.get("description", "") + " " + KUBE_TYPE.format(_short(name))).strip()
    return create_model(_short(name), __base__=KubeModel, __doc__=doc, **fields)


def dump(obj: KubeModel) -> dict[str, Any]:
    """The object as a Pod spec takes it (unset fields left out)."""
    return obj.model_dump(exclude_none=True, by_alias=True)


Toleration = model(_CORE + "Toleration")
Affinity = model(_CORE + "Affinity")
TopologySpreadConstraint = model(_CORE + "TopologySpreadConstraint")
Volume = model(_CORE + "Volume")
VolumeMount = model(_CORE + "VolumeMount")
EnvVar = model(_CORE + "EnvVar")
LocalObjectReference = model(_CORE + "LocalObjectReference")
