#!/usr/bin/env python3
"""Paired comparison of `tokenrouter eval` variants on the problems they share.

Reads per-problem rows from eval output directories (their `results/<variant>/*.json`) and
JSONL row files (docs/results/*.jsonl), optionally prefixing each source's variant names,
and prints pass@1 and large-model share over the problems every listed variant answered,
then an exact two-sided McNemar test (gained / lost / p) for each pair asked for.

    scripts/paired_eval.py --rows rstitch=docs/results/humaneval-infill-session48.jsonl \
        --rows r2r=/tmp/infill-r2r --pair "r2r routed threshold=0.5" "rstitch large"

Standard library only (no numpy).
"""
import argparse
import glob
import json
import math
import os
import sys


def load(spec, rows):
    prefix, _, path = spec.rpartition("=")
    prefix = prefix + " " if prefix else ""
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "results", "*", "*.json"))
        items = (json.load(open(f)) for f in files)
    else:
        items = (json.loads(line) for line in open(path) if line.strip())
    for r in items:
        if "variant" in r and "task_id" in r:
            rows.setdefault(prefix + r["variant"], {})[r["task_id"]] = r


def share(rows, tasks):
    by = {}
    for t in tasks:
        for model, n in rows[t]["answer"].get("tokens_by_model", {}).items():
            by[model] = by.get(model, 0) + n
    total = sum(by.values())
    # The second model of the pair is the large one (`reference` in the default pair).
    large = by.get("reference", 0)
    return large / total if total else 0.0


def mcnemar(a, b, tasks):
    gained = sum(1 for t in tasks if a[t]["passed"] and not b[t]["passed"])
    lost = sum(1 for t in tasks if b[t]["passed"] and not a[t]["passed"])
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return gained, lost, p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", action="append", required=True, help="[prefix=]eval-dir-or-jsonl")
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"))
    ap.add_argument("--variants", nargs="*", help="only these variants (default: all complete ones)")
    a = ap.parse_args()
    rows = {}
    for spec in a.rows:
        load(spec, rows)
    names = a.variants or sorted(rows)
    names = list(dict.fromkeys(names + [v for p in a.pair for v in p]))
    missing = [v for v in names if v not in rows]
    if missing:
        sys.exit(f"no rows for {missing}; have {sorted(rows)}")
    counts = {v: len(rows[v]) for v in names}
    most = max(counts.values())
    # Variants that answered every problem the fullest one did.
    full = [v for v in names if counts[v] == most]
    tasks = set.intersection(*(set(rows[v]) for v in full))
    skipped = [v for v in names if v not in full]
    if skipped:
        print(f"left out (fewer problems): {skipped}")
    table = sorted((share(rows[v], tasks), v) for v in full)
    print(f"{len(tasks)} problems")
    print("| variant | pass@1 | large-model share |\n|---|---|---|")
    for s, v in table:
        k = sum(rows[v][t]["passed"] for t in tasks)
        print(f"| {v} | {100 * k / len(tasks):.1f}% ({k}/{len(tasks)}) | {100 * s:.1f}% |")
    for x, y in a.pair:
        if x not in full or y not in full:
            print(f"{x} vs {y}: not on the same problems")
            continue
        g, l, p = mcnemar(rows[x], rows[y], tasks)
        print(f"{x} vs {y}: {g} gained / {l} lost, exact McNemar p = {p:.2g}")


if __name__ == "__main__":
    main()
