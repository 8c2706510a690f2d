#!/usr/bin/env python3
"""Routing benchmark on CPU with the real Qwen2.5-Coder pair: one table of throughput and
LLM share for several engine variants at several concurrencies, measured with our own
load generator (`tokenrouter bench`) against `tokenrouter serve`.

Variants (name -> config): slm_only, llm_only, random p=0.3 in sync / async (B=1) /
async + static delayed batching B per concurrency / async + `auto` (online planner).
Also prints, for the auto runs, the planner's predicted tok/s scraped from /metrics.

Usage: python3 scripts/bench_routing.py [--concurrency 1 4 8] [--prompts 8] [--max-tokens 64]
       [--variants slm_only llm_only sync async auto static:2 ...] [--seed 1] [--out DIR]

The binary is $TOKENROUTER_BIN, else $CARGO_TARGET_DIR/release/tokenrouter (built first), else
target/release/tokenrouter. `--seed` fixes the load generator's request seeds, so every variant
routes the same positions. The 1-minute load average is printed per run.
"""
import argparse, json, os, re, signal, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
BIN = os.environ.get("TOKENROUTER_BIN") or os.path.join(TARGET, "release", "tokenrouter")

def config(variant, seed=0):
    slm, llm, extra, execution = "random", "random", "", "async"
    kwargs = "{p: 0.3, seed: %d}" % seed
    if variant == "slm_only":
        slm, llm, kwargs = "slm_only", "slm_only", "{}"
    elif variant == "llm_only":
        slm, llm, kwargs = "llm_only", "llm_only", "{}"
    elif variant == "sync":
        execution = "sync"
    elif variant == "auto":
        extra = "    delayed_batching_threshold: auto\n"
    elif variant.startswith("static:"):
        extra = "    delayed_batching_threshold: %s\n" % variant.split(":", 1)[1]
    elif variant != "async":
        sys.exit(f"unknown variant {variant}")
    return (
        "model:\n"
        "  quick:\n    model_path: qwen2.5-coder-0.5b-instruct-q4_k_m\n"
        f"    scheduler_class: {slm}\n    scheduler_kwargs: {kwargs}\n    kv_cache_tokens: 16384\n"
        "  reference:\n    model_path: qwen2.5-coder-1.5b-instruct-q4_k_m\n"
        f"    scheduler_class: {llm}\n    kv_cache_tokens: 16384\n{extra}"
        f"system:\n  entry_model: quick\n  execution: {execution}\n"
    )

def wait_ready(port, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not become ready")

def metric(port, name, text=None):
    if text is None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    m = re.search(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(2)) if m else None

def run(variant, conc, args, out):
    port = args.port
    d = os.path.join(out, f"{variant.replace(':', '_').replace(',', '-')}_c{conc}")
    os.makedirs(d, exist_ok=True)
    cfg = os.path.join(d, "config.yaml")
    open(cfg, "w").write(config(variant))
    log = open(os.path.join(d, "server.log"), "w")
    srv = subprocess.Popen([BIN, "serve", "--config", cfg, "--port", str(port)], stdout=log, stderr=log)
    try:
        wait_ready(port)
        cmd = [BIN, "bench", "--base-url", f"http://127.0.0.1:{port}", "--concurrency", str(conc),
               "--num-prompts", str(max(args.prompts, conc)), "--max-tokens", str(args.max_tokens),
               "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--dataset", "code", "--out-dir", d,
               "--no-progress", "--quiet"]
        bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        # The planner's prediction and threshold are those in force while all `conc`
        # requests are in flight: sample /metrics during the run, keep the last such sample.
        predicted = thr = None
        while bench.poll() is None:
            time.sleep(0.5)
            if variant != "auto":
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except Exception:
                continue
            if metric(port, "tokenrouter:engine_active_requests", text) == conc:
                predicted = metric(port, "tokenrouter:planner_predicted_tokens_per_second", text) or None
                thr = metric(port, 'tokenrouter:delayed_batching_threshold{model="reference"}', text)
        if bench.returncode != 0:
            raise RuntimeError(f"bench failed ({bench.returncode})")
        s = json.load(open(os.path.join(d, "summary.json")))
        return s, predicted, thr, os.getloadavg()[0]
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=60)
        except subprocess.TimeoutExpired:
            srv.kill()

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["slm_only", "llm_only", "sync", "async", "auto"])
    ap.add_argument("--seed", type=int, default=1, help="request seed of the load generator")
    ap.add_argument("--port", type=int, default=30555)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not os.environ.get("TOKENROUTER_BIN"):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "tokenrouter"], cwd=ROOT, check=True)
    out = args.out or tempfile.mkdtemp(prefix="bench_routing_")
    rows = []
    for conc in args.concurrency:
        for v in args.variants:
            load0 = os.getloadavg()[0]
            s, pred, thr, load1 = run(v, conc, args, out)
            share = s.get("share_by_model") or {}
            rows.append((v, conc, s["output_throughput"] if "output_throughput" in s else s.get("output_tokens_per_s"), share.get("reference", 0.0), s.get("completed"), s.get("failed"), pred, thr))
            print(f"{v:>14} c={conc}: {rows[-1][2]:.2f} tok/s, LLM share {rows[-1][3]:.3f}" + (f", planner predicted {pred:.2f} tok/s (B={thr:.0f})" if pred else "") + f"  [load {load0:.2f} -> {load1:.2f}]", file=sys.stderr, flush=True)
    print(f"\nresults in {out}\n")
    print("| variant | concurrency | output tok/s | LLM share | completed/failed | planner predicted tok/s |")
    print("|---|---|---|---|---|---|")
    for v, c, tps, sh, ok, bad, pred, thr in rows:
        p = f"{pred:.2f} (B={thr:.0f})" if pred else ""
        print(f"| {v} | {c} | {tps:.2f} | {sh:.3f} | {ok}/{bad} | {p} |")

if __name__ == "__main__":
    main()
