"""One operator, hostile tenants (issue 28), on the real API server: objects a tenant made
under a child's name are never adopted; dripping endpoints and a DNS server that never
answers cost their own run a condition, never another run's status; values a tenant wrote
into the status, the token Secret or an endpoint's answer are conditions, not exceptions."""

from __future__ import annotations

import base64

import pytest

from asyncgrpo.api.validation import parse_run
from asyncgrpo.controller import bucketjob, children, secret
from tests.operator.helpers import (
    WAIT_SECONDS,
    component,
    kubelet,
    make_run,
    s3_secret,
    sandboxes_run,
    wait_for,
)
from tests.operator.peers import Dns

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LABELS = "app.kubernetes.io/managed-by"


def _pod_template(name: str) -> dict:
    return {"metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": "c", "image": "tenant/own:1"}]}}


def squatter(kind: str, ns: str, name: str, labels: dict | None = None) -> dict:
    """A minimal object of `kind` a tenant could create under a child's name."""
    meta = {"name": name, "namespace": ns, **({"labels": labels} if labels else {})}
    sel = {"matchLabels": {"app": name}}
    bodies = {
        "ServiceAccount": ("v1", {}),
        "ConfigMap": ("v1", {"data": {"run.yaml": "tenant: config\n"}}),
        "Secret": ("v1", {"stringData": {secret.GATEWAY_TOKEN_KEY: "known-to-the-tenant",
                                         secret.SANDBOX_TOKEN_KEY: "known-to-the-tenant"}}),
        "Service": ("v1", {"spec": {"ports": [{"port": 80}]}}),
        "Pod": ("v1", {"spec": {"containers": [{"name": "c", "image": "tenant/own:1"}]}}),
        "Role": ("rbac.authorization.k8s.io/v1", {"rules": [{"apiGroups": [""], "resources":
                                                              ["secrets"], "verbs": ["list"]}]}),
        "RoleBinding": ("rbac.authorization.k8s.io/v1", {
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "tenant"}, "subjects": []}),
        "NetworkPolicy": ("networking.k8s.io/v1", {"spec": {
            "podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]}}),
        "Deployment": ("apps/v1", {"spec": {"replicas": 0, "selector": sel,
                                            "template": _pod_template(name)}}),
        "StatefulSet": ("apps/v1", {"spec": {"replicas": 0, "serviceName": name,
                                             "selector": sel, "template": _pod_template(name)}}),
        "Job": ("batch/v1", {"spec": {"parallelism": 0, "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "tenant/own:1"}]}}}}),
    }
    api_version, rest = bodies[kind]
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **rest}


def child_names(run: dict) -> dict[str, str]:
    """kind -> the name of one child of that kind, as the operator would make it."""
    parsed = parse_run(run)
    out: dict[str, str] = {}
    for obj in children.build_children(parsed):
        out.setdefault(obj["kind"], obj["metadata"]["name"])
    out["Secret"] = secret.secret_name(parsed)
    out["Job"] = bucketjob.job_name(parsed, bucketjob.SETUP)
    out["Pod"] = f"{run['metadata']['name']}-sandbox-0"
    return out


KINDS = ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy", "Service",
         "Deployment", "StatefulSet", "Job", "Secret", "Pod"]


def test_a_precreated_object_of_every_child_kind_is_a_conflict_and_never_used(
        api, ns, s3_server):
    runs = {}
    for i, kind in enumerate(KINDS):
        name = f"sq{i}"
        run = sandboxes_run(s3_server, ns, name)
        target = child_names(run)[kind]
        api.create(squatter(kind, ns, target))
        runs[name] = (kind, target, run)
    # the same with the operator's own labels on it (so it shows in the operator's index)
    run = sandboxes_run(s3_server, ns, "sqlab")
    target = "sqlab-gateway"
    api.create(squatter("ServiceAccount", ns, target, labels={
        LABELS: "asyncgrpo-operator", "asyncgrpo.dev/run": "sqlab",
        "app.kubernetes.io/component": "gateway"}))
    runs["sqlab"] = ("ServiceAccount", target, run)
    for _, _, run in runs.values():
        api.create(run)

    for name, (kind, target, _) in runs.items():
        cond = wait_for(lambda n=name: (c := api.condition(ns, n, "Degraded"))
                        .get("reason") == "ChildConflict" and c, timeout=60,
                        what=f"ChildConflict of {name} ({kind} {target})")
        assert f"{kind} {target}" in cond["message"]
        assert api.run(ns, name)["status"]["phase"] == "Pending"
    for name, (kind, target, _) in runs.items():
        # the tenant's object is untouched: no owner reference, none of the run's content
        obj = api.get(kind, ns, target)
        assert not obj["metadata"].get("ownerReferences"), (kind, target)
        if kind == "ConfigMap":
            assert obj["data"] == {"run.yaml": "tenant: config\n"}
        # nothing of the run runs: every workload of its own at zero, no sandbox pod, no
        # setup Job (a sandbox pod's name is found taken only after the setup Job started)
        def own(kind_: str, n=name) -> list[dict]:
            return [o for o in api.list(kind_, ns, f"asyncgrpo.dev/run={n}")
                    if (o["metadata"].get("ownerReferences") or [{}])[0].get("name") == n]

        wait_for(lambda: all(w["spec"]["replicas"] == 0 for wl in ("Deployment", "StatefulSet")
                             for w in own(wl)), what=f"{name}: workloads at zero")
        assert not own("Pod"), name   # sandbox pods are the run's own children
        if kind not in ("Job", "Pod"):
            assert api.get("Job", ns, f"{name}-bucket-setup") is None, name
    assert "ChildConflict" in {e["reason"] for e in api.events(ns, "sq0")}

    # removing the tenant's object lets the run go on with its own
    api.delete("ServiceAccount", ns, runs["sq0"][1])
    wait_for(lambda: api.condition(ns, "sq0", "Degraded").get("reason") != "ChildConflict",
             timeout=60, what="sq0 free of conflicts")
    sa = api.get("ServiceAccount", ns, runs["sq0"][1])
    assert sa["metadata"]["ownerReferences"][0]["name"] == "sq0"


@pytest.fixture
def hostile(api, s3_server, crd_installed, peers):
    """An operator of its own whose DNS for tenant names is a loopback server that answers
    `good.test` and never answers anything else."""
    from asyncgrpo.controller.embedded import EmbeddedOperator
    from tests.operator.conftest import operator_settings

    dns = Dns({"good.test": "10.9.8.7"})
    ns = api.namespace("own")
    api.create(s3_secret(s3_server, ns))
    settings = operator_settings(peers)
    settings.dns_nameservers = [dns.server]
    settings.dns_deadline_seconds = 1.0
    settings.endpoint_deadline_seconds = 2.0
    op = EmbeddedOperator([ns], settings).start()
    yield ns
    for run in api.list("AsyncGRPORun", ns):
        api.delete("AsyncGRPORun", ns, run["metadata"]["name"])
    wait_for(lambda: not api.list("AsyncGRPORun", ns), timeout=60, what="runs gone")
    api.call("DELETE", f"/api/v1/namespaces/{ns}")
    op.stop()
    dns.close()
    peers.drips.clear()


def running(api, ns, name, gateway=True):
    if gateway:
        wait_for(lambda: kubelet(api, ns, component(name, "gateway")), what=f"{name} gateway")

    def up() -> bool:
        kubelet(api, ns, component(name, "vllm"))
        kubelet(api, ns, component(name, "sandbox"))
        sts = api.get("StatefulSet", ns, f"{name}-trainer")
        return bool(sts) and sts["spec"]["replicas"] > 0

    # four runs start at once on the shared machine
    wait_for(up, timeout=2 * WAIT_SECONDS, what=f"{name} trainer scaled up")
    wait_for(lambda: kubelet(api, ns, component(name, "trainer")), what=f"{name} trainer pod")


def test_dripping_endpoints_and_a_stalled_dns_cost_their_own_run_a_condition_only(
        api, hostile, s3_server, peers):
    ns = hostile
    for name in ("ok", "driptr", "dripgw"):
        api.create(sandboxes_run(s3_server, ns, name))
    egress = sandboxes_run(s3_server, ns, "dns")
    egress["spec"]["sandboxes"]["network"]["allowedEgressHosts"] = [
        "good.test", *(f"stall{i}.test" for i in range(20))]
    api.create(egress)
    peers.drips |= {f"/tr/{ns}/driptr/metrics", f"/gw/{ns}/dripgw/v1/demand",
                    f"/tr/{ns}/dns/metrics"}
    for name in ("ok", "driptr", "dripgw", "dns"):
        peers.set_json(f"/gw/{ns}/{name}/v1/demand", {"busy": 0, "idle": 1, "members": {}})
        if name != "dns":
            peers.set_text(f"/tr/{ns}/{name}/metrics", "asyncgrpo_trainer_step 1\n")
        running(api, ns, name)

    def degraded(name: str, reason: str, text: str):
        return wait_for(lambda: (c := api.condition(ns, name, "Degraded")).get("reason")
                        == reason and text in c["message"] and c, timeout=60,
                        what=f"{name}: {reason}")

    degraded("driptr", "EndpointSlow", "the trainer's metrics endpoint")
    degraded("dripgw", "EndpointSlow", "/v1/demand")
    peers.drips.discard(f"/tr/{ns}/dns/metrics")
    peers.set_text(f"/tr/{ns}/dns/metrics", "asyncgrpo_trainer_step 1\n")
    degraded("dns", "EgressHostsUnresolved", "stall")
    # the name that resolves is in the sandboxes' policy, the ones that stall are not
    pol = api.get("NetworkPolicy", ns, "dns-sandbox")
    cidrs = {b["ipBlock"]["cidr"] for rule in pol["spec"]["egress"] for b in rule.get("to", [])
             if "ipBlock" in b}
    assert "10.9.8.7/32" in cidrs
    # the healthy run keeps following its trainer, step after step
    for step in (5, 9, 13):
        peers.set_text(f"/tr/{ns}/ok/metrics", f"asyncgrpo_trainer_step {step}\n")
        wait_for(lambda s=step: api.run(ns, "ok")["status"].get("step") == s, timeout=30,
                 what=f"healthy run at step {step}")
    # and a new run beside them gets its first status
    api.create(sandboxes_run(s3_server, ns, "late"))
    wait_for(lambda: api.run(ns, "late").get("status", {}).get("phase"), timeout=30,
             what="the new run's first status")
    # a run whose endpoint answers again loses the condition
    peers.drips.discard(f"/tr/{ns}/driptr/metrics")
    wait_for(lambda: api.condition(ns, "driptr", "Degraded").get("reason") != "EndpointSlow",
             timeout=60, what="driptr recovered")


@pytest.mark.parametrize("what, value, reason", [
    ("demand", [], "BadResponse"),
    ("metrics", "asyncgrpo_trainer_step +Inf\n", "BadResponse"),
])
def test_hostile_answers_are_a_condition_and_the_run_keeps_its_status(
        api, ns, s3_server, peers, what, value, reason):
    name = f"bad{what}"
    api.create(sandboxes_run(s3_server, ns, name))
    peers.set_json(f"/gw/{ns}/{name}/v1/demand", {"busy": 0, "idle": 1, "members": {}})
    peers.set_text(f"/tr/{ns}/{name}/metrics", "asyncgrpo_trainer_step 3\n")
    running(api, ns, name)
    wait_for(lambda: api.run(ns, name)["status"].get("step") == 3, what="step 3")
    if what == "demand":
        peers.set_json(f"/gw/{ns}/{name}/v1/demand", value)
    else:
        peers.set_text(f"/tr/{ns}/{name}/metrics", value)
    cond = wait_for(lambda: (c := api.condition(ns, name, "Degraded")).get("reason")
                    == reason and c, timeout=30, what=reason)
    assert ("demand" if what == "demand" else "metrics") in cond["message"]
    assert api.run(ns, name)["status"]["step"] == 3
    # the status still moves (the handler returned normally): the generation is observed
    api.merge_patch("AsyncGRPORun", ns, name, {"spec": {"suspend": True}})
    wait_for(lambda: api.run(ns, name)["status"]["phase"] == "Suspended", what="suspended")


def test_a_token_secret_with_non_utf8_data_is_a_condition(api, ns, s3_server, peers):
    api.create(sandboxes_run(s3_server, ns, "tok"))
    wait_for(lambda: api.get("Secret", ns, "tok-tokens"), what="token Secret")
    wait_for(lambda: api.run(ns, "tok").get("status"), what="first status")
    # the tenant (who may write Secrets) spoils the operator's own Secret; a new operator
    # (nothing in memory) reads it
    bad = base64.b64encode(b"\xff\xfe\x00").decode()
    api.merge_patch("Secret", ns, "tok-tokens", {"data": {secret.GATEWAY_TOKEN_KEY: bad}})
    from asyncgrpo.controller.embedded import EmbeddedOperator
    from tests.operator.conftest import operator_settings

    other = api.namespace("own")
    api.create(s3_secret(s3_server, other))
    api.create(sandboxes_run(s3_server, other, "tok"))
    op = EmbeddedOperator([other], operator_settings(peers)).start()
    try:
        wait_for(lambda: api.get("Secret", other, "tok-tokens"), what="token Secret")
        api.merge_patch("Secret", other, "tok-tokens",
                        {"data": {secret.GATEWAY_TOKEN_KEY: bad}})
        op.stop()
        op = EmbeddedOperator([other], operator_settings(peers)).start()
        cond = wait_for(lambda: (c := api.condition(other, "tok", "Degraded")).get("reason")
                        == "TokenSecretInvalid" and c, timeout=60, what="TokenSecretInvalid")
        assert "tok-tokens" in cond["message"]
    finally:
        for run in api.list("AsyncGRPORun", other):
            api.delete("AsyncGRPORun", other, run["metadata"]["name"])
        wait_for(lambda: not api.list("AsyncGRPORun", other), timeout=60, what="runs gone")
        op.stop()
        api.call("DELETE", f"/api/v1/namespaces/{other}")


@pytest.mark.parametrize("patch", [
    {"completionTime": "2026-01-01T00:00:00.5Z", "phase": "Succeeded"},
    {"checkpointIdentity": "x"},
    {"checkpointIdentity": "[]"},
])
def test_hostile_status_values_are_data(api, ns, s3_server, patch):
    name = "st"
    api.create(make_run(s3_server, ns, name))
    wait_for(lambda: api.condition(ns, name, "BucketReady").get("status") == "True",
             what="bucket")
    api.merge_patch("AsyncGRPORun", ns, name, {"status": patch}, "/status")
    # the handler returns normally: a spec change is still observed
    api.merge_patch("AsyncGRPORun", ns, name, {"spec": {"suspend": True}})
    wait_for(lambda: api.run(ns, name)["status"].get("observedGeneration") == 2,
             what="generation 2 observed")
    if "checkpointIdentity" in patch:
        # the identity check does not rest on the status: a model change is still refused
        api.merge_patch("AsyncGRPORun", ns, name, {"spec": {"model": {"name": "other/m"}}})
        wait_for(lambda: api.condition(ns, name, "Degraded").get("reason")
                 == "ImmutableFieldChanged", what="ImmutableFieldChanged")
