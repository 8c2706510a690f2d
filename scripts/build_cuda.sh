#!/usr/bin/env bash
# Build the CUDA binary on this CPU-only machine (recipe: ../shared/cuda/README.md) and pack
# what the GPU machine needs into .gpu/ (git-ignored): the stripped binary (xz-compressed
# when large), run-on-gpu.sh and torch_reference_eager.py. Then, with the device tool:
#   run(command="bash scripts/gpu_bench.sh", carry=[".gpu"])
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/cuda}
source ~/.cache/tokenrouter-cuda/env.sh
nice -n 19 cargo build --release -p tokenrouter --features cuda --target-dir target-cuda
mkdir -p .gpu
rm -f .gpu/tokenrouter .gpu/tokenrouter.xz
strip -o .gpu/tokenrouter target-cuda/release/tokenrouter
cp "$SHARED/run-on-gpu.sh" "$SHARED/torch_reference_eager.py" .gpu/
if [ "$(stat -c %s .gpu/tokenrouter)" -gt $((40 * 1024 * 1024)) ]; then
  nice -n 19 xz -T2 -6 .gpu/tokenrouter   # unpacked by scripts/gpu_bench.sh
fi
du -sh .gpu/*
