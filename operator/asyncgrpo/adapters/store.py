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

The store itself is `asyncgrpo.storage.versions.VersionedStore` (the one versioned store,
shared with full weights); this module names the adapters' folder, manifest and errors.
Errors are raised as the exception types below. Their messages name the bucket and key
and the S3 error code, never the endpoint URL or credentials: they travel into logs,
run status conditions and (through the resolver) toward clients.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo import wire
from asyncgrpo.storage import StoreError, StoreRequestError, StoreUnavailable
from asyncgrpo.storage.versions import (
    FINAL,
    MANIFEST,
    FileEntry,
    VersionCorrupt,
    VersionedStore,
    VersionExists,
    VersionIncomplete,
    VersionNotFound,
    check_relpath,
    created_now,
    manifest_json,
    parse_files,
    sha256_file,
)

__all__ = ["FINAL", "MANIFEST", "MANIFEST_FORMAT", "AdapterCorrupt", "AdapterIncomplete",
           "AdapterNotFound", "AdapterStore", "AdapterStoreError", "AdapterVersionExists",
           "FileEntry", "Manifest", "StoreRequestError", "StoreUnavailable", "adapter_name",
           "parse_adapter_name", "parse_any_manifest", "sha256_file"]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "asyncgrpo.adapter/v1"


#: Base of every error this module raises (StoreUnavailable and StoreRequestError come from
#: the bucket layer, `asyncgrpo.storage`, shared with checkpoints and weights).
AdapterStoreError = StoreError


class AdapterNotFound(VersionNotFound):
    """No object at all exists for this version."""


class AdapterIncomplete(VersionIncomplete):
    """Files exist for this version but no manifest: a publish is in flight or died."""


class AdapterCorrupt(VersionCorrupt):
    """The manifest exists but a file is missing, has the wrong size or the wrong sha256."""


class AdapterVersionExists(VersionExists):
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
        return manifest_json({
            "format": self.format,
            "run": self.run,
            "version": self.version,
            "step": self.step,
            "base_model": self.base_model,
            "rank": self.rank,
            "created": self.created,
            "extra": self.extra,
        }, self.files)

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


class AdapterStore(VersionedStore[Manifest]):
    """Publish, list, fetch and prune the adapter versions of one run in one bucket
    (`asyncgrpo.storage.versions.VersionedStore` for the transport, retries, verified
    downloads and ``final/``)."""

    FOLDER = "adapters"
    NotFound = AdapterNotFound
    Incomplete = AdapterIncomplete
    Corrupt = AdapterCorrupt
    Exists = AdapterVersionExists

    def parse_manifest(self, body: bytes, where: str) -> Manifest:
        return Manifest.from_json(body, where=where)

    def parse_final(self, body: bytes, where: str) -> Any:
        return parse_any_manifest(body, where)

    def name(self, version: int) -> str:
        return adapter_name(version, self.name_prefix)

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
            check_relpath(rel)
        cfg = json.loads((local_dir / "adapter_config.json").read_text())
        base_model = base_model if base_model is not None else str(cfg.get("base_model_name_or_path") or "")
        rank = rank if rank is not None else cfg.get("r")

        vprefix = self.claim(version)
        entries = self.upload_files(local_dir, files, rels, vprefix)
        manifest = Manifest(
            run=self.run,
            version=version,
            step=int(step),
            base_model=base_model,
            rank=None if rank is None else int(rank),
            files=entries,
            created=created_now(),
            extra=dict(extra or {}),
        )
        self.put_manifest(vprefix, manifest)
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
            self.download_verified(version, manifest, tmp)
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
            self.download_verified(version, manifest, Path(tmp))
        return manifest

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
