"""Sharded weight versions: each trainer rank's own piece of every tensor, and their assembly.

Why: gathering every parameter to rank 0 makes one process hold a full CPU copy (the base of
the next delta: 61 GB at 30B in bf16) and pushes every byte through one uplink. Instead each
rank publishes what it owns (its FSDP2 shard: the DTensor's local block; with expert parallel,
its experts) as its own object, diffed against its own previous shard.

A **piece** is one rank's block of one checkpoint tensor: ``(file, offset, shape)`` inside the
tensor's global shape (an N-d box; FSDP2's ``Shard(0)`` gives a row range, but any box
works). On the bucket, per version (``format: asyncgrpo.weights/v2``):

* anchor: ``shard-{r:05d}-of-{W:05d}.safetensors`` per rank, holding its pieces under the
  checkpoint names; the manifest's ``shards.tensors`` maps every name to its dtype, global
  shape and pieces. The puller assembles the checkpoint layout (:func:`assemble_anchor`) by
  copying each piece into place, memory-mapped: memory is one piece, not the model.
* delta: ``delta-{r:05d}-of-{W:05d}.safetensors`` per rank with changed elements (``idx:`` as
  *global* flat indices into the checkpoint tensor, ``val:`` new values), so the existing
  in-place patcher applies every rank's file to the assembled copy unchanged; ranks whose
  shard did not change write no file.

Ownership: a replicated tensor (a plain tensor on every rank, or a DTensor ``Replicate`` mesh
dimension as in HSDP) is published by the ranks at coordinate 0 of its replicated dimensions
only, so nothing is uploaded twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from asyncgrpo.weights.format import (
    _BITS,
    ANCHOR_INDEX,
    ANCHOR_SINGLE,
    DEFAULT_SHARD_BYTES,
    IDX,
    VAL,
    DeltaMismatch,
    _int_view,
    read_header,
)

#: torch dtype name -> safetensors dtype name (the ones a model is published in)
ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
            "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
            "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def anchor_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def delta_name(rank: int, world: int) -> str:
    return f"delta-{rank:05d}-of-{world:05d}.safetensors"


# -- the trainer side: what this rank owns ----------------------------------------------------


def owned_block(param, rank: int):
    """(local block, global shape, offset) of what this rank publishes of ``param``, or None
    when another rank publishes it (replicated). Plain tensors are rank 0's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        if rank != 0:
            return None
        t = param.detach()
        return t, tuple(t.shape), (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = param.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh
        return None
    # A placement over a mesh dimension of size 1 places nothing (transformers' expert mesh
    # is (efsdp, ep) with a _StridedShard on efsdp = 1 when ep = fsdp): read it as Replicate.
    placements = [Replicate() if mesh.size(i) == 1 else p for i, p in enumerate(param.placements)]
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) and coord[dim] != 0:
            return None
    if any(type(p) not in (Shard, Replicate) for p in placements):
        raise ValueError(f"cannot publish a DTensor placed {param.placements} on mesh "
                         f"{tuple(mesh.shape)} without a gather")
    local = param.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"local block {tuple(local.shape)} != computed {tuple(shape)}")
    return local, tuple(param.shape), tuple(int(o) for o in offset)


def checkpoint_pieces(name: str, block, global_shape, offset,
                      to_checkpoint: Callable[[dict], dict] | None):
    """This rank's block of one in-memory parameter as checkpoint pieces:
    ``[(checkpoint name, tensor, global shape, offset)]``.

    Identity conversion: the block itself. A conversion that splits the leading (expert)
    dimension into per-expert tensors (transformers' ``revert_weight_conversion`` of a fused
    ``experts.gate_up_proj``): applied to the local experts, each result renamed to its global
    expert index, owned whole. Anything else cannot be converted from a block: refused (the
    caller says which parameter).
    """
    if to_checkpoint is None:
        return [(name, block, global_shape, offset)]
    out = to_checkpoint({name: block})
    if list(out) == [name] and tuple(out[name].shape) == tuple(block.shape):
        return [(name, out[name], global_shape, offset)]
    rows = block.shape[0] if block.dim() else 0
    if any(offset[1:]) or tuple(block.shape[1:]) != tuple(global_shape[1:]):
        raise ValueError(f"{name}: converted to {sorted(out)[:3]}..., but sharded beyond its "
                         f"leading dimension (offset {offset}): cannot publish per rank")
    pieces = []
    for ck, t in out.items():
        m = _EXPERT.search(ck)
        if m is None or int(m.group(1)) >= rows:
            raise ValueError(f"{name}: conversion gave {ck!r}, not a per-expert tensor of the "
                             f"local block: cannot publish per rank")
        e = int(m.group(1)) + int(offset[0])
        ck = ck[:m.start()] + f".experts.{e}." + ck[m.end():]
        pieces.append((ck, t, tuple(t.shape), (0,) * t.dim()))
    return pieces


