"""Hypothesis strategies: micro-batches of rollouts with every sharing pattern GRPO produces.

Small vocabularies make accidental sharing (same token at a fork, prompts that agree by
chance) common; a system prompt shared across groups, duplicates, rollouts that are a
prefix of another, single-token completions, empty masks and groups of one all occur.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from asyncgrpo.trainer.tree import Rollout

#: Settings of every property test here: examples are cheap; no deadline on shared cores.
tree_settings = settings(max_examples=100, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def rollout_sets(draw, max_groups: int = 3, max_generations: int = 4, max_prompt: int = 6,
                 max_completion: int = 6, vocab: int | None = None) -> list[Rollout]:
    vocab = vocab or draw(st.sampled_from([2, 5, 500]))
    tok = st.integers(0, vocab - 1)
    system = draw(st.lists(tok, max_size=3))
    rollouts = []
    for g in range(draw(st.integers(1, max_groups))):
        prompt = system + draw(st.lists(tok, min_size=0 if system else 1, max_size=max_prompt))
        for _ in range(draw(st.integers(1, max_generations))):
            completion = draw(st.lists(tok, max_size=max_completion))
            ids = prompt + completion
            trained = draw(st.lists(st.integers(0, 1), min_size=len(completion), max_size=len(completion)))
            mask = ([0] * len(prompt) + trained)
            mask[0] = 0
            advantage = draw(st.floats(-2, 2, allow_nan=False))
            rollouts.append(Rollout.make(f"g{g}", ids, mask, advantage))
    if draw(st.booleans()):  # a duplicate
        rollouts.append(draw(st.sampled_from(rollouts)))
    if draw(st.booleans()):  # a rollout that is a strict prefix of another
        r = draw(st.sampled_from(rollouts))
        if len(r) > 1:
            n = draw(st.integers(1, len(r) - 1))
            rollouts.append(Rollout.make(r.group_id, r.input_ids[:n], r.completion_mask[:n], r.advantage))
    return rollouts
