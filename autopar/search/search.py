"""Branch and bound over the outer space, CP-SAT for the stage split; optimal under the cost model.

1. Group legal configurations by what fixes a block's cost: (tp, cp, cp kind, sp, micro-batch,
   recompute). For each group and pipeline degree a lower bound on the step time is the balanced
   pipeline (M - 1/v) W/pp + W/v with W = L tau + embedding + head per micro-batch, at the
   group's most favourable v, with no tail, tau the block time without ZeRO-2/3 exposure (which
   only adds). A lower bound on memory is the model states alone.
2. Visit (group, pp) pairs in increasing bound; inside, every schedule, v and ZeRO stage gets its
   exact terms, a tighter bound (the balanced pipeline), and only then the ILP (pp > 1) or a direct
   evaluation (pp = 1).
3. Stop a branch when its bound cannot beat the K-th best plan found. Because every bound is a true
   lower bound of ``cost.step.evaluate``, the top K returned are the top K of the whole space,
   except for two dominated kinds never costed: GPipe where 1F1B is legal (same time, more memory)
   and selective recompute of a block without s^2 activations (same memory as none, more time).
4. A split program too large to enumerate is first solved by the parametric method (exact and
   polynomial, ``search.ilp.SplitILP.parametric``): a config whose optimal split cannot beat the
   K-th best is dropped without CP-SAT. Only the configs that end in the top K are given to
   CP-SAT, whose proven optimum is the split reported (the two agree: they solve the same integer
   program; the better of the two is kept should CP-SAT stop at its time limit). CP-SAT used to
   run for every surviving config: 188 solves of ~50 ms for Llama-3 70B at 4,096 GPUs.
5. A "mixed" recompute config (per-stage recompute) is solved by its own program (``search.ilp_recompute``:
   blocks per rank and recompute mode). Its bounds are the "none" block's (the fastest) and the
   most frugal mode's memory, so they stay true lower bounds. On request (``--recompute mixed``)
   every config's mix is costed; by default each of the top K single-mode plans is solved again as
   a mix of the same degrees and a faster mix joins the top K (``_refine_with_mixes``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from typing import Callable, Sequence

from autopar.cluster import Cluster
from autopar.cost.evolve import evolve
from autopar.cost.host import evaluate_with_host, host_family, host_lower_bound
from autopar.cost.pipeline_window import window_chunks
from autopar.cost.stage import Config, StageTerms, build_terms, software_recompute_reason
from autopar.cost.step import evaluate
from autopar.errors import PlanError
from autopar.graph.model_graph import ModelGraph
from autopar.plan import NO_OFFLOAD, Offload, even_stage_ranges, offload_reason
from autopar.search.candidates import Candidate, SearchResult, TopK
from autopar.search.ilp import MAX_ENUMERATED_SPLITS, SplitILP, rank_block_capacity, solve_split
from autopar.search.space import Branch, SearchSpace, enumerate_branches, enumerate_configs, mix_modes


def search(
    graph: ModelGraph,
    cluster: Cluster,
    space: SearchSpace,
    *,
    top_k: int = 5,
    progress: Callable[[int, int, float], None] | None = None,
    ilp_time_limit_s: float = 10.0,
) -> SearchResult:
    """The top ``top_k`` plans (fastest first) that fit memory; see the module docstring."""
    if graph.chain:  # no repeated block: per-unit terms and the chain's optimal partition
        from autopar.search.chain_search import search_chain

        return search_chain(graph, cluster, space, top_k=top_k, progress=progress)
    start = time.perf_counter()
    rejected: Counter = Counter()
    reason = software_recompute_reason(cluster, "op")
    if reason and "op" in space.recompute_modes:
        left = tuple(m for m in space.recompute_modes if m != "op")
        if not left:
            raise PlanError(f"recompute op is not possible: {reason}")
        space = replace(space, recompute_modes=left)
        rejected[f"recompute op: {reason}"] += 1
    tokens = space.global_batch * space.seq_len
    model_flops = graph.model_flops_per_sample() * space.global_batch
    flop_lb_s = model_flops / (space.num_gpus * cluster.peak_flops)  # even 100 % MFU needs this

    # Level 1: bound each branch (block cost x pipeline degree) from one terms build per block cost.
    base_terms: dict[tuple, StageTerms] = {}  # per block cost, the branch's shared terms
    bounded: list[tuple[float, float, float, Branch]] = []
    num_configs = 0
    for branch in enumerate_branches(graph, space, rejected):
        num_configs += branch.num_configs
        key = branch.block_key
        if key not in base_terms:
            # Block cost without ZeRO-2/3 exposure (which only adds) and without a pipeline.
            base_terms[key] = build_terms(graph, cluster, branch.config(dp=branch.dp * branch.pp, pp=1))
        base = base_terms[key]
        # step >= M * max_r t_r >= M * sum_r t_r / pp (every rank runs all M micro-batches), and with
        # the pipeline's fill and drain the balanced pipeline (M - 1/v) W/pp + W/v >= M W/pp of the
        # shared terms (no p2p, no ZeRO exposure: both only add). It falls with v at pp > 1, so the
        # branch's largest v gives the least.
        lb = max(flop_lb_s, _balanced_lb_of(base, graph.num_blocks, branch.pp, max(v for _, v in branch.schedules),
                                            branch.num_microbatches))
        # Two memory bounds (host offload): without offload (the first pass) and with the most frugal
        # offload the branch allows (the second), so the first pass prunes as it did before offload.
        mem_plain = _memory_lb(graph, cluster, base, branch)
        mem_off = _memory_lb(graph, cluster, base, branch, True) if cluster.has_host else mem_plain
        bounded.append((lb, mem_plain, mem_off, branch))
    bounded.sort(key=lambda x: x[0])

    if not cluster.has_host and any(m != "none" for m in space.offload_modes):  # host offload: said once
        rejected[f"offload: profile {cluster.name} gives no host: section"] += 1
    selective_saves = any(q.exps.quadratic for q in graph.regions["block"].saved)
    top = TopK(top_k)
    evaluated = solved = 0
    optimal = True
    min_mem, min_mem_cfg = math.inf, None
    visited = 0
    # Host offload: two passes over the branches, without offload and then with it. Offload only adds
    # time, so the first pass's plans give the second a tight threshold to prune with; each config is
    # visited once (pass 2 counts no branch-level rejection again).
    fits_plain: dict[int, set[int]] = {}  # per branch, ZeRO stages with a plan that fits without offload
    fits_off: dict[tuple[int, int], list[Offload]] = {}  # per (branch, ZeRO stage), offload modes that fit
    plain_terms: dict[tuple[int, int], StageTerms] = {}  # per (branch, ZeRO stage), the first pass's terms
    passes = (False, True) if cluster.has_host and any(m != "none" for m in space.offload_modes) else (False,)
    for offload_pass, (lb, mem_plain, mem_off, branch) in ((p, b) for p in passes for b in bounded):
        mem_lb = mem_off if offload_pass else mem_plain
        if not offload_pass:
            visited += 1
            if progress and visited % 500 == 0:
                progress(visited, len(bounded), time.perf_counter() - start)
        if mem_lb > cluster.usable_memory_bytes:
            if not offload_pass and mem_off > cluster.usable_memory_bytes:  # else the offload pass may fit it
                rejected["memory: cannot fit even with an ideal split"] += branch.num_configs
            continue
        if lb >= top.threshold():
            if not offload_pass:
                rejected["bound: cannot beat the best plans"] += branch.num_configs
            continue
        if branch.recompute == "selective" and not selective_saves:
            # With a fused attention kernel there are no s^2 activations: selective recompute would
            # re-run the attention forward and keep exactly what no recompute keeps.
            if not offload_pass:
                rejected["dominated: selective recompute saves nothing (fused attention)"] += branch.num_configs
            continue
        plain_fits = fits_plain.setdefault(id(branch), set())
        for zero, off in ((z, o) for z in branch.zero_stages for o in _offloads(branch, z, cluster, rejected)
                          if o.any == offload_pass):
            # Within a branch the terms depend on the ZeRO stage but not on the schedule or v (the
            # step formula reads those from the config): build them once per stage. 1F1B (GPipe when
            # 1F1B is not legal) keeps the fewest micro-batches in flight, so if it cannot fit,
            # no schedule of this stage can.
            if off.any and zero in plain_fits:
                # Host offload: offload only adds time to a config; where it fits without, it is not needed.
                rejected["dominated: offload where the plan fits without it"] += len(branch.schedules)
                continue
            if off.any and any(_within(f, off) for f in fits_off.get((id(branch), zero), ())):
                # Likewise up the lattice: offloading more than a mode that already fits only adds time
                # (the labels come subsets first: optimizer before params, activations before both).
                rejected["dominated: more offload than a plan that fits needs"] += len(branch.schedules)
                continue
            if off.any and _memory_lb(graph, cluster, base_terms[branch.block_key], branch, True, zero, off) > \
                    cluster.usable_memory_bytes:
                rejected["memory: cannot fit even with an ideal split"] += len(branch.schedules)
                continue
            plain0 = plain_terms.get((id(branch), zero))
            if off.any and plain0 is not None and all(
                    _balanced_lb_of(plain0, graph.num_blocks, branch.pp, v, branch.num_microbatches) >= top.threshold()
                    for _, v in branch.schedules):
                # Offload only adds time (each offload variant's bound is at least its twin's without
                # offload): where the twin's bound cannot make the top K, no variant is built.
                rejected["bound: cannot beat the best plans"] += len(branch.schedules)
                continue
            frugal = branch.schedules[0] if ("1f1b", 1) not in branch.schedules else ("1f1b", 1)
            # ... in activations; at ZeRO-1/2 an interleaved schedule's gather window (v > 3: three
            # chunks' 16-bit parameters, cost.pipeline_window.window_chunks) holds fewer model states, at least
            # 3 / v of them, so the bound takes 1F1B's activations beside the largest v's states
            saving = _window_saving_per_param(branch, zero)
            if branch.pp > 1 and branch.ep == 1 and not _fits_somehow(
                    _upper_capacity(base_terms[branch.block_key], branch, zero, off, frugal, cluster, graph, saving),
                    frugal[1], graph.num_blocks):
                # Decided from the branch's shared terms (search.fit_bound): the real capacities are
                # no larger, so the terms' own check below would say the same after building them.
                rejected["memory: no stage split fits"] += len(branch.schedules)
                continue
            terms0 = build_terms(graph, cluster, branch.config(*frugal, zero, offload=off))
            if not off.any:
                plain_terms[(id(branch), zero)] = terms0
            # (the same bound on the real terms: 1F1B's with the window's saving taken off its states)
            probe = evolve(terms0, state_bytes_per_param=terms0.state_bytes_per_param - saving) if saving else terms0
            if branch.pp > 1 and not _fits_somehow(_block_capacity(probe, graph), frugal[1], graph.num_blocks):
                rejected["memory: no stage split fits"] += len(branch.schedules)
                continue
            schedule_caps: dict[tuple[str, int], list[int]] = {}  # each schedule's, from terms0, asked once
            for schedule, v in branch.schedules:
                if schedule == "gpipe" and ("1f1b", 1) in branch.schedules and _gpipe_within_1f1b(terms0, schedule_caps):
                    # Same step time as 1F1B in the cost model, with M micro-batches in flight
                    # instead of at most pp: never better where it holds no fewer blocks on any rank
                    # (it can: its forwards peak before any gradient exists), so not costed there.
                    rejected["dominated: gpipe (1f1b is as fast with less memory)"] += 1
                    continue
                # The bound reads only the block terms (shared by the branch's schedules) and the
                # schedule's shape: no config or terms are built for a schedule it prunes.
                if (_balanced_lb_of(terms0, graph.num_blocks, branch.pp, v, branch.num_microbatches)
                        + _offload_tail_lb(terms0, graph.num_blocks)) >= top.threshold():
                    rejected["bound: cannot beat the best plans"] += 1
                    continue
                cfg = branch.config(schedule, v, zero, offload=off) if off.any else None
                if cfg is not None:
                    terms = evolve(terms0, config=cfg)
                    if host_lower_bound(terms, graph.num_blocks, cluster.gpus_per_node) > \
                            cluster.host_memory_bytes_per_node:  # host offload: no split can fit the host
                        rejected["memory: host memory per node"] += 1
                        continue
                # The schedule's own block capacities, read from the shared terms: most schedules
                # of a tight branch hold too many micro-batches in flight, decided here without
                # building their config.
                caps = _schedule_caps(terms0, (schedule, v), schedule_caps) \
                    if branch.pp > 1 and terms0.recompute_parts is None else None
                if caps is not None and not _fits_somehow(caps, v, graph.num_blocks):
                    evaluated += 1
                    rejected["memory: no stage split fits"] += 1
                    continue
                if cfg is None:
                    cfg = branch.config(schedule, v, zero, offload=off)
                    terms = evolve(terms0, config=cfg)
                cand = _solve(terms, graph, cluster, model_flops, tokens, ilp_time_limit_s, top.threshold(), caps)
                if cand is _PRUNED:
                    rejected["bound: cannot beat the best plans"] += 1
                    continue
                evaluated += 1
                solved += cand is not None and cfg.pp > 1
                if cand is _HOST_FULL:
                    rejected["memory: host memory per node"] += 1
                    continue
                if cand is None:
                    rejected["memory: no stage split fits"] += 1
                    continue
                if not off.any:
                    plain_fits.add(zero)
                else:
                    fits_off.setdefault((id(branch), zero), []).append(off)
                if cand.ilp_status not in ("OPTIMAL", "DIRECT"):
                    optimal = False
                top.offer(cand)
    if progress:
        progress(len(bounded), len(bounded), time.perf_counter() - start)
    refined = _refine_with_mixes(top, graph, cluster, space, model_flops, tokens, ilp_time_limit_s)
    confirmed = [_confirm_with_cp_sat(c, graph, cluster, model_flops, tokens, ilp_time_limit_s) for c in top.items]
    top.items = sorted(confirmed, key=lambda c: c.step_time_s)
    optimal = optimal and all(c.ilp_status in ("OPTIMAL", "DIRECT") for c in top.items)
    if not top.items:
        min_mem, min_mem_cfg = smallest_memory(graph, cluster, space)
    return SearchResult(
        top=tuple(top.items), num_configs=num_configs, num_evaluated=evaluated, num_ilp_solved=solved,
        rejected=dict(rejected), elapsed_s=time.perf_counter() - start, optimal=optimal,
        min_memory_bytes=min_mem, min_memory_config=min_mem_cfg, capacity_bytes=cluster.usable_memory_bytes,
        num_mixes_refined=refined,
    )


def _memory_lb(graph: ModelGraph, cluster: Cluster, base: StageTerms, branch: Branch, has_host: bool = False,
               zero: int | None = None, offload: Offload | None = None) -> float:
    """A lower bound on the peak memory of any config of ``branch``: the average rank's model
    states (under its most sharded ZeRO stage, less the 16-bit parameters a gather window leaves
    ungathered; without gradients where a step's only micro-batch
    may meet none at its loss) and one micro-batch of activations (every rank keeps at least one
    in flight), plus the framework reserve. ``has_host`` (host offload): offload is
    searched, so the bound takes what the most frugal offload mode of the branch leaves on the GPU;
    ``zero`` and ``offload`` given: the bound of that ZeRO stage and offload mode only."""
    from autopar.cost.memory import state_bytes_per_param

    params = graph.num_blocks * base.block.params + base.pre.params + base.post.params
    state = state_bytes_per_param(zero=max(branch.zero_stages) if zero is None else zero,
                                  shard_degree=branch.dp * branch.cp,
                                  dtype_bytes=branch.space.dtype_bytes, optimizer=branch.space.optimizer,
                                  moment_bytes=cluster.optimizer_moment_bytes, master_bytes=cluster.master_weight_bytes)
    best = state.total
    best -= _window_saving_per_param(branch, max(branch.zero_stages) if zero is None else zero)
    # the activations may peak before any gradient exists (StageTerms.loss_free_grads): a step of one
    # micro-batch (GPipe's with more holds every gradient beside at least one micro-batch's activations
    # after its first backward, which the bound's one micro-batch does not exceed)
    if branch.num_microbatches == 1:
        best -= state.grads
    block_act = _least_block_act(base, graph)
    if offload is not None:
        offs: Sequence[Offload] = (offload,)
    else:
        offs = [o for z in branch.zero_stages for o in branch.offloads(z)] if has_host else ()
    if any(o.params for o in offs):  # host offload: the most any offload mode leaves on the GPU
        best = 0.0
    elif any(o.optimizer for o in offs):
        best -= state.optimizer
    if any(o.activations for o in offs):
        block_act = 0.0
    acts = graph.num_blocks * block_act + base.pre.act_bytes + base.post.act_bytes
    return (params * best + acts) / branch.pp + base.reserve_bytes


def _offload_tail_lb(terms: StageTerms, num_blocks: int) -> float:
    """Host offload: with offload, the step's tail holds the CPU update of the slowest rank, at least the
    average rank's (max >= mean): params / pp x optimizer seconds per parameter. 0 without offload."""
    if terms.offload is None:
        return 0.0
    params = num_blocks * terms.block.params + terms.pre.params + terms.post.params + terms.tied_params
    return params / terms.config.pp * terms.optimizer_s_per_param


