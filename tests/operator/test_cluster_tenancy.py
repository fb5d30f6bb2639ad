"""Tenants cannot touch each other (issue 9), on the real API server with the real S3 server.

Each test is an attack from the issue: the cross-tenant deletions, a Secret sent where the
user says, handlers that raised forever on bad input, a cleanup that could never finish.
"""

from __future__ import annotations

import base64
import socket
import threading

import pytest

from tests.operator.helpers import make_run, s3_secret, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MARKER = ".asyncgrpo-owner.json"


def keys(s3_server, bucket: str) -> set[str]:
    out: set[str] = set()
    for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out |= {o["Key"] for o in page.get("Contents", [])}
    return out


def bucket_ready(api, ns, name) -> bool:
    return api.condition(ns, name, "BucketReady").get("status") == "True"


def second_namespace(api, s3_server) -> str:
    other = api.namespace("op")
    api.create(s3_secret(s3_server, other))
    return other


def test_same_name_in_two_namespaces_has_two_folders_and_delete_keeps_the_other(
        api, ns, s3_server):
    other = second_namespace(api, s3_server)
    for where in (ns, other):
        run = make_run(s3_server, where, "shared")
        run["spec"]["adapterStore"].update({"bucket": "tenancy-shared", "deletionPolicy": "Delete"})
        api.create(run)
    for where in (ns, other):
        wait_for(lambda w=where: bucket_ready(api, w, "shared"), what=f"bucket of {where}")
    s3 = s3_server.client()
    for where in (ns, other):
        s3.put_object(Bucket="tenancy-shared", Key=f"asyncgrpo/{where}/shared/adapters/v1/f",
                      Body=b"1")
    assert {f"asyncgrpo/{ns}/shared/{MARKER}",
            f"asyncgrpo/{other}/shared/{MARKER}"} <= keys(s3_server, "tenancy-shared")

    api.delete("AsyncGRPORun", ns, "shared")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "shared") is None, what="run deleted")
    left = keys(s3_server, "tenancy-shared")
    assert not [k for k in left if k.startswith(f"asyncgrpo/{ns}/")]
    assert {f"asyncgrpo/{other}/shared/adapters/v1/f",
            f"asyncgrpo/{other}/shared/{MARKER}"} <= left
    api.call("DELETE", f"/api/v1/namespaces/{other}")


def test_a_foreground_deletion_still_empties_the_folder(api, ns, s3_server):
    """`propagationPolicy: Foreground` (kubectl --cascade=foreground; GitOps tools use it)
    deletes the run's children before the run, its ServiceAccount among them, while the
    operator's finalizer holds the run: the cleanup Job runs as that ServiceAccount all the
    same. With a trainer pod, which the operator stops (and waits for) before the cleanup."""
    from tests.operator.test_cluster_lifecycle import bring_up

    run = make_run(s3_server, ns, "fg")
    run["spec"]["adapterStore"].update({"bucket": "tenancy-fg", "deletionPolicy": "Delete"})
    api.create(run)
    wait_for(lambda: bucket_ready(api, ns, "fg"), what="bucket ready")
    bring_up(api, ns, "fg")
    assert api.get("Pod", ns, "fg-trainer-0") is not None
    s3_server.client().put_object(Bucket="tenancy-fg", Key=f"asyncgrpo/{ns}/fg/adapters/v1/f",
                                  Body=b"1")
    api.delete("AsyncGRPORun", ns, "fg", propagation="Foreground")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "fg") is None, timeout=120,
             what="run deleted", on_timeout=lambda: str(api.events(ns, "fg")))
    assert not [k for k in keys(s3_server, "tenancy-fg") if k.startswith(f"asyncgrpo/{ns}/")]
    assert "BucketCleaned" in {e["reason"] for e in api.events(ns, "fg")}
    # nothing the cleanup needed is left behind
    assert api.get("ServiceAccount", ns, "fg-workload") is None


