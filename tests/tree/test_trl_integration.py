"""The TRL 1.16.0 seam: TRL's own compute_loss on our packed rows equals unpacked training."""

import types
from collections import defaultdict

import pytest
import torch
from accelerate import Accelerator

from asyncgrpo.trainer.tree.layout import TreeLayout
from asyncgrpo.trainer.tree.loss import grpo_loss
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts
from asyncgrpo.trainer.tree.trl_integration import (
    BATCH_FIELDS,
    TreeBatcher,
    TreeCollator,
    TreePackingMixin,
    _trl_compute_loss,
    check_trl_version,
    install_tree_packing,
    tree_compute_loss,
)
from asyncgrpo.trainer.tree.verify import _set_attention, reference_log_probs


def trl_samples(groups=2, generations=3, seed=0):
    """Samples shaped as TRL's RolloutQueueDataset yields them (tensors, per-token old log-probs)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for r in synthetic_rollouts(groups, generations, prompt=20, completion=8, turns=2, seed=seed):
        n = len(r)
        samples.append({
            "input_ids": torch.tensor(r.input_ids),
            "completion_mask": torch.tensor(r.completion_mask),
            "old_log_probs": -6.2 + 0.5 * torch.randn(n, generator=g),
            "advantage": r.advantage,
            "group_id": r.group_id,
            "metrics": {"reward": float(r.advantage)},
        })
    return samples


def trl_trainer_state():
    """The attributes TRL's compute_loss reads, around a real single-process Accelerator."""
    return types.SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.2, accelerator=Accelerator(cpu=True),
        current_gradient_accumulation_steps=1, aux_loss_enabled=False, router_aux_loss_coef=0.0,
        _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0, _step_trained_tokens=0.0,
        _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0,
    )


@pytest.fixture
def trl_model():
    """A tiny Qwen3 prepared as TRL's trainer prepares it (fused head, LoRA), then our install."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from asyncgrpo.trainer.tiny import tiny_model

    model = tiny_model("dense", seed=5)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    torch.manual_seed(6)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    install_tree_packing(model)
    return model


def test_pinned_trl_version():
    check_trl_version()


def test_trl_loss_on_packed_rows_equals_unpacked(trl_model):
    samples = trl_samples()
    (micro,) = TreeBatcher(samples, num_processes=1, token_budget=4096, samples_per_plan=len(samples))
    metrics = defaultdict(list)
    batch = TreeCollator(pad_token_id=0, num_processes=1, metrics=metrics)([micro])
    assert set(batch) == set(BATCH_FIELDS)

    trainer = trl_trainer_state()
    loss = tree_compute_loss(trainer, trl_model, batch)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in trl_model.named_parameters() if p.requires_grad}
    trl_model.zero_grad(set_to_none=True)

    _set_attention(trl_model, "sdpa")
    total = sum(int(s["completion_mask"].sum()) for s in samples)
    ref_loss = 0.0
    for s in samples:
        from asyncgrpo.trainer.tree.trl_integration import rollout_from_sample

        r = rollout_from_sample(s)
        lp = reference_log_probs(trl_model, r, "cpu")
        trained = s["completion_mask"].bool()
        part = grpo_loss(lp, s["old_log_probs"][trained], torch.full_like(lp, r.advantage), 0.2, 0.2, total)
        part.backward()
        ref_loss += part.item()
    _set_attention(trl_model, "asyncgrpo_tree")

    assert loss.item() == pytest.approx(ref_loss, abs=2e-6)
    for name, g in packed_grads.items():
        ref = dict(trl_model.named_parameters())[name].grad
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4)
    # TRL's own metrics came out of its code path, and ours from the collator.
    assert trainer._metrics["train"]["ratio"][0][1] == total and trainer._step_trained_tokens == total
    assert metrics["tree/compression_ratio"][0] > 1.0 and metrics["reward"]


def trl_compute_loss_on(trainer, model, batch):
    """TRL 1.16.0's own `compute_loss` on a one-rank tree batch (its model call routed to our packed forward)."""
    keep = batch["attention_mask"][0].bool()
    selected = batch["tree_pred_pos"][0] >= 0
    m = int(selected.sum())

    def packed_forward(**kwargs):
        pos = batch["position_ids"][0][keep]
        return model(input_ids=batch["input_ids"][0][keep][None], position_ids=pos[None],
                     tree_layout=TreeLayout(pos, batch["tree_leave"][0][keep]),
                     tree_pred_pos=batch["tree_pred_pos"][0][selected], tree_targets=batch["tree_targets"][0][selected])

    inputs = {
        "attention_mask": torch.ones(1, m, dtype=torch.long), "input_ids": torch.zeros(1, m, dtype=torch.long),
        "position_ids": torch.zeros(1, m, dtype=torch.long), "shift_labels": torch.full((1, m), -100),
        "token_index": torch.arange(m)[None], "old_log_probs": batch["old_log_probs"][:, selected],
        "advantages": batch["advantages"][:, selected], "segment_id": batch["segment_id"][:, selected],
        "tree_kv_index": torch.full((1, 1), -1), "tree_cu_seqlens_q": torch.full((1, 1), -1, dtype=torch.int32),
        "tree_cu_seqlens_k": torch.full((1, 1), -1, dtype=torch.int32),
        "tree_max_seqlens": torch.zeros(1, 2, dtype=torch.long),
        **{k: batch[k] for k in ("global_n_tokens", "global_n_forward_tokens", "mean_seq_len")},
    }
    return _trl_compute_loss()(trainer, packed_forward, inputs)


