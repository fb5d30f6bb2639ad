"""One rank of the FSDP2 checks (run by test_distributed.py under torchrun, gloo on CPU).

Every rank plans the same step (`TreeBatcher`, `TreeCollator`, the step totals stamped as the
trainer's `get_batch_samples` does), takes its own row of each micro-batch and trains it
through `tree_compute_loss` (TRL's metric collectives over a real process group) on an
FSDP2-sharded tiny Qwen3, accumulating the micro-batches' gradients. Rank 0 then compares
the gradients, the step loss and every logged metric with one process forwarding every
rollout alone, unsharded, and writes the differences to the JSON file in argv[1].

argv[2] picks the step: `uneven` (9 rollouts over 2+ ranks at a small budget: several
micro-batches with different token counts) or `filler` (one 9-term rollout, more ranks than
rollouts: the other ranks forward filler rows with an inert term).
"""

import copy
import json
import math
import sys
import types
from collections import defaultdict

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

from asyncgrpo.testing.ranks import leave_after_barrier
from asyncgrpo.trainer.tree import objective
from asyncgrpo.trainer.tree.loss import grpo_loss
from asyncgrpo.trainer.tree.rollout import Rollout
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts
from asyncgrpo.trainer.tree.trl_integration import (
    TreeBatcher,
    TreeCollator,
    install_tree_packing,
    rollout_from_sample,
    tree_compute_loss,
)
from asyncgrpo.trainer.tree.verify import _set_attention, reference_output

EPS = 0.2


def samples(scenario: str):
    g = torch.Generator().manual_seed(0)
    if scenario == "filler":
        ids = torch.randint(0, 512, (33,), generator=g).tolist()
        rollouts = [Rollout.make("g0", ids, [0] * 24 + [1] * 9, 0.7)]
    else:
        rollouts = synthetic_rollouts(groups=3, generations=3, prompt=24, completion=10, turns=2, seed=1)
    out = []
    for r in rollouts:
        out.append({
            "input_ids": torch.tensor(r.input_ids), "completion_mask": torch.tensor(r.completion_mask),
            "old_log_probs": -6.2 + 0.5 * torch.randn(len(r), generator=g), "advantage": r.advantage,
            "group_id": r.group_id, "metrics": {},
        })
    return out


def logged(metrics: dict) -> dict:
    """What TRL's sink logs for a window: (sum, count) pairs as sum/sum, extrema as such."""
    out = {}
    for key, values in metrics.items():
        values = [v for v in values if isinstance(v, tuple) or not math.isnan(v)]
        if not values:
            continue
        if isinstance(values[0], tuple):
            num, den = (sum(x) for x in zip(*values))
            out[key] = num / den
        else:
            out[key] = (min if key.endswith("min") else max)(values)
    return out


def reference_metrics(parts) -> dict:
    """Token means over every trained token, per completion extrema: the unpacked run's numbers."""
    lp = torch.cat([p[0] for p in parts])
    old = torch.cat([p[1] for p in parts])
    adv = torch.cat([p[2] for p in parts])
    ent = torch.cat([p[3] for p in parts])
    ratio = torch.exp(lp - old)
    low = (ratio < 1 - EPS) & (adv < 0)
    high = (ratio > 1 + EPS) & (adv > 0)
    per_low = [((torch.exp(p[0] - p[1]) < 1 - EPS) & (p[2] < 0)).float().mean().item() for p in parts]
    per_high = [((torch.exp(p[0] - p[1]) > 1 + EPS) & (p[2] > 0)).float().mean().item() for p in parts]
    return {
        "ratio": ratio.mean().item(), "kl": ((ratio - 1) - (lp - old)).mean().item(), "entropy": ent.mean().item(),
        "clip_ratio/low_mean": low.float().mean().item(), "clip_ratio/high_mean": high.float().mean().item(),
        "clip_ratio/region_mean": (low | high).float().mean().item(),
        "clip_ratio/low_min": min(per_low), "clip_ratio/high_max": max(per_high),
    }


def main(result_path: str, scenario: str) -> None:
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

    data = samples(scenario)
    budget = 80 if scenario == "uneven" else 400
    micro = list(TreeBatcher(data, world, token_budget=budget, samples_per_plan=len(data)))
    collate = TreeCollator(pad_token_id=0, num_processes=world)
    batches = [collate([mb]) for mb in micro]
    objective.stamp_step(batches)  # what TreePackingMixin.get_batch_samples does for the step
    trainer = types.SimpleNamespace(
        epsilon_low=EPS, epsilon_high=EPS, accelerator=accelerator, current_gradient_accumulation_steps=len(batches),
        aux_loss_enabled=False, router_aux_loss_coef=0.0, _metrics={"train": defaultdict(list)},
        _step_forward_tokens=0.0, _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0,
        _step_forward_s=0.0,
    )
    local_loss = 0.0
    for batch in batches:
        inputs = {k: v[rank: rank + 1] for k, v in batch.items()}
        loss = tree_compute_loss(trainer, model, inputs)
        loss.backward()
        local_loss += loss.item()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    losses = [None] * world
    dist.all_gather_object(losses, local_loss)

    if rank == 0:
        _set_attention(reference, "sdpa")
        total = sum(int(s["completion_mask"].sum()) for s in data)
        ref_loss, parts = 0.0, []
        for s in data:
            r = rollout_from_sample(s)
            out = reference_output(reference, r, "cpu")
            old = s["old_log_probs"][s["completion_mask"].bool()]
            adv = torch.full_like(out.log_probs, r.advantage)
            part = grpo_loss(out.log_probs, old, adv, EPS, EPS, total)
            part.backward()
            ref_loss += part.item()
            parts.append((out.log_probs.detach(), old, adv, out.entropy.detach()))
        rel = max(
            ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)).item()
            for n, p in reference.named_parameters()
        )
        with open(result_path, "w") as out:
            json.dump({
                "world": world, "micro_batches": len(batches),
                "micro_batch_trained_tokens": [mb.batch.trained for mb in micro],
                "filler_rows": int(sum(b["tree_filler"].sum().item() for b in batches)),
                "rank_rows": [int(m) for m in batches[0]["attention_mask"].sum(1)],
                # FSDP averages gradients over ranks; each rank's loss is world / step terms x its sum.
                "loss_sum_over_ranks_div_world": sum(losses) / world, "loss_reference": ref_loss,
                "max_grad_rel_diff": rel,
                "metrics": logged(trainer._metrics["train"]), "metrics_reference": reference_metrics(parts),
            }, out)
    leave_after_barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "uneven")
