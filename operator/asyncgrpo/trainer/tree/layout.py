"""What the attention of one packed row needs, derived once per forward from two tensors.

The wire format of a row is only `position_ids` and `leave` (see `forest.py`): they are
plain tensors, so TRL's dispatcher can scatter them to ranks like any other batch field.
Each rank rebuilds a `TreeLayout` from them and every attention layer reuses it:
- the FlexAttention `BlockMask` (CUDA), built from `k <= q < leave[k]`;
- the segments (unary chains of the forest) with their root paths, for the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """A run of packed tokens `[start, end)` that all see the same ancestors, plus themselves causally.

    `ancestors` are the indices (in `TreeLayout.segments()`) of the segments on its root
    path, root first; a root segment has none. Its keys are those segments, then itself.
    """

    start: int
    end: int
    ancestors: tuple[int, ...]
    prefix: int  # tokens on the root path before `start`

    @property
    def length(self) -> int:
        return self.end - self.start

    def mask(self, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive [length, prefix + length] mask: the whole root path, then itself causally."""
        own = torch.ones(self.length, self.length, dtype=torch.bool, device=device).tril()
        full = torch.ones(self.length, self.prefix, dtype=torch.bool, device=device)
        allowed = torch.cat([full, own], dim=1)
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


@dataclass
class TreeLayout:
    """Attention structure of one packed row; caches the per-device masks it builds."""

    position_ids: torch.Tensor  # [N]
    leave: torch.Tensor  # [N]
    _segments: list[Segment] | None = field(default=None, repr=False)
    _block_masks: dict = field(default_factory=dict, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_row(cls, row) -> TreeLayout:
        return cls(position_ids=row.position_ids, leave=row.leave)

    @property
    def size(self) -> int:
        return int(self.leave.numel())

    def segments(self) -> list[Segment]:
        """Unary chains of the forest in packed order, each with its root path.

        Node `i` continues the chain of `i - 1` iff `i - 1` is its parent and `i - 1` has no
        other child: then `i` sits one level deeper and both subtrees end at the same place.
        The ancestors of a chain are the earlier chains whose subtree still contains it,
        which a stack over the depth-first order yields directly.
        """
        if self._segments is None:
            pos = self.position_ids.cpu()
            leave = self.leave.cpu()
            n = pos.numel()
            cont = torch.zeros(n, dtype=torch.bool)
            if n > 1:
                cont[1:] = (pos[1:] == pos[:-1] + 1) & (leave[1:] == leave[:-1])
            starts = torch.nonzero(~cont).flatten().tolist()
            ends = starts[1:] + [n]
            leave_list = leave.tolist()
            stack: list[int] = []  # indices of the ancestor segments
            segments: list[Segment] = []
            for start, end in zip(starts, ends):
                while stack and leave_list[segments[stack[-1]].start] <= start:
                    stack.pop()
                prefix = sum(segments[a].length for a in stack)
                segments.append(Segment(start, end, tuple(stack), prefix))
                stack.append(len(segments) - 1)
            self._segments = segments
        return self._segments

    def kv_index(self, i: int) -> torch.Tensor:
        """Packed indices of the keys segment `i` attends to: its root path, then itself."""
        segs = self.segments()
        return torch.cat([torch.arange(segs[j].start, segs[j].end) for j in (*segs[i].ancestors, i)])

    def segment_masks(self, dtype: torch.dtype, device) -> list[torch.Tensor | None]:
        """Per-segment additive masks (None for roots), built once and shared by every layer."""
        key = (dtype, str(device))
        if key not in self._masks:
            self._masks[key] = [s.mask(dtype, device) if s.ancestors else None for s in self.segments()]
        return self._masks[key]

    def block_mask(self, device: torch.device):
        """FlexAttention BlockMask of `k <= q < leave[k]`; compiled where FlexAttention compiles."""
        key = str(device)
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            leave = self.leave.to(device)

            def mask_mod(b, h, q, k):
                return (k <= q) & (q < leave[k])

            n = self.size
            self._block_masks[key] = create_block_mask(
                mask_mod, None, None, n, n, device=device, _compile=torch.device(device).type == "cuda"
            )
        return self._block_masks[key]

    def dense_mask(self) -> torch.Tensor:
        """[N, N] boolean mask; O(N^2), for tests and small references only."""
        n = self.size
        q = torch.arange(n)[:, None]
        k = torch.arange(n)[None, :]
        return (k <= q) & (q < self.leave.cpu()[None, :])
