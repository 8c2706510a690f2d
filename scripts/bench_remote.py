#!/usr/bin/env python3
"""Remote sub-server benchmark on CPU with the real Qwen2.5-Coder pair: the 1.5B model in
the front end's process vs in a second process (`tokenrouter subserver`) on the same
machine over loopback TCP, for random routing (p = 0.3) and R-Stitch, at several
concurrencies. Prints one Markdown table: throughput in-process and remote, their ratio, the
per-hop transport latency (p50/p99, both directions: front -> remote measured by the
sub-server, remote -> front by the front end) and the LLM share.

Usage: python3 scripts/bench_remote.py [--concurrency 1 4 8] [--prompts 8] [--max-tokens 64]
       [--methods random rstitch] [--seed 1] [--out DIR] [--turn-file]
       python3 scripts/bench_remote.py --config PAIR.yaml [--set KEY=VALUE ...] [--bin CMD]
         (one method: that config with its overrides, e.g. the GPU pair of scripts/gpu_bench.sh)

`--turn-file`: in the remote placement both processes take CPU turns through one file
(`system.cpu_turn_file`), as two models in one process do (the in-process runs are the
default configuration either way). The binary is $TOKENROUTER_BIN, else
$CARGO_TARGET_DIR/release/tokenrouter (built first).
"""
import argparse, json, os, re, shlex, signal, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
BIN = os.environ.get("TOKENROUTER_BIN") or os.path.join(TARGET, "release", "tokenrouter")
CONFIGS = {
    "random": "config/random/qwen2.5-coder-0.5b_1.5b_cpu.yaml",
    "rstitch": "config/rstitch/qwen2.5-coder-0.5b_1.5b_cpu.yaml",
}


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_ready(url, timeout=180):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if get(url, 2)[0] == 200:
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become ready")


def histogram(text, name, labels):
    """Cumulative buckets [(le, count)] of one histogram series."""
    out = []
    for m in re.finditer(r"^" + re.escape(name) + r"_bucket\{([^}]*)\} ([0-9.eE+-]+)$", text, re.M):
        lab = dict(kv.split("=", 1) for kv in m.group(1).split(","))
        lab = {k: v.strip('"') for k, v in lab.items()}
        if all(lab.get(k) == v for k, v in labels.items()):
            le = float("inf") if lab["le"] == "+Inf" else float(lab["le"])
            out.append((le, float(m.group(2))))
    return sorted(out)


def quantile(buckets, q):
    """Prometheus-style linear interpolation inside the bucket holding quantile q."""
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_le, prev_c = le, c
    return prev_le


def run(method, remote, conc, args, out):
    d = os.path.join(out, f"{method}_{'remote' if remote else 'local'}_c{conc}")
    os.makedirs(d, exist_ok=True)
    cfg = args.config if method == "config" else os.path.join(ROOT, CONFIGS[method])
    sets = [a for kv in args.set for a in ("--set", kv)]
    if args.turn_file and remote:
        sets += ["--set", f"system.cpu_turn_file={os.path.join(out, 'cpu.turn')}"]
    procs = []
    try:
        sub_http = None
        if remote:
            log = open(os.path.join(d, "subserver.log"), "w")
            sub = subprocess.Popen(BIN + ["subserver", "--config", cfg, "--model", "reference",
                                    "--listen", f"tcp://127.0.0.1:{args.port + 1}", "--http",
                                    f"127.0.0.1:{args.port + 2}"] + sets,
                                   stdout=log, stderr=log)
            procs.append(sub)
            sub_http = f"http://127.0.0.1:{args.port + 2}"
            wait_ready(sub_http + "/health", timeout=600)
            sets += ["--set", f"model.reference.address=tcp://127.0.0.1:{args.port + 1}"]
        log = open(os.path.join(d, "server.log"), "w")
        srv = subprocess.Popen(BIN + ["serve", "--config", cfg, "--port", str(args.port)] + sets,
                               stdout=log, stderr=log)
        procs.insert(0, srv)
        base = f"http://127.0.0.1:{args.port}"
        wait_ready(base + "/health", timeout=600)
        cmd = BIN + ["bench", "--base-url", base, "--concurrency", str(conc),
               "--num-prompts", str(max(args.prompts, conc)), "--max-tokens", str(args.max_tokens),
               "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--dataset", "code",
               "--out-dir", d, "--no-progress", "--quiet"]
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        s = json.load(open(os.path.join(d, "summary.json")))
        front_metrics = get(base + "/metrics")[1]
        hop = {}
        if remote:
            sub_metrics = get(sub_http + "/metrics")[1]
            name = "tokenrouter:handoff_transport_seconds"
            hop["to_remote"] = histogram(sub_metrics, name, {"model": "reference"})
            hop["to_front"] = histogram(front_metrics, name, {"model": "quick"})
            hop["bytes"] = histogram(front_metrics, "tokenrouter:handoff_bytes", {"model": "reference", "kind": "delta"})
        return s, hop
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def us(x):
    return "" if x is None else f"{x * 1e6:.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["random", "rstitch"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=30655)
    ap.add_argument("--turn-file", action="store_true")
    ap.add_argument("--config", default=None, help="one pair config instead of --methods")
    ap.add_argument("--set", action="append", default=[], help="config override for every process")
    ap.add_argument("--bin", default=None, help="command that runs tokenrouter (default $TOKENROUTER_BIN)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global BIN
    if args.config:
        args.methods = ["config"]
    if args.bin:
        BIN = args.bin
    elif not os.environ.get("TOKENROUTER_BIN"):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "tokenrouter"], cwd=ROOT, check=True)
    BIN = shlex.split(BIN)
    out = args.out or tempfile.mkdtemp(prefix="bench_remote_")
    rows = []
    t0 = time.time()
    for method in args.methods:
        for conc in args.concurrency:
            local, _ = run(method, False, conc, args, out)
            remote, hop = run(method, True, conc, args, out)
            tl, tr = local["output_throughput"], remote["output_throughput"]
            share = lambda s: (s.get("share_by_model") or {}).get("reference", 0.0)
            q = {k: (quantile(v, 0.5), quantile(v, 0.99)) for k, v in hop.items()}
            rows.append((method, conc, tl, tr, tr / tl if tl else 0, q, share(local), share(remote),
                         local.get("failed", 0) + remote.get("failed", 0)))
            print(f"{method} c={conc}: in-process {tl:.2f} tok/s, remote {tr:.2f} tok/s "
                  f"({tr / tl:.3f}x) [{time.time() - t0:.0f}s]", file=sys.stderr, flush=True)
    print(f"\nresults in {out}; turn file: {'on' if args.turn_file else 'off'}\n")
    print("| method | c | in-process tok/s | remote tok/s | remote / in-process | hop to remote p50 / p99 µs "
          "| hop back p50 / p99 µs | delta bytes p50 | LLM share in-process / remote | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, c, tl, tr, r, q, sl, sr, f in rows:
        b = q.get("bytes", (None, None))[0]
        print(f"| {m} | {c} | {tl:.2f} | {tr:.2f} | {r:.3f} | {us(q['to_remote'][0])} / {us(q['to_remote'][1])} "
              f"| {us(q['to_front'][0])} / {us(q['to_front'][1])} | {'' if b is None else f'{b:.0f}'} "
              f"| {sl:.3f} / {sr:.3f} | {f} |")


if __name__ == "__main__":
    main()
