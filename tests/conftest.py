"""Fixtures shared by every test folder: real servers on loopback, started and ended here."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from asyncgrpo.testing.net import free_port, wait_for_port  # noqa: F401 (used by tests)
from asyncgrpo.testing.s3 import S3Server

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (moto_server) on loopback for the session."""
    server = S3Server.start(tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_server, request):
    """A fresh bucket on the session's S3 server, named after the test's folder."""
    folder = request.node.path.parent.name
    name = f"{folder}-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The moto server's dummy credentials in the environment, where boto3's chain finds them."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server.env()


# ---------------------------------------------------------------- the real test cluster


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    """etcd + kube-apiserver + kube-controller-manager on loopback, for the whole session.

    Binaries: KUBEBUILDER_ASSETS, else the cache filled by hack/build-kube-binaries.sh
    (`make test` runs it). Sets KUBECONFIG for code under test that reads it.
    """
    from asyncgrpo.testing.cluster import TestCluster

    cluster = TestCluster(tmp_path_factory.mktemp("kube"))
    cluster.start()
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


@pytest.fixture(scope="session")
def kube_client(kube_cluster):
    """A kubernetes ApiClient for the test cluster (admin)."""
    import warnings

    import urllib3
    from kubernetes import config

    warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
    urllib3.disable_warnings()
    return config.new_client_from_config(config_file=str(kube_cluster.kubeconfig))


@pytest.fixture(scope="session")
def kube_dynamic(kube_client):
    """The dynamic client: sends objects as plain dicts (the typed client drops some fields)."""
    from kubernetes import dynamic

    return dynamic.DynamicClient(kube_client)


@pytest.fixture(scope="session")
def crd_installed(kube_dynamic):
    """The AsyncGRPORun CRD from crds/, installed and Established, and known to the garbage
    collector (a run's children are collected through their owner references)."""
    import yaml

    from asyncgrpo.testing.kube import install_crd, wait_garbage_collected_owner

    install_crd(kube_dynamic, REPO / "crds" / "asyncgrpo.dev_asyncgrporuns.yaml")
    probe = yaml.safe_load((REPO / "examples" / "local-tiny.yaml").read_text())
    probe["metadata"] = {"name": "gc-probe", "namespace": "default"}
    wait_garbage_collected_owner(kube_dynamic, probe)
    return kube_dynamic.resources.get(api_version="asyncgrpo.dev/v1alpha1", kind="AsyncGRPORun")


# ---------------------------------------------------------------- the cluster with a real node
# Needs root; `make test` installs what else it needs (hack/install-system-deps.sh,
# hack/build-kube-binaries.sh). Without root the node and e2e tests skip with the reason;
# ASYNCGRPO_NODE=0 skips them on purpose.


@pytest.fixture(scope="session")
def kube_node(tmp_path_factory):
    from asyncgrpo.testing.node import ClusterWithNode, NodeUnavailable, check_host

    if os.environ.get("ASYNCGRPO_NODE") == "0":
        pytest.skip("ASYNCGRPO_NODE=0: the node tests are switched off")
    if os.geteuid() != 0:
        pytest.skip("the test node needs root (network namespaces, cgroups, iptables)")
    try:
        check_host()
    except NodeUnavailable as e:  # as root, make test installs everything: a real failure
        pytest.fail(str(e))
    whole = ClusterWithNode(tmp_path_factory.mktemp("node-cluster"))
    whole.start()
    try:
        yield whole
    finally:
        whole.stop()
