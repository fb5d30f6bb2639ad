"""Anchor and delta files: bit-exact round trips, in-place patching, refusal of misfits."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo.weights.format import (
    ANCHOR_INDEX,
    DeltaMismatch,
    apply_delta,
    changed_indices,
    delta_tensors,
    write_anchor,
    write_delta,
)


def _state(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(7, 5, generator=g).to(dtype),
            "b.bias": torch.randn(11, generator=g).to(dtype),
            "c.scalar": torch.randn((), generator=g).to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_delta_applied_to_anchor_is_bit_exact(tmp_path, dtype):
    old, new = _state(dtype), _state(dtype)
    new["a.weight"][2, 3] += 1
    new["a.weight"][6, 4] = -0.0 if old["a.weight"][6, 4] == 0 else 0.0
    new["b.bias"][0] = float("nan")
    write_anchor(old, tmp_path / "copy")
    delta = {}
    for name in new:
        delta.update(delta_tensors(name, new[name], old[name]))
    assert "idx:c.scalar" not in delta  # unchanged tensors are left out
    write_delta(delta, tmp_path / "d")
    tensors, elements = apply_delta(tmp_path / "copy", tmp_path / "d" / "delta.safetensors")
    assert (tensors, elements) == (2, 3)
    got = load_file(tmp_path / "copy" / "model.safetensors")
    for name, t in new.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_changed_is_decided_on_bits():
    a = torch.tensor([0.0, 1.0, float("nan")])
    b = torch.tensor([-0.0, 1.0, float("nan")])
    assert changed_indices(b, a).tolist() == [0]
    assert changed_indices(a, a.clone()).dtype == torch.int32


def test_sharded_anchor_has_the_checkpoint_index(tmp_path):
    state = _state(torch.float32)
    files = write_anchor(state, tmp_path, max_shard_bytes=64)
    assert ANCHOR_INDEX in files and len(files) == 3  # two shards + index
    new = {k: v + 1 for k, v in state.items()}
    delta = {}
    for name, t in new.items():
        delta.update(delta_tensors(name, t, state[name]))
    write_delta(delta, tmp_path / "d")
    apply_delta(tmp_path, tmp_path / "d" / "delta.safetensors")
    merged = {}
    for f in files[:-1]:
        merged.update(load_file(tmp_path / f))
    assert all(torch.equal(merged[k], new[k]) for k in new)


def test_delta_that_does_not_fit_changes_nothing(tmp_path):
    old = _state(torch.float32)
    write_anchor(old, tmp_path / "copy")
    before = (tmp_path / "copy" / "model.safetensors").read_bytes()
    cases = {
        "unknown name": {"idx:zzz": torch.tensor([0], dtype=torch.int32),
                         "val:zzz": torch.tensor([1.0])},
        "out of range": {"idx:b.bias": torch.tensor([11], dtype=torch.int32),
                         "val:b.bias": torch.tensor([1.0])},
        "wrong width": {"idx:b.bias": torch.tensor([0], dtype=torch.int32),
                        "val:b.bias": torch.tensor([1.0], dtype=torch.float16)},
        "unpaired": {"idx:b.bias": torch.tensor([0], dtype=torch.int32)},
        "length": {"idx:b.bias": torch.tensor([0, 1], dtype=torch.int32),
                   "val:b.bias": torch.tensor([1.0])},
    }
    for what, tensors in cases.items():
        # a good tensor first: nothing may be written before the whole delta is checked
        good = {"idx:a.weight": torch.tensor([0], dtype=torch.int32),
                "val:a.weight": torch.tensor([5.0])}
        write_delta({**good, **tensors}, tmp_path / what)
        with pytest.raises(DeltaMismatch):
            apply_delta(tmp_path / "copy", tmp_path / what / "delta.safetensors")
        assert (tmp_path / "copy" / "model.safetensors").read_bytes() == before, what
