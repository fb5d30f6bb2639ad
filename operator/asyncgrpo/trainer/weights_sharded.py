"""Full fine-tuning with several ranks: every rank publishes its own shard of each version.

:class:`~asyncgrpo.trainer.weights.BucketWeightTransfer` behind TRL's stream gathers every
parameter to rank 0, which keeps a full CPU copy (the base of the next delta) and uploads every
byte. :class:`ShardedWeightTransfer` is called on *every* rank with the model's own
parameters (FSDP2 DTensors, expert-parallel experts): each rank takes what it owns
(``asyncgrpo.weights.shards``: the DTensor's local block, replicated tensors once), diffs it
against its own previous shard, writes and uploads its own object, in parallel with the
others. The ranks then exchange their file entries and piece tables over a gloo group (CPU
collectives between trainer ranks; nothing between trainer and vLLM), and rank 0 writes the
manifest once every rank's object is in the bucket (it checks the listing first). Per-rank
memory for publication is one shard, not the model; no parameter is gathered.

Agreement: whether a version is an anchor or a delta is the same on every rank (the anchor
interval is shared; a rank whose shard changed shape, or deltas that together outweigh the
anchor, make it an anchor everywhere: one ``all_gather`` decides). A failure on any rank (a
permanent S3 error, a version that exists) raises on every rank, so no rank's base moves past
a version that was not published.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator

from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.weights.shards import (
    anchor_name,
    delta_name,
    delta_pieces,
    iter_pieces,
    merge_tables,
    table_entry,
)
from asyncgrpo.weights.store import ANCHOR, DELTA

log = logging.getLogger(__name__)


class PublishFailed(RuntimeError):
    """A rank could not do its part of a version: raised on every rank."""


class ShardedWeightTransfer(BucketWeightTransfer):
    """Per-rank publication (module docstring). Same arguments as the parent, plus the rank,
    the world and the gloo group the ranks agree over (None: the default group, which must
    then be gloo)."""

    def __init__(self, store, work_dir, *, rank: int, world: int, group=None, **kwargs):
        super().__init__(store, work_dir, **kwargs)
        self.rank, self.world, self.group = int(rank), int(world), group
        self.work_dir = self.work_dir / f"rank-{self.rank}"
        self._started = False


    # -- collectives -------------------------------------------------------------------------

    def _gather(self, obj) -> list:
        import torch.distributed as dist

        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _agree(self, what: str, fn):
        """Run ``fn`` on this rank; every rank learns every rank's result, or raises if any
        failed."""
        try:
            mine = (True, fn())
        except Exception as err:  # noqa: BLE001 - carried to every rank, raised below
            mine = (False, f"{type(err).__name__}: {err}"[:500])
        results = self._gather(mine)
        failed = {r: res for r, (ok, res) in enumerate(results) if not ok}
        if failed:
            raise PublishFailed(f"{what} failed on rank(s) {sorted(failed)}: "
                                f"{next(iter(failed.values()))}")
        return [res for _ok, res in results]

    # -- WeightTransferProtocol (every rank calls it) ----------------------------------------

    def init_weight_transfer(self) -> None:
        """Numbering continues after the newest version in the bucket, as rank 0 reads it at
        the next :meth:`send_weights`: TRL calls this on rank 0 only, so it cannot be a
        collective itself."""
        self._started = False

    def _start(self) -> None:
        latest = self._agree("listing the bucket",
                             lambda: self.store.latest() if self.rank == 0 else None)[0]
        self.version = latest or 0
        self._started = True
        log.info("sharded weights publish (rank %d of %d) to %s after v%d", self.rank,
                 self.world, self.store.url(self.store.root), self.version)

    def send_weights(self, iterator: Iterator[tuple[str, object]]) -> None:
        """Publish the next version from this rank's ``(name, parameter)`` pairs (local
        DTensors, not gathered)."""
        from safetensors.torch import save_file

        t0 = time.time()
        if not getattr(self, "_started", False):
            self._start()
        version = self.version + 1
        full = self._prev is None or version - self.anchor >= self.anchor_interval
        current: dict = {} if self._prev is None else self._prev
        self._prev = None  # a failure below leaves no half-updated base behind
        delta: dict = {}
        table: dict = {}
        seen: set = set()
        reshaped = False
        changed = total = 0
        afile = anchor_name(self.rank, self.world)
        for name, piece, gshape, offset in iter_pieces(iterator, self.rank, self.dtype,
                                                       self.to_checkpoint):
            total += piece.numel()
            seen.add(name)
            table[name] = table_entry(str(piece.dtype).removeprefix("torch."), gshape, afile,
                                      offset, piece.shape)
            if not full and not reshaped:
                old = current.get(name)
                if old is None or old.shape != piece.shape or old.dtype != piece.dtype:
                    reshaped = True  # only an anchor can carry that
                else:
                    d = delta_pieces(name, piece, old, gshape, offset)
                    if d:
                        changed += d[f"idx:{name}"].numel()
                        delta.update(d)
            current[name] = piece
        for gone in set(current) - seen:
            reshaped = True
            del current[gone]
        anchor_bytes = sum(t.numel() * t.element_size() for t in current.values())
        delta_bytes = sum(t.numel() * t.element_size() for t in delta.values())
        votes = self._gather((reshaped, anchor_bytes, delta_bytes, total, changed,
                              next((str(t.dtype) for t in current.values()), None)))
        if not any(v[3] for v in votes):
            raise ValueError("send_weights got no tensors on any rank")
        diffed = not full
        full = full or any(v[0] for v in votes) or (
            sum(v[2] for v in votes) >= sum(v[1] for v in votes))
        dtype = next(v[5] for v in votes if v[5] is not None).removeprefix("torch.")
        out = self.work_dir / f"v{version}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if full and current:
            save_file(current, str(out / afile), metadata={"format": "pt"})
        elif not full and delta:
            save_file(delta, str(out / delta_name(self.rank, self.world)),
                      metadata={"format": "pt"})
        t_write = time.time()
        # rank 0 first makes sure the version is not complete (versions are immutable), and
        # only then does any rank put an object under it
        self._agree(f"claiming v{version}", lambda: self.rank == 0 and self._publish(
            lambda: self.store.claim(version)))
        parts = self._agree(f"uploading v{version}", lambda: (
            self._publish(lambda: self.store.upload_rank_files(out, version)),
            table if full else {}))
        t_upload = time.time()
        shutil.rmtree(out, ignore_errors=True)
        kind = ANCHOR if full else DELTA

        def write_manifest():
            files = {rel: e for entries, _t in parts for rel, e in entries.items()}
            shards = {"world": self.world,
                      "ranks": {str(r): sorted(entries) for r, (entries, _t) in enumerate(parts)
                                if entries}}
            if full:
                shards["tensors"] = merge_tables(t for _e, t in parts)
            extra = {"elements": sum(v[3] for v in votes), **self.pending_extra}
            if not full:
                extra["changed_elements"] = sum(v[4] for v in votes)
            return self._publish(lambda: self.store.publish_sharded_manifest(
                version, kind=kind, step=self.step_fn(), dtype=dtype, files=files,
                shards=shards, base=None if full else self.version,
                anchor=version if full else self.anchor, extra=extra))

        manifest = self._agree(f"the manifest of v{version}",
                               lambda: write_manifest() if self.rank == 0 else None)[0]
        self._prev, self.version = current, version
        self.anchor = version if full else self.anchor
        self.pending_extra = {}
        mine = sum(e.size for e in parts[self.rank][0].values())
        record = {"version": version, "kind": kind, "rank": self.rank, "rank_bytes": mine,
                  "bytes": sum(e.size for p in parts for e in p[0].values()),
                  "elements": sum(v[3] for v in votes),
                  "changed_elements": sum(v[4] for v in votes) if diffed else None,
                  "write_s": t_write - t0, "upload_s": t_upload - t_write,
                  "publish_s": time.time() - t0, "published_at": time.time(),
                  "step": self.step_fn()}
        if self.rank == 0:
            if version in self.fault_versions:
                self._corrupt(manifest)
            record["rank_bytes_all"] = manifest.rank_bytes()
            try:
                self.store.prune(self.retention, self.max_staleness)
            except Exception as err:  # noqa: BLE001 - old versions linger; the next publish retries
                log.warning("pruning weight versions failed: %s", err)
        self.published.append(record)
        log.info("rank %d published its shard of weights v%d (%s, %d of %d bytes) in %.2fs",
                 self.rank, version, kind, mine, record["bytes"], time.time() - t0)


def gloo_group():
    """A gloo group over every rank for the publishers' small exchanges (the default group
    when it is gloo already, as on CPU; a new one beside NCCL on GPUs). A collective: every
    rank calls it, in the same order."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
