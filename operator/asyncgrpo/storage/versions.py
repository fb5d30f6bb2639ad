"""The versioned store: numbered versions of one run, each a set of files and a manifest
written last, checked file by file (size, sha256) before anyone uses them.

Adapters (`asyncgrpo.adapters.store.AdapterStore`) and full weights
(`asyncgrpo.weights.store.WeightStore`) are its two kinds, siblings on `VersionedStore`:
each names its folder, its manifest type and its error types; everything else is here.

Layout (one run; the run folder comes from ``asyncgrpo.api.layout.run_folder``)::

    <run folder>/<FOLDER>/v{N}/<files...>
    <run folder>/<FOLDER>/v{N}/manifest.json        <- written last
    <run folder>/final/<files...> + manifest.json   the run's result (either kind)

Invariants the readers rely on:

* A version exists for readers only once its ``manifest.json`` exists. The manifest is
  uploaded after every file it lists, so a reader never sees a manifest whose files are still
  in flight; a writer that dies mid-publish leaves a partial version nobody reads.
* Versions are immutable: ``claim`` refuses a version that is complete already.
* Deletion removes the manifest first, so a version disappears as a whole for readers.
* Every file is checked against the manifest's sha256 and size before anyone uses it; a
  mismatch is the store's `Corrupt` error, never a half-loaded version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Generic, Protocol, TypeVar

from asyncgrpo import wire
from asyncgrpo.api.layout import DEFAULT_NAMESPACE, run_folder
from asyncgrpo.storage.s3 import Bucket, CompleteVersions, StoreError
from asyncgrpo.storage.s3 import client as s3_client

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: the run folder's sub-folder with the run's result (see VersionedStore.final_prefix)
FINAL = "final"
#: Files up to this size go in one PUT/GET; larger ones through boto3's multipart transfer
#: manager (whose thread pool costs more than a small file's whole transfer).
SINGLE_REQUEST_BYTES = 8 * 1024 * 1024


class VersionNotFound(StoreError):
    """No object at all exists for this version."""


class VersionIncomplete(StoreError):
    """Files exist for this version but no manifest: a publish is in flight or died."""


class VersionCorrupt(StoreError):
    """The manifest exists but a file is missing, has the wrong size or the wrong sha256."""


class VersionExists(StoreError):
    """A complete version is never overwritten (readers may already use it)."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


class VersionManifest(Protocol):
    """What the store needs of a manifest (adapters' `Manifest`, `WeightsManifest`)."""

    version: int
    files: dict[str, FileEntry]

    @property
    def total_bytes(self) -> int: ...

    def to_json(self) -> str: ...


M = TypeVar("M", bound=VersionManifest)


def check_relpath(rel: str) -> None:
    """ValueError for a file name that could leave the version's folder (or be its
    manifest)."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or rel in ("", ".") or rel == MANIFEST or "\\" in rel:
        raise ValueError(f"unsafe file name {rel!r}")


def parse_files(doc: dict) -> dict[str, FileEntry]:
    """A manifest's `files` (relative path -> sha256 and size), checked; ValueError when an
    entry is malformed or there is none."""
    files = {}
    for rel, entry in doc["files"].items():
        check_relpath(rel)
        sha, size = str(entry["sha256"]), int(entry["size"])
        if not re.fullmatch(r"[0-9a-f]{64}", sha) or size < 0:
            raise ValueError(f"bad entry for {rel!r}")
        files[rel] = FileEntry(sha, size)
    if not files:
        raise ValueError("lists no files")
    return files


def manifest_json(doc: dict[str, Any], files: dict[str, FileEntry]) -> str:
    """A manifest's text: `doc` with its `files`, keys sorted, one trailing newline."""
    doc = dict(doc, files={k: {"sha256": v.sha256, "size": v.size}
                           for k, v in sorted(files.items())})
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def created_now() -> str:
    """A manifest's `created`: now, UTC, to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def local_files(local_dir: Path, *, skip: tuple[str, ...] = ()) -> tuple[list[Path], list[str]]:
    """(files, their relative names) under local_dir, sorted, each name checked; names in
    `skip` are left out."""
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name not in skip)
    rels = [p.relative_to(local_dir).as_posix() for p in files]
    for rel in rels:
        check_relpath(rel)
    return files, rels


def replace_verified(dest: Path, manifest, fill) -> tuple[Path, Any]:
    """`fill(tmp)` writes and verifies every file of `manifest` into a temporary sibling of
    `dest`; then the manifest is added and the folder swapped in whole (an existing `dest` is
    replaced), so `dest` never holds a partial or unverified copy. Returns (dest, manifest)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        fill(tmp)
        (tmp / MANIFEST).write_text(manifest.to_json())
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest, manifest


