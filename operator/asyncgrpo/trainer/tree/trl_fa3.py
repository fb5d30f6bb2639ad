"""TRL 1.16.0's own tree packing (`TreeRow` + `tree_fa3`), timed the way `bench` times ours.

Only for comparison on GPUs where TRL's path can run: it downloads a FlashAttention-3
kernel from the Hugging Face hub at first use (`kernels` package, network, Hopper or ROCm).
`run_trl_fa3` returns the median seconds, or raises with the reason it cannot run.
"""

from __future__ import annotations

import statistics
import time

import torch

from .rollout import Rollout


def _trl_row(rollouts: list[Rollout]) -> dict[str, torch.Tensor]:
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for r in rollouts:
        row.add({
            "input_ids": torch.tensor(r.input_ids),
            "completion_mask": torch.tensor(r.completion_mask),
            "old_log_probs": torch.zeros(len(r)),
            "advantage": r.advantage,
            "group_id": r.group_id,
        })
    return row.pack()


def run_trl_fa3(model_kind: str, rollouts: list[Rollout], device: str = "cuda", repeats: int = 3,
                dtype: torch.dtype = torch.bfloat16, seed: int = 0, model_overrides: dict | None = None) -> dict:
    from trl.experimental.async_grpo.packing import (
        TREE_ATTENTION,
        _flash_attn,
        register_tree_attention,
    )
    from trl.trainer.utils import add_fused_lm_head

    from asyncgrpo.trainer.tiny import tiny_model

    _flash_attn()  # fetch the hub kernel now, so a missing one is reported as the reason to skip
    register_tree_attention()
    model = tiny_model(model_kind, seed=seed, dtype=dtype, attn_implementation=TREE_ATTENTION,
                       **(model_overrides or {})).to(device)
    add_fused_lm_head(model, outputs=("log_probs",))
    model.train()
    packed = {k: v.to(device) for k, v in _trl_row(rollouts).items()}

    def step():
        model.zero_grad(set_to_none=True)
        out = model(
            input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
            shift_labels=packed["shift_labels"][None], fused_lm_head=True,
            tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        )
        log_probs = out.log_probs.flatten()[packed["token_index"]]
        ratio = torch.exp(log_probs - log_probs.detach())
        (-(ratio * packed["advantages"]).sum() / max(log_probs.numel(), 1)).backward()

    step()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"trl_fa3_s": statistics.median(times), "trl_fa3_tokens": int(packed["input_ids"].numel())}
