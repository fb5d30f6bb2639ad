"""The test cluster's opt-in audit log of API writes (what bench/sandbox_pool_node_bench.py
counts per lease): off by default; on, every write is recorded with its user, verb and
resource, and reads are not."""

from __future__ import annotations

import json
import ssl
import urllib.request

import pytest

from asyncgrpo.testing import cluster as kc

pytestmark = pytest.mark.cluster


def _call(cluster: kc.TestCluster, method: str, path: str, body: dict | None = None) -> dict:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(
        cluster.server + path, method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {kc.ADMIN_TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        return json.loads(r.read())


def test_the_audit_log_is_off_by_default(kube_cluster):
    assert kube_cluster.audit is False
    assert not kube_cluster.audit_log.exists()
    assert kube_cluster.read_audit() == []


def test_the_audit_log_records_writes_by_user_verb_and_resource(tmp_path):
    with kc.TestCluster(tmp_path, with_controller_manager=False, audit=True) as cluster:
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "audited", "namespace": "default"}, "data": {"a": "1"}}
        _call(cluster, "POST", "/api/v1/namespaces/default/configmaps", cm)
        _call(cluster, "GET", "/api/v1/namespaces/default/configmaps/audited")
        _call(cluster, "DELETE", "/api/v1/namespaces/default/configmaps/audited")
        events = [e for e in cluster.read_audit()
                  if e.get("objectRef", {}).get("resource") == "configmaps"
                  and e["objectRef"].get("name") == "audited"]
    seen = [(e["user"]["username"], e["verb"], e["stage"]) for e in events]
    assert seen == [("admin", "create", "ResponseComplete"),
                    ("admin", "delete", "ResponseComplete")], seen
    assert all("requestObject" not in e for e in events)  # Metadata level: no bodies
