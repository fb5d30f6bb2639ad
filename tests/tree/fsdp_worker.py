"""One rank of the FSDP2 check (run by test_distributed.py under torchrun, gloo on CPU).

Every rank plans the same micro-batch, takes its own row of `TreeCollator`'s batch, and
trains it through TRL's real `compute_loss` (via `tree_compute_loss`) on an FSDP2-sharded
tiny Qwen3. Rank 0 then compares the all-reduced gradients with one process forwarding
every rollout alone, unsharded, and writes the differences to the JSON file in argv[1].
"""

import copy
import json
import sys
import types
from collections import defaultdict

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

from asyncgrpo.trainer.tree.loss import grpo_loss
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts
from asyncgrpo.trainer.tree.trl_integration import (
    TreeBatcher,
    TreeCollator,
    install_tree_packing,
    rollout_from_sample,
    tree_compute_loss,
)
from asyncgrpo.trainer.tree.verify import _set_attention, reference_log_probs


def samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for r in synthetic_rollouts(groups=3, generations=3, prompt=24, completion=10, turns=2, seed=1):
        out.append({
            "input_ids": torch.tensor(r.input_ids), "completion_mask": torch.tensor(r.completion_mask),
            "old_log_probs": -6.2 + 0.5 * torch.randn(len(r), generator=g), "advantage": r.advantage,
            "group_id": r.group_id, "metrics": {},
        })
    return out


def main(result_path: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()

    from asyncgrpo.trainer.tiny import tiny_model

    model = tiny_model("dense", seed=3)
    install_tree_packing(model)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    data = samples()
    (micro,) = TreeBatcher(data, world, token_budget=400, samples_per_plan=len(data))
    batch = TreeCollator(pad_token_id=0, num_processes=world)([micro])
    inputs = {k: v[rank: rank + 1] for k, v in batch.items()}
    trainer = types.SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.2, accelerator=accelerator, current_gradient_accumulation_steps=1,
        aux_loss_enabled=False, router_aux_loss_coef=0.0, _metrics={"train": defaultdict(list)},
        _step_forward_tokens=0.0, _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0,
        _step_forward_s=0.0,
    )
    loss = tree_compute_loss(trainer, model, inputs)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    losses = [None] * world
    dist.all_gather_object(losses, loss.item())

    if rank == 0:
        _set_attention(reference, "sdpa")
        total = sum(int(s["completion_mask"].sum()) for s in data)
        ref_loss = 0.0
        for s in data:
            r = rollout_from_sample(s)
            lp = reference_log_probs(reference, r, "cpu")
            old = s["old_log_probs"][s["completion_mask"].bool()]
            part = grpo_loss(lp, old, torch.full_like(lp, r.advantage), 0.2, 0.2, total)
            part.backward()
            ref_loss += part.item()
        rel = max(
            ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)).item()
            for n, p in reference.named_parameters()
        )
        with open(result_path, "w") as out:
            json.dump({
                "world": world, "rank_rows": [int(m) for m in batch["attention_mask"].sum(1)],
                # FSDP averages gradients over ranks; TRL scales each rank's loss by world / global terms.
                "loss_sum_over_ranks_div_world": sum(losses) / world, "loss_reference": ref_loss,
                "max_grad_rel_diff": rel,
            }, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
