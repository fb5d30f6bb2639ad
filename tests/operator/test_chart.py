"""The Helm chart: CRDs equal to the generated ones, renders with a real helm, applies with
server-side dry-run to the test cluster, alert rules pass promtool, the dashboard reads
only metrics the operator exports, and the operator runs on exactly the RBAC it grants."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from asyncgrpo import wire
from tests.operator.conftest import operator_settings
from tests.operator.helpers import (
    component,
    kubelet,
    make_run,
    reconcile_errors,
    s3_secret,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "asyncgrpo"
BIN = wire.user_cache_dir() / "bin"
HELM = BIN / "helm"
KUBECTL = BIN / "kubectl" if (BIN / "kubectl").exists() else Path(shutil.which("kubectl") or "")

needs_helm = pytest.mark.skipif(not HELM.exists(), reason="run hack/get-helm.sh for helm")


def helm_template(*sets: str, namespace: str = "asyncgrpo-system",
                  set_json: tuple[str, ...] = ()) -> list[dict]:
    args = [str(HELM), "template", "asyncgrpo", str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    for s in set_json:
        args += ["--set-json", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "asyncgrpo.dev_asyncgrporuns.yaml").read_text() == \
        (REPO / "crds" / "asyncgrpo.dev_asyncgrporuns.yaml").read_text()


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    r = subprocess.run([promtool, "check", "rules", str(CHART / "files" / "alerts.yaml")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_and_rules_read_only_exported_metrics():
    """Every name a panel or rule reads is exported by the operator, the trainer, the gateway
    or vLLM (whose names the next test checks against the installed vLLM's source)."""
    from asyncgrpo.controller.metrics import OperatorMetrics
    from asyncgrpo.controller.progress import METRICS
    from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics
    from asyncgrpo.testing import prometheus

    # the test environment has every extra: a missing trainer is an error here, not a reason
    # to check fewer names
    from asyncgrpo.trainer.metrics import METRICS as TRAINER
    from asyncgrpo.trainer.metrics import PREFIX

    names = {m.name for r in (OperatorMetrics().registry, GatewayMetrics().registry)
             for m in r.collect()}
    names |= {PREFIX + n.removesuffix("_total") for n in TRAINER}
    names |= prometheus.VLLM_METRICS
    exported = names | {f"{n}_{s}" for n in names for s in ("total", "bucket", "sum", "count")} \
        | set(METRICS)
    checks = prometheus.panel_queries() + prometheus.rule_queries()
    used = {m for c in checks for m in prometheus.metrics_of(c.expr)}
    rules = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    used |= {m for g in rules["groups"] for r in g["rules"]
             for m in prometheus.metrics_of(r["expr"])}
    assert used and used <= exported, used - exported
    titles = " ".join(c.source.lower() for c in checks)
    for topic in ("throughput", "compression", "sandboxes", "policy lag", "reward",
                  "kv-cache", "prefix-cache", "lease wait", "execs/s", "errors",
                  "waiting for rollouts"):
        assert topic in titles, topic


def test_vllm_metric_names_are_vllms_own():
    """The vLLM names the dashboard and rules read are in the installed vLLM's source (skipped,
    visibly, where the vLLM CPU venv is not set up)."""
    from asyncgrpo.local.vllm import vllm_venv
    from asyncgrpo.testing import prometheus

    loggers = sorted(vllm_venv().glob("lib/python*/site-packages/vllm/v1/metrics/loggers.py"))
    if not loggers:
        pytest.skip(f"no vLLM under {vllm_venv()} (hack/setup-vllm-venv.sh)")
    source = loggers[0].read_text()
    missing = [n for n in sorted(prometheus.VLLM_METRICS) if f'"{n}"' not in source]
    assert not missing, missing


@needs_helm
def test_helm_lint_and_render():
    r = subprocess.run([str(HELM), "lint", str(CHART)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    docs = helm_template("metrics.serviceMonitor.enabled=true",
                         "metrics.prometheusRule.enabled=true", "metrics.dashboard.enabled=true")
    by_kind = {d["kind"]: d for d in docs}
    dep = by_kind["Deployment"]["spec"]["template"]["spec"]
    assert dep["securityContext"]["runAsNonRoot"] is True
    c = dep["containers"][0]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"]}}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ASYNCGRPO_OPERATOR_LEADER_ELECTION"] == "asyncgrpo-operator"
    assert (env["ASYNCGRPO_OPERATOR_LEASE_DURATION"], env["ASYNCGRPO_OPERATOR_RENEW_DEADLINE"],
            env["ASYNCGRPO_OPERATOR_RETRY_PERIOD"]) == ("15", "10", "2")
    assert "POD_NAMESPACE" in env   # the Lease's namespace, from the downward API
    # leader election: get/create/update on leases in the release namespace, nothing more
    lease_role = by_kind["Role"]
    assert lease_role["metadata"]["namespace"] == "asyncgrpo-system"
    assert lease_role["rules"] == [{"apiGroups": ["coordination.k8s.io"],
                                    "resources": ["leases"],
                                    "verbs": ["get", "create", "update"]}]
    assert by_kind["RoleBinding"]["roleRef"]["name"] == lease_role["metadata"]["name"]
    assert not any(d["kind"] == "Role" for d in helm_template("leaderElection.enabled=false"))
    assert env["ASYNCGRPO_OPERATOR_ALL_NAMESPACES"] == "true"
    rule = by_kind["PrometheusRule"]["spec"]
    assert rule == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    json.loads(by_kind["ConfigMap"]["data"]["asyncgrpo.json"])
    # the webhook: Service, cert-manager Certificate, env pointing at the Service, TLS mount
    docs = helm_template("webhook.enabled=true")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Service", "asyncgrpo-operator-webhook") in kinds
    assert ("Certificate", "asyncgrpo-operator-webhook") in kinds
    dep = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in dep["containers"][0]["env"]}
    assert env["ASYNCGRPO_OPERATOR_WEBHOOK_SERVICE"] == "asyncgrpo-system/asyncgrpo-operator-webhook"
    assert {"name": "webhook-tls", "secret": {"secretName": "asyncgrpo-webhook-tls"}} in dep["volumes"]
    # namespaced mode: Roles in the watched namespaces, nothing cluster-wide that writes
    docs = helm_template("watchNamespaces={team-a,team-b}")
    roles = [d for d in docs if d["kind"] == "Role"
             and not d["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert all(set(r["verbs"]) <= {"get", "list", "watch", "patch"} for r in cluster_rules)
    assert all("patch" not in r["verbs"] for r in cluster_rules)


def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(KUBECTL), *args], input=stdin, check=False, capture_output=True, text=True)


@needs_helm
@pytest.mark.cluster
def test_rendered_chart_applies_with_server_side_dry_run(kube_cluster, api, crd_installed):
    from kubernetes.client.exceptions import ApiException
    try:
        api.call("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": "asyncgrpo-system"}})
    except ApiException as e:
        assert e.status == 409
    out = yaml.safe_dump_all(helm_template())
    r = kubectl("apply", "--dry-run=server", "--server-side", "-f", "-", stdin=out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deployment.apps/asyncgrpo-operator serverside-applied (server dry run)" in r.stdout


@needs_helm
@pytest.mark.cluster
@pytest.mark.slow
def test_operator_runs_on_the_charts_rbac_alone(kube_cluster, api, crd_installed, peers,
                                               s3_server, tmp_path):
    """Install the chart's ServiceAccount and RBAC for real, then run the operator with that
    account's token: any permission the chart forgot fails this test."""
    from kubernetes.client.exceptions import ApiException

    from asyncgrpo.controller.embedded import EmbeddedOperator

    try:  # the release namespace (another test may have made it already)
        api.call("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": "asyncgrpo-system"}})
    except ApiException as e:
        assert e.status == 409
    rbac = [d for d in helm_template() if d["kind"] in (
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    r = kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(rbac))
    assert r.returncode == 0, r.stdout + r.stderr

    def token():
        sa = api.get("ServiceAccount", "asyncgrpo-system", "asyncgrpo-operator")
        names = [s["name"] for s in sa.get("secrets") or []]
        return names and api.get("Secret", "asyncgrpo-system", names[0])["data"].get("token")
    import base64
    tok = base64.b64decode(wait_for(token, what="service account token")).decode()
    cfg = yaml.safe_load(kube_cluster.kubeconfig.read_text())
    cfg["users"][0]["user"] = {"token": tok}
    path = tmp_path / "operator-kubeconfig"
    path.write_text(yaml.safe_dump(cfg))

    # leader election on the chart's Lease RBAC: acquire, renew, release in its namespace
    from kubernetes import config

    from asyncgrpo.controller.leader import ElectionConfig, LeaseElector
    elector = LeaseElector(config.new_client_from_config(config_file=str(path)),
                           ElectionConfig(namespace="asyncgrpo-system", lease_duration=3,
                                          renew_deadline=2, retry_period=0.5))
    wait_for(elector.try_acquire_or_renew, timeout=10, what="the Lease, as the chart's account")
    assert elector.try_acquire_or_renew()   # renewing
    elector.fence.close()
    elector.release()
    lease = api.call("GET", "/apis/coordination.k8s.io/v1/namespaces/asyncgrpo-system/"
                     "leases/asyncgrpo-operator")
    assert lease["spec"]["holderIdentity"] == ""

    ns = api.namespace("own")
    api.create(s3_secret(s3_server, ns))
    settings = operator_settings(peers)
    settings.kubeconfig = str(path)
    settings.preflight = True   # as the chart's default: its account creates the Job too
    op = EmbeddedOperator([ns], settings).start()
    try:
        run = make_run(s3_server, ns, "rbac", "multi-turn-sandboxes.yaml")
        run["spec"]["sandboxes"].pop("runtimeClassName")
        run["spec"]["sandboxes"]["network"].pop("allowedEgressHosts")
        run["spec"]["sandboxes"]["minWarm"] = 2
        run["spec"]["adapterStore"]["deletionPolicy"] = "Delete"
        api.create(run)
        wait_for(lambda: len(api.list("Pod", ns, component("rbac", "sandbox"))) == 2,
                 what="sandboxes created by the chart's account")
        wait_for(lambda: api.get("RoleBinding", ns, "rbac-gateway"), what="gateway RBAC")
        wait_for(lambda: kubelet(api, ns, component("rbac", "vllm")), what="vllm pods")
        wait_for(lambda: kubelet(api, ns, component("rbac", "gateway")), what="gateway pod")
        wait_for(lambda: api.get("StatefulSet", ns, "rbac-trainer")["spec"]["replicas"] == 1,
                 what="trainer")
        wait_for(lambda: kubelet(api, ns, component("rbac", "trainer")), what="trainer pod")
        wait_for(lambda: api.run(ns, "rbac")["status"]["phase"] == "Running", what="Running")
        assert any(e["reason"] == "Running" for e in api.events(ns, "rbac"))
        api.delete("AsyncGRPORun", ns, "rbac")
        wait_for(lambda: api.get("AsyncGRPORun", ns, "rbac") is None, what="finalized")
        assert reconcile_errors(op.runtime.metrics) == {}
    finally:
        op.stop()


@needs_helm
def test_chart_makes_runs_scrapable_both_ways():
    """A PodMonitor for Prometheus Operator users (off by default), scrape annotations on
    the operator's pods for a plain Prometheus, and the scrapers the runs' NetworkPolicies
    admit passed to the operator."""
    assert not any(d["kind"] == "PodMonitor" for d in helm_template())
    peers = '{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}'
    docs = helm_template("metrics.podMonitor.enabled=true", "metrics.serviceMonitor.enabled=true",
                         set_json=(f"metrics.scrapers=[{peers}]",))
    by_kind = {d["kind"]: d for d in docs}
    pm = by_kind["PodMonitor"]["spec"]
    assert pm["selector"]["matchExpressions"][0]["values"] == ["trainer", "vllm", "gateway"]
    assert [e["port"] for e in pm["podMetricsEndpoints"]] == ["metrics", "http"]
    assert {r["targetLabel"] for r in pm["podMetricsEndpoints"][0]["relabelings"]} == \
        {"run", "component"}
    assert by_kind["ServiceMonitor"]["spec"]["endpoints"][0]["honorLabels"] is True
    pod = by_kind["Deployment"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    default = next(d for d in helm_template() if d["kind"] == "Deployment")
    assert "ASYNCGRPO_OPERATOR_SCRAPERS" not in {
        e["name"] for e in default["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["ASYNCGRPO_OPERATOR_SCRAPERS"]) == [json.loads(peers)]
    job = yaml.safe_load((CHART / "files" / "prometheus-scrape.yaml").read_text())
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}] and job["honor_labels"] is True


# ---------------------------------------------------------------- wrong values (issue 24)

#: (--set or --set-json value, what the error must say): each names the value.
WRONG_VALUES = [
    ("replicaCount=two", "/replicaCount"),
    ("replicaCount=0", "/replicaCount"),
    ("metrics.port=abc", "/metrics/port"),
    ("metrics.port=70000", "/metrics/port"),
    ("healthPort=-1", "/healthPort"),
    ("watchNamespaces=team-a", "/watchNamespaces"),
    ("watchNamespace=team-a", "'watchNamespace' not allowed"),
    ("metrics.servicemonitor.enabled=true", "'servicemonitor' not allowed"),
    ("leaderElection.enabled=yes", "/leaderElection/enabled"),
    ("leaderElection.renewDeadlineSeconds=30", "renewDeadlineSeconds (30)"),
    ("leaderElection.retryPeriodSeconds=10", "retryPeriodSeconds (10)"),
    ("leaderElection.leaseDurationSeconds=10", "leaseDurationSeconds (10)"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("operator.resyncSeconds=0", "/operator/resyncSeconds"),
    ("caps.vllmReplicas=many", "/caps/vllmReplicas"),
    ("operator.tenantIO.endpointDeadlineSeconds=0", "/operator/tenantIO/endpointDeadlineSeconds"),
    ("operator.tenantIO.readsPerNamespace=0", "/operator/tenantIO/readsPerNamespace"),
    ("operator.tenantIO.dnsNameservers[0]=not a server", "/operator/tenantIO/dnsNameservers/0"),
    ("operator.tenantIO.deadline=3", "'deadline' not allowed"),
    ("gpuResourceName=nvidia gpu", "/gpuResourceName"),
    ("tolerations[0].efect=NoSchedule", "'efect' not allowed"),
    ("webhook.certManager=true", "/webhook/certManager"),
    ("metrics.podMonitor.interval=soon", "/metrics/podMonitor/interval"),
    ("resources.limits.memory=lots", "/resources/limits/memory"),
    ("preflight.enabled=yes", "/preflight/enabled"),
    ("preflight.enable=false", "'enable' not allowed"),
]


@needs_helm
@pytest.mark.parametrize("value,message", WRONG_VALUES, ids=[v for v, _ in WRONG_VALUES])
@pytest.mark.parametrize("command", ["template", "lint"])
def test_chart_refuses_a_wrong_value_naming_it(command, value, message):
    args = [str(HELM), command, *(["asyncgrpo"] if command == "template" else []),
            str(CHART), "--set", value]
    r = subprocess.run(args, check=False, capture_output=True, text=True)
    assert message in r.stdout + r.stderr, r.stdout + r.stderr
    if command == "lint" and value.startswith("leaderElection.") and "Seconds" in value:
        # helm lint turns a template's `fail` into a log line by design (it renders with
        # stand-in values); install, upgrade and template fail on it
        return
    assert r.returncode != 0, f"{value} rendered:\n{r.stdout[:500]}"


#: The overrides docs/operator.md documents; each renders and carries what it says.
DOCUMENTED = ("gpuResourceName=amd.com/gpu", "watchNamespaces={team-a,team-b}",
              "leaderElection.leaseDurationSeconds=30", "leaderElection.renewDeadlineSeconds=20",
              "leaderElection.retryPeriodSeconds=4", "imagePullSecrets[0].name=registry",
              "tolerations[0].key=dedicated", "tolerations[0].operator=Exists",
              "nodeSelector.pool=system", "replicaCount=2",
              "operator.tenantIO.endpointDeadlineSeconds=5",
              "operator.tenantIO.readsPerNamespace=2",
              "operator.tenantIO.dnsNameservers={10.0.0.10:5353,fd00::53}")


@needs_helm
def test_chart_default_and_documented_overrides_render():
    assert helm_template()
    docs = helm_template(*DOCUMENTED)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0][
        "env"]}
    assert env["ASYNCGRPO_OPERATOR_GPU_RESOURCE_NAME"] == "amd.com/gpu"
    assert env["ASYNCGRPO_OPERATOR_LEASE_DURATION"] == "30"
    assert dep["spec"]["replicas"] == 2
    assert (env["ASYNCGRPO_OPERATOR_ENDPOINT_DEADLINE_SECONDS"],
            env["ASYNCGRPO_OPERATOR_ENDPOINT_READS_PER_NAMESPACE"],
            env["ASYNCGRPO_OPERATOR_DNS_NAMESERVERS"]) == ("5", "2", "10.0.0.10:5353,fd00::53")
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert dep["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "dedicated", "operator": "Exists"}]


def test_every_default_value_is_in_the_schema_and_every_object_is_closed():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node, value, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for key, sub in (value or {}).items():
                assert key in node["properties"], f"{path}.{key} is not in the schema"
                walk(node["properties"][key], sub, f"{path}.{key}")
        else:
            assert "type" in node or "enum" in node or "anyOf" in node, path

    walk(schema, values, "values")


@needs_helm
@pytest.mark.cluster
def test_documented_overrides_apply_with_server_side_dry_run(kube_cluster, api, crd_installed):
    from kubernetes.client.exceptions import ApiException
    for ns in ("asyncgrpo-system", "team-a", "team-b"):
        try:
            api.call("POST", "/api/v1/namespaces", body={
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        except ApiException as e:
            assert e.status == 409
    out = yaml.safe_dump_all(helm_template(*DOCUMENTED))
    r = kubectl("apply", "--dry-run=server", "--server-side", "-f", "-", stdin=out)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
def test_the_preflight_is_on_by_default_and_a_value_turns_it_off():
    """The chart runs the cluster preflight unless preflight.enabled is false; the operator
    reads the same env (its default is on too, --no-preflight turns it off)."""
    from asyncgrpo.controller.commands import register

    def env_of(*sets):
        dep = next(d for d in helm_template(*sets) if d["kind"] == "Deployment")
        return {e["name"]: e.get("value")
                for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert env_of()["ASYNCGRPO_OPERATOR_PREFLIGHT"] == "true"
    assert env_of("preflight.enabled=false")["ASYNCGRPO_OPERATOR_PREFLIGHT"] == "false"

    import argparse
    import os
    from unittest import mock

    def parsed(argv, env):
        with mock.patch.dict(os.environ, env):   # the defaults are read from the env
            parser = argparse.ArgumentParser()
            register(parser.add_subparsers())
            return parser.parse_args(["operator", *argv]).preflight

    off = {"ASYNCGRPO_OPERATOR_PREFLIGHT": "false"}
    assert parsed([], {}) is True and parsed(["--no-preflight"], {}) is False
    assert parsed([], off) is False and parsed(["--preflight"], off) is True
