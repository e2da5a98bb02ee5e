"""Estimate a plan: check it against the model, build the stage terms, cost its split.

``estimate_json`` is the CONTRACT object of ``autopar estimate --json`` (docs/design.md §3): at least
step_time_s, tokens_per_s, mfu, peak_memory_bytes and memory_bytes {params, grads, optimizer,
activations, other} of the peak rank; more keys may be added, none removed.
"""

from __future__ import annotations

from typing import Any

from autopar.cluster import Cluster
from autopar.cost.stage import Config, build_terms, software_recompute_reason
from autopar.cost.step import Estimate, evaluate
from autopar.cost.zero import executed_zero
from autopar.errors import PlanError
from autopar.graph.model_graph import ModelGraph
from autopar.layout import ring_balance_reason
from autopar.plan import DIMENSION_NAMES, Plan


def config_from_plan(plan: Plan, moe_imbalance: float = 1.0) -> Config:
    """The plan as the cost model prices it: as the executor runs it. ZeRO-2 at pp > 1 runs as
    ZeRO-1 (torch.distributed.pipelining defers an FSDP stage's gradient sync; autopar.cost.zero).
    ``moe_imbalance``: the busiest expert-parallel rank's load over the mean (autopar.cost.expert)."""
    par, tr = plan.parallel, plan.training
    return Config(
        dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, cp_kind=par.cp_kind, sequence_parallel=par.sequence_parallel,
        zero=executed_zero(par.zero, par.pp), recompute="mixed" if par.recompute_blocks else par.recompute,
        schedule=par.pp_schedule, virtual_stages=par.pp_virtual_stages,
        micro_batch=tr.micro_batch_size, global_batch=tr.global_batch_size, seq_len=tr.seq_len,
        dtype_bytes=tr.dtype_bytes, optimizer=tr.optimizer, ep=par.ep, moe_imbalance=moe_imbalance,
        offload=par.offload,  # host offload
    )


def check_plan_against_model(plan: Plan, graph: ModelGraph) -> None:
    """Raise PlanError when the plan cannot apply to this model (one line, what to change)."""
    par = plan.parallel
    if plan.model.num_blocks != graph.num_blocks:
        raise PlanError(
            f"the plan is for a model with {plan.model.num_blocks} blocks but {graph.name} has "
            f"{graph.num_blocks}; re-plan for this model"
        )
    reason = graph.tp_allowed(par.tp)
    if reason:
        raise PlanError(f"parallel.tp = {par.tp} is not possible: {reason}")
    if par.recompute_blocks is None and par.recompute != "none" and graph.supports(par.recompute):
        raise PlanError(f"parallel.recompute {par.recompute} is not possible: {graph.supports(par.recompute)}")
    if par.recompute_blocks is not None:  # per-stage recompute
        if graph.chain:
            raise PlanError(f"parallel.recompute_blocks: {graph.name} is a chain of distinct units, not repeated "
                            "blocks; remove recompute_blocks and set parallel.recompute")
        for mode, total in zip(("none", "selective", "full"), map(sum, zip(*par.recompute_blocks))):
            if total and mode != "none" and graph.supports(mode):
                raise PlanError(f"parallel.recompute_blocks has {total} {mode} blocks but {graph.name} cannot run "
                                f"{mode} recompute: {graph.supports(mode)}")
    if par.ep > 1:  # expert parallelism
        from autopar.cost.expert import check_ep

        reason = check_ep(graph, par.ep, par.layout)
        if reason:
            raise PlanError(f"parallel.ep = {par.ep} is not possible: {reason}; plan with ep = 1")
    if par.cp > 1:
        if graph.cp_reason:
            raise PlanError(f"parallel.cp = {par.cp} is not possible: {graph.cp_reason}")
        if par.pp > 1 and graph.supports("cp_pp"):
            raise PlanError(f"parallel.cp = {par.cp} with pp = {par.pp} is not possible: {graph.supports('cp_pp')}")
        if par.cp_kind == "ulysses":
            reason = graph.ulysses_allowed(par.tp, par.cp)
            if reason:
                raise PlanError(f"parallel.cp_kind ulysses is not possible: {reason}")
        reason = ring_balance_reason(par.cp, plan.training.seq_len) if par.cp_kind == "ring" else None
        if reason:
            raise PlanError(reason)
    for dim, used, change in plan.dimensions_used():  # what the search offers, the executor runs
        reason = graph.supports(dim) if used else None
        if reason:
            raise PlanError(f"{DIMENSION_NAMES[dim]} cannot run on {graph.name}: {reason}; {change}")


