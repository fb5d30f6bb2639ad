"""Tree-packed training equals training on every rollout alone, on tiny Qwen3 dense and MoE."""

import random

import pytest
import torch
from hypothesis import given, settings
from tree_strategies import rollout_sets, tree_settings

from asyncgrpo.trainer.tree import Rollout, TreeLayout, pack
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts
from asyncgrpo.trainer.tree.verify import (
    _set_attention,
    build_model,
    compare,
    packed_log_probs,
    reference_log_probs,
    verdict,
)


def awkward_batch(seed: int = 0, with_old_log_probs: bool = False) -> list[Rollout]:
    """Multi-turn groups plus every edge case the packer must survive, in one micro-batch."""
    rng = random.Random(seed)
    rollouts = synthetic_rollouts(groups=2, generations=3, prompt=24, completion=12, turns=2, seed=seed)
    system = [7, 7, 3, 9]
    for g in ("sys-a", "sys-b"):  # a system prompt shared across groups
        prompt = system + [rng.randrange(512) for _ in range(5)]
        for _ in range(2):
            completion = [rng.randrange(512) for _ in range(rng.randint(1, 6))]
            rollouts.append(Rollout.make(g, prompt + completion, [0] * len(prompt) + [1] * len(completion),
                                         rng.gauss(0, 1)))
    first = rollouts[0]
    rollouts += [
        first,  # a duplicate
        Rollout.make(first.group_id, first.input_ids[:30], first.completion_mask[:30], 0.7),  # a prefix
        Rollout.make("one", [5, 6, 7, 8], [0, 0, 0, 1], -1.0),  # group of one, single-token completion
        Rollout.make("none", [5, 6, 9], [0, 0, 0], 1.0),  # empty completion mask
    ]
    if with_old_log_probs:
        rollouts = [Rollout.make(r.group_id, r.input_ids, r.completion_mask, r.advantage,
                                 [-6.2 + rng.uniform(-0.5, 0.5) for _ in r.input_ids]) for r in rollouts]
    return rollouts


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_loss_and_every_gradient_match_unpacked(kind, lora):
    model = build_model(kind, seed=1, lora=lora)
    result = compare(model, awkward_batch(), ranks=2, budget=80)
    ok, problems = verdict(result)
    assert ok, problems
    assert result["micro_batches"] > 1 and result["tokens_forwarded"] < result["tokens_raw"]
    assert result["loss_reference"] != 0.0


def test_off_policy_ratios_and_clipping_match_unpacked():
    """Old log-probs far from the model's push ratios into the clip range on both sides."""
    model = build_model("dense", seed=2)
    result = compare(model, awkward_batch(seed=3, with_old_log_probs=True), ranks=3, budget=200)
    ok, problems = verdict(result)
    assert ok, problems


@settings(tree_settings, max_examples=15)
@given(rollout_sets(max_prompt=8, max_completion=8))
def test_per_token_log_probs_match_unpacked_for_any_forest(rollouts):
    model = _shared_model()
    with torch.no_grad():
        _set_attention(model, "sdpa")
        ref = torch.cat([reference_log_probs(model, r, "cpu") for r in rollouts])
        _set_attention(model, "asyncgrpo_tree")
        packed = packed_log_probs(model, pack(rollouts), "cpu")
    torch.testing.assert_close(packed, ref, atol=2e-5, rtol=0)


def test_plain_causal_attention_over_the_packed_row_is_caught():
    """Negative control: packing without the forest mask (one causal sequence) must fail the check."""
    model = _shared_model()
    rollouts = awkward_batch()
    row = pack(rollouts)
    with torch.no_grad():
        _set_attention(model, "sdpa")
        ref = torch.cat([reference_log_probs(model, r, "cpu") for r in rollouts])
        _set_attention(model, "asyncgrpo_tree")
        wrong = TreeLayout(row.position_ids, torch.full_like(row.leave, row.tokens))
        out = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], tree_layout=wrong,
                    tree_pred_pos=row.pred_pos, tree_targets=row.target).log_probs
    assert (out - ref).abs().max() > 1e-2


_MODEL = None


def _shared_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = build_model("dense", seed=4)
    return _MODEL


def test_gradient_checkpointing_passes_the_layout_through():
    """Recomputed layers get the same `tree_layout` keyword, so checkpointed training stays exact."""
    model = build_model("dense", seed=7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ok, problems = verdict(compare(model, awkward_batch(seed=5), ranks=2, budget=120))
    assert ok, problems


def test_moe_router_aux_loss_counts_each_forwarded_token_once():
    """The documented difference: shared prefixes enter the load-balancing statistic once."""
    model = build_model("moe", seed=8)
    rollouts = synthetic_rollouts(groups=2, generations=4, prompt=30, completion=6)

    def aux(row):
        return model(input_ids=row.input_ids[None], position_ids=row.position_ids[None],
                     tree_layout=TreeLayout.from_row(row), tree_pred_pos=row.pred_pos,
                     tree_targets=row.target, output_router_logits=True).aux_loss

    with torch.no_grad():
        tree, sequence = aux(pack(rollouts)), aux(pack(rollouts, share=False))
        assert abs(tree - sequence) > 1e-4
        unshared = synthetic_rollouts(groups=4, generations=1, prompt=30, completion=6, seed=1)
        assert pack(unshared).tokens == pack(unshared, share=False).tokens  # nothing in common
        torch.testing.assert_close(aux(pack(unshared)), aux(pack(unshared, share=False)))
