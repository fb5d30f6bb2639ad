"""Random rollouts with the shape of a GRPO step, for the benchmark and the tests.

Single-turn (`turns=1`): K groups of G rollouts, each `prompt + completion`, the prompt
shared inside a group. Multi-turn (`turns=T`): every episode alternates T completion
turns with tool outputs, and each turn is its own training sample (history as context,
that turn trained), as TRL's multi-turn harness emits them; the samples of an episode are
then prefixes of one another, which the forest shares.
"""

from __future__ import annotations

import random

from .rollout import Rollout


def synthetic_rollouts(groups: int, generations: int, prompt: int, completion: int, turns: int = 1,
                       vocab: int = 512, tool_tokens: int = 32, seed: int = 0) -> list[Rollout]:
    if min(groups, generations, prompt, completion, turns) < 1:
        raise ValueError("groups, generations, prompt, completion and turns must all be >= 1")
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]
    per_turn = [completion // turns + (1 if t < completion % turns else 0) for t in range(turns)]
    rollouts = []
    for g in range(groups):
        shared = tokens(prompt)
        for _ in range(generations):
            advantage = rng.gauss(0.0, 1.0)
            history = list(shared)
            for t, n in enumerate(per_turn):
                answer = tokens(max(n, 1))
                ids = history + answer
                mask = [0] * len(history) + [1] * len(answer)
                rollouts.append(Rollout.make(f"group-{g}", ids, mask, advantage))
                history = ids + (tokens(tool_tokens) if t < turns - 1 else [])
    return rollouts
