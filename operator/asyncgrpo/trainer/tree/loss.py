"""Per-term log-probs over a packed row, and the GRPO loss on them.

The logits are never materialised for the whole row: only the hidden states named by
`pred_pos` go through the LM head, in TRL's `ChunkedLogProbFunction` (tiles over the
vocabulary, recomputed in backward). A fork position is gathered once per branch, which
is how one position predicts a different next token for each branch. The policy loss is
TRL 1.16 `AsyncGRPOTrainer.compute_loss`'s formula, so the numbers match what TRL trains.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

#: Vocabulary tile of the chunked LM head (TRL's default).
CHUNK_SIZE = 32768


@dataclass
class TreeLogProbOutput(ModelOutput):
    """Output of a model with `add_tree_lm_head`, called with `tree_pred_pos=` and `tree_targets=`."""

    log_probs: torch.Tensor | None = None  # [M]
    entropy: torch.Tensor | None = None  # [M]
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss over the forwarded tokens


def _full(t):
    """FSDP2 shards the head as a DTensor; the tile projection needs the whole weight."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def term_log_probs(hidden: torch.Tensor, lm_head: torch.nn.Module, pred_pos: torch.Tensor,
                   targets: torch.Tensor, temperature: float = 1.0, softcap: float | None = None,
                   logit_scale: float = 1.0, with_entropy: bool = True):
    """(log p(target | context), entropy) for every loss term; `hidden` is [N, H] of one row."""
    from trl.kernels import ChunkedLogProbFunction

    weight = _full(lm_head.weight)
    bias = None if getattr(lm_head, "bias", None) is None else _full(lm_head.bias)
    picked = hidden.index_select(0, pred_pos.to(hidden.device))
    outputs = ("entropy",) if with_entropy else ()
    log_probs, entropy, *_ = ChunkedLogProbFunction.apply(
        picked, weight, bias, targets.to(hidden.device), temperature, CHUNK_SIZE, softcap, logit_scale, outputs
    )
    return log_probs, entropy


def add_tree_lm_head(model, temperature: float = 1.0) -> None:
    """Let `model(..., tree_pred_pos=P, tree_targets=T)` return per-term log-probs, not logits.

    Patched on the model's own `forward` (as TRL's `add_fused_lm_head` does), so FSDP and
    peft hooks around the model still run; without `tree_pred_pos` the forward is the
    original one. Add it before wrapping the model with peft.
    """
    if getattr(model, "_asyncgrpo_tree_head", False):
        return
    original = model.forward
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    logit_scale = getattr(text_config, "logit_scale", None) or 1.0

    @functools.wraps(type(model).forward)
    def forward(self, *args, tree_pred_pos=None, tree_targets=None, **kwargs):
        if tree_pred_pos is None:
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        out = self.base_model(*args, **kwargs)
        log_probs, entropy = term_log_probs(
            out.last_hidden_state[0], self.get_output_embeddings(), tree_pred_pos, tree_targets,
            temperature, softcap, logit_scale,
        )
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(
                out.router_logits, text_config.num_experts, text_config.num_experts_per_tok, None
            )
        return TreeLogProbOutput(log_probs=log_probs, entropy=entropy, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
    model._asyncgrpo_tree_head = True


def grpo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """Clipped-ratio policy loss summed over terms, divided by `normalizer` (default: term count).

    TRL divides by the micro-batch's trained tokens per rank so that DDP/FSDP's gradient
    average comes out per token; pass that as `normalizer` to reproduce it.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_term = -torch.min(ratio * advantages, clipped * advantages)
    if normalizer is None:
        normalizer = max(per_term.numel(), 1)
    return per_term.sum() / normalizer
