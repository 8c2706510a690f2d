"""``python -m tokenrouter.entrypoints.openai.run_batch -i in.jsonl -o out.jsonl``: vLLM's
offline batch runner over the token-routing engine; the same as ``tokenrouter run-batch``.

Each input line is an OpenAI batch request (``{"custom_id", "method": "POST", "url",
"body"}`` for ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``); each output
line its answer, in input order. vLLM's ``--model`` is the config here (``--config``; default:
the built-in pair); dashes and underscores are interchangeable.
"""

import argparse
import sys
from typing import List, Optional

from ... import _native


def run_batch_argv(argv: Optional[List[str]] = None) -> List[str]:
    """The ``tokenrouter run-batch`` command line these flags mean."""
    p = argparse.ArgumentParser(
        prog="python -m tokenrouter.entrypoints.openai.run_batch",
        description="Answer an OpenAI batch file with the token-routing engine.",
    )
    p.add_argument("-i", "--input_file", "--input-file", dest="input_file", required=True)
    p.add_argument("-o", "--output_file", "--output-file", dest="output_file", required=True)
    p.add_argument("--config", "--config_path", "--config-path", dest="config",
                   help="YAML config (default: the built-in Qwen2.5-Coder 0.5B/1.5B CPU pair)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change one config value")
    p.add_argument("--max_concurrency", "--max-concurrency", dest="max_concurrency", type=int)
    a = p.parse_args(argv)
    cmd = ["tokenrouter", "run-batch", "-i", a.input_file, "-o", a.output_file]
    if a.config:
        cmd += ["--config", a.config]
    for o in a.overrides:
        cmd += ["--set", o]
    if a.max_concurrency is not None:
        cmd += ["--max-concurrency", str(a.max_concurrency)]
    return cmd


def main(argv: Optional[List[str]] = None) -> int:
    return _native.run_cli(run_batch_argv(argv))


if __name__ == "__main__":
    sys.exit(main())
