"""What to tell a user whose request no plan fits: only remedies checked, by the cost model, to fit.

Each candidate remedy is evaluated with ``search.smallest_memory`` (the least peak memory of any
legal configuration at its most frugal settings): dropping the user's constraints, more GPUs (the
power-of-two multiples around the memory ratio: the first that fits is named), a profile with more
memory per GPU (among those ``autopar profiles`` lists), a shorter sequence (sequence models). A
remedy whose frugal plan does not fit is not named.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from autopar.cluster import Cluster
from autopar.graph.model_graph import ModelGraph
from autopar.search.search import smallest_memory
from autopar.search.space import SearchSpace

_UNCONSTRAINED = {f.name: f.default for f in dataclasses.fields(SearchSpace)
                  if f.name in ("dp_degrees", "tp_degrees", "pp_degrees", "cp_degrees", "zero_stages",
                                "recompute_modes", "schedules", "cp_kinds", "sequence_parallel", "virtual_stages")}


def _fits(graph: ModelGraph, cluster: Cluster, space: SearchSpace) -> bool:
    need, cfg = smallest_memory(graph, cluster, space)
    return cfg is not None and need <= cluster.usable_memory_bytes


def infeasible_hint(graph: ModelGraph, cluster: Cluster, space: SearchSpace, fixed: Mapping[str, Any],
                    *, user_batch: bool) -> str:
    """One clause for the "no plan fits" error: the remedies that would fit, or why there are none."""
    remedies: list[str] = []
    if fixed:
        free = dataclasses.replace(space, micro_batches=(1, 2, 4, 8) if "micro_batch" in fixed else space.micro_batches,
                                   **_UNCONSTRAINED)
        if _fits(graph, cluster, free):
            remedies.append("drop the constraints (" + ", ".join(f"--{k.replace('_', '-')}" for k in fixed) + ")")
    # Memory per GPU falls about as 1/N: start at the power-of-two multiple that ratio asks for and
    # double (at most three checks, at most 65,536 GPUs).
    need, _ = smallest_memory(graph, cluster, space)
    ratio = need / cluster.usable_memory_bytes if math.isfinite(need) else 2.0
    first = 2 ** max(1, math.ceil(math.log2(max(ratio, 1.0))))
    for factor in ((first // 2,) if first >= 4 else ()) + (first, first * 2, first * 4):
        n = space.num_gpus * factor
        if n > 65536:
            break
        batch = space.global_batch if user_batch else max(space.global_batch, n)
        if batch % n and not user_batch:
            batch = (batch // n + 1) * n
        more = dataclasses.replace(space, num_gpus=n, global_batch=batch)
        if _fits(graph, cluster, more):
            remedies.append(f"more GPUs (--gpus {n})")
            break
    bigger = _larger_memory_profile(graph, cluster, space)
    if bigger:
        remedies.append(f"a larger-memory GPU (--cluster {bigger})")
    if graph.is_sequence_model:
        seq = space.seq_len
        for _ in range(4):
            if seq % 2:
                break
            seq //= 2
            if _fits(graph, cluster, dataclasses.replace(space, seq_len=seq)):
                remedies.append(f"a shorter sequence (--seq-len {seq})")
                break
    if not remedies:
        return ("no single change autopar checked fits either (more GPUs, a larger-memory profile, "
                "a shorter sequence); combine them or shrink the model")
    return "these would fit: " + "; or ".join(remedies)


def _larger_memory_profile(graph: ModelGraph, cluster: Cluster, space: SearchSpace) -> str | None:
    """The listed profile with the least memory above ``cluster``'s (and at least a quarter of its
    FLOP/s) on which some plan fits."""
    from autopar.cluster import list_profiles, load_cluster

    options = []
    for name, path in list_profiles().items():
        try:
            other = load_cluster(str(path))
        except Exception:  # noqa: BLE001 - a broken local profile must not hide the error being reported
            continue
        # A device four times slower (a measured CPU profile) is no remedy anyone wants.
        if (other.memory_bytes > cluster.memory_bytes and other.gpus_per_node >= space.gpus_per_node
                and other.peak_flops >= cluster.peak_flops / 4):
            options.append((other.memory_bytes, name, other))
    for _, name, other in sorted(options, key=lambda o: (o[0], o[1])):
        if _fits(graph, other, space):
            return name
    return None