def _balanced_lb(terms: StageTerms, num_blocks: int) -> float:
    """Step time if every rank carried exactly the average load (no imbalance, no tail)."""
    cfg = terms.config
    return _balanced_lb_of(terms, num_blocks, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)


def _balanced_lb_of(terms: StageTerms, num_blocks: int, pp: int, v: int, m: int) -> float:
    """``_balanced_lb`` for ``pp`` ranks, ``v`` chunks per rank and ``m`` micro-batches, from the
    per-block terms alone (they do not depend on the schedule)."""
    total = num_blocks * terms.block.time_s + terms.pre.time_s + terms.post.time_s
    if pp > 1:
        total += terms.p2p_s * 2 * (pp * v - 1)
    return (m - 1 / v) * total / pp + total / v


_PRUNED = "pruned"  # _solve's answer when a memory-aware bound shows the config cannot make the top K
_HOST_FULL = "host"  # _solve's answer when the split fits the GPUs but not the nodes' host memory (host offload)


def _within(a: Offload, b: Offload) -> bool:
    """Whether offload ``a`` moves a subset of what ``b`` moves (so ``b`` costs at least ``a``'s time)."""
    return all(getattr(b, k) or not getattr(a, k) for k in ("optimizer", "params", "grads", "activations"))


def _offloads(branch: Branch, zero: int, cluster: Cluster, rejected: Counter) -> tuple:
    """Host offload: the offload modes of ``branch`` at ``zero``; none but "no offload" on a cluster whose
    profile gives no host figures (autopar.cluster.Cluster.has_host)."""
    offs = branch.offloads(zero)
    return offs if cluster.has_host else tuple(o for o in offs if not o.any)


