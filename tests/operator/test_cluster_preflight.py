"""The cluster preflight on the real API server: a run whose model path does not exist gets
Preflight=False naming spec.model.name, and neither vLLM nor the trainer is scaled up; a good
run passes it and scales up. The preflight Job's pod runs the real `asyncgrpo
preflight` (asyncgrpo.testing.jobs: the run's ConfigMap laid out where the pod mounts it).

The preflight is on by default in the operator (and in the node e2e tests, which run the
chart's operator); the shared operator of the other cluster tests has it off, as each
preflight is a 13-70 s Python process on the 2-core machine and they test other things."""

from __future__ import annotations

import pytest

from tests.operator.helpers import make_run, s3_secret, wait_for

pytestmark = [pytest.mark.cluster]


@pytest.fixture
def preflighted(api, s3_server, crd_installed, peers):
    """An operator of its own with preflights on, on an `own-*` namespace."""
    from asyncgrpo.controller.embedded import EmbeddedOperator
    from tests.operator.conftest import operator_settings

    ns = api.namespace("own")
    api.create(s3_secret(s3_server, ns))
    settings = operator_settings(peers)
    settings.preflight = True
    op = EmbeddedOperator([ns], settings).start()
    yield ns
    op.stop()
    api.call("DELETE", f"/api/v1/namespaces/{ns}")


def test_a_failing_preflight_is_a_condition_naming_the_field_and_nothing_scales_up(
        api, preflighted, s3_server, bucket_jobs):
    ns = preflighted
    run = make_run(s3_server, ns, "typo")
    run["spec"]["model"]["name"] = "/models/qwen3-typo"
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "typo", "Preflight")).get("status") == "False"
                    and c, timeout=90, what="Preflight=False")
    assert cond["reason"] == "PreflightFailed"
    assert "spec.model.name: /models/qwen3-typo: no such folder" in cond["message"]
    assert api.run(ns, "typo")["status"]["phase"] == "Pending"
    degraded = api.condition(ns, "typo", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PreflightFailed"
    sts = api.call("GET", f"/apis/apps/v1/namespaces/{ns}/statefulsets/typo-trainer")
    deploy = api.call("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/typo-vllm")
    assert sts["spec"]["replicas"] == 0 and deploy["spec"]["replicas"] == 0
    assert any(r[1].startswith("typo-preflight") and r[2] == 1 for r in bucket_jobs.ran)


def test_a_passing_preflight_lets_the_run_scale_up(
        api, preflighted, s3_server, bucket_jobs):
    ns = preflighted
    api.create(make_run(s3_server, ns, "good"))
    wait_for(lambda: api.condition(ns, "good", "Preflight").get("status") == "True",
             what="Preflight=True")
    assert any(r[1].startswith("good-preflight") and r[2] == 0 for r in bucket_jobs.ran)
    # vLLM first (the trainer follows once vLLM is Ready, which pods here never become)
    wait_for(lambda: api.get("Deployment", ns, "good-vllm")["spec"]["replicas"] >= 1,
             what="vLLM scaled up after the preflight")
    assert api.condition(ns, "good", "Degraded").get("status") != "True"
