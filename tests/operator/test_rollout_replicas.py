"""Per vLLM replica in the run's status (`status.rolloutReplicas`): the requests the trainer's
router sent it (from the trainer's own metrics page), vLLM's own prefix-cache counters (read
from the pod's /metrics over HTTP, as the operator does) and the version it serves."""

from __future__ import annotations

import pytest

from asyncgrpo.api.v1alpha1 import AsyncGRPORunStatus
from asyncgrpo.controller import progress
from asyncgrpo.controller.observe import Child
from asyncgrpo.controller.rollout_replicas import (
    PrefixCache,
    replica_key,
    summarize,
    vllm_prefix_cache,
)
from asyncgrpo.controller.status import Observation, compute
from asyncgrpo.controller.tenant_io import TenantIO
from asyncgrpo.trainer.metrics import TrainerMetrics
from tests.operator.helpers import one_page_server
from tests.operator.test_builders import run_of

#: the lines of a vLLM 0.x /metrics page that matter here, as vLLM writes them (a counter
#: per engine, with its _created sample), among others that must be ignored
VLLM_PAGE = b"""\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1536.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1280.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 24.0
"""


def vllm_pod(name, ip, phase="Running"):
    return Child(kind="Pod", name=name, component="vllm", hash=None, phase=phase, ip=ip)


@pytest.fixture
def vllm_metrics():
    with one_page_server("/metrics", VLLM_PAGE) as served:
        yield served


def read(io, port):
    reading = io.read(("t", port), "t", f"http://127.0.0.1:{port}/metrics", vllm_prefix_cache,
                      max_bytes=1 << 20, wait=5)
    io.forget(("t",))
    return reading


def test_the_prefix_cache_counters_come_from_the_vllm_page(vllm_metrics):
    doc, port = vllm_metrics
    io = TenantIO()
    try:
        assert read(io, port).value == PrefixCache(queries=1536, hits=1280)
        # two engines in one server: summed
        doc["body"] = VLLM_PAGE + VLLM_PAGE.replace(b'engine="0"', b'engine="1"')
        assert read(io, port).value == PrefixCache(queries=3072, hits=2560)
        doc["body"] = b"vllm:request_success_total 3\n"     # no prefix cache counters
        assert read(io, port).value is None
        for bad in (b"vllm:prefix_cache_hits_total -1\n", b"vllm:prefix_cache_hits_total +Inf\n",
                    b"vllm:prefix_cache_hits_total 1.5\n", b"{{{ not prometheus"):
            doc["body"] = bad
            r = read(io, port)
            assert r.value is None and r.problem is not None, bad
    finally:
        io.close()


def test_the_router_counts_come_from_the_trainer_page():
    m = TrainerMetrics()
    m.update_from_logs({"routing/10.0.0.1:8000/requests_total": 12.0,
                        "routing/10.0.0.1:8000/groups_in_flight": 1.0,
                        "routing/10.0.0.1:8000/served_version": 4.0,
                        "routing/10.0.0.2:8000/requests_total": 5.0,
                        "routing/10.0.0.2:8000/groups_in_flight": 0.0})
    m.update_from_logs({"routing/10.0.0.1:8000/requests_total": 3.0,
                        "routing/10.0.0.1:8000/groups_in_flight": 0.0})
    p = progress.parse(m.exposition().decode())
    assert p.replicas == {"10.0.0.1:8000": {"requests": 15, "version": 4},
                          "10.0.0.2:8000": {"requests": 5}}
    assert progress.parse("asyncgrpo_trainer_step 3\n").replicas is None
    with pytest.raises(ValueError):   # a hostile label is refused, as any bad value
        progress.parse('asyncgrpo_trainer_rollout_routed_requests_total{replica="%s"} 1\n'
                       % ("x" * 100))


def test_status_lists_each_running_replica_with_its_three_sources():
    children = [vllm_pod("r-vllm-a", "10.0.0.1"), vllm_pod("r-vllm-b", "10.0.0.2"),
                vllm_pod("r-vllm-new", "", phase="Pending")]
    routed = {"10.0.0.1:8000": {"requests": 15, "version": 4},
              "10.0.0.2:8000": {"requests": 5},
              "10.0.0.9:8000": {"requests": 7}}       # a replica gone since
    caches = {"10.0.0.1": PrefixCache(queries=1536, hits=1280), "10.0.0.2": None}
    asked = []

    def read_cache(ip):
        asked.append(ip)
        return caches[ip]

    replicas = summarize(children, routed, read_cache, versions={"10.0.0.2": 5})
    assert sorted(asked) == ["10.0.0.1", "10.0.0.2"]
    assert replicas == [
        {"replica": "10.0.0.1:8000", "pod": "r-vllm-a", "requestsRouted": 15,
         "prefixCacheQueries": 1536, "prefixCacheHits": 1280, "servedVersion": 4},
        {"replica": "10.0.0.2:8000", "pod": "r-vllm-b", "requestsRouted": 5,
         "servedVersion": 5},                            # its puller's word
        {"replica": "10.0.0.9:8000", "requestsRouted": 7}]
    spec = run_of("full-finetune.yaml").spec
    status, _ = compute(spec, Observation(generation=1, bucket_checked=True,
                                          rollout_replicas=replicas), {}, "T")
    assert status["rolloutReplicas"] == replicas
    # what the CRD's schema holds (the status model is the schema's source)
    model = AsyncGRPORunStatus.model_validate({"rolloutReplicas": replicas})
    assert model.rollout_replicas[0].prefix_cache_hits == 1280
    assert model.rollout_replicas[2].pod is None
    # no routing counts yet (a trainer that has not routed), an IPv6 pod
    assert summarize([vllm_pod("v6", "fd00::5")], None, lambda ip: None) == [
        {"replica": "[fd00::5]:8000", "pod": "v6"}]
    assert replica_key("fd00::5") == "[fd00::5]:8000"
