"""Host memory per node and offload traffic of an estimated offload plan.

The pricing is autopar.cost.offload's; this module adds what an estimate of a whole split shows
(``OffloadedEstimate``) and the per-node host-memory constraint: as rows of the split programs
(``host_family``) where a node holds whole pipeline ranks or lies inside one, and in every
case checked again on the split the search picks (``fits``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from autopar.cost.step import Estimate, chunk_rank, evaluate

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.cost.terms import StageTerms


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
    fewest = terms.inflight(cfg.pp - 1)  # every schedule's in-flight count falls with the rank
    total = params * off.host_state_bytes_per_param + num_blocks * fewest * off.host_act_bytes_per_block
    return min(gpus_per_node, cfg.num_gpus) / cfg.pp * total


@dataclass(frozen=True, kw_only=True)
class HostFamily:
    """The per-node host-memory constraints of an offload config as linear rows over the pipeline
    ranks' block counts N_r: for each node group, sum_{r in ranks} coeffs_r N_r <= room_bytes, in
    integers (coefficients rounded up, room down: a split that meets them fits the float check)."""

    groups: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # (ranks, coeffs per rank, room)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("HostFamily: at least one node group")
        for ranks, coeffs, _ in self.groups:
            if len(ranks) != len(coeffs) or any(c < 0 for c in coeffs):
                raise ValueError("HostFamily: one non-negative coefficient per rank of each group")

    @property
    def shared_rows(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]:
        """The rows over several ranks (a node holding GPUs of several pipeline ranks); a one-rank
        row is a cap on its rank (``rank_caps``)."""
        return tuple(row for row in self.groups if len(row[0]) > 1)

    def rank_caps(self, num_ranks: int, least_blocks: int) -> list[int]:
        """Each rank's most blocks under its group's row when every other rank of the group holds
        ``least_blocks`` (its v chunks): exact for one-rank groups, a relaxation otherwise."""
        caps = [10**9] * num_ranks
        for ranks, coeffs, room in self.groups:
            others = sum(coeffs) * least_blocks
            for r, a in zip(ranks, coeffs):
                left = room - (others - a * least_blocks)
                caps[r] = min(caps[r], left // a if a > 0 else (10**9 if left >= 0 else -1))
        return caps

    @staticmethod
    def row_holds(row: tuple[tuple[int, ...], tuple[int, ...], int], rank_blocks: Sequence[int]) -> bool:
        ranks, coeffs, room = row
        return sum(a * rank_blocks[r] for r, a in zip(ranks, coeffs)) <= room

    def holds(self, rank_blocks: Sequence[int]) -> bool:
        return all(self.row_holds(row, rank_blocks) for row in self.groups)


def host_family(terms: "StageTerms", gpus_per_node: int) -> HostFamily | None:
    """The host rows of ``terms``: None without offload, and for a node layout neither closed form
    of ``host_per_node`` covers (then only the estimate's check applies). A rank's host bytes are
    h_s P_r + I_r N_r h_a (``host_memory_by_rank``), P_r = pi N_r + p_r; a node holds g GPUs of one
    pipeline rank (g <= dp cp tp), or dp cp tp GPUs of each of k = g / (dp cp tp) consecutive ranks."""
    off, cfg = terms.offload, terms.config
    if off is None:
        return None
    inner = cfg.dp * cfg.cp * cfg.tp
    g = min(gpus_per_node, cfg.num_gpus)
    if inner % g == 0:
        k, per_gpu = 1, g
    elif g % inner == 0 and cfg.pp % (g // inner) == 0:
        k, per_gpu = g // inner, inner
    else:
        return None
    last = chunk_rank(cfg.pp * cfg.virtual_stages - 1, cfg.pp)
    t, h_s, h_a = terms, off.host_state_bytes_per_param, off.host_act_bytes_per_block
    groups = []
    for first in range(0, cfg.pp, k):
        ranks = tuple(range(first, first + k))
        coeffs, fixed = [], 0.0
        for r in ranks:
            coeffs.append(math.ceil(per_gpu * (h_s * t.block.params + t.inflight(r) * h_a)))
            fixed_p = (t.pre.params if r == 0 else 0.0) + (t.post.params + t.tied_params if r == last else 0.0)
            fixed += per_gpu * h_s * fixed_p
        groups.append((ranks, tuple(coeffs), math.floor(off.host_memory_bytes_per_node - fixed)))
    return HostFamily(groups=tuple(groups))


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
