"""What the "no plan fits" message says about host offload: the memory the smallest plan
needs without offload, and with it the host memory per node a plan that fits the GPUs would need
(or, if none fits the GPUs even with offload, the smallest such plan's GPU and host memory).

Each figure is a plan at its most frugal settings (most sharded ZeRO, smallest micro-batch, 1F1B,
even split), the way ``search.smallest_memory`` finds the GPU minimum.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from autopar.cluster import Cluster
from autopar.cost.host import evaluate_with_host
from autopar.cost.stage import Config, build_terms
from autopar.graph.model_graph import ModelGraph
from autopar.plan import even_stage_ranges
from autopar.search.candidates import SearchResult
from autopar.search.search import smallest_memory
from autopar.search.space import SearchSpace, enumerate_configs

GIB = 2**30


def _shape(cfg: Config) -> str:
    return f"offload {cfg.offload.label}, dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} x cp {cfg.cp}, zero {cfg.zero}"


def _host_of(graph: ModelGraph, cluster: Cluster, cfg: Config) -> tuple[float, float]:
    """(GPU peak, host bytes of the fullest node) of ``cfg`` with an even split."""
    terms = build_terms(graph, cluster, cfg)
    even = [e - s for s, e in even_stage_ranges(graph.num_blocks, cfg.pp)]
    est = evaluate_with_host(terms, even, 0.0, 1.0, cluster)
    return est.peak_memory_bytes, est.host["host_memory_bytes"]  # type: ignore[attr-defined]


def least_host_that_fits(graph: ModelGraph, cluster: Cluster, space: SearchSpace) -> tuple[float, Config | None]:
    """The least host memory per node of an offload plan whose GPU memory fits (frugal settings)."""
    zero, mb = max(space.zero_stages), min(space.micro_batches)
    best: tuple[float, Config | None] = (math.inf, None)
    for cfg in enumerate_configs(graph, space, Counter()):
        if not cfg.offload.any or cfg.micro_batch != mb or cfg.recompute not in ("none", "full"):
            continue
        if cfg.virtual_stages != 1 and space.allows("virtual_stages", 1) or cfg.schedule == "gpipe" and "1f1b" in space.schedules:
            continue
        if cfg.zero != (zero if cfg.dp * cfg.cp > 1 else 0):
            continue
        peak, host = _host_of(graph, cluster, cfg)
        if peak <= cluster.usable_memory_bytes and host < best[0]:
            best = (host, cfg)
    return best


def needed_text(graph: ModelGraph, cluster: Cluster, space: SearchSpace, result: SearchResult) -> str:
    """``329.6 GiB`` -- or, where offload was searched, what it would take with it (module docstring)."""
    if not cluster.has_host or set(space.offload_modes) == {"none"} or graph.chain:
        return f"{result.min_memory_bytes / GIB:,.1f} GiB"
    text = []
    if "none" in space.offload_modes:
        plain, _ = smallest_memory(graph, cluster, dataclasses.replace(space, offload_modes=("none",)))
        text.append(f"{plain / GIB:,.1f} GiB without offload")
    host, cfg = least_host_that_fits(graph, cluster, space)
    if cfg is not None:
        text.append(f"with offload it fits the GPUs but needs {host / GIB:,.1f} GiB of host memory per node, "
                    f"more than the {cluster.host_memory_bytes_per_node / GIB:,.1f} GiB there ({_shape(cfg)})")
    elif result.min_memory_config is not None and result.min_memory_config.offload.any:
        # (the smallest configuration may hold no offload at all: offload refused with ep, say)
        peak, host = _host_of(graph, cluster, result.min_memory_config)
        text.append(f"with offload {peak / GIB:,.1f} GiB per GPU and {host / GIB:,.1f} GiB of host memory per node "
                    f"({_shape(result.min_memory_config)})")
    return "; ".join(text)
