"""The graph model: trace a model on meta, fit per-op scaling, expose a networkx DiGraph."""

from autopar.graph.model_graph import ModelGraph, build_graph

__all__ = ["ModelGraph", "build_graph"]
