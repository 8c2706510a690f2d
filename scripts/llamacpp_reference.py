#!/usr/bin/env python3
"""Reference data from llama.cpp for checking tokenrouter's CPU runtime on the real GGUFs.

For one GGUF, writes a JSON file with
  (a) tokenization of varied strings (special tokens parsed, no BOS),
  (b) teacher-forced next-token argmax (+ top-5 ids and logprobs) at every position of a few
      fixed texts (>= 512 positions in all),
  (c) greedy raw continuations (32 tokens) of 5 fixed prompts.
See scripts/README.md for the schema and how to regenerate.

Usage: python3 scripts/llamacpp_reference.py MODEL.gguf OUT.json [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llamacpp_common import XLLAMACPP_VERSION, LlamaServer, sha256_file  # noqa: E402

SCHEMA_VERSION = 1
TOP_N = 5
GREEDY_TOKENS = 32
MIN_POSITIONS = 512

TOKENIZE_STRINGS = [
    "Hello, world!",
    "",
    " ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!("{v:?}");\n}\n',
    "你好，世界！这是一个测试。日本語のテキストも含みます。한국어 문장입니다.",
    "I \u2764\ufe0f Rust \U0001f980\U0001f680 \u2014 emoji test \U0001f469\u200d\U0001f4bb\U0001f44d\U0001f3fd",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWrite a haiku.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|endoftext|>Document boundary<|endoftext|>",
    "text<|im_end|>more<|im_start|>",
    "<|not_a_token|> <im_start> <|im_start",
    "<|fim_prefix|>def f():\n<|fim_suffix|>\n    return x<|fim_middle|>",
    "a    b        c\t\t\td\n\n\n\ne   \n  f",
    "   leading and trailing spaces   ",
    "line1\r\nline2\r\n\r\nline3\n",
    "3.14159 2718281828 1,000,000 0x1F 1e-9 -42 +7 123456789012345",
    "\u00dcn\u00efc\u00f6d\u00e9 fa\u00e7ade na\u00efve caf\u00e9 \u2014 \u201cquotes\u201d \u2018single\u2019 "
    "\u00abguillemets\u00bb \u2026",
    "$\\frac{a}{b} = \\sum_{i=0}^{n} x_i^2$",
    "https://example.com/path?q=1&r=two#frag /usr/local/bin/python3 C:\\Windows\\System32",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "I'm sure you'll see they've done it, isn't it? We'd, he's. I'M LOUD, YOU'LL SEE",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!????",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u05e9\u05dc\u05d5\u05dd "
    "\u05e2\u05d5\u05dc\u05dd \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440 "
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    '<div class="a">&nbsp;&lt;b&gt;</div>\n<!-- comment -->',
]

TEACHER_FORCED_TEXTS = [
    (
        "python_code",
        '''import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Task:
    priority: int
    name: str = field(compare=False)


def schedule(tasks: list[Task], workers: int) -> dict[str, int]:
    """Assign each task to the least loaded worker, highest priority first."""
    loads = [(0, w) for w in range(workers)]
    heapq.heapify(loads)
    assignment = {}
    for task in sorted(tasks, reverse=True):
        load, worker = heapq.heappop(loads)
        assignment[task.name] = worker
        heapq.heappush(loads, (load + task.priority, worker))
    return assignment


if __name__ == "__main__":
    jobs = [Task(3, "build"), Task(1, "lint"), Task(5, "test"), Task(2, "docs")]
    print(schedule(jobs, 2))
''',
    ),
    (
        "english_prose",
        "The lighthouse keeper had kept the same routine for thirty years. Every evening, just before "
        "sunset, he climbed the one hundred and twelve steps, cleaned the great lens with a soft cloth, "
        "and lit the lamp. Ships no longer needed him; satellites told them where the rocks were. Still, "
        "he climbed. One stormy night in October, the radio crackled with a faint voice asking for help. "
        "A small fishing boat had lost its engine and was drifting toward the cliffs. The keeper turned "
        "the beam toward the sea and began to signal, slowly and patiently, until the boat's lights "
        "answered back.",
    ),
    (
        "chat_template",
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHow do I read a file line by line in Rust?<|im_end|>\n<|im_start|>assistant\n"
        "You can use `std::io::BufRead` together with `std::fs::File`:\n\n```rust\nuse std::fs::File;\n"
        "use std::io::{self, BufRead};\n\nfn main() -> io::Result<()> {\n    let file = File::open(\"input.txt\")?;\n"
        "    for line in io::BufReader::new(file).lines() {\n        println!(\"{}\", line?);\n    }\n"
        "    Ok(())\n}\n```\n\nEach call to `lines()` yields an `io::Result<String>`, so errors are handled "
        "per line.<|im_end|>\n",
    ),
    (
        "rust_code",
        '''use std::collections::HashMap;

/// Counts how often each word occurs, ignoring case and punctuation.
pub fn word_counts(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        *counts.entry(word.to_lowercase()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_words() {
        let c = word_counts("The cat and the hat.");
        assert_eq!(c["the"], 2);
        assert_eq!(c.get("dog"), None);
    }
}
''',
    ),
    (
        "mixed_multilingual",
        "Release notes / 发布说明 (v2.3):\n- Fixed a crash when the config file was empty (修复了配置文件为空时的崩溃)."
        "\n- Added emoji support in logs \U0001f389\U0001f680.\n- Performance: decoding is 12.5% faster; "
        "p99 latency dropped from 48 ms to 31 ms.\n- Deprecated: `--legacy-mode` will be removed in v3.0.\n",
    ),
]

GREEDY_PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
    "// Sum of squares of a slice\nfn sum_of_squares(v: &[i64]) -> i64 {\n",
    "Once upon a time, in a small village by the sea,",
]


def teacher_forced(server: LlamaServer, name: str, text: str) -> dict:
    """Next-token argmax and top-N after every prefix ids[:k+1], k = 0..len-1.

    Uses /completion with the prefix as token ids, n_predict=1, n_probs=TOP_N and the prompt cache,
    so each step evaluates one new token on top of the cached prefix (decode-mode logits)."""
    ids = server.tokenize(text)
    argmax, top_ids, top_logprobs = [], [], []
    for k in range(len(ids)):
        out = server.complete(ids[: k + 1], n_predict=1, n_probs=TOP_N, cache_prompt=True)
        sampled = int(out["tokens"][0])
        probs = out.get("completion_probabilities") or []
        if probs:
            top = probs[0]["top_logprobs"]
            if sampled != top[0]["id"]:
                # Greedy sampling and the top logprob disagree only on exact ties; keep the sampled one.
                print(f"  note: {name} pos {k}: sampled {sampled} vs top {top[0]['id']}", file=sys.stderr)
            top_ids.append([int(t["id"]) for t in top])
            top_logprobs.append([round(float(t["logprob"]), 4) for t in top])
        else:
            # llama.cpp withholds probabilities when the sampled token is an incomplete UTF-8
            # sequence (a byte-level piece of a multi-byte character): only the argmax is known.
            top_ids.append(None)
            top_logprobs.append(None)
        argmax.append(sampled)
    return {
        "name": name,
        "text": text,
        "ids": ids,
        "argmax": argmax,
        "top_ids": top_ids,
        "top_logprobs": top_logprobs,
    }


def greedy(server: LlamaServer, prompt: str) -> dict:
    prompt_ids = server.tokenize(prompt)
    out = server.complete(prompt_ids, n_predict=GREEDY_TOKENS, cache_prompt=False)
    ids = [int(t) for t in out["tokens"]]
    return {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "max_tokens": GREEDY_TOKENS,
        "ids": ids,
        "text": out["content"],
        "stop_type": out.get("stop_type"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("out", help="output JSON path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()

    t0 = time.time()
    server = LlamaServer(args.model, threads=args.threads, n_ctx=args.ctx)
    print(f"loaded {args.model} in {time.time() - t0:.1f}s", file=sys.stderr)

    tokenization = []
    for text in TOKENIZE_STRINGS:
        ids = server.tokenize(text)
        tokenization.append({"text": text, "ids": ids, "detokenized": server.detokenize(ids) if ids else ""})

    tf = []
    for name, text in TEACHER_FORCED_TEXTS:
        t1 = time.time()
        tf.append(teacher_forced(server, name, text))
        print(f"teacher-forced {name}: {len(tf[-1]['ids'])} positions in {time.time() - t1:.1f}s", file=sys.stderr)
    positions = sum(len(t["ids"]) for t in tf)
    if positions < MIN_POSITIONS:
        raise SystemExit(f"only {positions} teacher-forced positions, need {MIN_POSITIONS}")

    greedy_out = [greedy(server, p) for p in GREEDY_PROMPTS]

    result = {
        "schema_version": SCHEMA_VERSION,
        "generator": "scripts/llamacpp_reference.py",
        "xllamacpp_version": XLLAMACPP_VERSION,
        "model": {
            "file": os.path.basename(args.model),
            "size": os.path.getsize(args.model),
            "sha256": sha256_file(args.model),
        },
        "settings": {
            "threads": args.threads,
            "n_ctx": args.ctx,
            "add_special": False,
            "parse_special": True,
            "top_n": TOP_N,
            "sampling": "greedy (temperature 0), no chat template, prompts passed as token ids",
        },
        "tokenization": tokenization,
        "teacher_forced": tf,
        "teacher_forced_positions": positions,
        "greedy": greedy_out,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes, {positions} positions) "
          f"in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