def estimate_plan(plan: Plan, graph: ModelGraph, cluster: Cluster, moe_imbalance: float = 1.0) -> Estimate:
    """The cost model's prediction for ``plan`` (graph measured at the plan's seq_len)."""
    check_plan_against_model(plan, graph)
    reason = software_recompute_reason(cluster, plan.parallel.recompute)
    if reason and plan.parallel.recompute_blocks is None:
        raise PlanError(f"parallel.recompute {plan.parallel.recompute} is not possible on {cluster.name}: {reason}")
    cfg = config_from_plan(plan, moe_imbalance)
    if graph.chain:
        if cfg.offload.any:  # host offload
            raise PlanError(f"parallel.offload: {graph.name} is a chain of distinct units, which autopar plans "
                            "without offload; remove parallel.offload")
        return _estimate_chain(plan, graph, cluster, cfg)
    terms = build_terms(graph, cluster, cfg)
    chunk_blocks = [end - start for start, end in plan.stage_ranges()]
    tokens = plan.training.global_batch_size * plan.training.seq_len
    flops = graph.model_flops_per_sample() * plan.training.global_batch_size
    est = evaluate(terms, chunk_blocks, flops, tokens, cluster.peak_flops,
                   recompute_blocks=plan.parallel.recompute_blocks)
    if terms.offload is not None:  # host offload: host memory and offload traffic
        from autopar.cost.host import with_host

        est = with_host(terms, est, plan.cluster.gpus_per_node)
    return est


def _estimate_chain(plan: Plan, graph: ModelGraph, cluster: Cluster, cfg: Config) -> Estimate:
    """A chain model's plan (graph.chain): its per-unit terms and its stage ranges (cost/chain.py)."""
    from autopar.cost.chain import build_chain_terms, evaluate_chain

    if cfg.virtual_stages != 1:
        raise PlanError(f"parallel.pp_virtual_stages = {cfg.virtual_stages}: {graph.name} is a chain of distinct units, "
                        "planned with one chunk per pipeline rank; set pp_virtual_stages: 1")
    tokens = plan.training.global_batch_size * plan.training.seq_len
    flops = graph.model_flops_per_sample() * plan.training.global_batch_size
    terms = build_chain_terms(graph, cluster, cfg)
    return evaluate_chain(terms, plan.stage_ranges(), flops, tokens, cluster.peak_flops)


def estimate_json(est: Estimate) -> dict[str, Any]:
    """The ``estimate --json`` object (CONTRACT keys first)."""
    return {
        "step_time_s": est.step_time_s,
        "tokens_per_s": est.tokens_per_s,
        "mfu": est.mfu,
        "peak_memory_bytes": est.peak_memory_bytes,
        "memory_bytes": {k: est.memory_bytes[k] for k in ("params", "grads", "optimizer", "activations", "other")},
        "capacity_bytes": est.capacity_bytes,
        "fits": est.fits,
        "bubble_fraction": est.bubble_fraction,
        "time_breakdown_s": dict(est.time_breakdown_s),
        **({"moe": dict(est.moe)} if est.moe else {}),  # only for expert-parallel plans
        **dict(getattr(est, "host", None) or {}),  # host offload: host_memory_bytes ..., only for offload plans
        "stages": [
            {"rank": r.rank, "num_blocks": r.num_blocks, "microbatch_time_s": r.time_s,
             "peak_memory_bytes": r.peak_bytes, "memory_bytes": dict(r.memory_bytes)}
            for r in est.ranks
        ],
    }
