"""Kubernetes' own pod-spec types in the run model (issue 24): vendored from Kubernetes'
OpenAPI document, strict pydantic models, and the same schema in the CRD."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from pydantic import ValidationError

from asyncgrpo.api import k8s
from asyncgrpo.api.crd import openapi_schema
from asyncgrpo.api.k8s_vendor import ROOTS, _refs


def _vendored() -> dict:
    return json.loads(resources.files("asyncgrpo.api").joinpath("k8s_openapi.json").read_text())


def test_vendored_fragment_is_closed_and_holds_the_roots():
    defs = _vendored()["definitions"]
    assert set(ROOTS) <= set(defs)
    for name, node in defs.items():
        assert _refs(node) <= set(defs), name


def test_models_take_what_a_pod_spec_takes():
    t = k8s.Toleration.model_validate({"key": "nvidia.com/gpu", "operator": "Exists",
                                       "effect": "NoSchedule"})
    assert k8s.dump(t) == {"key": "nvidia.com/gpu", "operator": "Exists",
                           "effect": "NoSchedule"}
    v = k8s.Volume.model_validate({"name": "c", "ephemeral": {"volumeClaimTemplate": {
        "metadata": {"labels": {"a": "b"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {
            "storage": "1Gi"}}}}}})
    assert k8s.dump(v)["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"] == {
        "requests": {"storage": "1Gi"}}
    e = k8s.EnvVar.model_validate({"name": "POD", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}})
    assert k8s.dump(e)["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("model,doc,where", [
    (k8s.Toleration, {"kee": "a"}, "kee"),
    (k8s.Toleration, {"tolerationSeconds": "60"}, "tolerationSeconds"),
    (k8s.Volume, {"persistentVolumeClaim": {"claimName": "c"}}, "name"),
    (k8s.Volume, {"name": "v", "emptyDir": {"medium": 3}}, "emptyDir.medium"),
    (k8s.VolumeMount, {"name": "v"}, "mountPath"),
    (k8s.Affinity, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpresions": []}]}}},
     ("nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0"
      ".matchExpresions")),
    (k8s.TopologySpreadConstraint, {"topologyKey": "z", "whenUnsatisfiable": "DoNotSchedule"},
     "maxSkew"),
])
def test_models_refuse_typos_wrong_types_and_missing_fields(model, doc, where):
    with pytest.raises(ValidationError) as info:
        model.model_validate(doc)
    assert where in {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}


def test_fields_agree_with_the_kubernetes_python_client():
    """An independent reading of the same API: every field we vendored exists in the
    `kubernetes` client's model of that type (which may be newer and hold more)."""
    client = pytest.importorskip("kubernetes.client")
    for name, node in _vendored()["definitions"].items():
        if not name.startswith("io.k8s.api.core.v1."):
            continue
        cls = getattr(client, "V1" + name.rsplit(".", 1)[-1], None)
        if cls is None:
            continue
        assert set(node.get("properties", {})) <= set(cls.attribute_map.values()), name


def test_crd_carries_the_kubernetes_schemas():
    pod = openapi_schema()["properties"]["spec"]["properties"]["pod"]["properties"]
    toleration = pod["tolerations"]["items"]
    assert set(toleration["properties"]) == {"key", "operator", "value", "effect",
                                             "tolerationSeconds"}
    assert toleration["properties"]["tolerationSeconds"]["type"] == "integer"
    volume = pod["volumes"]["items"]
    assert volume["required"] == ["name"]
    assert {"persistentVolumeClaim", "nfs", "csi", "ephemeral", "configMap", "secret"} <= set(
        volume["properties"])
    assert volume["properties"]["emptyDir"]["properties"]["sizeLimit"][
        "x-kubernetes-int-or-string"] is True
    assert "nodeAffinity" in pod["affinity"]["properties"]
    assert pod["topologySpreadConstraints"]["items"]["required"] == ["maxSkew", "topologyKey",
                                                                     "whenUnsatisfiable"]
    # every component has the same shape
    spec = openapi_schema()["properties"]["spec"]["properties"]
    for section, field in (("trainer", "pod"), ("rollout", "pod"), ("sandboxes", "pod"),
                           ("sandboxes", "gatewayPod"), ("adapterStore", "bucketJobPod")):
        assert spec[section]["properties"][field]["properties"].keys() == pod.keys()
