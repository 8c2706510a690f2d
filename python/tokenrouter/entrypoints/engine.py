"""``from tokenrouter.entrypoints.engine import TokenRoutingEngine``, as in the research system."""

from ..engine import TokenRoutingEngine

__all__ = ["TokenRoutingEngine"]
