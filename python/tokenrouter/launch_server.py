"""``python -m tokenrouter.launch_server --config_path <yaml> [--port 30000]``: the research
system's way to start the server; runs the same server as ``tokenrouter serve``.

Flags are spelt as in the research system (``--config_path``) or as in ``tokenrouter serve``
(``--config``); dashes and underscores are interchangeable.
"""

import argparse
import sys
from typing import List, Optional

from . import _native


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tokenrouter.launch_server",
        description="Serve the OpenAI-compatible API over the token-routing engine.",
    )
    p.add_argument("--config_path", "--config-path", "--config", dest="config_path",
                   help="YAML config (default: the built-in Qwen2.5-Coder 0.5B/1.5B CPU pair)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api_key", "--api-key", dest="api_key",
                   help="require Authorization: Bearer <key> on /v1/*")
    p.add_argument("--allowed_origins", "--allowed-origins", dest="allowed_origins",
                   help="browser origins allowed to call the API (CORS), comma-separated")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change one config value, e.g. model.quick.scheduler_kwargs.threshold=0.1")
    p.add_argument("--shutdown_grace", "--shutdown-grace", dest="shutdown_grace", type=int,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--tool_call_parser", "--tool-call-parser", dest="tool_call_parser",
                   help="how chat answers' tool calls are read: hermes (qwen25), llama3_json (llama3) or none")
    p.add_argument("--reasoning_parser", "--reasoning-parser", dest="reasoning_parser",
                   help="how reasoning models' thinking is told from the answer: qwen3, deepseek_r1 or none")
    return p


def serve_argv(argv: Optional[List[str]] = None) -> List[str]:
    """The ``tokenrouter serve`` command line these flags mean."""
    a = _parser().parse_args(argv)
    cmd = ["tokenrouter", "serve", "--host", a.host, "--port", str(a.port)]
    if a.config_path:
        cmd += ["--config", a.config_path]
    if a.api_key:
        cmd += ["--api-key", a.api_key]
    if a.allowed_origins:
        cmd += ["--allowed-origins", a.allowed_origins]
    for o in a.overrides:
        cmd += ["--set", o]
    if a.shutdown_grace is not None:
        cmd += ["--shutdown-grace", str(a.shutdown_grace)]
    if a.tool_call_parser:
        cmd += ["--tool-call-parser", a.tool_call_parser]
    if a.reasoning_parser:
        cmd += ["--reasoning-parser", a.reasoning_parser]
    return cmd


def main(argv: Optional[List[str]] = None) -> int:
    return _native.run_cli(serve_argv(argv))


if __name__ == "__main__":
    sys.exit(main())
