"""The run folder's claim and release on the real API server, with the real S3 server and
the bucket Jobs run (issue 28, "Races on the ownership marker" and the smaller ones): a
deletion stops the setup Job before the cleanup, a run recreated after Retain takes its
folder back only when it asks (spec.adapterStore.reclaimRetainedFolder), a run that never
set its bucket up is deleted at once, and only a Secret marked for S3 credentials is sent.
"""

from __future__ import annotations

import time

import pytest

from tests.operator.helpers import make_run, wait_for

pytestmark = [pytest.mark.cluster]

MARKER = ".asyncgrpo-owner.json"


def keys(s3_server, bucket: str) -> set[str]:
    out: set[str] = set()
    for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out |= {o["Key"] for o in page.get("Contents", [])}
    return out


def reason(api, ns, name, type_="BucketReady"):
    return api.condition(ns, name, type_).get("reason")


def test_deleting_a_run_stops_its_setup_job_before_the_cleanup(api, ns, s3_server,
                                                               bucket_jobs):
    run = make_run(s3_server, ns, "mid")
    run["spec"]["adapterStore"].update({"bucket": "claims-mid", "deletionPolicy": "Delete"})
    s3_server.client().create_bucket(Bucket="claims-mid")
    bucket_jobs.hold(ns)   # the setup Job's pod waits, as on a busy node
    try:
        api.create(run)
        wait_for(lambda: api.get("Job", ns, "mid-bucket-setup"), what="the setup Job")
        api.delete("AsyncGRPORun", ns, "mid")
        seen_together = []

        def setup_gone() -> bool:
            setup, cleanup = (api.get("Job", ns, f"mid-bucket-{a}") for a in ("setup", "cleanup"))
            if setup is not None and cleanup is not None:
                seen_together.append(True)
            return setup is None and not [p for p in api.list("Pod", ns)
                                          if p["metadata"]["name"].startswith("mid-bucket-setup")]
        wait_for(setup_gone, timeout=30, what="the setup Job stopped by the deletion")
        assert not seen_together, "the cleanup Job ran beside the setup Job"
    finally:
        bucket_jobs.held.discard(ns)
    wait_for(lambda: api.get("AsyncGRPORun", ns, "mid") is None, timeout=60, what="deleted",
             on_timeout=lambda: str(api.events(ns, "mid")))
    # no marker left behind: the same name is set up again
    assert not [k for k in keys(s3_server, "claims-mid") if k.startswith(f"asyncgrpo/{ns}/mid/")]
    api.create(run)
    wait_for(lambda: api.condition(ns, "mid", "BucketReady").get("status") == "True",
             timeout=60, what="the recreated run's bucket",
             on_timeout=lambda: str(api.condition(ns, "mid", "BucketReady")))


def test_a_run_recreated_after_retain_takes_its_folder_back_when_it_asks(api, ns, s3_server):
    run = make_run(s3_server, ns, "again")
    run["spec"]["adapterStore"].update({"bucket": "claims-again", "deletionPolicy": "Retain"})
    api.create(run)
    wait_for(lambda: api.condition(ns, "again", "BucketReady").get("status") == "True",
             what="bucket")
    kept = f"asyncgrpo/{ns}/again/checkpoints/step-3/manifest.json"
    s3_server.client().put_object(Bucket="claims-again", Key=kept, Body=b"{}")
    api.delete("AsyncGRPORun", ns, "again")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "again") is None, what="deleted")
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "again", "BucketReady")).get("reason")
                    == "FolderOwnedByAnotherRun" and c, timeout=60, what="refused")
    assert "reclaimRetainedFolder" in cond["message"]
    api.merge_patch("AsyncGRPORun", ns, "again",
                    {"spec": {"adapterStore": {"reclaimRetainedFolder": True}}})
    wait_for(lambda: api.condition(ns, "again", "BucketReady").get("status") == "True",
             timeout=60, what="the folder taken back",
             on_timeout=lambda: str(api.condition(ns, "again", "BucketReady")))
    import json
    body = s3_server.client().get_object(Bucket="claims-again",
                                         Key=f"asyncgrpo/{ns}/again/{MARKER}")["Body"].read()
    assert json.loads(body)["uid"] == api.run(ns, "again")["metadata"]["uid"]
    assert kept in keys(s3_server, "claims-again")


