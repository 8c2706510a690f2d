#!/usr/bin/env python3
"""End-to-end routing throughput on the GPU machine (issue 6 table): Qwen3-0.6B and
Qwen3-32B shapes with random bf16 weights (config/random/Qwen3-0.6B_Qwen3-32B_random-weights.yaml),
seeded random routing at p = 0.35, served by `tokenrouter serve`, loaded by
`tokenrouter bench` (closed loop, EOS ignored) at several concurrencies.

Variants: slm_only, llm_only, sync (lockstep), async (B = 1), delayed (async + `auto`
delayed batching: online planner), static:B (async + constant threshold B).
One server per variant serves every concurrency level in turn.

Usage: python3 scripts/gpu_routing.py --bin BIN [--concurrency 1 4 8 16] [--max-tokens 256]
       [--variants slm_only llm_only sync async delayed] [--out DIR] [--budget-s 420]
       python3 scripts/gpu_routing.py --merge A/routing.json B/routing.json   (one table of both)
"""
import argparse, json, os, re, signal, subprocess, sys, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS_FILE = os.path.join(ROOT, "config", "random", "routing_variants.json")
VARIANTS = json.load(open(VARIANTS_FILE))
BASE = os.path.join(os.path.dirname(VARIANTS_FILE), VARIANTS["base"])

def overrides(variant, p):
    """The `serve --set` overrides of one variant (config/random/routing_variants.json)."""
    if variant.startswith("static:"):
        sets = [s.replace("{B}", variant.split(":", 1)[1]) for s in VARIANTS["static"]]
    elif variant in VARIANTS["variants"]:
        sets = VARIANTS["variants"][variant]
    else:
        sys.exit(f"unknown variant {variant!r}: known {sorted(VARIANTS['variants'])} or static:B")
    return [f"{VARIANTS['rate']}={p}"] + sets