def _window_saving_per_param(branch: Branch, zero: int) -> float:
    """The most model-state bytes per parameter a gather window of ``branch``'s schedules leaves
    ungathered at ``zero`` (cost.pipeline_window.window_chunks: a window of W of v chunks holds at least W / v
    of a rank's blocks, so at most d (1 - W / v) per parameter is saved); 0 without a window."""
    return _window_saving(zero, branch.dp * branch.cp, branch.pp, branch.schedules, branch.space.dtype_bytes)


@lru_cache(maxsize=4096)
def _window_saving(zero: int, shard_degree: int, pp: int, schedules: tuple[tuple[str, int], ...],
                   dtype_bytes: int) -> float:
    windows = [(w, v) for s, v in schedules if (w := window_chunks(
        zero=zero, shard_degree=shard_degree, pp=pp, schedule=s, virtual_stages=v))]
    return dtype_bytes * max((1 - w / v for w, v in windows), default=0.0)


def _upper_capacity(base: StageTerms, branch: Branch, zero: int, off: Offload, schedule: tuple[str, int],
                    cluster: Cluster, graph: ModelGraph, saving_per_param: float = 0.0) -> list[int]:
    """``search.fit_bound.upper_capacity`` of one config of ``branch`` (``base``: its shared terms);
    ``saving_per_param``: model-state bytes per parameter left out besides (a gather window's)."""
    from autopar.search.fit_bound import upper_capacity

    space = branch.space
    return upper_capacity(base, zero=zero, offload=off, schedule=schedule[0], pp=branch.pp,
                          virtual_stages=schedule[1], num_microbatches=branch.num_microbatches,
                          shard_degree=branch.dp * branch.cp, dtype_bytes=space.dtype_bytes,
                          optimizer=space.optimizer, capacity_bytes=cluster.usable_memory_bytes,
                          block_act_bytes=_least_block_act(base, graph), moment_bytes=cluster.optimizer_moment_bytes,
                          master_bytes=cluster.master_weight_bytes, saving_per_param=saving_per_param)


