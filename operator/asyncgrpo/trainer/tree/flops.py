"""The FLOP ideal of tree packing: what a training step of a given packing costs, from the model config.

Why not only tokens: the token ideal (raw tokens / forwarded tokens) assumes every FLOP is
per token. Attention is per (query, key) pair, and every branch of a fork still attends to
the whole shared prompt, so pairs shrink less than tokens; the LM head scores every trained
term on both sides, so it does not shrink at all. On a narrow model (attention-bound) the
token ideal overstates what any packing can reach. The FLOP ideal counts, for forward +
backward (x3 of the forward, the usual rule for matrix products):

- linear layers per forwarded token: attention projections, MLP (MoE: the router plus the
  `num_experts_per_tok` experts a token is routed to);
- attention per attended (query, key) pair: QK^T and PV over the query heads;
- the LM head per trained term (it runs only at the gathered positions).

Embeddings, norms, RoPE and softmax are left out (negligible next to these).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Forward + backward of a matrix product: 1 forward, 2 backward (input and weight gradients).
TRAIN_FACTOR = 3


@dataclass(frozen=True)
class FlopModel:
    """Per-unit forward FLOPs of one model (multiply-add = 2 FLOPs)."""

    per_token: float  # all layers' linear FLOPs for one forwarded token
    per_pair: float  # all layers' attention FLOPs for one (query, key) pair
    per_term: float  # LM-head FLOPs for one trained term

    @classmethod
    def of(cls, config) -> FlopModel:
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        h, layers = c.hidden_size, c.num_hidden_layers
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or h // heads
        attn_proj = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o + k, v
        experts = getattr(c, "num_experts", 0) or 0
        if experts:
            mlp = h * experts + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
        else:
            mlp = 3 * h * c.intermediate_size
        return cls(
            per_token=2.0 * layers * (attn_proj + mlp),
            per_pair=2.0 * 2 * layers * heads * head_dim,
            per_term=2.0 * h * c.vocab_size,
        )

    def step(self, tokens: int, pairs: int, terms: int) -> float:
        """Forward + backward FLOPs of forwarding `tokens` with `pairs` attended pairs, scoring `terms`."""
        return TRAIN_FACTOR * (self.per_token * tokens + self.per_pair * pairs + self.per_term * terms)

    def shares(self, tokens: int, pairs: int, terms: int) -> dict[str, float]:
        """Fraction of the step's FLOPs in linear layers, attention and the LM head."""
        parts = {"linear": self.per_token * tokens, "attention": self.per_pair * pairs, "lm_head": self.per_term * terms}
        total = sum(parts.values()) or 1.0
        return {k: v / total for k, v in parts.items()}
