"""The S3 part of `asyncgrpo.storage`: the client, retries, keys under one root, complete
versions. Every S3 request of the project goes through here (tests/test_layers.py).

* `client`: a boto3 client with botocore's own retries off, so `Bucket`'s attempts bound
  how long a caller can be held, and path-style addressing (MinIO, Ceph, moto).
* `retry`: exponential backoff with jitter on transient errors (connection refused,
  timeouts, 5xx, throttling); the last failure becomes `gave_up` (StoreUnavailable by
  default; a caller retrying something else names its own type).
* `Bucket`: keys under one root (`asyncgrpo.api.layout.run_folder`, or "" for the whole
  bucket), every call retried; a permanent S3 error becomes StoreRequestError. Every
  StoreError carries the S3 error code, HTTP status and the root cause's type
  (`code`, `status`, `cause`) for callers that map them to reasons of their own (the
  bucket Job, `asyncgrpo.bucket`). Messages name `s3://bucket/key` and the S3 error code,
  never the endpoint or credentials: they travel into logs, status conditions and, through
  the resolver, toward clients.
* `CompleteVersions`: numbered sub-folders each marked complete by one object written last
  (an adapter's `manifest.json`, a checkpoint's `COMPLETE`): a writer killed mid-upload
  leaves a partial version nobody reads; deletion removes the marker first, so a version
  disappears as a whole for readers.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: S3 error codes that say "try again" whatever the HTTP status
_TRANSIENT_CODES = ("SlowDown", "Throttling", "RequestTimeout", "InternalError",
                    "ServiceUnavailable")
#: S3 error codes that say "there is no such key" (the one list: `is_missing`)
MISSING_CODES = ("404", "NoSuchKey", "NotFound")


class StoreError(Exception):
    """Base of every error the bucket layer raises.

    `code`, `status` and `cause`: the S3 error code, the HTTP status and the type name of
    the root cause of the failure that became this error ("" / 0 when not known)."""

    code: str = ""
    status: int = 0
    cause: str = ""

    @classmethod
    def of(cls, message: str, err: BaseException | None) -> StoreError:
        """An error of this type about `err` (its code, status and cause recorded)."""
        out = cls(message)
        if err is not None:
            out.code, out.status = error_code(err)[0], http_status(err)
            out.cause = type(root_cause(err)).__name__
        return out


class StoreUnavailable(StoreError):
    """The bucket could not be reached (connection, timeout, 5xx) after all retries.

    Transient by nature: the caller keeps its state and tries again later.
    """


class StoreRequestError(StoreError):
    """S3 answered with a permanent error (missing bucket, access denied, bad request)."""


def root_cause(err: BaseException) -> BaseException:
    """boto3's transfer manager wraps S3 errors (S3UploadFailedError): the botocore error
    underneath, or the innermost cause."""
    seen = 0
    while seen < 8:
        nxt = err.__cause__ or err.__context__
        if nxt is None or type(err).__module__.startswith("botocore"):
            return err
        err, seen = nxt, seen + 1
    return err


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

    err = root_cause(err)
    if isinstance(err, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError,
                        ConnectionClosedError, BotoConnectionError, ConnectionError,
                        TimeoutError)):
        return True
    if isinstance(err, ClientError):
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or error_code(err)[0] in _TRANSIENT_CODES
    return False


def error_code(err: BaseException) -> tuple[str, str]:
    """(S3 error code, message) of a ClientError under err, or ("", "")."""
    from botocore.exceptions import ClientError

    err = root_cause(err)
    if isinstance(err, ClientError):
        e = err.response.get("Error", {})
        return str(e.get("Code", "")), str(e.get("Message", ""))
    return "", ""


def http_status(err: BaseException) -> int:
    """The HTTP status of a ClientError under err, or 0."""
    from botocore.exceptions import ClientError

    err = root_cause(err)
    if isinstance(err, ClientError):
        return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


def is_missing(err: BaseException) -> bool:
    """Whether S3 said there is no such key (or bucket, for a HEAD)."""
    code = err.code if isinstance(err, StoreError) else error_code(err)[0]
    return code in MISSING_CODES


def is_boto(err: BaseException) -> bool:
    """Whether err is (or wraps) an error of boto3 or botocore."""
    return type(root_cause(err)).__module__.startswith(("botocore", "boto3"))


def retry(what: str, fn: Callable[[], _T], *, attempts: int | None = 8, backoff_s: float = 1.0,
          max_backoff_s: float = 30.0, transient: Callable[[BaseException], bool] = is_transient,
          on_retry: Callable[[str, BaseException], None] | None = None,
          gave_up: type[Exception] = StoreUnavailable) -> _T:
    """fn() with exponential backoff on transient errors; the last one becomes `gave_up`.

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
                cause = error_code(err)[0] or type(root_cause(err)).__name__
                message = f"{what}: unreachable after {attempts} attempts ({cause})"
                if issubclass(gave_up, StoreError):
                    raise gave_up.of(message, err) from None
                raise gave_up(message) from None
            sleep = min(delay, max_backoff_s) * (0.5 + random.random() / 2)
            log.warning("%s failed (%s); retry %d%s in %.1fs", what, type(err).__name__,
                        attempt, "" if attempts is None else f"/{attempts - 1}", sleep)
            time.sleep(sleep)
            delay *= 2


