"""The two file kinds of a weights version: a full anchor and a sparse delta.

Anchor: the model's own checkpoint layout (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when sharded), with the
names ``transformers`` uses, so vLLM (``reload_weights``) and ``from_pretrained`` read it as is.

Delta: ``delta.safetensors`` holding, for every tensor with at least one changed element,
``idx:<name>`` (flat element indices, int32 below 2**31 elements, else int64) and
``val:<name>`` (the new values, in the model's dtype). Values, not differences: applying a
delta is a copy, so a replica's local copy is bit-identical to the trainer's version, whatever
the dtype. "Changed" is decided on the bits (so -0.0/+0.0 and NaN payloads round-trip).

Applying a delta writes into the local copy's safetensors files in place (memory-mapped), so a
replica needs one full copy on disk and only the delta's size in memory. The files' byte
layout never changes (same names, shapes, dtypes), only the payload bytes of changed elements.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ANCHOR_SINGLE = "model.safetensors"
ANCHOR_INDEX = "model.safetensors.index.json"
DELTA_FILE = "delta.safetensors"
IDX, VAL = "idx:", "val:"
#: Shard anchors like ``save_pretrained`` does, so no single object is unreasonably large.
DEFAULT_SHARD_BYTES = 5 * 1024**3

# safetensors dtype names -> numpy integer type of the same width (bits are copied, not cast)
_BITS = {"F64": np.uint64, "I64": np.uint64, "U64": np.uint64,
         "F32": np.uint32, "I32": np.uint32, "U32": np.uint32,
         "F16": np.uint16, "BF16": np.uint16, "I16": np.uint16, "U16": np.uint16,
         "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "I8": np.uint8, "U8": np.uint8,
         "BOOL": np.uint8}


class DeltaMismatch(ValueError):
    """A delta names a tensor or index the local copy does not have: never half-applied."""


def _int_view(t):
    """The tensor's bits as a same-width integer tensor (torch)."""
    import torch

    width = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])


def changed_indices(new, old):
    """Flat indices where ``new`` and ``old`` differ bitwise (both contiguous, same dtype)."""
    import torch

    if new.shape != old.shape or new.dtype != old.dtype:
        raise DeltaMismatch(f"shape/dtype changed: {tuple(old.shape)} {old.dtype} -> "
                            f"{tuple(new.shape)} {new.dtype}")
    diff = (_int_view(new) != _int_view(old)).reshape(-1)
    idx = torch.nonzero(diff, as_tuple=False).reshape(-1)
    return idx.to(torch.int32 if new.numel() < 2**31 else torch.int64)


def delta_tensors(name: str, new, old) -> dict:
    """``{idx:name, val:name}`` for one tensor, or {} when nothing changed."""
    idx = changed_indices(new, old)
    if idx.numel() == 0:
        return {}
    return {IDX + name: idx.contiguous(), VAL + name: new.reshape(-1)[idx.long()].contiguous()}


def write_anchor(tensors: dict, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``tensors`` (name -> contiguous CPU tensor) in the checkpoint layout; returns the
    files written (relative names)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / ANCHOR_SINGLE), metadata=meta)
        return [ANCHOR_SINGLE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        files.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / ANCHOR_INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    return files + [ANCHOR_INDEX]


def write_delta(tensors: dict, out_dir: Path, metadata: dict[str, str] | None = None) -> list[str]:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / DELTA_FILE), metadata={"format": "pt", **(metadata or {})})
    return [DELTA_FILE]


# -- reading and patching safetensors files without loading them -------------------------------


def read_header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def anchor_files(local_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (single or sharded)."""
    index = local_dir / ANCHOR_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [local_dir / n for n in names]
    return [local_dir / ANCHOR_SINGLE]


def tensor_locations(local_dir: Path) -> dict[str, tuple[Path, int, str, int]]:
    """name -> (file, absolute byte offset, safetensors dtype, element count)."""
    out = {}
    for path in anchor_files(local_dir):
        base, header = read_header(path)
        for name, info in header.items():
            start, end = info["data_offsets"]
            numel = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
            width = np.dtype(_BITS[info["dtype"]]).itemsize
            if end - start != numel * width:
                raise DeltaMismatch(f"{path.name}: {name} has {end - start} bytes for {numel} "
                                    f"elements of {info['dtype']}")
            out[name] = (path, base + start, info["dtype"], numel)
    return out


def iter_delta(delta_path: Path) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(tensor name, flat indices, values as same-width unsigned ints) per changed tensor."""
    from safetensors import safe_open

    with safe_open(str(delta_path), framework="pt") as f:
        keys = set(f.keys())
        names = sorted(k[len(IDX):] for k in keys if k.startswith(IDX))
        if {IDX + n for n in names} | {VAL + n for n in names} != keys:
            raise DeltaMismatch(f"{delta_path.name}: keys are not idx:/val: pairs")
        for name in names:
            idx = f.get_tensor(IDX + name)
            val = f.get_tensor(VAL + name)
            if idx.ndim != 1 or val.ndim != 1 or idx.numel() != val.numel():
                raise DeltaMismatch(f"{delta_path.name}: {name}: {idx.numel()} indices for "
                                    f"{val.numel()} values")
            yield name, idx.numpy().astype(np.int64, copy=False), _int_view(val).numpy()


def apply_delta(local_dir: Path, delta_path: Path) -> tuple[int, int]:
    """Write a delta's values into the local copy's files; returns (tensors, elements) patched.

    Everything is checked before the first byte is written (names, index range, dtype width),
    so a delta that does not fit this copy raises :class:`DeltaMismatch` and changes nothing.
    """
    return apply_deltas(local_dir, [delta_path])


def apply_deltas(local_dir: Path, delta_paths: list[Path]) -> tuple[int, int]:
    """:func:`apply_delta` for several files at once (one per trainer rank of a sharded
    version): all of them are checked before any is written."""
    where = tensor_locations(local_dir)
    plan = []
    for delta_path in delta_paths:
        for name, idx, bits in iter_delta(delta_path):
            if name not in where:
                raise DeltaMismatch(f"delta names {name!r}, which the local copy does not have")
            path, offset, dtype, numel = where[name]
            width = np.dtype(_BITS[dtype]).itemsize
            if bits.dtype.itemsize != width:
                raise DeltaMismatch(f"{name}: delta values are {bits.dtype.itemsize}-byte, the "
                                    f"copy holds {dtype}")
            if idx.size and (idx.min() < 0 or idx.max() >= numel):
                raise DeltaMismatch(f"{name}: index out of range for {numel} elements")
            plan.append((path, offset, numel, idx, bits))
    elements = 0
    by_file: dict[Path, list] = {}
    for item in plan:
        by_file.setdefault(item[0], []).append(item[1:])
    for path, items in by_file.items():
        mm = np.memmap(path, dtype=np.uint8, mode="r+")
        try:
            for offset, numel, idx, bits in items:
                width = bits.dtype.itemsize
                view = mm[offset:offset + numel * width].view(bits.dtype)
                view[idx] = bits  # safetensors and every host we run on are little-endian
                elements += idx.size
            mm.flush()
        finally:
            del mm
    return len(plan), elements
