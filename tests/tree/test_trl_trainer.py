"""TRL 1.16.0's real AsyncGRPOTrainer loop, with `TreePackingMixin` mixed in as the trainer runtime
does (`asyncgrpo.trainer.grpo.S3AdapterGRPOTrainer`), takes the exact gradient.

No vLLM here: rollouts come from a replay worker and weights go nowhere, through the two
protocols TRL's constructor takes for exactly that (`rollout_worker=`, `weight_transfer=`).
Everything between the queue and the optimizer is TRL's (dataset, accelerate dispatch, HF
Trainer step, `compute_loss`) with our planner, collator, attention and head in place. The
gradient reaching the optimizer must equal training on each rollout alone.
"""

import queue

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from asyncgrpo.trainer.tree.budget import plan
from asyncgrpo.trainer.tree.loss import add_tree_lm_head, grpo_loss
from asyncgrpo.trainer.tree.rollout import Rollout
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts
from asyncgrpo.trainer.tree.verify import reference_log_probs


class ReplayRolloutWorker:
    """TRL's RolloutWorkerProtocol over fixed, already scored samples (no generation).

    The samples are queued twice: accelerate's dispatcher fetches the batch after the
    last step before it knows training is over.
    """

    def __init__(self, samples):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()  # measures nothing: stays empty
        for s in samples + samples:
            self.rollout_buffer.put(s)

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        if self.rollout_buffer.empty():
            raise RuntimeError("replay exhausted")


class DiscardWeights:
    """TRL's WeightTransferProtocol with no server: consumes the weights it is sent."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


class GradientsAtStep(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rollout_samples(rollouts, old_log_probs):
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    group_ids = {g: i for i, g in enumerate(dict.fromkeys(r.group_id for r in rollouts))}
    return [
        RolloutSample(
            prompt=[], completion=[], input_ids=np.array(r.input_ids), completion_mask=np.array(r.completion_mask),
            old_log_probs=old, advantage=r.advantage, model_version=1, group_id=group_ids[r.group_id],
            metrics={"reward": r.advantage},
        )
        for r, old in zip(rollouts, old_log_probs)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("budget", "grad_accum"), [(4096, 1), (100, 4)], ids=["one-micro-batch", "uneven-4"])
def test_trl_trainer_step_with_the_mixin_takes_the_unpacked_gradient(tmp_path, monkeypatch, budget,
                                                                     grad_accum):
    """`uneven-4`: budget 100 plans micro-batches of 16, 16, 8 and 8 trained tokens, accumulated into
    one step. TRL's own normalisation (each micro-batch by its tokens, then / 4) weighs a token of
    the small ones 2x; the step must take the token mean over all 48."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as agt

    from asyncgrpo.trainer.tree.trl_integration import TreePackingMixin

    class TreeTrainer(TreePackingMixin, AsyncGRPOTrainer):
        """The mixin as the trainer runtime uses it, without its S3 and vLLM parts."""

    # TRL asks CUDA for the device name at init (MFU metrics); this host has no CUDA.
    monkeypatch.setattr(agt, "get_peak_flops_per_device", lambda *args: None)
    train_one_step_and_compare(TreeTrainer, tmp_path, budget, grad_accum)
    assert AsyncGRPOTrainer.compute_loss.__module__.startswith("trl.")  # TRL's class untouched


def train_one_step_and_compare(trainer_class, tmp_path, budget, grad_accum):
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from asyncgrpo.trainer.tiny import save_tiny_model, tiny_model
    from asyncgrpo.trainer.tiny_tokenizer import tiny_tokenizer

    model_dir = save_tiny_model(tmp_path / "model", "dense", seed=11)
    rollouts = synthetic_rollouts(groups=2, generations=3, prompt=20, completion=8, turns=2, seed=2)
    rng = np.random.default_rng(0)
    old = [(-6.2 + 0.5 * rng.standard_normal(len(r))).astype(np.float32) for r in rollouts]

    grads = GradientsAtStep()
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=len(rollouts),
        gradient_accumulation_steps=grad_accum, token_budget=budget, max_grad_norm=0.0, learning_rate=1e-3,
        report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, weight_sync_steps=1000,
        max_staleness=10, dtype="float32", bf16=False,  # TRL defaults to bf16 autocast
    )
    trainer = trainer_class(
        model=str(model_dir), args=args, processing_class=tiny_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]}),
        rollout_worker=ReplayRolloutWorker(rollout_samples(rollouts, old)), weight_transfer=DiscardWeights(),
        callbacks=[grads],
    )
    assert trainer.model.config._attn_implementation == "asyncgrpo_tree"
    trainer.samples_per_plan = len(rollouts)  # one plan per step, however many micro-batches it makes
    planned = [mb.trained for mb in plan(rollouts, 1, budget)]
    assert len(planned) == grad_accum and (grad_accum == 1 or len(set(planned)) > 1)
    trainer.train()
    assert grads.grads is not None

    reference = tiny_model("dense", seed=11)
    add_tree_lm_head(reference)
    total = sum(r.trained for r in rollouts)
    for r, o in zip(rollouts, old):
        lp = reference_log_probs(reference, Rollout.make(r.group_id, r.input_ids, r.completion_mask, r.advantage),
                                 "cpu")
        trained = torch.tensor(r.completion_mask, dtype=torch.bool)
        grpo_loss(lp, torch.from_numpy(o)[trained], torch.full_like(lp, r.advantage), 0.2, 0.2, total).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads.grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "tree/compression_ratio" in logged and "loss" in logged
    assert trainer.state.log_history[0]["batch/microbatches_per_step"] == grad_accum
