"""The graph model: trace a model on meta, fit per-op scaling, expose a networkx DiGraph.

``ModelGraph`` is plain data (no torch); ``build_graph`` measures one and is imported lazily, so
code that only reads graphs never imports torch.
"""

from __future__ import annotations

from typing import Any

from autopar.graph.model_graph import ModelGraph

__all__ = ["ModelGraph", "build_graph"]


def __getattr__(name: str) -> Any:
    if name == "build_graph":
        from autopar.graph.measure import build_graph

        return build_graph
    raise AttributeError(f"module 'autopar.graph' has no attribute {name!r}")
