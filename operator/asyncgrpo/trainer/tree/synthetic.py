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


def agentic_rollouts(groups: int = 4, generations: int = 8, turns: int = 6, system: int = 128, prompt: int = 128,
                     completion: int = 48, tool: int = 96, vocab: int = 512, seed: int = 0) -> list[Rollout]:
    """Multi-turn agent episodes shaped like a harness run, one training sample per turn.

    A system prompt is shared by every group; each group has its own task prompt. Episode 0
    of a group is fresh; every later episode copies an earlier one (its parent) up to a
    random turn and forks there (fork at turn 0: a different first answer), so the group's
    forest branches at different depths. Completion and tool-output lengths vary (0.5x to
    1.5x the given means). An episode emits a sample for every turn (history untrained, that
    turn's answer trained), so the turns it shares with its parent are duplicate samples
    with their own advantage, as a real harness emits them.
    """
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]
    vary = lambda n: max(1, rng.randint(n // 2, n + n // 2))
    shared = tokens(system)
    rollouts = []
    for g in range(groups):
        head = shared + tokens(prompt)
        episodes: list[list[tuple[list[int], list[int]]]] = []  # per episode: (answer, tool) per turn
        for e in range(generations):
            parent = episodes[rng.randrange(e)] if e else None
            fork = rng.randrange(turns) if parent else 0
            steps = list(parent[:fork]) if parent else []
            while len(steps) < turns:
                steps.append((tokens(vary(completion)), tokens(vary(tool)) if len(steps) < turns - 1 else []))
            episodes.append(steps)
            advantage = rng.gauss(0.0, 1.0)
            history = list(head)
            for answer, output in steps:
                ids = history + answer
                rollouts.append(Rollout.make(f"group-{g}", ids, [0] * len(history) + [1] * len(answer), advantage))
                history = ids + output
    return rollouts


if __name__ == "__main__":  # python -m asyncgrpo.trainer.tree.synthetic agentic OUT.jsonl [SEED]
    import sys

    from .rollout import dump_rollouts

    if len(sys.argv) < 3 or sys.argv[1] != "agentic":
        sys.exit("usage: python -m asyncgrpo.trainer.tree.synthetic agentic OUT.jsonl [SEED]")
    dump_rollouts(agentic_rollouts(seed=int(sys.argv[3]) if len(sys.argv) > 3 else 0), sys.argv[2])
