"""Fixtures: the tiny synthetic pair (random weights, no download) and engines over it."""

import pytest

from tokenrouter import TokenRoutingEngine
from tokenrouter.testing import tiny_pair


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("tiny"), p=0.5, seed=0)


@pytest.fixture(scope="session")
def engine(tiny_config):
    with TokenRoutingEngine(tiny_config) as e:
        yield e


def wait_idle(engine, timeout_s=10.0):
    """Polls until no request is inside the engine and no KV block is in use; returns the
    last stats (the engine frees an aborted request within a step)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats["active_requests"] == 0 and not any(stats["kv_blocks_used"].values()):
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
