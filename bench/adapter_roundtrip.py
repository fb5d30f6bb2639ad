"""Adapter round trip: seconds from "adapter saved" to "vLLM serves the new version".

Runs the real path on loopback: a moto S3 server, the real vLLM CPU server with the S3
resolver plugin, the tiny Qwen3 with a random rank-8 LoRA. For each new version N it times

  save     peft ``save_pretrained`` of the trained adapter (what ends a trainer step)
  publish  AdapterStore.publish: sha256 + upload of every file, manifest last
  serve    first request naming ``policy-v{N}`` until its first token: the resolver lists
           the manifest, downloads, verifies and vLLM loads the adapter
  warm     the same request once the version is loaded (generation cost alone)

and the bytes moved (up once; down once per vLLM replica). It then measures S3 upload and
verified download of an adapter the size of a 1.5B model's rank-16 LoRA, to extrapolate.

    .venv/bin/python bench/adapter_roundtrip.py [--versions 5] [--json out.json]

Needs the vLLM venv (hack/setup-vllm-venv.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.vllm_server import start_vllm_server

from asyncgrpo.testing.s3 import S3Server

# Qwen2.5-1.5B-class shapes for the extrapolation (hidden, intermediate, layers, q/kv heads,
# head_dim), LoRA on all 7 linear projections, rank 16.
BIG = {"hidden": 1536, "intermediate": 8960, "layers": 28, "q_heads": 12, "kv_heads": 2,
       "head_dim": 128, "rank": 16}


def lora_params(hidden, intermediate, layers, q_heads, kv_heads, head_dim, rank):
    q, kv = q_heads * head_dim, kv_heads * head_dim
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
              (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    return layers * sum(rank * (i + o) for i, o in shapes)


def first_token_s(server, model: str) -> float:
    t0 = time.perf_counter()
    status, body = server.completion(model, [1, 2, 3, 4], max_tokens=1, temperature=0.0)
    dt = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"{model}: {status} {body}")
    return dt


def big_transfer(store, tmp: Path) -> dict:
    """Publish + verified fetch of one safetensors file the size of the 1.5B rank-16 LoRA."""
    import torch
    from safetensors.torch import save_file

    n = lora_params(**BIG)
    d = tmp / "big-adapter"
    d.mkdir()
    # fp32: what a trainer holding LoRA weights in fp32 saves; one tensor keeps the file exact.
    w = {"w": torch.randn(n, dtype=torch.float32)}
    t0 = time.perf_counter()
    save_file(w, str(d / "adapter_model.safetensors"))
    save = time.perf_counter() - t0
    (d / "adapter_config.json").write_text(json.dumps({"r": BIG["rank"], "base_model_name_or_path": "1.5b"}))
    t0 = time.perf_counter()
    m = store.publish(d, 1, step=1)
    up = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.fetch(1, tmp / "big-fetched")
    down = time.perf_counter() - t0
    return {"params": n, "bytes": m.total_bytes, "save_s": save, "publish_s": up,
            "fetch_verify_s": down}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-big", action="store_true", help="skip the 1.5B-sized S3 transfer")
    args = ap.parse_args()

    from asyncgrpo.adapters.store import AdapterStore
    from asyncgrpo.adapters.tiny import random_lora_model
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="asyncgrpo-bench-adapters-"))
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
             "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(creds)
    moto = S3Server.start(tmp / "moto.log")
    endpoint = moto.endpoint
    server = None
    try:
        base = save_tiny_checkpoint(tmp / "base")
        store = AdapterStore("bench-adapters", run="bench", endpoint_url=endpoint)
        store.client.create_bucket(Bucket="bench-adapters")
        server = start_vllm_server(base, log_path=tmp / "vllm.log", env={
            **creds,
            "ASYNCGRPO_ADAPTER_ENDPOINT": endpoint,
            "ASYNCGRPO_ADAPTER_BUCKET": "bench-adapters",
            "ASYNCGRPO_ADAPTER_RUN": "bench",
            "ASYNCGRPO_ADAPTER_CACHE_DIR": str(tmp / "cache"),
        })
        first_token_s(server, str(base))  # warm the engine before timing anything

        rows = []
        for v in range(1, args.versions + 1):
            model = random_lora_model(base, rank=args.rank, seed=v)  # "the step just ended"
            out = tmp / f"out-v{v}"
            t0 = time.perf_counter()
            model.save_pretrained(str(out))
            t_save = time.perf_counter() - t0
            t0 = time.perf_counter()
            manifest = store.publish(out, v, step=v)
            t_pub = time.perf_counter() - t0
            t_serve = first_token_s(server, f"policy-v{v}")
            t_warm = first_token_s(server, f"policy-v{v}")
            manifest_bytes = len(manifest.to_json().encode())
            rows.append({"version": v, "save_s": t_save, "publish_s": t_pub, "serve_s": t_serve,
                         "warm_s": t_warm, "total_s": t_save + t_pub + t_serve,
                         "adapter_bytes": manifest.total_bytes, "manifest_bytes": manifest_bytes})

        result = {"tiny": rows, "rank": args.rank}
        if not args.no_big:
            big_store = AdapterStore("bench-adapters", run="bench-big", endpoint_url=endpoint)
            result["big"] = big_transfer(big_store, tmp)
    finally:
        if server is not None:
            server.stop()
        moto.stop()

    med = {k: statistics.median(r[k] for r in rows)
           for k in ("save_s", "publish_s", "serve_s", "warm_s", "total_s")}
    result["tiny_median"] = med
    print(f"tiny Qwen3 (rank {args.rank}), {len(rows)} versions, median seconds:")
    print(f"  save {med['save_s']:.3f}  publish {med['publish_s']:.3f}  "
          f"serve (resolve+load+1 token) {med['serve_s']:.3f}  warm 1 token {med['warm_s']:.3f}")
    print(f"  saved -> served: {med['total_s']:.3f} s; bytes per version: "
          f"{rows[0]['adapter_bytes']} adapter + {rows[0]['manifest_bytes']} manifest, "
          f"uploaded once, downloaded once per vLLM replica")
    if "big" in result:
        b = result["big"]
        print(f"1.5B-class rank-16 LoRA: {b['params']:,} params = {b['bytes'] / 1e6:.1f} MB fp32; "
              f"save {b['save_s']:.2f} s, publish {b['publish_s']:.2f} s ({b['bytes'] / 1e6 / b['publish_s']:.0f} MB/s), "
              f"fetch+verify {b['fetch_verify_s']:.2f} s ({b['bytes'] / 1e6 / b['fetch_verify_s']:.0f} MB/s)"
              " on loopback")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
