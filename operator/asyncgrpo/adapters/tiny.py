"""Random LoRA adapters on the tiny models, for tests and benchmarks of the adapter path.

A freshly initialised peft LoRA has B = 0 and changes nothing, which would make "vLLM serves
version 2, not version 1" untestable. These adapters have random non-zero A and B on every
projection vLLM packs (q/k/v -> qkv, gate/up -> gate_up) so a packing or scaling bug shows.
"""

from __future__ import annotations

from pathlib import Path

#: Every linear layer of a Qwen3 decoder block.
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_lora_model(base_dir: str | Path, *, rank: int = 8, alpha: int = 16, seed: int = 0,
                      scale: float = 0.5):
    """The tiny base from ``base_dir`` with a random LoRA (peft model, eval mode, fp32)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGET_MODULES,
                        lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    return model.eval()


def save_random_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int = 8,
                        alpha: int = 16, seed: int = 0):
    """Save a random adapter (peft layout) to ``out_dir``; returns the peft model too."""
    model = random_lora_model(base_dir, rank=rank, alpha=alpha, seed=seed)
    model.save_pretrained(str(out_dir))
    return model