def _least_block_act(base: StageTerms, graph: ModelGraph) -> float:
    """The activations a block of ``base``'s branch keeps at the least: a per-stage recompute mix keeps at
    least its most frugal mode's, and none keeps what only autocast keeps (the weight copies and fp32
    activations of ``base``'s data-parallel kind: ``Part.autocast_act_bytes``) where another ZeRO stage
    or offload of the branch trains through FSDP2's param_dtype."""
    parts = ({base.config.recompute: base.block} if base.recompute_parts is None
             else {m: base.recompute_parts[m] for m in mix_modes(graph)})
    return min(max(0.0, p.act_bytes - p.autocast_act_bytes) for p in parts.values())


def _fits_somehow(caps: list[int], virtual_stages: int, num_blocks: int) -> bool:
    """Whether some split fits memory, given each rank's block capacity (``rank_block_capacity``):
    each rank can hold its v chunks and all ranks together hold L."""
    return min(caps) >= virtual_stages and sum(caps) >= num_blocks


def _capped_lb(terms: StageTerms, caps: list[int], num_blocks: int) -> float:
    """Step-time bound that respects memory: the least max_r t_r when rank r may hold at most
    caps[r] blocks (continuous relaxation, found by bisection) in the step formula, plus the
    average rank's share of the tail (parameter update, hidden-sync contention)."""
    cfg = terms.config
    tau, v, m = terms.block.time_s, cfg.virtual_stages, cfg.num_microbatches
    last = cfg.pp * v - 1
    fixed = [0.0] * cfg.pp
    for c in range(last + 1):
        fixed[c % cfg.pp] += terms.p2p_s * ((c < last) + (c > 0))
    fixed[0] += terms.pre.time_s
    fixed[last % cfg.pp] += terms.post.time_s
    if tau <= 0:
        return 0.0
    lo = _least_max_time(caps, fixed, tau, num_blocks)
    total = tau * num_blocks + sum(fixed)
    # Tail: the slowest rank's update is at least the average rank's (max >= mean).
    params = num_blocks * terms.block.params + terms.pre.params + terms.post.params + terms.tied_params
    per_param = terms.after_sync_s_per_param
    if terms.grad_sync_overlaps:
        per_param += terms.overlap_cost_fraction * terms.grad_sync_s_per_param
    else:
        per_param += terms.grad_sync_s_per_param
    return (m - 1 / v) * lo + total / v + per_param * params / cfg.pp


