"""The run's S3 bucket: created if missing, and emptied of the run's objects on deletion when
the deletion policy says Delete.

Every failure becomes a `BucketError` with a reason a user can act on (SecretNotFound,
BadCredentials, BucketNotFound...) and a message that names the bucket and the S3 error
code, never the credentials. Only the run's own prefix (`<prefix>/<run>/`) is ever deleted:
a bucket is often shared by many runs.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from asyncgrpo.api.v1alpha1 import AdapterStoreSpec

_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                    "ExpiredToken", "AuthorizationHeaderMalformed"}


class BucketError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str

    def __repr__(self) -> str:  # never print a secret
        return "Credentials(<redacted>)"


def credentials_from_secret(secret: dict[str, Any] | None, store: AdapterStoreSpec) -> Credentials:
    """Decode the referenced Secret's keys; `secret` is None when it does not exist."""
    ref = store.credentials_secret
    assert ref is not None
    if secret is None:
        raise BucketError("SecretNotFound", f"Secret {ref.name!r} (spec.adapterStore."
                          "credentialsSecret) does not exist in the run's namespace")
    data = secret.get("data") or {}
    values = {}
    for key in (ref.access_key_id_key, ref.secret_access_key_key):
        if key not in data:
            raise BucketError("SecretKeyMissing", f"Secret {ref.name!r} has no key {key!r}")
        values[key] = base64.b64decode(data[key]).decode()
    return Credentials(values[ref.access_key_id_key], values[ref.secret_access_key_key])


def client(store: AdapterStoreSpec, creds: Credentials | None, timeout: float = 10.0):
    import boto3
    from botocore.config import Config

    kw: dict[str, Any] = {"region_name": store.region,
                          "config": Config(connect_timeout=timeout, read_timeout=timeout,
                                           retries={"max_attempts": 2})}
    if store.endpoint:
        kw["endpoint_url"] = store.endpoint
    if creds is not None:
        kw["aws_access_key_id"] = creds.access_key_id
        kw["aws_secret_access_key"] = creds.secret_access_key
    return boto3.client("s3", **kw)


def _classify(err: Exception, store: AdapterStoreSpec, action: str) -> BucketError:
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", "Unknown"))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _BAD_CREDENTIALS:
            return BucketError("BadCredentials", f"{action} bucket {store.bucket!r}: the "
                               f"credentials were refused ({code})")
        if code in ("AccessDenied", "403") or status == 403:
            return BucketError("AccessDenied", f"{action} bucket {store.bucket!r}: access "
                               "denied; grant the credentials s3:ListBucket, s3:GetObject, "
                               "s3:PutObject and s3:DeleteObject on it")
        if code in ("NoSuchBucket", "404") or status == 404:
            return BucketError("BucketNotFound", f"bucket {store.bucket!r} does not exist and "
                               "spec.adapterStore.createBucket is false")
        return BucketError("BucketError", f"{action} bucket {store.bucket!r}: S3 error {code}")
    if isinstance(err, NoCredentialsError):
        return BucketError("NoCredentials", "no S3 credentials: set spec.adapterStore."
                           "credentialsSecret or give the operator an ambient identity")
    if isinstance(err, EndpointConnectionError):
        return BucketError("EndpointUnreachable", f"{action} bucket {store.bucket!r}: the S3 "
                           "endpoint (spec.adapterStore.endpoint) is unreachable")
    return BucketError("BucketError", f"{action} bucket {store.bucket!r}: {type(err).__name__}")


def ensure_bucket(store: AdapterStoreSpec, creds: Credentials | None) -> bool:
    """Make sure the bucket exists; True if this call created it."""
    s3 = client(store, creds)
    try:
        s3.head_bucket(Bucket=store.bucket)
        return False
    except (BotoCoreError, ClientError) as err:
        missing = _classify(err, store, "checking")
        if missing.reason != "BucketNotFound" or not store.create_bucket:
            raise missing from None
    try:
        kw: dict[str, Any] = {"Bucket": store.bucket}
        if store.region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": store.region}
        s3.create_bucket(**kw)
        return True
    except (BotoCoreError, ClientError) as err:
        code = getattr(err, "response", {}).get("Error", {}).get("Code")
        if code in ("BucketAlreadyOwnedByYou",):
            return False
        raise _classify(err, store, "creating") from None


def run_prefix(store: AdapterStoreSpec, run_name: str) -> str:
    prefix = store.prefix.strip("/")
    return f"{prefix}/{run_name}/" if prefix else f"{run_name}/"


def delete_run_objects(store: AdapterStoreSpec, creds: Credentials | None, run_name: str) -> int:
    """Delete every object under the run's prefix; returns how many. Idempotent."""
    s3 = client(store, creds)
    deleted = 0
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=store.bucket, Prefix=run_prefix(store, run_name))
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=store.bucket, Delete={"Objects": keys, "Quiet": True})
                deleted += len(keys)
    except (BotoCoreError, ClientError) as err:
        e = _classify(err, store, "emptying")
        if e.reason == "BucketNotFound":
            return deleted  # nothing left to delete
        raise e from None
    return deleted
