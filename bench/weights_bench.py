"""Full weights through the bucket: bytes per step (anchor vs delta), fraction of bf16 elements
that change per optimizer step, and the arithmetic for a 30B-A3B model.

A real (tiny) training run: the tiny dense Qwen3 (random init, std 0.02 like real Qwen3
checkpoints) trained with AdamW on next-token loss over the project's tiny corpus, fp32
master weights. After every optimizer step the weights are published in bfloat16 through
the trainer's own BucketWeightTransfer to a real S3 server (moto), anchor every K versions,
so bytes are what the bucket holds. The fraction of bf16 elements that changed is counted
per step for several learning rates side by side (it falls with the learning rate: an Adam
step moves a weight by about lr, and bf16 keeps 8 bits of mantissa). Step end -> all replicas
serving vN comes from the end-to-end tests' records (``--e2e FILE``, repeatable):
tests/trainer/test_full_ft_vllm.py (one trainer process, format v1) and the node e2e's
two-trainer-pod runs (tests/e2e/test_runs_on_the_node.py, sharded format v2, dense and MoE;
``ASYNCGRPO_BENCH_OUT=DIR`` makes them write ``sharded_e2e_<run>.json``).

Sharded vs gathered (``--sharded-steps``, 0 to skip): two real gloo ranks (torchrun) train a
small Qwen3 (dense: FSDP 2; MoE: FSDP 2 + expert parallel 2) and publish every version twice
on the same weights, by every rank's ShardedWeightTransfer and by today's gather to rank 0
(bench/weights_shard_worker.py): bytes per version and per rank, publish time per rank, peak
RSS above the RSS before the call, and the base each process keeps for the next delta. Then
the arithmetic for Qwen3-30B-A3B on 64 ranks and 64 replicas from the measured delta density.

The puller's download (``--download-world``, 0 to skip): one sharded anchor of that many rank
files, fetched and verified by the puller's WeightStore with 1..16 files at once.

    .venv/bin/python bench/weights_bench.py [--steps 8] [--sharded-steps 4] [--e2e full_ft_e2e.json] [--e2e sharded_e2e_dense.json] [--json out]
"""

from __future__ import annotations

import argparse
import json
import math
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
#: The sharded-vs-gathered model: big enough that a full copy shows in RSS (~21M parameters).
SHARD_SHAPE = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 64}
MOE_SHAPE = dict(SHARD_SHAPE, moe_intermediate_size=384, num_experts=8)
RANKS, REPLICAS, GPUS_PER_NODE, NODE_GBPS = 64, 64, 8, 100
PART_BYTES = 64 * 2**20  # ranged-GET / multipart part size assumed below
PER_CONN_BPS = 80e6  # bytes/s of one S3 connection (an assumption, typical of S3 per stream)


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


