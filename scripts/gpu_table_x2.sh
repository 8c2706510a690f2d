#!/usr/bin/env bash
# The whole issue-6 table in one device call on a two-GPU machine (device kind
# nvidia-h200-x2, carry [".gpu"]): one GPU alone needs ~20 minutes for it, over the 10-minute
# call limit. At once, GPU 0 runs the HF eager reference, then serves the routing variants
# llm_only and sync; GPU 1 measures our steps with the ceilings, then serves slm_only,
# delayed and async. Each model pair sits on one GPU, so the two halves do not share a
# device. The kernel checks (`STEPS="check fused" bash scripts/gpu_bench.sh`) are not part of
# this call: ~10 minutes of GPU work leave no room for them. Output tokens per request:
# ROUTING_TOKENS (default 2048), c = 1 4 8 16. Logs in $OUT/gpu0 and $OUT/gpu1; the step
# table and the merged routing table come last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
TOK=${ROUTING_TOKENS:-2048}
OUT=$OUT/gpu0 CUDA_VISIBLE_DEVICES=0 STEPS="hf routing" \
  ROUTING_ARGS="--variants llm_only sync --max-tokens $TOK --port 30777 --budget-s ${BUDGET0:-360}" \
  bash scripts/gpu_bench.sh > "$OUT/gpu0.log" 2>&1 &
OUT=$OUT/gpu1 CUDA_VISIBLE_DEVICES=1 STEPS="ours routing" \
  ROUTING_ARGS="--variants slm_only delayed async --max-tokens $TOK --port 30778 --budget-s ${BUDGET1:-360}" \
  bash scripts/gpu_bench.sh > "$OUT/gpu1.log" 2>&1 &
wait
echo "== HF eager (GPU 0)"
grep -E "copy|gemm|HF eager" "$OUT/gpu0/hf_eager.txt"
echo "== steps (GPU 1)"
cp "$OUT/gpu0/hf_eager.txt" "$OUT/gpu1/" 2>/dev/null
OUT=$OUT/gpu1 STEPS=none bash scripts/gpu_bench.sh 2>/dev/null | sed -n '/^== SUMMARY/,$p'
echo "== routing, $TOK output tokens (GPU 0: llm_only sync; GPU 1: slm_only delayed async)"
python3 scripts/gpu_routing.py --merge "$OUT/gpu0/routing/routing.json" "$OUT/gpu1/routing/routing.json"
