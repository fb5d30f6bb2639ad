"""Full fine-tuning: the policy's weights go to the bucket, not over NCCL (TRL's protocol).

TRL 1.16's AsyncGRPOTrainer syncs full weights through a ``WeightTransferProtocol`` object
(``init_weight_transfer``, ``pause``, ``send_weights(iterator)``, ``resume``, ``destroy``). Its
default, ``WeightTransferClient``, needs vLLM installed in the trainer, NCCL on both sides,
one server URL and a port from trainer to vLLM. :class:`BucketWeightTransfer` implements the
same protocol by publishing each version to the run's bucket (``asyncgrpo.weights.store``):
a full anchor every ``anchor_interval`` versions, a sparse delta against the previous version
otherwise, manifest last. Each vLLM replica's puller (``asyncgrpo.weights.puller``) follows
the manifests and swaps the weights in on its own: any number of replicas, no port between
trainer and vLLM, NCCL nowhere.

One process only: TRL hands this ``send_weights`` full tensors, and under FSDP2 it would
gather every parameter to rank 0, which would keep a full CPU copy (the base of the next
delta) and upload every byte. With several ranks the trainer uses
``asyncgrpo.trainer.weights_sharded.ShardedWeightTransfer`` instead: every rank publishes its
own shard. This class is also the benchmark's gather-to-rank-0 baseline (bench/weights_bench.py).

``pause``/``resume`` do nothing: replicas pause themselves, one at a time, only for the swap
(``/pause?mode=keep`` -> ``reload_weights`` -> ``/resume``), so generation never stops for
the trainer's upload.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from asyncgrpo.weights.format import delta_tensors, write_anchor, write_delta
from asyncgrpo.weights.store import (
    ANCHOR,
    DEFAULT_ANCHOR_INTERVAL,
    DELTA,
    WeightsManifest,
    WeightStore,
)

log = logging.getLogger(__name__)


class BucketWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over the bucket (one process; see module docstring).

    Arguments:
      store: the run's :class:`WeightStore`.
      work_dir: local staging directory for the files of one version.
      anchor_interval: a full version every this many versions (the first of a process is
        always full: it has no previous version in memory to diff against).
      dtype: dtype the weights are published in (default: each tensor's own).
      retention / max_staleness: passed to :meth:`WeightStore.prune` after each publish.
      step_fn: the trainer's current step, recorded in manifests.
      publish: wraps the store call (the trainer passes its retry-until-done wrapper).
      fault_corrupt_versions: versions overwritten in the bucket right after publishing
        (fault injection: exercises the pullers' refusal path for real).
      to_checkpoint: maps a {name: tensor} piece of the stream to checkpoint names and layout
        (transformers' ``revert_weight_conversion``: a MoE's fused ``experts.gate_up_proj`` becomes
        the per-expert ``experts.{e}.gate_proj.weight``/``up_proj.weight`` that vLLM and
        ``from_pretrained`` read). Identity for dense models.
    """

    def __init__(self, store: WeightStore, work_dir: str | Path, *,
                 anchor_interval: int = DEFAULT_ANCHOR_INTERVAL, dtype=None,
                 retention: int = 8, max_staleness: int = 0,
                 step_fn: Callable[[], int] = lambda: 0,
                 publish: Callable[[Callable[[], WeightsManifest]], WeightsManifest] | None = None,
                 fault_corrupt_versions=(), to_checkpoint=None):
        if anchor_interval < 1:
            raise ValueError("anchor_interval must be >= 1")
        self.store = store
        self.work_dir = Path(work_dir)
        self.anchor_interval = int(anchor_interval)
        self.dtype = dtype
        self.retention = retention
        self.max_staleness = max_staleness
        self.step_fn = step_fn
        self._publish = publish or (lambda fn: fn())
        self.fault_versions = {int(v) for v in fault_corrupt_versions}
        self.to_checkpoint = to_checkpoint
        self.version = 0  # last published version (the bucket's newest after init)
        self.anchor = 0  # version of the anchor the current chain starts from
        self._prev: dict | None = None  # CPU copy of the last published version
        self.pending_extra: dict = {}  # added to the next manifest (e.g. the trained probe)
        self.published: list[dict] = []

    # -- WeightTransferProtocol --------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Continue after the newest version in the bucket (numbers are never reused)."""
        self.version = self.store.latest() or 0
        log.info("full weights publish to %s after v%d (anchor every %d versions)",
                 self.store.url(self.store.root), self.version, self.anchor_interval)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        self._prev = None

    def send_weights(self, iterator: Iterator[tuple[str, object]]) -> None:
        """Publish the next version from TRL's (name, full tensor) stream."""
        t0 = time.time()
        version = self.version + 1
        full = self._prev is None or version - self.anchor >= self.anchor_interval
        # Updated in place, tensor by tensor: rank 0 holds about one copy, not two.
        current: dict = {} if self._prev is None else self._prev
        self._prev = None  # a failure below leaves no half-updated base behind
        delta: dict = {}
        changed = total = 0
        for name, t in self._checkpoint_tensors(iterator):
            total += t.numel()
            if not full:
                old = current.get(name)
                if old is None or old.shape != t.shape or old.dtype != t.dtype:
                    full = True  # the model changed shape: only an anchor can carry that
                else:
                    d = delta_tensors(name, t, old)
                    if d:
                        changed += d[f"idx:{name}"].numel()
                        delta.update(d)
            current[name] = t
        if not current:
            raise ValueError("send_weights got no tensors")
        diffed = not full  # a diff against the previous version was computed
        if not full:
            # index + value per changed element: past about a third of the elements (bf16)
            # a delta outweighs the full copy, and an anchor also shortens the chain
            anchor_bytes = sum(t.numel() * t.element_size() for t in current.values())
            delta_bytes = sum(t.numel() * t.element_size() for t in delta.values())
            full = delta_bytes >= anchor_bytes
        dtype = str(next(iter(current.values())).dtype).removeprefix("torch.")
        out = self.work_dir / f"v{version}"
        shutil.rmtree(out, ignore_errors=True)
        extra = {"elements": total, **self.pending_extra}
        if full:
            write_anchor(current, out)
            kind, base, anchor = ANCHOR, None, version
        else:
            write_delta(delta, out)
            kind, base, anchor = DELTA, self.version, self.anchor
            extra["changed_elements"] = changed
        t_write = time.time()
        manifest = self._publish(lambda: self.store.publish_version(
            out, version, kind=kind, step=self.step_fn(), dtype=dtype, base=base,
            anchor=anchor, extra=extra))
        shutil.rmtree(out, ignore_errors=True)
        self._prev, self.version, self.anchor = current, version, anchor
        self.pending_extra = {}
        if version in self.fault_versions:
            self._corrupt(manifest)
        record = {"version": version, "kind": kind, "bytes": manifest.total_bytes,
                  "elements": total, "changed_elements": changed if diffed else None,
                  "write_s": t_write - t0, "upload_s": time.time() - t_write,
                  "published_at": time.time(), "step": manifest.step}
        self.published.append(record)
        log.info("published weights v%d (%s, %d bytes, %s/%d elements changed) in %.2fs",
                 version, kind, manifest.total_bytes, changed if diffed else "all", total,
                 time.time() - t0)
        try:
            self.store.prune(self.retention, self.max_staleness)
        except Exception as err:  # noqa: BLE001 - old versions linger; the next publish retries
            log.warning("pruning weight versions failed: %s", err)

    def _checkpoint_tensors(self, iterator):
        """(checkpoint name, contiguous CPU tensor in the publish dtype), one piece at a time."""
        for name, tensor in iterator:
            t = tensor.detach().to("cpu", dtype=self.dtype or tensor.dtype)
            pieces = {name: t} if self.to_checkpoint is None else self.to_checkpoint({name: t})
            for ck_name, piece in pieces.items():
                piece = piece.contiguous()
                if piece.data_ptr() == tensor.data_ptr():
                    piece = piece.clone()  # the stream may hand out live parameters
                yield ck_name, piece

    def _corrupt(self, manifest: WeightsManifest) -> None:
        rel = next(k for k in manifest.files if k.endswith(".safetensors"))
        key = self.store.overwrite(manifest.version, rel, b"corrupted")
        log.warning("fault injection: corrupted %s", self.store.url(key))
