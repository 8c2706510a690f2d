#!/usr/bin/env python3
"""llama.cpp's samplers, ours against llama.cpp's own server on the same GGUF.

Greedy requests (temperature 0) are deterministic in both engines, so the tokens must be
equal where the samplers agree: DRY (its penalties change the argmax), XTC at probability 1
(it always cuts: the answer is the least likely of the tokens above the threshold), typical-p
(the argmax of the locally typical set), and `samplers` orders. Each case runs `/completion`
on llama.cpp (in-process through the xllamacpp wheel, as llamacpp_reference.py) and on a
running tokenrouter pinned to one model, and prints how many answers are token for token
equal and where the first difference is.

Usage:
  tokenrouter serve &                     # the default pair
  python3 scripts/compare_llamacpp_samplers.py --gguf PATH/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      --url http://127.0.0.1:30000 --model quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llamacpp_common import LlamaServer  # noqa: E402

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(",
    "The list: apple, banana, apple, banana, apple,",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n",
    "<html><body><div><div><div>",
    "Once upon a time, there was a little",
]

# Every case is greedy, no repetition penalty (llama.cpp's 64-token window is the same rule
# here, but kept out so that each case tests one sampler). `ignore_eos` runs to n_predict:
# llama.cpp bans the end-of-generation ids then, and so do we on its endpoints. DRY's window
# is given: upstream llama.cpp reads its default -1 as the whole context, as we do, but the
# xllamacpp wheel refuses -1 and its default scans a shorter window.
BASE = {"temperature": 0, "repeat_penalty": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

CASES = {
    "greedy (control)": {},
    "DRY 0.8, default breakers": {"dry_multiplier": 0.8, "dry_penalty_last_n": 2048},
    "DRY 2.0, allowed 1, breaker newline": {
        "dry_multiplier": 2.0,
        "dry_allowed_length": 1,
        "dry_sequence_breakers": ["\n"],
        "dry_penalty_last_n": 2048,
    },
    "DRY 0.8, window 32, base 3": {"dry_multiplier": 0.8, "dry_penalty_last_n": 32, "dry_base": 3.0},
    "XTC always, threshold 0.1": {"xtc_probability": 1.0, "xtc_threshold": 0.1},
    "typical-p 0.5": {"typical_p": 0.5},
    "order: XTC before top-k": {
        "xtc_probability": 1.0,
        "xtc_threshold": 0.05,
        "samplers": ["xtc", "top_k", "temperature"],
    },
    "DRY + typical-p + XTC": {
        "dry_multiplier": 0.8,
        "dry_penalty_last_n": 2048,
        "typical_p": 0.7,
        "xtc_probability": 1.0,
        "xtc_threshold": 0.15,
    },
}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default="quick", help="our configured model serving the GGUF")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    llama = LlamaServer(args.gguf, threads=args.threads)
    rows = []
    control = {}
    for name, extra in CASES.items():
        equal = changed = 0
        firsts = []
        for prompt in PROMPTS:
            ids = llama.tokenize(prompt)
            body = {**BASE, **extra, "prompt": ids, "n_predict": args.tokens, "return_tokens": True,
                    "ignore_eos": True, "cache_prompt": False, "stream": False}
            theirs = llama.post("/completion", body)["tokens"]
            ours = post(args.url + "/completion", {**body, "model": args.model})["tokens"]
            # How often the sampler moved llama.cpp's own answer off plain greedy.
            control.setdefault(prompt, theirs)
            changed += int(theirs != control[prompt])
            if theirs == ours:
                equal += 1
            else:
                first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
                firsts.append(first)
        rows.append({"case": name, "equal": equal, "of": len(PROMPTS), "changed_by_sampler": changed,
                     "first_differences": firsts})
        print(f"{name:40} {equal}/{len(PROMPTS)} equal ({changed} changed by the sampler)"
              + (f"; first differences at {firsts}" if firsts else ""), flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
