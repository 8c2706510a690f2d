"""scripts/paired_eval.py on hand-made rows: one answer a problem (McNemar) and several
samples a problem (the problems' pass rates, the sign test over those that differ)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "paired_eval.py")


def row(variant, task, passed, sample=0, large=0, small=1):
    return {"variant": variant, "task_id": task, "sample": sample, "passed": passed,
            "answer": {"tokens_by_model": {"quick": small, "reference": large}}}


def run(rows, *args):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        out = subprocess.run([sys.executable, SCRIPT, "--rows", path, *args],
                             capture_output=True, text=True, check=True)
        return out.stdout


class PairedEval(unittest.TestCase):
    def test_one_answer_a_problem_is_mcnemar(self):
        # a passes t0..t3, b passes t3 only: 3 gained, 0 lost, p = 2 / 2^3.
        rows = [row("a", f"t{i}", True) for i in range(4)]
        rows += [row("b", f"t{i}", i == 3, large=1, small=0) for i in range(4)]
        out = run(rows, "--pair", "a", "b")
        self.assertIn("| a | 100.0% (4/4) | 0.0% |", out)
        self.assertIn("| b | 25.0% (1/4) | 100.0% |", out)
        self.assertIn("a vs b: 3 gained / 0 lost, exact McNemar (sign) p = 0.25", out)

    def test_samples_are_pass_rates_and_a_sign_test(self):
        # Four samples a problem. a: t0 4/4, t1 2/4, t2 0/4; b: t0 4/4, t1 1/4, t2 1/4.
        passes = {"a": {"t0": 4, "t1": 2, "t2": 0}, "b": {"t0": 4, "t1": 1, "t2": 1}}
        rows = [row(v, t, k < n, sample=k) for v, by in passes.items()
                for t, n in by.items() for k in range(4)]
        out = run(rows, "--pair", "a", "b")
        self.assertIn("| a | 50.0% (1.5/3, 4 samples a problem) |", out)
        self.assertIn("| b | 50.0% (1.5/3, 4 samples a problem) |", out)
        # t1 better for a, t2 better for b, t0 level: 1 / 1, p = 1.
        self.assertIn("a vs b: 1 gained / 1 lost, exact McNemar (sign) p = 1", out)


if __name__ == "__main__":
    unittest.main()
