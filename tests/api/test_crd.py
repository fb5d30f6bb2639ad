"""The CRD: generated from the model, checked in, structural."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from asyncgrpo.api.crd import crd, crd_yaml
from asyncgrpo.rewards import BUILTINS, arg_names

from .invalid_specs import REPO

CHECKED_IN = REPO / "crds" / "asyncgrpo.dev_asyncgrporuns.yaml"


def test_checked_in_crd_equals_generated():
    assert CHECKED_IN.read_text() == crd_yaml(), (
        "crds/ is stale: run `asyncgrpo crd > crds/asyncgrpo.dev_asyncgrporuns.yaml`")


def test_crd_command_prints_the_same():
    out = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "crd"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out == crd_yaml()


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.get("properties", {}).items():
            yield from _walk(v, f"{path}.{k}")
        if "items" in node:
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "const"):
            assert banned not in node, f"{path} has {banned}"
        # Kubernetes' two exceptions to "every node has a type"
        assert "type" in node or node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, False), bool), f"{path}.{bound} must be boolean"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert "properties" not in node, path


def test_free_form_only_where_the_model_is_free_form():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    free = sorted(p for p, n in _walk(schema) if n.get("x-kubernetes-preserve-unknown-fields"))
    # env's valueFrom is Kubernetes' EnvVarSource now (asyncgrpo.api.k8s), not free-form
    assert free == [
        "$.spec.harness.environment.args",
        "$.spec.reward.functions[].args{}",  # a map: the CRD's rule checks a built-in's names
        "$.spec.trainer.trlArgs",  # checked by validation against AsyncGRPOConfig's table
    ]


def test_descriptions_reach_kubectl_explain():
    """Each field's description in the model is the one `kubectl explain` shows."""
    from asyncgrpo.api.v1alpha1 import AsyncGRPORunSpec, TrainerSpec

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for model, schema, where in ((AsyncGRPORunSpec, spec, "spec"),
                                 (TrainerSpec, spec["properties"]["trainer"], "spec.trainer")):
        for field in model.model_fields.values():
            prop = schema["properties"][field.alias]
            assert field.description, f"{where}.{field.alias} lacks a description in the model"
            assert prop.get("description") == field.description, f"{where}.{field.alias}"


def test_printer_columns_and_status_subresource():
    version = yaml.safe_load(CHECKED_IN.read_text())["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Phase", "Step", "Policy", "Reward", "Tokens/s", "Sandboxes", "Age"]


def test_field_reference_doc_is_generated_from_the_model():
    from asyncgrpo.api.reference import reference_markdown

    doc = REPO / "docs" / "api-reference.md"
    assert doc.read_text() == reference_markdown(), (
        "docs/api-reference.md is stale: run "
        "`python -m asyncgrpo.api.reference > docs/api-reference.md`")


def _reward_rules() -> list[dict]:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fn = schema["properties"]["spec"]["properties"]["reward"]["properties"]["functions"]["items"]
    return fn["x-kubernetes-validations"]


@pytest.mark.parametrize("name", [*BUILTINS, "python"])
def test_the_crds_rule_refuses_an_unknown_built_in_arg(name):
    """The CEL rules as an API server >= 1.25 runs them (cel-python; the test API server is
    1.20, which ignores them): a built-in takes its own args only, a user function any."""
    import celpy

    env = celpy.Environment()
    rules = [env.program(env.compile(r["rule"])) for r in _reward_rules()]

    def admitted(fn: dict) -> bool:
        return all(bool(p.evaluate({"self": celpy.json_to_cel(fn)})) for p in rules)

    own = {a: "x" for a in (arg_names(name) or ("anything",))}
    assert admitted({"name": name, "args": own})
    assert admitted({"name": name})
    assert admitted({"name": name, "args": {**own, "bogus": 1}}) is (name == "python")
