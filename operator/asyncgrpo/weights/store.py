"""Versioned full weights in the run's bucket: anchors every K versions, sparse deltas between.

Layout (one run; the run's folder is the adapter store's, so wherever a run's objects live,
its weights live beside its adapters)::

    <run folder>/weights/v1/model.safetensors            anchor (checkpoint names and layout)
    <run folder>/weights/v1/manifest.json                <- written last
    <run folder>/weights/v2/delta.safetensors            delta against v1
    <run folder>/weights/v2/manifest.json
    ...
    <run folder>/weights/v{K+1}/model.safetensors        next anchor

The adapter store's invariants hold here too (its transport, retries and error types are
reused): a version exists once its manifest exists, versions are immutable, deletion removes
the manifest first, every file is checked against the manifest's size and sha256 before use.
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asyncgrpo.adapters.store import (
    MANIFEST,
    AdapterCorrupt,
    AdapterIncomplete,
    AdapterNotFound,
    AdapterStore,
    AdapterVersionExists,
    FileEntry,
    _check_relpath,
    parse_files,
    replace_verified,
)

log = logging.getLogger(__name__)

WEIGHTS_FORMAT = "asyncgrpo.weights/v1"
ANCHOR, DELTA = "anchor", "delta"
#: Default ``spec.model.full.anchorInterval``: a full version every K versions.
DEFAULT_ANCHOR_INTERVAL = 10

# The adapter store's error types, under the names readers of this module expect.
WeightsCorrupt = AdapterCorrupt
WeightsIncomplete = AdapterIncomplete
WeightsNotFound = AdapterNotFound
WeightsVersionExists = AdapterVersionExists


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

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        doc = {
            "format": self.format, "run": self.run, "version": self.version, "step": self.step,
            "kind": self.kind, "base": self.base, "anchor": self.anchor, "dtype": self.dtype,
            "created": self.created,
            "files": {k: {"sha256": v.sha256, "size": v.size} for k, v in sorted(self.files.items())},
            "extra": self.extra,
        }
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> WeightsManifest:
        """Parse and validate; anything unexpected is :class:`WeightsCorrupt`."""
        try:
            doc = json.loads(text)
            if doc.get("format") != WEIGHTS_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
            files = parse_files(doc)
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
                       created=str(doc.get("created", "")), extra=dict(doc.get("extra") or {}))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsCorrupt(f"{where} is not a valid weights manifest: {e}") from None


class WeightStore(AdapterStore):
    """Publish, list, fetch and prune the weight versions of one run.

    Built on :class:`AdapterStore` for its S3 transport (retries, error classification,
    verified downloads, complete versions); only the key space and the manifest differ.
    """

    FOLDER = "weights"

    def name(self, version: int) -> str:
        return f"weights v{int(version)}"

    # -- reading -----------------------------------------------------------------------------

    def manifest(self, version: int) -> WeightsManifest:  # type: ignore[override]
        body, key = self._manifest_body(version)
        m = WeightsManifest.from_json(body, where=self.url(key))
        if m.version != int(version):
            raise WeightsCorrupt(f"{self.url(key)} says version {m.version}, expected {version}")
        return m

    def fetch(self, version: int, dest: str | Path,  # type: ignore[override]
              manifest: WeightsManifest | None = None) -> tuple[Path, WeightsManifest]:
        """Download a complete version into ``dest``, verified (sizes, sha256) before it appears."""
        manifest = manifest or self.manifest(version)
        return replace_verified(Path(dest), manifest,
                                lambda tmp: self._download_verified(version, manifest, tmp))

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
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        rels = [p.relative_to(local_dir).as_posix() for p in files]
        for rel in rels:
            _check_relpath(rel)
        vprefix = self._claim(version)
        entries = self._upload_files(local_dir, files, rels, vprefix)
        manifest = WeightsManifest(
            run=self.run, version=version, step=int(step), kind=kind, base=base,
            anchor=version if kind == ANCHOR else int(anchor if anchor is not None else -1),
            dtype=dtype, files=entries, created=datetime.now(UTC).isoformat(timespec="seconds"),
            extra=dict(extra or {}))
        WeightsManifest.from_json(manifest.to_json(), where="new manifest")  # same rules as readers
        self.objects.put_bytes(vprefix + MANIFEST, manifest.to_json().encode(),
                               content_type="application/json")
        log.info("published %s (%s, %d files, %d bytes) to %s", self.name(version), kind,
                 len(entries), manifest.total_bytes, self.url(vprefix))
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