class VersionedStore(Generic[M]):
    """The versions of one run in one bucket: `v{N}/` under `FOLDER`, manifest last.

    Thread-safe for concurrent readers (boto3 clients are); one process publishes. Every S3
    call goes through `Bucket`: retried with exponential backoff and jitter on transient
    errors, botocore's own retries off, so that ``attempts`` bounds the total time a caller
    can be held. A kind of version names `FOLDER`, `parse_manifest`, `name` and its error
    types (subclasses of the four above).
    """

    #: the sub-folder of the run's folder that holds the versions
    FOLDER = ""
    #: files of one version a reader downloads at once (by default)
    DOWNLOAD_CONCURRENCY = 1
    NotFound: type[VersionNotFound] = VersionNotFound
    Incomplete: type[VersionIncomplete] = VersionIncomplete
    Corrupt: type[VersionCorrupt] = VersionCorrupt
    Exists: type[VersionExists] = VersionExists

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
        name_prefix: str = wire.DEFAULT_NAME_PREFIX,
        download_concurrency: int | None = None,
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
        #: files of one version fetched at once (each checked as it lands, as one by one)
        self.download_concurrency = max(1, int(download_concurrency or
                                               self.DOWNLOAD_CONCURRENCY))
        if client is None:
            client = s3_client(endpoint_url, region, connect_timeout_s=connect_timeout_s,
                             read_timeout_s=read_timeout_s)
        #: the run's folder in the bucket, every call retried
        self.objects = Bucket(bucket, self.folder, client, attempts=self.attempts,
                              backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        #: v{N}/ sub-folders of FOLDER, complete once their manifest is in
        self.versions_in = CompleteVersions(self.objects, self.FOLDER, MANIFEST, r"^v(\d+)$",
                                            lambda n: f"v{int(n)}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kwargs):
        """Build from the ``ASYNCGRPO_ADAPTER_*`` variables the operator sets (see
        docs/adapters.md): every kind of version lives in the run's one folder.

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
            "name_prefix": env.get(wire.ADAPTER_NAME_PREFIX_ENV) or wire.DEFAULT_NAME_PREFIX,
        }
        if env.get(wire.ADAPTER_ATTEMPTS_ENV):
            opts["attempts"] = int(env[wire.ADAPTER_ATTEMPTS_ENV])
        if env.get(wire.ADAPTER_BACKOFF_ENV):
            opts["backoff_s"] = float(env[wire.ADAPTER_BACKOFF_ENV])
        opts.update(kwargs)
        return cls(**opts)

    # -- what a kind of version names --------------------------------------------------------

    def parse_manifest(self, body: bytes, where: str) -> M:
        """A version's manifest from its bytes; the store's `Corrupt` when it is not one."""
        raise NotImplementedError

    def parse_final(self, body: bytes, where: str) -> Any:
        """The manifest of ``final/`` (by default: one of this kind)."""
        return self.parse_manifest(body, where)

    def name(self, version: int) -> str:
        return f"{self.FOLDER} v{int(version)}"

    # -- keys --------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The boto3 client under every call (shared with the run's other stores)."""
        return self.objects.client

    @client.setter
    def client(self, value: Any) -> None:
        self.objects.client = value

    @property
    def root(self) -> str:
        """Key prefix of this run's versions, ending in '/'."""
        return self.versions_in.root

    def version_prefix(self, version: int) -> str:
        return self.versions_in.prefix(version)

    def url(self, key: str = "") -> str:
        """``s3://bucket/key`` for messages: names the object, not the server."""
        return self.objects.url(key)

    # -- reading -----------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Complete versions (manifest present), oldest first."""
        return self.versions_in.complete()

    def latest(self) -> int | None:
        """The newest complete version, or None before the first publish."""
        v = self.versions()
        return v[-1] if v else None

    def manifest_body(self, version: int) -> tuple[bytes, str]:
        """(the manifest's bytes, its key) of a complete version; `Incomplete` or `NotFound`
        otherwise."""
        key = self.version_prefix(version) + MANIFEST
        body = self.objects.get_or_none(key)
        if body is None:
            if self.versions_in.has_any(version):
                raise self.Incomplete(
                    f"{self.name(version)} at {self.url(self.version_prefix(version))} has "
                    f"files but no {MANIFEST}: partial upload, not served"
                )
            raise self.NotFound(f"{self.name(version)} not found at {self.url(key)}")
        return body, key

    def manifest(self, version: int) -> M:
        """The manifest of a complete version; `Incomplete` or `NotFound` otherwise."""
        body, key = self.manifest_body(version)
        m = self.parse_manifest(body, self.url(key))
        if m.version != int(version):
            raise self.Corrupt(f"{self.url(key)} says version {m.version}, expected {version}")
        return m

    def download_verified(self, version: int, manifest: VersionManifest, into: Path,
                          vprefix: str | None = None) -> None:
        """Every file of the version into ``into``, ``download_concurrency`` at a time (the
        rank files of a sharded version in parallel), each checked as it lands; the first
        failure is raised once the others stopped."""
        vprefix = self.version_prefix(version) if vprefix is None else vprefix
        items = sorted(manifest.files.items())
        workers = min(self.download_concurrency, len(items))
        if workers <= 1:
            for rel, entry in items:
                self.download_file(version, vprefix, rel, entry, into)
            return
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

        with ThreadPoolExecutor(workers, thread_name_prefix=f"{self.FOLDER}-get") as pool:
            futures = [pool.submit(self.download_file, version, vprefix, rel, entry, into)
                       for rel, entry in items]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                for f in futures:
                    f.cancel()  # files not started yet are not fetched at all
                wait(futures)
                raise failed[0].exception()

    def download_file(self, version: int, vprefix: str, rel: str, entry: FileEntry,
                      into: Path) -> None:
        """One file of a version into ``into / rel``, checked against its manifest entry."""
        key = vprefix + rel
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.size <= SINGLE_REQUEST_BYTES:
            body = self.objects.get_or_none(key)
            if body is not None:
                target.write_bytes(body)
            found = body is not None
        else:
            found = self.objects.download(key, target)
        if not found:
            raise self.Corrupt(f"{self.name(version)}: {self.url(key)} is listed in the "
                               f"manifest but missing")
        size = target.stat().st_size
        if size != entry.size:
            raise self.Corrupt(f"{self.name(version)}: {self.url(key)} has {size} bytes, "
                               f"manifest says {entry.size}")
        sha = sha256_file(target)
        if sha != entry.sha256:
            raise self.Corrupt(f"{self.name(version)}: {self.url(key)} sha256 {sha[:12]}... "
                               f"does not match manifest {entry.sha256[:12]}...")

    # -- writing -----------------------------------------------------------------------------

    def claim(self, version: int) -> str:
        """The version's key prefix, unless it is complete already (`Exists`: versions are
        immutable)."""
        vprefix = self.version_prefix(int(version))
        if self.objects.get_or_none(vprefix + MANIFEST) is not None:
            raise self.Exists(f"{self.name(version)} already published at {self.url(vprefix)}")
        return vprefix

    def upload_files(self, local_dir: Path, files: list[Path], rels: list[str],
                     vprefix: str) -> dict[str, FileEntry]:
        """Every file under vprefix (before the manifest that lists them); their entries."""
        entries: dict[str, FileEntry] = {}
        for path, rel in zip(files, rels):
            entries[rel] = FileEntry(sha256_file(path), path.stat().st_size)
            if entries[rel].size <= SINGLE_REQUEST_BYTES:
                self.objects.put_bytes(vprefix + rel, path.read_bytes())
            else:
                self.objects.upload(path, vprefix + rel)
        return entries

    def put_manifest(self, vprefix: str, manifest: VersionManifest) -> None:
        """The manifest under vprefix: written last, it makes the version complete."""
        self.objects.put_bytes(vprefix + MANIFEST, manifest.to_json().encode(),
                               content_type="application/json")

    def overwrite(self, version: int, rel: str, body: bytes) -> str:
        """Replace one file of a complete version (fault injection: a corrupted copy that
        readers must refuse); returns its key."""
        key = self.version_prefix(version) + rel
        self.objects.put_bytes(key, body)
        return key

    def delete_version(self, version: int) -> None:
        """Remove one version, manifest first so it vanishes as a whole for readers."""
        self.versions_in.delete(version)

    # -- the run's final result --------------------------------------------------------------

    @property
    def final_prefix(self) -> str:
        """``<run folder>/final/``: the run's result, written once more at the end of training
        in a layout peft (LoRA) or transformers and vLLM (full weights) load directly."""
        return self.objects.key(FINAL) + "/"

    def publish_final(self, local_dir: str | Path, manifest: Any) -> Any:
        """Upload every file under ``local_dir`` to ``final/``, then ``manifest`` (an adapter
        manifest or a weights manifest, its ``files`` filled in here) last.

        Unlike versions, ``final/`` is rewritten when a resumed run finishes again: the old
        manifest goes first (readers see no result rather than a mixed one), stale files of
        the previous result are deleted after the new manifest is in."""
        from dataclasses import replace

        local_dir = Path(local_dir)
        files, rels = local_files(local_dir, skip=(MANIFEST,))
        prefix = self.final_prefix
        before = set(self.objects.list(prefix))
        if prefix + MANIFEST in before:
            self.objects.delete([prefix + MANIFEST])
        entries = self.upload_files(local_dir, files, rels, prefix)
        manifest = replace(manifest, files=entries, created=created_now())
        self.put_manifest(prefix, manifest)
        stale = sorted(before - {prefix + r for r in rels} - {prefix + MANIFEST})
        if stale:
            self.objects.delete(stale)
        log.info("final result of run %s (%d files, %d bytes) in %s", self.run, len(entries),
                 manifest.total_bytes, self.url(prefix))
        return manifest

    def final_manifest(self) -> Any:
        """The manifest of ``final/``, or None before a run finished."""
        key = self.final_prefix + MANIFEST
        body = self.objects.get_or_none(key)
        return None if body is None else self.parse_final(body, self.url(key))

    def fetch_final(self, dest: str | Path) -> tuple[Path, Any]:
        """``final/`` into ``dest``, every file checked against the manifest (sizes, sha256)
        before ``dest`` appears; an existing ``dest`` is replaced."""
        manifest = self.final_manifest()
        if manifest is None:
            raise self.NotFound(f"no final result at {self.url(self.final_prefix)} (the run "
                                "has not finished, or finished before final/ existed)")
        return replace_verified(Path(dest), manifest, lambda tmp: self.download_verified(
            manifest.version, manifest, tmp, vprefix=self.final_prefix))

