#!/usr/bin/env bash
# Runtime speed on CPU beside llama.cpp, same machine, same run (scripts/bench_cpu.py says what
# is measured): prefill 512, decode at 64 and at 1k context, our batch-8 decode, peak RSS; the
# CPU's SIMD flags first. Alternating rounds, medians, a Markdown table.
# Usage: scripts/bench_cpu.sh [rounds]   (models from `tokenrouter fetch`)
#   LLAMA=native|avx2|"native avx2"|none  which llama-bench builds to compare (default native;
#         scripts/build_llamacpp.sh builds them once); the xllamacpp wheel column appears when
#         `pip install xllamacpp==2026.10.11549` is done.
#   TOKENROUTER_CPU_QK=avx2 TOKENROUTER_CPU_Q5=avx2  force our AVX2 kernels on an AVX-512 CPU
#         (compare with LLAMA=avx2).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -q -p tokenrouter
cache=${TOKENROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenrouter}/models
args=()
for v in ${LLAMA:-native}; do
  [ "$v" = none ] && continue
  args+=(--llama-bench "$v=$(scripts/build_llamacpp.sh "$v")")
done
exec python3 scripts/bench_cpu.py --bin target/release/tokenrouter --rounds "$rounds" "${args[@]}" \
  --model "$cache/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
  --model "$cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" ${BENCH_JSON:+--json-out "$BENCH_JSON"}
