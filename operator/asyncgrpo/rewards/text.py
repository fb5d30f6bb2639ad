"""What every reward function reads from TRL's call: the completion's text and the columns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def completion_text(completion: Any) -> str:
    """The text a completion ends with: the string itself, or the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence) and completion:
        last = completion[-1]
        if isinstance(last, dict):
            content = last.get("content") or ""
            if isinstance(content, list):  # multimodal parts: keep the text ones
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
        return str(last)
    return ""


def per_row(value: Any, n: int) -> list[Any]:
    """A column (one value per completion) as it is, or one value repeated for all n.

    TRL passes each data set column as a list aligned with the completions; a reward's own
    `args` give one value for all of them."""
    return list(value) if isinstance(value, (list, tuple)) and len(value) == n else [value] * n


def column(columns: dict[str, Any], field: str, n: int, reward: str) -> list[Any]:
    """The data set column `field`, one value per completion; a missing one is named."""
    if field not in columns:
        raise KeyError(f"reward {reward}: the data set has no column {field!r} "
                       f"(columns: {sorted(k for k in columns if k not in ('prompts', 'completion_ids'))})")
    return per_row(columns[field], n)
