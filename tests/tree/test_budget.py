"""Planner invariants: budgets hold, nothing lost or duplicated, groups kept, ranks never empty."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tree_strategies import rollout_sets, tree_settings

from asyncgrpo.trainer.tree import Rollout, RolloutError, Trie, pack
from asyncgrpo.trainer.tree.budget import group_units, plan, split_group
from asyncgrpo.trainer.tree.metrics import PackingMetrics
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts


def plans():
    @st.composite
    def draw(draw):
        rollouts = draw(rollout_sets())
        longest = max(len(r) for r in rollouts)
        budget = draw(st.integers(longest, longest * 4))
        ranks = draw(st.integers(1, 4))
        return rollouts, ranks, budget

    return draw()


@tree_settings
@given(plans())
def test_every_rollout_lands_exactly_once_and_rows_stay_in_budget(case):
    rollouts, ranks, budget = case
    batches = plan(rollouts, ranks, budget)
    placed = sorted(s for b in batches for sources in b.sources for s in sources)
    assert placed == list(range(len(rollouts)))
    for b in batches:
        assert len(b.rows) == ranks
        for row, sources in zip(b.rows, b.sources):
            assert row.tokens >= 1, "a rank never gets an empty micro-batch"
            assert row.tokens <= budget and row.trained <= budget
            if row.filler:
                assert row.trained == 0 and not sources
            else:
                assert [r for r in row.rollouts] == [rollouts[s] for s in sources]
    assert sum(b.trained for b in batches) == sum(r.trained for r in rollouts)


@tree_settings
@given(plans())
def test_groups_that_fit_stay_in_one_row(case):
    rollouts, ranks, budget = case
    batches = plan(rollouts, ranks, budget)
    where = {s: (i, r) for i, b in enumerate(batches) for r, srcs in enumerate(b.sources) for s in srcs}
    split_rows = sum(1 for b in batches for srcs in b.sources if srcs) > len(group_units(rollouts, budget))
    for unit in group_units(rollouts, budget):
        trie = Trie()
        for i in unit:
            trie.insert(rollouts[i].input_ids)
        if len(trie) <= budget and not split_rows:
            assert len({where[i] for i in unit}) == 1


def test_a_group_larger_than_the_budget_is_split_with_its_prompt_repeated():
    rollouts = synthetic_rollouts(groups=1, generations=6, prompt=20, completion=10)
    batches = plan(rollouts, ranks=1, budget=45)  # prompt + 2 completions per row
    rows = [row for b in batches for row in b.rows]
    assert len(rows) == 3
    prompt = list(rollouts[0].input_ids[:20])
    for row in rows:
        assert row.tokens <= 45
        assert row.input_ids[:20].tolist() == prompt


def test_a_rollout_longer_than_the_budget_is_a_configuration_error():
    rollouts = synthetic_rollouts(groups=1, generations=2, prompt=20, completion=10)
    with pytest.raises(RolloutError, match="exceed the per-rank token budget of 29"):
        plan(rollouts, ranks=1, budget=29)


def test_more_ranks_than_rollouts_forward_fillers_that_train_nothing():
    rollouts = [Rollout.make("g", [1, 2, 3], [0, 1, 1], 1.0)]
    (batch,) = plan(rollouts, ranks=3, budget=10)
    assert [row.filler for row in batch.rows] == [False, True, True]
    assert [row.trained for row in batch.rows] == [2, 0, 0]
    assert PackingMetrics.of([batch]).filler_rows == 2


@tree_settings
@given(st.integers(2, 4), st.integers(4, 12), st.randoms(use_true_random=False))
def test_ranks_are_balanced_by_attention_cost(ranks, groups, rng):
    rollouts = []
    for g in range(groups):
        prompt = [rng.randrange(500) for _ in range(rng.randint(4, 40))]
        for _ in range(rng.randint(1, 4)):
            completion = [rng.randrange(500) for _ in range(rng.randint(1, 20))]
            rollouts.append(Rollout.make(f"g{g}", prompt + completion,
                                         [0] * len(prompt) + [1] * len(completion), 1.0))
    units = group_units(rollouts, 10_000)
    cost = [pack([rollouts[i] for i in u]).attention_pairs for u in units]
    (batch,) = plan(rollouts, ranks, budget=10_000)
    loads = [row.attention_pairs for row in batch.rows]
    assert len(units) == groups >= ranks
    # Greedy list scheduling bound: no rank exceeds the mean by more than one unit.
    assert max(loads) <= sum(cost) / ranks + max(cost)


def test_metrics_count_raw_and_forwarded_work():
    rollouts = synthetic_rollouts(groups=2, generations=4, prompt=10, completion=5)
    m = PackingMetrics.of(plan(rollouts, ranks=2, budget=100))
    assert m.rollouts == 8 and m.raw_tokens == 8 * 15
    assert m.forwarded_tokens == 2 * (10 + 4 * 5) == sum(m.rank_tokens)
    assert m.compression_ratio == pytest.approx(120 / 60)
    assert m.raw_attention_pairs == 8 * 15 * 16 // 2
    assert m.attention_pairs == sum(m.rank_load) < m.raw_attention_pairs
    assert m.as_scalars()["tree/compression_ratio"] == pytest.approx(2.0)


@tree_settings
@given(rollout_sets(), rollout_sets())
def test_trie_prices_a_candidate_exactly_without_changing(placed, candidate):
    trie = Trie()
    for r in placed:
        trie.insert(r.input_ids)
    before = (len(trie), trie.load)
    tokens, pairs = trie.price([r.input_ids for r in candidate])
    assert (len(trie), trie.load) == before
    for r in candidate:
        trie.insert(r.input_ids)
    assert (tokens, pairs) == (len(trie) - before[0], trie.load - before[1])


def test_a_split_multi_turn_group_repeats_only_its_prompt_and_keeps_episodes_whole():
    """4 episodes of 3 turns (one sample per turn); a budget of 150 holds one episode (108 tokens)
    but not two. Cutting in arrival order would cut inside episode 1 and repeat its history;
    cutting at the group's fork (after the 20-token prompt) repeats only the prompt."""
    rollouts = synthetic_rollouts(groups=1, generations=4, prompt=20, completion=24, turns=3)
    batches = plan(rollouts, ranks=1, budget=150)
    m = PackingMetrics.of(batches)
    assert m.micro_batches == 4 and m.distinct_tokens == 20 + 4 * 88
    assert m.forwarded_tokens == m.distinct_tokens + 3 * 20 and m.repeated_tokens == 60
    row_of = {s: i for i, b in enumerate(batches) for s in b.sources[0]}
    for episode in range(4):
        assert len({row_of[3 * episode + t] for t in range(3)}) == 1


@tree_settings
@given(plans())
def test_split_group_places_every_rollout_once_within_the_budget(case):
    rollouts, _ranks, budget = case
    for members in group_units(rollouts, 10**9):
        units = split_group(members, rollouts, budget)
        assert sorted(i for u in units for i in u) == sorted(members)
        for u in units:
            trie = Trie()
            for i in u:
                trie.insert(rollouts[i].input_ids)
            assert len(trie) <= budget and sum(rollouts[i].trained for i in u) <= budget
