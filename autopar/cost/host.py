"""Host memory per node and offload traffic of an estimated offload plan (issue 14).

The pricing is autopar.cost.offload's; this module adds what an estimate of a whole split shows
(``OffloadedEstimate``) and the per-node host-memory constraint, which the search checks on the split
the ILP picks (``fits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from autopar.cost.step import Estimate, evaluate

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.cost.stage import StageTerms


@dataclass(frozen=True, kw_only=True)
class OffloadedEstimate(Estimate):
    """An Estimate of an offload plan: GPU figures as before, plus host memory and offload traffic.
    ``fits`` also requires host memory per node within the profile's."""

    host: dict[str, Any]

    @property
    def fits(self) -> bool:
        return super().fits and self.host["host_memory_bytes"] <= self.host["host_capacity_bytes"]


def host_memory_by_rank(terms: "StageTerms", est: Estimate) -> list[float]:
    """Host bytes each pipeline rank's GPUs keep (model states + offloaded activations)."""
    off = terms.offload
    return [rk.params * off.host_state_bytes_per_param
            + terms.inflight(rk.rank) * rk.num_blocks * off.host_act_bytes_per_block for rk in est.ranks]


def host_per_node(terms: "StageTerms", per_pp_rank: Sequence[float], gpus_per_node: int) -> float:
    """The largest sum over one node's GPUs of ``per_pp_rank`` (ranks laid out [pp, dp, cp, tp]):
    a node holds gpus_per_node consecutive ranks, rank // (dp cp tp) being its pipeline rank."""
    cfg = terms.config
    inner = cfg.dp * cfg.cp * cfg.tp
    g = min(gpus_per_node, cfg.num_gpus)
    # The two layouts of power-of-two degrees, in closed form (the loop below visits every node:
    # 8,192 of them at 65,536 GPUs): a pipeline rank spans whole nodes, or a node holds whole ones.
    if inner % g == 0:
        return g * max(per_pp_rank)
    if g % inner == 0 and cfg.pp % (g // inner) == 0:
        k = g // inner
        return inner * max(sum(per_pp_rank[i:i + k]) for i in range(0, cfg.pp, k))
    worst = 0.0
    for first in range(0, cfg.num_gpus, g):
        # The pipeline ranks this node's GPUs belong to, and how many GPUs of each.
        total, r = 0.0, first
        while r < first + g:
            pp_rank = r // inner
            upto = min(first + g, (pp_rank + 1) * inner)
            total += (upto - r) * per_pp_rank[pp_rank]
            r = upto
        worst = max(worst, total)
        if inner % g == 0 and len(set(per_pp_rank)) == 1:
            break  # every node alike
    return worst


def host_lower_bound(terms: "StageTerms", num_blocks: int, gpus_per_node: int) -> float:
    """A lower bound on the fullest node's host bytes over every split: the average node's share,
    g / pp * sum_r host_r, with each rank's in-flight count at least the fewest any rank holds."""
    off, cfg = terms.offload, terms.config
    if off is None:
        return 0.0
    params = num_blocks * terms.block.params + terms.pre.params + terms.post.params
    fewest = min(terms.inflight(r) for r in range(cfg.pp))
    total = params * off.host_state_bytes_per_param + num_blocks * fewest * off.host_act_bytes_per_block
    return min(gpus_per_node, cfg.num_gpus) / cfg.pp * total


def with_host(terms: "StageTerms", est: Estimate, gpus_per_node: int) -> Estimate:
    """``est`` with host memory and offload traffic attached (unchanged without offload)."""
    off = terms.offload
    if off is None:
        return est
    cfg = terms.config
    per_rank = host_memory_by_rank(terms, est)
    m = cfg.num_microbatches
    traffic = [rk.params * (off.step_copy_bytes_per_param + m * off.microbatch_copy_bytes_per_param)
               + 2 * m * rk.num_blocks * off.host_act_bytes_per_block for rk in est.ranks]
    busiest = max(range(len(est.ranks)), key=lambda r: est.ranks[r].params)
    host = {
        "offload": off.label,
        "host_memory_bytes": host_per_node(terms, per_rank, gpus_per_node),  # the fullest node
        "host_capacity_bytes": off.host_memory_bytes_per_node,
        "host_memory_bytes_per_gpu": max(per_rank),
        "offload_traffic_bytes_per_gpu": max(traffic),  # both directions, one step
        "offload_copy_s": max(traffic) / off.link_bandwidth_bytes_per_s,
        "cpu_optimizer_s": est.ranks[busiest].params * off.cpu_step_s_per_param,
    }
    fields = {f: getattr(est, f) for f in Estimate.__dataclass_fields__}
    return OffloadedEstimate(**fields, host=host)


def evaluate_with_host(terms: "StageTerms", chunk_blocks: Sequence[int], model_flops_per_step: float,
                       tokens_per_step: float, cluster: "Cluster",
                       recompute_blocks: Sequence[Sequence[int]] | None = None) -> Estimate:
    """``cost.step.evaluate`` plus the host figures of an offload configuration."""
    est = evaluate(terms, chunk_blocks, model_flops_per_step, tokens_per_step, cluster.peak_flops,
                   recompute_blocks=recompute_blocks)
    return with_host(terms, est, cluster.gpus_per_node)