def delta_pieces(name: str, new, old, global_shape, offset) -> dict:
    """``{idx:name, val:name}`` of the changed elements of one block, with *global* flat
    indices into the checkpoint tensor (so every rank's file patches the assembled copy);
    {} when nothing changed."""
    import torch

    from asyncgrpo.weights.format import changed_indices

    local = changed_indices(new, old).long()
    if local.numel() == 0:
        return {}
    total = int(np.prod(global_shape, dtype=np.int64)) if global_shape else 1
    if tuple(new.shape) == tuple(global_shape):
        glob = local
    else:
        coords = torch.unravel_index(local, tuple(new.shape))
        glob = torch.zeros_like(local)
        stride = 1
        for d in range(len(global_shape) - 1, -1, -1):
            glob += (coords[d] + int(offset[d])) * stride
            stride *= int(global_shape[d])
    idx = glob.to(torch.int32 if total < 2**31 else torch.int64)
    return {IDX + name: idx.contiguous(), VAL + name: new.reshape(-1)[local].contiguous()}


# -- the manifest's table of pieces ----------------------------------------------------------


def merge_tables(per_rank: Iterable[dict]) -> dict:
    """The ranks' ``{name: {dtype, shape, pieces}}`` tables as one, checked: every tensor's
    pieces are inside it, disjoint, and cover it exactly."""
    merged: dict[str, dict] = {}
    for table in per_rank:
        for name, t in table.items():
            have = merged.setdefault(name, {"dtype": t["dtype"], "shape": list(t["shape"]),
                                            "pieces": []})
            if have["dtype"] != t["dtype"] or have["shape"] != list(t["shape"]):
                raise ValueError(f"{name}: ranks disagree on dtype/shape")
            have["pieces"].extend(t["pieces"])
    for name, t in merged.items():
        t["pieces"].sort()
        check_cover(name, t)
    return merged


def check_cover(name: str, t: dict) -> None:
    """Pieces inside the tensor, pairwise disjoint, their sizes adding up to it: they tile it."""
    shape = [int(s) for s in t["shape"]]
    total = int(np.prod(shape, dtype=np.int64)) if shape else 1
    boxes, covered = [], 0
    for piece in t["pieces"]:
        _file, off, pshape = piece
        if len(off) != len(shape) or len(pshape) != len(shape):
            raise ValueError(f"{name}: piece {piece} has the wrong rank")
        if any(o < 0 or p < 0 or o + p > s for o, p, s in zip(off, pshape, shape)):
            raise ValueError(f"{name}: piece {piece} outside {shape}")
        box = [(int(o), int(o) + int(p)) for o, p in zip(off, pshape)]
        for other in boxes:
            if all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(box, other)):
                raise ValueError(f"{name}: pieces overlap")
        boxes.append(box)
        covered += int(np.prod(pshape, dtype=np.int64)) if pshape else 1
    if covered != total:
        raise ValueError(f"{name}: pieces cover {covered} of {total} elements")


# -- the puller side: assembling the checkpoint layout ---------------------------------------


