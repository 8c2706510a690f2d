#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` and `llama-batched-bench` from the llama-cpp-python 0.3.36 sdist
# (PyPI, sha256-pinned), the reference scripts/bench_cpu.sh compares against
# (../shared/reference/CPU-PERF.md).
# Usage: scripts/build_llamacpp.sh [native|avx2]   -> prints the llama-bench path
#   native: GGML_NATIVE=ON (every SIMD extension this CPU has) but AMX: on the Sapphire Rapids
#           VMs we measured on, its AMX matmul traps (SIGILL at `tileloadd`) in llama-bench;
#   avx2:   AVX2 + FMA + F16C only (no AVX-512, no AVX-VNNI): what an AVX2-only machine runs,
#           for comparing with tokenrouter's forced AVX2 kernels on an AVX-512 machine.
# Needs a C++ compiler; cmake and ninja come from PyPI when missing. Cached under
# $TOKENROUTER_CACHE/llama.cpp (a few minutes on 2 cores the first time).
set -euo pipefail
variant=${1:-native}
case $variant in
  native) noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          flags=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx") ;;
  avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "usage: $0 [native|avx2]" >&2; exit 2 ;;
esac
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
cache=${TOKENROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenrouter}/llama.cpp
bin=$cache/build-$variant/bin/llama-bench
# llama-batched-bench (eight sequences decoding together) beside it: bench_cpu.py's batch-8 column.
if [ -x "$bin" ] && [ -x "${bin%/*}/llama-batched-bench" ]; then echo "$bin"; exit 0; fi
mkdir -p "$cache"
sdist=$cache/llama_cpp_python-$version.tar.gz
if ! echo "$sha256  $sdist" | sha256sum -c --quiet >/dev/null 2>&1; then
  # The simple index (PEP 503) is what every PyPI mirror serves.
  url=$(curl -fsSL "${PIP_INDEX_URL:-https://pypi.org/simple}/llama-cpp-python/" |
        grep -o "https://[^\"#]*llama_cpp_python-$version.tar.gz" | head -1)
  [ -n "$url" ] || { echo "llama-cpp-python $version sdist not found on the index" >&2; exit 1; }
  echo "downloading $url" >&2
  curl -fsSL -o "$sdist.part" "$url"
  echo "$sha256  $sdist.part" | sha256sum -c --quiet || { echo "sha256 mismatch for $url" >&2; exit 1; }
  mv "$sdist.part" "$sdist"
fi
src=$cache/llama_cpp_python-$version/vendor/llama.cpp
[ -d "$src" ] || tar xzf "$sdist" -C "$cache"
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  python3 -m venv "$cache/tools" >&2 && "$cache/tools/bin/pip" install -q cmake ninja >&2
  export PATH=$cache/tools/bin:$PATH
fi
echo "building llama-bench, llama-batched-bench ($variant) in $cache/build-$variant" >&2
cmake -S "$src" -B "$cache/build-$variant" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  "${flags[@]}" >&2
cmake --build "$cache/build-$variant" -j"$(nproc)" --target llama-bench llama-batched-bench >&2
echo "$bin"
