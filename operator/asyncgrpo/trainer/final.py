"""The run's result, written once more at the end of training as `<run folder>/final/`.

Why a copy: versions are pruned (`retention`), checkpoints carry optimizer state and the
names a resume needs, and neither says which object is the model. `final/` is the one place
a user looks, in a layout the usual loaders take directly:

* LoRA: the last published adapter (`adapter_config.json`, `adapter_model.safetensors`) plus
  the tokenizer's files: `PeftModel.from_pretrained(base, final_dir)`, vLLM
  `--lora-modules name=final_dir`.
* Full: the weights of the last published version in checkpoint names (the anchor layout,
  `model.safetensors` or shards with their index), the base model's `config.json` (and
  `generation_config.json`), and the tokenizer: `AutoModelForCausalLM.from_pretrained(dir)`,
  vLLM `--model dir`.

The last published version is the trained model: TRL syncs after every optimizer step, the
last one included, and a publish is retried until it is in. Its manifest is the store's own
format (the adapter manifest for LoRA, the weights manifest, kind anchor, for full), written
last, with `extra.final: true` and the version it was made from. Rank 0 writes it; it needs
no collective (the LoRA files come back from the bucket, verified; the full weights are
rank 0's CPU copy of the last version, the base of its next delta, or, when the ranks
published their own shards, the last version rebuilt from the bucket on disk the way a
vLLM replica's puller builds it, so no process ever holds the whole model).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

LORA, FULL = "lora", "full"


def output_record(store, manifest, kind: str) -> dict:
    """What `status.outputs` says of the result: where it is and what it is."""
    return {"bucket": store.bucket, "key": store.final_prefix, "kind": kind,
            "step": int(manifest.step), "version": int(manifest.version)}


def write_final_lora(store, tokenizer=None, *, extra: dict | None = None):
    """final/ from the newest complete adapter version; None when none was published."""
    from dataclasses import replace

    version = store.latest()
    if version is None:
        return None
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-final-") as tmp:
        src, manifest = store.fetch(version, Path(tmp) / f"v{version}")
        out = Path(tmp) / "final"
        shutil.copytree(src, out)
        (out / "manifest.json").unlink(missing_ok=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        final = replace(manifest, extra={**manifest.extra, **(extra or {}), "final": True,
                                         "kind": LORA, "source": store.name(version)})
        return store.publish_final(out, final)


def write_final_full(weight_store, tensors: dict, *, version: int, step: int,
                     base_model: str, tokenizer=None, extra: dict | None = None):
    """final/ from `tensors` (checkpoint name -> CPU tensor, the last published version),
    with the base model's config so transformers and vLLM load the folder as a model."""
    from asyncgrpo.weights.format import write_anchor

    if not tensors:
        return None
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-final-") as tmp:
        out = Path(tmp) / "final"
        write_anchor(tensors, out)
        return _publish_model_folder(weight_store, out, version=version, step=step, dtype=dtype,
                                     base_model=base_model, tokenizer=tokenizer, extra=extra)


def write_final_full_from_bucket(weight_store, *, version: int, step: int, base_model: str,
                                 tokenizer=None, extra: dict | None = None):
    """final/ from version `version` as the bucket holds it (a sharded run: every rank
    published only its own shard), rebuilt on local disk by the puller's own code."""
    from asyncgrpo.weights.puller import Puller

    with tempfile.TemporaryDirectory(prefix="asyncgrpo-final-") as tmp:
        puller = Puller(weight_store, vllm=None, work_dir=Path(tmp) / "copy", probe=False)
        copy = puller.build_local_copy(version)
        out = Path(tmp) / "final"
        out.mkdir()
        for f in copy.glob("*.safetensors*"):
            os.replace(f, out / f.name)  # same folder tree: a rename, no second copy
        for f in copy.glob("*.index.json"):
            os.replace(f, out / f.name)
        dtype = weight_store.manifest(version).dtype
        return _publish_model_folder(weight_store, out, version=version, step=step, dtype=dtype,
                                     base_model=base_model, tokenizer=tokenizer, extra=extra)


def _publish_model_folder(weight_store, out: Path, *, version: int, step: int, dtype: str,
                          base_model: str, tokenizer, extra: dict | None):
    """Add the base model's config (and generation config) and the tokenizer to a folder of
    checkpoint-layout weights, and publish it as final/ with its manifest last."""
    from transformers import AutoConfig, GenerationConfig

    from asyncgrpo.weights.store import ANCHOR, WeightsManifest

    AutoConfig.from_pretrained(base_model).save_pretrained(str(out))
    try:
        GenerationConfig.from_pretrained(base_model).save_pretrained(str(out))
    except OSError:
        pass  # the base has none: transformers' defaults apply
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    manifest = WeightsManifest(
        run=weight_store.run, version=int(version), step=int(step), kind=ANCHOR, base=None,
        anchor=int(version), dtype=dtype, files={},
        extra={**(extra or {}), "final": True, "kind": FULL,
               "source": weight_store.name(version), "base_model": base_model})
    return weight_store.publish_final(out, manifest)


def write_final(trainer, run, tokenizer) -> dict | None:
    """The run's final/ from a trainer that finished (rank 0 only); the `status.outputs`
    record, or None when nothing was published. A failure is logged, never raised: the
    versions and checkpoints are in the bucket whatever happens here."""
    try:
        if run.spec.model.finetuning == "lora":
            manifest = write_final_lora(trainer._store, tokenizer)
            return None if manifest is None else output_record(trainer._store, manifest, LORA)
        weights = trainer._weights
        if weights is None or weights._prev is None or not weights.version:
            return None
        step = weights.published[-1]["step"] if weights.published else trainer.state.global_step
        if getattr(weights, "world", 1) > 1:
            # a sharded publisher holds only its own shard: rebuild the version from the bucket
            manifest = write_final_full_from_bucket(
                weights.store, version=weights.version, step=step,
                base_model=run.spec.model.name, tokenizer=tokenizer)
        else:
            manifest = write_final_full(
                weights.store, weights._prev, version=weights.version, step=step,
                base_model=run.spec.model.name, tokenizer=tokenizer)
        return None if manifest is None else output_record(weights.store, manifest, FULL)
    except Exception as err:  # noqa: BLE001 - the run's versions and checkpoints stand
        log.error("the final result was not written to final/: %s", err)
        return None