def test_deleting_the_namespace_of_a_run_is_not_held_up(api, ns, s3_server):
    """A namespace going away takes the run's Secret and ServiceAccount with it: no cleanup
    Job can run there, so the run is released at once, and with it the ServiceAccount it
    held for the cleanup, and the namespace goes."""
    run = make_run(s3_server, ns, "doomed")
    run["spec"]["adapterStore"].update({"bucket": "tenancy-ns", "deletionPolicy": "Delete"})
    api.create(run)
    wait_for(lambda: bucket_ready(api, ns, "doomed"), what="bucket ready")
    account = api.get("ServiceAccount", ns, "doomed-workload")
    assert account["metadata"]["finalizers"] == ["asyncgrpo.dev/bucket-cleanup"]
    api.call("DELETE", f"/api/v1/namespaces/{ns}")
    wait_for(lambda: ns not in [n["metadata"]["name"] for n in
                                api.call("GET", "/api/v1/namespaces")["items"]], timeout=120,
             what="the namespace gone", on_timeout=lambda: str(
                 api.get("ServiceAccount", ns, "doomed-workload")))


def test_a_run_aimed_inside_another_runs_folder_is_refused_and_deletes_nothing(
        api, ns, s3_server):
    """The issue's `adapters` run with prefix `asyncgrpo/shared`, in today's layout: a prefix
    that puts the run folder inside the victim's."""
    victim_ns = second_namespace(api, s3_server)
    victim = make_run(s3_server, victim_ns, "victim")
    victim["spec"]["adapterStore"]["bucket"] = "tenancy-nested"
    api.create(victim)
    wait_for(lambda: bucket_ready(api, victim_ns, "victim"), what="victim's bucket")
    s3 = s3_server.client()
    victim_key = f"asyncgrpo/{victim_ns}/victim/adapters/v1/manifest.json"
    s3.put_object(Bucket="tenancy-nested", Key=victim_key, Body=b"{}")

    evil = make_run(s3_server, ns, "adapters")
    evil["spec"]["adapterStore"].update({"bucket": "tenancy-nested", "deletionPolicy": "Delete",
                                         "prefix": f"asyncgrpo/{victim_ns}/victim"})
    api.create(evil)
    cond = wait_for(lambda: (c := api.condition(ns, "adapters", "BucketReady"))
                    .get("reason") == "FolderInsideAnotherRun" and c, what="refused")
    assert cond["status"] == "False"
    assert api.get("StatefulSet", ns, "adapters-trainer") is None or \
        api.get("StatefulSet", ns, "adapters-trainer")["spec"]["replicas"] == 0
    api.delete("AsyncGRPORun", ns, "adapters")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "adapters") is None, what="evil run deleted")
    assert {victim_key, f"asyncgrpo/{victim_ns}/victim/{MARKER}"} <= keys(s3_server,
                                                                         "tenancy-nested")
    assert "NotOwner" in {e["reason"] for e in api.events(ns, "adapters")}
    api.call("DELETE", f"/api/v1/namespaces/{victim_ns}")


def test_a_run_around_another_runs_folder_never_empties_it(api, ns, s3_server):
    """The issue's run named `asyncgrpo` emptying the bucket: the widest folder a prefix can
    name is still `<prefix>/<namespace>/<name>/`, and another run inside it is skipped."""
    inner_ns = second_namespace(api, s3_server)
    inner = make_run(s3_server, inner_ns, "inner")
    inner["spec"]["adapterStore"].update({"bucket": "tenancy-wide",
                                          "prefix": f"asyncgrpo/{ns}/asyncgrpo"})
    api.create(inner)
    wait_for(lambda: bucket_ready(api, inner_ns, "inner"), what="inner's bucket")
    s3 = s3_server.client()
    inner_key = f"asyncgrpo/{ns}/asyncgrpo/{inner_ns}/inner/adapters/v1/f"
    unrelated = "datasets/prompts.jsonl"
    for k in (inner_key, unrelated):
        s3.put_object(Bucket="tenancy-wide", Key=k, Body=b"1")

    wide = make_run(s3_server, ns, "asyncgrpo")
    wide["spec"]["adapterStore"].update({"bucket": "tenancy-wide", "deletionPolicy": "Delete"})
    api.create(wide)
    wait_for(lambda: api.condition(ns, "asyncgrpo", "BucketReady").get("reason")
             == "FolderContainsAnotherRun", what="refused")
    api.delete("AsyncGRPORun", ns, "asyncgrpo")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "asyncgrpo") is None, what="deleted")
    assert {inner_key, unrelated} <= keys(s3_server, "tenancy-wide")
    api.call("DELETE", f"/api/v1/namespaces/{inner_ns}")


