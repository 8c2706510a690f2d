#!/usr/bin/env python3
"""Routing under a constraint on the GPU machine: the Qwen3-0.6B shape (entry) and the
Qwen3-8B shape with random bf16 weights and the synthetic tokenizer, served by
`tokenrouter serve`, once routed by R-Stitch (`rstitch`, threshold `--threshold`) and once
never routed (`random` with p = 0, which reads no entropy). Random weights make the small
model unsure of every token over the whole vocabulary, so free answers go to the large model
at nearly every position, while under a regex that allows a few dozen tokens a step its
entropy over the allowed tokens stays low: the CUDA path of the masked entropy
(`StepOutput::entropy_rows_allowed`) decides that. Checks: the constrained answers keep to
their constraint; the large model's share, free and constrained; the small model's step time
under the regex, R-Stitch (masks and masked entropy) against never routed (masks alone).

Usage: python3 scripts/gpu_constrained_routing.py --bin BIN [--concurrency 1 16 64] [--out DIR]
"""
import argparse, json, os, re, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_routing import get, step_stats, stop, wait_ready  # noqa: E402
from gpu_structured import post  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGEX = "[a-z]{3,8}(, [a-z]{3,8}){0,30}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
          "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
CONSTRAINTS = {"free": {}, "regex": {"guided_regex": REGEX},
               "schema": {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "item", "schema": SCHEMA}}}}


def tokens_by_model(port):
    text = get(port, "/metrics")
    out = {}
    for model in ("quick", "reference"):
        m = re.search(r'^tokenrouter:tokens_by_model_total\{model="' + model + r'"\} ([0-9.eE+-]+)$', text, re.M)
        out[model] = float(m.group(1)) if m else 0.0
    return out


def config(path, slm, slm_kwargs, llm):
    shapes = os.path.join(ROOT, "config", "shapes")
    open(path, "w").write(
        "model:\n"
        f"  quick:\n    model_path: {shapes}/qwen3-0.6b.json\n    random_weights: true\n"
        f"    device: cuda:0\n    dtype: bf16\n    kv_cache_tokens: 32768\n"
        f"    scheduler_class: {slm}\n    scheduler_kwargs: {slm_kwargs}\n"
        f"  reference:\n    model_path: {shapes}/qwen3-8b.json\n    random_weights: true\n"
        f"    device: cuda:0\n    dtype: bf16\n    kv_cache_tokens: 32768\n"
        f"    scheduler_class: {llm}\n"
        "system:\n  entry_model: quick\n  execution: async\n  max_queued_requests: 512\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--port", type=int, default=30779)
    ap.add_argument("--out", default="/tmp/gpu_constrained")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    servers = {"rstitch": ("rstitch_slm", f"{{threshold: {args.threshold}}}", "rstitch_llm"),
               "never": ("random_slm", "{p: 0.0, seed: 0}", "random_llm")}
    rows, checks = [], {}
    for name, (slm, kw, llm) in servers.items():
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        cfg = os.path.join(d, "config.yaml")
        config(cfg, slm, kw, llm)
        log = open(os.path.join(d, "server.log"), "w")
        srv = subprocess.Popen([args.bin, "serve", "--config", cfg, "--port", str(args.port)],
                               stdout=log, stderr=log)
        try:
            print(f"{name}: ready in {wait_ready(args.port, srv):.0f}s", file=sys.stderr, flush=True)
            r = post(args.port, "/v1/completions", {"prompt": "Some words:", "max_tokens": 200,
                                                    "temperature": 0, "guided_regex": REGEX})
            text = r["choices"][0]["text"]
            c = {"regex_ok": re.fullmatch(REGEX, text) is not None, "regex_by": r["tokenrouter"]["tokens_by_model"]}
            r = post(args.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "An item."}],
                                                         "max_tokens": 200, "temperature": 0,
                                                         **CONSTRAINTS["schema"]})
            text = r["choices"][0]["message"]["content"]
            try:
                v = json.loads(text)
                c["schema_ok"] = set(v) == {"name", "count"} and isinstance(v["count"], int)
            except ValueError:
                c["schema_ok"] = False
            c["schema_by"] = r["tokenrouter"]["tokens_by_model"]
            checks[name] = c
            print(json.dumps({name: c}), file=sys.stderr, flush=True)
            for conc in args.concurrency:
                for cname, extra in CONSTRAINTS.items():
                    dc = os.path.join(d, f"{cname}_c{conc}")
                    cmd = [args.bin, "bench", "--base-url", f"http://127.0.0.1:{args.port}",
                           "--concurrency", str(conc), "--num-prompts", str(max(2 * conc, 4)),
                           "--max-tokens", str(args.max_tokens), "--ignore-eos", "--temperature", "0",
                           "--dataset", "code", "--out-dir", dc, "--no-progress", "--quiet"]
                    if extra:
                        cmd += ["--extra-body", json.dumps(extra)]
                    before, tb = step_stats(args.port)["quick"], tokens_by_model(args.port)
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
                    after, ta = step_stats(args.port)["quick"], tokens_by_model(args.port)
                    n, sec, batch = (a - b for a, b in zip(after, before))
                    q, ref = ta["quick"] - tb["quick"], ta["reference"] - tb["reference"]
                    s = json.load(open(os.path.join(dc, "summary.json")))
                    rows.append(dict(server=name, constraint=cname, c=conc, tok_s=round(s["output_throughput"]),
                                     failed=s["failed"], llm_share=round(ref / max(1, q + ref), 3),
                                     quick_step_ms=round(1e3 * sec / n, 3) if n else None,
                                     mean_batch=round(batch / n, 1) if n else None))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        except Exception as e:
            print(f"{name}: FAILED {e}", file=sys.stderr, flush=True)
        finally:
            stop(srv)
    json.dump(dict(rows=rows, checks=checks), open(os.path.join(args.out, "constrained.json"), "w"), indent=1)
    for name, c in checks.items():
        print(f"CHECK {name}: regex ok={c['regex_ok']} by {c['regex_by']}; schema ok={c['schema_ok']} by {c['schema_by']}")
    print("| server | constraint | c | tok/s | LLM share | quick step ms | mean batch | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['constraint']} | {r['c']} | {r['tok_s']} | {100 * r['llm_share']:.1f}% | "
              f"{r['quick_step_ms']} | {r['mean_batch']} | {r['failed']} |")


if __name__ == "__main__":
    main()
