#!/usr/bin/env python3
"""Structured output on the GPU machine: the Qwen3-0.6B shape with random bf16 weights
(config/shapes/qwen3-0.6b.json, the synthetic tokenizer padded to 151,936 ids) served alone
by `tokenrouter serve`, loaded by `tokenrouter bench` (closed loop, greedy, EOS ignored)
free and under constraints (`json_object`, a JSON schema, a regex, and vLLM's token
restrictions `min_tokens` / `bad_words`), at several
concurrencies, with the masks applied on the device (default) and on the host
(`TOKENROUTER_DEVICE_MASKS=0`: the step's logits all come to the host). Before timing, each
server answers one schema and one regex request whose text is checked.

With `--switch sampling` the two servers differ instead in where sampled rows draw
(`TOKENROUTER_SAMPLING=device`, the GPU default, vs `host`: every step's logits to the host)
and the load is sampled (`--temperature`, `--top-p`, a seed per request).

With `--switch greedy` (and temperature 0) an all-greedy batch is picked by the sampling
kernel (`TOKENROUTER_SAMPLING=auto`, the default: the "device" column) or by candle's argmax
ops on the GPU (`host`: the "host" column).

Usage: python3 scripts/gpu_structured.py --bin BIN [--concurrency 1 16 64] [--out DIR]
           [--switch masks|sampling|greedy] [--temperature 0] [--top-p 1] [--constraints free ...]
           [--modes device host] [--extra-body JSON]
"""
import argparse, json, os, re, subprocess, sys, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_routing import get, step_stats, stop, wait_ready  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = "[a-z]{3,8}(, [a-z]{3,8}){0,30}"
CONSTRAINTS = {
    "free": None,
    "json_object": {"response_format": {"type": "json_object"}},
    "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}},
    "regex": {"guided_regex": REGEX},
    # vLLM's token restrictions: the same masks without a grammar (a stop id held back by
    # min_tokens, bad words masked at every step).
    "restricted": {"min_tokens": 96, "stop_token_ids": [11], "bad_words": ["def", " return", "import"]},
}
# Per switch: the variable, and its value on the device and on the host.
# "greedy": an all-greedy batch picked by the sampling kernel ("device": `auto`, the default)
# vs candle's argmax ops on the GPU ("host").
SWITCHES = {"masks": ("TOKENROUTER_DEVICE_MASKS", {"device": "1", "host": "0"}),
            "sampling": ("TOKENROUTER_SAMPLING", {"device": "device", "host": "host"}),
            "greedy": ("TOKENROUTER_SAMPLING", {"device": "auto", "host": "host"})}


def mask_stats(port):
    """Cumulative (steps with masks, seconds on masks) of the quick model from /metrics."""
    text = get(port, "/metrics")
    def val(name):
        m = re.search(r"^tokenrouter:token_mask_seconds_" + name + r'\{model="quick"\} ([0-9.eE+-]+)$', text, re.M)
        return float(m.group(1)) if m else 0.0
    return val("count"), val("sum")


