"""Assets of the embedded-default demo (`make demo`): a tiny model, prompts, and a reward a
tiny random model can learn within tens of steps on a CPU.

The task: answer with digits. The reward is the share of non-space characters that are
digits. A random tiny Qwen3 puts a few percent of its mass on digit tokens, so rewards start
low but vary within a group, and GRPO has something to push on. It says nothing about
reasoning; it shows rewards flowing to advantages, gradients, adapters in the bucket, and
back to the vLLM that samples the next rollouts (bench/learning.py measures it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_DIGIT = re.compile(r"\d")

PROMPTS = [
    "Say something.", "What comes next?", "Tell me a number.", "Write a short answer.",
    "Continue the list.", "What is the result?", "Give me a code.", "Answer briefly.",
    "Count something.", "What time is it?", "Pick a value.", "Reply now.",
]

#: initializer_range of the demo model: at transformers' default (0.02) a tiny model's
#: next-token distribution is nearly uniform and nothing is learnable in a few steps.
DEMO_INIT_RANGE = 0.2


def digit_fraction(completions, **kwargs) -> list[float]:
    """Reward: the share of a completion's non-space characters that are digits (a `python`
    reward function: `asyncgrpo.local.demo:digit_fraction`)."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else (c[-1].get("content") or "" if c else "")
        chars = [ch for ch in text if not ch.isspace()]
        out.append(sum(1 for ch in chars if _DIGIT.match(ch)) / len(chars) if chars else 0.0)
    return out


def write_prompts(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def prepare_demo(directory: Path, *, seed: int = 0,
                 init_range: float = DEMO_INIT_RANGE) -> tuple[Path, Path]:
    """Write (or keep) the demo model and prompts under `directory`; returns their paths."""
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    model = directory / "tiny-qwen3"
    if not (model / "config.json").exists():
        save_tiny_checkpoint(model, kind="dense", seed=seed, initializer_range=init_range)
    prompts = directory / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts)
    return model, prompts