def _least_max_time(caps: list[int], fixed: list[float], tau: float, num_blocks: int) -> float:
    """The least t with room(t) = sum_r min(cap_r, max(0, (t - f_r) / tau)) >= L, t >= max_r f_r.

    room is piecewise linear and non-decreasing, with breakpoints at f_r (rank r starts taking
    blocks) and f_r + tau cap_r (rank r is full): walk the breakpoints in order, and interpolate
    inside the segment where room reaches L. Exact (it replaced a 40-step bisection)."""
    events = sorted([(f, 1) for f in fixed] + [(f + tau * max(0, c), -1) for c, f in zip(caps, fixed)])
    start = max(fixed)
    slope = 0  # ranks taking blocks at the current t
    t_prev = events[0][0]
    room = 0.0
    for t, d in events:
        gained = room + slope * (t - t_prev) / tau
        if gained >= num_blocks and t > t_prev:
            return max(start, t_prev + (num_blocks - room) * tau / slope)
        room, t_prev = gained, t
        slope += d
    if sum(max(0, c) for c in caps) >= num_blocks:  # L is reached only as the last rank fills (rounding)
        return max(start, t_prev)
    return start + tau * num_blocks  # every rank full below L (no split fits): the bisection's upper end


def _solve(terms: StageTerms, graph: ModelGraph, cluster: Cluster, model_flops: float, tokens: float,
           time_limit_s: float, threshold_s: float = math.inf, caps: list[int] | None = None) -> "Candidate | None | str":
    """The best candidate for this config, None if no split fits memory, or _PRUNED (``caps``:
    its ``rank_block_capacity`` when already known)."""
    cfg = terms.config
    if cfg.recompute == "mixed":  # per-stage recompute
        return _solve_mixed(terms, graph, cluster, model_flops, tokens, time_limit_s, threshold_s)
    if cfg.pp == 1:
        est = evaluate_with_host(terms, [graph.num_blocks], model_flops, tokens, cluster)
        if not est.fits:
            return _HOST_FULL if est.peak_memory_bytes <= est.capacity_bytes else None
        return Candidate(config=cfg, chunk_blocks=(graph.num_blocks,), estimate=est, ilp_status="DIRECT",
                         ilp_objective_s=est.step_time_s, ilp_bound_s=est.step_time_s)
    caps = rank_block_capacity(terms) if caps is None else caps
    if not _fits_somehow(caps, cfg.virtual_stages, graph.num_blocks):
        return None
    host = host_family(terms, cluster.gpus_per_node)
    ilp = SplitILP(terms, graph.num_blocks, host, gpu_caps=caps)
    if host is not None and not _fits_somehow(ilp.caps, cfg.virtual_stages, graph.num_blocks):
        return _HOST_FULL  # the GPUs could hold a split, the nodes' host memory cannot
    if threshold_s < math.inf and _capped_lb(terms, ilp.caps, graph.num_blocks) >= threshold_s:
        return _PRUNED
    sol = None
    if ilp.count_splits() > MAX_ENUMERATED_SPLITS:
        sol = ilp.parametric()  # exact; CP-SAT confirms it only if the config reaches the top K
    if sol is None:
        sol = ilp.solve(time_limit_s)
    if sol.chunk_blocks is None:
        return None
    est = evaluate_with_host(terms, list(sol.chunk_blocks), model_flops, tokens, cluster)
    if not est.fits:  # host offload: the ILP's split overflows host memory (checked here, not in the ILP)
        return _HOST_FULL
    if sol.method == "parametric" and est.step_time_s >= threshold_s:
        return _PRUNED
    return Candidate(config=cfg, chunk_blocks=sol.chunk_blocks, estimate=est, ilp_status=sol.status,
                     ilp_objective_s=sol.objective_s, ilp_bound_s=sol.bound_s, split_method=sol.method)