def _layout(tensors: dict[str, dict], max_shard_bytes: int) -> list[list[str]]:
    """Names per output file, grouped like :func:`asyncgrpo.weights.format.write_anchor`."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = _nbytes(t)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _nbytes(t: dict) -> int:
    numel = int(np.prod(t["shape"], dtype=np.int64)) if t["shape"] else 1
    return numel * np.dtype(_BITS[t["dtype"]]).itemsize


def _write_file(path: Path, names: list[str], tensors: dict[str, dict],
                sources: dict[str, tuple[int, dict]], src_dir: Path) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name in names:
        t = tensors[name]
        n = _nbytes(t)
        header[name] = {"dtype": t["dtype"], "shape": list(t["shape"]),
                        "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-aligned, as safetensors writes it
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(base + pos)
    if pos == 0:
        return
    out = np.memmap(path, dtype=np.uint8, mode="r+")
    try:
        for name in names:
            t = tensors[name]
            bits = _BITS[t["dtype"]]
            width = np.dtype(bits).itemsize
            start = base + header[name]["data_offsets"][0]
            shape = [int(s) for s in t["shape"]]
            dst = out[start:start + _nbytes(t)].view(bits).reshape(shape)
            for file, off, pshape in t["pieces"]:
                src_base, src_header = sources[file]
                info = src_header.get(name)
                if (info is None or info["dtype"] != t["dtype"]
                        or [int(s) for s in info["shape"]] != [int(s) for s in pshape]):
                    raise DeltaMismatch(f"{file}: {name} is not the piece the manifest names")
                s0, s1 = info["data_offsets"]
                src = np.memmap(src_dir / file, dtype=np.uint8, mode="r", offset=src_base + s0,
                                shape=(s1 - s0,)).view(bits).reshape([int(s) for s in pshape])
                if src.size * width != s1 - s0:
                    raise DeltaMismatch(f"{file}: {name} has the wrong size")
                dst[tuple(slice(int(o), int(o) + int(p)) for o, p in zip(off, pshape))] = src
                del src
        out.flush()
    finally:
        del out


def assemble_anchor(src_dir: Path, tensors: dict[str, dict], out_dir: Path,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the checkpoint layout (``model.safetensors``, or shards + index past
    ``max_shard_bytes``, as ``write_anchor`` does) into ``out_dir`` from the rank files in
    ``src_dir`` and the manifest's table; returns the files written."""
    for name, t in tensors.items():
        check_cover(name, t)
    files = sorted({p[0] for t in tensors.values() for p in t["pieces"]})
    sources = {f: read_header(src_dir / f) for f in files}
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = _layout(tensors, max_shard_bytes)
    if len(groups) == 1:
        _write_file(out_dir / ANCHOR_SINGLE, groups[0], tensors, sources, src_dir)
        return [ANCHOR_SINGLE]
    written, weight_map = [], {}
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_file(out_dir / fname, names, tensors, sources, src_dir)
        written.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(_nbytes(t) for t in tensors.values())
    (out_dir / ANCHOR_INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    return written + [ANCHOR_INDEX]


def table_entry(dtype_name: str, global_shape, file: str, offset, shape) -> dict:
    return {"dtype": ST_DTYPE[dtype_name], "shape": [int(s) for s in global_shape],
            "pieces": [[file, [int(o) for o in offset], [int(s) for s in shape]]]}


def iter_pieces(named_params: Iterator, rank: int, dtype, to_checkpoint) -> Iterator[tuple]:
    """(checkpoint name, contiguous CPU block in the publish dtype, global shape, offset) of
    everything this rank owns, one piece at a time."""
    for name, param in named_params:
        owned = owned_block(param, rank)
        if owned is None:
            continue
        block, gshape, offset = owned
        # a copy even when dtype and device match: the delta's base must not be a live parameter
        t = block.to("cpu", dtype=dtype or block.dtype, copy=True)
        for ck, piece, gs, off in checkpoint_pieces(name, t, gshape, offset, to_checkpoint):
            yield ck, piece.contiguous(), gs, off


__all__ = [
    "_int_view",
    "anchor_name",
    "assemble_anchor",
    "checkpoint_pieces",
    "delta_name",
    "delta_pieces",
    "iter_pieces",
    "merge_tables",
    "owned_block",
    "table_entry",
]
