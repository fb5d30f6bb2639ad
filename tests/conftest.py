"""Fixtures shared by every test folder: real servers on loopback, started and ended here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.testing.net import free_port, wait_for_port

REPO = Path(__file__).resolve().parent.parent


class S3Server:
    """A real S3 HTTP server (moto_server) on loopback; credentials are dummies it accepts."""

    access_key = "testing-access-key"
    secret_key = "testing-secret-key"
    region = "us-east-1"

    def __init__(self, port: int, proc: subprocess.Popen):
        self.port = port
        self.proc = proc
        self.endpoint = f"http://127.0.0.1:{port}"

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
        }


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("s3") / "moto.log", "w")  # noqa: SIM115 (moto writes it)
    moto = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"},
    )
    try:
        wait_for_port(port, proc=proc)
        yield S3Server(port, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


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
    """The AsyncGRPORun CRD from crds/, installed and Established."""
    from asyncgrpo.testing.kube import install_crd

    install_crd(kube_dynamic, REPO / "crds" / "asyncgrpo.dev_asyncgrporuns.yaml")
    return kube_dynamic.resources.get(api_version="asyncgrpo.dev/v1alpha1", kind="AsyncGRPORun")
