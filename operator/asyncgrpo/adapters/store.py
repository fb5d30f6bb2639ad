"""Versioned LoRA adapters in an S3-compatible bucket: the only channel from trainer to vLLM.

Layout (one run; the run folder comes from ``asyncgrpo.api.layout.run_folder``)::

    <prefix>/<namespace>/<run>/adapters/v{N}/adapter_config.json
    <prefix>/<namespace>/<run>/adapters/v{N}/adapter_model.safetensors
    <prefix>/<namespace>/<run>/adapters/v{N}/manifest.json        <- written last

Invariants the readers rely on:

* A version exists for readers only once its ``manifest.json`` exists. The manifest is
  uploaded after every file it lists, so a reader never sees a manifest whose files are still
  in flight; a trainer that dies mid-publish leaves a partial version nobody serves.
* Versions are immutable. vLLM never resolves a name twice and reloads evicted adapters
  from its local copy, so changing ``v{N}`` after publication could only split the replicas'
  view of one name. ``publish`` refuses to overwrite a complete version.
* Deletion removes the manifest first, so a version disappears as a whole for readers.
* Every file is checked against the manifest's sha256 and size before anyone uses it; a
  mismatch is :class:`AdapterCorrupt`, never a half-loaded adapter.

Errors are raised as the exception types below. Their messages name the bucket and key
and the S3 error code, never the endpoint URL or credentials: they travel into logs,
run status conditions and (through the resolver) toward clients.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from asyncgrpo import wire
from asyncgrpo.api.layout import DEFAULT_NAMESPACE, run_folder

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "asyncgrpo.adapter/v1"
#: The served name of version N is f"{DEFAULT_NAME_PREFIX}{N}".
DEFAULT_NAME_PREFIX = "policy-v"
_VERSION_DIR = re.compile(r"^v(\d+)$")
#: Files up to this size go in one PUT/GET; larger ones through boto3's multipart transfer
#: manager (whose thread pool costs more than a small file's whole transfer).
SINGLE_REQUEST_BYTES = 8 * 1024 * 1024
_T = TypeVar("_T")


class AdapterStoreError(Exception):
    """Base of every error this module raises."""


class StoreUnavailable(AdapterStoreError):
    """The bucket could not be reached (connection, timeout, 5xx) after all retries.

    Transient by nature: the caller keeps its state and tries again later.
    """


class StoreRequestError(AdapterStoreError):
    """S3 answered with a permanent error (missing bucket, access denied, bad request)."""


class AdapterNotFound(AdapterStoreError):
    """No object at all exists for this version."""


class AdapterIncomplete(AdapterStoreError):
    """Files exist for this version but no manifest: a publish is in flight or died."""


class AdapterCorrupt(AdapterStoreError):
    """The manifest exists but a file is missing, has the wrong size or the wrong sha256."""


class AdapterVersionExists(AdapterStoreError):
    """A complete version is never overwritten (replicas may already serve it)."""


def adapter_name(version: int, name_prefix: str = DEFAULT_NAME_PREFIX) -> str:
    """The model name a client sends to vLLM for a version, e.g. ``policy-v3``."""
    return f"{name_prefix}{int(version)}"


def parse_adapter_name(name: str, name_prefix: str = DEFAULT_NAME_PREFIX) -> int | None:
    """The version in ``policy-v{N}``, or None for any other name (left to other resolvers)."""
    if not name.startswith(name_prefix):
        return None
    rest = name[len(name_prefix):]
    if not rest.isascii() or not rest.isdigit():
        return None
    return int(rest)


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` holds; written last, so its presence marks a complete version."""

    run: str
    version: int
    step: int
    base_model: str
    rank: int | None
    files: dict[str, FileEntry]
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = MANIFEST_FORMAT

    @property
    def name(self) -> str:
        return adapter_name(self.version)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        doc = {
            "format": self.format,
            "run": self.run,
            "version": self.version,
            "step": self.step,
            "base_model": self.base_model,
            "rank": self.rank,
            "created": self.created,
            "files": {k: {"sha256": v.sha256, "size": v.size} for k, v in sorted(self.files.items())},
            "extra": self.extra,
        }
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> Manifest:
        """Parse and validate; anything unexpected is :class:`AdapterCorrupt`."""
        try:
            doc = json.loads(text)
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            files = parse_files(doc)
            rank = doc.get("rank")
            return cls(
                run=str(doc["run"]),
                version=int(doc["version"]),
                step=int(doc["step"]),
                base_model=str(doc["base_model"]),
                rank=None if rank is None else int(rank),
                files=files,
                created=str(doc.get("created", "")),
                extra=dict(doc.get("extra") or {}),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise AdapterCorrupt(f"{where} is not a valid adapter manifest: {e}") from None


def _check_relpath(rel: str) -> None:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or rel in ("", ".") or rel == MANIFEST or "\\" in rel:
        raise ValueError(f"unsafe file name {rel!r}")

def parse_files(doc: dict) -> dict[str, FileEntry]:
    """A manifest's `files` (relative path -> sha256 and size), checked; ValueError when an
    entry is malformed or there is none. Shared by adapter and weights manifests."""
    files = {}
    for rel, entry in doc["files"].items():
        _check_relpath(rel)
        sha, size = str(entry["sha256"]), int(entry["size"])
        if not re.fullmatch(r"[0-9a-f]{64}", sha) or size < 0:
            raise ValueError(f"bad entry for {rel!r}")
        files[rel] = FileEntry(sha, size)
    if not files:
        raise ValueError("lists no files")
    return files



def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _root_cause(err: BaseException) -> BaseException:
    """boto3's transfer manager wraps S3 errors (S3UploadFailedError); classify the cause."""
    seen = 0
    while seen < 8:
        nxt = err.__cause__ or err.__context__
        if nxt is None or type(err).__module__.startswith("botocore"):
            return err
        err, seen = nxt, seen + 1
    return err


def _is_transient(err: BaseException) -> bool:
    err = _root_cause(err)
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(err, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError,
                        ConnectionClosedError, BotoConnectionError, ConnectionError, TimeoutError)):
        return True
    if isinstance(err, ClientError):
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = err.response.get("Error", {}).get("Code", "")
        return status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout", "InternalError")
    return False