def sharded_vs_gathered(kind: str, steps: int, lr: float, s3, workdir: Path) -> list[dict]:
    """Both publishers, two ranks, same weights; the workers' rows (one per rank and version)."""
    import subprocess

    from asyncgrpo.testing.net import free_port
    from asyncgrpo.trainer.tiny import save_tiny_model

    shape = MOE_SHAPE if kind == "moe" else SHARD_SHAPE
    save_tiny_model(workdir / f"model-{kind}", kind=kind, seed=0, **shape)
    bucket = f"shard-bench-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    torchrun = Path(sys.executable).with_name("torchrun")
    import os

    env = {**os.environ, **s3.env(),
           "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO / "bench" / "weights_shard_worker.py"), str(workdir), s3.endpoint, bucket, kind,
         str(steps), str(lr)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return [r for rank in (0, 1)
            for r in json.loads((workdir / f"{kind}-rank-{rank}.json").read_text())]


def print_sharded(kind: str, rows: list[dict]) -> dict:
    """The side-by-side table of one model; returns its summary."""
    mb = 1e6
    print(f"\n{kind}: sharded (every rank its own shard) vs gathered (rank 0), 2 gloo ranks, bf16")
    print(f"{'v':>2} {'kind':>6} {'bytes sharded (r0+r1)':>24} {'bytes gathered (r0)':>20} "
          f"{'publish s sharded r0/r1':>24} {'gathered r0/r1':>15} "
          f"{'peak RSS+ MB sh r0/r1':>22} {'gath r0/r1':>12} {'base MB sh r0/r1':>17} "
          f"{'gath r0/r1':>11}")
    by_v: dict = {}
    for r in rows:
        by_v.setdefault(r["version"], {})[r["rank"]] = r
    for v in sorted(by_v):
        a, b = by_v[v][0], by_v[v][1]
        sa, sb, ga, gb = a["sharded"], b["sharded"], a["gathered"], b["gathered"]
        print(f"{v:>2} {a['kind']:>6} {sa['bytes']:>10,} ({sa['rank_bytes']:,}+{sb['rank_bytes']:,})"
              f" {ga['bytes']:>20,} {sa['seconds']:>12.3f}/{sb['seconds']:<11.3f}"
              f" {ga['seconds']:>7.3f}/{gb['seconds']:<7.3f}"
              f" {sa['peak_rss_above'] / mb:>11.1f}/{sb['peak_rss_above'] / mb:<10.1f}"
              f" {ga['peak_rss_above'] / mb:>5.1f}/{gb['peak_rss_above'] / mb:<6.1f}"
              f" {sa['base_bytes'] / mb:>8.1f}/{sb['base_bytes'] / mb:<8.1f}"
              f" {ga['base_bytes'] / mb:>5.1f}/{gb['base_bytes'] / mb:<5.1f}")
    deltas = [by_v[v][0]["sharded"] for v in by_v if by_v[v][0]["kind"] == "delta"]
    fr = [d["changed"] / d["elements"] for d in deltas if d["changed"] is not None]
    return {"rows": rows, "delta_density_median": statistics.median(fr) if fr else None,
            "anchor_bytes": by_v[1][0]["sharded"]["bytes"],
            "gathered_anchor_bytes": by_v[1][0]["gathered"]["bytes"]}


def download_concurrency(s3, workdir: Path, world: int, rank_mb: float, levels: list[int],
                         repeats: int) -> list[dict]:
    """One sharded anchor of ``world`` rank files, fetched by the puller's store (verified:
    size and sha256 of every file) with ``download_concurrency`` at each level; seconds per
    fetch, median of ``repeats``."""
    import shutil
    import time

    import torch
    from safetensors.torch import save_file

    from asyncgrpo.weights.shards import anchor_name, table_entry
    from asyncgrpo.weights.store import ANCHOR, WeightStore

    bucket = f"dl-bench-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    store = WeightStore(bucket, run="dl", endpoint_url=s3.endpoint)
    cols = 1024
    rows = max(1, int(rank_mb * 1e6 / 4 / cols))
    files, table = {}, {"w": {"dtype": "F32", "shape": [rows * world, cols], "pieces": []}}
    for r in range(world):
        d = workdir / f"dl-r{r}"
        d.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.randn(rows, cols)}, str(d / anchor_name(r, world)))
        table["w"]["pieces"] += table_entry("float32", (rows * world, cols), anchor_name(r, world),
                                            (rows * r, 0), (rows, cols))["pieces"]
        files.update(store.upload_rank_files(d, 1))
    store.publish_sharded_manifest(1, kind=ANCHOR, step=1, dtype="float32", files=files,
                                   shards={"world": world, "ranks": {str(r): [anchor_name(
                                       r, world)] for r in range(world)}, "tensors": table})
    total = sum(e.size for e in files.values())
    out = []
    print(f"\nPuller download of one sharded anchor: {world} rank files of {rank_mb:g} MB "
          f"({total / 1e6:.0f} MB), real S3 server (moto) on loopback, verified (sha256)")
    print(f"{'files at once':>14} {'seconds (median)':>17} {'MB/s':>8} {'runs':>20}")
    for level in levels:
        store.download_concurrency = level
        secs = []
        for i in range(repeats):
            dest = workdir / f"dl-got-{level}-{i}"
            t0 = time.perf_counter()
            store.fetch(1, dest)
            secs.append(time.perf_counter() - t0)
            shutil.rmtree(dest)
        med = statistics.median(secs)
        out.append({"concurrency": level, "seconds": secs, "median_s": med, "bytes": total})
        print(f"{level:>14} {med:>17.3f} {total / med / 1e6:>8.0f} "
              f"{' '.join(f'{s:.2f}' for s in secs):>20}")
    return out


def print_e2e(e2e: dict) -> list[dict]:
    """Publish done -> every replica serving vN, per version that every replica swapped in,
    from an end-to-end test's record: ``published`` (version, kind, published_at, bytes) and
    ``served`` (each replica's swaps: version, swapped_at, swap_s)."""
    pubs = {p["version"]: p for p in e2e["published"]}
    where = e2e.get("where", "tests/trainer/test_full_ft_vllm.py, one process")
    fmt = {p.get("format", "asyncgrpo.weights/v1") for p in pubs.values()}
    print(f"\nEnd to end ({e2e.get('run', 'full_ft')}: {where}; {', '.join(sorted(fmt))}): "
          f"publish done -> all {len(e2e['served'])} replicas serving vN")
    print(f"{'v':>3} {'kind':>6} {'bytes':>11} {'per rank':>24} {'-> all serving s':>17} "
          f"{'swap s (per replica)':>22}")
    rows = []
    for v, p in sorted(pubs.items()):
        swaps = [next((h for h in hist if h["version"] == v), None) for hist in e2e["served"]]
        if not all(swaps):
            continue  # a replica passed over it (a newer version was there when it looked)
        lag = max(h["swapped_at"] for h in swaps) - p["published_at"]
        ranks = p.get("rank_bytes") or {}
        row = {"version": v, "kind": p["kind"], "bytes": p.get("bytes"), "rank_bytes": ranks,
               "to_all_serving_s": lag, "swap_s": [h.get("swap_s") for h in swaps]}
        rows.append(row)
        per_rank = " + ".join(f"{ranks[r]:,}" for r in sorted(ranks, key=int)) or "-"
        nbytes = f"{p['bytes']:,}" if p.get("bytes") is not None else "-"
        swap = " / ".join(f"{h['swap_s']:.2f}" for h in swaps if h.get("swap_s") is not None)
        print(f"{v:>3} {p['kind']:>6} {nbytes:>11} {per_rank:>24} {lag:>17.2f} {swap:>22}")
    skipped = sorted(set(pubs) - {r["version"] for r in rows})
    if skipped:
        print(f"    not served by every replica (passed over for a newer one): {skipped}")
    return rows