def get(port, path, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read().decode()

def wait_ready(port, srv, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if srv.poll() is not None:
            raise RuntimeError("server exited")
        try:
            get(port, "/health", 2)
            return time.time() - t0
        except Exception:
            time.sleep(0.5)
    raise RuntimeError("server did not become ready")

def stop(srv):
    """SIGTERM a server, then kill it if it has not exited within a minute."""
    srv.send_signal(signal.SIGTERM)
    try:
        srv.wait(timeout=60)
    except subprocess.TimeoutExpired:
        srv.kill()

def metric(port, name):
    m = re.search(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.eE+-]+)$", get(port, "/metrics"), re.M)
    return float(m.group(2)) if m else None

def step_stats(port):
    """Cumulative (steps, seconds stepping, rows stepped) per model from /metrics."""
    text = get(port, "/metrics")
    out = {}
    for model in ("quick", "reference"):
        def val(name):
            m = re.search(r"^tokenrouter:" + name + r'\{model="' + model + r'"\} ([0-9.eE+-]+)$', text, re.M)
            return float(m.group(1)) if m else 0.0
        out[model] = (val("model_step_latency_seconds_count"), val("model_step_latency_seconds_sum"),
                      val("model_batch_size_sum"))
    return out

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    ap.add_argument("--merge", nargs="+", help="print one table of these routing.json files")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--p", default="0.35")
    ap.add_argument("--variants", nargs="+", default=["slm_only", "llm_only", "sync", "async", "delayed"])
    ap.add_argument("--port", type=int, default=30777)
    ap.add_argument("--out", default="/tmp/gpu_routing")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new runs after this")
    args = ap.parse_args()
    if args.merge:
        rows = [r for f in args.merge for r in json.load(open(f))]
        order = ["slm_only", "llm_only", "sync", "async", "delayed"]
        seen = {r["variant"] for r in rows}
        variants = [v for v in order if v in seen] + sorted(seen - set(order))
        print_table(rows, variants, sorted({r["concurrency"] for r in rows}))
        return
    if not args.bin:
        ap.error("--bin is required (or --merge)")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    rows = []
    for v in args.variants:
        if time.time() - t_start > args.budget_s:
            print(f"budget spent, skipping {v}", file=sys.stderr)
            continue
        d = os.path.join(args.out, v.replace(":", "_"))
        os.makedirs(d, exist_ok=True)
        sets = overrides(v, args.p)
        open(os.path.join(d, "overrides.txt"), "w").write("\n".join(sets) + "\n")
        log = open(os.path.join(d, "server.log"), "w")
        cmd = [args.bin, "serve", "--config", BASE, "--port", str(args.port)]
        for s in sets:
            cmd += ["--set", s]
        srv = subprocess.Popen(cmd, stdout=log, stderr=log)
        try:
            load_s = wait_ready(args.port, srv)
            print(f"{v}: ready in {load_s:.0f}s", file=sys.stderr, flush=True)
            for c in args.concurrency:
                if time.time() - t_start > args.budget_s:
                    break
                dc = os.path.join(d, f"c{c}")
                cmd = [args.bin, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--concurrency", str(c),
                       "--num-prompts", str(c), "--max-tokens", str(args.max_tokens), "--ignore-eos",
                       "--temperature", "0", "--seed", "1", "--dataset", "code", "--out-dir", dc,
                       "--no-progress", "--quiet"]
                before = step_stats(args.port)
                t0 = time.time()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
                wall = time.time() - t0
                after = step_stats(args.port)
                steps = {}
                for mdl in after:
                    n, sec, rows_ = (a - b for a, b in zip(after[mdl], before[mdl]))
                    if n > 0:
                        # steps, mean step ms, mean batch, fraction of the wall time stepping
                        steps[mdl] = [int(n), round(1e3 * sec / n, 2), round(rows_ / n, 2), round(sec / wall, 3)]
                s = json.load(open(os.path.join(dc, "summary.json")))
                share = (s.get("share_by_model") or {}).get("reference", 0.0)
                tps = s.get("output_throughput", s.get("output_tokens_per_s"))
                thr = metric(args.port, 'tokenrouter:delayed_batching_threshold{model="reference"}')
                pred = metric(args.port, "tokenrouter:planner_predicted_tokens_per_second") if v == "delayed" else None
                rows.append(dict(variant=v, concurrency=c, tok_s=tps, llm_share=share, completed=s.get("completed"),
                                 failed=s.get("failed"), threshold=thr, predicted=pred, wall_s=wall, steps=steps,
                                 tpot_ms=(s.get("tpot_ms") or {}).get("median")))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        except Exception as e:
            print(f"{v}: FAILED {e}", file=sys.stderr, flush=True)
        finally:
            stop(srv)
    json.dump(rows, open(os.path.join(args.out, "routing.json"), "w"), indent=1)
    print_table(rows, args.variants, args.concurrency)

def print_table(rows, variants, cs):
    """Output tok/s per variant and concurrency, and delayed (or its first static:B) vs sync."""
    print("| variant | " + " | ".join(f"c={c} tok/s" for c in cs) + " | LLM share (last c) |")
    print("|---|" + "---|" * (len(cs) + 1))
    by = {}
    for v in variants:
        rr = {r["concurrency"]: r for r in rows if r["variant"] == v}
        if not rr:
            continue
        by[v] = rr
        cells = [f'{rr[c]["tok_s"]:.1f}' if c in rr else "-" for c in cs]
        last = rr[max(rr)]
        extra = f' (B={last["threshold"]:.0f}, planner {last["predicted"]:.0f})' if last.get("predicted") else ""
        print(f"| {v} | " + " | ".join(cells) + f' | {last["llm_share"]:.3f}{extra} |')
    if "sync" in by and "delayed" in by:
        cells = [f'{by["delayed"][c]["tok_s"] / by["sync"][c]["tok_s"]:.2f}x'
                 if c in by["delayed"] and c in by["sync"] else "-" for c in cs]
        print("| delayed / sync | " + " | ".join(cells) + " | |")

if __name__ == "__main__":
    main()