def _schedule_caps(terms: StageTerms, schedule: tuple[str, int], memo: dict[tuple[str, int], list[int]]) -> list[int]:
    """``rank_block_capacity(terms, schedule)``, kept in ``memo`` (one per set of shared terms)."""
    if schedule not in memo:
        memo[schedule] = rank_block_capacity(terms, schedule)
    return memo[schedule]


def _gpipe_within_1f1b(terms: StageTerms, memo: dict[tuple[str, int], list[int]]) -> bool:
    """Whether GPipe holds no more blocks than 1F1B on any rank of ``terms``'s branch (their memory
    families, ``rank_block_capacity``): then every split GPipe fits 1F1B fits too, at the same step
    time. GPipe's forwards peak before the step's first gradient (StageTerms.loss_free_grads), so
    where gradients outweigh the activations of the micro-batches beyond 1F1B's it can hold more.
    Per-stage recompute mixes price GPipe with its gradients: always within. ``memo``: as
    ``_schedule_caps`` (1F1B's capacities are asked again when its own turn comes)."""
    if terms.recompute_parts is not None:
        return True
    gpipe, one = _schedule_caps(terms, ("gpipe", 1), memo), _schedule_caps(terms, ("1f1b", 1), memo)
    return all(g <= o for g, o in zip(gpipe, one))


