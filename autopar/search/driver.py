"""One search request from a model file to ranked plans: shared by ``autopar plan`` and ``autopar.plan()``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from autopar.cluster import Cluster
from autopar.cost.compute import measured_table_warning
from autopar.errors import AutoparError, InfeasibleError
from autopar.graph import ModelGraph, build_graph
from autopar.modelfile import ModelFile
from autopar.plan import DTYPE_BYTES, Plan
from autopar.report import gib
from autopar.search.result import candidate_plan
from autopar.search.search import SearchResult, search
from autopar.search.space import SearchSpace


@dataclass(frozen=True, kw_only=True)
class PlanSearch:
    """A finished search: the ranked plans (fastest first) and what they were searched over."""

    result: SearchResult
    plans: tuple[Plan, ...]
    graph: ModelGraph
    cluster: Cluster
    space: SearchSpace
    warning: str | None  # a measured profile that does not apply to this model, or None


SAMPLES_PER_GPU = 32  # a model without SEQ_LEN (images -> classes): ImageNet's 256 images on 8 GPUs


def default_global_batch(num_gpus: int, seq_len: int) -> int:
    """The multiple of ``num_gpus`` closest to 4M tokens per step (at least ``num_gpus``); for a
    model without a sequence (``seq_len`` 1) ``SAMPLES_PER_GPU`` samples per GPU."""
    if seq_len <= 1:
        return SAMPLES_PER_GPU * num_gpus
    target = max(1, round((4 * 2**20) / seq_len))
    return max(num_gpus, round(target / num_gpus) * num_gpus)


def search_plans(
    mf: ModelFile,
    *,
    gpus: int,
    cluster: Cluster,
    cluster_ref: str,
    gpus_per_node: int | None = None,
    global_batch: int | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    seq_len: int | None = None,
    dtype: str = "bf16",
    optimizer: str = "adam",
    top_k: int = 5,
    knobs: Mapping[str, Any] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> PlanSearch:
    """Graph ``mf``, search the space, and return the top ``top_k`` plans as plan files.

    ``cluster_ref`` is what the plans record as ``cluster.profile`` (a name or a path). ``knobs``
    restrict the space (SearchSpace fields). Raises InfeasibleError when no plan fits memory.
    """
    if dtype not in DTYPE_BYTES:
        raise AutoparError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    gpn = gpus_per_node or cluster.gpus_per_node
    if gpn != cluster.gpus_per_node:
        cluster = dataclasses.replace(cluster, gpus_per_node=gpn)
    seq = seq_len or mf.seq_len or 1
    graph = build_graph(mf, seq_len=seq_len, dtype=dtype)
    try:
        space = SearchSpace(num_gpus=gpus, gpus_per_node=min(gpn, gpus),
                            global_batch=global_batch or default_global_batch(gpus, seq), seq_len=seq,
                            micro_batches=tuple(sorted(set(micro_batches))), dtype_bytes=DTYPE_BYTES[dtype],
                            optimizer=optimizer, **dict(knobs or {}))
    except (TypeError, ValueError) as exc:
        raise AutoparError(f"invalid search settings: {exc}") from None
    result = search(graph, cluster, space, top_k=top_k, progress=progress)
    if not result.top:
        raise InfeasibleError(
            f"no plan fits {gib(cluster.memory_bytes)} GiB per GPU on {gpus} GPUs: the smallest plan needs "
            f"{gib(result.min_memory_bytes)} GiB; use more GPUs (--gpus), a larger-memory GPU "
            f"(--cluster h200-141g), or a shorter sequence (--seq-len)"
        )
    plans = tuple(candidate_plan(c, mf, cluster_ref, gpn, dtype=dtype) for c in result.top)
    return PlanSearch(result=result, plans=plans, graph=graph, cluster=cluster, space=space,
                      warning=measured_table_warning(graph, cluster))
