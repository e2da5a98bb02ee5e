"""The cost of expert parallelism (plan ``parallel.ep``), as executor/parallel/expert_parallel.py runs it.

FLOPs. The graph already counts each block's experts at the expected tokens per expert (tokens x
top_k / E, balanced routing; autopar.spec.meta), so a block's FLOPs per token are the attention's
plus top_k experts' plus the router's: the "top-k dense equivalent" (Mixtral-8x7B: two 14336-wide
SwiGLU MLPs per token, not eight). ep does not change a rank's expert FLOPs under balanced routing:
each rank runs E/ep experts on the tokens of ep ranks, tokens x top_k rows in all.

Expert GEMM shapes. It does change their shapes: each of the rank's E/ep experts gets ep times the
rows (the tokens of ep ranks), so an expert GEMM whose row count is the tokens per expert -- one
Linear per expert (a ModuleList MoE), or the weight-gradient GEMMs of a grouped kernel, batched
over the E experts with those rows as their reduction dimension (HF Mixtral's ``grouped_mm``) --
runs as E/ep GEMMs of ep times the rows. ``expert_gemm_delta_s`` re-prices those GEMMs of the
traced block at that shape (autopar.cost.compute's GEMM efficiency; fewer, larger kernels), which
matters where the tokens per expert are few (small micro-batches). A grouped forward GEMM over
all of a rank's rows (tokens x top_k, any split among experts) keeps its shape.

Expert weights. The work of a block that grows with neither the micro-batch nor the sequence --
autocast's casts of the weights, the weight gradients' casts and their accumulation, memory ops
over whole parameters -- is proportional to the parameters a rank holds; under ep it holds E / ep
of the experts, so the experts' share of that work (their share of the block's parameters) shrinks
by (1 - 1 / ep) (``expert_weight_work_delta_s``). With 256 stacked experts (DeepSeek-V3) it is the
larger part of a small micro-batch's backward.

Imbalance. Routing is never balanced; with ep > 1 the step waits for the rank whose experts got the
most tokens. ``imbalance`` f >= 1 (``autopar plan --moe-imbalance F``; default 1.0, balanced) is
the busiest rank's load over the mean: its expert GEMMs take f times the balanced time (the extra
(f - 1) x expert share of the block's compute is added to forward and backward) and it receives f
times the mean all-to-all volume. At ep = 1 every rank computes its own tokens' experts, so f
costs nothing there.

All-to-all. Per MoE block and micro-batch a rank sends its tokens x top_k rows of the block's width
(``dispatch``) and receives as many back (``combine``); backward does both again. Each is an
all-to-all over the ep group: ep ranks at stride tp in the ``[pp, dp, cp, tp]`` order (ep
innermost of dp x cp; the ``ep`` and ``edp`` axes of autopar.layout, which owns their sizes,
strides and rules), so on NVLink while tp x ep fits a node and on the network beyond. Under
sequence parallelism the MoE layers run on each tp rank's sequence shard (Megatron-Core's MoE
parallel folding): a rank routes 1/tp of the tokens, and the ep ranks are drawn from dp x cp x tp,
tp ranks first (stride 1); the experts' compute on the shard is the traced block's replicated work,
which the block's shape already divides by tp.
They are on the critical path (the experts wait for their tokens), so they are priced exposed.

Memory and gradients. A rank holds E / ep experts of every block; their states shard over the
dp x cp / ep ranks that share them (ZeRO), so their bytes per parameter are ``zero.rank_state_bytes``
at that shard degree. The stage model has one parameter count per block, so the experts enter it as
the dense-equivalent count that gives exactly their bytes (``ExpertCost.block_params``); where the
gradient reduction of the expert parameters over their edp group is slower than the dense rate that
count is charged (a smaller group spread over more nodes), the difference is added, exposed, to the
block's backward (never less: an upper estimate). ZeRO-2/3's per-micro-batch gathers and
reduce-scatters move the block's dense parameters over dp x cp and its E / ep experts over edp.

The stage model (autopar.cost.stage) prices a block as if it were dense; ``adjust_terms`` is where
expert parallelism changes those block terms, the way other dimensions adjust the base terms.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.compute import is_core, is_parameter_sized, op_time_s
from autopar.cost.expert_gemms import experts_tp_sharded, grouped_rows_axis, token_axis
from autopar.cost.framework import per_microbatch_s
from autopar.cost.fused_elementwise import block_traffic
from autopar.cost.fused_moe import SORT_KERNELS, sort_bytes_per_token
from autopar.cost.zero import per_microbatch_exposed, per_step_sync, rank_state_bytes
from autopar.errors import PlanError
from autopar.layout import Layout, ep_reason, moe_pool

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.cost.comm import GroupLink
    from autopar.cost.terms import Config, Part
    from autopar.graph.model_graph import ModelGraph
    from autopar.graph.scaling import FitOp, Shape

DEFAULT_IMBALANCE = 1.0
DISPATCH_COMBINE_PER_PASS = 2  # dispatch + combine, in forward and again in backward


def check_imbalance(imbalance: float) -> None:
    if not (isinstance(imbalance, (int, float)) and 1.0 <= float(imbalance) <= 64.0):
        raise PlanError(f"the MoE imbalance factor must be a number in [1, 64] (1 = balanced routing), got {imbalance!r}")


def check_ep(graph: "ModelGraph", ep: int, layout: Layout) -> str | None:
    """Why ``ep`` is not legal for ``graph`` under ``layout``'s degrees (None: it is)."""
    if ep == 1:
        return None
    reason = graph.supports("ep")  # what the model must have (autopar.spec.support.ep_support)
    if reason:
        return f"{graph.name}: {reason}"
    if graph.moe is None:  # a graph measured without the ep predicate (older cache)
        return f"ep = {ep} needs a mixture-of-experts model; {graph.name} has no experts in its blocks"
    pool = moe_pool(layout.dp, layout.cp, layout.tp, layout.folds_tp)
    return ep_reason(ep, pool, graph.moe.num_experts, folds_tp=layout.folds_tp)  # the degree's rules: autopar.layout