def _block_capacity(terms: StageTerms, graph: ModelGraph) -> list[int]:
    """Each rank's most blocks within memory (for a mix: every block under its most frugal mode)."""
    if terms.recompute_parts is None:
        return rank_block_capacity(terms)
    from autopar.search.ilp_recompute import mixed_block_capacity

    return mixed_block_capacity(terms, mix_modes(graph))


def _solve_mixed(terms: StageTerms, graph: ModelGraph, cluster: Cluster, model_flops: float, tokens: float,
                 time_limit_s: float, threshold_s: float) -> "Candidate | None | str":
    """Per-stage recompute: the split and per-rank recompute counts of a "mixed" config (search.ilp_recompute).
    The bound of ``_capped_lb`` holds: every block takes at least the "none" block's time
    (``terms.block``), and no rank holds more than its most frugal mode allows."""
    from autopar.search.ilp_recompute import MixedSplitILP

    cfg = terms.config
    ilp = MixedSplitILP(terms, graph.num_blocks, mix_modes(graph), host_family(terms, cluster.gpus_per_node))
    if not _fits_somehow(ilp.capacity(host=False), cfg.virtual_stages, graph.num_blocks):
        return None
    caps = ilp.capacity()
    if not _fits_somehow(caps, cfg.virtual_stages, graph.num_blocks):
        return _HOST_FULL  # the GPUs could hold a split, the nodes' host memory cannot
    if threshold_s < math.inf and cfg.pp > 1 and _capped_lb(terms, caps, graph.num_blocks) >= threshold_s:
        return _PRUNED
    sol = ilp.solve(time_limit_s)
    if sol.chunk_blocks is None:
        return None
    est = evaluate_with_host(terms, list(sol.chunk_blocks), model_flops, tokens, cluster,
                             recompute_blocks=sol.recompute_blocks)
    if not est.fits:  # host offload: the split overflows host memory
        return _HOST_FULL
    return Candidate(config=cfg, chunk_blocks=sol.chunk_blocks, estimate=est, ilp_status=sol.status,
                     ilp_objective_s=sol.objective_s, ilp_bound_s=sol.bound_s, split_method=sol.method,
                     recompute_blocks=sol.recompute_blocks)


def _refine_with_mixes(top: TopK, graph: ModelGraph, cluster: Cluster, space: SearchSpace, model_flops: float,
                       tokens: float, time_limit_s: float) -> int:
    """Per-stage recompute: each top-K single-mode plan solved again as a per-rank recompute mix of the same
    degrees (same split program, counts per mode); a faster mix joins the top K. Done only when the
    space allows every mode the mix would use (a user's ``--recompute selective`` pins one mode)
    and the search did not already cost mixes everywhere (``--recompute mixed``). Not exhaustive: a
    config outside the single-mode top K whose mix would win is not visited (``--recompute mixed``
    searches every config's mix, about 10x the time); measured on GPT-3 175B at 64 GPUs, the mix
    of the top 5 gave plans 2.5-3.3 % faster for about 0.03-0.1 s per config. Returns how many
    plans were solved again (the plan table says so)."""
    modes = mix_modes(graph)
    if (not space.refine_recompute_mix or "mixed" in space.recompute_modes or len(modes) < 2
            or not set(modes) <= set(space.recompute_modes)):
        return 0
    refined = 0
    for cand in list(top.items):
        c = cand.config
        if cand.recompute_blocks is not None or offload_reason(c.offload, zero=c.zero, recompute="mixed", ep=c.ep):
            continue  # an offload a mix cannot run with (activation offload re-runs no block)
        refined += 1
        terms = build_terms(graph, cluster, replace(cand.config, recompute="mixed"))
        mixed = _solve_mixed(terms, graph, cluster, model_flops, tokens, time_limit_s, cand.step_time_s)
        if isinstance(mixed, Candidate) and mixed.step_time_s < cand.step_time_s and _uses_several(mixed):
            top.offer(mixed)
    return refined


