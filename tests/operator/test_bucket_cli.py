"""`asyncgrpo bucket setup|cleanup` against the real S3 server, run as the bucket Job's
container runs it: a process with only the Job's env, its outcome in the exit status and the
termination message (`<Reason>: <message>`) the operator copies into the run's condition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import bucketjob
from tests.operator.helpers import make_run

MARKER = ".asyncgrpo-owner.json"


def job_env(s3, tmp_path, *, ns="team-a", name="run", uid="uid-1", keys=True, **store):
    """The env of the Job's container (values; the Secret's keys as the kubelet resolves
    them), plus only what a pod has besides."""
    body = make_run(s3, ns, name)
    body["spec"]["adapterStore"].update(store)
    run = AsyncGRPORun.model_validate(body)
    job = bucketjob.build_job(run, bucketjob.SETUP, uid, bucketjob.JobSettings(image="x"))
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
           if "value" in e}
    if keys:
        env |= {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    return env | {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path),
                  "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true",
                  "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                  "ASYNCGRPO_TERMINATION_LOG": str(tmp_path / "termination-log")}


def bucket_cmd(action: str, env: dict) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "bucket", action], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    with open(env["ASYNCGRPO_TERMINATION_LOG"]) as f:
        return proc.returncode, f.read()


@pytest.fixture
def bucket_name():
    return f"cli-{uuid.uuid4().hex[:8]}"


def keys(s3, bucket: str) -> set[str]:
    return {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_setup_claims_the_folder_and_cleanup_empties_only_it(s3_server, tmp_path, bucket_name):
    env = job_env(s3_server, tmp_path, bucket=bucket_name)
    code, msg = bucket_cmd("setup", env)
    assert code == 0 and f"claimed s3://{bucket_name}/asyncgrpo/team-a/run/" in msg
    marker = s3_server.client().get_object(Bucket=bucket_name,
                                           Key=f"asyncgrpo/team-a/run/{MARKER}")
    assert json.loads(marker["Body"].read())["uid"] == "uid-1"
    assert bucket_cmd("setup", env)[0] == 0   # idempotent for the same run
    s3 = s3_server.client()
    for k in ("asyncgrpo/team-a/run/adapters/v1/f", "asyncgrpo/team-b/run/adapters/v1/f"):
        s3.put_object(Bucket=bucket_name, Key=k, Body=b"1")
    code, msg = bucket_cmd("cleanup", env)
    assert (code, msg) == (0, "deleted 2 objects of the run's folder")
    assert keys(s3_server, bucket_name) == {"asyncgrpo/team-b/run/adapters/v1/f"}


def test_another_runs_marker_refuses_cleanup_and_deletes_nothing(s3_server, tmp_path,
                                                                   bucket_name):
    assert bucket_cmd("setup", job_env(s3_server, tmp_path, bucket=bucket_name))[0] == 0
    s3_server.client().put_object(Bucket=bucket_name, Key="asyncgrpo/team-a/run/ckpt",
                                  Body=b"1")
    # a later run of the same name (another uid) in the same namespace
    impostor = job_env(s3_server, tmp_path, bucket=bucket_name, uid="uid-2")
    code, msg = bucket_cmd("cleanup", impostor)
    assert code == 1 and msg.startswith("NotOwner: ") and "nothing deleted" in msg
    code, msg = bucket_cmd("setup", impostor)
    assert code == 1 and msg.startswith("FolderOwnedByAnotherRun: ")
    assert keys(s3_server, bucket_name) == {"asyncgrpo/team-a/run/ckpt",
                                            f"asyncgrpo/team-a/run/{MARKER}"}
    msg = bucketjob.parse_message(msg, "x")
    assert msg[0] == "FolderOwnedByAnotherRun"


def test_endpoint_errors_are_clear_termination_messages(s3_server, tmp_path):
    from tests.conftest import free_port
    from tests.operator.test_cluster_tenancy import Listener

    closed = f"http://127.0.0.1:{free_port()}"
    code, msg = bucket_cmd("setup", job_env(s3_server, tmp_path, endpoint=closed))
    assert code == 1 and msg.startswith("EndpointUnreachable: ")
    assert "127.0.0.1" not in msg and s3_server.secret_key not in msg
    silent = Listener()
    try:
        code, msg = bucket_cmd("setup", job_env(s3_server, tmp_path, endpoint=silent.endpoint))
        assert code == 1 and msg.startswith("EndpointUnreachable: ")
    finally:
        silent.close()
    code, msg = bucket_cmd("setup", job_env(s3_server, tmp_path,
                                            endpoint="http://169.254.169.254"))
    assert code == 1 and msg.startswith("EndpointNotAllowed: ")
    # a name resolving to a metadata address is refused from the pod (the operator does not
    # resolve tenants' names)
    code, msg = bucket_cmd("setup", job_env(s3_server, tmp_path,
                                            endpoint="http://169.254.169.254.nip.io"))
    assert code == 1 and msg.split(":")[0] in ("EndpointNotAllowed", "EndpointUnreachable")


def test_bad_keys_and_no_identity_are_reasons(s3_server, tmp_path, bucket_name):
    env = job_env(s3_server, tmp_path, bucket=bucket_name)
    env["AWS_ACCESS_KEY_ID"] = b"\xff\xfe".decode("utf-8", "surrogateescape")
    code, msg = bucket_cmd("setup", env)
    assert code == 1 and msg.startswith("SecretInvalid: ")
    # no Secret: the pod's own identity, here none (no cloud identity on this machine)
    code, msg = bucket_cmd("setup", job_env(s3_server, tmp_path, bucket=bucket_name,
                                            keys=False, credentialsSecret=None))
    assert code == 1 and msg.startswith("NoCredentials: ")
    code, msg = bucket_cmd("setup", job_env(s3_server, tmp_path, bucket=bucket_name,
                                            createBucket=False))
    assert code == 1 and msg.startswith("BucketNotFound: ")
