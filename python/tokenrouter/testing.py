"""A tiny synthetic model pair for trying the engine and for tests: random weights, one
shared tokenizer, no download. Its text is gibberish; its routing, batching and provenance
are real."""

import os
from typing import Union

from . import _native


def tiny_pair(directory: Union[str, "os.PathLike[str]"], p: float = 0.5, seed: int = 0) -> str:
    """Writes the pair and a config routing each token to the large model with probability
    ``p`` (seeded) under ``directory``; returns the config's path."""
    os.makedirs(directory, exist_ok=True)
    return _native.write_tiny_pair(os.fspath(directory), p, seed)
