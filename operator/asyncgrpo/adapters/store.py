"""Versioned LoRA adapters in an S3-compatible bucket: the only channel from trainer to vLLM.

Layout (one run; the run folder comes from ``asyncgrpo.api.layout.run_folder``)::

    <prefix>/<namespace>/<run>/adapters/v{N}/adapter_config.json
    <prefix>/<namespace>/<run>/adapters/v{N}/adapter_model.safetensors
    <prefix>/<namespace>/<run>/adapters/v{N}/manifest.json        <- written last
    <prefix>/<namespace>/<run>/final/...  + manifest.json          the run's result (see below)

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
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from asyncgrpo import storage, wire
from asyncgrpo.api.layout import DEFAULT_NAMESPACE, run_folder
from asyncgrpo.storage import (  # noqa: F401  (the last two: raised through here, re-exported)
    Bucket,
    CompleteVersions,
    StoreError,
    StoreRequestError,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: the run folder's sub-folder with the run's result (see AdapterStore.final_prefix)
FINAL = "final"
MANIFEST_FORMAT = "asyncgrpo.adapter/v1"
#: Files up to this size go in one PUT/GET; larger ones through boto3's multipart transfer
#: manager (whose thread pool costs more than a small file's whole transfer).
SINGLE_REQUEST_BYTES = 8 * 1024 * 1024


#: Base of every error this module raises (StoreUnavailable and StoreRequestError come from
#: the bucket layer, `asyncgrpo.storage`, shared with checkpoints and weights).
AdapterStoreError = StoreError


class AdapterNotFound(AdapterStoreError):
    """No object at all exists for this version."""


class AdapterIncomplete(AdapterStoreError):
    """Files exist for this version but no manifest: a publish is in flight or died."""


class AdapterCorrupt(AdapterStoreError):
    """The manifest exists but a file is missing, has the wrong size or the wrong sha256."""


class AdapterVersionExists(AdapterStoreError):
    """A complete version is never overwritten (replicas may already serve it)."""


def adapter_name(version: int, name_prefix: str = wire.DEFAULT_NAME_PREFIX) -> str:
    """The model name a client sends to vLLM for a version, e.g. ``policy-v3``."""
    return f"{name_prefix}{int(version)}"


def parse_adapter_name(name: str, name_prefix: str = wire.DEFAULT_NAME_PREFIX) -> int | None:
    """The version in ``policy-v{N}``, or None for any other name (left to other resolvers).

    Only the canonical spelling: ``policy-v01`` is not ``policy-v1``. vLLM keys its LoRA slots by
    name, so an alias would load the same version into a second slot.
    """
    if not name.startswith(name_prefix):
        return None
    rest = name[len(name_prefix):]
    if not rest.isascii() or not rest.isdigit() or rest != str(int(rest)):
        return None
    return int(rest)


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


def parse_any_manifest(text: str | bytes, where: str = "manifest") -> Any:
    """An adapter :class:`Manifest` or a weights manifest, by its ``format`` (``final/``
    holds either, in the format of the versions it was made from)."""
    try:
        fmt = json.loads(text).get("format")
    except (ValueError, AttributeError):
        fmt = None
    if fmt == MANIFEST_FORMAT:
        return Manifest.from_json(text, where)
    from asyncgrpo.weights.store import WeightsManifest

    return WeightsManifest.from_json(text, where)


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


class AdapterStore:
    """Publish, list, fetch and prune the adapter versions of one run in one bucket.

    Thread-safe for concurrent readers (boto3 clients are); one trainer process publishes.
    Every S3 call goes through `asyncgrpo.storage.Bucket`: retried with exponential backoff
    and jitter on transient errors, botocore's own retries off, so that ``attempts`` bounds
    the total time a caller can be held.
    """

    #: the sub-folder of the run's folder that holds the versions
    FOLDER = "adapters"

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
            client = storage.client(endpoint_url, region, connect_timeout_s=connect_timeout_s,
                                    read_timeout_s=read_timeout_s)
        #: the run's folder in the bucket, every call retried (`asyncgrpo.storage`)
        self.objects = Bucket(bucket, self.folder, client, attempts=self.attempts,
                              backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        #: v{N}/ sub-folders of FOLDER, complete once their manifest is in
        self.versions_in = CompleteVersions(self.objects, self.FOLDER, MANIFEST, r"^v(\d+)$",
                                            lambda n: f"v{int(n)}")

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
            "name_prefix": env.get(wire.ADAPTER_NAME_PREFIX_ENV) or wire.DEFAULT_NAME_PREFIX,
        }
        if env.get(wire.ADAPTER_ATTEMPTS_ENV):
            opts["attempts"] = int(env[wire.ADAPTER_ATTEMPTS_ENV])
        if env.get(wire.ADAPTER_BACKOFF_ENV):
            opts["backoff_s"] = float(env[wire.ADAPTER_BACKOFF_ENV])
        opts.update(kwargs)
        return cls(**opts)

    @property
    def client(self) -> Any:
        """The boto3 client under every call (shared with the run's other stores)."""
        return self.objects.client

    @client.setter
    def client(self, value: Any) -> None:
        self.objects.client = value

    # -- keys -------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """Key prefix of this run's versions, ending in '/'."""
        return self.versions_in.root

    def version_prefix(self, version: int) -> str:
        return self.versions_in.prefix(version)

    def url(self, key: str = "") -> str:
        """``s3://bucket/key`` for messages: names the object, not the server."""
        return self.objects.url(key)

    def name(self, version: int) -> str:
        return adapter_name(version, self.name_prefix)

    # -- versions ---------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Complete versions (manifest present), oldest first."""
        return self.versions_in.complete()

    def latest(self) -> int | None:
        """The newest complete version, or None before the first publish."""
        v = self.versions()
        return v[-1] if v else None

    def _manifest_body(self, version: int) -> tuple[bytes, str]:
        """(the manifest's bytes, its key) of a complete version; :class:`AdapterIncomplete`
        or :class:`AdapterNotFound` otherwise."""
        key = self.version_prefix(version) + MANIFEST
        body = self.objects.get_or_none(key)
        if body is None:
            if self.versions_in.has_any(version):
                raise AdapterIncomplete(
                    f"{self.name(version)} at {self.url(self.version_prefix(version))} has "
                    f"files but no {MANIFEST}: partial upload, not served"
                )
            raise AdapterNotFound(f"{self.name(version)} not found at {self.url(key)}")
        return body, key

    def manifest(self, version: int) -> Manifest:
        """The manifest of a complete version; :class:`AdapterIncomplete` or
        :class:`AdapterNotFound` otherwise."""
        body, key = self._manifest_body(version)
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

        vprefix = self._claim(version)
        entries = self._upload_files(local_dir, files, rels, vprefix)
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
        self.objects.put_bytes(vprefix + MANIFEST, manifest.to_json().encode(),
                               content_type="application/json")
        log.info("published %s (%d files, %d bytes) to %s", self.name(version), len(entries),
                 manifest.total_bytes, self.url(vprefix))
        return manifest

    def _claim(self, version: int) -> str:
        """The version's key prefix, unless it is complete already (versions are immutable)."""
        vprefix = self.version_prefix(version)
        if self.objects.get_or_none(vprefix + MANIFEST) is not None:
            raise AdapterVersionExists(f"{self.name(version)} already published at "
                                       f"{self.url(vprefix)}")
        return vprefix

    def _upload_files(self, local_dir: Path, files: list[Path], rels: list[str],
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

    def _download_verified(self, version: int, manifest: Manifest, into: Path,
                           vprefix: str | None = None) -> None:
        vprefix = self.version_prefix(version) if vprefix is None else vprefix
        for rel, entry in manifest.files.items():
            self._download_file(version, vprefix, rel, entry, into)

    def _download_file(self, version: int, vprefix: str, rel: str, entry: FileEntry,
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

    # -- the run's final result ------------------------------------------------------------

    @property
    def final_prefix(self) -> str:
        """``<run folder>/final/``: the run's result, written once more at the end of training
        in a layout peft (LoRA) or transformers and vLLM (full weights) load directly."""
        return self.objects.key(FINAL) + "/"

    def publish_final(self, local_dir: str | Path, manifest: Any) -> Any:
        """Upload every file under ``local_dir`` to ``final/``, then ``manifest`` (an adapter
        :class:`Manifest` or a weights manifest, its ``files`` filled in here) last.

        Unlike versions, ``final/`` is rewritten when a resumed run finishes again: the old
        manifest goes first (readers see no result rather than a mixed one), stale files of
        the previous result are deleted after the new manifest is in."""
        from dataclasses import replace

        local_dir = Path(local_dir)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
        rels = [p.relative_to(local_dir).as_posix() for p in files]
        for rel in rels:
            _check_relpath(rel)
        prefix = self.final_prefix
        before = set(self.objects.list(prefix))
        if prefix + MANIFEST in before:
            self.objects.delete([prefix + MANIFEST])
        entries = self._upload_files(local_dir, files, rels, prefix)
        manifest = replace(manifest, files=entries,
                           created=datetime.now(UTC).isoformat(timespec="seconds"))
        self.objects.put_bytes(prefix + MANIFEST, manifest.to_json().encode(),
                               content_type="application/json")
        stale = sorted(before - {prefix + r for r in rels} - {prefix + MANIFEST})
        if stale:
            self.objects.delete(stale)
        log.info("final result of run %s (%d files, %d bytes) in %s", self.run, len(entries),
                 manifest.total_bytes, self.url(prefix))
        return manifest

    def final_manifest(self) -> Any:
        """The manifest of ``final/`` (adapter or weights format), or None before a run
        finished."""
        key = self.final_prefix + MANIFEST
        body = self.objects.get_or_none(key)
        return None if body is None else parse_any_manifest(body, self.url(key))

    def fetch_final(self, dest: str | Path) -> tuple[Path, Any]:
        """``final/`` into ``dest``, every file checked against the manifest (sizes, sha256)
        before ``dest`` appears; an existing ``dest`` is replaced."""
        manifest = self.final_manifest()
        if manifest is None:
            raise AdapterNotFound(f"no final result at {self.url(self.final_prefix)} (the run "
                                  "has not finished, or finished before final/ existed)")
        return replace_verified(Path(dest), manifest, lambda tmp: self._download_verified(
            manifest.version, manifest, tmp, vprefix=self.final_prefix))

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
        doomed, kept = self.versions_in.prune(keep)
        if doomed:
            log.info("pruned adapter versions %s of run %s (keeping %s)", doomed, self.run, kept)
        return doomed

    def delete_version(self, version: int) -> None:
        """Remove one version, manifest first so it vanishes as a whole for readers."""
        self.versions_in.delete(version)
