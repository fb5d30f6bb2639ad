"""Rollouts -> one packed row: a prefix forest laid out depth-first, plus the loss gather.

Why a forest and not TRL's trie: TRL's `TreeRow` keys a node on (token, next token) so
that each position has a single next-token label; a fork then costs one duplicated token
per extra branch. Here a node is keyed on its token alone, so the forwarded tokens are
exactly the distinct prefixes of the rollouts, and the loss is an explicit gather instead
of per-position labels: a fork position appears once per branch in `pred_pos`, each time
with that branch's own target, advantage and old log-prob.

Layout invariants (checked by tests/tree):
- Tokens are in depth-first pre-order, children sorted by token id, so the layout of a
  set of rollouts does not depend on the order they were added in.
- `position_ids[i]` is the depth of node `i`, which is its position in every rollout
  that contains it.
- `leave[i]` is one past the last packed index of node `i`'s subtree. Query `q` may attend
  to key `k` iff `k <= q < leave[k]`: `k` is `q` or an ancestor of `q`. That is exactly
  the context `q` had in its own rollout, with nothing across branches or trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .rollout import Rollout


class Trie:
    """Prefix trie keyed on token id; grows one rollout at a time and prices a candidate.

    `load` is the number of (query, key) pairs tree attention computes over the trie
    (every node sees depth + 1 keys): the attention cost the planner balances.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.depth: list[int] = []
        self.children: list[dict[int, int]] = []
        self.roots: dict[int, int] = {}
        self.load = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def insert(self, input_ids: Sequence[int]) -> list[int]:
        """Add a rollout; returns the trie node of each of its tokens."""
        level, nodes = self.roots, []
        for depth, token in enumerate(input_ids):
            node = level.get(token)
            if node is None:
                node = level[token] = len(self.tokens)
                self.tokens.append(token)
                self.depth.append(depth)
                self.children.append({})
                self.load += depth + 1
            nodes.append(node)
            level = self.children[node]
        return nodes

    def price(self, rollouts: Sequence[Sequence[int]]) -> tuple[int, int]:
        """(new tokens, new attention pairs) that adding `rollouts` would cost, trie unchanged."""
        overlay: dict[tuple[int, int], int] = {}  # (parent or -1 - its overlay id, token) -> overlay id
        tokens = pairs = 0
        for ids in rollouts:
            level: dict[int, int] | None = self.roots
            parent = -1
            for depth, token in enumerate(ids):
                node = level.get(token) if level is not None else None
                if node is not None:
                    level, parent = self.children[node], node
                    continue
                key = (parent, token)
                if key not in overlay:
                    overlay[key] = len(overlay)
                    tokens += 1
                    pairs += depth + 1
                level, parent = None, -2 - overlay[key]
        return tokens, pairs


@dataclass
class PackedRow:
    """One rank's forward: forest tokens in DFS order and the loss terms gathered over them.

    Every tensor is on the CPU; `to(device)` moves what the forward needs. The `M` loss
    terms are ordered by rollout, then by position inside the rollout.
    """

    input_ids: torch.Tensor  # [N] forwarded tokens
    position_ids: torch.Tensor  # [N] original position (depth in the forest)
    leave: torch.Tensor  # [N] end of each node's subtree: q sees k iff k <= q < leave[k]
    pred_pos: torch.Tensor  # [M] packed index whose hidden state predicts the term's target
    target: torch.Tensor  # [M] the trained token id
    old_log_probs: torch.Tensor  # [M] generator log-prob of the target; NaN where not given
    advantage: torch.Tensor  # [M] the rollout's advantage
    rollout: torch.Tensor  # [M] index into `rollouts`
    token_pos: torch.Tensor  # [M] the target's position in its rollout
    rollouts: list[Rollout] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)  # rollout -> packed index of each token
    filler: bool = False  # a copy forwarded only to keep ranks in step; it has no loss terms

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def trained(self) -> int:
        return int(self.target.numel())

    @property
    def raw_tokens(self) -> int:
        return 0 if self.filler else sum(len(r) for r in self.rollouts)

    @property
    def attention_pairs(self) -> int:
        return int((self.position_ids + 1).sum())

    def to(self, device: torch.device | str) -> PackedRow:
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "input_ids", "position_ids", "leave", "pred_pos", "target",
                "old_log_probs", "advantage", "rollout", "token_pos",
            )
        }
        return PackedRow(**moved, rollouts=self.rollouts, paths=self.paths, filler=self.filler)


def pack(rollouts: Sequence[Rollout], share: bool = True) -> PackedRow:
    """Pack rollouts into one row.

    `share=False` gives plain sequence packing (every rollout its own chain) through the
    same layout and attention, which is what the benchmark compares against.
    """
    tries = [Trie()] if share else [Trie() for _ in rollouts]
    trie_of = [tries[0] if share else tries[i] for i in range(len(rollouts))]
    nodes = [trie_of[i].insert(r.input_ids) for i, r in enumerate(rollouts)]

    input_ids: list[int] = []
    position_ids: list[int] = []
    leave: list[int] = []
    packed_of: list[list[int]] = []  # trie -> node -> packed index
    for trie in tries:
        packed = [0] * len(trie)
        stack: list[tuple[int, bool]] = [(n, False) for _, n in sorted(trie.roots.items(), reverse=True)]
        while stack:
            node, done = stack.pop()
            if done:
                leave[packed[node]] = len(input_ids)
                continue
            packed[node] = len(input_ids)
            input_ids.append(trie.tokens[node])
            position_ids.append(trie.depth[node])
            leave.append(-1)
            stack.append((node, True))
            stack.extend((c, False) for _, c in sorted(trie.children[node].items(), reverse=True))
        packed_of.append(packed)

    paths: list[list[int]] = []
    pred_pos, target, old_lp, advantage, owner, token_pos = [], [], [], [], [], []
    for i, (r, rollout_nodes) in enumerate(zip(rollouts, nodes)):
        packed = packed_of[0 if share else i]
        path = [packed[n] for n in rollout_nodes]
        paths.append(path)
        for p in range(1, len(r)):
            if r.completion_mask[p]:
                pred_pos.append(path[p - 1])
                target.append(r.input_ids[p])
                old_lp.append(float("nan") if r.old_log_probs is None else r.old_log_probs[p])
                advantage.append(r.advantage)
                owner.append(i)
                token_pos.append(p)

    long = lambda xs: torch.tensor(xs, dtype=torch.long)
    return PackedRow(
        input_ids=long(input_ids),
        position_ids=long(position_ids),
        leave=long(leave),
        pred_pos=long(pred_pos),
        target=long(target),
        old_log_probs=torch.tensor(old_lp, dtype=torch.float32),
        advantage=torch.tensor(advantage, dtype=torch.float32),
        rollout=long(owner),
        token_pos=long(token_pos),
        rollouts=list(rollouts),
        paths=paths,
    )
