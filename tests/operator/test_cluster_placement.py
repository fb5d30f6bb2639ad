"""Pod settings on a real API server (issue 24): the builders' pods, with every setting,
are valid Kubernetes objects that the server keeps whole; the CRD, carrying Kubernetes'
schemas, upgrades with server-side apply."""

from __future__ import annotations

import pytest

from asyncgrpo.api.validation import parse_run
from asyncgrpo.controller import rbac

from .test_chart import CHART, KUBECTL, kubectl
from .test_placement import AT, SETTINGS, doc_with, pods

pytestmark = pytest.mark.cluster

WORKLOADS = {"trainer": ("apps/v1", "StatefulSet"), "vllm": ("apps/v1", "Deployment"),
             "gateway": ("apps/v1", "Deployment"), "bucket": ("batch/v1", "Job")}


def _contains(big, small) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _contains(big[k], v)
                                             for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and all(any(_contains(b, s) for b in big) for s in small)
    return big == small


@pytest.mark.parametrize("component", sorted(AT))
def test_every_setting_survives_the_api_server(api, crd_installed, component):
    from kubernetes.client.exceptions import ApiException
    try:   # the Priority admission plugin refuses a pod naming a class that does not exist
        api.call("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body={
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": SETTINGS["priorityClassName"]}, "value": 1000})
    except ApiException as e:
        assert e.status == 409
    ns = api.namespace("place")
    section, field = AT[component]
    doc = doc_with(**{f"{section}__{field}": SETTINGS})
    doc["metadata"]["namespace"] = ns
    run = parse_run(doc)
    for account in rbac.build_rbac(run):
        api.create(account)
    pod = pods(run)[component]
    if component == "sandbox":
        obj = pod
    else:
        version, kind = WORKLOADS[component]
        obj = {"apiVersion": version, "kind": kind,
               "metadata": {"name": f"x-{component}", "namespace": ns},
               "spec": {"selector": {"matchLabels": pod["metadata"]["labels"]},
                        "template": pod} if kind != "Job" else {"template": pod}}
        if kind == "StatefulSet":
            obj["spec"]["serviceName"] = "x"
        if kind == "Job":
            obj["metadata"]["name"] = "x-bucket"
    plural = {"Pod": "pods", "StatefulSet": "statefulsets", "Deployment": "deployments",
              "Job": "jobs"}[obj["kind"]]
    base = "/api/v1" if obj["kind"] == "Pod" else f"/apis/{obj['apiVersion']}"
    created = api.call("POST", f"{base}/namespaces/{ns}/{plural}", body=obj,
                       query=[("dryRun", "All")])
    got = created["spec"] if obj["kind"] == "Pod" else created["spec"]["template"]["spec"]
    want = pod["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                "priorityClassName", "schedulerName", "imagePullSecrets", "volumes"):
        assert _contains(got.get(key), want[key]), (key, got.get(key))
    main = got["containers"][0]
    assert _contains(main["env"], SETTINGS["env"])
    assert _contains(main["volumeMounts"], SETTINGS["volumeMounts"])


def test_crd_upgrades_with_server_side_apply(kube_cluster, crd_installed):
    if not KUBECTL or not KUBECTL.exists():
        pytest.skip("no kubectl")
    r = kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "serverside-applied" in r.stdout
