#!/usr/bin/env python3
"""CPU speed of tokenrouter beside llama.cpp, same machine, same run (scripts/bench_cpu.sh).

Alternating rounds (ours, then each llama.cpp, per model), medians over the rounds of:
prefill tok/s of a 512-token prompt, single-stream greedy decode tok/s (128 tokens after 64,
and 64 after 1024), our batch-8 decode total tok/s, and each process's peak resident memory
(ru_maxrss of the child, so the same measure for every engine). Columns:
  tokenrouter          `tokenrouter bench-model --json` (kernels from TOKENROUTER_CPU_* if set);
  llama.cpp native     `llama-bench` built from the llama-cpp-python sdist (scripts/build_llamacpp.sh),
                       `-t T -p 512 -n 0`, `-d 64 -n 128`, `-d 1024 -n 64`; its batch-8 column from
                       `llama-batched-bench` beside it when built (8 sequences of 64 prompt tokens,
                       128 steps each, as ours: `-npp 64 -ntg 128 -npl 8`, the steps' total tok/s);
  llama.cpp wheel      xllamacpp through scripts/bench_llamacpp.py (prefill and decode at 64), if installed.
Prints the CPU's model and SIMD flags, then a Markdown table; --json-out keeps every run.

Usage: bench_cpu.py --bin target/release/tokenrouter --model A.gguf [--model B.gguf]
                    [--llama-bench PATH ...] [--rounds 3] [--threads 2] [--no-wheel]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SIMD = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
        "avx512_bf16", "amx_int8"]


def cpu_line() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, val = line.partition(":")
            if key.strip() == "model name":
                model = val.strip()
            elif key.strip() == "flags":
                flags = set(val.split())
    except OSError:
        pass
    have = [f for f in SIMD if f in flags]
    return f"{model}, {os.cpu_count()} CPUs; SIMD: {' '.join(have) or 'none known'}"


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[str, float]:
    """Run `cmd`; its stdout and its peak resident memory in MB. A failure stops the bench."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            tail = err.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{tail}")
        return out.read().decode(), usage.ru_maxrss / 1024.0


def ours(binary: str, model: str) -> dict:
    text, rss = run_measured([binary, "bench-model", "--model", model, "--repeats", "1", "--json"])
    j = json.loads(text.strip().splitlines()[-1])
    return {"prefill": j["prefill_tok_s"], "decode64": j["decode_tok_s"],
            "decode1k": j.get("long_decode_tok_s"), "batch8": j["batch_decode_tok_s"], "rss": rss}


def llama_bench(binary: str, model: str, threads: int) -> dict:
    runs = {"prefill": ["-p", "512", "-n", "0"], "decode64": ["-p", "0", "-n", "128", "-d", "64"],
            "decode1k": ["-p", "0", "-n", "64", "-d", "1024"]}
    row, rss = {}, 0.0
    for key, args in runs.items():
        text, r = run_measured([binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json", *args])
        row[key] = json.loads(text)[0]["avg_ts"]
        rss = max(rss, r)
    # Eight sequences stepping together, as `bench-model --batch 8` (64 prompt tokens, then
    # 128 steps): llama-batched-bench's generation speed (all sequences' tokens / time).
    batched = os.path.join(os.path.dirname(binary), "llama-batched-bench")
    if os.path.exists(batched):
        text, r = run_measured([batched, "-m", model, "-t", str(threads), "-c", "2048", "-b", "2048",
                                "-ub", "512", "-npp", "64", "-ntg", "128", "-npl", "8",
                                "--output-format", "jsonl"])
        row["batch8"] = json.loads(text.strip().splitlines()[-1])["speed_tg"]
        rss = max(rss, r)
    row["rss"] = rss
    return row


def wheel(model: str, threads: int) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    text, rss = run_measured([sys.executable, os.path.join(HERE, "bench_llamacpp.py"), "--model", model,
                              "--threads", str(threads), "--repeats", "1"], env)
    r = json.loads(text)["results"][0]
    return {"prefill": r["prefill_tok_s"], "decode64": r["decode_tok_s"], "rss": rss}


def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--llama-bench", action="append", default=[], metavar="NAME=PATH",
                    help="a natively built llama-bench (repeatable), e.g. native=build/bin/llama-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-wheel", action="store_true")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    benches = [tuple(x.split("=", 1)) if "=" in x else ("native", x) for x in a.llama_bench]
    use_wheel = not a.no_wheel
    if use_wheel:
        try:
            import xllamacpp  # noqa: F401
        except ImportError:
            print("xllamacpp not installed: no wheel column", file=sys.stderr)
            use_wheel = False
    kernels = {k: v for k, v in os.environ.items() if k.startswith("TOKENROUTER_CPU_")}
    print(cpu_line())
    print(f"threads {a.threads}, {a.rounds} alternating rounds, medians; tokenrouter kernels: "
          f"{' '.join(f'{k}={v}' for k, v in sorted(kernels.items())) or 'auto'}\n")
    runs: dict = {}
    for rnd in range(a.rounds):
        for m in a.model:
            name = os.path.basename(m)
            r = runs.setdefault(name, {})
            print(f"round {rnd + 1}: {name}", file=sys.stderr)
            r.setdefault("tokenrouter", []).append(ours(a.bin, m))
            for label, path in benches:
                r.setdefault(f"llama.cpp {label}", []).append(llama_bench(path, m, a.threads))
            if use_wheel:
                r.setdefault("llama.cpp wheel", []).append(wheel(m, a.threads))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"cpu": cpu_line(), "kernels": kernels, "runs": runs}, f, indent=1)
    keys = ["prefill", "decode64", "decode1k", "batch8", "rss"]
    print("| model | engine | prefill 512 tok/s | decode at 64 tok/s | decode at 1k tok/s | batch-8 decode tok/s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for name, engines in runs.items():
        meds = {e: {k: med(rows, k) for k in keys} for e, rows in engines.items()}
        first = True
        for e, v in meds.items():
            b8 = fmt(v["batch8"])
            if v["batch8"] is not None and v["decode64"]:
                b8 += f" ({v['batch8'] / v['decode64']:.2f}x b=1)"
            print(f"| {name if first else ''} | {e} | {fmt(v['prefill'])} | {fmt(v['decode64'])} | "
                  f"{fmt(v['decode1k'])} | {b8} | {fmt(v['rss'], 0)} |")
            first = False
        ref = next((e for e in meds if e.startswith("llama.cpp") and e != "llama.cpp wheel"), None) \
            or ("llama.cpp wheel" if "llama.cpp wheel" in meds else None)
        if ref:
            o, l = meds["tokenrouter"], meds[ref]
            print(f"| | ours / {ref} | {ratio(o['prefill'], l['prefill'])} | {ratio(o['decode64'], l['decode64'])} | "
                  f"{ratio(o['decode1k'], l['decode1k'])} | {ratio(o['batch8'], l.get('batch8'))} | "
                  f"{ratio(o['rss'], l['rss'])} |")


if __name__ == "__main__":
    main()
