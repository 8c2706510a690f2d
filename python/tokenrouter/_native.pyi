"""Type stubs of the native module (Rust, PyO3)."""

from typing import Dict, List, Optional, Tuple

__version__: str

class EngineError(RuntimeError):
    """The engine failed: a model did not load, went down, or refused the request for load."""

class Stream:
    request_id: int
    prompt_tokens: int
    max_new_tokens: int
    return_logprob: bool
    cached_tokens: int
    input_token_logprobs: Optional[List[Tuple[Optional[float], int]]]
    input_top_logprobs: Optional[List[Optional[List[Tuple[float, int]]]]]
    @property
    def running(self) -> bool: ...
    def next_chunk(self) -> Optional[Dict[str, object]]:
        """Next chunk (text, token_ids, sources, logprobs, finish_reason) or None when done."""
    def close(self) -> None:
        """Aborts the request if it is still running; its KV is freed."""

class Engine:
    def __init__(self, config_text: Optional[str], origin: str, timeout_s: float = 3600.0) -> None: ...
    def model_names(self) -> List[str]: ...
    @property
    def context_length(self) -> int: ...
    @property
    def ready(self) -> bool: ...
    def encode(self, text: str) -> List[int]: ...
    def decode(self, ids: List[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages_json: str, add_generation_prompt: bool, kwargs_json: str) -> str: ...
    def submit(self, prompts: List[List[int]], params_json: str, model: Optional[str] = None) -> List[Stream]: ...
    def stats(self) -> Tuple[int, List[int]]: ...
    def metrics_text(self) -> str: ...
    def flush_cache(self) -> None: ...
    def shutdown(self) -> None: ...

def run_cli(argv: List[str]) -> int:
    """Runs the tokenrouter command line (argv[0] is the program name); returns the exit code."""

def write_tiny_pair(dir: str, p: float = 0.5, seed: int = 0) -> str:
    """Writes the tiny synthetic pair and its config under dir; returns the config path."""