def test_a_run_that_never_set_its_bucket_up_is_deleted_at_once(api, ns, s3_server):
    run = make_run(s3_server, ns, "capped")
    run["spec"]["adapterStore"]["deletionPolicy"] = "Delete"
    run["spec"]["sandboxes"] = {"minWarm": 100000, "max": 100000, "hardCap": 100000}
    api.create(run)
    wait_for(lambda: reason(api, ns, "capped", "Degraded") == "OverCap", what="OverCap")
    t0 = time.monotonic()
    api.delete("AsyncGRPORun", ns, "capped")
    # the cleanup timeout is 600 s: before, the deletion waited all of it
    wait_for(lambda: api.get("AsyncGRPORun", ns, "capped") is None, timeout=30,
             what="deleted without a cleanup")
    assert time.monotonic() - t0 < 30
    assert "CleanupSkipped" in {e["reason"] for e in api.events(ns, "capped")}


def _secret(ns, name, type_, data, labels=None, annotations=None):
    import base64

    return {"apiVersion": "v1", "kind": "Secret", "type": type_,
            "metadata": {"name": name, "namespace": ns, "labels": labels or {},
                         "annotations": annotations or {}},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def test_only_a_secret_marked_as_s3_credentials_is_sent(api, ns, s3_server):
    """A tenant who may create runs (and Secrets, but read none) names a ServiceAccount
    token, a registry or TLS Secret, or an unmarked one, as credentialsSecret: no Job gets
    it, the run says SecretNotAllowed. The label is read with the type, never the data."""
    label = {"asyncgrpo.dev/s3-credentials": "true"}
    api.create({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "powerful", "namespace": ns}})
    hostile = {
        "sa-token": _secret(ns, "sa-token", "kubernetes.io/service-account-token", {},
                            labels=label,
                            annotations={"kubernetes.io/service-account.name": "powerful"}),
        "registry": _secret(ns, "registry", "kubernetes.io/dockerconfigjson",
                            {".dockerconfigjson": '{"auths": {}}'}, labels=label),
        "tls": _secret(ns, "tls", "kubernetes.io/tls", {"tls.crt": "c", "tls.key": "k"},
                       labels=label),
        "unmarked": _secret(ns, "unmarked", "Opaque", {"AWS_ACCESS_KEY_ID": "a",
                                                       "AWS_SECRET_ACCESS_KEY": "b"}),
    }
    for name, secret in hostile.items():
        api.create(secret)
        run = make_run(s3_server, ns, f"use-{name}")
        run["spec"]["adapterStore"]["credentialsSecret"] = {
            "name": name, "accessKeyIdKey": "token" if name == "sa-token" else "tls.key"
            if name == "tls" else ".dockerconfigjson" if name == "registry"
            else "AWS_ACCESS_KEY_ID"}
        api.create(run)
    for name in hostile:
        cond = wait_for(lambda n=name: (c := api.condition(ns, f"use-{n}", "BucketReady"))
                        .get("reason") == "SecretNotAllowed" and c, what=f"{name} refused")
        assert cond["status"] == "False" and name in cond["message"]
        assert api.get("Job", ns, f"use-{name}-bucket-setup") is None
    # the marked Opaque Secret of the fixture is used as before
    api.create(make_run(s3_server, ns, "fine"))
    wait_for(lambda: api.condition(ns, "fine", "BucketReady").get("status") == "True",
             what="the marked Secret used")


def test_a_config_map_refused_for_size_stops_the_run_with_a_condition(api, ns, s3_server):
    run = make_run(s3_server, ns, "huge")
    run["spec"]["reward"]["functions"] = [{"name": "python",
                                           "module": "asyncgrpo.local.demo:digit_fraction",
                                           "args": {"notes": "x" * 1_100_000}}]
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "huge", "Degraded")).get("reason")
                    == "ConfigRefused" and c, timeout=60, what="ConfigRefused",
                    on_timeout=lambda: str(api.run(ns, "huge").get("status")))
    assert "1 MiB" in cond["message"]
    assert api.run(ns, "huge")["status"]["phase"] == "Pending"
    assert api.get("ConfigMap", ns, "huge-config") is None
    # nothing runs without its config: every workload at zero, no trainer
    for kind, name in (("Deployment", "huge-vllm"), ("StatefulSet", "huge-trainer")):
        obj = api.get(kind, ns, name)
        assert obj is None or obj["spec"]["replicas"] == 0
    api.delete("AsyncGRPORun", ns, "huge")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "huge") is None, what="deleted")
