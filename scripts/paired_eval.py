#!/usr/bin/env python3
"""Paired comparison of `tokenrouter eval` variants on the problems they share.

Reads per-problem rows from eval output directories (their `results/<variant>/*.json`) and
JSONL row files (docs/results/*.jsonl), optionally prefixing each source's variant names,
and prints pass@1 and large-model share over the problems every listed variant answered,
then an exact two-sided McNemar test (gained / lost / p) for each pair asked for. With
several samples a problem (`eval --samples`), a problem's pass rate over its samples stands
for its pass, and the test is the exact sign test over the problems whose rates differ (the
same as McNemar's when there is one answer a problem).

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
            answers = rows.setdefault(prefix + r["variant"], {}).setdefault(r["task_id"], {})
            answers[r.get("sample", 0)] = r


def rate(answers):
    """A problem's pass rate over its samples (its pass, 0 or 1, with one answer)."""
    return sum(r["passed"] for r in answers.values()) / len(answers)


def share(rows, tasks):
    by = {}
    for t in tasks:
        for r in rows[t].values():
            for model, n in r["answer"].get("tokens_by_model", {}).items():
                by[model] = by.get(model, 0) + n
    total = sum(by.values())
    # The second model of the pair is the large one (`reference` in the default pair).
    large = by.get("reference", 0)
    return large / total if total else 0.0


def mcnemar(a, b, tasks):
    gained = sum(1 for t in tasks if rate(a[t]) > rate(b[t]))
    lost = sum(1 for t in tasks if rate(b[t]) > rate(a[t]))
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
        k = sum(rate(rows[v][t]) for t in tasks)
        n = max(len(rows[v][t]) for t in tasks)
        each = f", {n} samples a problem" if n > 1 else ""
        print(f"| {v} | {100 * k / len(tasks):.1f}% ({k:g}/{len(tasks)}{each}) | {100 * s:.1f}% |")
    for x, y in a.pair:
        if x not in full or y not in full:
            print(f"{x} vs {y}: not on the same problems")
            continue
        g, l, p = mcnemar(rows[x], rows[y], tasks)
        print(f"{x} vs {y}: {g} gained / {l} lost, exact McNemar (sign) p = {p:.2g}")


if __name__ == "__main__":
    main()
