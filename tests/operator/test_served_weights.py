"""Full fine-tuning: the versions the vLLM replicas serve, read from their weights pullers,
reach the run's status (oldest, newest), the operator's metrics, and the NetworkPolicy lets
only the operator ask."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.controller import network, untrusted
from asyncgrpo.controller.metrics import OperatorMetrics
from asyncgrpo.controller.observe import Child, summarize
from asyncgrpo.controller.served import ServedWeights, puller_url, served_weights
from asyncgrpo.controller.status import Observation, compute
from asyncgrpo.controller.tenant_io import TenantIO
from asyncgrpo.wire import PULLER_PORT
from tests.operator.helpers import one_page_server
from tests.operator.test_builders import run_of


def vllm_pod(name: str, ip: str, phase: str = "Running", deleting: bool = False) -> Child:
    return Child(kind="Pod", name=name, component="vllm", hash=None, phase=phase, ip=ip,
                 deleting=deleting)


@pytest.fixture
def puller_status():
    """A real HTTP server answering /status as the puller does; the test sets the body."""
    with one_page_server("/status", b"{}") as served:
        yield served


def read_puller(io: TenantIO, port: int) -> int | None:
    reading = io.read(("t", port), "t", puller_url("127.0.0.1", port), untrusted.puller,
                      max_bytes=1 << 16, wait=5)
    io.forget(("t",))
    return reading.value if reading is not None else None


def test_read_puller_takes_the_served_version_and_nothing_else(puller_status):
    doc, port = puller_status
    io = TenantIO()
    try:
        doc["body"] = json.dumps({"ready": True, "served_version": 7, "latest_seen": 9}).encode()
        assert read_puller(io, port) == 7
        for bad in (b'{"served_version": "7"}', b"[7]", b"not json",
                    b'{"served_version": true}', b'{"served_version": -1}',
                    b'{"served_version": 1e400}', b"\xff\xfe"):
            doc["body"] = bad
            assert read_puller(io, port) is None, bad
        doc["body"] = b'{"served_version": null}'
        assert read_puller(io, port) is None
    finally:
        io.close()


def test_a_silent_puller_is_none():
    # nothing listens on this port of loopback: refused at once
    io = TenantIO()
    try:
        assert read_puller(io, 9) is None
    finally:
        io.close()


def test_served_weights_spans_the_running_replicas_that_answer():
    children = [vllm_pod("a", "10.0.0.1"), vllm_pod("b", "10.0.0.2"), vllm_pod("c", "10.0.0.3"),
                vllm_pod("pending", "", phase="Pending"),
                vllm_pod("going", "10.0.0.9", deleting=True),
                Child(kind="Pod", name="t", component="trainer", hash=None, phase="Running",
                      ip="10.0.0.5")]
    asked = []
    versions = {"10.0.0.1": 4, "10.0.0.2": 6, "10.0.0.3": None}

    def read(ip):
        asked.append(ip)
        return versions[ip]

    assert served_weights(children, read=read) == ServedWeights(oldest=4, newest=6, replicas=2)
    assert sorted(asked) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert served_weights([vllm_pod("a", "10.0.0.1")], read=lambda ip: None) is None
    assert served_weights([], read=read) is None


def test_the_pod_ip_comes_from_the_pod_status():
    body = {"kind": "Pod", "metadata": {"name": "p", "labels": {
        "app.kubernetes.io/component": "vllm"}}, "status": {"phase": "Running",
                                                             "podIP": "198.18.0.7"}}
    assert summarize(body).ip == "198.18.0.7"


def test_status_and_metrics_show_the_spread():
    spec = run_of("full-finetune.yaml").spec
    obs = Observation(generation=1, bucket_checked=True,
                      served_weights=ServedWeights(oldest=3, newest=5, replicas=2))
    status, _ = compute(spec, obs, {}, "T")
    assert status["servedWeights"] == {"oldest": 3, "newest": 5, "replicas": 2}
    m = OperatorMetrics()
    m.set_status("ns", "r", status)
    value = m.registry.get_sample_value
    assert value("asyncgrpo_operator_run_served_weights_version",
                 {"namespace": "ns", "run": "r", "replica": "oldest"}) == 3
    assert value("asyncgrpo_operator_run_served_weights_version",
                 {"namespace": "ns", "run": "r", "replica": "newest"}) == 5
    m.forget("ns", "r")
    assert value("asyncgrpo_operator_run_served_weights_version",
                 {"namespace": "ns", "run": "r", "replica": "newest"}) is None


def test_only_the_operator_and_the_runs_router_may_ask_a_puller_and_only_in_full_runs():
    def puller_rules(run):
        policy = next(p for p in network.build_policies(run)
                      if p["metadata"]["name"].endswith("-vllm"))
        return [r for r in policy["spec"]["ingress"]
                if {"protocol": "TCP", "port": PULLER_PORT} in r.get("ports", [])]

    full = run_of("full-finetune.yaml")
    own_trainer = {"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "asyncgrpo", "app.kubernetes.io/instance": full.metadata.name,
        "app.kubernetes.io/component": "trainer"}}}
    # the trainer's version-aware router reads each replica's served version
    assert puller_rules(full) == [{"from": [network.OPERATOR_SCRAPER, own_trainer],
                                   "ports": [{"protocol": "TCP", "port": PULLER_PORT}]}]
    full.spec.rollout.routing = "service"   # no router: the operator alone
    assert puller_rules(full) == [
        {"from": [network.OPERATOR_SCRAPER], "ports": [{"protocol": "TCP", "port": PULLER_PORT}]}]
    assert puller_rules(run_of("lora-math.yaml")) == []
