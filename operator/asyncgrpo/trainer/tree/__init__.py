"""Tree packing: a micro-batch of rollouts as a prefix forest, forwarded once per shared prefix.

See docs/tree-packing.md. The pieces, each in its own module:
- `rollout`: the Rollout record and the JSON Lines rollouts file.
- `forest`: rollouts -> `PackedRow` (DFS layout, positions, `leave`, loss gather).
- `layout`: `TreeLayout`, what attention needs (BlockMask, segments), from two tensors.
- `attention`: the `asyncgrpo_tree` attention (FlexAttention on CUDA, SDPA per segment on CPU).
- `loss`: per-term log-probs through TRL's chunked LM head; the GRPO loss.
- `budget`: rows under a per-rank token budget, balanced across data-parallel ranks.
- `metrics`: what the trainer exports about packing.
- `trl_integration`: the seam into TRL's AsyncGRPOTrainer.
- `verify`, `bench`, `commands`: `asyncgrpo tree verify|bench`.
"""

from .attention import (
    TREE_ATTENTION,
    install_tree_attention,
    register_tree_attention,
    tree_attention,
)
from .forest import PackedRow, Trie, pack
from .layout import TreeLayout
from .rollout import Rollout, RolloutError, load_rollouts

__all__ = [
    "TREE_ATTENTION",
    "PackedRow",
    "Rollout",
    "RolloutError",
    "TreeLayout",
    "Trie",
    "install_tree_attention",
    "load_rollouts",
    "pack",
    "register_tree_attention",
    "tree_attention",
]
