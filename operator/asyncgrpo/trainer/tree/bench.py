"""`asyncgrpo tree bench`: one micro-batch, forward+backward packed as a tree vs as sequences.

Both sides use the same model, LM head, loss and attention family (FlexAttention on CUDA,
SDPA per segment on CPU); sequence packing is the same layout with nothing shared (each
rollout its own chain, i.e. document masking). Timings alternate between the two, after
a warm-up of each (which also absorbs compilation), and report the median.

Memory: on CUDA the peak allocated during the step; on CPU, where torch keeps no allocator
statistics, the bytes of tensors autograd saves for backward (activation memory), which is
what packing changes.
"""

from __future__ import annotations

import statistics
import time

import torch

from .forest import PackedRow, pack
from .layout import TreeLayout
from .loss import grpo_loss
from .synthetic import synthetic_rollouts
from .verify import build_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, row: PackedRow, device: torch.device) -> None:
    """Forward and backward of one row with a fresh layout, as the trainer does per micro-batch."""
    model.zero_grad(set_to_none=True)
    row = row.to(device)
    out = model(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        tree_layout=TreeLayout.from_row(row),
        tree_pred_pos=row.pred_pos,
        tree_targets=row.target,
    )
    grpo_loss(out.log_probs, out.log_probs.detach(), row.advantage).backward()


def _memory(model, row: PackedRow, device: torch.device) -> int:
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        train_step(model, row, device)
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    saved = 0

    def keep(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        train_step(model, row, device)
    return saved


def run_bench(model_kind: str = "dense", groups: int = 2, generations: int = 8, prompt: int = 1024,
              completion: int = 256, turns: int = 1, device: str = "cpu", repeats: int = 3,
              dtype: torch.dtype = torch.float32, seed: int = 0, model_overrides: dict | None = None) -> dict:
    device = torch.device(device)
    rollouts = synthetic_rollouts(groups, generations, prompt, completion, turns, seed=seed)
    model = build_model(model_kind, seed=seed, device=str(device), dtype=dtype, **(model_overrides or {}))
    model.train()
    rows = {"tree": pack(rollouts), "sequence": pack(rollouts, share=False)}

    for row in rows.values():  # warm-up: compilation, allocator, thread pools
        train_step(model, row, device)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, row in rows.items():
            _sync(device)
            start = time.perf_counter()
            train_step(model, row, device)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    memory = {name: _memory(model, row, device) for name, row in rows.items()}

    tree_s = statistics.median(times["tree"])
    sequence_s = statistics.median(times["sequence"])
    raw, unique = rows["sequence"].tokens, rows["tree"].tokens
    speedup = sequence_s / tree_s
    return {
        "model": model_kind,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "attention": "flex" if device.type == "cuda" else "sdpa-segments",
        "groups": groups,
        "generations": generations,
        "prompt": prompt,
        "completion": completion,
        "turns": turns,
        "rollouts": len(rollouts),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "tokens_raw": raw,
        "tokens_forwarded": unique,
        "trained_tokens": rows["tree"].trained,
        "attention_pairs_tree": rows["tree"].attention_pairs,
        "attention_pairs_sequence": rows["sequence"].attention_pairs,
        "tree_s": tree_s,
        "sequence_s": sequence_s,
        "tree_all_s": times["tree"],
        "sequence_all_s": times["sequence"],
        "speedup": speedup,
        # Best-of-repeats ratio: less sensitive to other processes on a shared machine.
        "speedup_min": min(times["sequence"]) / min(times["tree"]),
        "ideal_speedup": raw / unique,
        "efficiency": speedup / (raw / unique),
        "memory_kind": "cuda_peak_allocated" if device.type == "cuda" else "saved_activations",
        "tree_peak_mb": memory["tree"] / 2**20,
        "sequence_peak_mb": memory["sequence"] / 2**20,
    }


def format_table(result: dict) -> str:
    """Side-by-side table of the two packings (the JSON line after it carries everything)."""
    rows = [
        ("", "sequence", "tree"),
        ("tokens forwarded", f"{result['tokens_raw']}", f"{result['tokens_forwarded']}"),
        ("attention pairs", f"{result['attention_pairs_sequence']}", f"{result['attention_pairs_tree']}"),
        ("fwd+bwd median (s)", f"{result['sequence_s']:.4f}", f"{result['tree_s']:.4f}"),
        (f"memory ({result['memory_kind']}, MiB)", f"{result['sequence_peak_mb']:.1f}",
         f"{result['tree_peak_mb']:.1f}"),
    ]
    if "trl_fa3_s" in result:
        rows.append(("TRL tree_fa3 fwd+bwd (s)", "", f"{result['trl_fa3_s']:.4f}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b:>14}  {c:>14}" for a, b, c in rows]
    lines.append(
        f"speedup {result['speedup']:.2f}x of ideal {result['ideal_speedup']:.2f}x "
        f"(efficiency {result['efficiency']:.2f}); {result['model']} on {result['device']}, "
        f"{result['rollouts']} rollouts, {result['threads']} threads"
    )
    return "\n".join(lines)