def test_non_utf8_secret_is_a_condition_and_the_run_stays_deletable(api, ns, s3_server):
    api.create({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "binary", "namespace": ns, "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
                "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(b"\xff\xfe").decode(),
                         "AWS_SECRET_ACCESS_KEY": base64.b64encode(b"x").decode()}})
    run = make_run(s3_server, ns, "binary")
    run["spec"]["adapterStore"].update({"credentialsSecret": {"name": "binary"},
                                        "deletionPolicy": "Delete"})
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "binary", "BucketReady"))
                    .get("reason") == "SecretInvalid" and c, what="SecretInvalid")
    assert cond["status"] == "False"
    assert "SecretInvalid" in {e["reason"] for e in api.events(ns, "binary")}
    api.delete("AsyncGRPORun", ns, "binary")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "binary") is None, what="deleted")
    assert "SecretInvalid" in {e["reason"] for e in api.events(ns, "binary")
                               if e["type"] == "Warning"}


class Listener:
    """A TCP listener on loopback that records every byte sent to it and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.received = b""
        self.connections = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn) -> None:
        with conn:
            while chunk := conn.recv(65536):
                with self._lock:
                    self.received += chunk

    def close(self) -> None:
        self.sock.close()


def test_silent_endpoint_cleanup_is_released_by_the_annotation(api, ns, s3_server):
    silent = Listener()
    try:
        run = make_run(s3_server, ns, "stuck")
        run["spec"]["adapterStore"].update({"endpoint": silent.endpoint,
                                            "deletionPolicy": "Delete"})
        api.create(run)
        wait_for(lambda: api.condition(ns, "stuck", "BucketReady").get("reason")
                 == "EndpointUnreachable", timeout=60, what="EndpointUnreachable")
        api.delete("AsyncGRPORun", ns, "stuck")
        # the cleanup Job cannot reach the endpoint: the finalizer holds the run
        wait_for(lambda: api.run(ns, "stuck").get("metadata", {}).get("deletionTimestamp"),
                 what="deleting")
        assert api.get("AsyncGRPORun", ns, "stuck") is not None
        api.merge_patch("AsyncGRPORun", ns, "stuck",
                  {"metadata": {"annotations": {"asyncgrpo.dev/skip-bucket-cleanup": "true"}}})
        wait_for(lambda: api.get("AsyncGRPORun", ns, "stuck") is None, timeout=60,
                 what="deleted after the annotation")
        assert "CleanupSkipped" in {e["reason"] for e in api.events(ns, "stuck")}
    finally:
        silent.close()


@pytest.fixture
def guarded(api, s3_server, crd_installed, peers):
    """An operator of its own: endpoint allowlist = the real S3 server and one silent
    listener, a short cleanup timeout and bucket re-check; on an `own-*` namespace so the
    shared operator never sees its runs. Yields (namespace, silent listener)."""
    from asyncgrpo.controller.embedded import EmbeddedOperator
    from tests.operator.conftest import operator_settings

    ns, silent = api.namespace("own"), Listener()
    api.create(s3_secret(s3_server, ns))
    settings = operator_settings(peers)
    settings.allowed_endpoints = [s3_server.endpoint, silent.endpoint]
    settings.cleanup_timeout_seconds = 5.0
    settings.bucket_recheck_seconds = 2.0
    op = EmbeddedOperator([ns], settings).start()
    yield ns, silent
    # runs go while their operator still runs (it holds their finalizers), then the namespace
    for run in api.list("AsyncGRPORun", ns):
        api.merge_patch("AsyncGRPORun", ns, run["metadata"]["name"], {"metadata": {"annotations": {
            "asyncgrpo.dev/skip-bucket-cleanup": "true"}}})
        api.delete("AsyncGRPORun", ns, run["metadata"]["name"])
    wait_for(lambda: not api.list("AsyncGRPORun", ns), timeout=60, what="runs gone")
    api.call("DELETE", f"/api/v1/namespaces/{ns}")
    op.stop()
    silent.close()


def test_listener_never_receives_a_credential(api, guarded, s3_server, bucket_jobs):
    """The operator never talks to a run's endpoint: setup and cleanup are Jobs in the run's
    namespace, with the run's Secret by reference. With no kubelet for the namespace (held),
    an allowed listener as the endpoint sees no connection at all through setup and deletion:
    anything it got would have come from the operator."""
    ns, allowed = guarded
    listener = Listener()
    try:
        # aimed at an endpoint the admin did not allow: refused, no Job at all
        run = make_run(s3_server, ns, "exfil")
        run["spec"]["adapterStore"].update({"endpoint": listener.endpoint,
                                            "deletionPolicy": "Delete"})
        api.create(run)
        wait_for(lambda: api.condition(ns, "exfil", "BucketReady").get("reason")
                 == "EndpointNotAllowed", what="EndpointNotAllowed")
        assert api.get("Job", ns, "exfil-bucket-setup") is None

        # without a Secret: the Job runs as the run's ServiceAccount, never the operator's
        # identity; this machine gives that account none
        bare = make_run(s3_server, ns, "bare")
        bare["spec"]["adapterStore"].pop("credentialsSecret")
        bare["spec"]["adapterStore"]["deletionPolicy"] = "Delete"
        api.create(bare)
        cond = wait_for(lambda: (c := api.condition(ns, "bare", "BucketReady"))
                        .get("reason") == "NoCredentials" and c, what="NoCredentials")
        assert cond["status"] == "False"

        bucket_jobs.hold(ns)
        signer = make_run(s3_server, ns, "signer")
        signer["spec"]["adapterStore"].update({"endpoint": allowed.endpoint,
                                               "deletionPolicy": "Delete"})
        api.create(signer)
        job = wait_for(lambda: api.get("Job", ns, "signer-bucket-setup"), what="setup Job")
        pod = job["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "signer-workload"
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == \
            "s3-credentials"
        for name in ("exfil", "bare", "signer"):
            api.delete("AsyncGRPORun", ns, name)
        wait_for(lambda: api.get("Job", ns, "signer-bucket-cleanup"), what="cleanup Job")
        api.merge_patch("AsyncGRPORun", ns, "signer",
                  {"metadata": {"annotations": {"asyncgrpo.dev/skip-bucket-cleanup": "true"}}})
        for name in ("exfil", "bare", "signer"):
            wait_for(lambda n=name: api.get("AsyncGRPORun", ns, n) is None, what="deleted")
        assert (listener.connections, allowed.connections) == (0, 0)
        assert listener.received == allowed.received == b""
        assert "NoCredentials" in {e["reason"] for e in api.events(ns, "bare")
                                   if e["type"] == "Warning"}
        # the cleanup Job does not outlive the deletion
        wait_for(lambda: api.get("Job", ns, "signer-bucket-cleanup") is None,
                 what="cleanup Job removed")
    finally:
        listener.close()


def test_deleted_secret_turns_bucket_ready_false(api, guarded, s3_server):
    ns = guarded[0]
    run = make_run(s3_server, ns, "revoked")
    run["spec"]["adapterStore"]["bucket"] = "tenancy-revoked"
    api.create(run)
    wait_for(lambda: bucket_ready(api, ns, "revoked"), what="bucket")
    api.delete("Secret", ns, "s3-credentials")
    wait_for(lambda: api.condition(ns, "revoked", "BucketReady").get("reason")
             == "SecretNotFound", what="SecretNotFound after the re-check")


def test_cleanup_gives_up_after_the_timeout_with_a_warning(api, guarded, s3_server):
    ns, silent = guarded
    run = make_run(s3_server, ns, "gone")
    run["spec"]["adapterStore"].update({"endpoint": silent.endpoint, "deletionPolicy": "Delete"})
    api.create(run)
    wait_for(lambda: api.condition(ns, "gone", "BucketReady").get("reason")
             == "EndpointUnreachable", timeout=60, what="EndpointUnreachable")
    api.delete("AsyncGRPORun", ns, "gone")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "gone") is None, timeout=90, what="deleted")
    assert "CleanupAbandoned" in {e["reason"] for e in api.events(ns, "gone")
                                  if e["type"] == "Warning"}


def test_longest_name_gets_its_trainer_pod(api, ns, s3_server):
    """44 characters: the StatefulSet's controller-revision-hash label ("<name>-trainer-" +
    10) is exactly 63; the controller-manager creates the pod (45 is refused at apply)."""
    from tests.operator.test_cluster_lifecycle import bring_up

    name = "l" * 44
    api.create(make_run(s3_server, ns, name))
    bring_up(api, ns, name)
    pod = api.get("Pod", ns, f"{name}-trainer-0")
    assert len(pod["metadata"]["labels"]["controller-revision-hash"]) <= 63


def test_large_spec_is_handled_and_stays_deletable(api, ns, s3_server):
    run = make_run(s3_server, ns, "large")
    # a user reward's args are free-form (a built-in's are checked against its parameters)
    run["spec"]["reward"]["functions"] = [{"name": "python",
                                           "module": "asyncgrpo.local.demo:digit_fraction",
                                           "args": {"notes": "x" * 300_000}}]
    api.create(run)
    wait_for(lambda: api.get("Deployment", ns, "large-vllm"), what="children")
    annotations = api.run(ns, "large")["metadata"].get("annotations") or {}
    assert sum(len(v) for v in annotations.values()) < 4096   # no copy of the spec
    api.merge_patch("AsyncGRPORun", ns, "large", {"spec": {"trainer": {"learningRate": 2e-5}}})
    wait_for(lambda: api.run(ns, "large")["status"]["observedGeneration"] == 2,
             what="the update handled")
    api.delete("AsyncGRPORun", ns, "large")
    wait_for(lambda: api.get("AsyncGRPORun", ns, "large") is None, what="deleted")


def test_over_cap_pool_creates_nothing(api, ns, s3_server):
    run = make_run(s3_server, ns, "flood")
    run["spec"]["sandboxes"] = {"minWarm": 100000, "max": 100000, "hardCap": 100000}
    api.create(run)
    cond = wait_for(lambda: (c := api.condition(ns, "flood", "Degraded")).get("reason")
                    == "OverCap" and c, what="OverCap")
    assert "spec.sandboxes.hardCap" in cond["message"]
    assert api.list("Pod", ns) == [] and api.get("Deployment", ns, "flood-vllm") is None


def test_changing_the_model_is_reported_and_not_rolled_out(api, ns, s3_server):
    api.create(make_run(s3_server, ns, "fixed"))
    first = wait_for(lambda: api.get("Deployment", ns, "fixed-vllm"), what="vLLM")
    wait_for(lambda: api.run(ns, "fixed")["status"].get("checkpointIdentity"), what="identity")
    wait_for(lambda: api.condition(ns, "fixed", "BucketReady").get("status") == "True",
             what="bucket")
    api.merge_patch("AsyncGRPORun", ns, "fixed", {"spec": {"model": {"name": "other/model"}}})
    cond = wait_for(lambda: (c := api.condition(ns, "fixed", "Degraded")).get("reason")
                    == "ImmutableFieldChanged" and c, what="ImmutableFieldChanged")
    assert "spec.model.name" in cond["message"]
    assert "ImmutableFieldChanged" in {e["reason"] for e in api.events(ns, "fixed")}
    # the workloads keep the old model; what was observed of them is still reported
    vllm = api.get("Deployment", ns, "fixed-vllm")
    assert vllm["spec"]["template"] == first["spec"]["template"]
    assert api.condition(ns, "fixed", "BucketReady").get("status") == "True"
    # changing it back is accepted again
    original = make_run(s3_server, ns, "fixed")["spec"]["model"]["name"]
    api.merge_patch("AsyncGRPORun", ns, "fixed", {"spec": {"model": {"name": original}}})
    wait_for(lambda: api.condition(ns, "fixed", "Degraded").get("reason")
             != "ImmutableFieldChanged", what="accepted again")
