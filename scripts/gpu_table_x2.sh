#!/usr/bin/env bash
# The whole issue-6 table in one device call on a two-GPU machine (device kind
# nvidia-h200-x2, carry [".gpu"]): one GPU alone needs ~20 minutes for it, over the 10-minute
# call limit. The checks run first on GPU 0; then at once GPU 0 serves the routing variants
# llm_only, sync and async, while GPU 1 measures our steps with the ceilings, the HF eager
# reference, then slm_only and delayed. Each model pair sits on one GPU, so the two halves do
# not share a device. Output tokens per request: ROUTING_TOKENS (default 2048), c = 1 4 8 16.
# Logs in $OUT/gpu0 and $OUT/gpu1; the merged routing table and the step table come last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
TOK=${ROUTING_TOKENS:-2048}
OUT=$OUT/gpu0 CUDA_VISIBLE_DEVICES=0 STEPS="check fused" bash scripts/gpu_bench.sh > "$OUT/checks.log" 2>&1
grep -h "^CHECK" "$OUT/checks.log" | cut -c1-300
# The tensor-core attention fallback of gpu_bench.sh reads the check's output in its OUT.
cp "$OUT/gpu0/check_fused.txt" "$OUT/gpu1/" 2>/dev/null
OUT=$OUT/gpu0 CUDA_VISIBLE_DEVICES=0 STEPS=routing \
  ROUTING_ARGS="--variants llm_only sync async --max-tokens $TOK --port 30777 --budget-s ${BUDGET0:-480}" \
  bash scripts/gpu_bench.sh > "$OUT/gpu0.log" 2>&1 &
OUT=$OUT/gpu1 CUDA_VISIBLE_DEVICES=1 STEPS="ours hf routing" \
  ROUTING_ARGS="--variants slm_only delayed --max-tokens $TOK --port 30778 --budget-s ${BUDGET1:-240}" \
  bash scripts/gpu_bench.sh > "$OUT/gpu1.log" 2>&1 &
wait
echo "== steps (GPU 1) and HF eager"
sed -n '/^== SUMMARY/,$p' "$OUT/gpu1.log"
echo "== routing, $TOK output tokens (GPU 0: llm_only sync async; GPU 1: slm_only delayed)"
python3 scripts/gpu_routing.py --merge "$OUT/gpu0/routing/routing.json" "$OUT/gpu1/routing/routing.json"