def expert_flops_per_token(graph: "ModelGraph") -> float:
    """Forward FLOPs of one block's experts for one token: top_k experts' GEMMs (2 per weight)."""
    moe = graph.moe
    return 0.0 if moe is None else 2.0 * moe.top_k * moe.params_per_expert


def _on_shard(op: "FitOp", axis: int, sp: float) -> "FitOp":
    """Expert GEMM ``op`` on a tp rank's sequence shard (1/sp of its token rows)."""
    dims = list(op.dims)
    dims[axis] = max(1, round(dims[axis] / sp))
    return replace(op, dims=tuple(dims), flops=op.flops / sp)


def expert_gemm_delta_s(graph: "ModelGraph", cluster: "Cluster", shape: "Shape", ep: int,
                        region: str = "block", sp: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds by which one rank's expert GEMMs of one block (the fitted
    ``region``: "block", or a chain unit's), per micro-batch at ``shape``, run faster (negative) or
    slower under ep than as traced (module docstring). ``sp`` > 1: the MoE layer runs on a tp rank's
    sequence shard (sequence parallelism, autopar.layout's ``folds_tp``), so its expert GEMMs get
    1/sp of the rows -- which a GEMM's price, evaluated at the gathered sequence the TP region's
    GEMMs see, does not divide by itself."""
    moe = graph.moe
    if (ep == 1 and sp == 1.0) or moe is None or region not in graph.regions:
        return 0.0, 0.0
    per_expert = graph.seq_len * moe.top_k / moe.num_experts
    if per_expert >= graph.seq_len:  # no dimension tells one expert's tokens from a sequence's
        return 0.0, 0.0
    delta = {"fwd": 0.0, "bwd": 0.0}
    for op in graph.regions[region].ops:
        axis = token_axis(op, per_expert)
        rows = axis if axis is not None else grouped_rows_axis(op) if sp > 1.0 else None
        if rows is None:
            continue
        now, _ = op_time_s(op, shape, cluster, graph.seq_len)
        shard = _on_shard(op, rows, sp) if sp > 1.0 else op
        if axis is None or ep == 1:  # a grouped GEMM over all the rank's rows: its shard's shape only
            then, _ = op_time_s(shard, shape, cluster, graph.seq_len)
            delta[op.phase] += then - now
            continue
        op = shard
        dims = list(op.dims)
        dims[axis] *= ep
        batched = dims[0] == moe.num_experts and abs(op.dims_exps[0].b) < 0.25 and abs(op.dims_exps[0].s) < 0.25
        if batched:  # one GEMM batched over the E experts: E / ep of them, ep times the rows each
            dims[0] //= ep
            bigger, share = replace(op, dims=tuple(dims)), 1.0
        else:  # one GEMM per expert: the rank runs E / ep of the E, each on ep times the rows
            bigger, share = replace(op, dims=tuple(dims), flops=op.flops * ep), 1.0 / ep
        then, _ = op_time_s(bigger, shape, cluster, graph.seq_len)
        delta[op.phase] += share * then - now
    return delta["fwd"], delta["bwd"]


def expert_weight_work_delta_s(graph: "ModelGraph", cluster: "Cluster", shape: "Shape", ep: int, expert_share: float,
                               region: str = "block") -> tuple[float, float]:
    """(forward, backward) seconds (<= 0) by which one rank's token-independent work of one block
    shrinks under ep, per micro-batch at ``shape`` (module docstring): the memory ops whose bytes
    grow with neither the micro-batch nor the sequence -- autocast's weight casts, the weight
    gradients' casts and their accumulation -- are proportional to the parameters the rank holds,
    and it holds E / ep of the experts. ``expert_share``: the experts' share of the block's
    parameters on one rank at ep = 1."""
    if ep == 1 or expert_share <= 0.0 or region not in graph.regions:
        return 0.0, 0.0
    ops = graph.regions[region].ops
    # each op priced as the region's time prices it (cost.compute._region_time): software that
    # accumulates weight gradients inside the GEMM has no such copies, and fused element-wise
    # kernels replace the eager ones -- what the block was not charged cannot shrink
    sequence_model = any(op.bytes_exps.s > 0.5 for op in ops)
    fused = region == "block" and cluster.fused_elementwise and block_traffic(graph) is not None
    delta = {"fwd": 0.0, "bwd": 0.0}
    for op in ops:
        if op.kind != "mem" or abs(op.bytes_exps.b) > 0.25 or abs(op.bytes_exps.s) > 0.25 or is_core(op):
            continue
        parameter_sized = is_parameter_sized(op, sequence_model)
        if fused and not parameter_sized:
            continue
        now, _ = op_time_s(op, shape, cluster, graph.seq_len, parameter_sized)
        delta[op.phase] -= now * expert_share * (1.0 - 1.0 / ep)
    return delta["fwd"], delta["bwd"]


def expert_sort_s(graph: "ModelGraph", cluster: "Cluster", shape: "Shape", ep: int, sp: float,
                  imbalance: float) -> float:
    """Seconds of one pass (forward or backward) of the all-to-all dispatcher's chunk sorts on one
    rank, per block and micro-batch at ``shape``, where the software fuses the MoE layer's
    element-wise work (``fused_elementwise``: Megatron-Core's dispatcher, autopar.cost.fused_moe):
    with more than one local expert the rows it receives are sorted by expert before the experts
    and restored after them -- work a one-rank trace does not show. The busiest rank receives
    ``imbalance`` times the rows; ``sp`` > 1: it routes its sequence shard."""
    per_token = sort_bytes_per_token(graph, ep)
    if not cluster.fused_elementwise or per_token == 0.0 or block_traffic(graph) is None:
        return 0.0
    tokens = shape.b * shape.s_ratio * graph.seq_len / sp
    bw = cluster.memory_bandwidth_bytes_per_s * cluster.memory_efficiency
    return tokens * per_token * imbalance / bw + SORT_KERNELS * cluster.kernel_overhead_s


@dataclass(frozen=True, kw_only=True)
class ExpertCost:
    """Expert-parallel terms of one block on one rank, per micro-batch (seconds, bytes)."""

    ep: int
    imbalance: float
    link: str  # "nvlink" | "network": where the ep group's all-to-all runs
    a2a_bytes: float  # what one rank sends in one all-to-all (dispatch or combine), busiest rank
    a2a_fwd_s: float  # dispatch + combine in forward
    a2a_bwd_s: float  # their two reverses in backward
    imbalance_fwd_s: float  # the busiest rank's extra expert compute
    imbalance_bwd_s: float
    gemm_fwd_s: float  # the expert GEMMs at their ep shape minus as traced (expert_gemm_delta_s)
    gemm_bwd_s: float
    weights_fwd_s: float  # the token-independent work of the E - E / ep experts not held (<= 0;
    weights_bwd_s: float  # expert_weight_work_delta_s)
    sort_fwd_s: float = 0.0  # Megatron's dispatcher sorting the received rows by local expert and back
    sort_bwd_s: float = 0.0  # (expert_sort_s)
    expert_params: float  # expert parameters of one block on this rank (E / ep experts, / tp when TP shards them)
    all_expert_params: float  # the same at ep = 1 (all E experts)
    dense_params: float  # the block's other parameters on this rank
    block_params: float  # the dense-equivalent parameter count of the block (module docstring)
    grad_sync_extra_s: float  # per block per micro-batch, exposed (module docstring)
    state_split: dict[str, float]  # the experts' params / grads / optimizer bytes per parameter

    def state_delta_bytes(self, kind: str, dense_split: dict[str, float]) -> float:
        """What one block's experts hold of state ``kind`` beyond the dense-equivalent count priced
        at the dense ``dense_split`` (``block_params``: the same total, each expert byte under its
        own kind)."""
        return self.expert_params * self.state_split[kind] - (self.block_params - self.dense_params) * dense_split[kind]


def grads_share(graph: "ModelGraph", cfg: "Config", block_params: float) -> float:
    """Of a block's parameter gradients (``block_params`` on this rank at ep = 1), the share a rank
    makes under expert parallelism: its dense ones and those of its E / ep experts (1 at ep = 1 or
    without experts). FSDP2 holds them in the block's backward until its post-backward
    (cost.stage.region_peak_bytes picks the backward's peak op at this share)."""
    if cfg.ep == 1 or graph.moe is None or block_params <= 0:
        return 1.0
    all_experts = min(block_params, graph.moe.expert_params / (cfg.tp if experts_tp_sharded(graph) else 1))
    return (block_params - all_experts * (1.0 - 1.0 / cfg.ep)) / block_params


def expert_cost(graph: "ModelGraph", cluster: "Cluster", cfg: "Config", *, dense_state_bytes: float,
                dense_sync_s_per_param: float, tokens_bytes: float, block_fwd_s: float, block_bwd_s: float,
                block_params: float, shape: "Shape | None" = None, region: str = "block") -> ExpertCost | None:
    """The terms of ``cfg`` (``cfg.ep`` > 1 on an MoE graph; None otherwise). ``tokens_bytes``: one
    rank's block input per micro-batch; ``block_*``: the block's balanced compute and parameters;
    ``shape``: the block's (autopar.cost.stage), for the expert GEMMs' ep shapes (None: as traced);
    ``region``: the fitted region of the block ("block", or a chain unit's: cost/chain.py)."""
    ep, moe = cfg.ep, graph.moe
    if ep == 1 or moe is None:
        return None
    f = cfg.moe_imbalance
    layout = Layout.of(cfg)
    link = axis_link(cluster, layout, "ep")
    # under SP (folded) a rank routes its sequence shard: 1/tp of the block input; grouped stacks
    # (JetMoE's up and down projections) each send their rows and get their results back
    a2a_bytes = tokens_bytes / (cfg.tp if layout.folds_tp else 1) * moe.top_k * f * moe.exchange_factor
    # collective_time_s takes the full message: ep ranks' shares of what one rank sends
    one = collective_time_s("all_to_all", a2a_bytes, link)
    a2a_fwd = DISPATCH_COMBINE_PER_PASS * one
    block_flops = sum(op.flops for op in graph.regions[region].ops if op.phase == "fwd")
    tokens = graph.seq_len  # the graph's block FLOPs are of one sample at seq_len tokens
    share = min(1.0, expert_flops_per_token(graph) * tokens / block_flops) if block_flops else 0.0
    # a rank's share of all E experts: 1/tp where the TP plan shards them (expert tensor parallelism)
    all_experts = moe.expert_params / (cfg.tp if experts_tp_sharded(graph) else 1)
    experts = all_experts / ep
    dense = max(0.0, block_params - all_experts)
    edp = layout.size("edp")
    # the experts' states, sharded over their edp ranks (DDP skips them: no bucket)
    state = rank_state_bytes(cfg, cluster, shard_degree=edp, ddp_buckets=False)
    equivalent = dense + experts * state.total / dense_state_bytes
    edp_link = axis_link(cluster, layout, "edp")
    edp_sync, _, _ = per_step_sync(cfg, edp_link, cluster)
    sp = float(cfg.tp) if layout.folds_tp else 1.0  # the MoE layer on a sequence shard
    gemm_fwd, gemm_bwd = expert_gemm_delta_s(graph, cluster, shape, ep, region, sp) if shape is not None else (0.0, 0.0)
    weights_fwd, weights_bwd = (expert_weight_work_delta_s(graph, cluster, shape, ep, min(1.0, all_experts / block_params),
                                                           region) if shape is not None and block_params else (0.0, 0.0))
    extra = max(0.0, experts * edp_sync - (equivalent - dense) * dense_sync_s_per_param) / cfg.num_microbatches
    sort = expert_sort_s(graph, cluster, shape, ep, sp, f) if shape is not None and region == "block" else 0.0
    return ExpertCost(
        ep=ep, imbalance=f, link=link.link_name, a2a_bytes=a2a_bytes, a2a_fwd_s=a2a_fwd, a2a_bwd_s=a2a_fwd,
        imbalance_fwd_s=(f - 1.0) * share * block_fwd_s, imbalance_bwd_s=(f - 1.0) * share * block_bwd_s,
        gemm_fwd_s=gemm_fwd, gemm_bwd_s=gemm_bwd, weights_fwd_s=weights_fwd, weights_bwd_s=weights_bwd,
        sort_fwd_s=sort, sort_bwd_s=sort,
        expert_params=experts, all_expert_params=all_experts, dense_params=dense, block_params=equivalent, grad_sync_extra_s=extra,
        state_split={"params": state.params, "grads": state.grads, "optimizer": state.optimizer},
    )


def zero_exposed_s(cfg: "Config", cluster: "Cluster", cost: ExpertCost, fwd_s: float, bwd_s: float,
                   dpcp_link) -> float:  # noqa: ANN001
    """ZeRO-2/3 per-micro-batch collectives of one block under ep: its dense parameters over the
    dp x cp ranks, its E / ep experts over their dp x cp / ep edp ranks (both prefetched behind the
    block's compute, as autopar.cost.zero prices them)."""
    edp_link = axis_link(cluster, Layout.of(cfg), "edp")
    return (per_microbatch_exposed(cfg, cost.dense_params, fwd_s, bwd_s, dpcp_link, cluster)
            + per_microbatch_exposed(cfg, cost.expert_params, fwd_s, bwd_s, edp_link, cluster))


@dataclass(frozen=True, kw_only=True)
class ExpertTerms:
    """A block's stage terms as expert parallelism changes them (``adjust_terms``)."""

    block: "Part"  # the block's terms, per micro-batch on one rank
    expert: ExpertCost | None  # None: ep = 1, or no experts (``block`` unchanged)
    transient_saving_bytes: float  # ZeRO-3: less gathered per block (E / ep experts, not all E)


def adjust_terms(graph: "ModelGraph", cluster: "Cluster", cfg: "Config", block: "Part", *,
                 dense_state_bytes: float, dpcp_link: "GroupLink", tokens_bytes: float,
                 shape: "Shape", region: str = "block") -> ExpertTerms:
    """The dense-priced ``block`` terms of ``cfg`` (autopar.cost.stage) under expert parallelism:
    the all-to-alls, the imbalance and the expert GEMMs' ep shapes added to forward and backward
    (and to the recompute of a full-recompute block), the experts' excess gradient sync, ZeRO-2/3's
    collectives with the experts over edp, and the dense-equivalent parameter count (module
    docstring). ``dense_state_bytes``: bytes per dense parameter; ``dpcp_link``: the dp x cp group's;
    ``tokens_bytes``: one rank's block input per micro-batch; ``shape``: the block's; ``region``: its
    fitted region ("block", or a chain unit's holding the experts: cost/chain.py)."""
    if cfg.ep == 1:
        if Layout.of(cfg).folds_tp and graph.moe is not None:  # the experts on the shard
            fwd, bwd = expert_gemm_delta_s(graph, cluster, shape, 1, region, float(cfg.tp))
            rec = fwd if cfg.recompute == "full" else 0.0
            block = replace(block, fwd_s=block.fwd_s + fwd, bwd_s=block.bwd_s + bwd + rec,
                            recompute_s=block.recompute_s + rec)
        return ExpertTerms(block=block, expert=None, transient_saving_bytes=0.0)
    expert = expert_cost(graph, cluster, cfg, dense_state_bytes=dense_state_bytes,
                         dense_sync_s_per_param=per_step_sync(cfg, dpcp_link, cluster)[0],
                         tokens_bytes=tokens_bytes, block_fwd_s=block.fwd_s - block.tp_comm_s - block.cp_comm_s,
                         block_bwd_s=block.bwd_s - block.recompute_s - block.zero_comm_s, block_params=block.params,
                         shape=shape, region=region)
    if expert is None:
        return ExpertTerms(block=block, expert=None, transient_saving_bytes=0.0)
    saving = 0.0
    if cfg.zero == 3:  # the gathered block holds this rank's E / ep experts, not all E
        saving = 2 * (expert.all_expert_params - expert.expert_params) * cfg.dtype_bytes
    # gemm: the ep shapes; weights: the experts' token-independent work, E / ep of it; sort: the
    # dispatcher's ordering of the received rows by local expert
    fwd_extra = (expert.a2a_fwd_s + expert.imbalance_fwd_s + expert.gemm_fwd_s + expert.weights_fwd_s
                 + expert.sort_fwd_s)
    bwd_extra = (expert.a2a_bwd_s + expert.imbalance_bwd_s + expert.gemm_bwd_s + expert.weights_bwd_s
                 + expert.sort_bwd_s + expert.grad_sync_extra_s)
    recompute_extra = fwd_extra if cfg.recompute == "full" else 0.0  # a recomputed block re-runs its all-to-alls
    if cfg.zero in (2, 3):  # dense parameters gathered over dp x cp, experts over their edp ranks
        bwd_plain = block.bwd_s - block.zero_comm_s
        zero_ep = zero_exposed_s(cfg, cluster, expert, block.fwd_s, bwd_plain, dpcp_link)
        tensors = graph.params[region].tensors if region in graph.params else 0  # 0: a chain's (not counted)
        zero_ep += sum(per_microbatch_s(cfg, cluster, tensors))  # framework time
        block = replace(block, bwd_s=bwd_plain + zero_ep, zero_comm_s=zero_ep)
    block = replace(block, fwd_s=block.fwd_s + fwd_extra, bwd_s=block.bwd_s + bwd_extra + recompute_extra,
                    recompute_s=block.recompute_s + recompute_extra, params=expert.block_params,
                    ep_comm_s=expert.a2a_fwd_s + expert.a2a_bwd_s + expert.grad_sync_extra_s)
    return ExpertTerms(block=block, expert=expert, transient_saving_bytes=saving)


def moe_summary(cost: ExpertCost, cfg: "Config", num_blocks: int) -> dict[str, float | int | str]:
    """The expert-parallel figures of a plan (``estimate --json``'s ``moe``; ``explain``): per step,
    the bytes one rank sends to other ranks in all-to-alls (dispatch and combine per MoE block and
    micro-batch in forward, backward, and again in a full recompute; at the busiest rank) and
    their exposed time, the time the imbalance factor adds over balanced routing (its extra
    expert compute and all-to-all volume; 0 at imbalance 1), and what the expert GEMMs' ep shapes
    change (``expert_gemm_delta_s``, every pass) and the dispatcher's chunk sorts (``expert_sort_s``)."""
    mb_blocks = num_blocks * cfg.num_microbatches / cfg.pp  # one pipeline rank's blocks x micro-batches
    passes = 2 + (1 if cfg.recompute == "full" else 0)  # forward, backward, recomputed forward
    a2a_s = (cost.a2a_fwd_s * (passes - 1) + cost.a2a_bwd_s) * mb_blocks
    balanced_a2a_s = a2a_s / cost.imbalance  # bandwidth-bound volume scales with the factor (upper estimate)
    recompute = 1 if cfg.recompute == "full" else 0
    extra = ((cost.imbalance_fwd_s * (1 + recompute) + cost.imbalance_bwd_s) * mb_blocks
             + (a2a_s - balanced_a2a_s))
    gemm = (cost.gemm_fwd_s * (1 + recompute) + cost.gemm_bwd_s) * mb_blocks
    weights = (cost.weights_fwd_s * (1 + recompute) + cost.weights_bwd_s) * mb_blocks
    sort = (cost.sort_fwd_s * (1 + recompute) + cost.sort_bwd_s) * mb_blocks
    return {
        "ep": cost.ep, "imbalance": cost.imbalance, "a2a_link": cost.link,
        # over the wire: the (ep - 1) / ep of each message that leaves the GPU (explain's "sent")
        "a2a_bytes_per_step": passes * DISPATCH_COMBINE_PER_PASS * cost.a2a_bytes * mb_blocks * (cost.ep - 1) / cost.ep,
        "a2a_s_per_step": a2a_s, "imbalance_s_per_step": extra,
        "expert_params_per_rank": cost.expert_params * num_blocks / cfg.pp,
        # the expert GEMMs at their ep shape (E / ep experts, ep x the rows) minus as traced; < 0: faster
        "expert_gemm_s_per_step": gemm,
        # the token-independent work (weight casts, weight-gradient casts and sums) of the experts a
        # rank does not hold; <= 0
        "expert_weights_s_per_step": weights,
        # Megatron's dispatcher sorting the received rows by local expert and back (0 elsewhere)
        "expert_sort_s_per_step": sort,
    }
