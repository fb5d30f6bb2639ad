"""Full weights through the bucket: bytes per step (anchor vs delta), fraction of bf16 elements
that change per optimizer step, and the arithmetic for a 30B-A3B model.

A real (tiny) training run: the tiny dense Qwen3 (random init, std 0.02 like real Qwen3
checkpoints) trained with AdamW on next-token loss over the project's tiny corpus, fp32
master weights. After every optimizer step the weights are published in bfloat16 through
the trainer's own BucketWeightTransfer to a real S3 server (moto), anchor every K versions,
so bytes are what the bucket holds. The fraction of bf16 elements that changed is counted
per step for several learning rates side by side (it falls with the learning rate: an Adam
step moves a weight by about lr, and bf16 keeps 8 bits of mantissa). Step end -> all replicas
serving vN comes from the end-to-end test's records (tests/trainer/test_full_ft_vllm.py,
``--e2e FILE``).

    .venv/bin/python bench/weights_bench.py [--steps 8] [--e2e full_ft_e2e.json] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "operator"))

#: Qwen3-Coder-30B-A3B: total parameters, and the public figures the issue quotes.
BIG_PARAMS = 30.5e9
NCCL_FULL_S, NCCL_DELTA_S = 32.0, 7.0  # verl, H100s (full sync vs delta sync)
LINKS_GBPS = (10, 100)


def train_and_publish(lr: float, steps: int, anchor_every: int, s3, workdir: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.trainer.tiny_tokenizer import CORPUS, save_tiny_checkpoint
    from asyncgrpo.trainer.weights import BucketWeightTransfer
    from asyncgrpo.weights.store import WeightStore

    torch.manual_seed(0)
    ckpt = save_tiny_checkpoint(workdir / f"tiny-{lr}", kind="dense", seed=0)
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batch = tok(list(CORPUS)[:8], return_tensors="pt", padding=True, truncation=True,
                max_length=64)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    store = WeightStore(bucket, run="bench", endpoint_url=s3.endpoint)
    pub = BucketWeightTransfer(store, workdir / f"stage-{lr}", anchor_interval=anchor_every,
                               dtype=torch.bfloat16, retention=1000)
    pub.init_weight_transfer()
    pub.send_weights(model.named_parameters())  # v1: the initial anchor
    for _ in range(steps):
        out = model(**batch, labels=batch["input_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        pub.send_weights(model.named_parameters())
    return pub.published


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--e2e", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import os

    from asyncgrpo.testing.s3 import S3Server

    result: dict = {"runs": {}}
    with tempfile.TemporaryDirectory(prefix="weights-bench-") as tmp:
        s3 = S3Server.start(Path(tmp) / "moto.log")
        os.environ.update(s3.env())
        try:
            for lr in (float(x) for x in args.lrs.split(",")):
                result["runs"][str(lr)] = train_and_publish(lr, args.steps, args.anchor_every,
                                                            s3, Path(tmp))
        finally:
            s3.stop()

    print(f"\nTiny dense Qwen3, AdamW, bf16 publication, anchor every {args.anchor_every} "
          f"versions, {args.steps} steps per learning rate")
    print(f"{'lr':>8} {'anchor bytes':>13} {'delta bytes (median)':>21} {'delta/anchor':>13} "
          f"{'changed/step (median, min-max)':>32}")
    fractions = {}
    for lr, pubs in result["runs"].items():
        anchor = pubs[0]
        diffed = [p for p in pubs if p["changed_elements"] is not None]
        deltas = [p for p in diffed if p["kind"] == "delta"]
        fr = [p["changed_elements"] / p["elements"] for p in diffed]
        fractions[lr] = statistics.median(fr)
        db = (f"{int(statistics.median(p['bytes'] for p in deltas)):>21,} "
              f"{statistics.median(p['bytes'] for p in deltas) / anchor['bytes']:>13.3f}"
              if deltas else f"{'(anchors: smaller)':>21} {'-':>13}")
        print(f"{lr:>8} {anchor['bytes']:>13,} {db} "
              f"{statistics.median(fr):>14.2%} ({min(fr):.2%}-{max(fr):.2%})")
    result["fraction_changed_median"] = fractions

    if args.e2e and args.e2e.exists():
        e2e = json.loads(args.e2e.read_text())
        at = {p["version"]: p["published_at"] for p in e2e["published"]}
        lags = []
        for v, t in at.items():
            swaps = [next((h["swapped_at"] for h in hist if h["version"] == v), None)
                     for hist in e2e["served"]]
            if all(s is not None for s in swaps):
                lags.append((v, max(swaps) - t))
        result["step_end_to_all_serving_s"] = lags
        print("\nEnd to end (tests/trainer/test_full_ft_vllm.py): publish done -> both replicas "
              "serving vN, seconds")
        for v, lag in lags:
            kind = next(p["kind"] for p in e2e["published"] if p["version"] == v)
            print(f"  v{v} ({kind}): {lag:.2f}")

    print(f"\nArithmetic for Qwen3-Coder-30B-A3B ({BIG_PARAMS / 1e9:.1f}B parameters, bf16); "
          "delta = fraction x params x 6 bytes (int32 index + bf16 value); one upload, one "
          "download per replica (in parallel), link-bound")
    full = BIG_PARAMS * 2
    hdr = f"{'':28}" + "".join(f"{g:>10} Gb/s" for g in LINKS_GBPS)
    print(hdr)
    rows = [("anchor (full bf16)", full)] + [
        (f"delta at {f:.1%} changed", BIG_PARAMS * f * 6) for f in (0.01, 0.045)]
    table = []
    for name, nbytes in rows:
        secs = [2 * nbytes * 8 / (g * 1e9) for g in LINKS_GBPS]  # up + down, not overlapped
        table.append({"what": name, "gb": nbytes / 1e9, "seconds": secs})
        print(f"{name + f' ({nbytes / 1e9:.1f} GB)':28}" + "".join(f"{s:>13.1f}s" for s in secs))
    print(f"{'NCCL (verl, H100s)':28}  full sync {NCCL_FULL_S:.0f}s, delta sync {NCCL_DELTA_S:.0f}s")
    result["arithmetic_30b"] = table
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
