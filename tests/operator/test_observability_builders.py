"""Discovery on the pods the operator builds: scrape annotations on every pod that serves
metrics, the scrapers the NetworkPolicies admit, and the loggers' Secret on the trainer."""

from __future__ import annotations

import pytest

from asyncgrpo.api.validation import validate_run
from asyncgrpo.controller import children, gateway, network, trainer, vllm
from asyncgrpo.controller.commands import scraper_peers
from asyncgrpo.wire import GATEWAY_PORT, VLLM_PORT
from tests.operator.helpers import example


def run(source: str = "multi-turn-sandboxes.yaml", **trainer_fields):
    doc = example(source)
    doc["spec"]["trainer"].update(trainer_fields)
    parsed, errors = validate_run(doc)
    assert not errors, errors
    return parsed


def annotations(obj):
    return obj["spec"]["template"]["metadata"].get("annotations", {})


def test_every_pod_that_serves_metrics_is_annotated_for_scraping():
    r = run(metricsPort=9500)
    assert annotations(trainer.build_statefulset(r))["prometheus.io/port"] == "9500"
    assert annotations(vllm.build_deployment(r))["prometheus.io/port"] == str(VLLM_PORT)
    assert annotations(gateway.build_deployment(r))["prometheus.io/port"] == str(GATEWAY_PORT)
    for obj in (trainer.build_statefulset(r), vllm.build_deployment(r),
                gateway.build_deployment(r)):
        a = annotations(obj)
        assert (a["prometheus.io/scrape"], a["prometheus.io/path"]) == ("true", "/metrics")
        # the plain job keeps only asyncgrpo's pods; the PodMonitor selects on these labels
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "asyncgrpo"
        assert labels["app.kubernetes.io/managed-by"] == "asyncgrpo-operator"


def test_scrapers_reach_only_the_metrics_ports_and_the_operator_is_always_one():
    r = run()
    prom = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    peers = scraper_peers('[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name"'
                          ': "monitoring"}}, "podSelector": {"matchLabels": '
                          '{"app.kubernetes.io/name": "prometheus"}}}]')
    assert peers == [*prom, network.OPERATOR_SCRAPER]
    assert scraper_peers("") is None
    with pytest.raises(SystemExit):
        scraper_peers('{"podSelector": {}}')
    policies = {p["metadata"]["name"]: p for p in children.build_children(r, scrapers=peers)
                if p["kind"] == "NetworkPolicy"}
    port_of = {"trainer": r.spec.trainer.metrics_port, "vllm": VLLM_PORT, "gateway": GATEWAY_PORT}
    for component, port in port_of.items():
        rules = policies[f"{r.metadata.name}-{component}"]["spec"]["ingress"]
        scrape = [rule for rule in rules if rule["from"] == peers]
        assert scrape == [{"from": peers, "ports": [{"protocol": "TCP", "port": port}]}]
    # sandboxes stay closed to scrapers
    sandbox = policies[f"{r.metadata.name}-sandbox"]["spec"]["ingress"]
    assert all(rule["from"] != peers for rule in sandbox)


def test_report_to_reaches_trl_and_its_secret_reaches_only_the_trainer_env():
    from asyncgrpo.trainer.main import report_to

    r = run(reportTo=["trackio", "tensorboard"], reportToSecret="loggers")
    assert report_to(r) == ["trackio", "tensorboard"]
    assert report_to(run(reportTo=["none"])) == [] and report_to(run()) == []
    c = trainer.build_statefulset(r)["spec"]["template"]["spec"]["containers"][0]
    assert c["envFrom"] == [{"secretRef": {"name": "loggers"}}]
    assert "envFrom" not in trainer.build_statefulset(run())["spec"]["template"]["spec"][
        "containers"][0]


@pytest.mark.parametrize("fields, path", [
    ({"reportTo": ["none", "wandb"]}, "spec.trainer.reportTo"),
    ({"reportTo": ["wandb", "wandb"]}, "spec.trainer.reportTo"),
    ({"reportTo": ["comet_ml"]}, "spec.trainer.reportTo"),
    ({"reportToSecret": "Not_A_Name"}, "spec.trainer.reportToSecret"),
])
def test_report_to_refuses_what_trl_would_not_take(fields, path):
    doc = example("lora-math.yaml")
    doc["spec"]["trainer"].update(fields)
    _, errors = validate_run(doc)
    assert any(e.path.startswith(path) for e in errors), errors


def test_reconcile_results_are_exported_before_the_first_error():
    """A counter series born with its first increment hides that increment from rate():
    the alert's series exist at 0 from the operator's start."""
    from asyncgrpo.controller.metrics import OperatorMetrics

    m = OperatorMetrics()
    for result in ("ok", "error"):
        assert m.registry.get_sample_value("asyncgrpo_operator_reconciles_total",
                                           {"result": result}) == 0.0
