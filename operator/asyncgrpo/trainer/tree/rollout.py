"""Rollouts as the packer sees them, and the JSON Lines file the `tree` commands read.

A rollout is immutable and validated once, here, so the packer, the planner and the
attention never have to guess what a malformed sample meant: a bad line is an error with
its line number, never a silently dropped or truncated sample.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RolloutError(ValueError):
    """A rollout that cannot be packed as given (the caller's data or configuration is wrong)."""


@dataclass(frozen=True)
class Rollout:
    """One sampled sequence: prompt and completion (and, multi-turn, tool results) as one token row.

    `completion_mask[p] == 1` means token `p` is trained: it is predicted from the hidden
    state at `p - 1` with its own `advantage` and `old_log_probs[p]`. Token 0 has no
    predecessor, so it can never be trained.
    """

    group_id: str
    input_ids: tuple[int, ...]
    completion_mask: tuple[int, ...]
    advantage: float
    old_log_probs: tuple[float, ...] | None = None
    policy_version: int | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if n == 0:
            raise RolloutError(f"rollout of group {self.group_id!r} has no tokens")
        if len(self.completion_mask) != n:
            raise RolloutError(
                f"rollout of group {self.group_id!r}: completion_mask has {len(self.completion_mask)} "
                f"entries for {n} tokens"
            )
        if any(m not in (0, 1) for m in self.completion_mask):
            raise RolloutError(f"rollout of group {self.group_id!r}: completion_mask must hold 0 or 1")
        if self.completion_mask[0]:
            raise RolloutError(
                f"rollout of group {self.group_id!r}: token 0 is marked trained, but nothing predicts it"
            )
        if any(t < 0 for t in self.input_ids):
            raise RolloutError(f"rollout of group {self.group_id!r}: negative token id")
        if not math.isfinite(self.advantage):
            raise RolloutError(f"rollout of group {self.group_id!r}: advantage is not finite")
        if self.old_log_probs is not None and len(self.old_log_probs) != n:
            raise RolloutError(
                f"rollout of group {self.group_id!r}: old_log_probs has {len(self.old_log_probs)} "
                f"entries for {n} tokens"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained(self) -> int:
        """Loss terms this rollout contributes (its trained tokens)."""
        return sum(self.completion_mask)

    @classmethod
    def make(
        cls,
        group_id: Any,
        input_ids: Sequence[int],
        completion_mask: Sequence[int],
        advantage: float,
        old_log_probs: Sequence[float] | None = None,
        policy_version: int | None = None,
    ) -> Rollout:
        """Build from lists or tensors (what TRL's rollout worker and JSON hand over)."""
        as_list = lambda x: x.tolist() if hasattr(x, "tolist") else list(x)
        return cls(
            group_id=str(group_id),
            input_ids=tuple(int(t) for t in as_list(input_ids)),
            completion_mask=tuple(int(m) for m in as_list(completion_mask)),
            advantage=float(advantage),
            old_log_probs=None if old_log_probs is None else tuple(float(x) for x in as_list(old_log_probs)),
            policy_version=policy_version,
        )


def load_rollouts(path: str | Path) -> list[Rollout]:
    """Read a rollouts file (JSON Lines); blank lines are skipped, anything else must parse."""
    rollouts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            rollouts.append(
                Rollout.make(
                    group_id=record["group_id"],
                    input_ids=record["input_ids"],
                    completion_mask=record["completion_mask"],
                    advantage=record["advantage"],
                    old_log_probs=record.get("old_log_probs"),
                    policy_version=record.get("policy_version"),
                )
            )
        except (KeyError, TypeError, ValueError) as err:
            raise RolloutError(f"{path}:{number}: {err}") from err
    if not rollouts:
        raise RolloutError(f"{path}: no rollouts")
    return rollouts


def dump_rollouts(rollouts: Iterable[Rollout], path: str | Path) -> None:
    """Write rollouts in the format `load_rollouts` reads."""
    with open(path, "w") as out:
        for r in rollouts:
            record = {
                "group_id": r.group_id,
                "input_ids": list(r.input_ids),
                "completion_mask": list(r.completion_mask),
                "advantage": r.advantage,
            }
            if r.old_log_probs is not None:
                record["old_log_probs"] = list(r.old_log_probs)
            out.write(json.dumps(record) + "\n")
