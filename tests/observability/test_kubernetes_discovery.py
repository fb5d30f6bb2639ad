"""The chart's plain-Prometheus job (files/prometheus-scrape.yaml, as shipped) discovers the
pods the operator builds through the real test API server: a real Prometheus lists pods with
`kubernetes_sd_configs`, keeps those with the operator's scrape annotations, relabels them
to namespace/pod/run/component and scrapes the annotated port. There is no node here, so the
test plays the kubelet: it gives the trainer pod the address of a real trainer metrics
endpoint on loopback. The node e2e proves the same with pods that really run.

Debian's Prometheus has no `kubernetes_sd_configs`; there the same job runs with its
discovery served over HTTP SD by `asyncgrpo.testing.pod_discovery` (the pod role's targets and
labels, from the same API server), and the chart's relabel rules unchanged."""

from __future__ import annotations

import contextlib

import pytest

from asyncgrpo.api.validation import validate_run
from asyncgrpo.controller import rbac, sandboxes, trainer
from asyncgrpo.testing import prometheus as p
from asyncgrpo.testing.cluster import ADMIN_TOKEN
from asyncgrpo.testing.pod_discovery import PodDiscovery
from asyncgrpo.trainer.metrics import TrainerMetrics
from tests.observability.conftest import needs_prometheus
from tests.operator.helpers import Api, example, pod_status

pytestmark = [needs_prometheus, pytest.mark.cluster]


def as_pod(template: dict, name: str, ns: str) -> dict:
    """The pod a StatefulSet or the pool would create from `template`."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": name, "namespace": ns},
            "spec": template["spec"]}


def test_the_charts_scrape_job_discovers_and_relabels_the_operators_pods(kube_cluster,
                                                                        kube_client, tmp_path):
    api = Api(kube_client)
    ns = api.namespace("obs")
    metrics = TrainerMetrics()
    port = metrics.serve(0, host="127.0.0.1")
    try:
        metrics.set("step", 7)
        doc = example("multi-turn-sandboxes.yaml")
        doc["metadata"] = {"name": "math", "namespace": ns}
        doc["spec"]["trainer"]["metricsPort"] = port
        doc["spec"]["sandboxes"].pop("runtimeClassName")   # no RuntimeClass on this cluster
        run, errors = validate_run(doc)
        assert not errors, errors
        for account in (o for o in rbac.build_rbac(run) if o["kind"] == "ServiceAccount"):
            api.create(account)  # as the operator does first: pods need their accounts
        sts = trainer.build_statefulset(run)
        api.create(as_pod(sts["spec"]["template"], "math-trainer-0", ns))
        sandbox = sandboxes.build_pod(run, "a1")
        api.create(sandbox)
        for pod in ("math-trainer-0", sandbox["metadata"]["name"]):
            status = pod_status()
            status["status"]["podIP"] = "127.0.0.1"
            api.merge_patch("Pod", ns, pod, status, "/status")

        token = tmp_path / "token"
        token.write_text(ADMIN_TOKEN)
        with contextlib.ExitStack() as stack:
            if p.supports_kubernetes_sd():
                job = p.kubernetes_job(kube_cluster.server, token, namespaces=[ns])
            else:
                sd = stack.enter_context(PodDiscovery(kube_cluster.server, ADMIN_TOKEN, [ns]))
                job = p.http_sd_job(sd.url)
            prom = stack.enter_context(p.PrometheusServer(tmp_path / "prom", [job]))
            targets = prom.wait_for_targets_up(1)
            # one target: the trainer pod (its two ports collapse into the annotated one);
            # the sandbox pod has no scrape annotation and is dropped
            assert len(targets) == 1, targets
            t = targets[0]
            assert t["scrapeUrl"] == f"http://127.0.0.1:{port}/metrics"
            assert {k: t["labels"][k] for k in ("namespace", "pod", "run", "component")} == \
                {"namespace": ns, "pod": "math-trainer-0", "run": "math", "component": "trainer"}
            sample = prom.wait(lambda: prom.query(f'asyncgrpo_trainer_step{{run="math", '
                                                  f'namespace="{ns}"}}'), what="the step")
            assert sample[0]["value"][1] == "7"
    finally:
        metrics.close()
        api.call("DELETE", f"/api/v1/namespaces/{ns}")