def _uses_several(cand: Candidate) -> bool:
    """Whether a mixed candidate really mixes (a mix of one mode is that mode's plan, already listed)."""
    used = {m for counts in cand.recompute_blocks or () for m, n in enumerate(counts) if n}
    return len(used) > 1


def _confirm_with_cp_sat(cand: Candidate, graph: ModelGraph, cluster: Cluster, model_flops: float, tokens: float,
                         time_limit_s: float) -> Candidate:
    """A top-K candidate whose split the parametric method found, solved again by CP-SAT; the
    better split of the two (they are equal unless CP-SAT stopped at its time limit) is reported
    with CP-SAT's status and bound."""
    if cand.split_method != "parametric" or cand.recompute_blocks is not None:  # a mix's parametric is its own
        return cand
    terms = build_terms(graph, cluster, cand.config)
    sol = solve_split(terms, graph.num_blocks, time_limit_s, method="cp-sat",
                      host=host_family(terms, cluster.gpus_per_node))
    if sol.chunk_blocks is None:  # cannot happen for a feasible program; keep the exact answer
        return cand
    est = evaluate_with_host(terms, list(sol.chunk_blocks), model_flops, tokens, cluster)
    if est.step_time_s <= cand.step_time_s and est.fits:
        return replace(cand, chunk_blocks=sol.chunk_blocks, estimate=est, ilp_status=sol.status,
                       ilp_objective_s=sol.objective_s, ilp_bound_s=sol.bound_s, split_method="cp-sat")
    return replace(cand, ilp_status="OPTIMAL", ilp_bound_s=min(cand.ilp_bound_s, sol.bound_s),
                   split_method="parametric")


def _frugal_offload(space: SearchSpace, cfg: Config, cluster: Cluster) -> Offload:
    """The offload mode allowed for ``cfg`` that leaves the least on the GPU (host offload)."""
    if not cluster.has_host:
        return NO_OFFLOAD
    for label in ("params+activations", "params", "optimizer+activations", "optimizer", "activations"):
        off = Offload.from_label(label)
        if label in space.offload_modes and not offload_reason(off, zero=cfg.zero, recompute=cfg.recompute, ep=cfg.ep):
            return off
    return NO_OFFLOAD


def smallest_memory(graph: ModelGraph, cluster: Cluster, space: SearchSpace) -> tuple[float, Config | None]:
    """The least peak memory of any legal configuration at its most frugal settings (most sharded
    ZeRO, full recompute where allowed, smallest micro-batch, 1F1B, even split): what the
    "nothing fits" advice quotes."""
    zero = max(space.zero_stages)
    if "mixed" in space.recompute_modes:  # per-stage recompute: a mix is at its most frugal all one mode
        space = replace(space, recompute_modes=tuple(m for m in space.recompute_modes if m != "mixed")
                        + tuple(m for m in mix_modes(graph)[-1:] if m not in space.recompute_modes))
    rc = "full" if "full" in space.recompute_modes else space.recompute_modes[-1]
    mb = min(space.micro_batches)
    best: tuple[float, Config | None] = (math.inf, None)
    # Host offload: with offload, recompute none may need less (activation offload runs without recompute).
    rcs = {rc} | ({"none"} & set(space.recompute_modes) if cluster.has_host and not graph.chain else set())
    for cfg in enumerate_configs(graph, space, Counter()):
        if cfg.recompute not in rcs or cfg.micro_batch != mb:
            continue
        if cfg.offload != _frugal_offload(space, cfg, cluster):
            continue
        if cfg.virtual_stages != 1 and space.allows("virtual_stages", 1):
            continue
        if cfg.schedule == "gpipe" and "1f1b" in space.schedules:  # 1F1B keeps fewer in flight
            continue
        if cfg.zero != (zero if cfg.dp * cfg.cp > 1 else 0):
            continue
        terms = build_terms(graph, cluster, cfg)
        even = [e - s for s, e in even_stage_ranges(graph.num_blocks, cfg.pp)]
        peak = evaluate(terms, even, 0.0, 1.0, cluster.peak_flops).peak_memory_bytes
        if peak < best[0]:
            best = (peak, cfg)
    return best