def arithmetic_64(density: float) -> list[dict]:
    """Qwen3-30B-A3B, 64 trainer ranks (8 per node), 64 replicas, 100 Gb/s per node."""
    link = NODE_GBPS * 1e9 / 8  # bytes/s
    anchor, delta = BIG_PARAMS * 2, BIG_PARAMS * density * 6
    print(f"\nQwen3-30B-A3B ({BIG_PARAMS / 1e9:.1f}B, bf16) on {RANKS} ranks ({GPUS_PER_NODE} "
          f"per node) and {REPLICAS} replicas, {NODE_GBPS} Gb/s per node, delta density "
          f"{density:.2%} (measured above); upload then download, not overlapped")
    print(f"{'':26} {'bytes':>9} {'per rank':>9} {'upload gathered':>16} {'upload sharded':>15} "
          f"{'download':>9} {'total sharded':>14} {'GETs/version':>13} {'conns/replica':>14}")
    out = []
    for what, nbytes in (("delta", delta), ("anchor", anchor)):
        up_gathered = nbytes / link  # rank 0's node carries every byte
        up_sharded = nbytes / (RANKS / GPUS_PER_NODE) / link  # each node its 8 ranks' shards
        down = nbytes / link  # every replica pulls the whole version (TP 1), all in parallel
        gets = REPLICAS * max(RANKS, math.ceil(nbytes / PART_BYTES))  # >= one per rank file
        conns = link / PER_CONN_BPS
        row = {"what": what, "bytes": nbytes, "per_rank": nbytes / RANKS,
               "upload_gathered_s": up_gathered, "upload_sharded_s": up_sharded,
               "download_s": down, "total_sharded_s": up_sharded + down,
               "total_gathered_s": up_gathered + down, "gets_per_version": gets,
               "connections_per_replica": conns}
        out.append(row)
        print(f"{what:26} {nbytes / 1e9:>7.1f}GB {nbytes / RANKS / 1e9:>7.2f}GB "
              f"{up_gathered:>15.2f}s {up_sharded:>14.3f}s {down:>8.2f}s "
              f"{up_sharded + down:>13.2f}s {gets:>13,.0f} {conns:>14.0f}")
    print(f"  rank 0 host memory for publication, gathered: {anchor / 1e9:.0f} GB (its base) "
          f"+ one delta; sharded: {anchor / RANKS / 1e9:.2f} GB per rank + its delta share")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--e2e", type=Path, action="append", default=None,
                    help="an end-to-end record (repeatable): tests/trainer/test_full_ft_vllm.py's "
                    "full_ft_e2e.json, or the node e2e's sharded_e2e_<run>.json")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sharded-steps", type=int, default=4)
    ap.add_argument("--sharded-lr", type=float, default=1e-6)
    ap.add_argument("--sharded-kinds", default="dense,moe")
    ap.add_argument("--download-world", type=int, default=16,
                    help="rank files of the download bench's version (0 to skip)")
    ap.add_argument("--download-rank-mb", type=float, default=8.0)
    ap.add_argument("--download-levels", default="1,2,4,8,16")
    ap.add_argument("--download-repeats", type=int, default=3)
    args = ap.parse_args()

    import os

    from asyncgrpo.testing.s3 import S3Server

    result: dict = {"runs": {}}
    with tempfile.TemporaryDirectory(prefix="weights-bench-") as tmp:
        s3 = S3Server.start(Path(tmp) / "moto.log")
        os.environ.update(s3.env())
        try:
            for lr in (float(x) for x in args.lrs.split(",") if x):
                result["runs"][str(lr)] = train_and_publish(lr, args.steps, args.anchor_every,
                                                            s3, Path(tmp))
            if args.sharded_steps:
                for kind in args.sharded_kinds.split(","):
                    result.setdefault("sharded", {})[kind] = sharded_vs_gathered(
                        kind, args.sharded_steps, args.sharded_lr, s3, Path(tmp))
            if args.download_world:
                result["download_concurrency"] = download_concurrency(
                    s3, Path(tmp), args.download_world, args.download_rank_mb,
                    [int(x) for x in args.download_levels.split(",")], args.download_repeats)
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

    for path in args.e2e or []:
        if path.exists():
            result.setdefault("e2e", {})[path.name] = print_e2e(json.loads(path.read_text()))
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
    if result.get("sharded"):
        summaries = {k: print_sharded(k, rows) for k, rows in result["sharded"].items()}
        result["sharded"] = summaries
        density = next((s["delta_density_median"] for s in summaries.values()
                        if s["delta_density_median"] is not None), None)
        if density is not None:
            result["arithmetic_64"] = arithmetic_64(density)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
