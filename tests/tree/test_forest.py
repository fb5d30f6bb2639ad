"""Invariants of the packed layout: exact reconstruction, positions, visibility, loss gather."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tree_strategies import rollout_sets, tree_settings

from asyncgrpo.trainer.tree import Rollout, RolloutError, TreeLayout, pack


def distinct_prefixes(rollouts):
    return {tuple(r.input_ids[: k + 1]) for r in rollouts for k in range(len(r))}


@tree_settings
@given(rollout_sets())
def test_every_rollout_reconstructs_at_its_original_positions(rollouts):
    row = pack(rollouts)
    for r, path in zip(rollouts, row.paths):
        assert row.input_ids[path].tolist() == list(r.input_ids)
        assert row.position_ids[path].tolist() == list(range(len(r)))


@tree_settings
@given(rollout_sets())
def test_forwarded_tokens_are_the_distinct_prefixes(rollouts):
    row = pack(rollouts)
    assert row.tokens == len(distinct_prefixes(rollouts))
    assert pack(rollouts, share=False).tokens == sum(len(r) for r in rollouts)


@tree_settings
@given(rollout_sets())
def test_each_query_sees_exactly_its_own_path(rollouts):
    row = pack(rollouts)
    mask = TreeLayout.from_row(row).dense_mask()
    assert mask.sum(1).tolist() == (row.position_ids + 1).tolist()
    for path in row.paths:
        for p, q in enumerate(path):
            assert set(mask[q].nonzero().flatten().tolist()) == set(path[: p + 1])


@tree_settings
@given(rollout_sets())
def test_nothing_is_visible_across_unrelated_rollouts(rollouts):
    row = pack(rollouts)
    mask = TreeLayout.from_row(row).dense_mask()
    for a, pa in zip(rollouts, row.paths):
        for b, pb in zip(rollouts, row.paths):
            shared = next((k for k in range(min(len(a), len(b))) if a.input_ids[k] != b.input_ids[k]),
                          min(len(a), len(b)))
            # a's token at p sees b's token at k only through a common prefix.
            for p in range(len(a)):
                for k in range(shared, len(b)):
                    if pb[k] not in pa:
                        assert not mask[pa[p], pb[k]]


@tree_settings
@given(rollout_sets())
def test_loss_terms_are_the_trained_tokens_with_their_own_data(rollouts):
    row = pack(rollouts)
    assert row.trained == sum(r.trained for r in rollouts)
    for j in range(row.trained):
        r = rollouts[row.rollout[j]]
        p = int(row.token_pos[j])
        assert r.completion_mask[p] == 1
        assert int(row.target[j]) == r.input_ids[p]
        assert int(row.pred_pos[j]) == row.paths[int(row.rollout[j])][p - 1]
        assert int(row.position_ids[row.pred_pos[j]]) == p - 1
        assert float(row.advantage[j]) == pytest.approx(r.advantage)


@tree_settings
@given(rollout_sets(), st.randoms(use_true_random=False))
def test_layout_does_not_depend_on_insertion_order(rollouts, rng):
    shuffled = list(rollouts)
    rng.shuffle(shuffled)
    a, b = pack(rollouts), pack(shuffled)
    for name in ("input_ids", "position_ids", "leave"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist()
    terms = lambda row, rs: sorted(
        (rs[int(i)].input_ids, int(p), int(q), int(t)) for i, p, q, t in
        zip(row.rollout, row.token_pos, row.pred_pos, row.target)
    )
    assert terms(a, rollouts) == terms(b, shuffled)


@tree_settings
@given(rollout_sets())
def test_segments_partition_the_row_and_see_their_root_path(rollouts):
    row = pack(rollouts)
    layout = TreeLayout.from_row(row)
    mask = layout.dense_mask()
    segments = layout.segments()
    assert segments[0].start == 0 and segments[-1].end == row.tokens
    for s, nxt in itertools.pairwise(segments):
        assert s.end == nxt.start
    for i, s in enumerate(segments):
        keys = layout.kv_index(i).tolist()
        assert keys == mask[s.end - 1].nonzero().flatten().tolist()
        assert len(keys) == s.prefix + s.length
        assert bool(s.ancestors) == (s.prefix > 0)


def test_fork_forwards_one_position_with_a_target_per_branch():
    a = Rollout.make("g", [1, 2, 3, 4], [0, 0, 1, 1], 1.0)
    b = Rollout.make("g", [1, 2, 5, 6], [0, 0, 1, 1], -1.0)
    row = pack([a, b])
    assert row.tokens == 6  # 1 2 shared, then 3 4 and 5 6: no extra token at the fork
    fork = row.paths[0][1]
    assert row.pred_pos.tolist().count(fork) == 2
    assert sorted(int(t) for t, p in zip(row.target, row.pred_pos) if int(p) == fork) == [3, 5]


@pytest.mark.parametrize(
    "rollouts, tokens, terms",
    [
        ([Rollout.make("g", [1, 2, 3], [0, 1, 1], 1.0)] * 3, 3, 6),  # duplicates
        ([Rollout.make("g", [1, 2, 3, 4], [0, 0, 1, 1], 1.0), Rollout.make("g", [1, 2, 3], [0, 0, 1], 1.0)], 4, 3),
        ([Rollout.make("g", [1, 2, 7], [0, 0, 1], 1.0), Rollout.make("g", [1, 2, 8], [0, 0, 1], 1.0)], 4, 2),
        ([Rollout.make("lonely", [4, 5, 6], [0, 0, 1], 0.5)], 3, 1),  # group of one
        ([Rollout.make("a", [9, 9, 1], [0, 0, 1], 1.0), Rollout.make("b", [9, 9, 2], [0, 0, 1], 1.0)], 4, 2),
        ([Rollout.make("g", [1, 2, 3], [0, 0, 0], 1.0), Rollout.make("g", [1, 2, 4], [0, 0, 1], 1.0)], 4, 1),
        ([Rollout.make("g", [7], [0], 1.0)], 1, 0),  # a single token trains nothing
    ],
    ids=["duplicates", "prefix-of-another", "single-token-completions", "group-of-one",
         "system-prompt-across-groups", "empty-completion-mask", "one-token"],
)
def test_edge_cases(rollouts, tokens, terms):
    row = pack(rollouts)
    assert (row.tokens, row.trained) == (tokens, terms)
    for r, path in zip(rollouts, row.paths):
        assert row.input_ids[path].tolist() == list(r.input_ids)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": [], "completion_mask": []}, "no tokens"),
        ({"input_ids": [1, 2], "completion_mask": [0]}, "completion_mask has 1"),
        ({"input_ids": [1, 2], "completion_mask": [1, 1]}, "token 0"),
        ({"input_ids": [1, 2], "completion_mask": [0, 2]}, "0 or 1"),
        ({"input_ids": [1, 2], "completion_mask": [0, 1], "old_log_probs": [0.0]}, "old_log_probs"),
    ],
)
def test_malformed_rollouts_are_rejected(kwargs, message):
    with pytest.raises(RolloutError, match=message):
        Rollout.make("g", advantage=1.0, **kwargs)
