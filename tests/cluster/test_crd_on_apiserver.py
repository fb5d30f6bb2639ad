"""The CRD on a real kube-apiserver: installs, accepts every example, refuses bad runs (422)
naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes.client.rest import ApiException

from tests.api.invalid_specs import NAME_INVALID, REPO, SCHEMA_INVALID, base_run

pytestmark = pytest.mark.cluster

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _contains(big, small) -> bool:
    """Every value in `small` is in `big` (which may hold more: server-side defaults)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _contains(big[k], v)
                                             for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(big) == len(small) and all(
            _contains(b, s) for b, s in zip(big, small))
    return big == small


def _dry_run_create(dynamic, doc: dict, namespace: str = "default"):
    resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    return resource.create(body=doc, namespace=namespace, query_params=[("dryRun", "All")])


def test_crd_is_established(crd_installed, kube_dynamic):
    crds = kube_dynamic.resources.get(api_version="apiextensions.k8s.io/v1",
                                      kind="CustomResourceDefinition")
    status = crds.get(name="asyncgrporuns.asyncgrpo.dev").status
    assert {(c.type, c.status) for c in status.conditions} >= {("Established", "True"),
                                                                ("NamesAccepted", "True")}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_applies_with_server_side_dry_run(crd_installed, kube_dynamic, path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        created = _dry_run_create(kube_dynamic, doc)
        assert created.metadata.name == doc["metadata"]["name"]
        if doc["kind"] == "AsyncGRPORun":
            # The API server kept every field the user wrote (nothing pruned).
            assert _contains(created.to_dict()["spec"], doc["spec"])


def test_api_server_fills_scalar_defaults(crd_installed, kube_dynamic):
    doc = base_run()
    del doc["spec"]["trainer"]["maxStaleness"]
    created = _dry_run_create(kube_dynamic, doc).to_dict()
    assert created["spec"]["trainer"]["maxStaleness"] == 4
    assert created["spec"]["model"]["attention"] == "auto"


@pytest.mark.parametrize("case", SCHEMA_INVALID + NAME_INVALID, ids=lambda c: c[0])
def test_invalid_run_is_rejected_with_its_field(crd_installed, kube_dynamic, case):
    _, make, field = case
    with pytest.raises(ApiException) as info:
        _dry_run_create(kube_dynamic, make())
    assert info.value.status == 422
    body = yaml.safe_load(info.value.body)
    fields = [c.get("field", "") for c in body["details"]["causes"]]
    # 1.20 names list items without an index (spec.reward.functions.name).
    assert any(f.startswith(field.split("[")[0]) for f in fields), (fields, body["message"])


def test_schema_layer_rejects_at_least_ten_distinct_fields():
    assert len({c[2] for c in SCHEMA_INVALID}) >= 10