def _client_error_code(err: BaseException) -> tuple[str, str]:
    from botocore.exceptions import ClientError

    err = _root_cause(err)
    if isinstance(err, ClientError):
        e = err.response.get("Error", {})
        return str(e.get("Code", "")), str(e.get("Message", ""))
    return "", ""


class AdapterStore:
    """Publish, list, fetch and prune the adapter versions of one run in one bucket.

    Thread-safe for concurrent readers (boto3 clients are); one trainer process publishes.
    Every S3 call is retried with exponential backoff and jitter on transient errors
    (connection refused, timeouts, 5xx, throttling); botocore's own retries are turned off
    so that ``attempts`` bounds the total time a caller can be held.
    """

    def __init__(
        self,
        bucket: str,
        run: str,
        prefix: str = "asyncgrpo",
        *,
        namespace: str | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        client: Any = None,
        attempts: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        name_prefix: str = DEFAULT_NAME_PREFIX,
    ):
        if not bucket:
            raise ValueError("bucket must be set")
        self.bucket = bucket
        self.run = run
        self.namespace = namespace or DEFAULT_NAMESPACE
        self.prefix = prefix
        self.folder = run_folder(prefix, self.namespace, run)  # ValueError on a bad segment
        self.name_prefix = name_prefix
        self.attempts = max(1, int(attempts))
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url or None,
                region_name=region or None,
                config=Config(
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=connect_timeout_s,
                    read_timeout=read_timeout_s,
                    # Path-style works with every S3-compatible server (MinIO, Ceph, moto).
                    s3={"addressing_style": "path"},
                ),
            )
        self.client = client

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kwargs) -> AdapterStore:
        """Build from the ``ASYNCGRPO_ADAPTER_*`` variables the operator sets (see docs/adapters.md).

        Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID`` and friends, or a
        web identity); ``ASYNCGRPO_ADAPTER_ENDPOINT`` or ``AWS_ENDPOINT_URL_S3`` name the server.
        """
        env = os.environ if env is None else env
        missing = [k for k in (wire.ADAPTER_BUCKET_ENV, wire.ADAPTER_RUN_ENV) if not env.get(k)]
        if missing:
            raise ValueError(f"adapter store not configured: {', '.join(missing)} unset")
        opts: dict[str, Any] = {
            "bucket": env[wire.ADAPTER_BUCKET_ENV],
            "run": env[wire.ADAPTER_RUN_ENV],
            "prefix": env.get(wire.ADAPTER_PREFIX_ENV) or "asyncgrpo",
            "namespace": env.get(wire.ADAPTER_NAMESPACE_ENV) or None,
            "endpoint_url": env.get(wire.ADAPTER_ENDPOINT_ENV) or None,
            "region": env.get(wire.ADAPTER_REGION_ENV) or None,
            "name_prefix": env.get(wire.ADAPTER_NAME_PREFIX_ENV) or DEFAULT_NAME_PREFIX,
        }
        if env.get(wire.ADAPTER_ATTEMPTS_ENV):
            opts["attempts"] = int(env[wire.ADAPTER_ATTEMPTS_ENV])
        if env.get(wire.ADAPTER_BACKOFF_ENV):
            opts["backoff_s"] = float(env[wire.ADAPTER_BACKOFF_ENV])
        opts.update(kwargs)
        return cls(**opts)

    # -- keys -------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """Key prefix of this run's adapters, ending in '/'."""
        return self.folder + "adapters/"

    def version_prefix(self, version: int) -> str:
        return f"{self.root}v{int(version)}/"

    def url(self, key: str = "") -> str:
        """``s3://bucket/key`` for messages: names the object, not the server."""
        return f"s3://{self.bucket}/{key}"

    def name(self, version: int) -> str:
        return adapter_name(version, self.name_prefix)

    def parse_name(self, name: str) -> int | None:
        return parse_adapter_name(name, self.name_prefix)

    # -- retries ----------------------------------------------------------------------------

    def _call(self, what: str, key: str, fn: Callable[[], _T]) -> _T:
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as err:  # classified below
                if not _is_transient(err):
                    code, msg = _client_error_code(err)
                    if code:
                        raise StoreRequestError(
                            f"{what} {self.url(key)} failed: {code}: {msg}"
                        ) from None
                    if type(_root_cause(err)).__module__.startswith(("botocore", "boto3")):
                        raise StoreRequestError(
                            f"{what} {self.url(key)} failed: {type(_root_cause(err)).__name__}"
                        ) from None
                    raise
                if attempt == self.attempts:
                    code, _ = _client_error_code(err)
                    cause = code or type(err).__name__
                    raise StoreUnavailable(
                        f"{what} {self.url(key)}: object store unreachable after "
                        f"{self.attempts} attempts ({cause})"
                    ) from None
                sleep = min(delay, self.max_backoff_s) * (0.5 + random.random() / 2)
                log.warning("%s %s failed (%s), retry %d/%d in %.2fs", what, self.url(key),
                            type(err).__name__, attempt, self.attempts - 1, sleep)
                time.sleep(sleep)
                delay *= 2
        raise AssertionError("unreachable")

    def _keys(self, prefix: str) -> dict[str, int]:
        """Every key under prefix with its size (paginated)."""

        def run() -> dict[str, int]:
            out: dict[str, int] = {}
            token = None
            while True:
                kw = {"Bucket": self.bucket, "Prefix": prefix}
                if token:
                    kw["ContinuationToken"] = token
                resp = self.client.list_objects_v2(**kw)
                for obj in resp.get("Contents", []):
                    out[obj["Key"]] = int(obj["Size"])
                if not resp.get("IsTruncated"):
                    return out
                token = resp["NextContinuationToken"]

        return self._call("list", prefix, run)

    def _get_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        def run() -> bytes | None:
            try:
                return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise

        return self._call("get", key, run)

    # -- versions ---------------------------------------------------------------------------

    def _scan(self) -> tuple[set[int], set[int]]:
        """(complete versions, versions with any object at all)."""
        complete, seen = set(), set()
        for key in self._keys(self.root):
            parts = key[len(self.root):].split("/", 1)
            m = _VERSION_DIR.match(parts[0])
            if not m or len(parts) < 2:
                continue
            v = int(m.group(1))
            seen.add(v)
            if parts[1] == MANIFEST:
                complete.add(v)
        return complete, seen

    def versions(self) -> list[int]:
        """Complete versions (manifest present), oldest first."""
        return sorted(self._scan()[0])

    def latest(self) -> int | None:
        """The newest complete version, or None before the first publish."""
        v = self.versions()
        return v[-1] if v else None

    def manifest(self, version: int) -> Manifest:
        """The manifest of a complete version; :class:`AdapterIncomplete` or
        :class:`AdapterNotFound` otherwise."""
        key = self.version_prefix(version) + MANIFEST
        body = self._get_bytes(key)
        if body is None:
            if self._keys(self.version_prefix(version)):
                raise AdapterIncomplete(
                    f"adapter version {version} at {self.url(self.version_prefix(version))} has "
                    f"files but no {MANIFEST}: partial upload, not served"
                )
            raise AdapterNotFound(f"adapter version {version} not found at {self.url(key)}")
        m = Manifest.from_json(body, where=self.url(key))
        if m.version != int(version):
            raise AdapterCorrupt(f"{self.url(key)} says version {m.version}, expected {version}")
        return m

    # -- publish ----------------------------------------------------------------------------

    def publish(
        self,
        local_dir: str | Path,
        version: int,
        *,
        step: int,
        base_model: str | None = None,
        rank: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Upload every file under ``local_dir`` (a peft ``save_pretrained`` output) as
        version ``version``, then its manifest.

        ``base_model`` and ``rank`` default to ``base_model_name_or_path`` and ``r`` of the
        directory's ``adapter_config.json``. Re-publishing a version whose upload died
        (no manifest) is allowed and overwrites the partial files; a complete one raises
        :class:`AdapterVersionExists`.
        """
        local_dir = Path(local_dir)
        version = int(version)
        if version < 1:
            raise ValueError(f"versions start at 1, got {version}")
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        rels = [p.relative_to(local_dir).as_posix() for p in files]
        if "adapter_config.json" not in rels:
            raise ValueError(f"{local_dir} has no adapter_config.json: not a peft adapter")
        for rel in rels:
            _check_relpath(rel)
        cfg = json.loads((local_dir / "adapter_config.json").read_text())
        base_model = base_model if base_model is not None else str(cfg.get("base_model_name_or_path") or "")
        rank = rank if rank is not None else cfg.get("r")

        vprefix = self.version_prefix(version)
        if self._get_bytes(vprefix + MANIFEST) is not None:
            raise AdapterVersionExists(f"adapter version {version} already published at {self.url(vprefix)}")

        entries: dict[str, FileEntry] = {}
        for path, rel in zip(files, rels):
            entries[rel] = FileEntry(sha256_file(path), path.stat().st_size)
            key = vprefix + rel
            if entries[rel].size <= SINGLE_REQUEST_BYTES:
                data = path.read_bytes()
                self._call("put", key, lambda k=key, d=data: self.client.put_object(
                    Bucket=self.bucket, Key=k, Body=d))
            else:
                self._call("put", key, lambda p=path, k=key: self.client.upload_file(
                    str(p), self.bucket, k))
        manifest = Manifest(
            run=self.run,
            version=version,
            step=int(step),
            base_model=base_model,
            rank=None if rank is None else int(rank),
            files=entries,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            extra=dict(extra or {}),
        )
        body = manifest.to_json().encode()
        key = vprefix + MANIFEST
        self._call("put", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=key, Body=body, ContentType="application/json"))
        log.info("published %s (%d files, %d bytes) to %s", self.name(version), len(entries),
                 manifest.total_bytes, self.url(vprefix))
        return manifest

    # -- fetch ------------------------------------------------------------------------------

    def fetch(self, version: int, dest: str | Path) -> tuple[Path, Manifest]:
        """Download a complete version into ``dest`` and verify every file before it appears.

        Files land in a temporary sibling directory that is renamed to ``dest`` only after
        all sizes and sha256 sums match, so ``dest`` existing means "verified". An existing
        ``dest`` is returned as is (versions are immutable; the caller's cache is
        append-only). Raises :class:`AdapterCorrupt`, :class:`AdapterIncomplete`,
        :class:`AdapterNotFound` or :class:`StoreUnavailable`.
        """
        dest = Path(dest)
        if (dest / MANIFEST).is_file():
            return dest, Manifest.from_json((dest / MANIFEST).read_bytes(), where=str(dest / MANIFEST))
        manifest = self.manifest(version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        try:
            self._download_verified(version, manifest, tmp)
            (tmp / MANIFEST).write_text(manifest.to_json())
            try:
                os.rename(tmp, dest)
            except OSError:
                if not (dest / MANIFEST).is_file():  # lost a race to a complete copy: fine
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return dest, manifest

    def verify(self, version: int) -> Manifest:
        """Download and check a version without keeping it (e.g. right after publishing)."""
        manifest = self.manifest(version)
        with tempfile.TemporaryDirectory(prefix="asyncgrpo-verify-") as tmp:
            self._download_verified(version, manifest, Path(tmp))
        return manifest

    def _download_verified(self, version: int, manifest: Manifest, into: Path) -> None:
        from botocore.exceptions import ClientError

        vprefix = self.version_prefix(version)
        for rel, entry in manifest.files.items():
            key = vprefix + rel
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)

            def get(k=key, t=target, small=entry.size <= SINGLE_REQUEST_BYTES) -> bool:
                try:
                    if small:
                        body = self.client.get_object(Bucket=self.bucket, Key=k)["Body"].read()
                        t.write_bytes(body)
                    else:
                        self.client.download_file(self.bucket, k, str(t))
                    return True
                except ClientError as e:
                    if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                        return False
                    raise

            if not self._call("get", key, get):
                raise AdapterCorrupt(f"{self.name(version)}: {self.url(key)} is listed in the "
                                     f"manifest but missing")
            size = target.stat().st_size
            if size != entry.size:
                raise AdapterCorrupt(f"{self.name(version)}: {self.url(key)} has {size} bytes, "
                                     f"manifest says {entry.size}")
            sha = sha256_file(target)
            if sha != entry.sha256:
                raise AdapterCorrupt(f"{self.name(version)}: {self.url(key)} sha256 {sha[:12]}... "
                                     f"does not match manifest {entry.sha256[:12]}...")

    # -- retention --------------------------------------------------------------------------

    def prune(self, retention: int, max_staleness: int = 0) -> list[int]:
        """Delete all but the newest complete versions; returns the deleted versions.

        Keeps ``max(retention, max_staleness + 2)``: rollouts may still be generated by any
        version up to ``max_staleness`` behind, plus the one being published and a margin for
        a replica that resolves a name just as it is pruned. Partial versions older than the
        oldest kept one (left by a trainer that died mid-publish) are deleted too; newer
        partial ones may be in flight and are left alone.
        """
        keep = max(int(retention), int(max_staleness) + 2, 1)
        complete, seen = self._scan()
        kept = sorted(complete)[-keep:]
        if not kept:
            return []
        floor = kept[0]
        doomed = sorted(v for v in seen if v < floor)
        for v in doomed:
            self.delete_version(v)
        if doomed:
            log.info("pruned adapter versions %s of run %s (keeping %s)", doomed, self.run, kept)
        return doomed

    def delete_version(self, version: int) -> None:
        """Remove one version, manifest first so it vanishes as a whole for readers."""
        vprefix = self.version_prefix(version)
        keys = sorted(self._keys(vprefix), key=lambda k: k != vprefix + MANIFEST)
        if keys and keys[0] == vprefix + MANIFEST:
            self._call("delete", keys[0], lambda: self.client.delete_object(
                Bucket=self.bucket, Key=keys[0]))
            keys = keys[1:]
        for batch in _chunks(keys, 1000):
            self._call("delete", vprefix, lambda b=batch: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in b], "Quiet": True}))


def _chunks(items: list[str], n: int) -> Iterable[list[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]
