"""`asyncgrpo tree verify`: a training step on tree rows equals training every rollout alone.

The packed side runs the trainer's own code path for whole steps: the planner and collator
(`TreeBatcher`, `TreeCollator`), gradient accumulation over the planned micro-batches with
the step's totals stamped in (`objective.stamp_step`), every rank's row through
`forward_row`/`row_loss`, the gradient averaged over ranks as FSDP does. The reference
forwards each rollout by itself with the model's ordinary causal SDPA attention and takes
the GRPO loss as the token mean over the step's trained tokens. Per-token log-probs, the
step loss, every trainable gradient and the logged token-mean metrics must agree to fp32
round-off, so a wrong normalisation (uneven micro-batches weighed per micro-batch, an inert
filler term counted) fails it. Without `old_log_probs` in the file the step is on-policy:
the reference's own log-probs, detached, serve as old log-probs on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from . import objective
from .attention import TREE_ATTENTION, install_tree_attention, uses_flex
from .layout import TreeLayout
from .loss import add_tree_lm_head, grpo_loss
from .metrics import PackingMetrics
from .rollout import Rollout

#: fp32 tolerances. Packed and reference differ only in the order of floating-point sums
#: (attention over other key orders and block splits), which stays ~1e-6 on these models.
TOLERANCE = {
    "max_logprob_abs_diff": 2e-5,
    "loss_abs_diff": 2e-6,
    "max_grad_rel_diff": 1e-4,
    "max_metric_abs_diff": 1e-5,
}


def build_model(kind: str = "dense", seed: int = 0, lora: bool = False, device: str = "cpu",
                dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random Qwen3 (see asyncgrpo.trainer.tiny) with the tree LM head, optionally under LoRA."""
    from asyncgrpo.trainer.tiny import tiny_model

    model = tiny_model(kind, seed=seed, dtype=dtype, **overrides)
    add_tree_lm_head(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        # Random B as well as A, so every LoRA weight gets a gradient to compare.
        config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    install_tree_attention(model)
    return model.to(device)


def _set_attention(model, name: str) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(name)


def reference_output(model, rollout: Rollout, device):
    """Log-probs (and entropies) of a rollout's trained tokens, forwarded alone with causal SDPA."""
    positions = [p for p in range(1, len(rollout)) if rollout.completion_mask[p]]
    ids = torch.tensor(rollout.input_ids, device=device)[None]
    pred = torch.tensor([p - 1 for p in positions], dtype=torch.long, device=device)
    target = torch.tensor([rollout.input_ids[p] for p in positions], dtype=torch.long, device=device)
    return model(input_ids=ids, tree_pred_pos=pred, tree_targets=target)


def reference_log_probs(model, rollout: Rollout, device) -> torch.Tensor:
    """Log-probs of a rollout's trained tokens, forwarded alone with causal SDPA (the ground truth)."""
    return reference_output(model, rollout, device).log_probs


def packed_log_probs(model, row, device) -> torch.Tensor:
    row = row.to(device)
    return model(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        tree_layout=TreeLayout.from_row(row),
        tree_pred_pos=row.pred_pos,
        tree_targets=row.target,
    ).log_probs


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters() if p.requires_grad
    }