def test_our_objective_equals_trls_compute_loss_where_trl_is_right(trl_model):
    """One micro-batch, one rank, no filler: TRL's normalisation is the token mean, so its loss,
    gradient and metrics must equal ours exactly (our copy of its formulas stays faithful)."""
    samples = trl_samples()
    (micro,) = TreeBatcher(samples, num_processes=1, token_budget=4096, samples_per_plan=len(samples))
    batch = TreeCollator(pad_token_id=0, num_processes=1)([micro])

    ours = trl_trainer_state()
    loss = tree_compute_loss(ours, trl_model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trl_model.named_parameters() if p.requires_grad}
    trl_model.zero_grad(set_to_none=True)
    theirs = trl_trainer_state()
    trl_loss = trl_compute_loss_on(theirs, trl_model, batch)
    trl_loss.backward()

    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-7)
    for name, p in trl_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-7, rtol=1e-6)
    ours_m, theirs_m = ours._metrics["train"], theirs._metrics["train"]
    assert set(ours_m) == set(theirs_m)
    for key, values in theirs_m.items():
        (mine,) = ours_m[key]
        mine = mine[0] / mine[1] if isinstance(mine, tuple) else mine
        assert mine == pytest.approx(values[0], abs=1e-6), key


def test_collator_gives_every_rank_a_row_and_fillers_an_inert_term():
    samples = trl_samples(groups=1, generations=1)[:1]
    (micro,) = TreeBatcher(samples, num_processes=3, token_budget=4096, samples_per_plan=1)
    batch = TreeCollator(pad_token_id=0, num_processes=3)([micro])
    assert batch["attention_mask"].sum(1).min() >= 1
    assert batch["global_n_tokens"].tolist() == [float(samples[0]["completion_mask"].sum())] * 3
    assert (batch["tree_pred_pos"][1:] >= 0).sum(1).tolist() == [1, 1]
    assert batch["advantages"][1:, 0].tolist() == [0.0, 0.0]
    # The inert terms are marked, so neither the loss nor any metric counts them.
    assert batch["tree_valid"][1:, 0].tolist() == [0.0, 0.0] and batch["tree_filler"].tolist() == [0.0, 1.0, 1.0]
    assert batch["tree_real_rows"].tolist() == [1.0] * 3


