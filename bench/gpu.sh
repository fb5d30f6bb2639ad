#!/usr/bin/env bash
# Tree packing on one CUDA GPU, in one go (a few minutes):
#   1. correctness: the compiled FlexAttention path against forwarding every rollout alone
#      (`asyncgrpo tree verify --device cuda`, fp32; dense and MoE, full and LoRA);
#   2. benchmark: a Qwen3-0.6B-shaped random model in bf16, G=16, prompt 2048, completion 512
#      (ideal 4.0x), tree vs sequence packing (FlexAttention document masking), and TRL's
#      own tree_fa3 path where its hub kernel can be fetched.
# Results go to $OUT (default bench/results/gpu-<timestamp>); record them in docs/benchmarks/tree.md.
#
# STATUS: written without a GPU at hand and NOT YET RUN on one. The CPU parts it calls are
# tested (tests/tree); the CUDA-only parts (compiled FlexAttention, create_block_mask on CUDA,
# bf16 at this size) are not.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
OUT=${OUT:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
tree() { "$PY" -m asyncgrpo.cli tree "$@"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.csv"
"$PY" - <<'PY' | tee "$OUT/torch.txt"
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
PY

echo "== 1. correctness (compiled FlexAttention on CUDA vs each rollout alone, fp32)"
"$PY" - "$OUT/rollouts.jsonl" <<'PY'
import sys
from asyncgrpo.trainer.tree.rollout import dump_rollouts
from asyncgrpo.trainer.tree.synthetic import synthetic_rollouts
# Two single-turn groups and two multi-turn groups: forks, prefixes, shared histories.
rollouts = synthetic_rollouts(2, 8, 300, 80) + synthetic_rollouts(2, 4, 200, 120, turns=3, seed=1)
dump_rollouts(rollouts, sys.argv[1])
PY
failed=0
for model in dense moe; do
  for lora in "" "--lora"; do
    name="verify-$model${lora:+-lora}"
    if tree verify "$OUT/rollouts.jsonl" --model "$model" $lora --device cuda --ranks 2 --budget 2048 \
        > "$OUT/$name.json"; then
      echo "PASS $name: $(tail -c 400 "$OUT/$name.json")"
    else
      echo "FAIL $name: $(cat "$OUT/$name.json")"; failed=1
    fi
  done
done

echo "== 2. benchmark: Qwen3-0.6B shape, bf16, G=16, prompt 2048, completion 512"
QWEN3_06B='{"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
  "max_position_embeddings": 40960, "tie_word_embeddings": true}'
tree bench --device cuda --dtype bfloat16 --groups 1 --generations 16 --prompt 2048 --completion 512 \
  --repeats 5 --model-config "$QWEN3_06B" --compare-trl-fa3 | tee "$OUT/bench-qwen3-0.6b.txt"

echo "== 3. the CPU benchmark's shape on the GPU (tiny dense, fp32)"
tree bench --device cuda --groups 2 --generations 8 --prompt 1024 --completion 256 --repeats 5 \
  | tee "$OUT/bench-tiny.txt"

"$PY" - "$OUT/bench-qwen3-0.6b.txt" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
verdict = "meets" if r["speedup"] >= 3.5 else "MISSES"
print(f"speedup {r['speedup']:.2f}x (ideal {r['ideal_speedup']:.2f}x): {verdict} the 3.5x target")
print("TRL tree_fa3:", r.get("trl_fa3_s", r.get("trl_fa3_skipped")))
PY
echo "results in $OUT"
exit $failed