def _grad_diff(grads: dict, grads_ref: dict) -> tuple[float, float]:
    grad_abs = grad_rel = 0.0
    for name, g_ref in grads_ref.items():
        diff = (grads[name] - g_ref).abs().max().item()
        scale = g_ref.abs().max().item()
        grad_abs = max(grad_abs, diff)
        grad_rel = max(grad_rel, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return grad_abs, grad_rel


def _with_old_log_probs(model, rollouts: Sequence[Rollout], device) -> list[Rollout]:
    """On-policy where the file gives no old log-probs: the reference's own, detached."""
    out = []
    with torch.no_grad():
        for r in rollouts:
            if r.old_log_probs is not None:
                out.append(r)
                continue
            lp = reference_log_probs(model, r, device).tolist()
            old = [0.0] * len(r)
            for p, value in zip((p for p in range(1, len(r)) if r.completion_mask[p]), lp):
                old[p] = value
            out.append(replace(r, old_log_probs=tuple(old)))
    return out


def _samples(rollouts: Sequence[Rollout]) -> list[dict]:
    """The rollouts as TRL's rollout queue yields them (what the trainer's `TreeBatcher` reads)."""
    return [{
        "input_ids": torch.tensor(r.input_ids), "completion_mask": torch.tensor(r.completion_mask),
        "old_log_probs": torch.tensor(r.old_log_probs), "advantage": r.advantage, "group_id": r.group_id,
        "index": i,
    } for i, r in enumerate(rollouts)]


def _reference_step(model, rollouts: Sequence[Rollout], members: list[int], device, epsilon: float):
    """Unpacked training of one step: each rollout alone, loss = token mean over the step's terms."""
    model.zero_grad(set_to_none=True)
    total = max(sum(rollouts[i].trained for i in members), 1)
    loss_sum, lps, stats = 0.0, {}, []
    for i in members:
        r = rollouts[i]
        out = reference_output(model, r, device)
        positions = [p for p in range(1, len(r)) if r.completion_mask[p]]
        old = torch.tensor([r.old_log_probs[p] for p in positions], device=device)
        adv = torch.full_like(out.log_probs, r.advantage)
        loss = grpo_loss(out.log_probs, old, adv, epsilon, epsilon, total)
        loss.backward()
        loss_sum += loss.item()
        lps[i] = out.log_probs.detach()
        t = objective.policy_terms(out.log_probs.detach(), old, adv, epsilon, epsilon)
        stats.append(objective.local_sums(t, out.entropy, torch.ones_like(adv)))
    sums = torch.stack(stats).sum(0) if stats else torch.zeros(9)
    metrics = {k: (n / c if c else 0.0) for k, (n, c) in objective.mean_metrics(sums).items()}
    return loss_sum, lps, _grads(model), metrics


def compare(model, rollouts: Sequence[Rollout], ranks: int = 1, budget: int = 4096,
            device: str = "cpu", epsilon: float = 0.2, grad_accum: int = 0) -> dict:
    """Train one or more steps as the trainer does and as unpacked training would; return the differences.

    Packed side, as `TreePackingMixin` trains: `TreeBatcher` plans the file for `ranks` ranks
    under `budget`, `TreeCollator` builds each micro-batch, `grad_accum` consecutive
    micro-batches make an optimizer step (0: all of them, one step) and get the step's totals
    (`objective.stamp_step`, as `get_batch_samples` does), every rank's row goes through
    `forward_row`/`row_loss` and its gradient is averaged over ranks as FSDP does (here the
    ranks run one after another in this process; their metric sums are added as the
    all-reduce would). Reference, per step: every rollout of the step forwarded alone, the
    loss the token mean over the step's trained tokens. Log-probs, loss, gradients and the
    token-mean metrics (ratio, KL, entropy, clip fractions) must agree.
    """
    from .trl_integration import TreeBatcher, TreeCollator, forward_row, row_loss

    device = torch.device(device)
    _set_attention(model, "sdpa")
    rollouts = _with_old_log_probs(model, rollouts, device)
    micro = list(TreeBatcher(_samples(rollouts), ranks, budget, samples_per_plan=len(rollouts)))
    collate = TreeCollator(pad_token_id=0, num_processes=ranks)
    per_step = grad_accum if grad_accum > 0 else len(micro)
    steps = [micro[i: i + per_step] for i in range(0, len(micro), per_step)]

    result = {"loss_reference": 0.0, "loss_packed": 0.0, "max_logprob_abs_diff": 0.0, "loss_abs_diff": 0.0,
              "max_grad_abs_diff": 0.0, "max_grad_rel_diff": 0.0, "max_metric_abs_diff": 0.0}
    step_tokens = []
    for step in steps:
        members = [s["index"] for mb in step for row in mb.samples for s in row]
        _set_attention(model, "sdpa")
        loss_ref, ref_lp, grads_ref, metrics_ref = _reference_step(model, rollouts, members, device, epsilon)

        _set_attention(model, TREE_ATTENTION)
        model.zero_grad(set_to_none=True)
        batches = [{k: v.to(device) for k, v in collate([mb]).items()} for mb in step]
        objective.stamp_step(batches)
        step_tokens.append(int(batches[0]["tree_step_n_tokens"][0]))
        loss_packed, sums = 0.0, torch.zeros(9, device=device)
        for mb, batch in zip(step, batches):
            for rank in range(ranks):
                inputs = {k: v[rank: rank + 1] for k, v in batch.items()}
                row = forward_row(model, inputs)
                loss, terms = row_loss(row, inputs, ranks, epsilon, epsilon)
                (loss / ranks).backward()  # FSDP/DDP average the gradient over ranks
                loss_packed += loss.item() / ranks
                sums += objective.local_sums(terms, row.entropy, row.valid, real_row=not row.filler)
                sources = [s["index"] for s in mb.samples[rank]]
                seen: dict[int, int] = {}
                for k, (segment, valid) in enumerate(zip(row.segment_id.tolist(), row.valid.tolist())):
                    if not valid:
                        continue
                    src = sources[segment]
                    j = seen[src] = seen.get(src, -1) + 1
                    diff = abs(row.log_probs[k].item() - ref_lp[src][j].item())
                    result["max_logprob_abs_diff"] = max(result["max_logprob_abs_diff"], diff)
        metrics = {k: (n / c if c else 0.0) for k, (n, c) in objective.mean_metrics(sums).items()}
        grad_abs, grad_rel = _grad_diff(_grads(model), grads_ref)
        result["loss_reference"] += loss_ref
        result["loss_packed"] += loss_packed
        result["loss_abs_diff"] = max(result["loss_abs_diff"], abs(loss_packed - loss_ref))
        result["max_grad_abs_diff"] = max(result["max_grad_abs_diff"], grad_abs)
        result["max_grad_rel_diff"] = max(result["max_grad_rel_diff"], grad_rel)
        result["max_metric_abs_diff"] = max(result["max_metric_abs_diff"],
                                            *(abs(metrics[k] - metrics_ref[k]) for k in metrics_ref))

    batches = [mb.batch for mb in micro]
    metrics = PackingMetrics.of(batches)
    placed = sorted(s for b in batches for srcs in b.sources for s in srcs)
    return {
        "rollouts": len(rollouts),
        "tokens_raw": metrics.raw_tokens,
        "tokens_forwarded": metrics.forwarded_tokens,
        "tokens_distinct": metrics.distinct_tokens,
        "compression_ratio": round(metrics.compression_ratio, 4),
        "trained_tokens": metrics.trained_tokens,
        "micro_batches": metrics.micro_batches,
        "micro_batch_trained_tokens": [b.trained for b in batches],
        "steps": len(steps),
        "step_trained_tokens": step_tokens,
        "filler_rows": metrics.filler_rows,
        "rank_tokens": metrics.rank_tokens,
        "rank_load": metrics.rank_load,
        "dropped": len(rollouts) - len(set(placed)),
        "duplicated": len(placed) - len(set(placed)),
        **result,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "attention": "flex" if uses_flex(device) else "sdpa-segments",
    }


def verdict(result: dict) -> tuple[bool, list[str]]:
    """Whether `compare`'s result passes; the reasons when it does not."""
    problems = [f"{k}={result[k]:.3g} > {tol:g}" for k, tol in TOLERANCE.items() if not result[k] <= tol]
    if result["dropped"]:
        problems.append(f"dropped={result['dropped']}")
    if result["duplicated"]:
        problems.append(f"duplicated={result['duplicated']}")
    return not problems, problems
