"""One search request from a model file to ranked plans: shared by ``autopar plan``, sweeps,
``autopar estimate``'s ranking and ``autopar.plan()``.

The graph comes from the graph cache (``graph/cache.py``): on a hit this module and everything it
imports run without torch; the model file is imported and traced only on a miss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from autopar.cluster import Cluster, usable_text
from autopar.cost.compute import measured_table_warning
from autopar.errors import AutoparError, InfeasibleError
from autopar.graph.cache import ModelSource, cached_graph
from autopar.graph.model_graph import ModelGraph
from autopar.plan import DTYPE_BYTES, Plan
from autopar.search.hints import infeasible_hint
from autopar.search.result import candidate_plan
from autopar.search.search import SearchResult, search
from autopar.search.space import SearchSpace

# User constraints (``plan --tp 8 ...``, the names plans record under prediction.search.fixed_by_user)
# and the SearchSpace field each narrows; micro_batch narrows ``micro_batches``.
CONSTRAINTS: dict[str, str] = {
    "dp": "dp_degrees", "tp": "tp_degrees", "pp": "pp_degrees", "cp": "cp_degrees", "zero": "zero_stages",
    "recompute": "recompute_modes", "schedule": "schedules", "micro_batch": "micro_batches",
    "cp_kind": "cp_kinds", "sp": "sequence_parallel", "virtual_stages": "virtual_stages",
    "ep": "ep_degrees",  # expert parallelism
    "offload": "offload_modes",  # host offload
}


@dataclass(frozen=True, kw_only=True)
class PlanSearch:
    """A finished search: the ranked plans (fastest first) and what they were searched over."""

    result: SearchResult
    plans: tuple[Plan, ...]
    graph: ModelGraph
    cluster: Cluster
    space: SearchSpace
    warning: str | None  # a measured profile that does not apply to this model, or None
    source: ModelSource | None = None
    fixed: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # constraints the user set


SAMPLES_PER_GPU = 32  # a model without SEQ_LEN (images -> classes): ImageNet's 256 images on 8 GPUs


def default_global_batch(num_gpus: int, seq_len: int) -> int:
    """The multiple of ``num_gpus`` closest to 4M tokens per step (at least ``num_gpus``); for a
    model without a sequence (``seq_len`` 1) ``SAMPLES_PER_GPU`` samples per GPU."""
    if seq_len <= 1:
        return SAMPLES_PER_GPU * num_gpus
    target = max(1, round((4 * 2**20) / seq_len))
    return max(num_gpus, round(target / num_gpus) * num_gpus)


def load_graph(model: Any, *, seq_len: int | None, dtype: str, use_cache: bool = True,
               on_miss: Callable[[], None] | None = None) -> tuple[ModelGraph, ModelSource]:
    """The graph of ``model`` (path or ModelFile) at ``seq_len`` / ``dtype``, through the cache."""
    if dtype not in DTYPE_BYTES:
        raise AutoparError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return cached_graph(model, seq_len=seq_len, dtype=dtype, use_cache=use_cache, on_miss=on_miss)


def build_space(graph: ModelGraph, source: ModelSource, *, gpus: int, gpus_per_node: int,
                global_batch: int | None, micro_batches: Sequence[int], seq_len: int | None, dtype: str,
                optimizer: str, knobs: Mapping[str, Any] | None = None,
                constraints: Mapping[str, Sequence[Any]] | None = None) -> SearchSpace:
    """The SearchSpace of one request; bad settings are an AutoparError naming them."""
    seq = seq_len or source.declared_seq_len or 1
    fields = dict(knobs or {})
    mbs = tuple(sorted(set(micro_batches)))
    for name, values in (constraints or {}).items():
        if name not in CONSTRAINTS:
            raise AutoparError(f"unknown constraint {name!r}; allowed: {', '.join(CONSTRAINTS)}")
        if name == "micro_batch":
            mbs = tuple(sorted(set(values)))
        else:
            fields[CONSTRAINTS[name]] = tuple(values)
    try:
        return SearchSpace(num_gpus=gpus, gpus_per_node=min(gpus_per_node, gpus),
                           global_batch=global_batch or default_global_batch(gpus, seq), seq_len=seq,
                           micro_batches=mbs, dtype_bytes=DTYPE_BYTES[dtype], optimizer=optimizer, **fields)
    except (TypeError, ValueError) as exc:
        raise AutoparError(f"invalid search settings: {exc}") from None


def search_plans(
    model: Any,
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
    constraints: Mapping[str, Sequence[Any]] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    use_cache: bool = True,
    on_miss: Callable[[], None] | None = None,
) -> PlanSearch:
    """Graph ``model`` (a path or a ModelFile), search the space, return the top ``top_k`` plans.

    ``cluster_ref`` is what the plans record as ``cluster.profile`` (a name or a path). ``knobs``
    restrict the space (SearchSpace fields); ``constraints`` (keys of CONSTRAINTS) do too and are
    recorded in each plan as fixed by the user. Raises InfeasibleError when no plan fits memory,
    with a hint naming only the remedies that were checked to fit.
    """
    graph, source = load_graph(model, seq_len=seq_len, dtype=dtype, use_cache=use_cache, on_miss=on_miss)
    gpn = gpus_per_node or cluster.gpus_per_node
    if gpn != cluster.gpus_per_node:
        cluster = dataclasses.replace(cluster, gpus_per_node=gpn)
    fixed = {k: tuple(v) for k, v in (constraints or {}).items()}
    space = build_space(graph, source, gpus=gpus, gpus_per_node=gpn, global_batch=global_batch,
                        micro_batches=micro_batches, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                        knobs=knobs, constraints=fixed)
    if not cluster.has_host and "none" not in space.offload_modes:
        raise AutoparError(f"--offload {','.join(space.offload_modes)} needs the host memory and link figures of a "
                           f"cluster profile's host: section, and {cluster.name} has none: choose a profile with "
                           "one (autopar profiles) or drop --offload")
    result = search(graph, cluster, space, top_k=top_k, progress=progress)
    if not result.top:
        if result.num_configs == 0 or not any(k.startswith("memory") for k in result.rejected):
            # nothing was too large: every configuration was illegal, or dominated by one that is
            # not allowed (a pinned --recompute selective where it saves nothing)
            raise AutoparError(_no_config_message(space, fixed, result))
        from autopar.search.offload_need import needed_text  # with host offload, the host memory too

        raise InfeasibleError(
            f"no plan fits {usable_text(cluster)} per GPU on {gpus} GPUs: the smallest plan needs "
            f"{needed_text(graph, cluster, space, result)}; "
            + infeasible_hint(graph, cluster, space, fixed, user_batch=global_batch is not None)
        )
    plans = tuple(candidate_plan(c, source, cluster_ref, gpn, dtype=dtype, fixed=fixed) for c in result.top)
    return PlanSearch(result=result, plans=plans, graph=graph, cluster=cluster, space=space,
                      warning=measured_table_warning(graph, cluster), source=source, fixed=fixed)


def _no_config_message(space: SearchSpace, fixed: Mapping[str, tuple], result: SearchResult) -> str:
    reasons = "; ".join(f"{why} ({n:,})" for why, n in sorted(result.rejected.items(), key=lambda kv: -kv[1])[:3])
    if fixed:
        what = " ".join(f"--{k.replace('_', '-')} {','.join(map(_flag_value, v))}" for k, v in fixed.items())
        return (f"no legal configuration on {space.num_gpus} GPUs satisfies {what}: {reasons}; "
                "loosen or drop a constraint")
    return f"no legal configuration on {space.num_gpus} GPUs: {reasons}"


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)
