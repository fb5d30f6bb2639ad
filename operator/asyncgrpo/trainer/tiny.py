"""Tiny random Qwen3-class models and a locally trained tokenizer.

No model or data set can be downloaded where this project is tested, so every test and
benchmark that needs a model builds one from a config here. The shapes keep the features
that matter for correctness (grouped-query attention, RoPE, q/k norms, MoE routing with
several experts per token) while staying fast on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path

#: Dense Qwen3: 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16.
DENSE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

#: Qwen3-MoE: the dense shapes with 4 experts, 2 routed per token, in every layer.
MOE = dict(
    DENSE,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,
)


def tiny_config(kind: str = "dense", **overrides):
    """Config of a tiny random Qwen3 (`kind="dense"`) or Qwen3-MoE (`kind="moe"`)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if kind == "dense":
        params = dict(DENSE)
        params.pop("rope_theta")
        return Qwen3Config(**{**params, **overrides})
    if kind == "moe":
        params = dict(MOE)
        params.pop("rope_theta")
        return Qwen3MoeConfig(**{**params, **overrides})
    raise ValueError(f"unknown tiny model kind {kind!r}; expected 'dense' or 'moe'")


def tiny_model(kind: str = "dense", seed: int = 0, dtype=None, attn_implementation: str = "sdpa",
               **overrides):
    """A randomly initialised tiny model, deterministic for a given seed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(
        config, dtype=dtype or torch.float32, attn_implementation=attn_implementation
    )
    return model


def save_tiny_model(path: str | Path, kind: str = "dense", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model in the Hugging Face layout (what vLLM and from_pretrained read)."""
    path = Path(path)
    model = tiny_model(kind, seed=seed, **overrides)
    model.save_pretrained(path)
    return path
