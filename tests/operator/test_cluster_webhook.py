"""The optional validating admission webhook on the real API server: a run that
`asyncgrpo validate` refuses is refused at `kubectl apply`, with every field path."""

from __future__ import annotations

import datetime
import ipaddress

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import free_port
from tests.operator.conftest import operator_settings
from tests.operator.helpers import make_run, s3_secret, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
CONFIG = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def self_signed(dir_):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (dir_ / "tls.crt").write_bytes(pem)
    (dir_ / "ca.crt").write_bytes(pem)
    (dir_ / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


def test_webhook_refuses_cross_field_errors_at_apply(api, crd_installed, peers, s3_server,
                                                     tmp_path):
    from asyncgrpo.controller.embedded import EmbeddedOperator
    from asyncgrpo.controller.runtime import WebhookSettings

    self_signed(tmp_path)
    ns = api.namespace("own")
    api.create(s3_secret(s3_server, ns))
    settings = operator_settings(peers)
    settings.webhook = WebhookSettings(port=free_port(), addr="127.0.0.1", host="127.0.0.1",
                                       cert_dir=str(tmp_path))
    op = EmbeddedOperator([ns], settings).start()
    try:
        def configured():
            try:
                return api.call("GET", f"{CONFIG}/validate.asyncgrpo.dev")["webhooks"]
            except ApiException:
                return None
        hooks = wait_for(configured, what="ValidatingWebhookConfiguration")
        assert hooks[0]["clientConfig"]["url"].startswith("https://127.0.0.1:")
        bad = make_run(s3_server, ns, "refused")
        bad["spec"]["model"]["lora"]["rank"] = 64      # above rollout.maxLoraRank 32
        bad["spec"]["adapterStore"]["retention"] = 1   # below maxStaleness + 2

        def refused():
            try:
                api.create(bad)
            except ApiException as e:
                return e
            api.delete("AsyncGRPORun", ns, "refused")   # the webhook was not called yet
            return None
        err = wait_for(refused, what="the webhook refusing")
        assert err.status == 422
        assert "spec.model.lora.rank" in err.body and "spec.adapterStore.retention" in err.body
        assert api.get("AsyncGRPORun", ns, "refused") is None
        ok = make_run(s3_server, ns, "accepted")
        assert api.create(ok)["metadata"]["name"] == "accepted"
        # an update that breaks a valid run is refused as well
        with pytest.raises(ApiException) as e:
            api.merge_patch("AsyncGRPORun", ns, "accepted", {"spec": {"trainer": {"fsdpSize": 3}}})
        assert e.value.status == 422 and "spec.trainer.fsdpSize" in e.value.body
        # fields the checkpoints depend on are immutable (issue 9)
        with pytest.raises(ApiException) as e:
            api.merge_patch("AsyncGRPORun", ns, "accepted", {"spec": {"model": {"lora": {"rank": 8}}}})
        assert e.value.status == 422 and "spec.model.lora.rank" in e.value.body
        # pod settings that would replace what the operator owns (issue 24)
        with pytest.raises(ApiException) as e:
            api.merge_patch("AsyncGRPORun", ns, "accepted", {"spec": {
                "pod": {"labels": {"asyncgrpo.dev/run": "other"}},
                "trainer": {"pod": {"env": [{"name": "ASYNCGRPO_ADAPTER_BUCKET",
                                             "value": "other"}]}}}})
        assert e.value.status == 422
        assert "spec.pod.labels.asyncgrpo.dev/run" in e.value.body
        assert "spec.trainer.pod.env[0].name" in e.value.body
        # over the operator's caps
        flood = make_run(s3_server, ns, "flood")
        flood["spec"]["sandboxes"] = {"minWarm": 100000, "max": 100000, "hardCap": 100000}
        with pytest.raises(ApiException) as e:
            api.create(flood)
        assert e.value.status == 422 and "spec.sandboxes.hardCap" in e.value.body
    finally:
        op.stop()
        try:   # kopf removes its managed configuration on exit; make sure of it
            api.call("DELETE", f"{CONFIG}/validate.asyncgrpo.dev")
        except ApiException as e:
            assert e.status == 404


def test_in_cluster_server_reports_a_service_client_config(tmp_path):
    """Inside a cluster the API server must call the webhook through its Service."""
    import asyncio

    from asyncgrpo.controller.runtime import WebhookSettings
    from asyncgrpo.controller.webhook import server

    self_signed(tmp_path)
    port = free_port()
    srv = server(WebhookSettings(port=port, addr="127.0.0.1", cert_dir=str(tmp_path),
                                 service="asyncgrpo-system/asyncgrpo-operator-webhook"))

    async def first():
        async def fn(*a, **kw):
            return {}
        configs = srv(fn)
        try:
            return await configs.__anext__()
        finally:
            await configs.aclose()
    config = asyncio.run(first())
    assert "url" not in config
    assert config["service"] == {"namespace": "asyncgrpo-system",
                                 "name": "asyncgrpo-operator-webhook", "port": port, "path": ""}
    assert config["caBundle"]
