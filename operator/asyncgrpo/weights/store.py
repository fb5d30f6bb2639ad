"""Versioned full weights in the run's bucket: anchors every K versions, sparse deltas between.

Layout (one run; the run's folder is the adapter store's, so wherever a run's objects live,
its weights live beside its adapters)::

    <run folder>/weights/v1/model.safetensors            anchor (checkpoint names and layout)
    <run folder>/weights/v1/manifest.json                <- written last
    <run folder>/weights/v2/delta.safetensors            delta against v1
    <run folder>/weights/v2/manifest.json
    ...
    <run folder>/weights/v{K+1}/model.safetensors        next anchor

The versioned store's invariants hold here too (`asyncgrpo.storage.versions.VersionedStore`,
the adapter store's sibling): a version exists once its manifest exists, versions are
immutable, deletion removes the manifest first, every file is checked against the
manifest's size and sha256 before use.
On top of them:

* A delta's manifest names its ``base`` (the version it applies to, always the one published
  just before it) and its ``anchor`` (the full version its chain starts from). A reader whose
  local copy is at ``base`` applies it; any other reader starts again from an anchor.
* Retention never breaks a chain: the oldest version kept is an anchor (the newest anchor at
  or before the oldest version retention wants), so every kept version can be rebuilt and a
  replica that fell behind can always catch up from the newest anchor.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.storage.versions import (
    FileEntry,
    VersionCorrupt,
    VersionedStore,
    VersionExists,
    VersionIncomplete,
    VersionNotFound,
    check_relpath,
    created_now,
    local_files,
    manifest_json,
    parse_files,
    replace_verified,
)

log = logging.getLogger(__name__)

WEIGHTS_FORMAT = "asyncgrpo.weights/v1"
#: Sharded versions (one object per trainer rank, ``shards`` in the manifest): a puller that
#: knows only v1 refuses them by their format ("format is 'asyncgrpo.weights/v2', expected
#: 'asyncgrpo.weights/v1'") and keeps serving what it has.
WEIGHTS_FORMAT_SHARDED = "asyncgrpo.weights/v2"
FORMATS = (WEIGHTS_FORMAT, WEIGHTS_FORMAT_SHARDED)
ANCHOR, DELTA = "anchor", "delta"
#: Default ``spec.model.full.anchorInterval``: a full version every K versions.
DEFAULT_ANCHOR_INTERVAL = 10
#: Files of one version a reader downloads at once (a sharded version is one file per trainer
#: rank: fetched one after another, a replica's link would wait on one S3 stream at a time).
DEFAULT_DOWNLOAD_CONCURRENCY = 8


class WeightsNotFound(VersionNotFound):
    """No object at all exists for this version."""


class WeightsIncomplete(VersionIncomplete):
    """Files exist for this version but no manifest (or a rank's file did not land)."""


class WeightsCorrupt(VersionCorrupt):
    """The manifest is invalid, or a file is missing, has the wrong size or sha256."""


class WeightsVersionExists(VersionExists):
    """A complete version is never overwritten (replicas may already serve it)."""


@dataclass(frozen=True)
class WeightsManifest:
    """``weights/v{N}/manifest.json``; its presence marks a complete version."""

    run: str
    version: int
    step: int
    kind: str  # "anchor" | "delta"
    base: int | None  # the version a delta applies to (None for an anchor)
    anchor: int  # the anchor this version's chain starts from (itself for an anchor)
    dtype: str
    files: dict[str, FileEntry]
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = WEIGHTS_FORMAT
    #: v2 only: ``{"world": W, "ranks": {"r": [files]}, "tensors": {name: {dtype, shape,
    #: pieces}}}`` (tensors for anchors; asyncgrpo.weights.shards)
    shards: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    def rank_bytes(self) -> dict[int, int]:
        """Bytes each trainer rank uploaded (sharded versions)."""
        ranks = (self.shards or {}).get("ranks", {})
        return {int(r): sum(self.files[f].size for f in fs) for r, fs in ranks.items()}

    def to_json(self) -> str:
        doc = {
            "format": self.format, "run": self.run, "version": self.version, "step": self.step,
            "kind": self.kind, "base": self.base, "anchor": self.anchor, "dtype": self.dtype,
            "created": self.created, "extra": self.extra,
        }
        if self.shards is not None:
            doc["shards"] = self.shards
        return manifest_json(doc, self.files)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> WeightsManifest:
        """Parse and validate; anything unexpected is :class:`WeightsCorrupt`."""
        try:
            doc = json.loads(text)
            if doc.get("format") not in FORMATS:
                raise ValueError(f"format is {doc.get('format')!r}, expected one of {FORMATS}")
            files = parse_files(doc)
            shards = doc.get("shards")
            if (doc["format"] == WEIGHTS_FORMAT_SHARDED) != (shards is not None):
                raise ValueError(f"{doc['format']} and shards {'absent' if shards is None else 'present'}")
            if shards is not None:
                _check_shards(shards, files, str(doc["kind"]))
            version, kind = int(doc["version"]), str(doc["kind"])
            base = None if doc.get("base") is None else int(doc["base"])
            anchor = int(doc["anchor"])
            if kind == ANCHOR and (base is not None or anchor != version):
                raise ValueError("an anchor has no base and is its own anchor")
            if kind == DELTA and (base is None or not anchor <= base < version):
                raise ValueError(f"delta {version} has base {base} and anchor {anchor}")
            if kind not in (ANCHOR, DELTA):
                raise ValueError(f"kind is {kind!r}")
            return cls(run=str(doc["run"]), version=version, step=int(doc["step"]), kind=kind,
                       base=base, anchor=anchor, dtype=str(doc["dtype"]), files=files,
                       created=str(doc.get("created", "")), extra=dict(doc.get("extra") or {}),
                       format=str(doc["format"]), shards=shards)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsCorrupt(f"{where} is not a valid weights manifest: {e}") from None


def _check_shards(shards: dict, files: dict, kind: str) -> None:
    """A v2 manifest's ``shards``: every rank's files are the manifest's files, and an
    anchor's pieces tile each tensor exactly, from files of the version."""
    from asyncgrpo.weights.shards import check_cover

    world = int(shards["world"])
    ranks = shards["ranks"]
    if world < 1 or not all(0 <= int(r) < world for r in ranks):
        raise ValueError(f"shards: ranks {sorted(ranks)} for world {world}")
    listed = [f for fs in ranks.values() for f in fs]
    if sorted(listed) != sorted(files) or len(set(listed)) != len(listed):
        raise ValueError("shards: the ranks' files are not the manifest's files")
    if kind == ANCHOR:
        tensors = shards["tensors"]
        if not tensors:
            raise ValueError("shards: an anchor without tensors")
        for name, t in tensors.items():
            check_relpath(name.replace(".", "/"))  # no path tricks in names either
            if any(p[0] not in files for p in t["pieces"]):
                raise ValueError(f"shards: {name} names a file outside the version")
            check_cover(name, t)


class WeightStore(VersionedStore[WeightsManifest]):
    """Publish, list, fetch and prune the weight versions of one run: the adapter store's
    sibling on `asyncgrpo.storage.versions.VersionedStore` (transport, retries, verified
    downloads, complete versions, ``final/``); only the key space and the manifest differ.
    The files of one version are fetched ``download_concurrency`` at a time (default 8)."""

    FOLDER = "weights"
    DOWNLOAD_CONCURRENCY = DEFAULT_DOWNLOAD_CONCURRENCY
    NotFound = WeightsNotFound
    Incomplete = WeightsIncomplete
    Corrupt = WeightsCorrupt
    Exists = WeightsVersionExists

    def parse_manifest(self, body: bytes, where: str) -> WeightsManifest:
        return WeightsManifest.from_json(body, where=where)

    # -- reading -----------------------------------------------------------------------------

    def fetch(self, version: int, dest: str | Path,
              manifest: WeightsManifest | None = None) -> tuple[Path, WeightsManifest]:
        """Download a complete version into ``dest``, verified (sizes, sha256) before it
        appears; an existing ``dest`` is replaced."""
        manifest = manifest or self.manifest(version)
        return replace_verified(Path(dest), manifest,
                                lambda tmp: self.download_verified(version, manifest, tmp))

    def plan(self, have: int | None, latest: int) -> list[WeightsManifest]:
        """The versions to apply, in order, to go from a local copy at ``have`` (None: no
        usable copy) to ``latest``: the deltas after ``have`` if their chain is unbroken, else
        the newest anchor at or before ``latest`` and the deltas after it. Raises
        :class:`WeightsNotFound`/:class:`WeightsCorrupt` when no chain reaches ``latest``."""
        if have is not None and have >= latest:
            return []
        chain: list[WeightsManifest] = []
        v = latest
        while True:
            m = self.manifest(v)
            chain.append(m)
            if m.kind == ANCHOR or (have is not None and m.base == have):
                break
            if m.base is None or m.base < m.anchor:
                raise WeightsCorrupt(f"{self.name(v)}: broken chain")
            v = m.base
        chain.reverse()
        if chain[0].kind == DELTA and chain[0].base != have:
            raise WeightsCorrupt(f"no chain from {have} to {latest}")
        return chain

    # -- publish -----------------------------------------------------------------------------

    def publish_version(self, local_dir: str | Path, version: int, *, kind: str, step: int,
                        dtype: str, base: int | None = None, anchor: int | None = None,
                        extra: dict[str, Any] | None = None) -> WeightsManifest:
        """Upload every file under ``local_dir`` as ``weights/v{version}``, manifest last.

        A complete version is never overwritten; one left without a manifest by a dead
        publisher is redone.
        """
        local_dir, version = Path(local_dir), int(version)
        if version < 1:
            raise ValueError(f"versions start at 1, got {version}")
        files, rels = local_files(local_dir)
        vprefix = self.claim(version)
        entries = self.upload_files(local_dir, files, rels, vprefix)
        manifest = WeightsManifest(
            run=self.run, version=version, step=int(step), kind=kind, base=base,
            anchor=version if kind == ANCHOR else int(anchor if anchor is not None else -1),
            dtype=dtype, files=entries, created=created_now(),
            extra=dict(extra or {}))
        WeightsManifest.from_json(manifest.to_json(), where="new manifest")  # same rules as readers
        self.put_manifest(vprefix, manifest)
        log.info("published %s (%s, %d files, %d bytes) to %s", self.name(version), kind,
                 len(entries), manifest.total_bytes, self.url(vprefix))
        return manifest

    def upload_rank_files(self, local_dir: str | Path, version: int) -> dict[str, FileEntry]:
        """One trainer rank's files of a sharded version (no manifest: rank 0 writes it once
        every rank's files are in the bucket, :meth:`publish_sharded_manifest`)."""
        local_dir = Path(local_dir)
        files, rels = local_files(local_dir)
        return self.upload_files(local_dir, files, rels, self.version_prefix(int(version)))

    def publish_sharded_manifest(self, version: int, *, kind: str, step: int, dtype: str,
                                 files: dict[str, FileEntry], shards: dict,
                                 base: int | None = None, anchor: int | None = None,
                                 extra: dict[str, Any] | None = None) -> WeightsManifest:
        """The manifest of a sharded version whose files every rank has uploaded; each listed
        file is checked to be in the bucket with its size first (a rank's upload that did not
        land leaves the version without a manifest, i.e. absent)."""
        version = int(version)
        vprefix = self.claim(version)
        manifest = WeightsManifest(
            run=self.run, version=version, step=int(step), kind=kind, base=base,
            anchor=version if kind == ANCHOR else int(anchor if anchor is not None else -1),
            dtype=dtype, files=dict(files), created=created_now(),
            extra=dict(extra or {}), format=WEIGHTS_FORMAT_SHARDED, shards=shards)
        WeightsManifest.from_json(manifest.to_json(), where="new manifest")  # same rules as readers
        present = self.objects.list(vprefix)  # one listing, not a request per file
        for rel, entry in files.items():
            if present.get(vprefix + rel) != entry.size:
                raise WeightsIncomplete(f"{self.url(vprefix + rel)} has "
                                        f"{present.get(vprefix + rel)} bytes, its rank uploaded "
                                        f"{entry.size}: no manifest")
        self.put_manifest(vprefix, manifest)
        log.info("published %s (%s, sharded over %d ranks, %d files, %d bytes) to %s",
                 self.name(version), kind, shards["world"], len(files), manifest.total_bytes,
                 self.url(vprefix))
        return manifest

    # -- retention ---------------------------------------------------------------------------

    def prune(self, retention: int, max_staleness: int = 0) -> list[int]:
        """Delete versions no replica can need; returns the deleted versions.

        Keeps the newest ``max(retention, max_staleness + 2)`` complete versions and, below
        them, everything back to the newest anchor at or before the oldest of those (its
        chain). Older versions, complete or partial, are deleted; newer partial ones may be
        in flight and are left alone.
        """
        keep = max(int(retention), int(max_staleness) + 2, 1)
        complete, seen = self.versions_in.scan()
        kept = sorted(complete)[-keep:]
        if not kept:
            return []
        floor = None
        for v in sorted((c for c in complete if c <= kept[0]), reverse=True):
            if self.manifest(v).kind == ANCHOR:
                floor = v
                break
        if floor is None:  # no anchor below: nothing older can be dropped safely
            return []
        doomed = sorted(v for v in seen if v < floor)
        for v in doomed:
            self.delete_version(v)
        if doomed:
            log.info("pruned weight versions %s of run %s (chain from anchor v%d kept)",
                     doomed, self.run, floor)
        return doomed
