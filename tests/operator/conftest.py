"""Fixtures of the operator tests: the operator (kopf, in a thread) against the real test
cluster, a loopback HTTP server standing in for gateways and trainers, the real S3 server,
and a kubelet for the bucket Jobs' pods (they run `asyncgrpo bucket ...` as local processes).

The shared operator watches namespaces named `op-*`; tests that restart or peer operators
run their own on `own-*` namespaces, so two operators never act on one run.
"""

from __future__ import annotations

import os

# kopf fixes timer intervals when handlers register: set before anything imports them
os.environ.setdefault("ASYNCGRPO_OPERATOR_RESYNC_SECONDS", "1")

import pytest
from kubernetes.client.exceptions import ApiException

from tests.operator.helpers import Api, JsonServer, s3_secret


@pytest.fixture(scope="session")
def bucket_jobs(kube_client, tmp_path_factory):
    """Runs the bucket and preflight Jobs' pods (the test cluster has no node): see
    asyncgrpo.testing.jobs. Every test that talks to the cluster has it, through `api`.
    A preflight (test_cluster_preflight.py turns it on) sees the example runs' hub models in
    a seeded cache (asyncgrpo.testing.hub): this machine has no network."""
    from asyncgrpo.testing.hub import seed_hub_cache
    from asyncgrpo.testing.jobs import BucketJobKubelet

    hub = seed_hub_cache(tmp_path_factory.mktemp("hub"))
    kubelet = BucketJobKubelet(kube_client, hub_cache=hub).start()
    yield kubelet
    kubelet.stop()


@pytest.fixture(scope="session")
def api(kube_client, bucket_jobs):
    return Api(kube_client)


@pytest.fixture(scope="session")
def peers():
    server = JsonServer()
    yield server
    server.close()


def operator_settings(peers):
    from asyncgrpo.controller.runtime import Settings

    return Settings(resync_seconds=1.0, gateway_url=peers.base + "/gw/{namespace}/{name}",
                    trainer_metrics_url=peers.base + "/tr/{namespace}/{name}/metrics",
                    scrapers=None,
                    # each preflight is a 13-70 s Python process on this 2-core machine:
                    # tests/operator/test_cluster_preflight.py turns it on (as the operator's
                    # default is), and the node e2e tests run the chart's operator with it
                    preflight=False)


@pytest.fixture(scope="session")
def operator(crd_installed, peers):
    from asyncgrpo.controller.embedded import EmbeddedOperator

    op = EmbeddedOperator(["op-*"], operator_settings(peers)).start()
    yield op
    op.stop()


@pytest.fixture
def ns(api, operator, s3_server):
    """A fresh namespace the shared operator watches, holding the S3 credentials Secret."""
    name = api.namespace("op")
    api.create(s3_secret(s3_server, name))
    yield name
    # runs of finished tests leave with their namespace, so later tests share the operator
    # with as few runs as possible (the finalizer and garbage collector do the rest)
    try:
        api.call("DELETE", f"/api/v1/namespaces/{name}")
    except ApiException as e:
        if e.status != 404:  # a test may have deleted it already
            raise
