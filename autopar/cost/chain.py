"""Per-unit cost terms of a chain model (no repeated block; graph.chain) and the cost of one
contiguous partition of its chain over the pipeline ranks.

For one configuration, unit i costs ``units[i]`` (a ``Part``: forward/backward time of one
micro-batch, parameters, activations per in-flight micro-batch), a cut before unit i sends unit
i's input to the next rank (``cut_p2p_s[i]``), and unit i needs ``unit_transient_bytes[i]`` while
it runs (its ZeRO-3 gathered parameters and gradients, its recompute working set). The stem, head,
loss, model states, tails and capacity are the ones ``cost.stage.build_terms`` gives any model.

A chain is planned with one chunk per pipeline rank (v = 1: GPipe or 1F1B). Rank r holds units
[s_r, s_{r+1}); with the step formula of ``cost.step``:

    t_r   = sum_{i in r} tau_i + [r > 0] p2p(s_r) + [r < pp-1] p2p(s_{r+1}) + [r = 0] pre + [r = pp-1] post
    step  = (M - 1) max_r t_r + sum_r t_r + max_r tail_r
    mem_r = sigma P_r + I_r (sum_{i in r} alpha_i + edges + cut_r) + other_r + reserve
    other_r = root_r + max(max_{i in r} phase_i - [r = pp-1] post_act,
                           first_r - [r = pp-1] post_act,
                           [r = pp-1] loss, [r = 0] pre_peak) + M (buf(s_r) [r > 0] + buf(s_{r+1}) [r < pp-1])

cut_r is what a micro-batch holds at the rank's cuts (``cut_edge_bytes``): torch pipelining keeps
its output until its backward (h(s_{r+1}), r < pp - 1), and its first unit's saved input is the
receive buffer, priced with the buffers (- h(s_r) where unit s_r saves what it receives, r > 0).

phase_i is unit i's backward (beside the rank's saved activations less those of the units after it,
which the micro-batch's backward has released: ``stage_phase_bytes``) (``unit_phase_bytes``): its transients (ZeRO-3's gathered
parameters and gradients, its recompute working set) + its temporaries (gradients of
activations, ``Part.peak_bytes``) + FSDP2's held reduce-scatter input beyond the unit's own
activations; first_r is the backward of the rank's last unit, the first to run backward, when
it meets the previous micro-batch's last reduce-scatter input whole (FSDP2 under torch pipelining
keeps it until the next reduce: the root unit's gradients on an edge rank, else those of the
rank's first unit; ``first_backward_bytes``, 0 without it); the loss and embedding phases, the root's gathered parameters and the pipeline's
receive buffers (one per micro-batch per cut, ``cut_buffer_bytes``) are the ones
``StageTerms.rank_other_bytes`` gives a block list's ranks.

tail_r as in ``cost.step.evaluate``. With tp > 1 (a list of differing blocks with a TP plan per
unit kind, spec/chain_tp.py) tau_i is unit i's region at t = tp -- fitted under its kind's plan, so
only the sharded ops divide -- plus its TP all-reduces (recorded per unit, priced as a block's by
cost.stage), and P_r counts the parameters a kind's plan shards 1/tp; with sequence parallelism
the replicated token-proportional work, a unit's input and a cut's send are a 1/tp sequence shard.
``evaluate_chain`` is the oracle the partition search (search/partition.py) optimises and the
estimate of a chain plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.cluster import Cluster
from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.compute import graph_region_time
from autopar.cost.expert import ExpertCost, adjust_terms, grads_share, moe_summary
from autopar.cost.megatron_memory import FP32_BYTES
from autopar.cost.stage import (
    Config,
    Part,
    StageTerms,
    _pipeline_buffer_bytes,
    _tp_backward_exposed,
    _tp_time,
    as_trained,
    build_terms,
    keeps_autocast_copies,
    region_peak_bytes,
)
from autopar.cost.step import Estimate, RankCost
from autopar.cost.zero import overlapped, per_microbatch_exposed
from autopar.graph.model_graph import ChainUnit, ModelGraph
from autopar.graph.scaling import Shape
from autopar.layout import Layout


@dataclass(frozen=True, kw_only=True)
class ChainTerms:
    """Everything needed to cost any partition of a chain for one Config (module docstring)."""

    base: StageTerms
    units: tuple[Part, ...]
    cut_p2p_s: tuple[float, ...]  # [i]: a cut before unit i (index 0 unused: 0.0)
    unit_transient_bytes: tuple[float, ...]
    # [i]: what unit i's backward holds beyond saved activations and states (module docstring)
    unit_phase_bytes: tuple[float, ...]
    # [i]: one pipeline receive buffer of a cut before unit i (0 where the software allocates none)
    cut_buffer_bytes: tuple[float, ...]
    # [i]: a cut before unit i per micro-batch (StageTerms.chunk_edges): the output the rank before
    # keeps until its backward (torch pipelining's fwd_cache), and what of it unit i saves for
    # backward on the rank after, the receive buffer itself (ChainUnit.saves_input); () = none
    cut_handoff_bytes: tuple[float, ...] = ()
    cut_received_saved_bytes: tuple[float, ...] = ()
    # ep > 1: the expert-parallel terms of one unit holding the experts (all such units share the
    # graph's one mixture), and which units hold them; None / all False otherwise
    expert: ExpertCost | None = None
    expert_units: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.units) == len(self.cut_p2p_s) == len(self.unit_transient_bytes) == len(self.unit_phase_bytes)
                == len(self.cut_buffer_bytes) >= 1):
            raise ValueError("ChainTerms needs one part, cut time, transient, backward phase and cut buffer per unit")
        if self.base.config.virtual_stages != 1:
            raise ValueError("a chain is planned with one chunk per pipeline rank (virtual_stages 1)")

    @property
    def config(self) -> Config:
        return self.base.config

    @property
    def num_units(self) -> int:
        return len(self.units)


def build_chain_terms(graph: ModelGraph, cluster: Cluster, cfg: Config) -> ChainTerms:
    """Per-unit terms of ``cfg`` for the chain model ``graph`` (``graph.chain`` non-empty)."""
    if not graph.chain:
        raise ValueError(f"{graph.name} has no chain (its blocks repeat); use cost.stage.build_terms")
    if cfg.tp > 1 and graph.tp_reason:
        raise ValueError(f"{graph.name}: tp {cfg.tp} is not offered ({graph.tp_reason})")
    base = build_terms(graph, cluster, cfg)
    s_ratio = cfg.seq_len / graph.seq_len if graph.is_sequence_model else 1.0
    # tp > 1: each unit's region was fitted with its kind's tp plan (graph/chain_tp.py): its t
    # exponents divide the sharded ops, its recorded collectives are the unit's TP all-reduces
    # (under SP an all-gather and a reduce-scatter each), and SP divides what stays replicated
    sp = float(cfg.tp) if cfg.sequence_parallel and cfg.tp > 1 else 1.0
    shape = Shape(b=cfg.micro_batch, s_ratio=s_ratio, kv_ratio=s_ratio, t=cfg.tp, sp=sp)
    layout = Layout.of(cfg)
    pp_link, dpcp_link = axis_link(cluster, layout, "pp"), axis_link(cluster, layout, "dp_cp")
    tp_link = axis_link(cluster, layout, "tp")
    parts, cuts, transient, phases, buffers, handoffs, received = [], [], [], [], [], [], []
    held_per_param = base.held_reduce_bytes_per_param
    expert: ExpertCost | None = None
    for i, unit in enumerate(graph.chain):
        rt = as_trained(graph_region_time(graph, unit.region, cluster, shape), cluster, cfg)
        tp_f, tp_b = _unit_tp_time(graph, unit.region, cluster, cfg, shape, tp_link, rt)
        fwd = rt.fwd_s + tp_f
        in_bytes = unit.input_bytes * cfg.micro_batch * s_ratio / sp  # a sequence shard under SP
        if keeps_autocast_copies(cluster, cfg):
            in_bytes *= FP32_BYTES / cfg.dtype_bytes  # the residual stream a checkpoint keeps, fp32 under autocast
        if cfg.recompute == "full":
            recompute, act, work = fwd, in_bytes, rt.saved_bytes
        else:
            recompute, act, work = 0.0, rt.saved_bytes, 0.0
        bwd = rt.bwd_s + tp_b + recompute
        params = _unit_params(graph, unit, cfg.tp)
        zero = per_microbatch_exposed(cfg, params, fwd, bwd, dpcp_link, cluster)
        share = grads_share(graph, cfg, params) if unit.experts else 1.0
        peak, peak_grads = region_peak_bytes(rt, cfg, cluster, share)
        part = Part(fwd_s=fwd, bwd_s=bwd + zero, recompute_s=recompute, tp_comm_s=tp_f + tp_b, cp_comm_s=0.0,
                    zero_comm_s=zero, act_bytes=act, params=params, fwd_flops=rt.fwd_flops, bwd_flops=rt.bwd_flops,
                    peak_bytes=peak, peak_grads_bytes=peak_grads)
        gathered = params
        # its experts sharded over ep ranks, or run on a sequence shard under SP, priced as a block's (cost/expert.py)
        if (cfg.ep > 1 or layout.folds_tp) and unit.experts:
            ep = adjust_terms(graph, cluster, cfg, part, dense_state_bytes=base.state_bytes_per_param,
                              dpcp_link=dpcp_link, tokens_bytes=unit.input_bytes * cfg.micro_batch * s_ratio,
                              shape=shape, region=unit.region)
            part, expert = ep.block, ep.expert or expert
            if ep.expert is not None:  # this rank gathers its E / ep experts only
                gathered -= ep.expert.all_expert_params - ep.expert.expert_params
        parts.append(part)
        cuts.append(collective_time_s("p2p", in_bytes, pp_link) if i and cfg.pp > 1 else 0.0)
        # ZeRO-3: the unit's gathered parameters and the next one's, prefetched, as build_terms for a
        # block (its unsharded gradients are in part.peak_bytes: cost.zero.holds_unit_grads)
        transient.append((2 * gathered * cfg.dtype_bytes if cfg.zero == 3 else 0.0) + work)
        # its backward: + gradients of activations, + FSDP2's held reduce-scatter input (the unit
        # after it has released its activations by then), as StageTerms.rank_other_bytes's block
        phases.append(transient[-1] + part.peak_bytes + max(0.0, part.params * held_per_param - part.act_bytes))
        buffers.append(_pipeline_buffer_bytes(cfg, cluster, unit.input_bytes * cfg.micro_batch * s_ratio, sp,
                                              base.carried_bytes))
        # a cut before unit i: unit i - 1's output, kept where it does not save it itself (full
        # recompute saves none of a unit's own tensors), and unit i's saved input
        hidden = _pipeline_buffer_bytes(cfg, cluster, unit.input_bytes * cfg.micro_batch * s_ratio, sp)
        kept = i > 0 and graph.chain[i - 1].saves_output and cfg.recompute != "full"
        handoffs.append(0.0 if kept else hidden)
        received.append(hidden if unit.saves_input or cfg.recompute == "full" else 0.0)
    return ChainTerms(base=base, units=tuple(parts), cut_p2p_s=tuple(cuts), unit_transient_bytes=tuple(transient),
                      unit_phase_bytes=tuple(phases), cut_buffer_bytes=tuple(buffers),
                      cut_handoff_bytes=tuple(handoffs), cut_received_saved_bytes=tuple(received),
                      expert=expert, expert_units=tuple(u.experts and expert is not None for u in graph.chain))


def _unit_params(graph: ModelGraph, unit: ChainUnit, tp: int) -> float:
    """One tp rank's parameters of ``unit``: those its kind's plan divides (graph.params of the
    unit's region, present where the chain was measured under plans per kind) count 1/tp."""
    region = graph.params.get(unit.region)
    sharded = region.tp_sharded if region is not None and tp > 1 else 0
    return unit.params - sharded + sharded / tp


def _unit_tp_time(graph: ModelGraph, region: str, cluster: Cluster, cfg: Config, shape: Shape, link,  # noqa: ANN001
                  rt) -> tuple[float, float]:  # noqa: ANN001 - cost.compute.RegionTime
    """(forward, backward) exposed TP collectives of one unit, as cost.stage prices a block's."""
    if cfg.tp == 1:
        return 0.0, 0.0
    comm = graph.regions[region].comm
    tp_f = _tp_time(cluster, cfg, comm, "fwd", shape, link)
    tp_b = _tp_time(cluster, cfg, comm, "bwd", shape, link)
    if cluster.tp_comm_overlap:
        return (overlapped(tp_f, rt.fwd_gemm_s, cluster.overlap_cost_fraction),
                overlapped(tp_b, rt.bwd_gemm_s, cluster.overlap_cost_fraction))
    if cluster.async_tp_backward:
        return tp_f, _tp_backward_exposed(cfg, tp_b, rt.bwd_gemm_s / 2)
    return tp_f, tp_b


@dataclass(frozen=True, kw_only=True)
class StageLoad:
    """Rank-level sums of one stage [start, end) at pipeline position ``rank``."""

    time_s: float
    bwd_s: float
    params: float
    act_bytes: float
    transient_bytes: float
    expert_units: int = 0  # units holding experts sharded over ep (ChainTerms.expert)
    phase_bytes: float = 0.0  # the largest backward phase of its units (ChainTerms.unit_phase_bytes)
    # under a pipeline that holds the previous micro-batch's last reduce-scatter input: the phase of
    # its first unit to run backward (its last) with that input whole (first_backward_bytes); else 0
    first_backward_bytes: float = 0.0
    buffer_bytes: float = 0.0  # one micro-batch's pipeline receive buffers (its cuts in and out)
    edge_bytes: float = 0.0  # one micro-batch's handed-on output less its saved received input (cut_edge_bytes)


def stage_load(terms: ChainTerms, start: int, end: int, rank: int) -> StageLoad:
    """What ranks ``rank`` of ``terms.config.pp`` holding units [start, end) costs (module docstring)."""
    pp, L, t = terms.config.pp, terms.num_units, terms.base
    us = terms.units[start:end]
    time = sum(u.time_s for u in us)
    bwd = sum(u.bwd_s for u in us)
    params = sum(u.params for u in us)
    act = sum(u.act_bytes for u in us)
    if start > 0:
        time += terms.cut_p2p_s[start]
    if end < L:
        time += terms.cut_p2p_s[end]
    if rank == 0:
        time, bwd, params, act = time + t.pre.time_s, bwd + t.pre.bwd_s, params + t.pre.params, act + t.pre.act_bytes
    if rank == pp - 1:
        time, bwd = time + t.post.time_s, bwd + t.post.bwd_s
        params, act = params + t.post.params + t.tied_params, act + t.post.act_bytes
    return StageLoad(time_s=time, bwd_s=bwd, params=params, act_bytes=act,
                     transient_bytes=max(terms.unit_transient_bytes[start:end], default=0.0),
                     expert_units=sum(terms.expert_units[start:end]),
                     phase_bytes=stage_phase_bytes(terms, start, end),
                     buffer_bytes=cut_buffers_bytes(terms, start, end), edge_bytes=cut_edge_bytes(terms, start, end),
                     first_backward_bytes=first_backward_bytes(terms, start, end, rank))


def stage_phase_bytes(terms: ChainTerms, start: int, end: int) -> float:
    """The largest backward phase of units [start, end) beside the stage's saved activations: unit
    u's (``unit_phase_bytes``) less the activations of the units after it on the stage, which the
    micro-batch's backward has released by then -- max_u (phase_u + A_{u+1}) - A_end, with A the
    prefix sums of the units' activations (a ResNet's first bottleneck peaks beside none of the
    later ones' saved tensors)."""
    act = [u.act_bytes for u in terms.units[start:end]]
    later, best = 0.0, float("-inf")
    for phase, a in zip(reversed(terms.unit_phase_bytes[start:end]), reversed(act)):
        best = max(best, phase - later)
        later += a
    return best if end > start else 0.0


def first_backward_bytes(terms: ChainTerms, start: int, end: int, rank: int) -> float:
    """The backward phase of the stage's first unit to run backward (unit ``end - 1``) when it meets
    the previous micro-batch's last reduce-scatter input whole: nothing of this micro-batch has been
    released yet (``StageTerms.first_backward_held_bytes``, with the stage's first unit as the
    block whose reduce-scatter runs last); 0 where no pipeline holds it."""
    t = terms.base
    if not t.pipeline_held_reduce_bytes_per_param:
        return 0.0
    held = t.first_backward_held_bytes(rank == 0, rank == terms.config.pp - 1, terms.units[start].params)
    return terms.unit_transient_bytes[end - 1] + terms.units[end - 1].peak_bytes + held


def cut_buffers_bytes(terms: ChainTerms, start: int, end: int) -> float:
    """The receive buffers of one micro-batch on the rank holding units [start, end): the
    activations of its first unit's input and the gradient of its output (the next rank's input)."""
    if terms.config.pp == 1:
        return 0.0
    return (terms.cut_buffer_bytes[start] if start > 0 else 0.0) + \
        (terms.cut_buffer_bytes[end] if end < terms.num_units else 0.0)


def cut_edge_bytes(terms: ChainTerms, start: int, end: int) -> float:
    """What one micro-batch of the rank holding units [start, end) holds at its cuts beside its
    units' saved activations (StageTerms.chunk_edges): its output, kept until its backward, where
    a rank follows, less its first unit's saved input, the receive buffer, where one precedes."""
    if terms.config.pp == 1 or not terms.cut_handoff_bytes:
        return 0.0
    return (terms.cut_handoff_bytes[end] if end < terms.num_units else 0.0) - \
        (terms.cut_received_saved_bytes[start] if start > 0 else 0.0)


def stage_tail_s(terms: ChainTerms, load: StageLoad) -> float:
    """The end-of-step tail of a rank (the formula of ``cost.step.evaluate``)."""
    t = terms.base
    sync = load.params * t.grad_sync_s_per_param
    if t.grad_sync_overlaps:
        tail = max(t.grad_sync_floor_s if sync > 0 else 0.0, sync - load.bwd_s) + t.overlap_cost_fraction * sync
    else:
        tail = sync
    return tail + load.params * t.after_sync_s_per_param


def stage_memory(terms: ChainTerms, load: StageLoad, rank: int) -> dict[str, float]:
    """Bytes by kind of the rank ``rank`` holding ``load`` at its peak (module docstring): model
    states, saved activations and "other" (the largest phase, buffers, the reserve)."""
    t, split = terms.base, terms.base.state_split
    memory = {kind: load.params * split[kind] for kind in ("params", "grads", "optimizer")}
    ex = terms.expert
    if ex is not None and load.expert_units:  # the same total, each expert byte under its own kind (cost.step)
        for kind in memory:
            memory[kind] += load.expert_units * ex.state_delta_bytes(kind, split)
    other = _other_bytes(terms, load, rank, loss=True)
    activations = t.inflight(rank) * (load.act_bytes + load.edge_bytes)
    # a step's only micro-batch, no pipeline (StageTerms.one_microbatch_peak; a chain's GPipe stages
    # keep their gradients in the price: over)
    if t.loss_free_grads > 0 and terms.config.pp == 1:
        other, memory["grads"], activations = t.one_microbatch_moments(
            _other_bytes(terms, load, rank, loss=True, blocks=False), _other_bytes(terms, load, rank, loss=False),
            memory["grads"], activations, terms.units[0].act_bytes + t.pre.act_bytes)  # the first unit's and the stem's
    return {**memory, "activations": activations, "other": other + t.reserve_bytes}


def _other_bytes(terms: ChainTerms, load: StageLoad, rank: int, *, loss: bool, blocks: bool = True) -> float:
    """``other_r`` of the module docstring less the reserve; ``loss`` False leaves the loss phase
    out, ``blocks`` False the units' and embedding's phases (the loss phase alone)."""
    t, c = terms.base, terms.config
    first, last = rank == 0, rank == c.pp - 1
    phases = [0.0]
    if blocks:
        root_grads = t.root_grad_bytes if last else 0.0  # FSDP2's root unit's, as StageTerms.rank_other_bytes
        own_post = t.post.act_bytes if last else 0.0
        phases.append(load.phase_bytes - own_post + root_grads)
        if load.first_backward_bytes:  # a micro-batch's first unit in backward: nothing released yet
            phases.append(load.first_backward_bytes - own_post + root_grads)
        if first:
            phases.append(t.pre.peak_bytes + root_grads)
    if last and loss:
        # ZeRO-3: the last unit's parameters, prefetched from the head's backward on (StageTerms._loss_phase_bytes)
        gather = terms.units[-1].params * c.dtype_bytes if c.zero == 3 else 0.0
        # and the previous micro-batch's last reduce-scatter input, the root's (StageTerms.rank_other_bytes)
        phases.append(t.loss_phase_bytes(gather) + t.first_backward_held_bytes(first, last))
    # the outputs of the micro-batches whose loss and backward are pending (StageTerms.rank_other_bytes)
    held = t.stage_output_bytes * t.loss_inflight() if last else 0.0
    # and the rank's rows of the step's batch (StageTerms.batch_bytes)
    return t.root_bytes(first, last) + max(phases) + held + c.num_microbatches * load.buffer_bytes + t.batch_bytes


def evaluate_chain(terms: ChainTerms, ranges: Sequence[tuple[int, int]], model_flops_per_step: float,
                   tokens_per_step: float, peak_flops: float) -> Estimate:
    """Cost the partition ``ranges`` (one contiguous [start, end) per pipeline rank, covering the chain)."""
    cfg, L = terms.config, terms.num_units
    if len(ranges) != cfg.pp or ranges[0][0] != 0 or ranges[-1][1] != L or any(
            a >= b for a, b in ranges) or any(ranges[k][1] != ranges[k + 1][0] for k in range(len(ranges) - 1)):
        raise ValueError(f"ranges {list(ranges)} are not {cfg.pp} contiguous non-empty stages covering {L} units")
    ranks = []
    for r, (a, b) in enumerate(ranges):
        load = stage_load(terms, a, b, r)
        ranks.append(RankCost(rank=r, num_blocks=b - a, time_s=load.time_s, backward_s=load.bwd_s,
                              tail_s=stage_tail_s(terms, load), params=load.params,
                              memory_bytes=stage_memory(terms, load, r)))
    m, pp, t = cfg.num_microbatches, cfg.pp, terms.base
    steady = (m - 1) * max(rk.time_s for rk in ranks)
    busy = sum(rk.time_s for rk in ranks)
    tail = max(rk.tail_s for rk in ranks)
    step = steady + busy + tail
    us = terms.units
    per_mb = {
        "compute": sum(u.compute_s for u in us) + t.pre.time_s
        + t.post.time_s - t.pre.tp_comm_s - t.post.tp_comm_s - t.pre.zero_comm_s - t.post.zero_comm_s,
        "recompute": sum(u.recompute_s for u in us),
        "tp_comm": sum(u.tp_comm_s for u in us) + t.pre.tp_comm_s + t.post.tp_comm_s,
        "cp_comm": 0.0,
        "zero_comm": sum(u.zero_comm_s for u in us) + t.pre.zero_comm_s + t.post.zero_comm_s,
        "pp_comm": 2 * sum(terms.cut_p2p_s[a] for a, _ in ranges[1:]),
    }
    if cfg.ep > 1:  # the experts' all-to-alls (a key only where ep is used, as cost.step's)
        per_mb["ep_comm"] = sum(u.ep_comm_s for u in us)
    breakdown = {k: val * m / pp for k, val in per_mb.items()}
    breakdown["bubble"] = steady + busy - m * busy / pp
    optimizer = max(rk.params * t.optimizer_s_per_param for rk in ranks)
    breakdown["optimizer"] = optimizer
    breakdown["dp_tail"] = tail - optimizer
    peak = max(ranks, key=lambda rk: rk.peak_bytes)
    return Estimate(
        step_time_s=step, tokens_per_s=tokens_per_step / step,
        mfu=model_flops_per_step / (step * cfg.num_gpus * peak_flops), peak_memory_bytes=peak.peak_bytes,
        capacity_bytes=t.capacity_bytes, memory_bytes=dict(peak.memory_bytes), time_breakdown_s=breakdown,
        ranks=tuple(ranks), bubble_fraction=max(0.0, breakdown["bubble"]) / step if step else 0.0,
        reserve_bytes=t.reserve_bytes,
        moe=moe_summary(terms.expert, cfg, sum(terms.expert_units)) if terms.expert is not None else None,
    )
