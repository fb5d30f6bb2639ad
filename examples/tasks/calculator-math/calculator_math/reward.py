"""The reward of the calculator task: is the completion's final answer the row's `answer`?

A `python` reward (`spec.reward.functions: [{name: python, module:
calculator_math.reward:final_answer}]`) is called once per group with TRL's keywords:
`completions` (one per rollout; a multi-turn completion is the list of messages after the
prompt: assistant turns, tool calls and tool results), `prompts`, `completion_ids`, every
other column of the data set as a list aligned with `completions` (here `answer`), and the
function's `args` from the run. It returns one float per completion (None: not scored).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def last_assistant_text(completion) -> str:
    """The text of the last assistant message (the final answer, after any tool calls)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            return content if isinstance(content, str) else "".join(
                p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def final_answer(completions, answer, tolerance: float = 1e-6, **kwargs) -> list[float]:
    """1.0 when the last number of the final assistant message equals the row's answer
    (within `tolerance`), else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = _NUMBER.findall(last_assistant_text(completion))
        try:
            ok = bool(numbers) and abs(float(numbers[-1]) - float(expected)) <= tolerance
        except ValueError:
            ok = False
        out.append(1.0 if ok else 0.0)
    return out
