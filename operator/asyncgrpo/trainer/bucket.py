"""The run's bucket for what is not an adapter: prompt data and checkpoints.

Adapters go through `asyncgrpo.adapters.store.AdapterStore` (its manifest protocol is
what vLLM's resolver reads). Checkpoints use the same idea with their own key space:
files first, a `COMPLETE` marker last, so a trainer killed mid-upload leaves a checkpoint
nobody resumes from.

Every call retries transient failures (connection refused, timeouts, 5xx, throttling) with
exponential backoff and jitter, so an S3 outage stalls the trainer rather than losing a
step; `on_retry` lets the caller export the outage (metric, status reason). Messages name
`s3://bucket/key`, never the endpoint or credentials.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class BucketUnavailable(RuntimeError):
    """The bucket stayed unreachable for every attempt."""


def is_transient(err: BaseException) -> bool:
    """Connection-level failures and server-side errors: worth another try."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError,
                            ConnectionClosedError, BotoConnectionError, ConnectionError,
                            TimeoutError)):
            return True
        if isinstance(err, ClientError):
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = err.response.get("Error", {}).get("Code", "")
            return status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout",
                                             "InternalError", "ServiceUnavailable")
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def retry(what: str, fn: Callable[[], _T], *, attempts: int | None = 8, backoff_s: float = 1.0,
          max_backoff_s: float = 30.0, transient: Callable[[BaseException], bool] = is_transient,
          on_retry: Callable[[str, BaseException], None] | None = None) -> _T:
    """fn() with exponential backoff on transient errors; the last one becomes BucketUnavailable.

    `attempts=None` retries until it succeeds: for work that must not be lost (a publish),
    where stalling through an outage beats failing the step; `on_retry` reports each failure.
    """
    delay = backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as err:
            if not transient(err):
                raise
            if on_retry is not None:
                on_retry(what, err)
            if attempts is not None and attempt >= attempts:
                raise BucketUnavailable(f"{what}: unreachable after {attempts} attempts "
                                        f"({type(err).__name__})") from None
            sleep = min(delay, max_backoff_s) * (0.5 + random.random() / 2)
            log.warning("%s failed (%s); retry %d%s in %.1fs", what, type(err).__name__,
                        attempt, "" if attempts is None else f"/{attempts - 1}", sleep)
            time.sleep(sleep)
            delay *= 2


def s3_client(endpoint: str | None, region: str | None):
    """A boto3 client with botocore's own retries off (ours bound the wait)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint or None, region_name=region or None,
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5,
                      read_timeout=60, s3={"addressing_style": "path"}),
    )


class Bucket:
    """Keys under one root (the run folder, `asyncgrpo.api.layout.run_folder`), with retries."""

    def __init__(self, bucket: str, root: str, client: Any, *, attempts: int = 8,
                 backoff_s: float = 1.0, on_retry: Callable[[str, BaseException], None] | None = None):
        self.bucket = bucket
        self.root = root.strip("/")
        self.client = client
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.on_retry = on_retry

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.root, *parts) if p and p.strip("/"))

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _retry(self, what: str, key: str, fn: Callable[[], _T]) -> _T:
        return retry(f"{what} {self.url(key)}", fn, attempts=self.attempts,
                     backoff_s=self.backoff_s, on_retry=self.on_retry)

    def list(self, prefix: str) -> dict[str, int]:
        """key -> size under prefix (absolute keys)."""

        def run() -> dict[str, int]:
            out, token = {}, None
            while True:
                kw = {"Bucket": self.bucket, "Prefix": prefix}
                if token:
                    kw["ContinuationToken"] = token
                resp = self.client.list_objects_v2(**kw)
                out.update({o["Key"]: int(o["Size"]) for o in resp.get("Contents", [])})
                if not resp.get("IsTruncated"):
                    return out
                token = resp["NextContinuationToken"]

        return self._retry("list", prefix, run)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        def run() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=key)
                return True
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise

        return self._retry("head", key, run)

    def upload(self, path: Path, key: str) -> None:
        self._retry("put", key, lambda: self.client.upload_file(str(path), self.bucket, key))

    def put_bytes(self, key: str, body: bytes) -> None:
        self._retry("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=key,
                                                               Body=body))

    def download(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._retry("get", key, lambda: self.client.download_file(self.bucket, key, str(path)))

    def get_bytes(self, key: str) -> bytes:
        return self._retry("get", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=key)["Body"].read())

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            self._retry("delete", batch[0], lambda b=batch: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in b], "Quiet": True}))
