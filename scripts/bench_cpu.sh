#!/usr/bin/env bash
# Runtime speed on CPU, side by side with llama.cpp in the same run:
# prefill tok/s (512-token prompt), single-stream greedy decode tok/s (128 tokens after 64),
# and our batch-8 decode throughput. Prints a Markdown table.
# Usage: scripts/bench_cpu.sh [repeats]   (models from `tokenrouter fetch`; needs
#        `pip install xllamacpp==2026.10.11549` for the llama.cpp column)
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
cargo build --release -q -p tokenrouter
bin=target/release/tokenrouter
cache=${TOKENROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenrouter}/models
out=${BENCH_OUT:-$(mktemp -d)}
for m in 0.5b 1.5b; do
  f=$cache/qwen2.5-coder-$m-instruct-q4_k_m.gguf
  "$bin" bench-model --model "$f" --repeats "$repeats" --json > "$out/ours-$m.json"
  OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_llamacpp.py --model "$f" --repeats "$repeats" > "$out/llama-$m.json" 2> "$out/llama-$m.log"
done
python3 - "$out" <<'PY'
import json, sys, os
d = sys.argv[1]
print(f"| model | engine | prefill 512 tok/s | decode b=1 tok/s | decode b=8 total tok/s |")
print("|---|---|---|---|---|")
for m in ["0.5b", "1.5b"]:
    ours = json.load(open(os.path.join(d, f"ours-{m}.json")))
    ll = json.load(open(os.path.join(d, f"llama-{m}.json")))["results"][0]
    print(f"| Qwen2.5-Coder-{m} Q4_K_M | tokenrouter | {ours['prefill_tok_s']:.1f} | {ours['decode_tok_s']:.1f} | {ours['batch_decode_tok_s']:.1f} ({ours['batch_decode_tok_s']/ours['decode_tok_s']:.2f}x b=1) |")
    print(f"| | llama.cpp (xllamacpp) | {ll['prefill_tok_s']:.1f} | {ll['decode_tok_s']:.1f} | – |")
    print(f"| | ratio ours/llama.cpp | {ours['prefill_tok_s']/ll['prefill_tok_s']:.2f}x | {ours['decode_tok_s']/ll['decode_tok_s']:.2f}x | |")
PY
