"""Discovery on the pods the operator builds: scrape annotations on every pod that serves
metrics, the scrapers the NetworkPolicies admit, and the loggers' Secret and folders on the
trainer."""

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


def test_the_offline_loggers_write_to_the_work_volume_under_the_runs_name(tmp_path):
    """TRL gets report_to, the run's name and a trackio project; the pod tells trackio and
    tensorboard where to write (a folder each under wire.LOGGER_DIR, on the work emptyDir),
    only for the loggers named, and a user's spec.trainer.env wins."""
    from asyncgrpo.trainer.main import trl_config
    from asyncgrpo.trainer.runtime_env import RuntimeEnv
    from asyncgrpo.wire import LOGGER_DIR, TRAINER_WORK_DIR

    def env_of(r):
        c = trainer.build_statefulset(r)["spec"]["template"]["spec"]["containers"][0]
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        return {e["name"]: e.get("value") for e in c["env"]}, mounts

    r = run(reportTo=["trackio", "tensorboard"])
    cfg = trl_config(r, RuntimeEnv.from_env({"ASYNCGRPO_VLLM_URL": "http://v:8000",
                                             "ASYNCGRPO_WORK_DIR": str(tmp_path)}), use_cpu=True)
    assert cfg.report_to == ["trackio", "tensorboard"]
    assert cfg.run_name == r.metadata.name
    assert cfg.project == f"asyncgrpo-{r.metadata.namespace or 'default'}"
    env, mounts = env_of(r)
    assert env["TRACKIO_DIR"] == f"{LOGGER_DIR}/trackio"
    assert env["TENSORBOARD_LOGGING_DIR"] == f"{LOGGER_DIR}/tensorboard"
    assert LOGGER_DIR.startswith(TRAINER_WORK_DIR + "/") and TRAINER_WORK_DIR in mounts
    env, _ = env_of(run(reportTo=["tensorboard"]))
    assert "TRACKIO_DIR" not in env and "TENSORBOARD_LOGGING_DIR" in env
    env, _ = env_of(run(reportTo=["wandb"]))
    assert not {"TRACKIO_DIR", "TENSORBOARD_LOGGING_DIR"} & set(env)
    env, _ = env_of(run(reportTo=["trackio"], env=[{"name": "TRACKIO_DIR", "value": "/data/t"}]))
    assert env["TRACKIO_DIR"] == "/data/t"


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