def post(port, path, body, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def checks(port):
    """One schema answer (chat) and one regex answer (completions): their texts and whether
    they keep to the constraint."""
    out = {}
    r = post(port, "/v1/chat/completions", {
        "model": "quick", "messages": [{"role": "user", "content": "Describe an item."}],
        "max_tokens": 200, "temperature": 0, **CONSTRAINTS["schema"]})
    text = r["choices"][0]["message"]["content"]
    try:
        v = json.loads(text)
        ok = set(v) == {"name", "count", "tags"} and isinstance(v["count"], int) and isinstance(v["tags"], list)
    except ValueError:
        ok = False
    out["schema"] = dict(text=text, ok=ok, finish=r["choices"][0]["finish_reason"])
    r = post(port, "/v1/completions", {"model": "quick", "prompt": "Some words:", "max_tokens": 200,
                                       "temperature": 0, "guided_regex": REGEX})
    text = r["choices"][0]["text"]
    out["regex"] = dict(text=text, ok=re.fullmatch(REGEX, text) is not None, finish=r["choices"][0]["finish_reason"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=30778)
    ap.add_argument("--out", default="/tmp/gpu_structured")
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="masks")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--constraints", nargs="+", choices=list(CONSTRAINTS), default=list(CONSTRAINTS))
    ap.add_argument("--modes", nargs="+", choices=["device", "host"], default=["device", "host"])
    ap.add_argument("--extra-body", type=json.loads, default={},
                    help="JSON fields added to every benchmark request (e.g. penalties)")
    args = ap.parse_args()
    var, modes = SWITCHES[args.switch]
    modes = {m: v for m, v in modes.items() if m in args.modes}
    sampling = ["--temperature", str(args.temperature)]
    if args.temperature > 0:
        sampling += ["--seed", "1"]
    os.makedirs(args.out, exist_ok=True)
    cfg = os.path.join(args.out, "qwen3-0.6b-alone.yaml")
    open(cfg, "w").write(
        "model:\n  quick:\n"
        f"    model_path: {ROOT}/config/shapes/qwen3-0.6b.json\n"
        "    random_weights: true\n    device: cuda:0\n    dtype: bf16\n    kv_cache_tokens: 65536\n"
        "system:\n  entry_model: quick\n  max_queued_requests: 512\n")
    rows, answers = [], {}
    for mode, flag in modes.items():
        d = os.path.join(args.out, mode)
        os.makedirs(d, exist_ok=True)
        log = open(os.path.join(d, "server.log"), "w")
        env = dict(os.environ, **{var: flag})
        srv = subprocess.Popen([args.bin, "serve", "--config", cfg, "--port", str(args.port)],
                               stdout=log, stderr=log, env=env)
        try:
            print(f"{mode}: ready in {wait_ready(args.port, srv):.0f}s", file=sys.stderr, flush=True)
            answers[mode] = checks(args.port)
            print(json.dumps({mode: answers[mode]}), file=sys.stderr, flush=True)
            for c in args.concurrency:
                for name, extra in ((n, CONSTRAINTS[n]) for n in args.constraints):
                    dc = os.path.join(d, f"{name}_c{c}")
                    cmd = [args.bin, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--model", "quick",
                           "--concurrency", str(c), "--num-prompts", str(max(2 * c, 4)),
                           "--max-tokens", str(args.max_tokens), "--ignore-eos", *sampling,
                           "--dataset", "code", "--out-dir", dc, "--no-progress", "--quiet"]
                    body = dict(extra or {}, **args.extra_body,
                                **({"top_p": args.top_p} if args.top_p < 1 else {}))
                    if body:
                        cmd += ["--extra-body", json.dumps(body)]
                    before, masks_before = step_stats(args.port)["quick"], mask_stats(args.port)
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
                    after, masks_after = step_stats(args.port)["quick"], mask_stats(args.port)
                    n, sec, batch = (a - b for a, b in zip(after, before))
                    mn, msec = (a - b for a, b in zip(masks_after, masks_before))
                    s = json.load(open(os.path.join(dc, "summary.json")))
                    rows.append(dict(mode=mode, constraint=name, concurrency=c, tok_s=s["output_throughput"],
                                     completed=s["completed"], failed=s["failed"],
                                     tokens=s["total_output_tokens"],
                                     step_ms=round(1e3 * sec / n, 3) if n else None,
                                     mean_batch=round(batch / n, 1) if n else None,
                                     mask_ms=round(1e3 * msec / mn, 3) if mn else None))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        except Exception as e:
            print(f"{mode}: FAILED {e}", file=sys.stderr, flush=True)
        finally:
            stop(srv)
    json.dump(dict(rows=rows, answers=answers), open(os.path.join(args.out, "structured.json"), "w"), indent=1)
    for mode, a in answers.items():
        print(f"CHECK {mode}: schema ok={a['schema']['ok']} finish={a['schema']['finish']} "
              f"regex ok={a['regex']['ok']} finish={a['regex']['finish']}")
    if len(answers) == 2:
        same = all(answers["device"][k]["text"] == answers["host"][k]["text"] for k in ("schema", "regex"))
        print(f"CHECK device and host ({args.switch}) give the same greedy answers: {same}")
    print("| constraint | c | device tok/s | host tok/s | device / host | device step ms | host step ms | masks ms a step (device / host) | mean batch | tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["mode"], r["constraint"], r["concurrency"]): r for r in rows}
    for c in args.concurrency:
        for name in CONSTRAINTS:
            dv, hs = by.get(("device", name, c)), by.get(("host", name, c))
            if not dv or not hs:
                continue
            print(f"| {name} | {c} | {dv['tok_s']:.0f} | {hs['tok_s']:.0f} | {dv['tok_s'] / hs['tok_s']:.2f}x | "
                  f"{dv['step_ms']} | {hs['step_ms']} | {dv['mask_ms']} / {hs['mask_ms']} | {dv['mean_batch']} | "
                  f"{dv['tokens']} / {hs['tokens']} |")


if __name__ == "__main__":
    main()
