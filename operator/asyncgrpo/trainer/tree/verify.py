"""`asyncgrpo tree verify`: tree-packed training equals forwarding every rollout alone.

The reference forwards each rollout by itself with the model's ordinary causal SDPA
attention; the packed side plans micro-batches for `ranks` ranks and forwards each row with
tree attention. Both score the same terms with the same LM head and GRPO loss, normalised
by the total trained tokens (what TRL's per-rank normalisation and the DDP/FSDP gradient
average add up to), so per-token log-probs, the loss and every trainable gradient must
agree to fp32 round-off. Without `old_log_probs` in the file the step is on-policy: the
reference's own log-probs, detached, serve as old log-probs on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .attention import TREE_ATTENTION, install_tree_attention, uses_flex
from .budget import plan
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


def reference_log_probs(model, rollout: Rollout, device) -> torch.Tensor:
    """Log-probs of a rollout's trained tokens, forwarded alone with causal SDPA (the ground truth)."""
    positions = [p for p in range(1, len(rollout)) if rollout.completion_mask[p]]
    ids = torch.tensor(rollout.input_ids, device=device)[None]
    pred = torch.tensor([p - 1 for p in positions], dtype=torch.long, device=device)
    target = torch.tensor([rollout.input_ids[p] for p in positions], dtype=torch.long, device=device)
    return model(input_ids=ids, tree_pred_pos=pred, tree_targets=target).log_probs


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


def compare(model, rollouts: Sequence[Rollout], ranks: int = 1, budget: int = 4096,
            device: str = "cpu", epsilon: float = 0.2) -> dict:
    """Run both sides on `model` and return the differences and packing numbers."""
    device = torch.device(device)
    total_terms = max(sum(r.trained for r in rollouts), 1)

    # Reference: every rollout alone.
    _set_attention(model, "sdpa")
    model.zero_grad(set_to_none=True)
    ref_lp, old_lp, loss_ref = [], [], 0.0
    for r in rollouts:
        lp = reference_log_probs(model, r, device)
        positions = [p for p in range(1, len(r)) if r.completion_mask[p]]
        old = (torch.tensor([r.old_log_probs[p] for p in positions], device=device)
               if r.old_log_probs is not None else lp.detach())
        loss = grpo_loss(lp, old, torch.full_like(lp, r.advantage), epsilon, epsilon, total_terms)
        loss.backward()
        loss_ref += loss.item()
        ref_lp.append(lp.detach())
        old_lp.append(old)
    grads_ref = _grads(model)

    # Packed: micro-batches of one tree row per rank, their gradients accumulated.
    _set_attention(model, TREE_ATTENTION)
    model.zero_grad(set_to_none=True)
    batches = plan(rollouts, ranks, budget)
    loss_packed, max_lp_diff = 0.0, 0.0
    for batch in batches:
        for row, sources in zip(batch.rows, batch.sources):
            lp = packed_log_probs(model, row, device)
            src = [sources[j] for j in row.rollout.tolist()]
            first = {}
            for k, s in enumerate(src):
                first.setdefault(s, k)
            index = torch.tensor([k - first[s] for k, s in enumerate(src)], dtype=torch.long)
            old = torch.stack([old_lp[s][i] for s, i in zip(src, index.tolist())]) if src else lp.detach()
            ref = torch.stack([ref_lp[s][i] for s, i in zip(src, index.tolist())]) if src else lp.detach()
            if src:
                max_lp_diff = max(max_lp_diff, (lp.detach() - ref).abs().max().item())
            loss = grpo_loss(lp, old, row.advantage.to(device), epsilon, epsilon, total_terms)
            loss.backward()
            loss_packed += loss.item()
    grads = _grads(model)

    grad_abs = grad_rel = 0.0
    for name, g_ref in grads_ref.items():
        diff = (grads[name] - g_ref).abs().max().item()
        scale = g_ref.abs().max().item()
        grad_abs = max(grad_abs, diff)
        grad_rel = max(grad_rel, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))

    metrics = PackingMetrics.of(batches)
    placed = sorted(s for b in batches for srcs in b.sources for s in srcs)
    return {
        "rollouts": len(rollouts),
        "tokens_raw": metrics.raw_tokens,
        "tokens_forwarded": metrics.forwarded_tokens,
        "compression_ratio": round(metrics.compression_ratio, 4),
        "trained_tokens": metrics.trained_tokens,
        "micro_batches": metrics.micro_batches,
        "filler_rows": metrics.filler_rows,
        "rank_tokens": metrics.rank_tokens,
        "rank_load": metrics.rank_load,
        "dropped": len(rollouts) - len(set(placed)),
        "duplicated": len(placed) - len(set(placed)),
        "loss_reference": loss_ref,
        "loss_packed": loss_packed,
        "max_logprob_abs_diff": max_lp_diff,
        "loss_abs_diff": abs(loss_packed - loss_ref),
        "max_grad_abs_diff": grad_abs,
        "max_grad_rel_diff": grad_rel,
        "trainable_parameters": sum(g.numel() for g in grads.values()),
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
