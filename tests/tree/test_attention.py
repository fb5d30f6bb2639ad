"""The CPU segment path, FlexAttention and a dense masked reference are one attention."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_strategies import rollout_sets, tree_settings

from asyncgrpo.trainer.tree import TreeLayout, pack
from asyncgrpo.trainer.tree.attention import flex_tree_attention, segment_attention, tree_attention
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts


def qkv(n, heads=4, kv_heads=2, dim=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(1, h, n, dim, generator=g, requires_grad=grad)
    return make(heads), make(kv_heads), make(kv_heads)


def dense_reference(q, k, v, layout):
    """O(N^2) SDPA with the forest mask: the definition the fast paths must match."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(), enable_gqa=True)


@tree_settings
@given(rollout_sets(max_completion=10), st.integers(0, 1000))
def test_segment_path_equals_dense_mask_forward_and_backward(rollouts, seed):
    layout = TreeLayout.from_row(pack(rollouts))
    q, k, v = qkv(layout.size, seed=seed, grad=True)
    out = segment_attention(q, k, v, layout, None)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = dense_reference(q, k, v, layout)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@settings(tree_settings, max_examples=15)
@given(rollout_sets(max_completion=10), st.integers(0, 1000))
def test_flex_attention_forward_on_cpu_equals_segment_path(rollouts, seed):
    """FlexAttention's eager forward runs on CPU: the BlockMask built for CUDA defines the same attention."""
    layout = TreeLayout.from_row(pack(rollouts))
    q, k, v = qkv(layout.size, seed=seed)
    with torch.no_grad():
        flex = flex_tree_attention(q, k, v, layout, None, compiled=False)
        seg = segment_attention(q, k, v, layout, None)
    torch.testing.assert_close(flex, seg, atol=1e-5, rtol=1e-5)


def test_cpu_memory_never_grows_with_the_square_of_the_row():
    """Two unrelated groups: no mask spans both, and none is larger than segment x root path."""
    rollouts = synthetic_rollouts(groups=2, generations=4, prompt=64, completion=16)
    layout = TreeLayout.from_row(pack(rollouts))
    n = layout.size
    masks = layout.segment_masks(torch.float32, "cpu")
    biggest = max(m.numel() for m in masks if m is not None)
    assert biggest == 16 * (64 + 16)
    assert biggest * 4 < n * n / 4
    for i, s in enumerate(layout.segments()):  # keys never leave the segment's own tree
        assert layout.kv_index(i).min() >= (0 if s.start < n // 2 else n // 2)


def test_attention_interface_selects_by_device_and_requires_a_layout():
    layout = TreeLayout.from_row(pack(synthetic_rollouts(1, 3, 8, 4)))
    q, k, v = qkv(layout.size)
    out, weights = tree_attention(None, q, k, v, None, tree_layout=layout)
    assert weights is None and out.shape == (1, layout.size, 4, 16)
    torch.testing.assert_close(out.transpose(1, 2), dense_reference(q, k, v, layout), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tree_layout"):
        tree_attention(None, q, k, v, None)


@pytest.mark.slow
def test_compiled_flex_attention_on_cpu_equals_segment_path():
    """The compiled kernel (what CUDA runs) also compiles for CPU's forward; ~15 s of Inductor."""
    layout = TreeLayout.from_row(pack(synthetic_rollouts(2, 4, 40, 12, turns=2)))
    q, k, v = qkv(layout.size, seed=3)
    with torch.no_grad():
        flex = flex_tree_attention(q, k, v, layout, None, compiled=True)
        seg = segment_attention(q, k, v, layout, None)
    torch.testing.assert_close(flex, seg, atol=1e-5, rtol=1e-5)
