"""Bucket setup and cleanup as Jobs in the run's namespace: the pure builders, the reading of
a Job's outcome, and one reconcile driven by Job summaries (writes go to a recorder). The
operator never talks to the bucket: a listener as the endpoint never sees a connection."""

from __future__ import annotations

import pytest

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import bucketjob, network, reconcile
from asyncgrpo.controller.observe import Child, summarize
from asyncgrpo.controller.runtime import Runtime, Settings
from tests.operator.helpers import make_run
from tests.operator.test_reconcile_stale import Recorder

JS = bucketjob.JobSettings(image="reg/operator:1", pull_policy="Never",
                           allowed_endpoints=("http://s3:9000",))


class S3:
    endpoint = "http://minio.storage:9000"


def run_of(**store) -> AsyncGRPORun:
    body = make_run(S3, "team-a", "math")
    body["spec"]["adapterStore"].update(store)
    return AsyncGRPORun.model_validate(body)


def env_of(job) -> dict:
    return {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_setup_job_runs_as_the_runs_account_with_its_secret_by_reference():
    job = bucketjob.build_job(run_of(), bucketjob.SETUP, "uid-1", JS)
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert job["kind"] == "Job" and job["metadata"]["name"] == "math-bucket-setup"
    assert job["metadata"]["namespace"] == "team-a"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] > 0
    assert pod["serviceAccountName"] == "math-workload"
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert (c["image"], c["imagePullPolicy"]) == ("reg/operator:1", "Never")
    assert c["command"] == ["asyncgrpo", "bucket", "setup"]
    assert c["terminationMessagePath"] == "/dev/termination-log"
    env = env_of(job)
    # the keys come from the kubelet, never as values the operator read
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[key]
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"
    assert env[wire.RUN_UID_ENV]["value"] == "uid-1"
    assert env[wire.ALLOWED_ENDPOINTS_ENV]["value"] == "http://s3:9000"
    assert env["ASYNCGRPO_ADAPTER_NAMESPACE"]["value"] == "team-a"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["asyncgrpo.dev/run"] == "math"
    assert labels["app.kubernetes.io/component"] == bucketjob.SETUP
    cleanup = bucketjob.build_job(run_of(), bucketjob.CLEANUP, "uid-1", JS)
    assert cleanup["metadata"]["name"] == "math-bucket-cleanup"
    assert cleanup["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "cleanup"


def test_without_a_secret_the_job_has_only_its_accounts_identity():
    job = bucketjob.build_job(run_of(credentialsSecret=None), bucketjob.SETUP, "u", JS)
    env = env_of(job)
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "math-workload"


def test_the_job_spec_hash_follows_the_store_and_the_uid():
    h = lambda job: job["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"]
    base = h(bucketjob.build_job(run_of(), bucketjob.SETUP, "u", JS))
    assert base == h(bucketjob.build_job(run_of(), bucketjob.SETUP, "u", JS))
    assert base != h(bucketjob.build_job(run_of(), bucketjob.SETUP, "v", JS))
    assert base != h(bucketjob.build_job(run_of(bucket="other"), bucketjob.SETUP, "u", JS))


def test_longest_name_fits_the_job_name_label():
    body = make_run(S3, "ns", "l" * 44)
    run = AsyncGRPORun.model_validate(body)
    assert len(bucketjob.job_name(run, bucketjob.CLEANUP)) <= 63


def test_bucket_policy_opens_the_endpoint_port_but_not_metadata():
    pol = network.build_bucket_policy(run_of())
    spec = pol["spec"]
    assert spec["ingress"] == [] and set(spec["policyTypes"]) == {"Ingress", "Egress"}
    expr = spec["podSelector"]["matchExpressions"][0]
    assert set(expr["values"]) == {bucketjob.SETUP, bucketjob.CLEANUP}
    s3_rule = spec["egress"][1]
    assert s3_rule["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert "169.254.0.0/16" in s3_rule["to"][0]["ipBlock"]["except"]
    assert network.build_bucket_policy(run_of(endpoint=None))["spec"]["egress"][1]["ports"] \
        == [{"protocol": "TCP", "port": 443}]
    # the pod's cloud identity may need the metadata server: open
    assert network.build_bucket_policy(run_of(credentialsSecret=None))["spec"]["egress"] == [{}]
    assert pol in network.build_policies(run_of())


def job(phase="Running", uid="j1", hash_="h", reason="", message="", run="math") -> Child:
    return Child(kind="Job", name=f"{run}-bucket-setup", component=bucketjob.SETUP, hash=hash_,
                 phase=phase, uid=uid, problem=reason, problem_message=message, owner_uid="u1")


def pod(owner="j1", message="", problem="", problem_message="") -> Child:
    return Child(kind="Pod", name="math-bucket-setup-x", component=bucketjob.SETUP, hash=None,
                 owner_uid=owner, termination_message=message, problem=problem,
                 problem_message=problem_message)


def test_outcome_of_a_job_from_its_own_pods_message():
    assert bucketjob.outcome(job("Complete"), [pod(message="claimed s3://b/f/")]).state \
        == "succeeded"
    failed = bucketjob.outcome(job("Failed"), [pod(message="FolderInsideAnotherRun: s3://b/x "
                                                           "lies inside p/")])
    assert (failed.state, failed.reason) == ("failed", "FolderInsideAnotherRun")
    assert failed.message == "s3://b/x lies inside p/"
    # a pod of an older Job of the same name is not this Job's
    old = bucketjob.outcome(job("Failed", reason="BackoffLimitExceeded", message="x"),
                            [pod(owner="old", message="BadCredentials: no")])
    assert old.reason == "BackoffLimitExceeded"
    deadline = bucketjob.outcome(job("Failed", reason="DeadlineExceeded", message="slow"), [])
    assert deadline.reason == "DeadlineExceeded"
    missing = bucketjob.outcome(job(), [pod(problem="CreateContainerConfigError",
                                            problem_message='secret "s3" not found')])
    assert (missing.state, missing.reason) == ("failed", "SecretNotFound")
    key = bucketjob.outcome(job(), [pod(problem="CreateContainerConfigError",
                                        problem_message="couldn't find key K in Secret n/s")])
    assert key.reason == "SecretKeyMissing"
    assert bucketjob.outcome(job(), [pod()]).state == "running"
    assert bucketjob.parse_message("garbage", "D") == ("D", "garbage")


@pytest.mark.parametrize("conditions,phase", [
    ([], "Running"),
    ([{"type": "Complete", "status": "True"}], "Complete"),
    ([{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}], "Failed"),
])
def test_job_summary(conditions, phase):
    c = summarize({"kind": "Job", "metadata": {"name": "j", "uid": "u", "labels": {}},
                   "status": {"conditions": conditions}})
    assert (c.phase, c.uid) == (phase, "u")


# ---------------------------------------------------------------- one reconcile, many ticks


def workloads_ready(name: str) -> list[Child]:
    return [Child(kind="Deployment", name=f"{name}-vllm", component="vllm", hash="x",
                  replicas=1, ready_replicas=1, owner_uid="u1"),
            Child(kind="ServiceAccount", name=f"{name}-workload", component="workload",
                  hash="x", owner_uid="u1")]


def bucket_cond(out) -> dict:
    return next(c for c in out.status["conditions"] if c["type"] == "BucketReady")


def test_reconcile_runs_setup_as_a_job_and_never_touches_the_endpoint():
    from tests.operator.test_cluster_tenancy import Listener

    listener = Listener()
    try:
        rt = Runtime(Settings(gateway_url="http://127.0.0.1:1",
                              trainer_metrics_url="http://127.0.0.1:1",
                              bucket_job_image="reg/op:1"))
        rt.kube = Recorder(None)
        body = make_run(S3, "ns", "quiet")
        body["spec"]["adapterStore"]["endpoint"] = listener.endpoint
        body["metadata"].update({"uid": "u1", "generation": 1})

        first = reconcile.reconcile(rt, body, [])
        assert bucket_cond(first)["reason"] == "Checking" and first.status["phase"] == "Pending"
        kinds = [o["kind"] for verb, o in rt.kube.writes if verb == "create"]
        # the Job comes after the ServiceAccount its pod runs as
        assert kinds.index("ServiceAccount") < kinds.index("Job")
        created = next(o for verb, o in rt.kube.writes if o["kind"] == "Job")
        sts = next(o for verb, o in rt.kube.writes if o["kind"] == "StatefulSet")
        assert sts["spec"]["replicas"] == 0    # the trainer waits for the setup
        h = created["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"]

        # the Job's pod failed: the reason reaches the condition, the Job goes, and a new one
        # waits for the backoff
        rt.kube.writes.clear()
        failed = [*workloads_ready("quiet"), job("Failed", "j1", h, run="quiet"),
                  pod("j1", "EndpointUnreachable: the S3 endpoint did not answer")]
        out = reconcile.reconcile(rt, body, failed)
        assert bucket_cond(out)["status"] == "False"
        assert bucket_cond(out)["reason"] == "EndpointUnreachable"
        assert ("delete", {"kind": "Job", "name": "quiet-bucket-setup"}) in rt.kube.writes
        rt.kube.writes.clear()
        out = reconcile.reconcile(rt, body, workloads_ready("quiet"))
        assert bucket_cond(out)["reason"] == "EndpointUnreachable"
        assert not [o for verb, o in rt.kube.writes if o.get("kind") == "Job"]

        # a later Job succeeds: BucketReady, and the trainer may start
        rt.runs[("ns", "quiet")].bucket.retry_at = 0.0
        ok = [*workloads_ready("quiet"), job("Complete", "j2", h, run="quiet"), pod("j2", "claimed")]
        rt.kube.writes.clear()
        out = reconcile.reconcile(rt, body, ok)
        assert bucket_cond(out)["status"] == "True"
        # the preflight (on by default) starts once the bucket is set up; the trainer waits
        preflight = next(o for verb, o in rt.kube.writes if verb == "create"
                         and o["kind"] == "Job" and o["metadata"]["name"] == "quiet-preflight")
        assert all(o["spec"]["replicas"] == 0 for _, o in rt.kube.writes
                   if o.get("kind") == "StatefulSet")
        passed = Child(kind="Job", name="quiet-preflight", component="preflight", phase="Complete",
                       hash=preflight["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"],
                       uid="p1", owner_uid="u1")
        rt.kube.writes.clear()
        out = reconcile.reconcile(rt, body, [*ok, passed])
        sts = next(o for verb, o in rt.kube.writes if o["kind"] == "StatefulSet")
        assert sts["spec"]["replicas"] == 1
        assert listener.connections == 0 and listener.received == b""
    finally:
        listener.close()


def test_an_endpoint_outside_the_allowlist_gets_no_job():
    rt = Runtime(Settings(gateway_url="http://127.0.0.1:1",
                          trainer_metrics_url="http://127.0.0.1:1",
                          allowed_endpoints=["http://s3.internal:9000"]))
    rt.kube = Recorder(None)
    for endpoint, reason in (("http://evil.example:9000", "EndpointNotAllowed"),):
        body = make_run(S3, "ns", "exfil")
        body["spec"]["adapterStore"]["endpoint"] = endpoint
        body["metadata"].update({"uid": "u1", "generation": 1})
        out = reconcile.reconcile(rt, body, [])
        assert bucket_cond(out)["reason"] == reason
        assert not [o for verb, o in rt.kube.writes if o.get("kind") == "Job"]
    # a metadata address literal is refused without the allowlist too
    rt = Runtime(Settings(gateway_url="http://127.0.0.1:1",
                          trainer_metrics_url="http://127.0.0.1:1"))
    rt.kube = Recorder(None)
    body = make_run(S3, "ns", "imds")
    body["spec"]["adapterStore"]["endpoint"] = "http://169.254.169.254"
    body["metadata"].update({"uid": "u1", "generation": 1})
    out = reconcile.reconcile(rt, body, [])
    assert bucket_cond(out)["reason"] == "EndpointNotAllowed"
    assert not [o for verb, o in rt.kube.writes if o.get("kind") == "Job"]