def test_get_batch_samples_stamps_the_step_totals_into_every_micro_batch():
    """The trainer's prefetch of one step's micro-batches is where the step's normaliser comes from."""
    samples = trl_samples(groups=2, generations=3)
    micro = list(TreeBatcher(samples, num_processes=1, token_budget=100, samples_per_plan=len(samples)))
    collate = TreeCollator(pad_token_id=0, num_processes=1)
    it = iter([collate([mb]) for mb in micro])
    from transformers import Trainer

    class StepTrainer(TreePackingMixin, Trainer):
        pass

    trainer = StepTrainer.__new__(StepTrainer)  # only the prefetch runs: no model, no arguments needed
    batches, _ = trainer.get_batch_samples(it, len(micro), torch.device("cpu"))
    total = sum(int(s["completion_mask"].sum()) for s in samples)
    assert len(batches) == len(micro) > 1
    assert [b["tree_step_n_tokens"].tolist() for b in batches] == [[float(total)]] * len(micro)
    assert sum(b["global_n_tokens"].item() for b in batches) == total


def test_zero_or_negative_token_budget_means_trls_fixed_count():
    """TRL: token_budget <= 0 packs per_device_train_batch_size x ranks samples per micro-batch."""
    samples = trl_samples(groups=2, generations=3)  # 12 samples
    micro = list(TreeBatcher(samples, num_processes=2, token_budget=0, samples_per_plan=12,
                             samples_per_micro_batch=4))
    assert [sum(len(row) for row in mb.samples) for mb in micro] == [4, 4, 4]
    assert all(row for mb in micro for row in mb.samples)
    with pytest.raises(ValueError, match="fixed count of samples per micro-batch"):
        TreeBatcher(samples, num_processes=2, token_budget=-1, samples_per_plan=12)


def test_trl_fused_head_still_serves_calls_without_a_tree(trl_model):
    _set_attention(trl_model, "sdpa")
    ids = torch.tensor([[1, 2, 3, 4]])
    out = trl_model(input_ids=ids, shift_labels=torch.tensor([[2, 3, 4, -100]]), fused_lm_head=True)
    assert out.log_probs.shape == (1, 4)
    _set_attention(trl_model, "asyncgrpo_tree")


def test_trained_samples_keep_the_version_that_generated_them():
    """TRL's RolloutQueueDataset drops stale samples and yields dicts without the version;
    through `LastTaken` + `WithPolicyVersions` each yielded sample carries its own, and the
    counts tally them (the trainer's status reports the count)."""
    import queue

    import numpy as np
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from asyncgrpo.trainer.tree.trl_integration import LastTaken, WithPolicyVersions

    q: queue.Queue = queue.Queue()
    versions = [7, 2, 9, 8, 4, 9]  # trainer at 9, maxStaleness 2: 2 and 4 are dropped
    for i, v in enumerate(versions):
        q.put(RolloutSample(prompt=[], completion=[], input_ids=np.arange(6),
                            completion_mask=np.array([0, 0, 0, 1, 1, 1]),
                            old_log_probs=np.zeros(6, np.float32), advantage=float(i),
                            model_version=v, group_id=i, metrics={"reward": 0.0}))
    taken = LastTaken(q)
    dataset = RolloutQueueDataset(rollout_queue=taken, model_version_fn=lambda: 9,
                                  check_health_fn=lambda _s: None, stale_after_s=60,
                                  metrics=defaultdict(list), max_staleness=2)
    versions = WithPolicyVersions(dataset, taken)
    batcher = TreeBatcher(versions, num_processes=1, token_budget=64, samples_per_plan=4)
    micro = next(iter(batcher))
    yielded = sorted((s["advantage"], s["model_version"]) for row in micro.samples for s in row)
    assert yielded == [(0.0, 7), (2.0, 9), (3.0, 8), (5.0, 9)]
    assert versions.counts == {9: 2, 7: 1, 8: 1}
