"""Shared helpers for the llama.cpp reference scripts.

Starts llama.cpp's server in-process through the `xllamacpp` wheel (pinned below) and talks to
its HTTP API (/tokenize, /detokenize, /completion) with the standard library only, so the
reference data is produced exactly the way llama.cpp's own server computes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request

# Must be set before llama.cpp starts its OpenMP threads, or they busy-wait (~15x slower on 2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import xllamacpp  # noqa: E402  (import after the environment is set)

XLLAMACPP_VERSION = "2026.10.11549"

DEFAULT_CACHE = os.environ.get("TOKENROUTER_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenrouter"
)
DEFAULT_MODELS = {
    "0.5b": os.path.join(DEFAULT_CACHE, "models", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "1.5b": os.path.join(DEFAULT_CACHE, "models", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}


class LlamaServer:
    """llama.cpp's server, loaded in this process, reachable on a local port."""

    def __init__(self, model_path: str, threads: int = 2, n_ctx: int = 2048):
        if xllamacpp.__version__ != XLLAMACPP_VERSION:
            raise SystemExit(
                f"xllamacpp {xllamacpp.__version__} installed, the reference needs {XLLAMACPP_VERSION}: "
                f"pip install xllamacpp=={XLLAMACPP_VERSION}"
            )
        if not os.path.isfile(model_path):
            raise SystemExit(f"model not found: {model_path}")
        params = xllamacpp.CommonParams()
        params.model.path = model_path
        params.n_ctx = n_ctx
        params.n_parallel = 1
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        params.warmup = True
        self.model_path = model_path
        self.threads = threads
        self.n_ctx = n_ctx
        self._server = xllamacpp.Server(params)  # keep a reference: dropping it stops the server
        self.base = self._server.listening_address
        if not self.base.startswith("http"):
            self.base = "http://" + self.base

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{path} failed: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from e

    def tokenize(self, text: str) -> list[int]:
        """Token ids as llama.cpp makes them: special tokens parsed, no BOS added."""
        out = self.post("/tokenize", {"content": text, "add_special": False, "parse_special": True})
        return [int(t) for t in out["tokens"]]

    def detokenize(self, ids: list[int]) -> str:
        return self.post("/detokenize", {"tokens": ids})["content"]

    def complete(self, prompt_ids: list[int], n_predict: int, n_probs: int = 0, cache_prompt: bool = True,
                 ignore_eos: bool = False) -> dict:
        """Greedy raw completion of a token-id prompt (no chat template, no BOS)."""
        return self.post(
            "/completion",
            {
                "prompt": prompt_ids,
                "n_predict": n_predict,
                "temperature": 0.0,
                "n_probs": n_probs,
                "cache_prompt": cache_prompt,
                "return_tokens": True,
                "ignore_eos": ignore_eos,
                "stream": False,
            },
        )


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
