#!/usr/bin/env python3
"""llama.cpp CPU throughput baseline for tokenrouter's own benchmark (same machine, same run).

For each GGUF, measures with llama.cpp's server (xllamacpp, in-process, 2 threads by default):
  decode:  single-stream greedy generation of 128 tokens after a 64-token prompt (EOS ignored),
           tok/s over the generated tokens only;
  prefill: a 512-token prompt, prompt-processing tok/s.
Timings are llama.cpp's own (`timings` of /completion); prompt caching is off, so every run
re-processes its prompt. One warm-up run, then --repeats runs; the median is reported.
Prints one JSON object on stdout (llama.cpp's logs go to stderr).

Usage: python3 scripts/bench_llamacpp.py [--model PATH ...] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llamacpp_common import DEFAULT_MODELS, XLLAMACPP_VERSION, LlamaServer  # noqa: E402

# Source text for prompts; tokenized and cycled to the exact lengths needed.
PROMPT_SOURCE = (
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    left = merge_sort(items[:mid])\n    right = merge_sort(items[mid:])\n    out = []\n"
    "    while left and right:\n        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return out + left + right\n\n"
    "The quick brown fox jumps over the lazy dog while the committee reviews the quarterly report, "
    "noting that latency improved by 12% and throughput by 30% after the cache redesign.\n"
)


def prompt_of(server: LlamaServer, n: int) -> list[int]:
    base = server.tokenize(PROMPT_SOURCE)
    return (base * (n // len(base) + 1))[:n]


def run(server: LlamaServer, prompt: list[int], n_predict: int) -> dict:
    t = time.perf_counter()
    out = server.complete(prompt, n_predict=n_predict, cache_prompt=False, ignore_eos=True)
    wall = time.perf_counter() - t
    tm = out["timings"]
    return {
        "prompt_n": tm["prompt_n"],
        "prompt_tok_s": round(tm["prompt_per_second"], 3),
        "predicted_n": tm["predicted_n"],
        "decode_tok_s": round(tm["predicted_per_second"], 3),
        "wall_s": round(wall, 4),
    }


def bench_model(path: str, threads: int, repeats: int, decode_prompt: int, decode_tokens: int,
                prefill_tokens: int) -> dict:
    t0 = time.time()
    server = LlamaServer(path, threads=threads, n_ctx=max(2048, prefill_tokens + 16, decode_prompt + decode_tokens + 16))
    load_s = time.time() - t0
    dec_prompt = prompt_of(server, decode_prompt)
    pre_prompt = prompt_of(server, prefill_tokens)
    run(server, dec_prompt, 8)  # warm-up
    decode = [run(server, dec_prompt, decode_tokens) for _ in range(repeats)]
    prefill = [run(server, pre_prompt, 1) for _ in range(repeats)]
    for r in decode:
        if r["predicted_n"] != decode_tokens:
            raise SystemExit(f"decode produced {r['predicted_n']} tokens, expected {decode_tokens}")
    return {
        "model": os.path.basename(path),
        "path": path,
        "load_s": round(load_s, 2),
        "decode_prompt_tokens": decode_prompt,
        "decode_tokens": decode_tokens,
        "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in decode), 3),
        "prefill_tokens": prefill_tokens,
        "prefill_tok_s": round(statistics.median(r["prompt_tok_s"] for r in prefill), 3),
        "decode_runs": decode,
        "prefill_runs": prefill,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="GGUF path (repeatable); default: both cached Qwen2.5-Coder models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    args = ap.parse_args()
    models = args.model or [DEFAULT_MODELS["0.5b"], DEFAULT_MODELS["1.5b"]]
    results = [
        bench_model(m, args.threads, args.repeats, args.decode_prompt, args.decode_tokens, args.prefill_tokens)
        for m in models
    ]
    print(json.dumps({
        "engine": "llama.cpp",
        "xllamacpp_version": XLLAMACPP_VERSION,
        "threads": args.threads,
        "repeats": args.repeats,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg())},
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
