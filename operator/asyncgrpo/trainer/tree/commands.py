"""`asyncgrpo tree verify|bench`: check tree packing against unpacked training, and time it.

Both print one JSON object as their last line so scripts (bench/gpu.sh, CI) can parse it.
The tiny models are those of `asyncgrpo.trainer.tiny` (Qwen3, 2 layers, hidden 64, 4 query
heads over 2 KV heads, head_dim 16, vocab 512; the MoE variant has 4 experts, 2 per token).
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    tree = subparsers.add_parser("tree", help="tree packing: verify exactness, benchmark speed")
    sub = tree.add_subparsers(dest="tree_command", metavar="SUBCOMMAND", required=True)

    verify = sub.add_parser(
        "verify",
        help="pack a rollouts file and compare with forwarding each rollout alone",
        description="Builds a tiny random Qwen3 (dense) or Qwen3-MoE, packs FILE into micro-batches of "
        "--ranks rows under --budget tokens, and compares per-token log-probs, the GRPO loss and every "
        "gradient with forwarding each rollout alone under causal attention. Exit 1 if a difference "
        "exceeds the fp32 tolerance or a rollout was dropped.",
    )
    verify.add_argument("file", help="rollouts, JSON Lines: group_id, input_ids, completion_mask, advantage, "
                        "old_log_probs (optional)")
    verify.add_argument("--model", choices=("dense", "moe"), default="dense")
    verify.add_argument("--ranks", type=int, default=1, help="data-parallel ranks to plan rows for")
    verify.add_argument("--budget", type=int, default=4096, help="per-rank token budget of a row")
    verify.add_argument("--grad-accum", type=int, default=0,
                        help="micro-batches per optimizer step, as gradient_accumulation_steps "
                        "(0: all planned micro-batches make one step)")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random model")
    verify.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights")
    verify.add_argument("--device", default="cpu", help="cpu, or cuda to check the FlexAttention path")
    verify.set_defaults(func=_verify)

    bench = sub.add_parser(
        "bench",
        help="time forward+backward of one micro-batch as a tree vs sequence packing",
        description="Random rollouts of the given shape; the same micro-batch packed as a tree and as "
        "sequences (document masking, same attention family), median of --repeats.",
    )
    bench.add_argument("--file", help="a rollouts file (verify's format) instead of the synthetic shape")
    bench.add_argument("--budget", type=int, default=0,
                       help="per-rank token budget: plan micro-batches as the trainer does (0: one micro-batch)")
    bench.add_argument("--ranks", type=int, default=1, help="data-parallel ranks to plan rows for")
    bench.add_argument("--model", choices=("dense", "moe"), default="dense")
    bench.add_argument("--groups", type=int, default=2)
    bench.add_argument("--generations", type=int, default=8)
    bench.add_argument("--prompt", type=int, default=1024)
    bench.add_argument("--completion", type=int, default=256)
    bench.add_argument("--turns", type=int, default=1)
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    bench.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    bench.add_argument("--model-config", default="{}",
                       help="JSON overrides of the tiny config, e.g. a Qwen3-0.6B shape on GPU")
    bench.add_argument("--compare-trl-fa3", action="store_true",
                       help="also time TRL's own TreeRow + tree_fa3 path (CUDA, needs the hub kernel)")
    bench.set_defaults(func=_bench)


def _verify(args: argparse.Namespace) -> int:
    from .rollout import RolloutError, load_rollouts
    from .verify import TOLERANCE, build_model, compare, verdict

    try:
        rollouts = load_rollouts(args.file)
        model = build_model(args.model, seed=args.seed, lora=args.lora, device=args.device)
        vocab = model.config.get_text_config().vocab_size
        if max(max(r.input_ids) for r in rollouts) >= vocab:
            raise RolloutError(f"{args.file}: token ids must be below the tiny model's vocabulary of {vocab}")
        result = compare(model, rollouts, ranks=args.ranks, budget=args.budget, device=args.device,
                         grad_accum=args.grad_accum)
    except RolloutError as err:
        print(f"asyncgrpo tree verify: {err}", file=sys.stderr)
        return 2
    ok, problems = verdict(result)
    result.update(model=args.model, lora=args.lora, device=args.device, seed=args.seed,
                  tolerance=TOLERANCE, ok=ok, problems=problems)
    print(json.dumps(result))
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import format_table, run_bench
    from .rollout import RolloutError, load_rollouts

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = json.loads(args.model_config)
    try:
        rollouts = load_rollouts(args.file) if args.file else None
        vocab = overrides.get("vocab_size", 512)
        if rollouts and max(max(r.input_ids) for r in rollouts) >= vocab:
            raise RolloutError(f"{args.file}: token ids must be below the model's vocabulary of {vocab}")
        result = run_bench(
            model_kind=args.model, groups=args.groups, generations=args.generations, prompt=args.prompt,
            completion=args.completion, turns=args.turns, device=args.device, repeats=args.repeats,
            dtype=getattr(torch, args.dtype), model_overrides=overrides, rollouts=rollouts,
            budget=args.budget, ranks=args.ranks,
        )
    except RolloutError as err:
        print(f"asyncgrpo tree bench: {err}", file=sys.stderr)
        return 2
    if args.compare_trl_fa3 and not args.file:
        result.update(_trl_fa3(args))
        if "trl_fa3_s" in result:
            result["speedup_vs_trl_fa3"] = result["trl_fa3_s"] / result["tree_s"]
    print(format_table(result))
    print(json.dumps(result))
    return 0


def _trl_fa3(args: argparse.Namespace) -> dict:
    """TRL's path where it runs; otherwise the reason it could not, never a failed benchmark."""
    import torch

    from .synthetic import synthetic_rollouts
    from .trl_fa3 import run_trl_fa3

    rollouts = synthetic_rollouts(args.groups, args.generations, args.prompt, args.completion, args.turns)
    try:
        return run_trl_fa3(args.model, rollouts, args.device, args.repeats, getattr(torch, args.dtype),
                           model_overrides=json.loads(args.model_config))
    except Exception as err:  # noqa: BLE001 - any failure to fetch or run the kernel is a skip
        return {"trl_fa3_skipped": f"{type(err).__name__}: {err}"[:300]}
