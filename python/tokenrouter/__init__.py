"""tokenrouter: token-level routing between LLMs that share a tokenizer.

A small model writes; per token a routing method decides whether a large model rewrites that
position. This package runs the Rust engine in-process::

    from tokenrouter import TokenRoutingEngine

    with TokenRoutingEngine("config/rstitch/qwen2.5-coder-0.5b_1.5b_cpu.yaml") as engine:
        out = engine.generate("def fib(n):", {"max_new_tokens": 64, "temperature": 0})
        print(out["text"], out["meta_info"]["tokens_by_model"])

and ships the server (``python -m tokenrouter.launch_server --config_path <yaml>``) and the
whole ``tokenrouter`` command line.
"""

from ._native import EngineError, __version__
from .engine import TokenRoutingEngine

__all__ = ["TokenRoutingEngine", "EngineError", "__version__"]
