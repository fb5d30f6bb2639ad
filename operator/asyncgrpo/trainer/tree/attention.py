"""Tree attention behind transformers' `AttentionInterface`, so any decoder it implements runs unmodified.

A model loaded (or switched) to `attn_implementation="asyncgrpo_tree"` takes a
`tree_layout=TreeLayout` keyword in its forward; the decoder passes it through to every
attention layer, which picks its path by device:
- CUDA: compiled `flex_attention` with the layout's BlockMask. Fully masked 128x128
  blocks (across trees, across sibling branches) are skipped; K/V are read in place,
  never gathered.
- CPU: FlexAttention has no backward there, so each segment of the forest runs SDPA over
  its root path (`segment_attention`). Memory is O(segment x path), never O(row^2).
Both compute the same softmax over the same keys (tests/tree check they agree).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .layout import TreeLayout

TREE_ATTENTION = "asyncgrpo_tree"


def segment_attention(query, key, value, layout: TreeLayout, scaling: float | None) -> torch.Tensor:
    """Exact tree attention on any device by SDPA per segment; inputs [1, H, N, D] -> [1, H, N, D].

    Tensors are split into segments and keys re-assembled with `cat`, whose backward is
    slicing: no per-segment full-size zero buffers, as indexing would allocate.
    """
    gqa = query.shape[1] != key.shape[1]
    segments = layout.segments()
    masks = layout.segment_masks(query.dtype, query.device)
    sizes = [s.length for s in segments]
    qs, ks, vs = (t.split(sizes, dim=2) for t in (query, key, value))
    outs = []
    for i, (seg, mask) in enumerate(zip(segments, masks)):
        if mask is None:
            outs.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, scale=scaling,
                                                        enable_gqa=gqa))
            continue
        path = [*seg.ancestors, i]
        k = torch.cat([ks[j] for j in path], dim=2)
        v = torch.cat([vs[j] for j in path], dim=2)
        outs.append(F.scaled_dot_product_attention(qs[i], k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Default (automatic) dynamic shapes: rows change length every micro-batch, so after the
    # first recompilation the kernel is shape-generic instead of recompiling per length.
    return torch.compile(flex_attention)


def flex_tree_attention(query, key, value, layout: TreeLayout, scaling: float | None,
                        compiled: bool = True) -> torch.Tensor:
    """FlexAttention over the layout's BlockMask; inputs [1, H, N, D] -> [1, H, N, D].

    `compiled=False` runs FlexAttention's eager reference (forward only on CPU), which the
    tests use to check that the CUDA mask and the CPU path define the same attention.
    """
    from torch.nn.attention.flex_attention import flex_attention

    flex = _compiled_flex() if compiled else flex_attention
    gqa = query.shape[1] != key.shape[1]
    return flex(query, key, value, block_mask=layout.block_mask(query.device), scale=scaling, enable_gqa=gqa)


def uses_flex(device: torch.device) -> bool:
    """FlexAttention trains where it has a backward and we have checked it: CUDA; elsewhere, segments."""
    return device.type == "cuda"


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   sliding_window=None, tree_layout: TreeLayout | None = None, **kwargs):
    """The `AttentionInterface` entry: [B=1, H, N, D] in, ([1, N, H, D], None) out."""
    if tree_layout is None:
        raise ValueError(
            f"attn_implementation={TREE_ATTENTION!r} needs `tree_layout=` in the model call; "
            "build it with asyncgrpo.trainer.tree.TreeLayout.from_row(row)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"tree attention packs everything into one row; got batch size {query.shape[0]}")
    if sliding_window:
        raise NotImplementedError("tree attention does not implement sliding-window layers")
    if dropout:
        raise NotImplementedError("tree attention does not implement attention dropout")
    if uses_flex(query.device):
        out = flex_tree_attention(query, key, value, tree_layout, scaling)
    else:
        out = segment_attention(query, key, value, tree_layout, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> None:
    """Register `asyncgrpo_tree` with transformers (idempotent).

    The mask interface returns None: the whole mask lives in the layout, so transformers
    must not build an [N, N] causal mask for a packed row.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda *args, **kwargs: None)


def install_tree_attention(model) -> None:
    """Switch a loaded model (or a peft wrapper of one) to tree attention, in place."""
    register_tree_attention()
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.set_attn_implementation(TREE_ATTENTION)
