"""`asyncgrpo tree bench`: a step's micro-batches, forward+backward packed as trees vs as sequences.

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

from .budget import plan
from .flops import FlopModel
from .forest import PackedRow, pack
from .layout import TreeLayout
from .loss import grpo_loss
from .metrics import PackingMetrics
from .rollout import Rollout
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


def _rows(rollouts: list[Rollout], ranks: int, budget: int) -> tuple[list[PackedRow], list]:
    """The trainer's micro-batches (`budget.plan`); budget <= 0: everything in one micro-batch."""
    if budget <= 0:
        budget = max(sum(len(r) for r in rollouts), sum(r.trained for r in rollouts), 1)
    batches = plan(rollouts, ranks, budget)
    return [row for mb in batches for row in mb.rows], batches


def _time(model, rows: list[PackedRow], device: torch.device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of training every row once.

    On a shared CPU the wall time also counts the time other processes held the core; with
    one torch thread the process CPU time does not, so its ratio is the steadier one there.
    """
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for row in rows:
        train_step(model, row, device)
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


def run_bench(model_kind: str = "dense", groups: int = 2, generations: int = 8, prompt: int = 1024,
              completion: int = 256, turns: int = 1, device: str = "cpu", repeats: int = 3,
              dtype: torch.dtype = torch.float32, seed: int = 0, model_overrides: dict | None = None,
              rollouts: list[Rollout] | None = None, budget: int = 0, ranks: int = 1) -> dict:
    """Time one step's micro-batches packed as trees vs the same rows with nothing shared.

    `rollouts` (a rollouts file) replaces the synthetic shape. `budget`/`ranks` plan the
    micro-batches exactly as the trainer does; every row of every micro-batch is timed here,
    one after another (total compute of the step). The sequence side forwards the same rows
    unshared (document masking), so both sides train the same terms.
    """
    device = torch.device(device)
    source = "file" if rollouts is not None else "synthetic"
    if rollouts is None:
        rollouts = synthetic_rollouts(groups, generations, prompt, completion, turns, seed=seed)
    model = build_model(model_kind, seed=seed, device=str(device), dtype=dtype, **(model_overrides or {}))
    model.train()
    tree_rows, batches = _rows(rollouts, ranks, budget)
    rows = {"tree": tree_rows, "sequence": [pack(row.rollouts, share=False) for row in tree_rows]}

    for side in rows.values():  # warm-up: compilation, allocator, thread pools
        _time(model, side, device)
    times: dict[str, list[float]] = {name: [] for name in rows}
    cpu_times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, side in rows.items():
            wall, cpu = _time(model, side, device)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    memory = {name: max(_memory(model, row, device) for row in side) for name, side in rows.items()}

    packing = PackingMetrics.of(batches)
    count = {name: {"tokens": sum(r.tokens for r in side), "pairs": sum(r.attention_pairs for r in side),
                    "terms": sum(r.trained for r in side)} for name, side in rows.items()}
    flop_model = FlopModel.of(model.config)
    flops = {name: flop_model.step(**c) for name, c in count.items()}
    tree_s = statistics.median(times["tree"])
    sequence_s = statistics.median(times["sequence"])
    raw, forwarded = count["sequence"]["tokens"], count["tree"]["tokens"]
    speedup = sequence_s / tree_s
    flop_ideal = flops["sequence"] / flops["tree"]
    return {
        "source": source,
        "model": model_kind,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "attention": "flex" if device.type == "cuda" else "sdpa-segments",
        **({"groups": groups, "generations": generations, "prompt": prompt, "completion": completion,
            "turns": turns} if source == "synthetic" else {}),
        "rollouts": len(rollouts),
        "budget": budget,
        "ranks": ranks,
        "micro_batches": len(batches),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "tokens_raw": raw,
        "tokens_forwarded": forwarded,
        "tokens_distinct": packing.distinct_tokens,
        "trained_tokens": count["tree"]["terms"],
        "attention_pairs_tree": count["tree"]["pairs"],
        "attention_pairs_sequence": count["sequence"]["pairs"],
        "flops_tree": flops["tree"],
        "flops_sequence": flops["sequence"],
        "flop_shares_tree": flop_model.shares(**count["tree"]),
        "tree_s": tree_s,
        "sequence_s": sequence_s,
        "tree_all_s": times["tree"],
        "sequence_all_s": times["sequence"],
        "speedup": speedup,
        # Best-of-repeats ratio: less sensitive to other processes on a shared machine.
        "speedup_min": min(times["sequence"]) / min(times["tree"]),
        "ideal_speedup": raw / forwarded,
        "ideal_speedup_distinct": raw / max(packing.distinct_tokens, 1),
        "efficiency": speedup / (raw / forwarded),
        "flop_ideal_speedup": flop_ideal,
        "efficiency_flop": speedup / flop_ideal,
        # Process CPU time (CPU only): not inflated by other processes holding the core.
        **({"tree_cpu_s": statistics.median(cpu_times["tree"]),
            "sequence_cpu_s": statistics.median(cpu_times["sequence"]),
            "speedup_cpu": statistics.median(cpu_times["sequence"]) / statistics.median(cpu_times["tree"]),
            "efficiency_flop_cpu": statistics.median(cpu_times["sequence"])
            / statistics.median(cpu_times["tree"]) / flop_ideal} if device.type == "cpu" else {}),
        "memory_kind": "cuda_peak_allocated" if device.type == "cuda" else "saved_activations",
        "tree_peak_mb": memory["tree"] / 2**20,
        "sequence_peak_mb": memory["sequence"] / 2**20,
    }


def format_table(result: dict) -> str:
    """Side-by-side table of the two packings (the JSON line after it carries everything)."""
    rows = [
        ("", "sequence", "tree"),
        ("tokens forwarded", f"{result['tokens_raw']}", f"{result['tokens_forwarded']}"),
        ("  distinct prefixes", "", f"{result['tokens_distinct']}"),
        ("attention pairs", f"{result['attention_pairs_sequence']}", f"{result['attention_pairs_tree']}"),
        ("train FLOPs (model)", f"{result['flops_sequence']:.3e}", f"{result['flops_tree']:.3e}"),
        ("fwd+bwd median (s)", f"{result['sequence_s']:.4f}", f"{result['tree_s']:.4f}"),
        *([("fwd+bwd median CPU time (s)", f"{result['sequence_cpu_s']:.4f}", f"{result['tree_cpu_s']:.4f}")]
          if "tree_cpu_s" in result else []),
        (f"memory ({result['memory_kind']}, MiB)", f"{result['sequence_peak_mb']:.1f}",
         f"{result['tree_peak_mb']:.1f}"),
    ]
    if "trl_fa3_s" in result:
        rows.append(("TRL tree_fa3 fwd+bwd (s)", "", f"{result['trl_fa3_s']:.4f}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b:>14}  {c:>14}" for a, b, c in rows]
    shares = ", ".join(f"{k} {v:.0%}" for k, v in result["flop_shares_tree"].items())
    if "speedup_cpu" in result:
        lines.append(f"CPU time: speedup {result['speedup_cpu']:.2f}x, {result['efficiency_flop_cpu']:.2f} of the "
                     "FLOP ideal (wall time below counts other processes' use of the core)")
    lines.append(
        f"speedup {result['speedup']:.2f}x; token ideal {result['ideal_speedup']:.2f}x (efficiency "
        f"{result['efficiency']:.2f}), FLOP ideal {result['flop_ideal_speedup']:.2f}x (efficiency "
        f"{result['efficiency_flop']:.2f}); tree FLOPs: {shares}"
    )
    lines.append(
        f"{result['model']} on {result['device']}, {result['rollouts']} rollouts in {result['micro_batches']} "
        f"micro-batch(es) x {result['ranks']} rank(s), {result['threads']} threads"
    )
    return "\n".join(lines)
