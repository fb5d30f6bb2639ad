"""The GRPO objective of one optimizer step over tree rows: TRL 1.16.0's loss and metrics, two fixes.

TRL's `AsyncGRPOTrainer.compute_loss` divides each micro-batch's summed per-token loss by
that micro-batch's trained tokens (per rank) and then by the gradient-accumulation count.
That is the token mean TRL documents only when every micro-batch carries the same number of
trained tokens; a budget planner makes uneven micro-batches (5376 / 5376 / 1536 on a
6-turn agentic file), and a leftover rollout alone in a micro-batch then weighs ~7x per
token. Here the loss of a step is

    sum over the step's trained terms (all micro-batches, all ranks) / the step's trained terms

and each rank returns `world / step_terms * its own sum`, because FSDP/DDP average the
gradient over ranks. The counts are batch-wide, so no collective is needed for them.

Inert terms (`valid == 0`: the one term a filler row carries so every rank runs the same
forward, backward and collectives) weigh zero in the loss and never enter a metric. The
metrics are TRL's keys, logged as `(sum, count)` pairs that TRL's sink reduces as
sum/sum over its logging window: a token mean, never a mean of micro-batch means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Token-mean metrics, in the order of `local_sums` (the last two entries are the term count
#: and the MoE aux loss over real rows with the real-row count).
MEAN_KEYS = (
    "ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
)


@dataclass
class Terms:
    """Per-term quantities of the clipped policy loss (TRL 1.16.0's formulas)."""

    per_term: torch.Tensor  # -min(r A, clip(r) A)
    ratio: torch.Tensor  # r = exp(log p - log p_old)
    log_ratio: torch.Tensor
    low_clipped: torch.Tensor  # bool: r < 1 - eps_low and A < 0
    high_clipped: torch.Tensor  # bool: r > 1 + eps_high and A > 0


def policy_terms(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 epsilon_low: float, epsilon_high: float) -> Terms:
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_term = -torch.min(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return Terms(per_term, ratio, log_ratio, low, high)


def step_loss(terms: Terms, valid: torch.Tensor, step_terms: float | torch.Tensor, world: int) -> torch.Tensor:
    """This rank's share of the step's token-mean loss: `world / step_terms * sum(valid terms)`.

    Summed over the step's micro-batches and averaged over ranks (FSDP), it is the token mean
    over every trained term of the step, however the planner cut it.
    """
    step_terms = torch.as_tensor(step_terms, dtype=torch.float32, device=terms.per_term.device).clamp(min=1.0)
    return (terms.per_term * valid).sum() * (world / step_terms)


def local_sums(terms: Terms, entropy: torch.Tensor, valid: torch.Tensor,
               aux_loss: torch.Tensor | None = None, real_row: bool = True) -> torch.Tensor:
    """[ratio, kl, entropy, low, high, region, count, aux, rows] summed over this rank's valid terms.

    KL is Schulman's k3 estimator, as TRL logs it. One tensor so one all-reduce carries it.
    """
    with torch.no_grad():
        v = valid.to(terms.ratio.dtype)
        kl = (terms.ratio - 1) - terms.log_ratio
        region = terms.low_clipped | terms.high_clipped
        row = 1.0 if real_row else 0.0
        aux = aux_loss.detach().float() * row if aux_loss is not None else torch.zeros((), device=v.device)
        return torch.stack([
            (terms.ratio * v).sum(), (kl * v).sum(), (entropy.detach() * v).sum(),
            (terms.low_clipped * v).sum(), (terms.high_clipped * v).sum(), (region * v).sum(), v.sum(),
            aux.to(v.dtype).reshape(()), torch.tensor(row, dtype=v.dtype, device=v.device),
        ])


def mean_metrics(sums: torch.Tensor, with_aux: bool = False) -> dict[str, tuple[float, float]]:
    """(sum, count) pairs for TRL's metric sink from all-reduced `local_sums`."""
    values = sums.tolist()
    count = values[6]
    out = {key: (values[i], count) for i, key in enumerate(MEAN_KEYS)}
    if with_aux:
        out["aux_loss"] = (values[7], values[8])
    return out


def per_sequence_clip(terms: Terms, valid: torch.Tensor, segment_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (min low-clip fraction, max high-clip fraction) over its completions.

    NaN where the rank has no valid term (TRL's nanmin/nanmax then skip it after the gather).
    """
    from trl.trainer.utils import nanmax, nanmin

    with torch.no_grad():
        v = valid.float()
        n = int(segment_id.max()) + 1 if segment_id.numel() else 1

        def seg_sum(vals):
            return torch.zeros(n, device=vals.device).index_add_(0, segment_id, vals.float() * v)

        tokens = seg_sum(torch.ones_like(v))
        tokens = torch.where(tokens > 0, tokens, torch.full_like(tokens, float("nan")))
        return nanmin(seg_sum(terms.low_clipped) / tokens), nanmax(seg_sum(terms.high_clipped) / tokens)


def stamp_step(batches: list[dict[str, torch.Tensor]]) -> None:
    """Write the step's totals into each of its micro-batches (in place), as the trainer prefetches them.

    `tree_step_n_tokens`: trained terms of the whole step; `tree_step_rows`: its real (non-filler)
    rows. Both come from batch-wide fields every rank holds, so every rank computes the same.
    """
    tokens = sum(float(b["global_n_tokens"].reshape(-1)[0]) for b in batches)
    rows = sum(float(b["tree_real_rows"].reshape(-1)[0]) for b in batches)
    for b in batches:
        b["tree_step_n_tokens"] = torch.full_like(b["global_n_tokens"], tokens)
        b["tree_step_rows"] = torch.full_like(b["global_n_tokens"], rows)
