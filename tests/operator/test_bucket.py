"""The bucket module against the real S3 server (moto): create, empty a run's prefix only,
and errors that name a reason and never a credential."""

from __future__ import annotations

import base64
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.api.v1alpha1 import AdapterStoreSpec
from asyncgrpo.controller import bucket


def store(s3, **kw):
    return AdapterStoreSpec(endpoint=s3.endpoint, bucket=kw.pop("bucket", f"b-{uuid.uuid4().hex[:8]}"),
                            credentials_secret={"name": "s3"}, **kw)


def creds(s3):
    return bucket.Credentials(s3.access_key, s3.secret_key)


def test_ensure_creates_once(s3_server):
    st = store(s3_server)
    assert bucket.ensure_bucket(st, creds(s3_server)) is True
    assert bucket.ensure_bucket(st, creds(s3_server)) is False


def test_missing_bucket_without_create_is_bucket_not_found(s3_server):
    with pytest.raises(bucket.BucketError) as e:
        bucket.ensure_bucket(store(s3_server, create_bucket=False), creds(s3_server))
    assert e.value.reason == "BucketNotFound"


def test_delete_run_objects_touches_only_that_run(s3_server):
    st = store(s3_server, prefix="team/x")
    bucket.ensure_bucket(st, creds(s3_server))
    s3 = s3_server.client()
    # more than one page (1000 keys) of the run's objects
    keys = [f"team/x/run-a/adapters/v{i}/f" for i in range(1001)] + [
        "team/x/run-ab/adapters/v1/f", "team/x/run-b/adapters/v1/f", "other/run-a/f"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=st.bucket, Key=k, Body=b"1"), keys))
    assert bucket.delete_run_objects(st, creds(s3_server), "run-a") == 1001
    left = {o["Key"] for o in s3.list_objects_v2(Bucket=st.bucket)["Contents"]}
    assert left == set(keys[1001:])
    assert bucket.delete_run_objects(st, creds(s3_server), "run-a") == 0


def test_secret_errors_and_redaction(s3_server):
    st = store(s3_server)
    with pytest.raises(bucket.BucketError) as e:
        bucket.credentials_from_secret(None, st)
    assert e.value.reason == "SecretNotFound"
    with pytest.raises(bucket.BucketError) as e:
        bucket.credentials_from_secret({"data": {"AWS_ACCESS_KEY_ID": "eA=="}}, st)
    assert e.value.reason == "SecretKeyMissing" and "AWS_SECRET_ACCESS_KEY" in e.value.message
    c = bucket.credentials_from_secret({"data": {
        "AWS_ACCESS_KEY_ID": base64.b64encode(b"id").decode(),
        "AWS_SECRET_ACCESS_KEY": base64.b64encode(b"hunter2").decode()}}, st)
    assert c.secret_access_key == "hunter2" and "hunter2" not in repr(c)


def test_unreachable_endpoint_is_named_without_its_url():
    from tests.conftest import free_port

    st = AdapterStoreSpec(endpoint=f"http://127.0.0.1:{free_port()}", bucket="x-bucket")
    with pytest.raises(bucket.BucketError) as e:
        bucket.ensure_bucket(st, bucket.Credentials("a", "b"))
    assert e.value.reason == "EndpointUnreachable" and "127.0.0.1" not in e.value.message