def client(endpoint: str | None, region: str | None, *, connect_timeout_s: float = 5.0,
           read_timeout_s: float = 60.0, keys: tuple[str, str] | None = None):
    """A boto3 S3 client with botocore's own retries off (ours bound the wait). `keys`
    (access key id, secret) sign its requests; without them boto3's own chain does (the
    environment, then the identity of the pod it runs in)."""
    import boto3
    from botocore.config import Config

    signed = {} if keys is None else {"aws_access_key_id": keys[0],
                                      "aws_secret_access_key": keys[1]}
    return boto3.session.Session(region_name=region or None, **signed).client(
        "s3", endpoint_url=endpoint or None, region_name=region or None,
        # a pool for concurrent GETs (a version's rank files) and boto3's multipart threads
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"},
                      max_pool_connections=32,
                      connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                      s3={"addressing_style": "path"}),
    )


def _unless_missing(fn: Callable[[], _T], missing: _T) -> Callable[[], _T]:
    """fn, answering `missing` instead of raising when S3 says there is no such key."""

    def run() -> _T:
        try:
            return fn()
        except Exception as err:
            if is_missing(err):
                return missing
            raise

    return run


class Bucket:
    """Keys under one root (a run's folder, or "" for the whole bucket), every call retried."""

    def __init__(self, bucket: str, root: str, client: Any, *, attempts: int | None = 8,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 on_retry: Callable[[str, BaseException], None] | None = None):
        if not bucket:
            raise ValueError("bucket must be set")
        self.bucket = bucket
        self.root = root.strip("/")
        self.client = client
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_retry = on_retry

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.root, *parts) if p and p.strip("/"))

    def url(self, key: str = "") -> str:
        """``s3://bucket/key`` for messages: names the object, not the server."""
        return f"s3://{self.bucket}/{key}"

    def call(self, what: str, key: str, fn: Callable[[], _T]) -> _T:
        """fn() retried; StoreUnavailable when the bucket stays unreachable, StoreRequestError
        for a permanent S3 error; other errors (a local file, a bug) pass through."""
        where = f"{what} {self.url(key)}"
        try:
            return retry(where, fn, attempts=self.attempts, backoff_s=self.backoff_s,
                         max_backoff_s=self.max_backoff_s, on_retry=self.on_retry)
        except StoreError:
            raise
        except Exception as err:
            code, msg = error_code(err)
            if code:
                raise StoreRequestError.of(f"{where} failed: {code}: {msg}", err) from None
            if is_boto(err):
                raise StoreRequestError.of(f"{where} failed: {type(root_cause(err)).__name__}",
                                           err) from None
            raise

    def list(self, prefix: str) -> dict[str, int]:
        """key -> size of every key under prefix (absolute keys, paginated)."""
        return {o["Key"]: int(o["Size"]) for o in self.listing(prefix)}

    def listing(self, prefix: str, limit: int | None = None) -> list[dict[str, Any]]:
        """S3's entries (Key, Size, LastModified, ...) of the keys under prefix, in key
        order; every page, or the first `limit` keys (one request)."""

        def run() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            token = None
            while True:
                kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
                if token:
                    kw["ContinuationToken"] = token
                if limit is not None:
                    kw["MaxKeys"] = limit
                resp = self.client.list_objects_v2(**kw)
                out.extend(resp.get("Contents", []))
                if limit is not None or not resp.get("IsTruncated"):
                    return out
                token = resp["NextContinuationToken"]

        return self.call("list", prefix, run)

    def probe(self) -> None:
        """HEAD of the bucket itself: raises (StoreRequestError with code "404" when there is
        no such bucket)."""
        self.call("head", "", lambda: self.client.head_bucket(Bucket=self.bucket))

    def create(self, region: str | None) -> None:
        """Create the bucket (in `region`; us-east-1 takes no location constraint)."""
        kw: dict[str, Any] = {"Bucket": self.bucket}
        if region and region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": region}
        self.call("create", "", lambda: self.client.create_bucket(**kw))

    def exists(self, key: str) -> bool:
        return self.call("head", key, _unless_missing(
            lambda: self.client.head_object(Bucket=self.bucket, Key=key) and True, False))

    def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; with `max_bytes`, only its first ones (one ranged GET)."""
        extra = {} if max_bytes is None else {"Range": f"bytes=0-{max_bytes - 1}"}
        return self.call("get", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=key, **extra)["Body"].read())

    def get_or_none(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is no such key."""
        return self.call("get", key, _unless_missing(lambda: self.client.get_object(
            Bucket=self.bucket, Key=key)["Body"].read(), None))

    def get_tagged(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        """(the object's bytes, at most `limit` of them, and its ETag), or None when there is
        no such key."""

        def run() -> tuple[bytes, str]:
            got = self.client.get_object(Bucket=self.bucket, Key=key)
            body = got["Body"].read() if limit is None else got["Body"].read(limit)
            return body, str(got.get("ETag") or "")

        return self.call("get", key, _unless_missing(run, None))

    def put_bytes(self, key: str, body: bytes, content_type: str | None = None, *,
                  if_none_match: str | None = None, if_match: str | None = None) -> None:
        """One PUT; `if_none_match="*"` (only where no object is) or `if_match=<ETag>` make
        it conditional (a lost race is StoreRequestError with code PreconditionFailed)."""
        extra = {"ContentType": content_type} if content_type else {}
        if if_none_match is not None:
            extra["IfNoneMatch"] = if_none_match
        if if_match is not None:
            extra["IfMatch"] = if_match
        self.call("put", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=key, Body=body, **extra))

    def upload(self, path: Path, key: str) -> None:
        """A file through boto3's transfer manager (multipart when large)."""
        self.call("put", key, lambda: self.client.upload_file(str(path), self.bucket, key))

    def download(self, key: str, path: Path) -> bool:
        """The object into path; False when there is no such key."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return self.call("get", key, _unless_missing(
            lambda: self.client.download_file(self.bucket, key, str(path)) or True, False))

    def delete_one(self, key: str) -> None:
        """One DELETE (no error for a missing key)."""
        self.call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def delete(self, keys: list[str]) -> None:
        for batch in _chunks(keys, 1000):
            self.call("delete", batch[0], lambda b=batch: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in b], "Quiet": True}))


def _chunks(items: list[str], n: int) -> Iterable[list[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class CompleteVersions:
    """Numbered sub-folders of `<bucket root>/<folder>/`, each complete once its marker is in.

    `pattern` matches a sub-folder's name and captures its number; `dir_name(n)` is the
    inverse. Readers see only complete versions; partial ones are a writer in flight or
    one that died, and are cleaned up once older than every version kept.
    """

    def __init__(self, bucket: Bucket, folder: str, marker: str, pattern: str,
                 dir_name: Callable[[int], str]):
        self.bucket = bucket
        self.marker = marker
        self._pattern = re.compile(pattern)
        self._dir_name = dir_name
        self.root = bucket.key(folder) + "/"

    def prefix(self, n: int) -> str:
        """Key prefix of version n, ending in '/'."""
        return f"{self.root}{self._dir_name(n)}/"

    def scan(self) -> tuple[set[int], set[int]]:
        """(complete versions, versions with any object at all)."""
        complete, seen = set(), set()
        for key in self.bucket.list(self.root):
            parts = key[len(self.root):].split("/", 1)
            m = self._pattern.match(parts[0])
            if not m or len(parts) < 2:
                continue
            n = int(m.group(1))
            seen.add(n)
            if parts[1] == self.marker:
                complete.add(n)
        return complete, seen

    def complete(self) -> list[int]:
        """Complete versions, oldest first."""
        return sorted(self.scan()[0])

    def latest(self) -> int | None:
        complete = self.complete()
        return complete[-1] if complete else None

    def has_any(self, n: int) -> bool:
        """Whether any object of version n exists (a partial one included)."""
        return bool(self.bucket.list(self.prefix(n)))

    def delete(self, n: int) -> None:
        """Remove one version, marker first so it vanishes as a whole for readers."""
        prefix = self.prefix(n)
        keys = sorted(self.bucket.list(prefix), key=lambda k: k != prefix + self.marker)
        if keys and keys[0] == prefix + self.marker:
            self.bucket.delete(keys[:1])
            keys = keys[1:]
        if keys:
            self.bucket.delete(keys)

    def prune(self, keep: int) -> tuple[list[int], list[int]]:
        """Keep the newest `keep` complete versions; delete every older version, partial or
        not (newer partial ones may be in flight). Returns (deleted, kept)."""
        complete, seen = self.scan()
        kept = sorted(complete)[-max(1, keep):]
        if not kept:
            return [], []
        doomed = sorted(n for n in seen if n < kept[0])
        for n in doomed:
            self.delete(n)
        return doomed, kept
